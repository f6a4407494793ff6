"""mokgen.reference.backward against central finite differences of mokgen.reference.forward, in float64, on tiny
shapes: every activation (swiglu, clamped swiglu with pre-activations inside the clamp region, swiglu_oai with
biases and the interleaved layout, its default limit of 7 reached), shared experts, top-k above the local expert
count, and an out-of-range slot. (tests/test_reference.py checks the hand-written backward against autograd;
this checks both against the definition of the derivative, independent of torch's autograd formulas.)
"""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("mokgen") is None:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mokgen import reference as ref  # noqa: E402
from mokgen.reference import LayerConfig  # noqa: E402

F64 = torch.float64
EPS = 1e-6           # central-difference step; truncation error O(EPS^2), roundoff O(1e-16 / EPS)
KINK_GAP = 1e-3      # no pre-activation within this distance of a clamp boundary (the derivative jumps there)


def cfg_of(activation="swiglu", limit=None, layout="concat", bias=False, shared=0, H=8, I=4, E=3, K=2, T=5,
           ep=1):
    return LayerConfig(hidden=H, ffn=I, experts=E * ep, ep=ep, topk=K, tokens=T, shared_experts=shared,
                       activation=activation, swiglu_limit=limit, gate_up_layout=layout, bias=bias)


CASES = {
    "swiglu": cfg_of(),
    "swiglu-clamped": cfg_of(limit=0.5),
    "swiglu-shared": cfg_of(shared=1),
    "swiglu-clamped-shared2-bias-interleaved": cfg_of(limit=0.6, layout="interleaved", bias=True, shared=2),
    "swiglu_oai-interleaved-bias": cfg_of("swiglu_oai", layout="interleaved", bias=True),
    "swiglu_oai-interleaved-bias-limit0.8-shared": cfg_of("swiglu_oai", 0.8, "interleaved", True, shared=1),
    "swiglu-topk-above-local-experts": cfg_of(E=2, K=3, ep=2, shared=1),
}
X_SCALE = {"swiglu_oai-interleaved-bias": 9.0}   # reach the default limit 7 with N(0, 1)-sized weights


def pre_activations(cfg, x, w1, b1):
    """z = W1[g] x_t + b1[g] for every token and every group: [G, T, 2I] (the forward computes a subset)."""
    z = torch.einsum("gnh,th->gtn", w1, x)
    if b1 is not None:
        z = z + b1[:, None, :]
    return z


def clamp_distances(cfg, z):
    """(distance of each pre-activation to its nearest clamp boundary, how many lie in the clamp region)."""
    lim = cfg.limit
    if lim is None:
        return torch.full((), float("inf"), dtype=F64), 0
    gate, up = ref._split_gate_up(z.reshape(-1, z.shape[-1]), cfg.gate_up_layout)
    d = torch.cat([(gate - lim).abs().flatten(), (up - lim).abs().flatten(), (up + lim).abs().flatten()])
    inside = int((gate > lim).sum() + (up.abs() > lim).sum())
    return d.min(), inside


def make_inputs(name, cfg):
    """float64 inputs (random_inputs' distributions), resampled until no pre-activation sits within KINK_GAP of a
    clamp boundary, and (for clamped configs) some lie in the clamp region."""
    for seed in range(100):
        inp = ref.random_inputs(cfg, seed=seed)
        x, idx, w, w1, w2, b1, b2 = (None if t is None else (t.to(F64) if t.is_floating_point() else t)
                                     for t in inp)
        x = x * X_SCALE.get(name, 1.0)
        dist, inside = clamp_distances(cfg, pre_activations(cfg, x, w1, b1))
        if float(dist) > KINK_GAP and (cfg.limit is None or inside >= 3):
            return x, idx, w, w1, w2, b1, b2
    raise AssertionError(f"{name}: no seed gives inputs away from the clamp kinks")


def finite_difference(f, t: torch.Tensor) -> torch.Tensor:
    """d f / d t by central differences, one element at a time (t is modified in place and restored)."""
    g = torch.empty_like(t)
    flat, gflat = t.view(-1), g.view(-1)
    for i in range(flat.numel()):
        v = flat[i].item()
        flat[i] = v + EPS
        fp = f()
        flat[i] = v - EPS
        fm = f()
        flat[i] = v
        gflat[i] = (fp - fm) / (2 * EPS)
    return g


