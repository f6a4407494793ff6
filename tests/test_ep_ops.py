"""Expert parallelism's runtime path (mokgen/ep_ops.py, issue 22) on simulated ranks in one process, on the CPU with
the reference kernels: every rank's y equals the single-GPU layer (the same reference kernels) on the gathered
problem bit for bit, and the float64 reference within bf16 rounding, for R = 2, 3, 4 ranks, skewed routings, ranks
with zero tokens, T = 1, shared experts, biases, ids out of range; the order in which the ranks run does not change
a bit; the routing kernel's row space is mokgen.ep.dispatch_layout's order. The EP kernels compile for sm_90a
(slow). tests/test_gpu_ep.py runs the same checks with the device kernels."""
from __future__ import annotations

import itertools
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mokgen import ep, ep_ops
from mokgen import reference as R
from mokgen.ops import CompiledMoE, MoEInputError, RoutingError
from mokgen.spec import Spec

from test_ep import _inputs, _spec


def _gathered_layer(spec, inp, bm):
    """y of the single-GPU layer (reference kernels) on the gathered problem, and its float64 reference."""
    gx, gi, gw, W1, W2, B1, B2, cfg = ep.gather_problem(*inp[:5], spec, inp[5], inp[6])
    moe = CompiledMoE(cfg, bm, functions=R.reference_kernels(cfg, bm), allow_cpu=True)
    b = {} if B1 is None else dict(b1=B1.float().contiguous(), b2=B2.float().contiguous())
    y = moe(gx.contiguous(), gi.int().contiguous(), gw.float().contiguous(), W1.contiguous(), W2.contiguous(), **b)
    return y, R.forward(gx, gi, gw, W1, W2, cfg, B1, B2)


def _ep_layer(spec, bm, gather=False):
    return ep_ops.EPMoE(spec, SimpleNamespace(bm=bm, gemm1=SimpleNamespace(a_load="tma" if gather else "gather")),
                        functions=ep_ops.reference_ep_kernels(spec, bm, gather=gather), allow_cpu=True)


def _args(inp):
    x, idx, wt, w1, w2, b1, b2 = inp
    b = {} if b1 is None else dict(b1=[t.float().contiguous() for t in b1], b2=[t.float().contiguous() for t in b2])
    return (x, [i.int().contiguous() for i in idx], [w.float().contiguous() for w in wt], w1, w2), b


CASES = [
    (dict(ep=2, experts=4), [16, 16], "random"),
    (dict(ep=3, experts=6, shared_experts=1), [5, 16, 9], "random"),
    (dict(), [16, 16, 16, 16], "random"),
    (dict(shared_experts=1), [16, 0, 7, 1], "random"),                   # a rank with no tokens, T = 1
    (dict(ep=2, experts=4, topk=2), [1, 1], "random"),
    (dict(shared_experts=1, bias=True, activation="swiglu_oai", gate_up_layout="interleaved"), [9, 16, 3, 5],
     "random"),
    (dict(shared_experts=2), [16, 16, 16, 16], "one_rank"),             # skewed: every slot on rank 0's experts
    (dict(ep=3, experts=6), [0, 12, 0], "one_rank"),
    (dict(ep=4, experts=16, topk=4, swiglu_limit=1.0), [4, 3, 2, 1], "random"),
]


@pytest.mark.parametrize("kw,tokens,routing", CASES)
@pytest.mark.parametrize("gather", [False, True])
def test_ep_layer_equals_the_gathered_single_gpu_layer(kw, tokens, routing, gather):
    spec = _spec(**kw)
    bm = 8
    inp = _inputs(spec, tokens, seed=1, routing=routing)
    args, b = _args(inp)
    y = _ep_layer(spec, bm, gather)(*args, **b)
    assert [t.shape[0] for t in y] == tokens and all(t.dtype == torch.bfloat16 for t in y)
    y_single, y64 = _gathered_layer(spec, inp, bm)
    assert torch.equal(torch.cat(y), y_single)                     # same rows, same GEMMs, same sum order
    if y64.numel():
        assert R.rel_err(torch.cat(y).double(), y64) < 2e-2         # bf16 rounding of h, ys, y
    y_ref = ep.forward_ep(*inp[:5], spec, inp[5], inp[6], bm=bm)   # the float64 protocol
    if y64.numel():
        assert ep.check_gathered(y_ref, y64) < 1e-12


def test_rank_order_does_not_change_a_bit():
    spec = _spec(shared_experts=1)
    inp = _inputs(spec, [16, 9, 0, 12], seed=5)
    args, b = _args(inp)
    moe = _ep_layer(spec, 8)
    base = moe(*args, **b)
    for order in ([3, 2, 1, 0], [2, 0, 3, 1], [1, 3, 0, 2]):
        again = moe(*args, **b, order=order)
        assert all(torch.equal(u, v) for u, v in zip(base, again)), order
    with pytest.raises(MoEInputError, match="permutation"):
        moe(*args, **b, order=[0, 0, 1, 2])


