#!/usr/bin/env python
"""Does the host keep the GPU waiting? (kernel author's tool, GPU.) For each SPEC, times mokgen's forward the way
tools/bench_forward.py does (``triton.testing.do_bench``, L2 flushed before every call) called eagerly and
replayed from a CUDA graph, plus the host time of one eager call (enqueue only). If the eager median exceeds
the graph median by more than the launch latencies, the GPU idled on the host within the timed region.

    python tools/host_overhead.py [SPEC ...] [--json OUT]     (default: kimi-k2 deepseek-v4-pro glm-5)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import mokgen  # noqa: E402
from bench_forward import make_inputs, resolve_spec  # noqa: E402


def main(argv=None) -> int:
    from triton.testing import do_bench

    ap = argparse.ArgumentParser()
    ap.add_argument("specs", nargs="*", default=["kimi-k2", "deepseek-v4-pro", "glm-5"])
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    out = []
    with torch.no_grad():
        for name in a.specs:
            spec = resolve_spec(name)
            moe = mokgen.compile(spec)
            i = make_inputs(spec, torch.device("cuda"))
            args = (i["x"], i["topk_idx"], i["topk_weight"], i["w1"], i["w2"], i["b1"], i["b2"])
            y = torch.empty_like(i["x"])

            def fn():
                return moe(*args, out=y)

            fn()
            torch.cuda.synchronize()
            host = []
            for _ in range(20):  # a few calls at a time: the queue never fills, so this is the host's own cost
                t0 = time.perf_counter()
                for _ in range(5):
                    fn()
                host.append((time.perf_counter() - t0) / 5 * 1e6)
                torch.cuda.synchronize()
            host.sort()
            eager = do_bench(fn, warmup=25, rep=100, return_mode="median")
            y_eager = y.clone()
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fn()
                with torch.cuda.graph(g, stream=s):
                    fn()
            torch.cuda.current_stream().wait_stream(s)
            g.replay()
            torch.cuda.synchronize()
            same = bool(torch.equal(y.view(torch.int16), y_eager.view(torch.int16)))
            graph = do_bench(g.replay, warmup=25, rep=100, return_mode="median")
            eager2 = do_bench(fn, warmup=25, rep=100, return_mode="median")  # again, after the graph
            r = dict(spec=spec.name, host_us_per_call=host[len(host) // 2], eager_ms=eager, graph_ms=graph,
                     eager_again_ms=eager2, graph_same_bits=same, mokgen=os.environ.get("MOKGEN_GIT_SHA"))
            print(json.dumps(r), flush=True)
            out.append(r)
            del moe, g
            torch.cuda.empty_cache()
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
