"""Nsight Compute output of tools/device_ncu.sh -> a table and JSON records (kernel author's tool, any machine).

    python tools/ncu_summary.py RAW_CSV LABELS_TXT [--json OUT] [--run NAME] [--all]

RAW_CSV is ``ncu -i prof.ncu-rep --page raw --csv``, LABELS_TXT the stdout of tools/ncu_profile.py (its
``label ITEM PHASE`` lines name ncu's kernels in order). Prints one row per GEMM kernel (``--all``: every kernel)
with the counters below, where ncu collected them, and appends one record per kernel to OUT (a JSON list).
ncu's numbers are single launches with the clocks left alone: compare bytes, instructions and per-clock
utilisation, not milliseconds.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path

# (column, ncu metric, scale) -- the scale applies to the metrics without a unit conversion below (counts)
METRICS = [
    ("ms", "gpu__time_duration.sum", 1.0),
    ("sm_ghz", "gpc__cycles_elapsed.avg.per_second", 1.0),
    ("tensor_active_pct", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active", 1.0),
    ("dram_read_gb", "dram__bytes_read.sum", 1.0),
    ("dram_write_mb", "dram__bytes_write.sum", 1.0),
    ("l2_to_sm_gb", "l1tex__m_xbar2l1tex_read_bytes.sum", 1.0),
    ("minst", "smsp__inst_executed.sum", 1e-6),
    ("gmma_minst", "smsp__sass_inst_executed_op_shared_gmma.sum", 1e-6),
    ("dram_pct", "dram__throughput.avg.pct_of_peak_sustained_elapsed", 1.0),
    ("occupancy_pct", "sm__warps_active.avg.pct_of_peak_sustained_active", 1.0),
    ("regs", "launch__registers_per_thread", 1.0),
    ("issue_active_pct", "sm__inst_issued.avg.pct_of_peak_sustained_active", 1.0),
    ("smem_bank_conflicts_k", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum", 1e-3),
]
# ncu's raw page picks a unit per column for the values in that report ("us" for short kernels, "ms" for long
# ones; "Mbyte" or "Gbyte"): the columns named with a unit are converted to it (a record's "units" then says that
# unit), so records of different reports compare
UNIT_OF = {"ms": "ms", "sm_ghz": "GHz", "dram_read_gb": "GB", "dram_write_mb": "MB", "l2_to_sm_gb": "GB"}
TO_BASE = {  # unit (lower case) -> (quantity, factor to the base: ms, GHz, bytes)
    "ns": ("time", 1e-6), "us": ("time", 1e-3), "usecond": ("time", 1e-3), "ms": ("time", 1.0),
    "msecond": ("time", 1.0), "s": ("time", 1e3), "second": ("time", 1e3), "nsecond": ("time", 1e-6),
    "hz": ("freq", 1e-9), "khz": ("freq", 1e-6), "mhz": ("freq", 1e-3), "ghz": ("freq", 1.0),
    "byte": ("bytes", 1.0), "kbyte": ("bytes", 1e3), "mbyte": ("bytes", 1e6), "gbyte": ("bytes", 1e9),
    "tbyte": ("bytes", 1e12),
}
TARGET = {"ms": ("time", 1.0), "GHz": ("freq", 1.0), "GB": ("bytes", 1e9), "MB": ("bytes", 1e6)}


def convert(col: str, value: float, unit: str) -> tuple[float, str]:
    """`value` of column `col` in ncu's `unit` -> (value, unit) in the column's own unit (UNIT_OF); columns
    without one keep ncu's value and unit. An unknown unit for a unit column is an error, not a silent mix."""
    want = UNIT_OF.get(col)
    if want is None:
        return value, unit
    got = TO_BASE.get(unit.strip().lower())
    quantity, per = TARGET[want]
    if got is None or got[0] != quantity:
        raise SystemExit(f"ncu_summary: column {col} needs a {quantity} unit, ncu gave {unit!r}")
    return value * got[1] / per, want


# warps stalled per issued instruction, by reason (WarpStateStats): the record's "stalls" dict, the largest first
STALL_PREFIX, STALL_SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"


def load(raw_csv: str | Path, labels_txt: str | Path) -> list[dict]:
    rows = list(csv.reader(open(raw_csv, newline="")))
    hi = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
    hdr, units, data = rows[hi], rows[hi + 1], rows[hi + 2:]
    labels = [line.split(None, 1)[1].strip() for line in open(labels_txt) if line.startswith("label ")]
    if len(labels) != len(data):
        raise SystemExit(f"ncu_summary: {len(data)} kernels in {raw_csv} but {len(labels)} labels in {labels_txt}")
    ix = {h: i for i, h in enumerate(hdr)}
    u = dict(zip(hdr, units))
    out = []
    for label, d in zip(labels, data):
        item, phase = label.rsplit(" ", 1)
        rec = {"item": item, "phase": phase, "kernel": d[ix["Kernel Name"]][:60] if "Kernel Name" in ix else None}
        for col, metric, scale in METRICS:
            if metric in ix and d[ix[metric]].strip():
                try:
                    value = float(d[ix[metric]].replace(",", "")) * scale
                except ValueError:
                    continue
                rec[col], rec.setdefault("units", {})[col] = convert(col, value, u.get(metric, ""))
        stalls = {}
        for h, i in ix.items():
            if (h.startswith(STALL_PREFIX) and h.endswith(STALL_SUFFIX) and d[i].strip()
                    and h != STALL_PREFIX + "selected" + STALL_SUFFIX):   # the issuing warp itself: always 1
                try:
                    v = float(d[i].replace(",", ""))
                except ValueError:
                    continue
                if v >= 0.05:
                    stalls[h[len(STALL_PREFIX):-len(STALL_SUFFIX)]] = round(v, 3)
        if stalls:
            rec["stalls"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1]))
        out.append(rec)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("raw_csv")
    ap.add_argument("labels")
    ap.add_argument("--json", default=None)
    ap.add_argument("--run", default=None, help="a name for this run (commit, date) stored in every record")
    ap.add_argument("--all", action="store_true")
    a = ap.parse_args(argv)
    recs = load(a.raw_csv, a.labels)
    cols = [c for c, _, _ in METRICS if any(c in r for r in recs)] + (["top stalls"] if any("stalls" in r for r in recs) else [])
    w = {c: max(9, len(c) + 1) for c in cols}
    w["top stalls"] = 0
    print(f"{'item':40s} {'phase':16s}" + "".join(f"{c:>{w[c]}s}" if c != "top stalls" else f"  {c}" for c in cols))
    for r in recs:
        if not a.all and not r["phase"].startswith("gemm"):
            continue
        top = " ".join(f"{k}={v:.1f}" for k, v in list(r.get("stalls", {}).items())[:3])
        print(f"{r['item'][:40]:40s} {r['phase'][:16]:16s}" + "".join(
            f"{r.get(c, math.nan):{w[c]}.4g}" for c in cols if c != "top stalls") + (f"  {top}" if top else ""))
    if a.json:
        p = Path(a.json)
        old = json.loads(p.read_text()) if p.exists() else []
        for r in recs:
            r["run"] = a.run
        p.write_text(json.dumps(old + recs, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
