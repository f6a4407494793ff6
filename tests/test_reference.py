"""mokgen.reference: the ground truth, checked against an independent per-token loop and float64 autograd."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("mokgen") is None:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mokgen import reference as ref  # noqa: E402
from mokgen import spec as spec_mod  # noqa: E402
from mokgen.reference import LayerConfig, layer_config, rel_err  # noqa: E402

F64 = torch.float64

# (activation, swiglu_limit): the limit values are small enough that the clamps really fire on N(0, 1) data
ACTS = [("swiglu", None), ("swiglu", 0.5), ("swiglu_oai", None), ("swiglu_oai", 0.8)]
LAYOUTS = ["concat", "interleaved"]


def cfg_of(activation="swiglu", limit=None, layout="concat", bias=False, shared=0, H=16, I=8, E=4, K=2, T=12,
           ep=1):
    return LayerConfig(hidden=H, ffn=I, experts=E * ep, ep=ep, topk=K, tokens=T, shared_experts=shared,
                       activation=activation, swiglu_limit=limit, gate_up_layout=layout, bias=bias)


def naive_forward(x, idx, w, w1, w2, b1, b2, cfg):
    """An independent per-(token, slot) loop in float64, written straight from docs/contract.md."""
    T, H = x.shape
    G, I2, _ = w1.shape
    I = I2 // 2
    S = cfg.shared_experts
    E = G - S
    x, w, w1, w2 = x.double(), w.double(), w1.double(), w2.double()
    b1 = b1.double() if b1 is not None else torch.zeros(G, I2, dtype=F64)
    b2 = b2.double() if b2 is not None else torch.zeros(G, H, dtype=F64)
    if cfg.activation == "swiglu_oai":
        L = 7.0 if cfg.swiglu_limit is None else cfg.swiglu_limit
    else:
        L = cfg.swiglu_limit

    def expert(e, xt):
        z = w1[e] @ xt + b1[e]
        if cfg.gate_up_layout == "concat":
            gate = z[:I]
            up = z[I:]
        else:
            gate = torch.stack([z[2 * j] for j in range(I)])
            up = torch.stack([z[2 * j + 1] for j in range(I)])
        if L is not None:
            gate = torch.minimum(gate, torch.full_like(gate, L))
            up = torch.maximum(torch.minimum(up, torch.full_like(up, L)), torch.full_like(up, -L))
        if cfg.activation == "swiglu_oai":
            a = gate * (1.0 / (1.0 + torch.exp(-1.702 * gate))) * (up + 1.0)
        else:
            a = gate / (1.0 + torch.exp(-gate)) * up
        return w2[e] @ a + b2[e]

    y = torch.zeros(T, H, dtype=F64)
    for t in range(T):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if 0 <= e < E:
                y[t] += w[t, k] * expert(e, x[t])
        for s in range(S):
            y[t] += expert(E + s, x[t])
    return y


def inputs_of(cfg, seed=0, routing="random"):
    return ref.random_inputs(cfg, device="cpu", seed=seed, routing=routing)


COMBOS = [(a, lim, lay, bias, S) for (a, lim) in ACTS for lay in LAYOUTS for bias in (False, True) for S in (0, 1, 2)]


@pytest.mark.parametrize("activation,limit,layout,bias,shared", COMBOS)
def test_forward_backward_every_combo(activation, limit, layout, bias, shared):
    cfg = cfg_of(activation, limit, layout, bias, shared)
    inp = inputs_of(cfg, seed=hash((activation, limit, layout, bias, shared)) % 1000)
    x, idx, w, w1, w2, b1, b2 = inp
    assert (b1 is not None) == bias
    y64 = ref.forward(x, idx, w, w1, w2, cfg, b1, b2)
    assert y64.dtype == F64 and y64.shape == (cfg.tokens, cfg.hidden)
    # independent formula
    assert rel_err(y64, naive_forward(x, idx, w, w1, w2, b1, b2, cfg)) < 1e-12
    # float32 reference vs float64
    y32 = ref.forward(x, idx, w, w1, w2, cfg, b1, b2, dtype=torch.float32)
    assert y32.dtype == torch.float32
    assert rel_err(y32, y64) < 1e-5
    # output dtype
    assert ref.forward(x, idx, w, w1, w2, cfg, b1, b2, out_dtype=torch.bfloat16).dtype == torch.bfloat16
    # backward: hand-written == autograd in float64; float32 hand-written close
    dy = torch.randn(cfg.tokens, cfg.hidden, dtype=F64, generator=torch.Generator().manual_seed(7))
    g_auto = ref.backward_autograd(dy, x, idx, w, w1, w2, cfg, b1, b2)
    g_hand = ref.backward(dy, x, idx, w, w1, w2, cfg, b1, b2)
    g_32 = ref.backward(dy, x, idx, w, w1, w2, cfg, b1, b2, dtype=torch.float32)
    for name in ref.Grads._fields:
        a, h, h32 = getattr(g_auto, name), getattr(g_hand, name), getattr(g_32, name)
        if name in ("b1", "b2") and not bias:
            assert a is None and h is None and h32 is None
            continue
        assert h.shape == a.shape and h.dtype == F64, name
        assert rel_err(h, a) < 1e-10, name
        assert rel_err(h32, a) < 1e-4, name


def test_clamps_fire():
    """The limit configs above really exercise the clamp branches (else the combo test proves little)."""
    cfg = cfg_of("swiglu", 0.5)
    x, idx, w, w1, w2, b1, b2 = inputs_of(cfg)
    z = x.double() @ w1[0].double().t()
    assert (z[:, :cfg.ffn] > 0.5).any() and (z[:, cfg.ffn:].abs() > 0.5).any()


def test_dS_is_inner_product_with_expert_output():
    """dS[t,k] = <dy_t, W2[e] a + b2[e]> (the routing-weight gradient's definition)."""
    cfg = cfg_of("swiglu_oai", None, "interleaved", True, 1, T=5)
    x, idx, w, w1, w2, b1, b2 = inputs_of(cfg, seed=3)
    dy = torch.randn(cfg.tokens, cfg.hidden, dtype=F64)
    g = ref.backward(dy, x, idx, w, w1, w2, cfg, b1, b2)
    for t in range(cfg.tokens):
        for k in range(cfg.topk):
            one = torch.zeros_like(w)
            one[t, k] = 1.0
            e = int(idx[t, k])
            # output of expert e alone for token t = forward with a one-hot weight, minus the shared part
            only = ref.forward(x[t:t + 1], idx[t:t + 1], one[t:t + 1], w1, w2, cfg, b1, b2)
            shared = ref.forward(x[t:t + 1], idx[t:t + 1], torch.zeros_like(one[t:t + 1]), w1, w2, cfg, b1, b2)
            o = (only - shared)[0]
            assert e >= 0
            assert math.isclose(float(g.topk_weight[t, k]), float(dy[t] @ o), rel_tol=1e-9, abs_tol=1e-12)


def test_out_of_range_slots_are_dropped():
    cfg = cfg_of(shared=1, bias=True)
    x, idx, w, w1, w2, b1, b2 = inputs_of(cfg, seed=5)
    bad = idx.clone()
    bad[0, 0] = cfg.local_experts        # just past the end
    bad[3, 1] = -1
    w0 = w.clone()
    w0[0, 0] = 0.0
    w0[3, 1] = 0.0
    ok = idx.clone()
    ok[0, 0] = 0
    ok[3, 1] = 0
    y_bad = ref.forward(x, bad, w, w1, w2, cfg, b1, b2)
    y_ref = ref.forward(x, ok, w0, w1, w2, cfg, b1, b2)
    assert rel_err(y_bad, y_ref) < 1e-14
    assert rel_err(y_bad, naive_forward(x, bad, w, w1, w2, b1, b2, cfg)) < 1e-12
    dy = torch.randn_like(y_bad)
    g = ref.backward(dy, x, bad, w, w1, w2, cfg, b1, b2)
    ga = ref.backward_autograd(dy, x, bad, w, w1, w2, cfg, b1, b2)
    assert g.topk_weight[0, 0] == 0 and g.topk_weight[3, 1] == 0
    for name in ("x", "topk_weight", "w1", "w2", "b1", "b2"):
        assert rel_err(getattr(g, name), getattr(ga, name)) < 1e-10


def test_topk_above_local_experts_samples_with_replacement():
    cfg = cfg_of(E=3, K=5, T=40, ep=2, shared=1)   # 6 experts over ep 2 -> 3 local, top-5
    assert cfg.local_experts == 3
    x, idx, w, w1, w2, b1, b2 = inputs_of(cfg, seed=11)
    assert idx.shape == (40, 5) and int(idx.min()) >= 0 and int(idx.max()) < 3
    assert any(len(set(r)) < 5 for r in idx.tolist())   # duplicates are unavoidable
    y = ref.forward(x, idx, w, w1, w2, cfg)
    assert rel_err(y, naive_forward(x, idx, w, w1, w2, b1, b2, cfg)) < 1e-12
    dy = torch.randn_like(y)
    g, ga = ref.backward(dy, x, idx, w, w1, w2, cfg), ref.backward_autograd(dy, x, idx, w, w1, w2, cfg)
    for name in ("x", "topk_weight", "w1", "w2"):
        assert rel_err(getattr(g, name), getattr(ga, name)) < 1e-10


def test_zero_tokens():
    cfg = cfg_of(shared=1, T=0)
    x, idx, w, w1, w2, b1, b2 = inputs_of(cfg)
    assert x.shape == (0, cfg.hidden) and idx.shape == (0, cfg.topk)
    assert ref.forward(x, idx, w, w1, w2, cfg).shape == (0, cfg.hidden)
    g = ref.backward(torch.zeros(0, cfg.hidden), x, idx, w, w1, w2, cfg)
    assert g.x.shape == (0, cfg.hidden) and float(g.w1.abs().sum()) == 0.0


@pytest.mark.parametrize("routing", ref.ROUTING_MODES)
@pytest.mark.parametrize("E,K", [(8, 2), (8, 8), (3, 5)])
def test_routing_modes_valid(routing, E, K):
    cfg = cfg_of(E=E, K=K, T=200, bias=True, shared=1)
    x, idx, w, w1, w2, b1, b2 = inputs_of(cfg, seed=2, routing=routing)
    G = E + 1
    assert x.dtype == w1.dtype == w2.dtype == torch.bfloat16
    assert x.shape == (200, 16) and w1.shape == (G, 16, 16) and w2.shape == (G, 16, 8)
    assert b1.shape == (G, 16) and b2.shape == (G, 16) and b1.dtype == b2.dtype == torch.float32
    assert idx.dtype == torch.int32 and idx.shape == (200, K) and idx.is_contiguous()
    assert int(idx.min()) >= 0 and int(idx.max()) < E
    assert w.dtype == torch.float32 and w.shape == (200, K) and bool((w > 0).all())
    assert torch.allclose(w.sum(1), torch.ones(200))
    counts = torch.bincount(idx.reshape(-1).long(), minlength=E)
    rows = idx.tolist()
    if routing == "one_expert":
        assert bool((idx == E - 1).all())
    elif routing == "empty_experts":
        assert int(counts[0::2].sum()) == 0 and int(counts[1::2].min()) > 0
    else:
        if K <= E:
            assert all(len(set(r)) == K for r in rows), "experts must be distinct per token when K <= E"
        if routing == "skewed" and K < E:
            assert int(counts.max()) > 1.5 * int(counts.min())
        if routing == "random" and K < E:
            assert int(counts.min()) > 0
    # deterministic per seed, different across seeds
    again = inputs_of(cfg, seed=2, routing=routing)
    assert torch.equal(again.x, x) and torch.equal(again.topk_idx, idx) and torch.equal(again.w1, w1)
    other = inputs_of(cfg, seed=3, routing=routing)
    assert not torch.equal(other.x, x)


def test_weight_scale():
    cfg = cfg_of(H=256, I=128, E=2, K=1, T=64)
    x, idx, w, w1, w2, b1, b2 = inputs_of(cfg)
    assert abs(float(x.float().std()) - 1.0) < 0.1
    assert abs(float(w1.float().std()) * math.sqrt(256) - 1.0) < 0.1
    assert abs(float(w2.float().std()) * math.sqrt(128) - 1.0) < 0.1


def test_random_inputs_rejects_unknown_routing():
    with pytest.raises(ValueError, match="routing must be one of"):
        inputs_of(cfg_of(), routing="zipf")


def test_rel_err():
    b = torch.tensor([3.0, 4.0])
    assert rel_err(b, b) == 0.0
    assert math.isclose(rel_err(b + torch.tensor([0.3, 0.4]), b), 0.1, rel_tol=1e-6)
    assert rel_err(torch.zeros(2), torch.zeros(2)) == 0.0
    assert math.isnan(rel_err(torch.tensor([float("nan"), 0.0]), b))
    assert rel_err(torch.ones(2, dtype=torch.bfloat16), torch.ones(2, dtype=F64)) == 0.0


def test_layer_config_accepts_mappings_and_objects():
    d = dict(hidden=64, ffn=32, experts=16, ep=4, topk=2, shared_experts=1, activation="swiglu_oai",
             gate_up_layout="interleaved", bias=True, name="x", swiglu_limit=None)
    c = layer_config(d)
    assert (c.local_experts, c.groups, c.limit) == (4, 5, 7.0)

    class Obj:
        pass

    o = Obj()
    o.__dict__.update(d)
    assert layer_config(o) == c
    assert layer_config(dict(d, activation="swiglu")).limit is None
    assert layer_config(dict(d, activation="swiglu", swiglu_limit=10)).limit == 10.0
    with pytest.raises(ValueError, match="activation"):
        layer_config(dict(d, activation="gelu"))
    with pytest.raises(ValueError, match="gate_up_layout"):
        layer_config(dict(d, gate_up_layout="split"))


def test_presets_map_to_layer_config():
    specs = spec_mod.list_presets()
    assert specs
    for s in specs:
        c = layer_config(s)
        assert (c.hidden, c.ffn, c.topk, c.shared_experts) == (s.hidden, s.ffn, s.topk, s.shared_experts)
        assert c.local_experts == s.local_experts and c.groups == s.groups
        assert c.activation == s.activation and c.gate_up_layout == s.gate_up_layout and c.bias == s.bias
        assert layer_config(s.name) == c


# ---- reference kernels (the workspace contract) --------------------------------------------------------------


def run_routing(cfg, idx, w, bm, ws=None):
    from mokgen.ops import Workspace

    ws = ws or Workspace.allocate(cfg, bm, idx.shape[0], "cpu")
    ref.ref_routing(idx, w, ws.row_src, ws.row_w, ws.tile_group, ws.meta, ws.slot_pos,
                    local_experts=cfg.local_experts, shared_experts=cfg.shared_experts, bm=bm)
    return ws


@pytest.mark.parametrize("routing", ref.ROUTING_MODES)
@pytest.mark.parametrize("shared", [0, 2])
def test_ref_routing_workspace_invariants(routing, shared):
    bm = 8
    cfg = cfg_of(E=5, K=3, T=37, shared=shared)
    _, idx, w, *_ = inputs_of(cfg, seed=1, routing=routing)
    ws = run_routing(cfg, idx, w, bm)
    T, K, E, S, G = 37, 3, 5, shared, 5 + shared
    counts = torch.bincount(idx.reshape(-1).long(), minlength=E).tolist() + [T] * S
    padded = [(c + bm - 1) // bm * bm for c in counts]
    used_tiles = sum(padded) // bm
    assert int(ws.meta[0]) == used_tiles and int(ws.meta[1]) == 0
    assert ws.tile_group[:used_tiles].tolist() == sum(([g] * (p // bm) for g, p in enumerate(padded)), [])
    assert bool((ws.tile_group[used_tiles:] == -1).all())
    off = 0
    for g in range(G):
        rows = list(range(off, off + counts[g]))
        pad = list(range(off + counts[g], off + padded[g]))
        if g < E:
            slots = [(t, k) for t in range(T) for k in range(K) if int(idx[t, k]) == g]   # (t, k) order
            assert [int(ws.row_src[r]) for r in rows] == [t for t, _ in slots]
            assert [float(ws.row_w[r]) for r in rows] == [float(w[t, k]) for t, k in slots]
            assert [int(ws.slot_pos[t, k]) for t, k in slots] == rows
        else:
            assert ws.row_src[off:off + T].tolist() == list(range(T))
            assert bool((ws.row_w[off:off + T] == 1).all())
            assert ws.slot_pos[:, K + g - E].tolist() == rows
        assert all(int(ws.row_src[r]) == 0 and float(ws.row_w[r]) == 0.0 for r in pad)
        off += padded[g]
    assert off <= ws.cap_rows and bool((ws.slot_pos >= 0).all())


def test_ref_routing_error_flag_is_sticky():
    bm = 4
    cfg = cfg_of(E=4, K=2, T=6)
    _, idx, w, *_ = inputs_of(cfg)
    bad = idx.clone()
    bad[2, 1] = 4
    ws = run_routing(cfg, bad, w, bm)
    assert int(ws.meta[1]) == 1 and int(ws.slot_pos[2, 1]) == -1
    assert int((ws.slot_pos >= 0).sum()) == 6 * 2 - 1
    run_routing(cfg, idx, w, bm, ws)            # a clean call does not clear the flag
    assert int(ws.meta[1]) == 1 and bool((ws.slot_pos >= 0).all())
