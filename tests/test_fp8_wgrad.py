"""FP8 weight gradients (dtype fp8, plan ``wgrad1_dtype`` / ``wgrad2_dtype`` "fp8") on the CPU: the plan's tiles and
one-line errors, the runtime's launches (the column quantizers, the wgrad*_fp8 argument tables) on the reference
kernels, and the gradients against the float64 product of the operands the BF16 weight gradients read, each
quantized per 128 x 1 tile as the kernels quantize them."""

import dataclasses

import pytest
import torch

from mokgen import fp8
from mokgen import plan as P
from mokgen import reference as R
from mokgen.ops import GATHER_KERNEL, CompiledMoE, fp8_reference_kernels, fp8_wgrads, kernels_of
from mokgen.spec import Spec

H, I, E, K = 256, 384, 4, 2


def _spec(T=300, bias=False):
    return Spec(name="w8", hidden=H, ffn=I, experts=E, topk=K, tokens=T, dtype="fp8", bias=bias)


def _inputs(spec, seed):
    g = torch.Generator().manual_seed(seed)
    T = spec.tokens
    x = torch.randn(T, H, generator=g).bfloat16()
    w1 = (torch.randn(E, 2 * I, H, generator=g) * 0.05).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) * 0.05).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int()
    idx[: T // 2, 0] = 1   # a skewed expert: groups of several 128-row blocks
    idx[: T // 2, 1] = torch.where(idx[: T // 2, 1] == 1, 2, idx[: T // 2, 1])
    wt = torch.rand(T, K, generator=g)
    b1 = b2 = None
    if spec.bias:
        b1 = torch.randn(E, 2 * I, generator=g) * 0.1
        b2 = torch.randn(E, H, generator=g) * 0.1
    return x, idx, wt, w1, w2, b1, b2


def _moe(spec, pl, calls=None, captured=None):
    fns = fp8_reference_kernels(spec, pl)
    if calls is not None or captured is not None:
        def wrap(n, f):
            def step(*a):
                if calls is not None:
                    calls.append(n)
                if captured is not None:
                    captured[n] = [t.clone() if isinstance(t, torch.Tensor) else t for t in a]
                return f(*a)
            return step
        fns = {n: wrap(n, f) for n, f in fns.items()}
    return CompiledMoE(spec, pl, functions=fns, allow_cpu=True)


BF16W = dict(wgrad1_dtype="bf16", wgrad2_dtype="bf16")   # the BF16 weight gradients (not the default)


def test_plan_fp8_wgrad_tiles_and_errors():
    spec = _spec()
    pl = P.solve(spec, wgrad1_dtype="fp8", wgrad2_dtype="fp8")
    narrow = P.solve(spec, wgrad1_dtype="fp8", wgrad2_dtype="fp8", wgrad1_bn=128, wgrad2_bn=128)
    for name in ("wgrad1", "wgrad2"):
        g, w = getattr(narrow.backward, name), getattr(pl.backward, name)
        assert (g.bn, g.bk, g.elem_bytes, g.stage_scale_bytes) == (128, 128, 1, (128 + 128) * 4)
        assert g.smem_bytes() <= 227 * 1024 and g.stages >= 3
        # the default FP8 tile is 128 x 256 (plan.fp8_wgrad_wide; test_plan_fp8_wgrad_wide)
        assert (w.bn, w.bk, w.elem_bytes, w.mma_split) == (256, 128, 1, 2)
    base = P.solve(spec, **BF16W)
    assert pl.backward.dgrad1 == base.backward.dgrad1   # only the weight gradients change
    assert P.solve(spec).backward == pl.backward   # FP8 weight gradients are the default (plan.FP8_WGRAD_DEFAULT)
    only2 = P.solve(spec, wgrad1_dtype="bf16", wgrad2_dtype="fp8")
    assert only2.backward.wgrad1.elem_bytes == 2 and only2.backward.wgrad2.elem_bytes == 1
    assert P.solve(spec, wgrad1_dtype="bf16").backward.wgrad1 == base.backward.wgrad1
    assert P.solve(spec, wgrad1_bn=256).backward.wgrad1 == P.solve(spec, wgrad1_dtype="bf16", wgrad1_bn=256).backward.wgrad1
    with pytest.raises(P.PlanError, match=r"^plan\.wgrad1_dtype: must be one of bf16, fp8, got 'e5m2'$"):
        P.solve(spec, wgrad1_dtype="e5m2")
    bf16 = Spec(name="b", hidden=H, ffn=I, experts=E, topk=K, tokens=64)
    with pytest.raises(P.PlanError, match=r"^plan\.wgrad2_dtype: FP8 weight gradients .*dtype fp8.*bf16$"):
        P.solve(bf16, wgrad2_dtype="fp8")
    assert {"quant_cols_used", "quant_cols_gather"} <= set(kernels_of(pl))
    assert not {"quant_cols_used", "quant_cols_gather"} & set(kernels_of(base))


def test_gather_kernel_only_where_the_step_launches_it():
    """Both weight gradients FP8 and no bias: the quantizers gather every row the step needs, so the entry has no
    ``gather`` kernel (emitted, built or required to train); a BF16 weight gradient or a bias (db2 sums the bf16 dO
    rows) brings it back."""
    from mokgen.emit import emit

    for spec, kw, want in ((_spec(), {}, False), (_spec(bias=True), {}, True),
                           (_spec(), dict(wgrad1_dtype="bf16"), True), (_spec(), dict(wgrad2_dtype="bf16"), True),
                           (_spec(), BF16W, True)):
        pl = P.solve(spec, **kw)
        files = {f.removesuffix(".py") for f in emit(pl).files if f.endswith(".py")}
        assert (GATHER_KERNEL in kernels_of(pl)) == want == (GATHER_KERNEL in files), (spec.bias, kw)
    pl = P.solve(_spec())
    assert fp8_wgrads(pl) == ("wgrad1", "wgrad2")
    fns = {n: f for n, f in fp8_reference_kernels(_spec(), pl).items()
           if n != GATHER_KERNEL}
    m = CompiledMoE(_spec(), pl, functions=fns, allow_cpu=True)
    assert m.trainable
    x, idx, wt, w1, w2, _, _ = _inputs(_spec(), 3)
    y, saved = m.forward_train(x, idx, wt, w1, w2)
    g = m.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).bfloat16(), saved, x, wt, w1, w2)
    assert all(bool(torch.isfinite(t).all()) for t in (g.x, g.w1, g.w2, g.topk_weight))