def fd_grads(cfg, x, idx, w, w1, w2, b1, b2, dy):
    def loss():
        return float((ref.forward(x, idx, w, w1, w2, cfg, b1, b2, dtype=F64) * dy).sum())

    return ref.Grads(*(None if t is None else finite_difference(loss, t) for t in (x, w, w1, w2, b1, b2)))


def assert_close(got, want, what):
    assert got.shape == want.shape, what
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= 1e-7 * max(scale, 1.0), f"{what}: max |analytic - finite difference| {err:.2e} (scale {scale:.2e})"


@pytest.mark.parametrize("name", list(CASES))
def test_backward_matches_finite_differences(name):
    cfg = CASES[name]
    x, idx, w, w1, w2, b1, b2 = make_inputs(name, cfg)
    dy = torch.randn(cfg.tokens, cfg.hidden, dtype=F64, generator=torch.Generator().manual_seed(11))
    fd = fd_grads(cfg, x, idx, w, w1, w2, b1, b2, dy)
    hand = ref.backward(dy, x, idx, w, w1, w2, cfg, b1, b2)
    auto = ref.backward_autograd(dy, x, idx, w, w1, w2, cfg, b1, b2)
    for field in ref.Grads._fields:
        f, h, a = getattr(fd, field), getattr(hand, field), getattr(auto, field)
        if f is None:
            assert h is None and a is None, field
            continue
        assert h.dtype == F64
        assert_close(h, f, f"{name}: backward d{field}")
        assert_close(a, f, f"{name}: backward_autograd d{field}")
    if cfg.shared_experts:
        # the shared experts' weights really get gradients (every token visits them)
        assert hand.w1[-cfg.shared_experts:].abs().sum() > 0 and hand.w2[-cfg.shared_experts:].abs().sum() > 0


def test_clamp_region_gradient_is_zero():
    """Where the clamp is active the gate/up gradient vanishes: W1 rows that only ever see clamped values get no
    gradient from that token. Checked on one token and one expert, every gate/up unit."""
    cfg = cfg_of(limit=0.5, T=1, E=1, K=1)
    x, idx, w, w1, w2, b1, b2 = make_inputs("swiglu-clamped", cfg)
    dy = torch.randn(1, cfg.hidden, dtype=F64, generator=torch.Generator().manual_seed(5))
    g = ref.backward(dy, x, idx, w, w1, w2, cfg)
    z = (w1[0] @ x[0])
    gate, up = z[:cfg.ffn], z[cfg.ffn:]
    dgate_rows, dup_rows = g.w1[0, :cfg.ffn], g.w1[0, cfg.ffn:]
    for j in range(cfg.ffn):
        if gate[j] > cfg.limit:
            assert bool((dgate_rows[j] == 0).all()), f"gate unit {j} clamped but has a gradient"
        if up[j].abs() > cfg.limit:
            assert bool((dup_rows[j] == 0).all()), f"up unit {j} clamped but has a gradient"
    assert bool((gate > cfg.limit).any() or (up.abs() > cfg.limit).any()), "no unit clamped: test inputs wrong"


def test_out_of_range_slot_has_zero_gradient():
    """A slot with an invalid expert id contributes nothing: its weight's derivative is 0 (and so is what it
    would have added to dx), by finite differences as well."""
    cfg = cfg_of(shared=1)
    x, idx, w, w1, w2, b1, b2 = make_inputs("swiglu-shared", cfg)
    idx = idx.clone()
    idx[2, 1] = cfg.local_experts            # out of range
    idx[4, 0] = -1
    dy = torch.randn(cfg.tokens, cfg.hidden, dtype=F64, generator=torch.Generator().manual_seed(3))
    fd = fd_grads(cfg, x, idx, w, w1, w2, b1, b2, dy)
    g = ref.backward(dy, x, idx, w, w1, w2, cfg)
    assert fd.topk_weight[2, 1] == 0 and fd.topk_weight[4, 0] == 0
    assert g.topk_weight[2, 1] == 0 and g.topk_weight[4, 0] == 0
    for field in ("x", "topk_weight", "w1", "w2"):
        assert_close(getattr(g, field), getattr(fd, field), f"out-of-range: d{field}")
