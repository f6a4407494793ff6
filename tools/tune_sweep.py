#!/usr/bin/env python
"""Tune specs and sweep T: the piecewise (tuned) plan against the single-T plan, in the same process (GPU).

    python tools/tune_sweep.py SPEC[,SPEC...] [--tokens 4096,16384] [--budget 4]
        [--sweep 512,1024,2048,4096,8192,16384] [--rounds 3] [--out bench/results/tune-<gpu>.json]

For each spec: ``mokgen.tune.tune`` at ``--tokens`` (the record's ``default_ms`` / ``tuned_ms`` are timed in
that process), then every T of ``--sweep`` times, interleaved round by round: ``single`` (the solver's plan
for the spec's own token count, used at every T: what a compile-time plan does today) and ``piecewise`` (the
tuned record's piece for each T; ``mokgen.driver.PiecewiseMoE``). A spec is a preset name or a YAML path
(e.g. ``tools/specs/h5120-i1536-e160-k8-ep32.yaml``, a shape that is no preset). Records are APPENDED to
``--out``: one per spec with ``spec``, ``default_ms``, ``tuned_ms``, ``tune_s``, candidates compiled / timed,
the chosen plan, and ``sweep`` (per T: single_ms, piecewise_ms, the rounds, the piece).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mokgen import costmodel as C  # noqa: E402
from mokgen import plan as P  # noqa: E402
from mokgen import tune as TU  # noqa: E402
from mokgen.arch import resolve_arch  # noqa: E402
from mokgen.spec import load_spec  # noqa: E402


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def sweep(spec, arch: str, chosen: dict, ts: list[int], rounds: int) -> list[dict]:
    pw = C.PiecewisePlan.from_dict(chosen)
    single = dataclasses.replace(P.solve(spec, arch), backward=None)
    moes = {"single": TU.compile_candidate(spec, arch, single)}
    by_piece = {}
    for piece in pw.pieces:
        p = dataclasses.replace(P.solve(spec, arch, **piece.overrides), backward=None)
        by_piece[(piece.lo, piece.hi)] = TU.compile_candidate(spec, arch, p)
    timer = TU.CudaTimer()
    out = []
    for t in ts:
        inp = TU._inputs_gpu(spec, t)
        piece = pw.piece(t)
        fns = {"single": lambda inp=inp: moes["single"](*inp),
               "piecewise": lambda inp=inp, m=by_piece[(piece.lo, piece.hi)]: m(*inp)}
        got = TU.time_rounds(fns, timer, rounds)
        rec = {"T": t, "single_ms": statistics.median(got["single"]), "piecewise_ms": statistics.median(got["piecewise"]),
               "round_ms": got, "piece": piece.to_dict()}
        print(f"  T={t:6d}: single {rec['single_ms']:.4f} ms, piecewise {rec['piecewise_ms']:.4f} ms "
              f"({rec['single_ms'] / rec['piecewise_ms']:.3f}x)", flush=True)
        out.append(rec)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs")
    ap.add_argument("--tokens", type=_ints, default=[4096, 16384])
    ap.add_argument("--budget", type=float, default=4.0)
    ap.add_argument("--sweep", type=_ints, default=[512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arch")
    ap.add_argument("--out", default=None, help="JSON the results are appended to (default bench/results/"
                    "tune-<gpu>.json: the GPU's own file, bench_forward.default_out)")
    a = ap.parse_args(argv)
    arch = resolve_arch(a.arch)
    if a.out is None:
        import torch

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import bench_forward as BF

        a.out = BF.default_out("tune", torch.device("cuda"))
    for s in a.specs.split(","):
        spec = load_spec(s)
        print(f"== {spec.name}: tune at T = {a.tokens}, budget {a.budget:g} min", flush=True)
        res = TU.tune(spec, arch, a.tokens, budget_min=a.budget)
        print(TU._table(res), flush=True)
        res["sweep"] = sweep(spec, arch, res["chosen"], a.sweep, a.rounds) if a.sweep else []
        TU.append_json(a.out, res)
        print(f"   appended to {a.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
