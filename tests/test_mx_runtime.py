"""The runtime's MXFP8 path (spec dtype mxfp8, sm_100a) on the CPU, on the reference kernels
(mokgen.reference.reference_kernels: the kernels' argument tables; the quantizers of mokgen/mx_ops.py writing the
bytes the kernels write, the GEMMs computing in float32 from the dequantized packed operands): the reference
quantizers against the emulations of the rendered templates (tests/test_mxfp8.py), the launch sequence, the weights'
MXFP8 copies following in-place updates, forward and a training step against the float64 references on the
dequantized operands (mokgen.reference.forward_mx / backward_mx) and against the BF16 float64 reference. Nothing
here runs on a GPU: no MXFP8 kernel has run on a Blackwell GPU."""
from __future__ import annotations

import pytest
import torch

from mokgen import fp8, mx_ops
from mokgen import reference as R
from mokgen.ops import GATHER_KERNEL, CompiledMoE, kernels_of
from mokgen.plan import solve
from mokgen.spec import load_spec
from test_mxfp8 import boundary_rows, emulate_cols_quantizer, emulate_quantizer

H, I, E, T = 256, 128, 4, 64


def _spec(**changes):
    return load_spec({"name": "mxrt", "hidden": H, "ffn": I, "experts": E, "topk": 2, "tokens": T,
                      "dtype": "mxfp8", "archs": ["sm_100a"], **changes})


def _case(seed=0, bwd_streams=None, wrap=None, **changes):
    spec = _spec(**changes)
    pl = solve(spec, "sm_100a", **({"bwd_streams": bwd_streams} if bwd_streams else {}))
    fns = R.reference_kernels(spec, pl.bm, training=True)
    if wrap is not None:
        fns = {n: (lambda f, n: lambda *a: (wrap.append(n), f(*a))[1])(f, n) for n, f in fns.items()}
    moe = CompiledMoE(spec, pl, functions=fns, allow_cpu=True, arch="sm_100a")
    inp = R.random_inputs(spec, tokens=T, seed=seed)
    return spec, pl, moe, inp


def _args(inp):
    return (inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2, inp.b1, inp.b2)


# ---- the reference quantizers write the bytes the rendered kernels write -------------------------------------