@pytest.mark.parametrize("streams", [1, 2])
def test_fp8_wgrads_launches_and_gradients(streams):
    """Both weight gradients in FP8: the launches are launch_sequence's; dx and the router gradient are the
    BF16-wgrad step's bits (the weight gradients feed nothing else); dW1 / dW2 equal the float64 product of the
    128 x 1-quantized operands that the BF16 weight gradients read (dz and the x rows; the dO rows and s a), per
    group, within bf16 rounding; and FP8 really ran (they differ from the BF16 weight gradients by e4m3's
    resolution)."""
    spec = _spec()
    x, idx, wt, w1, w2, b1, b2 = _inputs(spec, 1)
    base = P.solve(spec, bwd_streams=streams, **BF16W)
    cap = {}
    m16 = _moe(spec, base, captured=cap)
    y16, s16 = m16.forward_train(x, idx, wt, w1, w2)
    dy = torch.randn(y16.shape, generator=torch.Generator().manual_seed(7)).bfloat16()
    g16 = m16.backward(dy, s16, x, wt, w1, w2)

    pl = P.solve(spec, wgrad1_dtype="fp8", wgrad2_dtype="fp8", bwd_streams=streams)
    calls = []
    m8 = _moe(spec, pl, calls=calls)
    m8(x, idx, wt, w1, w2)   # the weights' e4m3 copies made outside the counted step
    y8, s8 = m8.forward_train(x, idx, wt, w1, w2)
    m8.backward(dy, s8, x, wt, w1, w2)
    y8, s8 = m8.forward_train(x, idx, wt, w1, w2)
    del calls[:]
    g8 = m8.backward(dy, s8, x, wt, w1, w2)
    assert torch.equal(y8, y16)
    seq = m8.launch_sequence()
    phase = {"gather_dO": GATHER_KERNEL, "gather_x": GATHER_KERNEL, "combine_dx": "combine",
             "quant_both_gather_dO": "quant_both_gather", "quant_cols_used_sa": "quant_cols_used",
             "quant_both_used_dz": "quant_both_used", "quant_cols_gather_x": "quant_cols_gather"}
    first = seq.index("quant_both_gather_dO")
    assert "quant_rows_gather" not in seq[first:] and "quant_rows_used" not in seq[first:]   # one read of dO, dz
    assert calls == [phase.get(p, p) for p in seq[first:]], (calls, seq)
    assert "gather_dO" not in seq and "gather_x" not in seq   # no bf16 row copies for the weight gradients
    assert torch.equal(g8.x, g16.x) and torch.equal(g8.topk_weight, g16.topk_weight)

    gs = cap["wgrad1"][2].tolist()
    for name, (a, b) in (("w1", cap["wgrad1"][:2]), ("w2", cap["wgrad2"][:2])):
        want = torch.zeros(getattr(g16, name).shape, dtype=torch.float64)
        for e in range(E):
            r0, r1 = gs[e], gs[e + 1]
            if r1 > r0:
                qa, sa = fp8.quantize_128x1(a[r0:r1], pow2=True)
                qb, sb = fp8.quantize_128x1(b[r0:r1], pow2=True)
                want[e] = fp8.gemm_128x1_128x1_f64(qa, sa, qb, sb)
        got = getattr(g8, name)
        assert bool(torch.isfinite(got).all())
        assert R.rel_err(got.float(), want) < 6e-3, name   # bf16 rounding of an fp32 sum
        e16 = R.rel_err(got.float(), getattr(g16, name).double())
        assert 5e-3 < e16 < 0.1, (name, e16)   # e4m3's resolution: FP8 really ran


