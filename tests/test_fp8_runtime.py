"""The runtime's FP8 path (spec dtype fp8) on the CPU, on the reference kernels (mokgen.reference_kernels: the
kernels' argument tables, float32 math on the dequantized operands): the launch sequence, the weights' e4m3
copies following in-place updates, forward against the quantization-aware float64 reference, the training step."""

import pytest
import torch

from mokgen import plan as P
from mokgen import reference as R
from mokgen.ops import CompiledMoE, kernels_of
from mokgen.spec import Spec


BF16W = dict(wgrad1_dtype="bf16", wgrad2_dtype="bf16")
# these tests run h's quant_rows_used launch (the tiny specs' default is GEMM 1's epilogue: plan.fp8_default_h_quant;
# test_h_quant_in_gemm1_epilogue compares the two)
KERNEL_HQ = dict(gemm1_h_quant="kernel")


def _case(seed=0, T=64):
    spec = Spec(name="t8", hidden=256, ffn=256, experts=4, topk=2, tokens=T, dtype="fp8")
    pl = P.solve(spec, **BF16W, **KERNEL_HQ)   # the FP8 weight gradients (the default) have their own tests: test_fp8_wgrad.py
    moe = CompiledMoE(spec, pl, functions=R.reference_kernels(spec, pl.bm, training=True), allow_cpu=True)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, 256, generator=g).bfloat16()
    w1 = (torch.randn(4, 512, 256, generator=g) * 0.05).bfloat16()
    w2 = (torch.randn(4, 256, 256, generator=g) * 0.05).bfloat16()
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(T)]).int()
    wt = torch.rand(T, 2, generator=g)
    return spec, pl, moe, x, idx, wt, w1, w2


def test_fp8_kernels_and_sequence():
    spec, pl, moe, *_ = _case()
    ks = kernels_of(pl)
    assert {"quant_rows_gather", "quant_rows_used", "quant_w", "quant_wt"} <= set(ks)
    assert moe.launch_sequence(training=False) == ("routing", "quant_rows_gather", "gemm1", "quant_rows_used",
                                                   "gemm2", "combine")
    assert moe.fp8 and moe.trainable


def test_fp8_forward_matches_the_quantized_reference():
    spec, pl, moe, x, idx, wt, w1, w2 = _case()
    y = moe(x, idx, wt, w1, w2)
    ref8 = R.forward_fp8(x, idx, wt, w1, w2, spec)
    ref16 = R.forward(x, idx, wt, w1, w2, spec)
    assert R.rel_err(y.float(), ref8) < 1e-2
    assert 0.02 < R.rel_err(y.float(), ref16) < 0.12   # e4m3's resolution, not zero: FP8 really ran
    y2, saved = moe.forward_train(x, idx, wt, w1, w2)
    assert torch.equal(y, y2)


def test_fp8_weights_follow_in_place_updates():
    spec, pl, moe, x, idx, wt, w1, w2 = _case()
    y1 = moe(x, idx, wt, w1, w2)
    assert torch.equal(moe(x, idx, wt, w1, w2), y1)   # cached copies: same bits
    with torch.no_grad():
        w2.mul_(0.5)   # what optimizer.step() does: in place, version bumped
    y2 = moe(x, idx, wt, w1, w2)
    assert R.rel_err(y2.float(), R.forward_fp8(x, idx, wt, w1, w2, spec)) < 1e-2
    assert not torch.equal(y1, y2)
    w2b = w2.clone()   # another tensor with the same values: its own copy, same result
    assert torch.equal(moe(x, idx, wt, w1, w2b), y2)


def test_fp8_training_step():
    spec, pl, moe, x, idx, wt, w1, w2 = _case(seed=1)
    y, saved = moe.forward_train(x, idx, wt, w1, w2)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).bfloat16()
    g = moe.backward(dy, saved, x, wt, w1, w2)
    r = R.backward(dy, x, idx, wt, w1, w2, spec)
    for name in ("x", "topk_weight", "w1", "w2"):
        got = getattr(g, name)
        assert bool(torch.isfinite(got).all()), name
        assert R.rel_err(got.float(), getattr(r, name)) < 0.12, name


