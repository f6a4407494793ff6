#!/usr/bin/env python
"""Does the host keep the GPU waiting in a training step? Time forward+backward under autograd eagerly and
replayed from a CUDA graph (the same step captured), alternately, in the same process.

    python tools/graph_vs_eager.py SPEC [...] [--rounds 3] [--json OUT]

A graph replay has no host work between kernels, so (graph ms) is the GPU's own time of the step and
(eager ms - graph ms) what the host costs the eager step. Timing: triton do_bench medians (L2 flushed), rounds
interleaved (eager, graph, eager, graph, ...) so both see the same clock regime.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import torch  # noqa: E402

import mokgen  # noqa: E402
from mokgen import reference as R  # noqa: E402
from mokgen.spec import load_spec  # noqa: E402


def main(argv=None) -> int:
    from triton.testing import do_bench

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("specs", nargs="+")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    out = open(a.json, "a") if a.json else None
    for name in a.specs:
        spec = load_spec(name)
        moe = mokgen.compile(spec)
        x, idx, tw, w1, w2, b1, b2 = R.random_inputs(spec, spec.tokens, device="cuda", seed=5)
        leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (x, tw, w1, w2, b1, b2)]
        dy = torch.randn(spec.tokens, spec.hidden, device="cuda", dtype=torch.bfloat16)

        def step():
            for t in leaves:
                if t is not None:
                    t.grad = None
            y = mokgen.moe_forward(leaves[0], idx, leaves[1], leaves[2], leaves[3], leaves[4], leaves[5], moe=moe)
            y.backward(dy)

        step()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        torch.cuda.synchronize()
        eager, graph = [], []
        for _ in range(a.rounds):
            eager.append(float(do_bench(step, return_mode="median")))
            graph.append(float(do_bench(g.replay, return_mode="median")))
        t0 = time.perf_counter()
        for _ in range(20):
            step()
        host_ms = (time.perf_counter() - t0) / 20 * 1e3   # enqueue time while the GPU runs behind (upper bound)
        torch.cuda.synchronize()
        med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
        rec = dict(spec=name, gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                   eager_ms=med(eager), graph_ms=med(graph), eager_rounds=eager, graph_rounds=graph,
                   host_loop_ms=host_ms, method="triton do_bench median, L2 flushed, rounds interleaved")
        print(f"{name:20s} eager {rec['eager_ms']:.3f} ms  graph {rec['graph_ms']:.3f} ms  "
              f"(eager/graph {rec['eager_ms'] / rec['graph_ms']:.3f}; rounds {[round(v, 3) for v in eager]} / "
              f"{[round(v, 3) for v in graph]}); host loop {host_ms:.3f} ms per step")
        if out:
            out.write(json.dumps(rec) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
