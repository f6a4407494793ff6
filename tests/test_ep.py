"""Expert parallelism's plan and reference protocol (mokgen/ep.py) on the CPU: the EP layer by pull-dispatch /
push-combine equals the single-GPU reference on the gathered problem, for skewed routings, ranks with zero
tokens, T = 1, shared experts, biases and both gate/up layouts; the dispatch order is deterministic; the sizes."""

import pytest
import torch

from mokgen import ep
from mokgen import reference as R
from mokgen.plan import solve
from mokgen.spec import Spec, load_spec


def _spec(**kw):
    base = dict(name="ep-t", hidden=128, ffn=64, experts=8, topk=2, ep=4, tokens=16)
    return Spec(**{**base, **kw})


def _inputs(spec, tokens, seed=0, routing="random"):
    """Per rank: x, global top-k ids (distinct per token), softmax weights; per rank's groups: its L experts then
    the S shared ones (the same shared weights on every rank: replicated)."""
    c = R.layer_config(spec)
    g = torch.Generator().manual_seed(seed)
    ranks, L, S, K, H, I = c.ep, c.local_experts, c.shared_experts, c.topk, c.hidden, c.ffn
    E = ranks * L
    x, idx, wt = [], [], []
    for T in tokens:
        x.append(torch.randn(T, H, generator=g).bfloat16())
        if routing == "one_rank":   # every slot to rank 0's experts (needs K <= L)
            ids = torch.stack([torch.randperm(L, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K)
        else:
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K)
        idx.append(ids.int())
        wt.append(torch.softmax(torch.randn(T, K, generator=g), -1))
    shared1 = torch.randn(S, 2 * I, H, generator=g) / H ** 0.5
    shared2 = torch.randn(S, H, I, generator=g) / I ** 0.5
    w1 = [torch.cat([torch.randn(L, 2 * I, H, generator=g) / H ** 0.5, shared1]).bfloat16() for _ in tokens]
    w2 = [torch.cat([torch.randn(L, H, I, generator=g) / I ** 0.5, shared2]).bfloat16() for _ in tokens]
    b1 = b2 = None
    if c.bias:
        sb1, sb2 = torch.randn(S, 2 * I, generator=g) * 0.1, torch.randn(S, H, generator=g) * 0.1
        b1 = [torch.cat([torch.randn(L, 2 * I, generator=g) * 0.1, sb1]) for _ in tokens]
        b2 = [torch.cat([torch.randn(L, H, generator=g) * 0.1, sb2]) for _ in tokens]
    return x, idx, wt, w1, w2, b1, b2


CASES = [
    (dict(), [16, 16, 16, 16], "random"),
    (dict(shared_experts=1), [16, 0, 7, 1], "random"),                   # a rank with no tokens, T = 1
    (dict(ep=2, experts=4, topk=2), [1, 1], "random"),
    (dict(shared_experts=1, bias=True, activation="swiglu_oai", gate_up_layout="interleaved"), [9, 16, 3, 5],
     "random"),
    (dict(), [16, 16, 16, 16], "one_rank"),                              # skewed: every slot on rank 0
    (dict(ep=8, experts=16, topk=4, swiglu_limit=1.0), [4] * 8, "random"),
]


@pytest.mark.parametrize("kw,tokens,routing", CASES)
def test_ep_equals_the_gathered_single_gpu_layer(kw, tokens, routing):
    spec = _spec(**kw)
    inp = _inputs(spec, tokens, routing=routing)
    y_ep = ep.forward_ep(*inp[:5], spec, inp[5], inp[6], bm=8)
    assert [y.shape[0] for y in y_ep] == tokens
    gx, gi, gw, W1, W2, B1, B2, cfg = ep.gather_problem(*inp[:5], spec, inp[5], inp[6])
    y_single = R.forward(gx, gi, gw, W1, W2, cfg, B1, B2)
    assert ep.check_gathered(y_ep, y_single) < 1e-12


def test_dispatch_layout_is_deterministic_and_complete():
    spec = _spec(shared_experts=1)
    _, idx, *_ = _inputs(spec, [16, 0, 7, 1], seed=3)
    lay = ep.dispatch_layout(idx, 2, bm=8)
    assert lay.rows == ep.dispatch_layout([i.clone() for i in idx], 2, bm=8).rows
    for d, rows in enumerate(lay.rows):
        assert len(rows) % 8 == 0 and lay.group_start[d][-1] == len(rows)
        for e in range(2):   # each group: its slots, by source rank then (t, k), then padding
            real = [r for r in rows[lay.group_start[d][e]:lay.group_start[d][e + 1]] if r[0] >= 0]
            assert real == sorted(real) and all(r[3] == e for r in real)
    for s, i in enumerate(idx):   # every slot lands exactly once, at its recv_pos
        for t in range(i.shape[0]):
            for k in range(i.shape[1]):
                d = int(i[t, k]) // 2
                assert lay.rows[d][int(lay.recv_pos[s][t, k])][:3] == (s, t, k)
    with pytest.raises(ValueError, match="rank 0's topk_idx has ids outside"):
        ep.dispatch_layout([torch.tensor([[8]])], 2, bm=8)


@pytest.mark.parametrize("name", ["kimi-k2", "deepseek-v3"])
def test_ep_plan_sizes(name):
    spec = load_spec(name)
    plan = solve(spec)
    p = ep.plan_ep(spec, plan)
    assert p.ranks == spec.ep and p.local_experts == spec.experts // spec.ep
    assert p.worst_rows == spec.ep * spec.tokens * min(spec.topk, p.local_experts)
    assert p.recv_rows >= p.worst_rows + p.local_experts * (plan.bm - 1) and p.recv_rows % plan.bm == 0
    assert p.chunk_rows == plan.chunk_rows   # >= 2 SM waves of each GEMM's tiles (the single-GPU plan's rule)
    assert p.ring_rows * p.bytes_per_row <= ep.RING_BYTES_MAX
    assert not p.whole   # 64 ranks' worst case does not fit a 4 GiB ring: back-pressure per chunk
    small = ep.plan_ep(_spec(), solve(_spec()))
    assert small.whole and small.ring_rows >= small.recv_rows
    assert any("worst case" in line for line in p.describe())
