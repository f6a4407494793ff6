"""Hardware counters of one training step's generated kernels (kernel author's tool, GPU + Nsight Compute).

    ncu --clock-control none --profile-from-start off --kernel-name regex:kernel_cutlass \\
        --section SpeedOfLight ... -o OUT python tools/ncu_step.py SPEC[@k=v,...] [--tokens T]

Runs one forward_train + backward of SPEC once outside the profiled range (build, load, warm-up), then once inside
``cudaProfilerStart/Stop``, so ncu sees each generated kernel of the step exactly once; stdout's ``label SPEC
PHASE`` lines name them in launch order (routing, [gather], gemm1_train, gemm2, combine, gather_dO, dgrad1,
wgrad2, dgrad2, combine_dx, gather_x, wgrad1), which is how tools/ncu_summary.py maps ncu's rows to phases.
Compare counters that do not depend on the clock (bytes, instructions, tensor-pipe activity per cycle); ncu's
durations are single launches.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import torch  # noqa: E402

import mokgen  # noqa: E402
from mokgen import reference as R  # noqa: E402
from mokgen.plan import parse_overrides  # noqa: E402
from mokgen.spec import load_spec  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("items", nargs="+", help="SPEC[@k=v,...]")
    ap.add_argument("--tokens", type=int, default=None)
    a = ap.parse_args(argv)
    cudart = torch.cuda.cudart()
    for item in a.items:
        name, _, ov = item.partition("@")
        spec = load_spec(name)
        moe = mokgen.compile(spec, overrides=parse_overrides(ov) if ov else None)
        T = a.tokens or spec.tokens
        inp = R.random_inputs(spec, T, device="cuda", seed=7)
        dy = torch.randn(T, spec.hidden, device="cuda", dtype=torch.bfloat16)

        def step():
            y, saved = moe.forward_train(inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2, inp.b1, inp.b2)
            return moe.backward(dy, saved, inp.x, inp.topk_weight, inp.w1, inp.w2, inp.b1, inp.b2)

        step()
        torch.cuda.synchronize()
        cudart.cudaProfilerStart()
        step()
        torch.cuda.synchronize()
        cudart.cudaProfilerStop()
        for ph in moe.launch_sequence(training=True):
            print(f"label {item} {ph}", flush=True)
        del inp, dy
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
