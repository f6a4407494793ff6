#!/usr/bin/env python
"""Does a training step (mokgen.moe_forward + backward under autograd) synchronize the host with the GPU?

    python tools/sync_check.py SPEC [...]

Runs one warm-up step, then one step under ``torch.cuda.set_sync_debug_mode("error")``: the first synchronizing
call raises with its traceback (printed); no exception means no host sync in the step.
"""
from __future__ import annotations

import sys
import traceback
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import torch  # noqa: E402

import mokgen  # noqa: E402
from mokgen import reference as R  # noqa: E402
from mokgen.spec import load_spec  # noqa: E402


def main(argv=None) -> int:
    names = (sys.argv[1:] if argv is None else argv) or ["kimi-k2"]
    bad = 0
    for name in names:
        spec = load_spec(name)
        moe = mokgen.compile(spec)
        x, idx, tw, w1, w2, b1, b2 = R.random_inputs(spec, spec.tokens, device="cuda", seed=3)
        leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (x, tw, w1, w2, b1, b2)]
        dy = torch.randn(spec.tokens, spec.hidden, device="cuda", dtype=torch.bfloat16)

        def step():
            for t in leaves:
                if t is not None:
                    t.grad = None
            mokgen.moe_forward(leaves[0], idx, leaves[1], leaves[2], leaves[3], leaves[4], leaves[5], moe=moe).backward(dy)

        step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
            print(f"{name}: no host sync in a training step")
        except RuntimeError:
            bad += 1
            print(f"{name}: the step synchronizes:")
            traceback.print_exc(limit=30)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