def test_fp8_autograd_and_main_grad():
    """mokgen.moe_forward on an FP8 layer: the autograd op runs the FP8 training kernels, its gradients equal the
    direct forward_train + backward, and main_grad accumulation adds the same weight gradients in fp32."""
    import mokgen

    spec, pl, moe, x, idx, wt, w1, w2 = _case(seed=2)
    leaves = [t.clone().requires_grad_(True) for t in (x, wt, w1, w2)]
    y = mokgen.moe_forward(leaves[0], idx, leaves[1], leaves[2], leaves[3], moe=moe)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(4)).bfloat16()
    y.backward(dy)
    y_d, saved = moe.forward_train(x, idx, wt, w1, w2)
    g = moe.backward(dy, saved, x, wt, w1, w2)
    assert torch.equal(y.detach(), y_d)
    for leaf, want in zip(leaves, (g.x, g.topk_weight, g.w1, g.w2)):
        assert torch.equal(leaf.grad, want)
    mg1, mg2 = torch.zeros(w1.shape), torch.zeros(w2.shape)
    w1l, w2l = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)
    mokgen.moe_forward(x, idx, wt, w1l, w2l, moe=moe, w1_main_grad=mg1, w2_main_grad=mg2).backward(dy)
    assert w1l.grad is None and w2l.grad is None
    # fp32 accumulation of the same products: equal to the bf16 gradient up to its rounding
    assert R.rel_err(g.w1.float(), mg1.double()) < 1e-2 and R.rel_err(g.w2.float(), mg2.double()) < 1e-2


def test_fp8_backward_sequence_and_two_streams():
    """The FP8 training step launches what launch_sequence says (dO's rows quantized before dgrad1, dz's before
    dgrad2), on one backward stream and on two (plan bwd_streams 2: the bf16 weight gradients first, on the side
    stream), with the same gradient bits."""
    from mokgen.ops import GATHER_KERNEL

    grads = {}
    for streams in (1, 2):
        spec, pl, moe, x, idx, wt, w1, w2 = _case(seed=5)
        pl2 = P.solve(spec, bwd_streams=streams, **BF16W, **KERNEL_HQ)
        assert pl2.backward.streams == streams
        calls = []
        fns = {n: (lambda f, n: lambda *a: (calls.append(n), f(*a))[1])(f, n)
               for n, f in R.reference_kernels(spec, pl2.bm, training=True).items()}
        moe = CompiledMoE(spec, pl2, functions=fns, allow_cpu=True)
        moe(x, idx, wt, w1, w2)   # the weights' e4m3 copies made (a steady step does not launch quant_w)
        y, saved = moe.forward_train(x, idx, wt, w1, w2)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(6)).bfloat16()
        moe.backward(dy, saved, x, wt, w1, w2)   # the transposed copies made
        y, saved = moe.forward_train(x, idx, wt, w1, w2)
        del calls[:]
        g = moe.backward(dy, saved, x, wt, w1, w2)
        kernel = {"gather_dO": GATHER_KERNEL, "gather_x": GATHER_KERNEL, "combine_dx": "combine"}
        seq = moe.launch_sequence()
        assert calls == [kernel.get(ph, ph) for ph in seq[seq.index("gather_dO"):]], (calls, seq)
        grads[streams] = g
    for name in ("x", "topk_weight", "w1", "w2"):
        assert torch.equal(getattr(grads[1], name), getattr(grads[2], name)), name


def test_h_quant_in_gemm1_epilogue():
    """Plan gemm1.h_quant "epilogue": GEMM 1 (its gemm1*_hq_fp8 tables) writes h's e4m3 rows and 1 x 128 scales
    itself, quant_rows_used is not launched in the forward, and the forward and every gradient have the same
    bits as with the quant_rows_used launch."""
    spec, pl, moe, x, idx, wt, w1, w2 = _case(seed=2)
    pq = P.solve(spec, **BF16W, gemm1_h_quant="epilogue")
    assert (pq.gemm1.h_quant, pq.train_gemm1.h_quant, pl.gemm1.h_quant) == ("epilogue", "epilogue", "kernel")
    mq = CompiledMoE(spec, pq, functions=R.reference_kernels(spec, pq.bm, training=True, fp8_h_quant=True),
                     allow_cpu=True)
    assert mq.fp8_h_quant and not moe.fp8_h_quant
    assert mq.launch_sequence(training=False) == ("routing", "quant_rows_gather", "gemm1", "gemm2", "combine")
    assert "quant_rows_used" in mq.launch_sequence()   # dz's rows (the BF16 wgrad1) in the backward
    assert torch.equal(mq(x, idx, wt, w1, w2), moe(x, idx, wt, w1, w2))
    dy = torch.randn(x.shape[0], spec.hidden, generator=torch.Generator().manual_seed(4)).bfloat16()
    (y1, s1), (y2, s2) = moe.forward_train(x, idx, wt, w1, w2), mq.forward_train(x, idx, wt, w1, w2)
    assert torch.equal(y1, y2)
    g1, g2 = moe.backward(dy, s1, x, wt, w1, w2), mq.backward(dy, s2, x, wt, w1, w2)
    for name in ("x", "topk_weight", "w1", "w2"):
        assert torch.equal(getattr(g1, name), getattr(g2, name)), name
    # the kernels' tables: the inference and training GEMM 1 take hq / hs
    from mokgen import kernels

    assert [a.name for a in kernels.ARGS["gemm1_train_hq_fp8"]][-4:] == ["z", "hq", "hs", "num_ctas"]