def test_fp8_wgrad1_only_main_grad_and_bias():
    """wgrad1 alone in FP8, with biases (dO's bf16 rows still gathered: db2 and the BF16 wgrad2 read them) and
    fp32 main_grad accumulation: the accumulated dW1 is the bf16 output's fp32 twin, dW2 the BF16 path's bits."""
    spec = _spec(T=200, bias=True)
    x, idx, wt, w1, w2, b1, b2 = _inputs(spec, 2)
    pl = P.solve(spec, wgrad1_dtype="fp8", wgrad2_dtype="bf16")
    m8 = _moe(spec, pl)
    y, sv = m8.forward_train(x, idx, wt, w1, w2, b1, b2)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(9)).bfloat16()
    g = m8.backward(dy, sv, x, wt, w1, w2, b1, b2)
    seq = m8.launch_sequence()
    assert "gather_dO" in seq and "gather_x" not in seq and "quant_both_used_dz" in seq
    assert "quant_rows_gather" in seq[seq.index("gather_dO"):]   # dO's rows only: wgrad2 is BF16
    m16 = _moe(spec, P.solve(spec, **BF16W))
    y16, sv16 = m16.forward_train(x, idx, wt, w1, w2, b1, b2)
    g16 = m16.backward(dy, sv16, x, wt, w1, w2, b1, b2)
    assert torch.equal(g.w2, g16.w2) and torch.equal(g.b1, g16.b1) and torch.equal(g.b2, g16.b2)
    mg1, mg2 = torch.full(w1.shape, 0.5), torch.zeros(w2.shape)
    y, sv = m8.forward_train(x, idx, wt, w1, w2, b1, b2)
    m8.backward(dy, sv, x, wt, w1, w2, b1, b2, w1_main_grad=mg1, w2_main_grad=mg2)
    assert R.rel_err(g.w1.float(), (mg1 - 0.5).double()) < 4e-3
    assert 5e-3 < R.rel_err(g.w1.float(), g16.w1.double()) < 0.1


