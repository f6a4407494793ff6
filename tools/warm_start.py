#!/usr/bin/env python
"""Warm start: how long ``mokgen.compile`` of a cached spec takes in a fresh process, beyond ``import torch``.

    python tools/warm_start.py [SPEC] [--arch sm_90a] [--set k=v,...] [--runs 9] [--out PATH] [--as-is]

In fresh subprocesses, interleaved, ``--runs`` times each:

* ``torch``: ``import torch`` alone;
* ``warm``: ``import torch, mokgen; mokgen.compile(SPEC, arch=ARCH, overrides=...)`` answered from the warm-start
  index (``mokgen.index``), the entry loaded and verified, its library loaded;
* ``full``: the same with ``MOKGEN_NO_WARM_START=1`` (spec -> plan -> emit -> cache key -> entry: the way before
  the index).

Each run reports the in-process times of ``import torch`` and of the rest (``import mokgen`` + ``compile``), the
process's wall time, and which heavy modules ended up imported (cutlass, sympy, torch._dynamo, jinja2, yaml,
mokgen.plan / emit / build). Medians go to stdout and to ``--out`` (default
``bench/results/warm-start-<host>.json``; records are appended to the JSON list there).

The entry must be in the cache (``mokgen compile SPEC --arch ARCH`` first; a first, untimed call here records it
in the index). By default the subprocesses get a private bytecode cache (``PYTHONPYCACHEPREFIX`` under the
system temp directory, ``PYTHONDONTWRITEBYTECODE`` unset) that an untimed run fills, so that what is timed is
imports as on an installed system rather than recompiling every module; ``--as-is`` keeps the environment as
it is.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
HEAVY = ["cutlass", "sympy", "torch._dynamo", "jinja2", "yaml", "tvm_ffi", "mokgen.plan", "mokgen.emit",
         "mokgen.build"]

_TORCH = r'''
import json, time, sys
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
print(json.dumps({"torch_s": t1 - t0}))
'''

_MOKGEN = r'''
import json, time, sys
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import mokgen
moe = mokgen.compile(%(spec)r, arch=%(arch)r, overrides=%(overrides)r)
t2 = time.perf_counter()
print(json.dumps({"torch_s": t1 - t0, "mokgen_s": t2 - t1, "entry": str(moe.entry_dir),
                  "plan_type": type(moe.plan).__name__,
                  "modules": {m: m in sys.modules for m in %(heavy)r}}))
'''


def _run(code: str, env: dict[str, str]) -> dict[str, Any]:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=_REPO)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"warm_start: a subprocess failed:\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["wall_s"] = wall
    return out


def _git_sha() -> str | None:
    sha = os.environ.get("MOKGEN_GIT_SHA")
    if sha:
        return sha
    try:
        sha = subprocess.run(["git", "-C", str(_REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(_REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except Exception:  # noqa: BLE001 - no git here
        return None


def _med(rows: list[dict[str, Any]], k: str) -> float | None:
    vals = [r[k] for r in rows if k in r]
    return round(statistics.median(vals), 4) if vals else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", nargs="?", default="qwen3-30b-a3b")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--set", default=None, help="plan overrides, k=v,k=v (as mokgen.compile(overrides=...))")
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--out", default=None)
    ap.add_argument("--as-is", action="store_true", help="keep PYTHONDONTWRITEBYTECODE / the bytecode cache as is")
    ap.add_argument("--no-full", action="store_true", help="do not time the full (index-less) path")
    args = ap.parse_args(argv)

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(_REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("MOKGEN_NO_WARM_START", None)
    if not args.as_is:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(Path(tempfile.gettempdir()) / "mokgen-warm-start-pyc")
    full_env = dict(env, MOKGEN_NO_WARM_START="1")
    code = _MOKGEN % dict(spec=args.spec, arch=args.arch, overrides=args.set, heavy=HEAVY)

    # untimed: record the call in the index (full path), fill the bytecode cache
    prime = _run(code, full_env)
    _run(_TORCH, env)
    _run(code, env)
    rows: dict[str, list[dict[str, Any]]] = {"torch": [], "warm": [], "full": []}
    for _ in range(args.runs):
        rows["torch"].append(_run(_TORCH, env))
        rows["warm"].append(_run(code, env))
        if not args.no_full:
            rows["full"].append(_run(code, full_env))

    torch_wall = _med(rows["torch"], "wall_s")
    summary: dict[str, Any] = {}
    for name, rs in rows.items():
        if not rs:
            continue
        s = {"torch_import_s": _med(rs, "torch_s"), "wall_s": _med(rs, "wall_s")}
        if name != "torch":
            s["mokgen_s"] = _med(rs, "mokgen_s")   # import mokgen + mokgen.compile, in process
            s["wall_over_torch_s"] = round(s["wall_s"] - torch_wall, 4) if torch_wall is not None else None
            mods = rs[-1]["modules"]
            s["imported"] = sorted(m for m, v in mods.items() if v)
            s["not_imported"] = sorted(m for m, v in mods.items() if not v)
            s["plan_type"] = rs[-1]["plan_type"]
        summary[name] = s

    host = socket.gethostname().split(".")[0] or "host"
    rec = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": host,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_avg": list(os.getloadavg())},
        "versions": {"mokgen": _git_sha(), "torch": _run("import torch, json; print(json.dumps({'v': torch.__version__}))",
                                                         env)["v"]},
        "spec": args.spec, "arch": args.arch, "overrides": args.set, "entry": prime["entry"],
        "runs": args.runs, "bytecode": "as-is" if args.as_is else "private PYTHONPYCACHEPREFIX, primed",
        "medians": summary,
        "goal": "warm mokgen_s <= 0.05 s (issue 13 point 4)",
    }
    w = summary["warm"]
    print(f"{args.spec} {args.arch}, medians of {args.runs} fresh processes (entry {prime['entry']}):")
    print(f"  import torch alone                  {summary['torch']['torch_import_s']:.3f} s "
          f"(process {summary['torch']['wall_s']:.3f} s)")
    print(f"  warm: import mokgen + compile       {w['mokgen_s']:.3f} s (process {w['wall_s']:.3f} s, "
          f"{w['wall_over_torch_s']:+.3f} s over torch alone)")
    if "full" in summary:
        f = summary["full"]
        print(f"  full path (MOKGEN_NO_WARM_START=1)  {f['mokgen_s']:.3f} s (process {f['wall_s']:.3f} s)")
        print(f"    imported: {', '.join(f['imported'])}")
    print(f"  warm imported: {', '.join(w['imported']) or '-'}; not: {', '.join(w['not_imported'])}")

    out = Path(args.out) if args.out else _REPO / "bench" / "results" / f"warm-start-{host}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(out.read_text()) if out.exists() else []
    data.append(rec)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"record appended to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