def test_gemm1_gathers_token_rows():
    """Plan gemm1.a_load "gather" (FP8): x is quantized once per token (quant_rows, T rows) and GEMM 1 reads those
    rows through row_src, instead of quant_rows_gather's T (K + S) routed rows. Asked for, it holds for the training
    GEMM 1 too (z from the consumers with epilogue buffers, through the ring with gemm1_epi_store=ring); as the
    default of large routed groups (fp8_default_a_load) only the inference GEMM 1 gathers. Same operands, same
    products: the same bits as the TMA form, in the inference forward, the training forward and every gradient."""
    from mokgen import kernels

    spec, pl, moe, x, idx, wt, w1, w2 = _case(seed=7)
    assert pl.gemm1.a_load == "tma" and P.fp8_default_a_load(spec, pl.gemm1) == "tma"   # 64 tokens: small groups
    assert kernels.fp8_a_gather(pl) == () and "quant_rows" not in kernels.fp8_layer_kernels(pl)
    dy = torch.randn(x.shape[0], spec.hidden, generator=torch.Generator().manual_seed(8)).bfloat16()
    y0 = moe(x, idx, wt, w1, w2)
    ya, sa_ = moe.forward_train(x, idx, wt, w1, w2)
    ga = moe.backward(dy, sa_, x, wt, w1, w2)
    for epi, z_store in (("smem", "direct"), ("ring", "ring")):
        pg = P.solve(spec, **BF16W, **KERNEL_HQ, gemm1_a_load="gather", gemm1_epi_store=epi)
        assert (pg.gemm1.a_load, pg.train_gemm1.a_load, pg.train_gemm1.z_store) == ("gather", "gather", z_store)
        assert kernels.fp8_a_gather(pg) == ("gemm1", "gemm1_train") and "quant_rows" in kernels.fp8_layer_kernels(pg)
        calls = []
        fns = {n: (lambda f, n: lambda *a: (calls.append(n), f(*a))[1])(f, n)
               for n, f in R.reference_kernels(spec, pg.bm, training=True,
                                               fp8_a_gather=kernels.fp8_a_gather(pg)).items()}
        mg = CompiledMoE(spec, pg, functions=fns, allow_cpu=True)
        assert mg.fp8_a_gather == ("gemm1", "gemm1_train")
        assert mg.launch_sequence(training=False) == ("routing", "quant_rows", "gemm1", "quant_rows_used", "gemm2",
                                                      "combine")
        assert mg.launch_sequence()[:3] == ("routing", "quant_rows", "gemm1_train")
        mg(x, idx, wt, w1, w2)   # the weights' e4m3 copies made (a steady call does not launch quant_wt)
        del calls[:]
        y1 = mg(x, idx, wt, w1, w2)
        assert calls[:3] == ["routing", "quant_rows", "gemm1"], calls
        assert torch.equal(y0, y1) and torch.isfinite(y1.float()).all()
        yb, sb_ = mg.forward_train(x, idx, wt, w1, w2)
        assert torch.equal(ya, yb) and torch.equal(ya, y0)
        gb = mg.backward(dy, sb_, x, wt, w1, w2)
        for name in ("x", "topk_weight", "w1", "w2"):
            assert torch.equal(getattr(ga, name), getattr(gb, name)), (epi, name)
    # the default form of large groups: inference gathers, training reads quant_rows_gather's rows by TMA
    big = Spec(name="t8b", hidden=256, ffn=256, experts=2, topk=1, tokens=4096, dtype="fp8")
    pb = P.solve(big, **BF16W, **KERNEL_HQ)
    assert (pb.gemm1.a_load, pb.gemm1.epi_store, pb.train_gemm1.a_load) == ("gather", "smem", "tma")
    mb = CompiledMoE(big, pb, functions=R.reference_kernels(big, pb.bm, training=True,
                                                              fp8_a_gather=kernels.fp8_a_gather(pb)), allow_cpu=True)
    assert mb.fp8_a_gather == ("gemm1",)
    assert mb.launch_sequence(training=False)[:2] == ("routing", "quant_rows")
    assert mb.launch_sequence()[:2] == ("routing", "quant_rows_gather")


