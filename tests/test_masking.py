"""The runtime's masking mode (``CompiledMoE.masked_view``, ``mokgen.moe_forward(..., masked=True)``) on a CPU,
with the reference kernels standing in for libmokgen.so.

Masking mode is transformers' expert-parallel convention: ids >= local experts are masked slots (another rank's
expert). They must give exactly 0 (output and every gradient, their routing weight's included) and raise no
routing error, while negative ids still do, and objects not in masking mode still report every id outside
``[0, local_experts)``."""

import pytest
import torch

import mokgen
from mokgen import reference as ref
from mokgen.ops import CompiledMoE, RoutingError
from mokgen.reference import LayerConfig, rel_err

BM = 16


def cfg_(bias=False, shared=0, layout="concat", activation="swiglu"):
    return LayerConfig(hidden=64, ffn=64, experts=6, topk=3, tokens=32, shared_experts=shared, bias=bias,
                       gate_up_layout=layout, activation=activation)


def emulated(cfg):
    return CompiledMoE(cfg, BM, functions=ref.reference_kernels(cfg, BM, training=True), allow_cpu=True)


def masked_inputs(cfg, T=29, seed=0, frac=0.5, sentinel=None):
    """Random inputs with about ``frac`` of the slots masked: id set to the sentinel (local experts, as
    transformers sends; or any id >= it), weight 0."""
    inp = ref.random_inputs(cfg, tokens=T, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    mask = torch.rand(inp.topk_idx.shape, generator=g) < frac
    E = cfg.local_experts
    sent = torch.full_like(inp.topk_idx, E) if sentinel is None else sentinel(inp.topk_idx)
    idx = torch.where(mask, sent, inp.topk_idx).contiguous()
    w = torch.where(mask, 0.0, inp.topk_weight).contiguous()
    return inp._replace(topk_idx=idx, topk_weight=w), mask


def test_default_mode_still_reports_the_sentinel():
    cfg = cfg_()
    moe = emulated(cfg)
    inp, _ = masked_inputs(cfg)
    moe(inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2)
    with pytest.raises(RoutingError, match=r"outside \[0, 6\)"):
        moe.check_errors()
    with pytest.raises(RoutingError, match=r"outside \[0, 6\)"):
        moe(inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2, check=True)


@pytest.mark.parametrize("sentinel", [None, lambda i: i + 6, lambda i: torch.full_like(i, 2**31 - 1)],
                         ids=["E", "E+id", "int32max"])
@pytest.mark.parametrize("bias,shared,layout,activation", [(False, 0, "concat", "swiglu"),
                                                           (True, 0, "interleaved", "swiglu_oai"),
                                                           (False, 1, "concat", "swiglu")])
def test_masked_slots_give_zero_output_and_no_error(sentinel, bias, shared, layout, activation):
    cfg = cfg_(bias, shared, layout, activation)
    moe = emulated(cfg).masked_view()
    assert moe.masked
    inp, mask = masked_inputs(cfg, sentinel=sentinel)
    assert mask.any() and not mask.all()
    y = moe(inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2, inp.b1, inp.b2, check=True)
    moe.check_errors()
    # the reference drops out-of-range ids: exactly the masked semantics
    want = ref.forward(inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2, cfg, inp.b1, inp.b2)
    assert rel_err(y.float(), want) < 1e-2
    # and the output equals the one of the call without those slots' rows at all: masked slots moved to a
    # valid expert with weight 0 would compute rows (and bias); here they compute nothing
    routed = ref.forward(inp.x, torch.where(mask, -1, inp.topk_idx), inp.topk_weight, inp.w1, inp.w2, cfg,
                         inp.b1, inp.b2)
    assert torch.equal(want, routed)


def test_all_slots_masked_gives_zero():
    cfg = cfg_(bias=True, layout="interleaved", activation="swiglu_oai")
    moe = emulated(cfg).masked_view()
    inp, _ = masked_inputs(cfg, frac=1.1)
    y = moe(inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2, inp.b1, inp.b2, check=True)
    assert torch.count_nonzero(y) == 0


def test_negative_ids_are_still_errors_in_masking_mode():
    cfg = cfg_()
    base = emulated(cfg)
    moe = base.masked_view()
    inp, _ = masked_inputs(cfg)
    idx = inp.topk_idx.clone()
    idx[3, 1] = -2
    with pytest.raises(RoutingError, match=r"1 negative topk_idx value\(s\).*topk_idx\[3, 1\] = -2"):
        moe(inp.x, idx, inp.topk_weight, inp.w1, inp.w2, check=True)
    moe(inp.x, idx, inp.topk_weight, inp.w1, inp.w2)
    with pytest.raises(RoutingError):
        moe.check_errors()
    # the sticky flags are the device's, shared by the object and its view: either one's check reports them
    moe(inp.x, idx, inp.topk_weight, inp.w1, inp.w2)
    with pytest.raises(RoutingError):
        base.check_errors()
    moe.check_errors()   # cleared


def test_training_gradients_of_masked_slots_are_zero():
    cfg = cfg_(bias=True, layout="interleaved", activation="swiglu_oai")
    moe = emulated(cfg)
    inp, mask = masked_inputs(cfg, T=23)
    leaves = [t.detach().clone().requires_grad_(True) for t in (inp.x, inp.topk_weight, inp.w1, inp.w2,
                                                                 inp.b1, inp.b2)]
    x, w, w1, w2, b1, b2 = leaves
    y = mokgen.moe_forward(x, inp.topk_idx, w, w1, w2, b1, b2, moe=moe, masked=True)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    y.backward(dy)
    moe.check_errors()   # nothing reported by the masked call
    assert torch.count_nonzero(w.grad[mask]) == 0
    g = ref.backward(dy, inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2, cfg, inp.b1, inp.b2)
    for name, got, want in zip(ref.Grads._fields, (x.grad, w.grad, w1.grad, w2.grad, b1.grad, b2.grad), g):
        assert rel_err(got.float(), want) < 2e-2, name
    # the same gradients as a call that never had those slots (their ids made negative: the reference
    # drops them too), so masked slots add exactly nothing
    g2 = ref.backward(dy, inp.x, torch.where(mask, -1, inp.topk_idx), inp.topk_weight, inp.w1, inp.w2, cfg,
                      inp.b1, inp.b2)
    for a, b in zip(g, g2):
        assert torch.equal(a, b)


def test_masked_view_is_one_object_with_its_own_registry_id():
    moe = emulated(cfg_())
    v = moe.masked_view()
    assert v is moe.masked_view() and v.masked_view() is v and not moe.masked
    assert v.registry_id != moe.registry_id
    assert v._fns is moe._fns and v._states is moe._states
    moe.close()
    with pytest.raises(RuntimeError, match="no CompiledMoE"):
        mokgen.ops._lookup(v._registry_id)


def test_masked_slots_contribute_nothing_bitwise():
    """Two masked calls that differ only in the masked slots (sentinel value and a nonzero weight there) give
    the same bits: output and every gradient (the masked slots' routing-weight gradients are 0 in both)."""
    cfg = cfg_(bias=True, layout="interleaved", activation="swiglu_oai")
    moe = emulated(cfg)
    inp, mask = masked_inputs(cfg, T=19)
    other_idx = torch.where(mask, 6 + 3, inp.topk_idx).contiguous()
    other_w = torch.where(mask, 0.7, inp.topk_weight).contiguous()
    dy = torch.randn(19, 64, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    outs = []
    for idx, w0 in ((inp.topk_idx, inp.topk_weight), (other_idx, other_w)):
        leaves = [t.detach().clone().requires_grad_(True) for t in (inp.x, w0, inp.w1, inp.w2, inp.b1, inp.b2)]
        y = mokgen.moe_forward(leaves[0], idx, *leaves[1:], moe=moe, masked=True)
        y.backward(dy)
        outs.append([y] + [t.grad for t in leaves])
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert torch.count_nonzero(outs[1][2][mask]) == 0
    moe.check_errors()
