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

pytestmark = [pytest.mark.gpu, pytest.mark.ep_kernels]   # skipped where the arch's entries have no ep_* kernels

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


def _train_layers(spec):
    """(EPMoE with the training kernels, the single-GPU layer of the gathered problem with every forward and
    backward GEMM choice of the EP plan pinned)."""
    key = ("train", spec)
    if key not in _LAYERS:
        moe = mokgen.compile(spec)
        p = moe.plan
        layer = ep_ops.EPMoE(spec, p, moe.entry_dir)
        c = R.layer_config(spec)
        pin = {"gemm1_bn": p.gemm1.bn, "gemm2_bn": p.gemm2.bn, "gemm1_consumer": p.gemm1.consumer,
               "gemm2_consumer": p.gemm2.consumer, "gemm1_a_load": p.gemm1.a_load}
        for name in ("dgrad1", "dgrad2", "wgrad1", "wgrad2"):
            pin[f"{name}_bn"] = getattr(p.backward, name).bn
        for name in ("dgrad1", "dgrad2"):
            pin[f"{name}_consumer"] = getattr(p.backward, name).consumer
        gspec = Spec(**{**spec.to_dict(), "name": spec.name + "-g", "ep": 1, "experts": c.ep * c.local_experts,
                        "tokens": spec.tokens * c.ep})
        _LAYERS[key] = (layer, mokgen.compile(gspec, overrides=pin))
    return _LAYERS[key]


@pytest.mark.parametrize("ranks,kw,tokens,routing", CASES)
def test_gpu_ep_training_step_equals_the_gathered_layer(ranks, kw, tokens, routing):
    """forward_train + backward of the simulated ranks against the gathered single-GPU layer's training step: y,
    dx, the router-weight gradient and every routed expert's dW1 / dW2 bit for bit (bias specs: the router
    gradient's <dO, b2> term within float32 rounding); the shared expert's replicas' gradients summed over the
    ranks within bf16 rounding; two runs in other rank orders give the same bits; nothing NaN."""
    spec = _spec(ranks, **kw)
    layer, single = _train_layers(spec)
    c = R.layer_config(spec)
    L, n = c.local_experts, c.ep
    inp = _cuda(_inputs(spec, tokens, seed=ranks + 10, routing=routing))
    x, idx, wt, w1, w2, b1, b2 = inp
    b = {} if b1 is None else dict(b1=b1, b2=b2)
    g = torch.Generator(device="cuda").manual_seed(5)
    dy = [torch.randn(t, c.hidden, generator=g, device="cuda").bfloat16() for t in tokens]
    y, saved = layer.forward_train(x, idx, wt, w1, w2, **b)
    grads = layer.backward(dy, saved, x, w1, w2, **b)
    y2, saved2 = layer.forward_train(x, idx, wt, w1, w2, **b, order=list(reversed(range(n))))
    grads2 = layer.backward(dy, saved2, x, w1, w2, **b, order=list(reversed(range(n))))
    for u, v in zip(grads, grads2):
        for name in ("x", "topk_weight", "w1", "w2", "b1", "b2"):
            a1, a2 = getattr(u, name), getattr(v, name)
            assert (a1 is None and a2 is None) or torch.equal(a1, a2), name
            assert a1 is None or bool(torch.isfinite(a1).all()), name
    cpu = [[t.cpu() if t is not None else None for t in ts] if ts is not None else None for ts in inp]
    gx, gi, gw, W1, W2, B1, B2, cfg = ep.gather_problem(*cpu[:5], spec, cpu[5], cpu[6])
    cu = lambda t: t.cuda().contiguous()   # noqa: E731
    gb = {} if B1 is None else dict(b1=cu(B1.float()), b2=cu(B2.float()))
    ys, sv = single.forward_train(cu(gx), cu(gi.int()), cu(gw.float()), cu(W1), cu(W2), **gb)
    gs = single.backward(torch.cat(dy), sv, cu(gx), cu(gw.float()), cu(W1), cu(W2), **gb)
    assert torch.equal(torch.cat(y), ys)
    assert torch.equal(torch.cat([r.x for r in grads]), gs.x)
    dtw = torch.cat([r.topk_weight for r in grads])
    assert torch.equal(dtw, gs.topk_weight) if B1 is None else torch.allclose(dtw, gs.topk_weight, rtol=1e-4,
                                                                               atol=1e-4)
    for d in range(n):
        assert torch.equal(grads[d].w1[:L], gs.w1[d * L:(d + 1) * L]) and \
            torch.equal(grads[d].w2[:L], gs.w2[d * L:(d + 1) * L]), d
    for name in ("w1", "w2"):
        tot = sum(getattr(grads[d], name)[L].float() for d in range(n))
        assert R.rel_err(tot.double().cpu(), getattr(gs, name)[n * L].double().cpu()) < 2e-2, name
