#!/usr/bin/env python
"""Append a device call's benchmark records to the committed ones, labelled with the call:

    python tools/merge_records.py SRC.json DEST.json --run "2026-12-04 eleventh session, device call 1" [--commit C]

SRC/DEST: JSON lists of records (bench_forward / bench_backward / bench_fp8) or JSON-lines files (step_timeline).
``--commit`` sets ``versions.mokgen`` where the device copy reported a dirty or stale tree (the work tree it ran was
that commit plus uncommitted edits: say so in the label). A DEST named after a GPU (``fp8-h100.json``) takes only
records of that GPU (``mokgen.tunedb.gpu_tag`` of their ``gpu``): records of another one are refused, nothing is
written, and the exit status is 1."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from mokgen.tunedb import gpu_tag  # noqa: E402  (no torch at import)


def load(path: Path) -> tuple[list, bool]:
    text = path.read_text() if path.exists() else ""
    if not text.strip():
        return [], path.suffix == ".jsonl"
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()], True
    return json.loads(text), False


def dest_tag(dest: Path) -> str | None:
    """The GPU tag a per-GPU records file is named with (``fp8-h100.json`` -> ``h100``), or None for a file named
    after no GPU model (e.g. ``warm-start-vm.json``, ``ptx-refactor.json``)."""
    tail = dest.name.split(".")[0].rsplit("-", 1)[-1]
    return tail if re.fullmatch(r"[a-z]+[0-9]+[a-z]*", tail) else None


def foreign_rows(dest: Path, records: list) -> list[str]:
    """The GPU names of `records` that do not belong in `dest` (its tag differs from theirs); [] when dest names
    no GPU or the records name none."""
    tag = dest_tag(dest)
    if tag is None:
        return []
    return [r["gpu"] for r in records if isinstance(r, dict) and isinstance(r.get("gpu"), str)
            and r["gpu"] != "cpu" and gpu_tag(r["gpu"]) != tag]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("src", type=Path)
    ap.add_argument("dest", type=Path)
    ap.add_argument("--run", required=True)
    ap.add_argument("--commit", default=None)
    a = ap.parse_args(argv)
    new, _ = load(a.src)
    old, lines = load(a.dest)
    wrong = foreign_rows(a.dest, new)
    if wrong:
        tag = dest_tag(a.dest)
        theirs = sorted({a.dest.name.replace(f"-{tag}.", f"-{gpu_tag(g)}.") for g in wrong})
        print(f"merge_records: {a.dest.name} is the file of '{tag}' GPUs, but {len(wrong)} of the {len(new)} "
              f"records ran on {sorted(set(wrong))}: merge them into {', '.join(theirs)}; nothing written",
              file=sys.stderr)
        return 1
    for r in new:
        r["run"] = a.run
        if a.commit:
            r.setdefault("versions", {})["mokgen"] = a.commit
    out = old + new
    if lines:
        a.dest.write_text("".join(json.dumps(r) + "\n" for r in out))
    else:
        a.dest.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{a.dest}: {len(old)} + {len(new)} records")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
