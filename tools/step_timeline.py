#!/usr/bin/env python
"""Where a training step's time goes in the sustained (power-capped) regime: the GPU timeline of a few
forward+backward steps under autograd, taken after the GPU has run the same step for a while.

    python tools/step_timeline.py SPEC[@k=v,...] [...] [--warm-s 3] [--steps 3] [--tokens T] [--forward] [--json OUT]

The H200 of this project throttles to its power cap under sustained GEMM load; a step timed right after a pause
runs at boost clocks and can be 10% faster than the same step in a benchmark's later rounds. This tool first
runs the step back to back for --warm-s seconds, then records --steps steps with torch.profiler and reports, per
step: wall time on the GPU (first kernel start to last kernel end), the sum of kernel times, the idle time
between kernels (gaps > 0), and per kernel its duration (mean over the recorded steps), and the same for torch's
grouped_mm pipeline. One JSON line per spec and implementation. ``--forward`` does the same for the inference
forward alone (no autograd).
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
from mokgen import baselines as B  # noqa: E402
from mokgen import reference as R  # noqa: E402
from mokgen.plan import parse_overrides  # noqa: E402
from mokgen.spec import load_spec  # noqa: E402


def _kernels(prof) -> list:
    evs = [e for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")
           and (e.device_time_total or 0) > 0 and e.time_range.end > e.time_range.start]
    evs.sort(key=lambda e: e.time_range.start)
    return [(e.name, e.time_range.start, e.time_range.end) for e in evs]  # microseconds


def timeline(step, warm_s: float, steps: int, marker) -> dict:
    """Run `step` back to back for warm_s seconds, then profile `steps` more."""
    from torch.profiler import ProfilerActivity, profile

    step()  # the first call may build or load kernels: not part of the warm-up time
    torch.cuda.synchronize()
    t_end = time.time() + warm_s
    n = 0
    while time.time() < t_end:
        step()
        n += 1
        if n % 8 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    ks = _kernels(prof)
    if not ks:
        return dict(error="no kernels recorded")
    wall = (ks[-1][2] - ks[0][1]) / 1000 / steps
    busy = sum(e - s for _, s, e in ks) / 1000 / steps
    gaps = []
    for (n0, _, e0), (n1, s1, _) in zip(ks, ks[1:]):
        if s1 > e0:
            gaps.append((s1 - e0, n0[:40], n1[:40]))
    gaps.sort(reverse=True)
    # the steps launch the same sequence: kernel i of the step is entry i of every step's block
    per_step = len(ks) // steps
    kernels = []
    if per_step * steps == len(ks):
        for i in range(per_step):
            durs = [(ks[j * per_step + i][2] - ks[j * per_step + i][1]) / 1000 for j in range(steps)]
            kernels.append((marker(ks[i][0]), round(sum(durs) / steps, 4), 1))
    return dict(warm_steps=n, wall_ms=round(wall, 4), busy_ms=round(busy, 4),
                idle_ms=round(sum(g for g, _, _ in gaps) / 1000 / steps, 4),
                largest_gaps_us=[(round(g, 1), a, b) for g, a, b in gaps[:8]], kernels_ms=kernels)


# FLOPs of each grouped GEMM in units of 2 * rows * H * I (rows = T * (K + S), the routed and shared rows)
GEMM_UNITS = {"gemm1": 2, "gemm1_train": 2, "gemm2": 1, "dgrad1": 1, "wgrad2": 1, "dgrad2": 2, "wgrad1": 2}
# each backward GEMM and the forward GEMM of the same FLOPs it is held against (issue 19's "twins")
TWINS = {"dgrad1": "gemm2", "wgrad2": "gemm2", "wgrad1": "dgrad2"}


def label_phases(kernels_ms: list, sequence: tuple[str, ...], flop_unit: float) -> tuple[list, dict]:
    """The generated kernels of a recorded step (``kernel_cutlass...`` entries, in launch order) named by the
    runtime's ``launch_sequence``; per GEMM its sustained TFLOP/s; per backward GEMM its rate over its twin's.
    ([], {}) when the counts differ (another kernel order than the one the runtime says)."""
    ours = [(n, ms) for n, ms, _ in kernels_ms if n.startswith("kernel_cutlass")]
    if len(ours) != len(sequence):
        return [], {}
    phases = []
    rate = {}
    for ph, (_, ms) in zip(sequence, ours):
        tf = GEMM_UNITS[ph] * flop_unit / (ms * 1e-3) / 1e12 if ph in GEMM_UNITS and ms > 0 else None
        phases.append((ph, ms, None if tf is None else round(tf, 1)))
        if tf is not None:
            rate[ph] = tf
    twins = {k: round(rate[k] / rate[t], 3) for k, t in TWINS.items() if k in rate and t in rate}
    return phases, twins


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("items", nargs="+")
    ap.add_argument("--warm-s", type=float, default=3.0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=None, help="T for every item (default: each spec's own tokens)")
    ap.add_argument("--json")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--forward", action="store_true", help="the inference forward only (no autograd)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("step_timeline: needs a CUDA GPU", file=sys.stderr)
        return 2
    out = open(a.json, "a") if a.json else None
    for item in a.items:
        name, _, ov = item.partition("@")
        spec = load_spec(name)
        moe = mokgen.compile(spec, overrides=parse_overrides(ov) if ov else None)
        T = a.tokens if a.tokens is not None else spec.tokens
        inp = R.random_inputs(spec, T, device="cuda", seed=7)
        x, idx, tw, w1, w2, b1, b2 = inp
        leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (x, tw, w1, w2, b1, b2)]
        dy = torch.randn(T, spec.hidden, device="cuda", dtype=torch.bfloat16)

        def clear():
            for t in leaves:
                if t is not None:
                    t.grad = None

        if a.forward:
            def ours():
                with torch.no_grad():
                    mokgen.moe_forward(x, idx, tw, w1, w2, b1, b2, moe=moe)

            def theirs():
                with torch.no_grad():
                    B.torch_grouped_mm(x, idx, tw, w1, w2, spec, b1, b2)
        else:
            def ours():
                clear()
                mokgen.moe_forward(leaves[0], idx, leaves[1], leaves[2], leaves[3], leaves[4], leaves[5],
                                   moe=moe).backward(dy)

            def theirs():
                clear()
                B.torch_grouped_mm(leaves[0], idx, leaves[1], leaves[2], leaves[3], spec, leaves[4],
                                   leaves[5]).backward(dy)

        impls = [("mokgen", ours)] + ([] if a.no_torch else [("torch_grouped_mm", theirs)])
        for impl, fn in impls:
            rec = dict(spec=item, impl=impl, mode="forward" if a.forward else "train", tokens=T,
                       gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                       **timeline(fn, a.warm_s, a.steps, lambda n: n[:60]))
            if impl == "mokgen":
                unit = 2.0 * T * (spec.topk + spec.shared_experts) * spec.hidden * spec.ffn
                rec["phases"], rec["twin_ratio"] = label_phases(rec.get("kernels_ms", []),
                                                                moe.launch_sequence(training=not a.forward), unit)
            line = json.dumps(rec)
            if out:
                out.write(line + "\n")
                out.flush()
            print(f"{item:20s} {impl:17s} wall {rec.get('wall_ms')} ms  busy {rec.get('busy_ms')}  idle "
                  f"{rec.get('idle_ms')}  (warm steps {rec.get('warm_steps')})")
            if rec.get("phases"):
                for ph, ms, tf in rec["phases"]:
                    print(f"    {ms:8.4f} ms  {ph:12s}" + ("" if tf is None else f" {tf:6.1f} TFLOP/s"))
                print("    backward GEMM / twin:", ", ".join(f"{k} {v:.3f}" for k, v in rec["twin_ratio"].items()))
            else:
                for k, ms, cnt in rec.get("kernels_ms", []):
                    if ms >= 0.02:
                        print(f"    {ms:8.4f} ms  x{cnt}  {k}")
            print("    largest gaps (us):", rec.get("largest_gaps_us", [])[:5])
    return 0


if __name__ == "__main__":
    sys.exit(main())