def test_quant_cols_forms_match_the_quantizer():
    """The column quantizers' reference steps (what the kernels match bit for bit): the used rows only, the
    gathered rows (padding: token 0), st row-block-major, a partial last 128-column block."""
    from mokgen import fp8_ops

    g = torch.Generator().manual_seed(3)
    x = torch.randn(384, 208, generator=g).bfloat16()   # 208 = 128 + 80: a partial column block
    fns = fp8_ops.reference_quant_kernels(bm=128)
    meta = torch.tensor([2, 0, 0, 0], dtype=torch.int32)
    qt, st = fp8_ops.quantize_used_cols(fns, x, meta)
    q, s = fp8.quantize_128x1(x[:256], pow2=True)
    assert qt.shape == (208, 384) and st.shape == (3, 208)
    assert torch.equal(qt[:, :256], q.view(torch.uint8).T) and torch.equal(st[:2], s)
    row_src = torch.randint(0, 100, (384,), generator=g, dtype=torch.int32)
    row_src[250:] = 0
    tok = torch.randn(100, 208, generator=g).bfloat16()
    qt, st = fp8_ops.quantize_gathered_cols(fns, tok, row_src, meta)
    q, s = fp8.quantize_128x1(tok[row_src[:256].long()], pow2=True)
    assert torch.equal(qt[:, :256], q.view(torch.uint8).T) and torch.equal(st[:2], s)
    with pytest.raises(ValueError, match="multiple of 128 rows"):
        fp8_ops.quantize_gathered_cols(fns, tok, row_src[:200], meta)


def test_quant_both_forms_are_rows_and_cols():
    """The one-read quantizers (dO, dz) write what the row and the column quantizers write."""
    from mokgen import fp8_ops

    g = torch.Generator().manual_seed(4)
    fns = fp8_ops.reference_quant_kernels(bm=128)
    meta = torch.tensor([3, 0, 0, 0], dtype=torch.int32)
    x = torch.randn(512, 2880 // 10, generator=g).bfloat16()   # 288 columns: a partial 1x128 tile
    q, s, qt, st = fp8_ops.quantize_used_both(fns, x, meta)
    q2, s2 = fp8_ops.quantize_used_rows(fns, x, meta)
    qt2, st2 = fp8_ops.quantize_used_cols(fns, x, meta)
    n = 384
    assert torch.equal(q[:n], q2[:n]) and torch.equal(s[:n], s2[:n])
    assert torch.equal(qt[:, :n], qt2[:, :n]) and torch.equal(st[:3], st2[:3])
    row_src = torch.randint(0, 50, (512,), generator=g, dtype=torch.int32)
    tok = torch.randn(50, 288, generator=g).bfloat16()
    q, s, qt, st = fp8_ops.quantize_gathered_both(fns, tok, row_src, meta)
    q2, s2 = fp8_ops.quantize_gathered_rows(fns, tok, row_src, meta)
    qt2, st2 = fp8_ops.quantize_gathered_cols(fns, tok, row_src, meta)
    assert torch.equal(q[:n], q2[:n]) and torch.equal(s[:n], s2[:n])
    assert torch.equal(qt[:, :n], qt2[:, :n]) and torch.equal(st[:3], st2[:3])


@pytest.mark.slow
def test_fp8_wgrads_compile_for_sm90a(tmp_path):
    """kimi-k2-fp8 with both weight gradients in FP8 (wgrad1 overlapped, wgrad2 staggered): the four wgrad kernels
    compile for sm_90a with e4m3 wgmma
    (m64n128k32), TMA loads of the operands and of the scales, the per-element promotion (one FMUL and one FFMA
    per accumulator element per K block), no ptxas advisory; the column quantizers convert with
    cvt.rn.satfinite."""
    pytest.importorskip("cutlass")
    import dataclasses
    import re
    from pathlib import Path

    from mokgen import build
    from mokgen.emit import emit
    from mokgen.spec import load_spec

    plan = P.solve(load_spec("kimi-k2-fp8"), "sm_90a", wgrad1_dtype="fp8", wgrad2_dtype="fp8",
                   wgrad1_promote="overlap", wgrad2_bn=128, wgrad2_promote="stagger")
    src = emit(plan)
    keep = {f"{k}.py" for k in ("wgrad1", "wgrad1_acc", "wgrad2", "wgrad2_acc", "quant_cols_used",
                                "quant_cols_gather", "quant_both_used", "quant_both_gather")}
    art = build.build(dataclasses.replace(src, files={n: t for n, t in src.files.items() if n in keep}), "sm_90a",
                      tmp_path, progress=False)
    for k in ("wgrad1", "wgrad1_acc", "wgrad2", "wgrad2_acc"):
        ptx = (Path(art.dir) / f"{k}.ptx").read_text()
        assert set(re.findall(r"wgmma\.mma_async\.\S+", ptx)) == {"wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"}, k
        assert ptx.count("cp.async.bulk.tensor") >= 4, k   # A, B and their scales
        assert len(re.findall(r"fma\.rn\.f32", ptx)) >= 64 and len(re.findall(r"mul\.f32", ptx)) >= 64, k
        # wgrad2 staggers its warpgroups' promotions (named barrier 5), wgrad1 does not
        assert ("bar.arrive 5, 256" in ptx) == k.startswith("wgrad2"), k
        # wgrad1 overlaps: its K blocks unrolled in chains of 4, 2 and 1 (4 wgmma each), waits (1) inside a chain
        assert ptx.count("wgmma.mma_async") == (28 if k.startswith("wgrad1") else 4), k
        assert bool(re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)) == k.startswith("wgrad1"), k
    for k in ("quant_cols_used", "quant_cols_gather", "quant_both_used", "quant_both_gather"):
        assert "cvt.rn.satfinite.e4m3x2.f32" in (Path(art.dir) / f"{k}.ptx").read_text(), k
    adv = build.ptxas_report(art)
    if adv is not None:
        assert not any(adv.values()), {k: v for k, v in adv.items() if v}
    # the 128 x 256 form (wgrad*_bn=256): 128-column wgmma halves, per K block 2 x 4 of them, both waited (0)
    wide = P.solve(load_spec("kimi-k2-fp8"), "sm_90a", wgrad1_dtype="fp8", wgrad1_bn=256, wgrad2_dtype="fp8",
                   wgrad2_bn=256)
    src = emit(wide)
    keep = {f"{k}.py" for k in ("wgrad1", "wgrad2_acc")}
    art = build.build(dataclasses.replace(src, files={n: t for n, t in src.files.items() if n in keep}), "sm_90a",
                      tmp_path / "wide", progress=False)
    for k in ("wgrad1", "wgrad2_acc"):
        ptx = (Path(art.dir) / f"{k}.ptx").read_text()
        assert set(re.findall(r"wgmma\.mma_async\.\S+", ptx)) == {"wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"}, k
        assert ptx.count("wgmma.mma_async") == 8 and not re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx), k
        assert ptx.count("cp.async.bulk.tensor") >= 4, k
    adv = build.ptxas_report(art)
    if adv is not None:
        assert not any(adv.values()), {k: v for k, v in adv.items() if v}