def test_gemm1_gather_refused_where_it_cannot_run():
    """gemm1_a_load=gather (FP8) refuses, one line each: a hidden size that is no multiple of 128 (a row's last K
    block would be read past the row), the W-multicast cluster, staged scales, tma_rows (BF16's override), and x's
    columns from the forward (quant_both_gather's routed rows, which a gathering training GEMM 1 does not read)."""
    spec = Spec(name="t8", hidden=256, ffn=256, experts=4, topk=2, tokens=64, dtype="fp8")
    odd = Spec(name="t8o", hidden=320, ffn=256, experts=4, topk=2, tokens=64, dtype="fp8")
    for s, extra, msg in ((odd, {}, "multiple of 128, got 320"), (spec, {"gemm1_cluster": 2}, "cluster 1"),
                          (spec, {"gemm1_scale_load": "stage"}, "scale_load global")):
        with pytest.raises(P.PlanError, match=msg):
            P.solve(s, gemm1_a_load="gather", **extra)
    with pytest.raises(P.PlanError, match="tma_rows"):
        P.solve(spec, gemm1_a_load="tma_rows")
    with pytest.raises(P.PlanError, match="bwd_x_cols: forward .* gathers x's per-token rows itself"):
        P.solve(spec, gemm1_a_load="gather", wgrad1_dtype="fp8", bwd_x_cols="forward")


def test_reference_gemm1_refuses_the_other_row_form():
    """The reference GEMM 1 bound for one A form (reference_kernels' fp8_a_gather) refuses the other one's rows with
    a message naming the binding, instead of computing on the wrong rows."""
    from mokgen import kernels

    spec, pl, moe, x, idx, wt, w1, w2 = _case(seed=9)
    pg = P.solve(spec, **BF16W, **KERNEL_HQ, gemm1_a_load="gather")
    wrong = CompiledMoE(spec, pg, functions=R.reference_kernels(spec, pg.bm, training=True), allow_cpu=True)
    with pytest.raises(ValueError, match="bound to read gathered rows .*fp8_a_gather"):
        wrong(x, idx, wt, w1, w2)
    other = CompiledMoE(spec, pl, functions=R.reference_kernels(spec, pl.bm, training=True,
                                                               fp8_a_gather=kernels.fp8_a_gather(pg)),
                        allow_cpu=True)
    with pytest.raises(ValueError, match="bound to gather token rows"):
        other(x, idx, wt, w1, w2)


def test_captured_step_quantizes_the_weights_once(monkeypatch):
    """Inside a CUDA-graph capture (simulated: ops._capturing patched, the reference kernels run as the replay
    would) a training step's backward takes the transposed e4m3 copies its own forward made (one quant_wt per
    weight per step, not two); a forward without its backward, a weight changed in place between them and a call
    outside the capture each leave nothing to take; the gradients are the same bits as the eager step's."""
    import mokgen
    from mokgen import ops

    spec, pl, moe, x, idx, wt, w1, w2 = _case(seed=5)
    dy = torch.randn((x.shape[0], spec.hidden), generator=torch.Generator().manual_seed(6)).bfloat16()
    made = []
    real = moe._fns["quant_wt"]
    moe._fns = {**moe._fns, "quant_wt": lambda *a: (made.append(a[0].shape), real(*a))[1]}

    def step(w1_, w2_):
        leaves = [t.clone().requires_grad_(True) for t in (x, wt)] + [w1_, w2_]
        mokgen.moe_forward(leaves[0], idx, leaves[1], leaves[2], leaves[3], moe=moe).backward(dy)
        return [t.grad for t in leaves]

    w1e, w2e = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)
    eager = step(w1e, w2e)
    assert len(made) == 2   # eager: made once, cached
    monkeypatch.setattr(ops, "_capturing", lambda t: True)
    made.clear()
    w1c, w2c = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)
    captured = step(w1c, w2c)
    assert sorted(made) == sorted([tuple(w1.shape), tuple(w2.shape)])   # w1 and w2 once each
    assert all(torch.equal(a, b) for a, b in zip(eager, captured))
    assert not moe._fp8_weights._captured   # the backward took what its forward kept
    # a forward without its backward keeps its copies until a call outside the capture
    y, saved = moe.forward_train(x, idx, wt, w1c, w2c)
    assert len(moe._fp8_weights._captured) == 2
    # a weight changed in place between the forward and the backward: quantized again for the backward
    made.clear()
    with torch.no_grad():
        w2c.mul_(0.5)
    moe.backward(dy, saved, x, wt, w1c, w2c)
    assert made == [tuple(w2.shape)] and not moe._fp8_weights._captured
    moe.forward_train(x, idx, wt, w1c, w2c)   # kept again ...
    assert len(moe._fp8_weights._captured) == 2
    monkeypatch.setattr(ops, "_capturing", lambda t: False)
    moe(x, idx, wt, w1c, w2c)   # ... and dropped by the first call outside the capture
    assert not moe._fp8_weights._captured
