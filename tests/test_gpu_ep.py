"""Expert parallelism (issue 22) on one GPU: the EP forward of R = 2, 3, 4 simulated ranks (mokgen/ep_ops.py) with
the compiled kernels (ep_routing, ep_dispatch, ep_push from templates/sm90/ep_*.py.j2; the single-GPU gemm1, gemm2,
combine), against the single-GPU layer compiled for the gathered problem (the same GEMM choices pinned): the same
bits; against the float64 reference: bf16 rounding; two runs and other rank orders: the same bits. Skewed routing
(every slot on rank 0's experts), ranks with zero tokens, T = 1, shared experts, biases. Not run on the CPU
machines (tests/test_ep_ops.py runs the same protocol there on the reference kernels)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("mokgen") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mokgen  # noqa: E402
from mokgen import ep, ep_ops  # noqa: E402
from mokgen import reference as R  # noqa: E402
from mokgen.spec import Spec  # noqa: E402

from test_ep import _inputs  # noqa: E402

pytestmark = pytest.mark.gpu

_LAYERS: dict = {}


def _spec(ranks, **kw):
    base = dict(name=f"ep{ranks}-gpu", hidden=256, ffn=128, experts=2 * ranks, topk=2, ep=ranks, tokens=64,
                shared_experts=1)
    base.update(kw)
    if kw:
        base["name"] += "-" + "-".join(f"{k[:4]}{v}" for k, v in sorted(kw.items()))
    return Spec(**base)


def _layers(spec):
    """(EPMoE on the compiled entry of spec, the single-GPU layer of the gathered problem with the EP plan's GEMM
    choices, its layer config)."""
    if spec not in _LAYERS:
        moe = mokgen.compile(spec)
        p = moe.plan
        layer = ep_ops.EPMoE(spec, p, moe.entry_dir)
        c = R.layer_config(spec)
        pin = {"gemm1_bn": p.gemm1.bn, "gemm2_bn": p.gemm2.bn, "gemm1_consumer": p.gemm1.consumer,
               "gemm2_consumer": p.gemm2.consumer, "gemm1_a_load": p.gemm1.a_load}
        gspec = Spec(**{**spec.to_dict(), "name": spec.name + "-g", "ep": 1, "experts": c.ep * c.local_experts,
                        "tokens": spec.tokens * c.ep})
        _LAYERS[spec] = (layer, mokgen.compile(gspec, overrides=pin))
    return _LAYERS[spec]


def _cuda(inp):
    x, idx, wt, w1, w2, b1, b2 = inp
    cu = lambda ts, dt=None: [t.to("cuda", dt).contiguous() for t in ts] if ts is not None else None  # noqa: E731
    return cu(x), cu(idx, torch.int32), cu(wt, torch.float32), cu(w1), cu(w2), cu(b1, torch.float32), \
        cu(b2, torch.float32)


CASES = [
    (2, {}, [64, 64], "random"),
    (2, {}, [1, 0], "random"),
    (3, {}, [40, 0, 17], "random"),
    (3, {}, [64, 64, 64], "one_rank"),
    (4, {}, [64, 1, 0, 33], "random"),
    (4, {}, [64, 64, 64, 64], "one_rank"),
    (4, dict(bias=True, activation="swiglu_oai", gate_up_layout="interleaved"), [20, 64, 3, 9], "random"),
]


@pytest.mark.parametrize("ranks,kw,tokens,routing", CASES)
def test_gpu_ep_equals_the_gathered_layer_bitwise(ranks, kw, tokens, routing):
    spec = _spec(ranks, **kw)
    layer, single = _layers(spec)
    inp = _cuda(_inputs(spec, tokens, seed=ranks, routing=routing))
    x, idx, wt, w1, w2, b1, b2 = inp
    b = {} if b1 is None else dict(b1=b1, b2=b2)
    y = layer(x, idx, wt, w1, w2, **b, check=True)
    assert [t.shape[0] for t in y] == tokens
    again = layer(x, idx, wt, w1, w2, **b)
    assert all(torch.equal(u, v) for u, v in zip(y, again))                    # run to run
    back = layer(x, idx, wt, w1, w2, **b, order=list(reversed(range(ranks))))
    assert all(torch.equal(u, v) for u, v in zip(y, back))                     # rank order
    cpu = [[t.cpu() if t is not None else None for t in ts] if ts is not None else None for ts in inp]
    gx, gi, gw, W1, W2, B1, B2, cfg = ep.gather_problem(*cpu[:5], spec, cpu[5], cpu[6])
    gb = {} if B1 is None else dict(b1=B1.float().cuda().contiguous(), b2=B2.float().cuda().contiguous())
    y_single = single(gx.cuda().contiguous(), gi.int().cuda().contiguous(), gw.float().cuda().contiguous(),
                      W1.cuda().contiguous(), W2.cuda().contiguous(), **gb)
    assert torch.equal(torch.cat(y), y_single)
    y64 = R.forward(gx, gi, gw, W1, W2, cfg, B1, B2)
    assert R.rel_err(torch.cat(y).cpu().double(), y64) < 1e-2


def test_gpu_ep_poisoned_buffers_are_overwritten():
    """Outputs written in full: y poisoned by a previous call's NaNs in the caching allocator does not leak."""
    spec = _spec(2)
    layer, _ = _layers(spec)
    junk = torch.full((1 << 20,), float("nan"), device="cuda")
    del junk
    x, idx, wt, w1, w2, _, _ = _cuda(_inputs(spec, [64, 5], seed=9))
    y = layer(x, idx, wt, w1, w2)
    assert all(bool(torch.isfinite(t).all()) for t in y)