def test_plan_fp8_wgrad_wide():
    """``wgrad*_dtype=fp8, wgrad*_bn=256`` (the default): 128 x 256 FP8 weight-gradient tiles (plan.fp8_wgrad_wide): two wgmma
    halves (mma_split 2) promoted in turn (serial), the stage's scales of 128 + 256 columns, N tiles recounted, as
    many stages as fit; ``wgrad*_bn=256`` without the dtype keeps meaning a BF16 weight gradient; other tile
    widths and other promotions are one-line errors."""
    spec = _spec()
    base = P.solve(spec, wgrad1_dtype="fp8", wgrad2_dtype="fp8", wgrad1_bn=128, wgrad2_bn=128)
    wide = P.solve(spec, wgrad1_dtype="fp8", wgrad1_bn=256, wgrad2_dtype="fp8", wgrad2_bn=256)
    # the default FP8 weight gradients are this form (plan.FP8_WGRAD_PROMOTE's note: measured, v23), staggered
    # (FP8_WGRAD_SPLIT_PROMOTE, v27); overlap (the 128 x 128 tile's own promotion) or wgrad*_bn=128 asks for the
    # 128 x 128 tile
    assert P.solve(spec).backward == wide.backward == P.solve(spec, wgrad1_dtype="fp8", wgrad2_dtype="fp8").backward
    assert P.solve(spec, wgrad1_promote="stagger").backward == wide.backward
    ov = P.solve(spec, wgrad1_promote="overlap", wgrad2_bn=128, wgrad2_promote="stagger").backward
    assert (ov.wgrad1.bn, ov.wgrad1.promote, ov.wgrad2.bn, ov.wgrad2.promote) == (128, "overlap", 128, "stagger")
    assert ov.wgrad1 == base.backward.wgrad1
    a = P.get_arch("sm_90a")
    for name in ("wgrad1", "wgrad2"):
        g, b = getattr(wide.backward, name), getattr(base.backward, name)
        n = P.backward_shape(spec, name)[1]
        assert (g.bn, g.mma_split, g.promote, g.bk, g.elem_bytes) == (256, 2, "stagger", 128, 1)
        assert g.stage_scale_bytes == (128 + 256) * 4 and g.n_tiles == -(-n // 256)
        assert g.stages == P._stages_most(a, g) >= 3 and g.smem_bytes() <= a.smem_per_cta
        assert (g.epi_store, g.raster_group) == (b.epi_store, b.raster_group)
    assert wide.backward.dgrad1 == base.backward.dgrad1 and wide.backward.dgrad2 == base.backward.dgrad2
    assert P.solve(spec, wgrad1_bn=256).backward.wgrad1.elem_bytes == 2   # the BF16 meaning of wgrad1_bn=256
    assert P.solve(spec, wgrad1_dtype="fp8", wgrad1_bn=128).backward.wgrad1 == base.backward.wgrad1
    for kw, msg in ((dict(wgrad1_dtype="fp8", wgrad1_bn=192),
                     r"^plan\.wgrad1_bn: FP8 weight gradients run 128 x 128 or 128 x 256 tiles \(wgrad1_dtype=fp8\), "
                     r"got 192$"),
                    (dict(wgrad2_dtype="fp8", wgrad2_bn=256, wgrad2_promote="overlap"),
                     r"^plan\.wgrad2_promote: the 128 x 256 FP8 wgrad2 promotes its two halves in turn \(serial, or "
                     r"stagger: the warpgroups offset by one half\), got 'overlap'$")):
        with pytest.raises(P.PlanError, match=msg):
            P.solve(spec, **kw)
    from mokgen import configs
    from mokgen.emit import emit

    assert configs.check_plan(wide) == [] and configs.check_config(spec, "sm_90a", dict(wgrad1_dtype="fp8", wgrad1_bn=256)) == []
    assert configs.check_config(spec, "sm_90a", dict(wgrad1_dtype="fp8", wgrad1_bn=192)) == [
        "wgrad1_bn: FP8 weight gradients run 128 x 128 or 128 x 256 tiles"]
    assert configs.check_config(spec, "sm_90a", dict(wgrad2_dtype="fp8", wgrad2_bn=256, wgrad2_promote="overlap")) == [
        "wgrad2_promote: the 128 x 256 FP8 weight gradient promotes its halves in turn (serial, or stagger)"]
    assert configs.check_config(spec, "sm_90a", dict(wgrad2_dtype="fp8", wgrad2_bn=256, wgrad2_promote="stagger")) == []
    files = emit(wide).files
    for k in ("wgrad1", "wgrad1_acc", "wgrad2", "wgrad2_acc"):
        src = files[f"{k}.py"]
        assert "MMA_SPLIT = 2" in src and "BN = 256" in src and "mma_half" in src and "tCrB_h" in src, k
    assert "MMA_SPLIT = 1" in emit(base).files["wgrad1.py"]


def test_plan_fp8_wgrad_split_stagger():
    """The 128 x 256 FP8 weight gradients' promotion (plan.FP8_WGRAD_SPLIT_PROMOTE): "stagger" by default (warpgroup
    1 waits on named barrier STAGGER_BAR until warpgroup 0's first half has retired, once per tile with at least
    STAGES K blocks), ``wgrad*_promote=serial`` the two warpgroups together; everything else equal.
    ``wgrad*_bn=128, wgrad*_promote=stagger`` is the 128 x 128 staggered tile."""
    spec = _spec()
    st = P.solve(spec)
    ser = P.solve(spec, wgrad1_promote="serial", wgrad2_promote="serial")
    assert st.backward == P.solve(spec, wgrad1_dtype="fp8", wgrad1_bn=256, wgrad1_promote="stagger", wgrad2_dtype="fp8",
                                  wgrad2_bn=256, wgrad2_promote="stagger").backward
    for name in ("wgrad1", "wgrad2"):
        g, w = getattr(st.backward, name), getattr(ser.backward, name)
        assert (g.bn, g.mma_split, g.promote) == (256, 2, "stagger") and w.promote == "serial"
        assert g == dataclasses.replace(w, promote="stagger")
    assert P.solve(spec, wgrad1_bn=128, wgrad1_promote="stagger").backward.wgrad1.bn == 128
    wide = ser
    from mokgen import configs
    from mokgen.emit import emit

    assert configs.check_plan(st) == []
    files, plain = emit(st).files, emit(wide).files
    for k in ("wgrad1", "wgrad1_acc", "wgrad2", "wgrad2_acc"):
        src = files[f"{k}.py"]
        assert "MMA_SPLIT = 2" in src and "STAGGER_BAR = 5" in src, k
        assert src.count("barrier_id=STAGGER_BAR") == 2 and "staggered = k_tiles >= STAGES" in src, k
        assert "STAGGER_BAR" not in plain[f"{k}.py"], k


def test_explain_shows_the_backward_choices():
    """plan --explain has a backward section: each backward GEMM's operand type, tile, stages and output path;
    the FP8 note says which weight gradients are FP8."""
    spec = _spec()
    text = P.explain(P.solve(spec, wgrad1_dtype="bf16", wgrad2_dtype="fp8", wgrad2_bn=128, wgrad2_promote="stagger"))
    back = text[text.index("backward (training"):text.index("notes:")]
    assert "wgrad2  dW2[g]" in back and "per 128 x 1 tile along the rows" in back and "(stagger)" in back
    assert back.count("BF16") == 1   # wgrad1 only (the dgrads are FP8)
    assert "weight gradients: wgrad2 FP8, the other BF16" in text and "BF16 weight-gradient GEMMs" not in text
    assert "BF16 weight-gradient GEMMs" in P.explain(P.solve(spec, wgrad1_dtype="bf16", wgrad2_dtype="bf16"))
    assert "FP8 weight-gradient GEMMs" in P.explain(P.solve(spec))   # the default (plan.FP8_WGRAD_DEFAULT)


@pytest.mark.parametrize("T", [1, 37])
def test_fp8_wgrads_empty_experts_and_tiny_T(T):
    """Experts with no rows get zero weight gradients (untouched main_grad), T = 1 and an odd T run, and the FP8
    weight gradients stay close to the BF16 ones where there are rows."""
    spec = _spec(T=T)
    x, idx, wt, w1, w2, *_ = _inputs(spec, 5)
    idx = torch.stack([torch.zeros(T, dtype=torch.int32), torch.full((T,), 2, dtype=torch.int32)], 1)  # 1, 3 empty
    m8 = _moe(spec, P.solve(spec, wgrad1_dtype="fp8", wgrad2_dtype="fp8"))
    m16 = _moe(spec, P.solve(spec, **BF16W))
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(11)).bfloat16()
    g = {}
    for name, m in (("fp8", m8), ("bf16", m16)):
        y, sv = m.forward_train(x, idx, wt, w1, w2)
        g[name] = m.backward(dy, sv, x, wt, w1, w2)
    for n in ("w1", "w2"):
        got = getattr(g["fp8"], n)
        assert bool((got[[1, 3]] == 0).all()), n
        assert 0 < R.rel_err(got[[0, 2]].float(), getattr(g["bf16"], n)[[0, 2]].double()) < 0.1, n
    mg1 = torch.full(w1.shape, 0.25)
    y, sv = m8.forward_train(x, idx, wt, w1, w2)
    m8.backward(dy, sv, x, wt, w1, w2, w1_main_grad=mg1, w2_main_grad=torch.zeros(w2.shape))
    assert bool((mg1[[1, 3]] == 0.25).all())


