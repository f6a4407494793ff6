"""MXFP8 weight gradients on sm_100a (issue 20; plan ``wgrad1_dtype`` / ``wgrad2_dtype`` = "mxfp8", dtype mxfp8
specs, opt-in): the plan knob and its refusals, the rendered kernels (templates/sm100/wgrad.py.j2's MX form, the
row-space column quantizers of templates/sm100/quant_mx.py.j2), the quantizers' arithmetic emulated from the
rendered template against mokgen.fp8.quantize_mx bit for bit, the block-scaled product read from the packed bytes
the way the MMA reads them, a training step on the CPU reference kernels (dW against the float64 product of the
bytes the quantizers wrote, against the BF16 weight gradients; dx and the router gradient unchanged; empty experts,
T = 1, odd counts, 32-row blocks at group edges), and (slow) the kernels compiled for sm_100a with their PTX
checked. Nothing here runs on a GPU: no MXFP8 weight gradient has run on a Blackwell GPU."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from mokgen import fp8, kernels, mx_ops
from mokgen import reference as R
from mokgen.ops import GATHER_KERNEL, CompiledMoE, kernels_of
from mokgen.plan import PlanError, solve
from mokgen.spec import load_spec
from test_mxfp8 import (MX_KERNELS, MX_TRAIN, _desc_base, _template_expr, boundary_rows, emulated_block_scaled_gemm,
                        kernel_e8m0)

H, I, E, T = 256, 128, 4, 64
BOTH = {"wgrad1_dtype": "mxfp8", "wgrad2_dtype": "mxfp8"}
WGRAD_Q = ("quant_mx_cols_gather", "quant_mx_dz_cols", "quant_mx_sa_cols")


def _spec(**changes):
    return load_spec({"name": "mxwg", "hidden": H, "ffn": I, "experts": E, "topk": 2, "tokens": T,
                      "dtype": "mxfp8", "archs": ["sm_100a"], **changes})


# ---- the plan knob -------------------------------------------------------------------------------------------


def test_default_is_bf16_and_the_knob_opts_in():
    """BF16 weight gradients stay the default (nothing of the MXFP8 form has run on a GPU); wgrad*_dtype=mxfp8 gives
    the weight gradient e4m3 operands, 128 x 128 tiles, K step 128 (whole scale atoms), stages within the budget;
    the kernel set gains the column quantizers it needs and, with both in MXFP8 and no bias, loses the bf16 gather."""
    from mokgen.sm100.rules import kernel_tiles

    spec = _spec()
    default = solve(spec, "sm_100a")
    assert kernels.mx_wgrads(default) == () and default.backward.wgrad1.elem_bytes == 2
    assert set(kernels_of(default)) == set(MX_KERNELS + MX_TRAIN)
    assert solve(spec, "sm_100a", wgrad1_dtype="bf16", wgrad2_dtype="bf16") == default
    both = solve(spec, "sm_100a", **BOTH)
    assert kernels.mx_wgrads(both) == ("wgrad1", "wgrad2")
    tiles = kernel_tiles(both)
    for name in ("wgrad1", "wgrad2"):
        g = getattr(both.backward, name)
        assert (g.elem_bytes, g.bn, g.bk) == (1, 128, 128) and g.stages >= 2, name
        t = tiles[name]
        assert t.mx and t.stages == g.stages and not t.problems(232448), (name, t.problems(232448))
        assert any(n.startswith(f"overrides: wgrad{name[-1]}_dtype=mxfp8") for n in both.notes)
    # the forward and the dgrads are the default plan's
    assert (both.gemm1, both.gemm2, both.backward.dgrad1, both.backward.dgrad2) == \
        (default.gemm1, default.gemm2, default.backward.dgrad1, default.backward.dgrad2)
    assert set(kernels_of(both)) == (set(MX_KERNELS + MX_TRAIN) - {"gather"}) | set(WGRAD_Q)
    one = solve(spec, "sm_100a", wgrad1_dtype="mxfp8")
    assert kernels.mx_wgrads(one) == ("wgrad1",)
    assert set(kernels_of(one)) == set(MX_KERNELS + MX_TRAIN) | {"quant_mx_dz_cols", "quant_mx_cols_gather"}
    two = solve(spec, "sm_100a", wgrad2_dtype="mxfp8")
    assert set(kernels_of(two)) == set(MX_KERNELS + MX_TRAIN) | {"quant_mx_sa_cols", "quant_mx_cols_gather"}
    # plan --explain says which form each backward GEMM runs
    from mokgen.plan import explain

    text = explain(both)
    assert text.count("block-scaled tcgen05 MMA (wgrad*_dtype=mxfp8)") == 2
    assert "block-scaled tcgen05 MMA (wgrad*_dtype=mxfp8)" not in explain(one).split("wgrad2  ")[1].split("\n")[0]
    assert "wgrad*_dtype" not in explain(default) and "FP8 e4m3 (A per 1x128" not in explain(default)
    # a bias keeps the gather (db2 sums the bf16 dO rows)
    assert GATHER_KERNEL in kernels_of(solve(_spec(bias=True), "sm_100a", **BOTH))


@pytest.mark.parametrize("spec,arch,overrides,key,message", [
    ("mx", "sm_100a", {"wgrad1_dtype": "fp8"}, "wgrad1_dtype", "blockwise FP8 weight gradients are sm_90a's"),
    ("mx", "sm_100a", {"wgrad2_dtype": "e5m2"}, "wgrad2_dtype", "one of bf16, mxfp8, got 'e5m2'"),
    ("bf16", "sm_100a", {"wgrad1_dtype": "mxfp8"}, "wgrad1_dtype", "a choice of dtype mxfp8 specs, this one is bf16"),
    ("fp8", "sm_90a", {"wgrad1_dtype": "mxfp8"}, "wgrad1_dtype", "must be one of bf16, fp8, got 'mxfp8'"),
    ("mx", "sm_100a", {"wgrad1_dtype": "mxfp8", "wgrad1_bn": 256}, "wgrad1_bn", "take the default tiles only"),
])
def test_refusals(spec, arch, overrides, key, message):
    """What the knob refuses, in one line naming the override."""
    s = {"mx": _spec(), "bf16": load_spec({"name": "b", "hidden": H, "ffn": I, "experts": E, "topk": 2, "tokens": T}),
         "fp8": load_spec({"name": "f", "hidden": H, "ffn": I, "experts": E, "topk": 2, "tokens": T, "dtype": "fp8"})}[spec]
    with pytest.raises(PlanError) as e:
        solve(s, arch, **overrides)
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"plan.{key}: ") and message in text, text


def test_emit_refusals():
    from mokgen.emit_base import EmitError
    from mokgen.sm100.emit import render_wgrad

    bf16 = solve(load_spec({"name": "b", "hidden": H, "ffn": I, "experts": E, "topk": 2, "tokens": T}), "sm_100a")
    with pytest.raises(EmitError, match=r"^plan\.backward\.wgrad1: the MXFP8 weight gradient .* dtype mxfp8 specs, "
                                        r"got 'bf16'$"):
        render_wgrad(bf16, "wgrad1", mx=True, bn=128, bk=128)
    with pytest.raises(EmitError, match=r"^plan\.backward\.wgrad2\.bn: the MXFP8 GEMMs take 128 columns"):
        render_wgrad(solve(_spec(), "sm_100a"), "wgrad2", mx=True, bn=256, bk=128)


# ---- the rendered kernels --------------------------------------------------------------------------------------


def test_render():
    """The opt-in plan renders wgrad1 / wgrad2 (and their fp32 main_grad forms) in the MX form (table wgrad*_mx:
    e4m3 bytes and packed codes; the block-scaled tiled MMA with both operands MN-major; the scale atoms loaded,
    copied to TMEM, set on the MMA) and the three column quantizers; the default plan's wgrads have none of it."""
    from mokgen.emit import emit

    default, both = emit(solve(_spec(), "sm_100a")).files, emit(solve(_spec(), "sm_100a", **BOTH)).files
    assert set(both) - set(default) == {f"{k}.py" for k in WGRAD_Q} and set(default) - set(both) == {"gather.py"}
    for k, m_out, n_out in (("wgrad1", 2 * I, H), ("wgrad2", H, I)):
        for name in (k, k + "_acc"):
            d, m = default[f"{name}.py"], both[f"{name}.py"]
            assert "blockscaled" not in d and "SF_TYPE" not in d and "sfa" not in d, name
            assert "MX = True" in m and "AB_TYPE = cutlass.Float8E4M3FN" in m, name
            assert f"M_OUT = {m_out} " in m and f"N_OUT = {n_out} " in m, name
            assert "BN = 128 " in m and "BK = 128 " in m, name
            assert ("make_blockscaled_trivial_tiled_mma(\n        AB_TYPE, AB_TYPE, tcgen05.OperandMajorMode.MN, "
                    "tcgen05.OperandMajorMode.MN, SF_TYPE, SF_VEC,") in m, name
            assert "tiled_mma.set(tcgen05.Field.SFA" in m and "tiled_mma.set(tcgen05.Field.SFB" in m, name
            assert m.count("cute.copy(tma_atom_sf") == 2 and m.count("cute.copy(s2t_sf") == 2, name
            assert re.findall(r"^    (\w+): ", m.split("def launch(")[1].split("):")[0], re.M) == \
                ["a", "sfa", "b", "sfb", "group_start", "out", "num_ctas", "stream"], name
            assert "in MXFP8 (e4m3, e8m0 scales per 32 rows)" in m and "in MXFP8" not in d, name
    for k, cols in (("quant_mx_cols_gather", H), ("quant_mx_dz_cols", 2 * I), ("quant_mx_sa_cols", I)):
        text = both[f"{k}.py"]
        assert f"C_COLS = {cols} " in text and "if mRowW[kb * SF_VEC + i] == cutlass.Float32(0.0):" in text, k
        assert ("mRowSrc[kb * SF_VEC + i]" in text) == (k == "quant_mx_cols_gather"), k


