"""Where each generated kernel's warps wait, per SASS instruction (kernel author's tool, no GPU needed).

    python tools/ncu_source.py ncu-source.csv.gz ncu-labels.txt [ITEM/PHASE ...] [--top N] [--json OUT.json]

Reads the source page that ``tools/device_steps.sh``'s ``ncu`` step exports with ``NCU_SOURCE=1`` and
``NCU_ARGS="--section SourceCounters"`` (``ncu --page source --csv --print-source sass``: one block per profiled
kernel, in launch order) and the ``label ITEM PHASE`` lines of ``tools/ncu_step.py`` that name those kernels. For
each kernel asked for (all when none is named, e.g. ``kimi-k2-fp8/gemm1_train``) it prints the warp-state
samples by stall reason (``other``: samples the CSV gives no reason column for, e.g. the wgmma issue's) and the N
instructions holding the most samples, each with its top reasons. ``--json`` writes the same as records.
"""
from __future__ import annotations

import argparse
import csv
import gzip
import json
import sys
from collections import Counter
from pathlib import Path

ALL = "Warp Stall Sampling (All Samples)"


def kernels(csv_path: Path, labels_path: Path) -> list[dict]:
    """The source page's kernel blocks, each {"label": "ITEM/PHASE", "header": [...], "lines": [[...], ...]}."""
    opener = gzip.open if csv_path.suffix == ".gz" else open
    with opener(csv_path, "rt") as f:
        rows = list(csv.reader(f))
    labels = [" ".join(l.split()[1:2]) + "/" + l.split()[2] for l in labels_path.read_text().splitlines()
              if l.startswith("label ")]
    out: list[dict] = []
    for r in rows:
        if r and r[0] == "Kernel Name":
            out.append({"name": r[1], "header": None, "lines": []})
        elif r and r[0] == "Address" and out:
            out[-1]["header"] = r
        elif out and out[-1]["header"] is not None and r:
            out[-1]["lines"].append(r)
    if len(out) != len(labels):
        sys.exit(f"ncu_source: {len(out)} kernels in {csv_path} but {len(labels)} labels in {labels_path}")
    for k, lab in zip(out, labels):
        k["label"] = lab
    return out


def summarize(k: dict, top: int) -> dict:
    ix = {n: i for i, n in enumerate(k["header"])}
    reasons = [n for n in k["header"] if n.startswith("stall_") and "Not Issued" not in n]
    by_reason: Counter = Counter()
    total = 0
    per_line = []
    for n, r in enumerate(k["lines"]):
        s = int(r[ix[ALL]] or 0)
        total += s
        got = {x[len("stall_"):]: int(r[ix[x]] or 0) for x in reasons}
        got["other"] = s - sum(got.values())
        by_reason.update(got)
        per_line.append((s, n, r[ix["Source"]].strip(), int(r[ix["Instructions Executed"]] or 0), got))
    worst = sorted(per_line, key=lambda t: -t[0])[:top]
    return {
        "kernel": k["label"], "samples": total, "sass_lines": len(k["lines"]),
        "stall_pct": {n: round(100 * v / total, 2) for n, v in by_reason.most_common() if v and total},
        "top_lines": [{"line": n, "sass": src, "samples_pct": round(100 * s / total, 2), "executed": ex,
                       "reasons": {a: b for a, b in sorted(got.items(), key=lambda t: -t[1])[:3] if b}}
                      for s, n, src, ex, got in sorted(worst, key=lambda t: t[1])] if total else [],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source_csv", type=Path)
    ap.add_argument("labels", type=Path)
    ap.add_argument("kernels", nargs="*", help="ITEM/PHASE (default: every kernel)")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    ks = kernels(a.source_csv, a.labels)
    if a.kernels:
        unknown = sorted(set(a.kernels) - {k["label"] for k in ks})
        if unknown:
            sys.exit(f"ncu_source: no kernel {', '.join(unknown)}; known: {', '.join(k['label'] for k in ks)}")
        ks = [k for k in ks if k["label"] in a.kernels]
    out = [summarize(k, a.top) for k in ks]
    for s in out:
        print(f"{s['kernel']}: {s['samples']} samples over {s['sass_lines']} SASS lines; "
              + ", ".join(f"{n} {v}%" for n, v in list(s["stall_pct"].items())[:8]))
        for t in s["top_lines"]:
            why = " ".join(f"{n}={v}" for n, v in t["reasons"].items())
            print(f"  {t['line']:5d} {t['samples_pct']:5.1f}%  x{t['executed']:<9d} {t['sass'][:64]:64s} {why}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
