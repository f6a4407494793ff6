#!/usr/bin/env python
"""Append a device call's benchmark records to the committed ones, labelled with the call:

    python tools/merge_records.py SRC.json DEST.json --run "2026-12-04 eleventh session, device call 1" [--commit C]

SRC/DEST: JSON lists of records (bench_forward / bench_backward / bench_fp8) or JSON-lines files (step_timeline).
``--commit`` sets ``versions.mokgen`` where the device copy reported a dirty or stale tree (the work tree it ran was
that commit plus uncommitted edits: say so in the label)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(path: Path) -> tuple[list, bool]:
    text = path.read_text() if path.exists() else ""
    if not text.strip():
        return [], path.suffix == ".jsonl"
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()], True
    return json.loads(text), False


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("src", type=Path)
    ap.add_argument("dest", type=Path)
    ap.add_argument("--run", required=True)
    ap.add_argument("--commit", default=None)
    a = ap.parse_args()
    new, _ = load(a.src)
    old, lines = load(a.dest)
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