# ---- the column quantizers: the rendered arithmetic = quantize_mx, bit for bit ---------------------------------


def emulate_rows_cols_quantizer(text: str, x: torch.Tensor, row_src: torch.Tensor, row_w: torch.Tensor, n: int,
                                rows: int, gather: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The row-space column quantizer's math on the CPU (templates/sm100/quant_mx.py.j2 rows_gather / rows_used):
    rows r < n of the row space (x[row_src[r]] gathered or x[r]; zero where row_w is 0), per (32-row block,
    column) its amax, code and inverse (kernel_e8m0: the template's e8m0_code on int32 bits), q = e4m3(v * inv), the
    code bytes at the rendered `off = ...` expression. Bytes of rows >= n: 0x7F / 255 (never written)."""
    C = x.shape[1]
    v = (x[row_src[:n].long().clamp(min=0)] if gather else x[:n]).float()
    v = torch.where((row_w[:n] != 0).view(-1, 1), v, torch.zeros(()))
    vb = v.view(n // 32, 32, C)
    c, inv = kernel_e8m0(vb.abs().amax(1))                                   # [n / 32, C]
    q = torch.full((rows, C), 0x7F, dtype=torch.uint8)
    q[:n] = fp8.to_e4m3(vb * inv.unsqueeze(1)).view(n, C).view(torch.uint8)
    sf = torch.full((fp8.mx_sf_bytes(C, rows // 32),), 255, dtype=torch.uint8)
    off = eval(_template_expr(text, "off = "), {"row": torch.arange(C).view(1, -1), "kb": torch.arange(n // 32).view(-1, 1),
                                                "K_BLOCKS": rows // 32, "SF_ROWS": 128, "SF_ATOM": 512})
    sf[off] = c.to(torch.uint8)
    return q, sf


def _row_space(counts, bm=128):
    """row_src / row_w of a padded row space as the routing kernel writes it: groups holding `counts` rows (tokens
    0, 1, ... in row order, weights in (0.1, 1); one real row of weight 0), padded to bm with rows of token 0 and
    weight 0, plus an unused routing tile at the end (stale values); `real` marks the routed rows; meta[0] the used
    tiles."""
    srcs, ws, tok = [], [], 0
    g = torch.Generator().manual_seed(sum(counts))
    for c in counts:
        padded = -(-c // bm) * bm
        r = torch.zeros((padded,), dtype=torch.int32)
        r[:c] = torch.arange(tok, tok + c, dtype=torch.int32)
        w = torch.zeros((padded,))
        w[:c] = 0.1 + 0.9 * torch.rand(c, generator=g)
        srcs.append(r)
        ws.append(w)
        tok += c
    used = sum(p.shape[0] for p in srcs)
    row_src = torch.cat(srcs + [torch.full((bm,), 7, dtype=torch.int32)])   # an unused tile (stale values)
    row_w = torch.cat(ws + [torch.full((bm,), 0.5)])
    real = row_w != 0
    real[used:] = False
    if tok > 3:
        row_w[int((row_src[:used] == 3).nonzero()[0])] = 0.0                 # a slot routed with weight 0
    meta = torch.tensor([used // bm, 0, 0, 0], dtype=torch.int32)
    return row_src, row_w, real, meta, used


@pytest.mark.parametrize("kernel,counts", [
    ("quant_mx_cols_gather", (31, 0, 32, 33, 1)),       # blocks at group edges, an empty group, a one-row group
    ("quant_mx_cols_gather", (129, 127)),
    ("quant_mx_dz_cols", (5, 96, 128)),
    ("quant_mx_sa_cols", (200, 0, 1)),
])
def test_cols_quantizer_math_equals_quantize_mx(kernel, counts):
    """The rendered column quantizer, emulated (e8m0 on int32 bits, the template's offset expression), equals
    quantize_mx of each group's rows transposed (32-row blocks down the columns from the group's first row; padding
    rows zero) bit for bit, the codes at pack_mx_scales' bytes of the [C, rows / 32] matrix; the reference step
    (mokgen.mx_ops) writes the same bytes and leaves the rows past meta[0] * BM and their codes unwritten."""
    from mokgen.sm100.emit import render_quant_mx

    plan = solve(_spec(), "sm_100a", **BOTH)
    text = render_quant_mx(plan, kernel)
    C = {"quant_mx_cols_gather": H, "quant_mx_dz_cols": 2 * I, "quant_mx_sa_cols": I}[kernel]
    gather = kernel == "quant_mx_cols_gather"
    row_src, row_w, real, meta, n = _row_space(counts, plan.bm)
    rows = row_src.shape[0]
    # the row space's values: boundary rows turned so that their 32-blocks run down the columns (amax on every
    # binade edge, zero blocks, subnormals, half-way and saturating values), columns taken cyclically
    bt = boundary_rows(rows).t()                                             # [rows, m]
    space = bt[:, torch.arange(C) % bt.shape[1]].contiguous()
    if gather:   # token rows: the real rows' values, in token order (padding rows read token 0: ignored)
        src = space[real].contiguous()
        assert src.shape[0] == int(row_src[:n].max()) + 1 == sum(counts)
    else:        # the row space itself; garbage (huge values) in the padding rows must not reach the amax
        src = space.clone()
        src[row_w == 0] = 3.0e38
    q_e, sf_e = emulate_rows_cols_quantizer(text, src, row_src, row_w, n, rows, gather)
    # quantize_mx, group by group, of the rows as the wgrad reduces them (padding rows zero)
    vals = (src[row_src[:n].long().clamp(min=0)] if gather else src[:n]).float()
    vals = torch.where((row_w[:n] != 0).view(-1, 1), vals, torch.zeros(()))
    qr, er = fp8.quantize_mx(vals.t())                                       # [C, n], [C, n / 32]
    assert torch.equal(q_e[:n], qr.view(torch.uint8).t())
    full = fp8.pack_mx_scales(torch.cat([er, torch.full((C, (rows - n) // 32), 255, dtype=torch.uint8)], 1))
    assert torch.equal(sf_e, full.flatten())                                 # every used code byte, at its place
    assert {0, 127}.issubset(set(er.flatten().tolist()))                     # tiny and all-zero blocks reached
    # the reference step, through the launch helper: the same bytes; rows past n untouched
    fns = mx_ops.reference_quant_kernels(plan.bm)
    q = torch.full((rows, C), 0x7F, dtype=torch.uint8)
    sf = torch.full((fp8.mx_sf_bytes(C, rows // 32),), 255, dtype=torch.uint8)
    fns[kernel](*((src, row_src, row_w, meta, q, sf) if gather else (src, row_w, meta, q, sf)))
    assert torch.equal(q, q_e) and torch.equal(sf, sf_e)
    if gather:
        q2, sf2 = mx_ops.quantize_gathered_cols(fns, src, row_src, row_w, meta)
    else:
        q2, sf2 = mx_ops.quantize_used_cols(fns, src, row_w, meta, kernel)
    assert torch.equal(q2[:n], q_e[:n])
    assert torch.equal(mx_ops.dequantize_cols(q2, sf2, n).double(), fp8.dequantize_mx(qr, er, out_dtype=torch.float64).t())


def test_block_scaled_product_from_the_packed_bytes():
    """The wgrad's GEMM as the block-scaled MMA reads it (A = a's bytes viewed (M, K = rows), scales of (column m,
    32-row block) at mx_sf_offset(m, kb, rows / 32); likewise B), per group over its rows only, equals the float64
    product of quantize_mx's operands (rel. 1e-12) and the reference step ref_wgrad_mx within fp32 rounding."""
    plan = solve(_spec(), "sm_100a", **BOTH)
    counts = (33, 0, 128, 1)
    row_src, row_w, _, meta, n = _row_space(counts, plan.bm)
    rows = row_src.shape[0]
    g = torch.Generator().manual_seed(4)
    A = torch.randn(rows, 256, generator=g).bfloat16() * torch.exp2(torch.randint(-8, 8, (rows, 1), generator=g))
    B = torch.randn(rows, 128, generator=g).bfloat16()
    fns = mx_ops.reference_quant_kernels(plan.bm)
    qa, sfa = mx_ops.quantize_used_cols(fns, A.bfloat16(), row_w, meta, "quant_mx_dz_cols")
    qb, sfb = mx_ops.quantize_used_cols(fns, B, row_w, meta, "quant_mx_sa_cols")
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + -(-c // plan.bm) * plan.bm)
    gs = torch.tensor(starts, dtype=torch.int32)
    out = torch.empty(len(counts), 256, 128, dtype=torch.float32)
    R.ref_wgrad_mx(qa, sfa, qb, sfb, gs, out, 1)
    keep = (row_w[:n] != 0).view(-1, 1)
    for gi in range(len(counts)):
        r0, r1 = starts[gi], starts[gi + 1]
        za = qa.clone()
        zb = qb.clone()
        za[:r0] = 0
        zb[:r0] = 0
        got = emulated_block_scaled_gemm(za[:r1].t().contiguous(), sfa, zb[:r1].t().contiguous(), sfb, r1,
                                         offset=lambda m, kb, _kb: fp8.mx_sf_offset(m, kb, rows // 32))
        va = torch.where(keep[r0:r1], A[r0:r1].float(), torch.zeros(()))
        vb = torch.where(keep[r0:r1], B[r0:r1].float(), torch.zeros(()))
        want = (R._mx_cols(va, torch.float64).t() @ R._mx_cols(vb, torch.float64)) if r1 > r0 else \
            torch.zeros(256, 128, dtype=torch.float64)
        assert torch.allclose(got, want, rtol=1e-12, atol=0), gi
        assert torch.allclose(out[gi].double(), want, rtol=1e-6, atol=1e-30), gi
        if r1 == r0:
            assert not bool(out[gi].any())


# ---- a training step on the reference kernels ------------------------------------------------------------------


def _layer(spec, overrides, calls=None, bwd_streams=None):
    ov = dict(overrides, **({"bwd_streams": bwd_streams} if bwd_streams else {}))
    pl = solve(spec, "sm_100a", **ov)
    fns = R.reference_kernels(spec, pl.bm, training=True, mx_wgrads=kernels.mx_wgrads(pl))
    if calls is not None:   # record every launch and the tensors it was given (after it ran)
        fns = {k: (lambda f, k: lambda *a: (f(*a), calls.append((k, a)))[0])(f, k) for k, f in fns.items()}
    return pl, CompiledMoE(spec, pl, functions=fns, allow_cpu=True, arch="sm_100a")


def _inputs(spec, tokens, seed, idx=None):
    inp = R.random_inputs(spec, tokens=tokens, seed=seed)
    if idx is not None:
        inp = inp._replace(topk_idx=idx)
    return inp


def _idx_odd(tokens, experts):
    """topk_idx routing odd counts to the experts, expert experts - 1 none (an empty group)."""
    g = torch.Generator().manual_seed(tokens)
    first = torch.randint(0, experts - 1, (tokens,), generator=g)
    second = (first + 1 + torch.randint(0, experts - 2, (tokens,), generator=g)) % (experts - 1)
    return torch.stack([first, second], 1).to(torch.int32)


CASES = {
    "default": dict(tokens=T),
    "t1": dict(tokens=1),
    "odd_empty": dict(tokens=45, idx=_idx_odd(45, E)),
    "group_edges": dict(tokens=80, idx=torch.stack([torch.arange(80) % 3, (torch.arange(80) // 3) % 3 + 0], 1)),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("main_grad", [False, True])
def test_training_step(case, main_grad):
    """A training step with both weight gradients in MXFP8 on the reference kernels: dW1 / dW2 equal the float64
    product of the dequantized bytes the column quantizers wrote (per group over its rows; rel. < 4e-3: the bf16
    output's rounding, < 1e-6 for the fp32 main_grad), are within a few % of the BF16 weight gradients of the
    default step (0.5% .. 8%: MXFP8 really ran, at its resolution) and near the float64 reference backward_mx with
    mx_wgrads; dx and the router gradient are the default MXFP8 step's, bit for bit."""
    c = CASES[case]
    tokens = c["tokens"]
    spec = _spec(tokens=max(tokens, 1))
    idx = c.get("idx")
    if idx is not None:
        idx = torch.where(idx[:, :1] == idx[:, 1:], torch.stack([idx[:, 0], (idx[:, 0] + 1) % 3], 1), idx)
        idx = idx.to(torch.int32)
    inp = _inputs(spec, tokens, seed=11, idx=idx)
    a = (inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2)
    dy = torch.randn(tokens, H, generator=torch.Generator().manual_seed(12)).bfloat16()
    _, base = _layer(spec, {})
    y0, s0 = base.forward_train(*a)
    g0 = base.backward(dy, s0, inp.x, inp.topk_weight, inp.w1, inp.w2)
    calls = []
    pl, moe = _layer(spec, BOTH, calls)
    y1, s1 = moe.forward_train(*a)
    assert torch.equal(y0, y1)
    del calls[:]
    if main_grad:
        mg1 = torch.randn(inp.w1.shape, generator=torch.Generator().manual_seed(13))
        mg2 = torch.randn(inp.w2.shape, generator=torch.Generator().manual_seed(14))
        m1, m2 = mg1.clone(), mg2.clone()
        g1 = moe.backward(dy, s1, inp.x, inp.topk_weight, inp.w1, inp.w2, w1_main_grad=m1, w2_main_grad=m2)
        assert g1.w1 is None and g1.w2 is None
    else:
        g1 = moe.backward(dy, s1, inp.x, inp.topk_weight, inp.w1, inp.w2)
    assert torch.equal(g1.x, g0.x) and torch.equal(g1.topk_weight, g0.topk_weight)
    names = [k for k, _ in calls]
    assert GATHER_KERNEL not in names and ("wgrad1_acc" if main_grad else "wgrad1") in names
    # the bytes the column quantizers wrote, and the group_start the wgrads got
    got = {}
    for k, args in calls:
        if k in WGRAD_Q:
            got.setdefault(k, []).append((args[-2], args[-1]))   # q, sf
        if k.startswith("wgrad"):
            gs = args[4]
    rows_used = int(gs[-1])
    assert rows_used == int(s1.meta[0]) * pl.bm
    deq = {k: [mx_ops.dequantize_cols(q, sf, rows_used).double() for q, sf in v] for k, v in got.items()}
    dO_c, x_c = deq["quant_mx_cols_gather"]          # wgrad2's A first, then wgrad1's B
    dz_c, sa_c = deq["quant_mx_dz_cols"][0], deq["quant_mx_sa_cols"][0]
    gl = gs.tolist()
    want1 = torch.stack([dz_c[r0:r1].t() @ x_c[r0:r1] for r0, r1 in zip(gl, gl[1:])])
    want2 = torch.stack([dO_c[r0:r1].t() @ sa_c[r0:r1] for r0, r1 in zip(gl, gl[1:])])
    # padding rows quantized as zero: the operands' rows of padding (routing weight 0; row_src 0, token 0's row,
    # in the gathered ones) are exactly zero
    pad = s1.row_w[:rows_used] == 0
    assert bool(pad.any()) and bool((s1.row_src[:rows_used][pad] == 0).all())
    for t in (dO_c, x_c, dz_c, sa_c):
        assert not bool(t[pad].any())
    if main_grad:
        dw1, dw2 = (m1 - mg1).double(), (m2 - mg2).double()
        tol = 1e-6
    else:
        dw1, dw2 = g1.w1.double(), g1.w2.double()
        tol = 4e-3
    for name, got_w, want, bf in (("w1", dw1, want1, g0.w1), ("w2", dw2, want2, g0.w2)):
        if tokens == 0 or not bool(want.any()):
            continue
        assert R.rel_err(got_w, want) < tol, (name, R.rel_err(got_w, want))
        err = R.rel_err(got_w, bf.double())
        assert 0.005 < err < 0.08, (name, err)
    if not main_grad:
        rm = R.backward_mx(dy, *a, spec, mx_wgrads=("wgrad1", "wgrad2"))
        assert R.rel_err(g1.w1.float(), rm.w1) < 1e-2 and R.rel_err(g1.w2.float(), rm.w2) < 1e-2
        # groups with no rows: zero gradients
        counts = torch.bincount(inp.topk_idx.reshape(-1).long(), minlength=E)
        for e in range(E):
            if counts[e] == 0:
                assert not bool(g1.w1[e].any()) and not bool(g1.w2[e].any())


@pytest.mark.parametrize("which", ["wgrad1", "wgrad2"])
def test_one_weight_gradient_in_mxfp8(which):
    """One weight gradient in MXFP8, the other BF16: the BF16 one is the default step's bit for bit (it keeps the
    gather), the MXFP8 one near the float64 reference with that one quantized."""
    spec = _spec(bias=True)
    inp = _inputs(spec, T, seed=21)
    a = (inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2, inp.b1, inp.b2)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(22)).bfloat16()
    _, base = _layer(spec, {})
    _, moe = _layer(spec, {f"{which}_dtype": "mxfp8"})
    g0 = base.backward(dy, base.forward_train(*a)[1], inp.x, inp.topk_weight, inp.w1, inp.w2, inp.b1, inp.b2)
    g1 = moe.backward(dy, moe.forward_train(*a)[1], inp.x, inp.topk_weight, inp.w1, inp.w2, inp.b1, inp.b2)
    other = "w2" if which == "wgrad1" else "w1"
    mine = "w1" if which == "wgrad1" else "w2"
    for name in ("x", "topk_weight", other, "b1", "b2"):
        assert torch.equal(getattr(g1, name), getattr(g0, name)), name
    rm = R.backward_mx(dy, *a[:5], spec, b1=a[5], b2=a[6], mx_wgrads=(which,))
    assert R.rel_err(getattr(g1, mine).float(), getattr(rm, mine)) < 1e-2
    assert 0.005 < R.rel_err(getattr(g1, mine).float(), getattr(g0, mine).float()) < 0.08


@pytest.mark.parametrize("streams", [1, 2])
def test_steady_step_launches_the_sequence(streams):
    """The launch sequence with MXFP8 weight gradients: no bf16 gather; dO's and x's rows gathered into their
    column forms, s a and dz quantized down their columns right before their weight gradient; a steady step
    launches exactly that, on one backward stream and on two, with the same gradient bits."""
    spec = _spec()
    inp = _inputs(spec, T, seed=31)
    a = (inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(32)).bfloat16()
    calls = []
    _, moe = _layer(spec, BOTH, calls, bwd_streams=streams)
    seq = moe.launch_sequence()
    assert seq[6:] == (("quant_mx_gather", "dgrad1", "quant_mx_cols_gather_dO", "quant_mx_sa_cols", "wgrad2")
                       + (("quant_mx_dz_cols", "quant_mx_cols_gather_x", "wgrad1", "quant_mx_dz", "dgrad2",
                           "combine_dx") if streams == 2 else
                          ("quant_mx_dz", "dgrad2", "combine_dx", "quant_mx_dz_cols", "quant_mx_cols_gather_x",
                           "wgrad1")))
    moe.backward(dy, moe.forward_train(*a)[1], inp.x, inp.topk_weight, inp.w1, inp.w2)
    del calls[:]
    g = moe.backward(dy, moe.forward_train(*a)[1], inp.x, inp.topk_weight, inp.w1, inp.w2)
    phase = {"combine_dx": "combine", "quant_mx_cols_gather_dO": "quant_mx_cols_gather",
             "quant_mx_cols_gather_x": "quant_mx_cols_gather"}
    assert [k for k, _ in calls] == [phase.get(p, p) for p in seq]
    if streams == 2:
        _, one = _layer(spec, BOTH)
        g1 = one.backward(dy, one.forward_train(*a)[1], inp.x, inp.topk_weight, inp.w1, inp.w2)
        for name in ("x", "topk_weight", "w1", "w2"):
            assert torch.equal(getattr(g, name), getattr(g1, name)), name


# ---- compiled for sm_100a ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_compile_for_sm100a(tmp_path):
    """The opt-in kernels compile for sm_100a: the weight gradients (bf16 and fp32 main_grad forms) issue
    tcgen05.mma kind::mxf8f6f4.block_scale with both operands MN-major (instruction descriptor bits 15 and 16), e4m3
    (bits 7-12 zero), e8m0 scales (bit 23), N = 128, M = 128; one tcgen05.cp of A's and one of B's scale atom per
    K step of four MMAs; per K step TMA loads of A, B (2d) and their scale atoms (3d); the Cluster Launch Control
    walk. The column quantizers: 8 columns x 32 rows a thread (32 16-byte loads, 128 e4m3 conversions, 32 8-byte
    stores, 8 code bytes), no shuffles, no division."""
    pytest.importorskip("cutlass")
    from mokgen import build
    from mokgen.emit import emit

    plan = solve(_spec(), "sm_100a", **BOTH)
    src = emit(plan).files
    names = ("wgrad1", "wgrad2", "wgrad1_acc", "wgrad2_acc") + WGRAD_Q
    art = build.build({f"{k}.py": src[f"{k}.py"] for k in names}, "sm_100a", tmp_path, jobs=1, progress=False)
    report = build.ptx_report(art)
    for k in names[:4]:
        ptx = (Path(art.dir) / f"{k}.ptx").read_text()
        assert report[k]["target"] and report[k]["tcgen05"] and report[k]["block_scale"], (k, report[k])
        assert report[k]["clusterlaunchcontrol"] and report[k]["cp.async.bulk.tensor"], k
        mma = re.findall(r"tcgen05\.mma\.\S+", ptx)
        assert mma and set(mma) == {"tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.block32.collector::a::discard"}
        cps = re.findall(r"tcgen05\.cp\.\S+", ptx)
        assert cps and set(cps) == {"tcgen05.cp.cta_group::1.32x128b.warpx4"}
        assert len(mma) * 2 == len(cps) * (128 // 32), (k, len(mma), len(cps))
        assert "kind::f16" not in ptx and "wgmma" not in ptx, k
        loads = {d: len(re.findall(rf"cp\.async\.bulk\.tensor\.{d}d\.shared::cta\.global", ptx)) for d in (2, 3, 4)}
        # per K step four boxes: A and B (2d) and their scale atoms, 3d over (MN atoms, K atoms) where the operand has
        # more than one 128-column atom (wgrad1: 2I = H = 256 both; wgrad2: H = 256 for A, I = 128 for B: 2d)
        steps, rest = divmod(loads[2] + loads[3], 4)
        n3 = (2 * I > 128) + (H > 128) if k.startswith("wgrad1") else (H > 128) + (I > 128)
        assert steps > 0 and not rest and loads[3] == n3 * steps and loads[4] == 0, (k, loads)
        d = _desc_base(ptx)
        assert (d >> 7) & 0x3F == 0 and d & (1 << 15) and d & (1 << 16), (k, hex(d))
        assert (d >> 17) & 0x3F == 128 >> 3 and d >> 23 & 1 and (d >> 24) & 0x1F == 128 >> 4, (k, hex(d))
        for op in ("tcgen05.alloc.cta_group::1", "tcgen05.dealloc.cta_group::1", "tcgen05.ld.sync.aligned.32x32b",
                   "tcgen05.commit.cta_group::1", "tcgen05.wait::ld", "clusterlaunchcontrol.try_cancel"):
            assert op in ptx, (k, op)
        if k.endswith("_acc"):   # the fp32 main_grad read-add-write
            assert "cp.async.bulk.tensor.3d.global.shared::cta" not in ptx and "ld.global.v4" in ptx, k
        else:                    # the bf16 TMA store of (M_OUT, N_OUT, GROUPS)
            assert "cp.async.bulk.tensor.3d.global.shared::cta" in ptx, k
    for k in WGRAD_Q:
        ptx = (Path(art.dir) / f"{k}.ptx").read_text()
        assert report[k]["target"] and not report[k]["tcgen05"], k
        assert ptx.count("cvt.rn.satfinite.e4m3x2.f32") == 128, k
        assert ptx.count("ld.global.v4.b32") == 32 and ptx.count("st.global.v2.b32") == 32, k
        assert ptx.count("st.global.b8") == 8 and "shfl" not in ptx, k
        assert ".ftz" not in ptx and "div." not in ptx and "rcp." not in ptx, k