def _routing(spec, pl, inp):
    cap = -(-(T * 2 + E * (pl.bm - 1)) // pl.bm) * pl.bm
    row_src = torch.empty(cap, dtype=torch.int32)
    row_w = torch.empty(cap)
    tile_group = torch.empty(cap // pl.bm, dtype=torch.int32)
    meta = torch.zeros(4, dtype=torch.int32)
    slot_pos = torch.empty(T, 2, dtype=torch.int32)
    R.ref_routing(inp.topk_idx, inp.topk_weight, row_src, row_w, tile_group, meta, slot_pos, local_experts=E,
                  shared_experts=0, bm=pl.bm)
    return row_src, meta


def test_row_quantizers_write_the_emulated_kernel_bytes():
    """quant_mx_gather (x's rows by row_src, padding rows token 0), quant_mx_used (h) and quant_mx_dz (dz) of the
    reference: the used rows' e4m3 bytes and every code byte they own equal the emulation of the rendered template
    (its e8m0 arithmetic on int32 bits and its offset expression); the bytes of the unused rows are not written."""
    from mokgen.sm100.emit import render_quant_mx

    spec, pl, moe, inp = _case()
    fns = R.reference_kernels(spec, pl.bm, training=True)
    row_src, meta = _routing(spec, pl, inp)
    n = int(meta[0]) * pl.bm
    assert 0 < n < row_src.shape[0]
    x = torch.cat([boundary_rows(H), inp.x])[-T:].contiguous()        # binade edges, zeros, saturation
    for kernel, src, K, launch in (
            ("quant_mx_gather", x, H, lambda: mx_ops.quantize_gathered_rows(fns, x, row_src, meta)),
            ("quant_mx_used", None, I, None), ("quant_mx_dz", None, 2 * I, None)):
        text = render_quant_mx(pl, kernel)
        if src is None:
            g = torch.Generator().manual_seed(K)
            src = torch.cat([boundary_rows(K), torch.randn(row_src.shape[0], K, generator=g).bfloat16()])
            src = src[:row_src.shape[0]].contiguous()
            launch = (lambda s, k: lambda: mx_ops.quantize_used_rows(fns, s, meta, kernel=k))(src, kernel)
            rows = src
        else:
            rows = torch.zeros(row_src.shape[0], K, dtype=torch.bfloat16)   # row_src past the used rows: unset
            rows[:n] = src[row_src[:n].long().clamp(min=0)]
        q, sf = launch()
        q_e, sf_e = emulate_quantizer(text, rows)
        assert torch.equal(q[:n], q_e[:n]), kernel
        mine = fp8.mx_sf_offset(torch.arange(n).view(-1, 1), torch.arange(K // 32).view(1, -1), K // 32)
        assert torch.equal(sf[mine], sf_e[mine]), kernel
        # unused rows: untouched (a poisoned buffer keeps its poison)
        q2 = torch.full_like(q, 0x7F)
        sf2 = torch.full_like(sf, 255)
        kw = dict(row_src=row_src) if kernel == "quant_mx_gather" else {}
        fns[kernel](*([src] + list(kw.values()) + [meta, q2, sf2]))
        assert bool((q2[n:] == 0x7F).all()) and int((sf2 != 255).sum()) == n * K // 32, kernel


@pytest.mark.parametrize("layout", ["concat", "interleaved"])
def test_weight_quantizers_write_the_emulated_kernel_bytes(layout):
    """quant_mx_w1 (concat order, codes per (group, part)), quant_mx_w2 and the column forms quant_mx_w1_cols /
    quant_mx_w2_cols of the reference equal the emulated templates byte for byte (tests/test_mxfp8.py: the forward
    quantizer's row map, the column quantizer's formulas)."""
    from mokgen.sm100.emit import render_quant_mx

    spec, pl, moe, inp = _case(gate_up_layout=layout)
    fns = R.reference_kernels(spec, pl.bm, training=True)
    G = spec.experts
    g = torch.Generator().manual_seed(11)
    w1 = (boundary_rows(H)[:1].repeat(G * 2 * I, 1) * torch.rand(G * 2 * I, 1, generator=g)).bfloat16()
    w1 = w1.view(G, 2 * I, H)
    w1[:, :7] = inp.w1[:, :7]
    w2 = torch.cat([boundary_rows(I), inp.w2.reshape(-1, I)])[:G * H].reshape(G, H, I).contiguous()
    # the forward forms
    q1, sf1 = mx_ops.quantize_w(fns, w1, "quant_mx_w1")
    concat = torch.cat([w1[:, 0::2], w1[:, 1::2]], dim=1) if layout == "interleaved" else w1
    qe, sfe = emulate_quantizer(render_quant_mx(pl, "quant_mx_w1"), concat.reshape(G * 2 * I, H))
    assert torch.equal(q1.view(-1, H), qe) and torch.equal(sf1, sfe)
    q2, sf2 = mx_ops.quantize_w(fns, w2, "quant_mx_w2")
    qe, sfe = emulate_quantizer(render_quant_mx(pl, "quant_mx_w2"), w2.reshape(G * H, I))
    assert torch.equal(q2.view(-1, I), qe) and torch.equal(sf2, sfe)
    # the column forms, in the spec's layout
    for kernel, w in (("quant_mx_w1_cols", w1), ("quant_mx_w2_cols", w2)):
        q, sf = mx_ops.quantize_w_cols(fns, w, kernel)
        qe, sfe = emulate_cols_quantizer(render_quant_mx(pl, kernel), w)
        assert torch.equal(q, qe) and torch.equal(sf, sfe), kernel


def test_reference_gemm_reads_the_packed_scales_by_address():
    """The reference GEMMs dequantize with the codes read at mx_sf_offset: a packed buffer read row-major (the
    logical layout) would give other values (so a packing slip in a quantizer would show in the layer tests)."""
    x = boundary_rows(H)[:128].contiguous()
    q, e = fp8.quantize_mx(x)
    sf = fp8.pack_mx_scales(e)
    got = mx_ops.dequantize_rows(q.view(torch.uint8), sf, 128)
    assert torch.equal(got.double(), fp8.dequantize_mx(q, e, out_dtype=torch.float64))
    wrong = q.float() * fp8.mx_scale_values(sf.view(128, -1), torch.float32).repeat_interleave(32, dim=1)
    assert not torch.equal(wrong, got)


# ---- the layer --------------------------------------------------------------------------------------------------


def test_mxfp8_kernel_set_and_launch_sequence():
    spec, pl, moe, inp = _case()
    assert moe.mx and moe.trainable and not moe.gather
    assert set(kernels_of(pl)) == {"routing", "gather", "gemm1", "gemm2", "combine", "quant_mx_gather",
                                   "quant_mx_used", "quant_mx_w1", "quant_mx_w2", "gemm1_train", "dgrad1", "dgrad2",
                                   "wgrad1", "wgrad2", "wgrad1_acc", "wgrad2_acc", "quant_mx_dz", "quant_mx_w2_cols",
                                   "quant_mx_w1_cols"}
    assert len(kernels_of(pl)) == 19   # the training entry mokgen compile --arch sm_100a builds
    assert moe.launch_sequence(training=False) == ("routing", "quant_mx_gather", "gemm1", "quant_mx_used", "gemm2",
                                                   "combine")
    assert moe.launch_sequence() == ("routing", "quant_mx_gather", "gemm1_train", "quant_mx_used", "gemm2", "combine",
                                     "gather_dO", "quant_mx_gather", "dgrad1", "wgrad2", "quant_mx_dz", "dgrad2",
                                     "combine_dx", "gather_x", "wgrad1")


def test_spec_and_plan_dtypes_must_agree():
    spec, pl, *_ = _case()
    bf16 = solve(load_spec({k: v for k, v in spec.to_dict().items() if k != "dtype"}), "sm_100a")
    with pytest.raises(ValueError, match=r"the spec's dtype is 'mxfp8' but the plan's is 'bf16'"):
        CompiledMoE(spec, bf16, functions=R.reference_kernels(spec, pl.bm, training=True), allow_cpu=True)
    with pytest.raises(ValueError, match=r"the spec's dtype is 'bf16' but the plan's is 'mxfp8'"):
        CompiledMoE(bf16.spec, pl, functions=R.reference_kernels(bf16.spec, pl.bm, training=True), allow_cpu=True)


@pytest.mark.parametrize("changes", [{}, {"gate_up_layout": "interleaved", "bias": True},
                                     {"activation": "swiglu_oai", "shared_experts": 1, "experts": 5}])
def test_mxfp8_layer_forward_and_training_step(changes):
    """y and every gradient of the MXFP8 layer (reference kernels) against the float64 references on the
    dequantized MXFP8 operands (forward_mx / backward_mx: rel. err < 1e-2; measured at most 2.4e-3, the outputs'
    bf16 rounding; the router gradient ~1e-7), and against the BF16 float64 reference: rel. err 0.05 .. 0.08 for y,
    dx, the router gradient, dW1 and dW2 (e4m3's 3 mantissa bits; asserted in [0.02, 0.15]: MXFP8 really ran, and
    only at its resolution)."""
    spec, pl, moe, inp = _case(seed=1, **changes)
    a = _args(inp)
    y = moe(*a)
    assert R.rel_err(y.float(), R.forward_mx(*a[:5], spec, b1=a[5], b2=a[6])) < 1e-2
    assert 0.02 < R.rel_err(y.float(), R.forward(*a[:5], spec, b1=a[5], b2=a[6])) < 0.15
    y2, saved = moe.forward_train(*a)
    assert torch.equal(y, y2)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(2)).bfloat16()
    g = moe.backward(dy, saved, inp.x, inp.topk_weight, inp.w1, inp.w2, inp.b1, inp.b2)
    rm = R.backward_mx(dy, *a[:5], spec, b1=a[5], b2=a[6])
    r16 = R.backward(dy, *a[:5], spec, b1=a[5], b2=a[6])
    names = ("x", "topk_weight", "w1", "w2") + (("b1", "b2") if spec.bias else ())
    for name in names:
        got = getattr(g, name).float()
        assert bool(torch.isfinite(got).all()), name
        assert R.rel_err(got, getattr(rm, name)) < 1e-2, name
        if name not in ("b1", "b2"):
            assert 0.02 < R.rel_err(got, getattr(r16, name)) < 0.15, name


def test_mxfp8_weights_follow_in_place_updates():
    calls = []
    spec, pl, moe, inp = _case(seed=5, wrap=calls)
    a = _args(inp)
    y1 = moe(*a)
    assert calls.count("quant_mx_w1") == 1 and calls.count("quant_mx_w2") == 1
    del calls[:]
    assert torch.equal(moe(*a), y1)                      # cached copies: same bits, no weight quantizer launched
    assert not any(c in ("quant_mx_w1", "quant_mx_w2") for c in calls)
    with torch.no_grad():
        inp.w2.mul_(0.5)                                 # what optimizer.step() does: in place, version bumped
    del calls[:]
    y2 = moe(*a)
    assert calls.count("quant_mx_w2") == 1 and "quant_mx_w1" not in calls
    assert not torch.equal(y1, y2)
    assert R.rel_err(y2.float(), R.forward_mx(*a[:5], spec)) < 1e-2
    w2b = inp.w2.clone()                                 # another tensor with the same values: its own copy
    del calls[:]
    assert torch.equal(moe(inp.x, inp.topk_idx, inp.topk_weight, inp.w1, w2b), y2)
    assert calls.count("quant_mx_w2") == 1
    # the backward's column forms: made once, re-made after an in-place update of their weight
    y, saved = moe.forward_train(*a)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(6)).bfloat16()
    del calls[:]
    g1 = moe.backward(dy, saved, inp.x, inp.topk_weight, inp.w1, inp.w2)
    assert calls.count("quant_mx_w1_cols") == 1 and calls.count("quant_mx_w2_cols") == 1
    del calls[:]
    assert torch.equal(moe.backward(dy, saved, inp.x, inp.topk_weight, inp.w1, inp.w2).x, g1.x)
    assert "quant_mx_w1_cols" not in calls and "quant_mx_w2_cols" not in calls
    with torch.no_grad():
        inp.w1.mul_(-1.0)
    del calls[:]
    g2 = moe.backward(dy, saved, inp.x, inp.topk_weight, inp.w1, inp.w2)
    assert calls.count("quant_mx_w1_cols") == 1 and "quant_mx_w2_cols" not in calls
    assert torch.equal(g2.x, -g1.x)   # the dx from dz (saved) and -W1: exactly negated (sign is exact in e4m3)


@pytest.mark.parametrize("streams", [1, 2])
def test_mxfp8_steady_step_launches_the_sequence(streams):
    """A steady training step (the weights' copies made) launches exactly launch_sequence(), forward and
    backward, on one backward stream and on two, with the same gradient bits."""
    calls = []
    spec, pl, moe, inp = _case(seed=7, bwd_streams=streams, wrap=calls)
    assert pl.backward.streams == streams
    a = _args(inp)
    y, saved = moe.forward_train(*a)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(8)).bfloat16()
    moe.backward(dy, saved, inp.x, inp.topk_weight, inp.w1, inp.w2)
    del calls[:]
    y, saved = moe.forward_train(*a)
    g = moe.backward(dy, saved, inp.x, inp.topk_weight, inp.w1, inp.w2)
    kernel = {"gather_dO": GATHER_KERNEL, "gather_x": GATHER_KERNEL, "combine_dx": "combine"}
    assert calls == [kernel.get(ph, ph) for ph in moe.launch_sequence()], calls
    del calls[:]
    moe(*a)
    assert calls == list(moe.launch_sequence(training=False))
    ref = R.backward_mx(dy, *a[:5], spec)
    assert R.rel_err(g.x.float(), ref.x) < 1e-2


def test_mxfp8_autograd_and_main_grad():
    """mokgen.moe_forward on an MXFP8 layer: the autograd op's gradients equal the direct forward_train + backward,
    and main_grad accumulation adds the same (BF16-kernel) weight gradients in fp32."""
    import mokgen

    spec, pl, moe, inp = _case(seed=9)
    x, idx, wt, w1, w2 = inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2
    leaves = [t.clone().requires_grad_(True) for t in (x, wt, w1, w2)]
    y = mokgen.moe_forward(leaves[0], idx, leaves[1], leaves[2], leaves[3], moe=moe)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(10)).bfloat16()
    y.backward(dy)
    y_d, saved = moe.forward_train(x, idx, wt, w1, w2)
    g = moe.backward(dy, saved, x, wt, w1, w2)
    assert torch.equal(y.detach(), y_d)
    for leaf, want in zip(leaves, (g.x, g.topk_weight, g.w1, g.w2)):
        assert torch.equal(leaf.grad, want)
    mg1, mg2 = torch.zeros(w1.shape), torch.zeros(w2.shape)
    w1l, w2l = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)
    mokgen.moe_forward(x, idx, wt, w1l, w2l, moe=moe, w1_main_grad=mg1, w2_main_grad=mg2).backward(dy)
    assert R.rel_err(g.w1.float(), mg1.double()) < 1e-2 and R.rel_err(g.w2.float(), mg2.double()) < 1e-2
