#!/usr/bin/env python
"""Does the host keep the GPU waiting in a training step? Time forward+backward under autograd eagerly and
replayed from a CUDA graph (the same step captured), alternately, in the same process.

    python tools/graph_vs_eager.py SPEC [...] [--rounds 3] [--json OUT] [--graph-kernels] [--profile N] [--profile-out FILE]
                                   [--op-path] [--old-path]

A graph replay has no host work between kernels, so (graph ms) is the GPU's own time of the step and
(eager ms - graph ms) what the host costs the eager step. Not for FP8 / MXFP8 specs: their captured step also
quantizes the weights, once a replay (so a replay never uses stale copies), which the eager
step does only when the weights change (``graph_includes_weight_quant`` in the record); use ``--profile``'s host
times there. Timing: triton do_bench medians (L2 flushed), rounds
interleaved (eager, graph, eager, graph, ...) so both see the same clock regime.

``--graph-kernels``: the kernels one replay runs, with their times (torch.profiler), in the record and printed.
``--profile N``: after the timing, the host's enqueue time of the forward and the backward (``host_fwd_ms``,
``host_bwd_ms``: medians of N steps each started on an idle GPU, beside their GPU time ``synced_step_gpu_ms``), then
N steps under cProfile (each from an idle GPU: the host's Python time per function), the top functions by own
time printed and the whole table appended to ``--profile-out``; ``profile_host_ms`` is the profiled steps' host
time (the profiler's cost included).
``--op-path``: the eager step also through torch.ops.mokgen's custom ops (``mokgen.ops.EAGER_CALLS = False``, what
``moe_forward`` ran outside torch.compile before v36), interleaved with the other timings: ``eager_op_ms``, and with
``--profile`` its host times ``host_fwd_op_ms`` / ``host_bwd_op_ms``. ``--old-path``: also the whole host path before
v36 (the custom ops, and a ``tvm_ffi.use_torch_stream`` context around every launch: ``mokgen.launch.PER_CALL_STREAM
= False``): ``eager_old_ms``, ``host_fwd_old_ms`` / ``host_bwd_old_ms``.
"""
from __future__ import annotations

import argparse
import contextlib
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

sys.path.insert(0, str(_REPO / "tools"))
from step_timeline import _kernels  # noqa: E402  (a profile's CUDA kernels in start order)


def _med(v: list) -> float:
    """The median as the records have always taken it (the upper one of an even count)."""
    return sorted(v)[len(v) // 2]


def main(argv=None) -> int:
    from triton.testing import do_bench

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("specs", nargs="+")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--profile", type=int, default=0, help="eager steps to run under cProfile (0: none)")
    ap.add_argument("--profile-out", default=None, help="file the profiles' tables are appended to")
    ap.add_argument("--profile-top", type=int, default=25, help="functions printed per profile")
    ap.add_argument("--op-path", action="store_true", help="also time the eager step through the custom ops "
                    "(mokgen.ops.EAGER_CALLS = False)")
    ap.add_argument("--old-path", action="store_true", help="also time the eager step through the custom ops with "
                    "a stream context per launch (the host path before v36)")
    ap.add_argument("--graph-kernels", action="store_true", help="list the kernels of one graph replay with their "
                    "times (torch.profiler): what the captured step runs")
    a = ap.parse_args(argv)
    out = open(a.json, "a") if a.json else None
    for name in a.specs:
        spec = load_spec(name)
        moe = mokgen.compile(spec)
        x, idx, tw, w1, w2, b1, b2 = R.random_inputs(spec, spec.tokens, device="cuda", seed=5)
        leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (x, tw, w1, w2, b1, b2)]
        dy = torch.randn(spec.tokens, spec.hidden, device="cuda", dtype=torch.bfloat16)

        def fwd():
            for t in leaves:
                if t is not None:
                    t.grad = None
            return mokgen.moe_forward(leaves[0], idx, leaves[1], leaves[2], leaves[3], leaves[4], leaves[5], moe=moe)

        def step():
            fwd().backward(dy)

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
        eager, graph, via_op, via_old = [], [], [], []
        for _ in range(a.rounds):
            eager.append(float(do_bench(step, return_mode="median")))
            graph.append(float(do_bench(g.replay, return_mode="median")))
            if a.op_path:
                with _op_path():
                    via_op.append(float(do_bench(step, return_mode="median")))
            if a.old_path:
                with _op_path(old=True):
                    via_old.append(float(do_bench(step, return_mode="median")))
        t0 = time.perf_counter()
        for _ in range(20):
            step()
        host_ms = (time.perf_counter() - t0) / 20 * 1e3   # enqueue time while the GPU runs behind (upper bound)
        torch.cuda.synchronize()
        rec = dict(spec=name, gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                   eager_ms=_med(eager), graph_ms=_med(graph), eager_rounds=eager, graph_rounds=graph,
                   host_loop_ms=host_ms, method="triton do_bench median, L2 flushed, rounds interleaved",
                   # FP8 / MXFP8: the weights' quantization is captured too (ops._Fp8Weights keeps nothing from
                   # one capture to the next), so a replay re-quantizes them: graph_ms is then not the eager step's
                   graph_includes_weight_quant=spec.dtype != "bf16")
        if a.graph_kernels:
            rec["graph_kernels_us"] = _graph_kernels(g)
        if a.op_path:
            rec.update(eager_op_ms=_med(via_op), eager_op_rounds=via_op, eager_calls=mokgen.ops.EAGER_CALLS)
            print(f"    through the custom ops: eager {rec['eager_op_ms']:.3f} ms ({[round(v, 3) for v in via_op]})")
        if a.old_path:
            rec.update(eager_old_ms=_med(via_old), eager_old_rounds=via_old)
            print(f"    the host path before v36: eager {rec['eager_old_ms']:.3f} ms ({[round(v, 3) for v in via_old]})")
        if a.profile > 0:
            rec.update(_host_times(fwd, dy, a.profile))
            for on, old, tag in ((a.op_path, False, "_op_ms"), (a.old_path, True, "_old_ms")):
                if on:
                    with _op_path(old=old):
                        rec.update({k.replace("_ms", tag): v for k, v in _host_times(fwd, dy, a.profile).items()})
            rec["profile_host_ms"] = _profile(step, a.profile, name, a.profile_top, a.profile_out)
        print(f"{name:20s} eager {rec['eager_ms']:.3f} ms  graph {rec['graph_ms']:.3f} ms  "
              f"(eager/graph {rec['eager_ms'] / rec['graph_ms']:.3f}; rounds {[round(v, 3) for v in eager]} / "
              f"{[round(v, 3) for v in graph]}); host loop {host_ms:.3f} ms per step")
        if out:
            out.write(json.dumps(rec) + "\n")
            out.flush()
    return 0