@pytest.mark.parametrize("tokens,routing", [([16, 0, 7, 1], "random"), ([16, 16, 16, 16], "one_rank"), ([1, 0, 0, 0],
                                                                                                       "random")])
def test_ep_routing_is_the_dispatch_layout(tokens, routing):
    """The routing step (reference kernel, through peer addresses) of every destination: its routed rows are
    dispatch_layout's rows (source rank, slot t * K + k, weight) with the same group starts and padding, its
    shared rows are its own tokens, its slot map points at the combine buffer's rows."""
    spec = _spec(shared_experts=1)
    c = R.layer_config(spec)
    bm, K, L, S = 8, c.topk, c.local_experts, c.shared_experts
    _, idx, wt, *_ = _inputs(spec, tokens, seed=3, routing=routing)
    idx = [i.int().contiguous() for i in idx]
    wt = [w.float().contiguous() for w in wt]
    lay = ep.dispatch_layout(idx, L, bm)
    fns = ep_ops.reference_ep_kernels(spec, bm)
    idxs, wts = ep_ops.PeerBuffers(idx), ep_ops.PeerBuffers(wt)
    for d in range(c.ep):
        cap = ep_ops.recv_capacity(tokens, tokens[d], c, bm)
        rr, rs = torch.full((cap,), 99, dtype=torch.int32), torch.full((cap,), 99, dtype=torch.int32)
        rw, tg = torch.full((cap,), 9.0), torch.full((cap // bm,), 99, dtype=torch.int32)
        meta, sp = torch.zeros(4, dtype=torch.int32), torch.full((tokens[d], K + S), 99, dtype=torch.int32)
        fns["ep_routing"](idxs.ptrs, wts.ptrs, torch.tensor(tokens, dtype=torch.int32), d, rr, rs, rw, tg, meta, sp)
        rows = lay.rows[d]
        n = len(rows)
        assert int(meta[2]) == n and int(meta[1]) == 0
        got = [(int(a), int(b) // K, int(b) % K) if a >= 0 else (-1, -1, -1) for a, b in zip(rr[:n], rs[:n])]
        assert got == [r[:3] for r in rows]
        for i, (s, t, k, _) in enumerate(rows):
            assert float(rw[i]) == (float(wt[s][t, k]) if s >= 0 else 0.0)
        starts = lay.group_start[d]
        for e in range(L):
            assert (tg[starts[e] // bm:starts[e + 1] // bm] == e).all()
        sh = -(-tokens[d] // bm) * bm
        assert int(meta[0]) * bm == n + S * sh and (tg[int(meta[0]):] == -1).all()
        assert (rr[n:n + tokens[d]] == d).all() and torch.equal(rs[n:n + tokens[d]].long(),
                                                                torch.arange(tokens[d]) * K)
        assert (rr[n + tokens[d]:n + sh] == -1).all() and (rw[n:n + tokens[d]] == 1).all()
        assert torch.equal(sp[:, :K].long().flatten(), torch.arange(tokens[d] * K))
        assert torch.equal(sp[:, K].long(), tokens[d] * K + n + torch.arange(tokens[d]))


def test_ids_out_of_range_add_nothing_and_are_reported():
    spec = _spec(ep=2, experts=4, shared_experts=1)
    inp = list(_inputs(spec, [6, 5], seed=7))
    inp[1] = [i.clone() for i in inp[1]]
    inp[1][0][2, 1] = 4          # R * L: no rank has it
    inp[1][1][0, 0] = -1
    args, b = _args(inp)
    moe = _ep_layer(spec, 8)
    y = moe(*args, **b)
    assert int(moe.last_meta[0][1]) == 1 and int(moe.last_meta[1][3]) == 2
    y_single, _ = _gathered_layer(spec, inp, 8)   # the single-GPU layer drops the same slots
    assert torch.equal(torch.cat(y), y_single)
    with pytest.raises(RoutingError, match="2 top-k id"):
        moe(*args, **b, check=True)
    # without check=True the calls count them on the device; check_errors reports the sum once, then clears
    with pytest.raises(RoutingError, match="2 top-k id"):
        moe.check_errors()   # the first call's; the check=True call reported its own and is not counted
    moe(*args, **b)
    moe(*args, **b)
    with pytest.raises(RoutingError, match="4 top-k id"):
        moe.check_errors()
    moe.check_errors()
    good = list(_inputs(spec, [6, 5], seed=7))
    moe(*_args(good)[0], **_args(good)[1])
    moe.check_errors()   # in range: nothing to report


def test_inputs_are_checked():
    spec = _spec(ep=2, experts=4)
    args, b = _args(_inputs(spec, [4, 4]))
    moe = _ep_layer(spec, 8)
    with pytest.raises(MoEInputError, match="one tensor per rank"):
        moe(args[0][:1], *args[1:])
    bad = list(args)
    bad[1] = [args[1][0].long(), args[1][1]]
    with pytest.raises(MoEInputError, match="rank 0's topk_idx must be a contiguous torch.int32"):
        moe(*bad)
    with pytest.raises(RuntimeError, match="no registered peer buffer"):
        ep_ops.ref_ep_dispatch(torch.tensor([12345]), torch.zeros(8, dtype=torch.int32),
                               torch.zeros(8, dtype=torch.int32), torch.tensor([1, 0, 8, 0], dtype=torch.int32),
                               torch.empty(8, 128, dtype=torch.bfloat16), topk=2, bm=8)


def test_recv_capacity_is_the_worst_case():
    """Every slot of every rank routed to one rank's experts (a token's ids distinct: min(K, L) per token) fits."""
    spec = _spec(ep=3, experts=6, topk=4, shared_experts=1)   # L = 2 < K = 4: at most 2 slots per token per rank
    c = R.layer_config(spec)
    for tokens in ([16, 16, 16], [0, 1, 30]):
        for d in range(3):
            cap = ep_ops.recv_capacity(tokens, tokens[d], c, 8)
            worst = sum(tokens) * 2 + tokens[d] + 3 * 7
            assert cap == -(-worst // 8) * 8
    # a routing that reaches it: every token's 4 ids over ranks 0..1's experts, 2 on rank 0
    idx = [torch.tensor([[0, 1, 2, 3]] * t, dtype=torch.int32).reshape(t, 4) for t in (16, 16, 16)]
    lay = ep.dispatch_layout(idx, 2, 8)
    assert len(lay.rows[0]) + 16 + 0 <= ep_ops.recv_capacity([16, 16, 16], 16, c, 8)


@pytest.mark.slow
def test_ep_kernels_compile_for_sm90a(tmp_path):
    """The three EP kernels of a small ep = 4 spec and of kimi-k2 (ep 64) compile for sm_90a: peer base addresses
    loaded as 64-bit values, 16-byte row loads and stores, the routing's warp matching and shared atomics."""
    pytest.importorskip("cutlass")
    from mokgen import build
    from mokgen.emit import emit
    from mokgen.plan import solve
    from mokgen.spec import load_spec

    for spec in (Spec(name="ep-c", hidden=256, ffn=128, experts=8, topk=2, ep=4, tokens=64, shared_experts=1),
                 load_spec("kimi-k2")):
        src = emit(solve(spec, "sm_90a"))
        files = {n: t for n, t in src.files.items() if n.startswith("ep_")}
        assert sorted(files) == ["ep_dispatch.py", "ep_push.py", "ep_routing.py"]
        assert f"RANKS = {spec.ep}" in files["ep_routing.py"]
        art = build.build(files, "sm_90a", tmp_path / spec.name, progress=False)
        assert sorted(art.kernels) == ["ep_dispatch", "ep_push", "ep_routing"]
        ptx = {k: (Path(art.dir) / f"{k}.ptx").read_text() for k in art.kernels}
        for k in ("ep_dispatch", "ep_push"):
            assert "ld.global.b64" in ptx[k] and re.search(r"ld\.global(\.nc)?\.v4", ptx[k]), k
            assert re.search(r"st\.global\.v4", ptx[k]), k
        assert "match.any.sync" in ptx["ep_routing"] and "atom.shared" in ptx["ep_routing"]
        assert ".target sm_90a" in ptx["ep_routing"]


def test_emit_renders_ep_kernels_only_for_ep_above_one():
    from mokgen.emit import emit
    from mokgen.plan import solve

    one = emit(solve(Spec(name="ep1", hidden=256, ffn=128, experts=8, topk=2, ep=1, tokens=64), "sm_90a"))
    assert not [n for n in one.files if n.startswith("ep_")]
    four = emit(solve(Spec(name="ep4", hidden=256, ffn=128, experts=8, topk=2, ep=4, tokens=64), "sm_90a"))
    assert {"ep_routing.py", "ep_dispatch.py", "ep_push.py"} <= set(four.files)
    assert "LOCAL = 2" in four.files["ep_routing.py"] and "TOPK = 2" in four.files["ep_dispatch.py"]


def test_permutations_of_three_ranks():
    """R = 3: all six phase orders give the same bits."""
    spec = _spec(ep=3, experts=6, shared_experts=1)
    args, b = _args(_inputs(spec, [7, 0, 11], seed=11))
    moe = _ep_layer(spec, 8)
    outs = [moe(*args, **b, order=list(p)) for p in itertools.permutations(range(3))]
    assert all(torch.equal(torch.cat(o), torch.cat(outs[0])) for o in outs)


def _train_layer(spec, bm):
    return ep_ops.EPMoE(spec, SimpleNamespace(bm=bm, gemm1=SimpleNamespace(a_load="gather")),
                        functions=ep_ops.reference_ep_kernels(spec, bm, training=True), allow_cpu=True)


@pytest.mark.parametrize("kw,tokens,routing", CASES)
def test_ep_backward_equals_the_gathered_single_gpu_backward(kw, tokens, routing):
    """A training step of R simulated ranks (forward_train, then backward: dO pulled like x, dx pushed like y,
    each row's router gradient sent to its owner's slot) against the single-GPU layer's training step on the
    gathered problem (the same reference kernels): y, dx, the router-weight gradient and every routed expert's
    dW1 / dW2 bit for bit (bias specs: the router gradient's <dO, b2> term is a matmul of another shape, so
    within float32 rounding); a shared expert's replicas' gradients summed over the ranks within bf16 rounding of
    the single layer's."""
    spec = _spec(**kw)
    c = R.layer_config(spec)
    bm, L, S, n = 8, c.local_experts, c.shared_experts, c.ep
    inp = _inputs(spec, tokens, seed=2, routing=routing)
    args, b = _args(inp)
    g = torch.Generator().manual_seed(11)
    dy = [torch.randn(t, c.hidden, generator=g).bfloat16() for t in tokens]
    moe = _train_layer(spec, bm)
    y, saved = moe.forward_train(*args, **b)
    grads = moe.backward(dy, saved, args[0], args[3], args[4], **b)

    gx, gi, gw, W1, W2, B1, B2, cfg = ep.gather_problem(*inp[:5], spec, inp[5], inp[6])
    single = CompiledMoE(cfg, bm, functions=R.reference_kernels(cfg, bm, training=True), allow_cpu=True)
    bb = {} if B1 is None else dict(b1=B1.float().contiguous(), b2=B2.float().contiguous())
    ys, sv = single.forward_train(gx.contiguous(), gi.int().contiguous(), gw.float().contiguous(), W1.contiguous(),
                                  W2.contiguous(), **bb)
    gs = single.backward(torch.cat(dy), sv, gx.contiguous(), gw.float().contiguous(), W1.contiguous(),
                         W2.contiguous(), **bb)
    assert torch.equal(torch.cat(y), ys)
    assert torch.equal(torch.cat([r.x for r in grads]), gs.x)
    dtw = torch.cat([r.topk_weight for r in grads])
    if B1 is None:
        assert torch.equal(dtw, gs.topk_weight)
    else:
        assert torch.allclose(dtw, gs.topk_weight, rtol=1e-5, atol=1e-5)
    for d in range(n):
        assert torch.equal(grads[d].w1[:L], gs.w1[d * L:(d + 1) * L]), d
        assert torch.equal(grads[d].w2[:L], gs.w2[d * L:(d + 1) * L]), d
        if B1 is not None:
            assert torch.allclose(grads[d].b1[:L], gs.b1[d * L:(d + 1) * L], rtol=1e-5, atol=1e-5)
            assert torch.allclose(grads[d].b2[:L], gs.b2[d * L:(d + 1) * L], rtol=1e-5, atol=1e-5)
    for j in range(S):   # the replicas' gradients add up to the single layer's (other summation order)
        for name in ("w1", "w2"):
            tot = sum(getattr(grads[d], name)[L + j].float() for d in range(n))
            want = getattr(gs, name)[n * L + j].float()
            if want.abs().max() > 0:
                assert R.rel_err(tot.double(), want.double()) < 2e-2, (name, j)
    # and a second run gives the same bits, the ranks run in another order
    y2, saved2 = moe.forward_train(*args, **b, order=list(reversed(range(n))))
    grads2 = moe.backward(dy, saved2, args[0], args[3], args[4], **b, order=list(reversed(range(n))))
    for u, v in zip(grads, grads2):
        for name in ("x", "topk_weight", "w1", "w2", "b1", "b2"):
            a1, a2 = getattr(u, name), getattr(v, name)
            assert (a1 is None and a2 is None) or torch.equal(a1, a2), name


def test_ep_forward_train_needs_the_training_kernels():
    spec = _spec()
    inp = _inputs(spec, [4, 4, 4, 4], seed=3)
    args, b = _args(inp)
    with pytest.raises(RuntimeError, match="cannot train"):
        _ep_layer(spec, 8).forward_train(*args, **b)
