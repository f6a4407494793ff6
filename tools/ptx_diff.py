#!/usr/bin/env python
"""Compile two trees of emitted kernel sources to PTX and say which kernels changed (CPU, needs the CuTe DSL).

    python tools/ptx_diff.py OLD_DIR NEW_DIR [--kernels gemm1,gemm2,...] [--jobs 2] [--json OUT]

OLD_DIR and NEW_DIR hold one sub-directory per variant (e.g. ``kimi-k2/``) of emitted ``<kernel>.py`` files, as
``Sources.write`` leaves them (emit them from two commits, or keep a copy of ``generated/`` before a template
change). Every kernel present in both is compiled for sm_90a; the PTX is compared after dropping comments, blank
lines and the module-derived symbol prefix. "same" means the refactor cannot have changed what the GPU runs:
same instructions, same order, so the same bits and the same speed.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]


def _ptx(src: Path, out_dir: Path) -> str:
    name = src.stem
    out_dir.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "mokgen.build", "compile-one", str(src), str(out_dir / f"{name}.o"),
                        "--arch", "sm_90a", "--name", name], cwd=str(_REPO), capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{src}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
    return (out_dir / f"{name}.ptx").read_text(errors="replace")


def normalize(ptx: str) -> list[str]:
    lines = []
    for line in ptx.splitlines():
        s = line.strip()
        if not s or s.startswith("//"):
            continue
        lines.append(re.sub(r"mokgen_kernel_[A-Za-z0-9_]*", "", s))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--kernels", default="", help="comma-separated kernel names (default: every common one)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    old, new = Path(a.old), Path(a.new)
    want = {k for k in a.kernels.split(",") if k}
    pairs = []
    for vd in sorted(p for p in old.iterdir() if p.is_dir()):
        for f in sorted(vd.glob("*.py")):
            g = new / vd.name / f.name
            if g.is_file() and (not want or f.stem in want):
                pairs.append((vd.name, f, g))
    tmp = Path(tempfile.mkdtemp(prefix="ptx_diff."))
    results = {}
    with cf.ThreadPoolExecutor(max_workers=max(1, a.jobs)) as ex:
        futs = {ex.submit(lambda v, f, g: (normalize(_ptx(f, tmp / "old" / v)), normalize(_ptx(g, tmp / "new" / v))),
                          v, f, g): (v, f.stem) for v, f, g in pairs}
        for fut in cf.as_completed(futs):
            v, k = futs[fut]
            try:
                po, pn = fut.result()
                same = po == pn
                results[f"{v}/{k}"] = dict(same=same, lines_old=len(po), lines_new=len(pn),
                                           differing=0 if same else sum(x != y for x, y in zip(po, pn)) + abs(len(po) - len(pn)))
            except Exception as e:  # noqa: BLE001
                results[f"{v}/{k}"] = dict(error=str(e)[:300])
            r = results[f"{v}/{k}"]
            print(f"{v}/{k}: " + ("error " + r["error"] if "error" in r else ("same" if r["same"] else
                  f"DIFFERENT ({r['differing']} of {r['lines_old']} lines)")), flush=True)
    n_same = sum(1 for r in results.values() if r.get("same"))
    print(f"{n_same} of {len(results)} kernels compile to the same PTX")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(old=str(old), new=str(new), results=results), indent=1, sort_keys=True))
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