@pytest.mark.parametrize("streams", [1, 2])
def test_x_cols_in_the_forward_same_bits(streams):
    """Plan bwd_x_cols="forward": the training forward's x quantizer is quant_both_gather (GEMM 1's 1 x 128 rows and
    the FP8 wgrad1's 128 x 1 columns from one read), the forward saves the column form, and the backward launches
    no quant_cols_gather: the launches are launch_sequence's, y and every gradient have the bits of the default
    (the columns quantized in the backward), and the saved bytes grow by exactly the column form. Through the
    autograd op too (the custom op carries the columns to the backward)."""
    import mokgen

    spec = _spec()
    x, idx, wt, w1, w2, _, _ = _inputs(spec, 5)
    dy = torch.randn(spec.tokens, H, generator=torch.Generator().manual_seed(9)).bfloat16()
    base, fwd = (P.solve(spec, bwd_streams=streams, **kw) for kw in ({}, dict(bwd_x_cols="forward")))
    assert (base.backward.x_cols, fwd.backward.x_cols) == ("backward", "forward")
    m0, calls = _moe(spec, base), []
    m1 = _moe(spec, fwd, calls=calls)
    m1(x, idx, wt, w1, w2)   # the weights' e4m3 copies made outside the counted step
    y0, s0 = m0.forward_train(x, idx, wt, w1, w2)
    g0 = m0.backward(dy, s0, x, wt, w1, w2)
    del calls[:]
    y1, s1 = m1.forward_train(x, idx, wt, w1, w2)
    g1 = m1.backward(dy, s1, x, wt, w1, w2)
    seq = m1.launch_sequence()
    assert seq[1] == "quant_both_gather_x" and "quant_cols_gather_x" not in seq and "quant_rows_gather" not in seq
    assert m0.launch_sequence()[1] == "quant_rows_gather" and "quant_cols_gather_x" in m0.launch_sequence()
    phase = {"quant_both_gather_x": "quant_both_gather", "quant_both_gather_dO": "quant_both_gather",
             "combine_dx": "combine", "quant_cols_used_sa": "quant_cols_used", "quant_both_used_dz": "quant_both_used"}
    assert calls == [phase.get(p, p) for p in seq], (calls, seq)
    assert s0.xt is None and s1.xt is not None
    cap = s1.z.shape[0]
    assert (tuple(s1.xt.shape), tuple(s1.xts.shape)) == ((H, cap), (cap // 128, H))
    assert s1.nbytes == s0.nbytes + H * cap + cap // 128 * H * 4
    assert torch.equal(y0, y1)
    for name in ("x", "topk_weight", "w1", "w2"):
        assert torch.equal(getattr(g0, name), getattr(g1, name)), name
    # the autograd op: the same gradients through moe_forward
    leaves = [t.clone().requires_grad_(True) for t in (x, wt, w1, w2)]
    y = mokgen.moe_forward(leaves[0], idx, leaves[1], leaves[2], leaves[3], moe=m1)
    y.backward(dy)
    assert torch.equal(y.detach(), y1)
    for t, name in zip(leaves, ("x", "topk_weight", "w1", "w2")):
        assert torch.equal(t.grad, getattr(g1, name).to(t.grad.dtype)), name


def test_x_cols_plan_errors():
    """bwd_x_cols is an FP8-wgrad1 choice: refused with a BF16 wgrad1 or a BF16 spec, and not offered to tune there."""
    from mokgen import configs as C

    spec = _spec()
    with pytest.raises(P.PlanError, match=r"bwd_x_cols.*FP8 wgrad1"):
        P.solve(spec, bwd_x_cols="forward", wgrad1_dtype="bf16")
    with pytest.raises(P.PlanError, match=r"bwd_x_cols: must be one of backward, forward"):
        P.solve(spec, bwd_x_cols="both")
    bf16 = Spec(name="b", hidden=H, ffn=I, experts=E, topk=K, tokens=64)
    with pytest.raises(P.PlanError, match=r"bwd_x_cols"):
        P.solve(bf16, bwd_x_cols="forward")
    assert {"bwd_x_cols": "forward"} in list(C.enumerate_backward_configs(spec, axes=("bwd_x_cols",)))
    assert list(C.enumerate_backward_configs(bf16, axes=("bwd_x_cols",))) == []
    assert "x's columns quantized here (quant_cols_gather)" in P.explain(P.solve(spec))
    assert "x's columns from the training forward's x quantizer" in P.explain(P.solve(spec, bwd_x_cols="forward"))
    assert C.check_config(spec, "sm_90a", {"bwd_x_cols": "forward", "wgrad1_dtype": "bf16"})