@contextlib.contextmanager
def _op_path(old: bool = False):
    """moe_forward through torch.ops.mokgen's custom ops while inside; ``old``: also a tvm-ffi stream context
    around every launch (both: the host path before v36)."""
    from mokgen import launch

    was = mokgen.ops.EAGER_CALLS, launch.PER_CALL_STREAM
    mokgen.ops.EAGER_CALLS = False
    launch.PER_CALL_STREAM = not old
    try:
        yield
    finally:
        mokgen.ops.EAGER_CALLS, launch.PER_CALL_STREAM = was


def _graph_kernels(g) -> list:
    """The kernels of one replay of graph ``g`` in start order, [(name, microseconds)], printed with their sum."""
    from torch.profiler import ProfilerActivity, profile

    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    out = [(name[:80], round(end - start, 1)) for name, start, end in _kernels(prof)]
    print(f"    one graph replay: {len(out)} kernels, {sum(d for _, d in out) / 1000:.3f} ms of kernel time")
    for n, d in out:
        print(f"      {d:9.1f} us  {n[:70]}")
    return out


def _host_times(fwd, dy, n: int) -> dict:
    """The host's enqueue time of the forward and of the backward, each step started on an idle GPU (synchronized
    before it, so no launch waits for a full queue): medians over ``n`` steps, and the GPU time of the same steps
    (CUDA events around forward + backward)."""
    tf, tb, gpu = [], [], []
    for _ in range(n):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        e0.record()
        y = fwd()
        t1 = time.perf_counter()
        y.backward(dy)
        e1.record()
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        tf.append((t1 - t0) * 1e3)
        tb.append((t2 - t1) * 1e3)
        gpu.append(e0.elapsed_time(e1))
    r = dict(host_fwd_ms=_med(tf), host_bwd_ms=_med(tb), synced_step_gpu_ms=_med(gpu))
    print(f"    host enqueue on an idle GPU: forward {r['host_fwd_ms']:.3f} ms, backward {r['host_bwd_ms']:.3f} ms; "
          f"the same steps' GPU time (events, from an idle start) {r['synced_step_gpu_ms']:.3f} ms")
    return r


def _profile(step, n: int, name: str, top: int, out_path: str | None) -> float:
    """``n`` eager steps under cProfile, each from an idle GPU; prints the ``top`` functions by own time, appends
    the whole table to ``out_path``; returns the host time per step (ms) of the profiled steps (cProfile's own cost
    included)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    host = 0.0
    for _ in range(n):
        torch.cuda.synchronize()   # every step from an idle GPU: no launch waits for a full queue
        t0 = time.perf_counter()
        prof.enable()
        step()
        prof.disable()
        host += time.perf_counter() - t0
    host_ms = host / n * 1e3
    torch.cuda.synchronize()
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf).sort_stats("tottime")
    st.print_stats(top)
    print(f"--- {name}: cProfile of {n} eager steps, {host_ms:.3f} ms host time per step (profiler included)")
    print("\n".join(buf.getvalue().splitlines()[-(top + 3):]))
    if out_path:
        full = io.StringIO()
        pstats.Stats(prof, stream=full).sort_stats("tottime").print_stats(80)
        pstats.Stats(prof, stream=full).sort_stats("cumulative").print_stats(60)
        with open(out_path, "a") as f:
            f.write(f"===== {name}: {n} steps, {host_ms:.3f} ms per step\n{full.getvalue()}\n")
    return host_ms


if __name__ == "__main__":
    sys.exit(main())
