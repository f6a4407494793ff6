"""mokgen's Megatron-core adapter (mokgen.integrations.megatron) on a CPU, with mokgen's reference kernels.

megatron-core 0.19.2 requires Python >= 3.12 (its only wheel is cp312) and does not install on this project's
Python 3.11 machines, so the modules checked here are the faithful copies of its experts' contract in
tests/framework_contracts.py (``TEGroupedMLP`` with TE GroupedLinear's per-expert ``weight{i}``,
``SequentialMLP`` with per-expert MLPs). Where megatron-core imports, the real classes' call signatures are
checked against the copies' too.

* forward and every gradient (x, permuted_probs, every fc1 / fc2 weight and bias) through ``apply`` against
  the module's own forward in float64 (rel. err <= 1e-2; with fewer than 8 rows d(probs) against the larger of
  its norm and the norm of its dot products' terms, see ``compare``): SwiGLU, clamped SwiGLU, the gpt-oss activation
  (quick_gelu, offset 1, clamp 7, biases), interleaved gate/up, ``moe_apply_probs_on_input``, empty experts, one
  expert, N = 1, counts on the host and as a list, bf16 parameters;
* the configurations mokgen does not compute raise UnsupportedExperts naming why.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect

import pytest
import torch
import torch.nn.functional as F

import framework_contracts as FC
import mokgen.integrations.megatron as mmc
from mokgen.integrations import grouped as G
from mokgen.reference import rel_err

TOL = 1e-2
H, FFN, E = 64, 64, 4


@pytest.fixture(autouse=True)
def reference_kernels():
    old = G.set_compiler(G.reference_compiler())
    yield
    G.set_compiler(old)


def config(**kw) -> FC.TransformerConfig:
    base = dict(hidden_size=H, moe_ffn_hidden_size=FFN, num_moe_experts=E, params_dtype=torch.float64)
    base.update(kw)
    return FC.TransformerConfig(**base)


def build(cls: str, cfg: FC.TransformerConfig, experts: int = E, seed: int = 0) -> torch.nn.Module:
    m = getattr(FC, cls)(experts, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            scale = 0.1 if "bias" in n else 1.0 / p.shape[-1] ** 0.5
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return m


def inputs(counts, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    N = sum(counts)
    x = torch.randn(N, H, generator=g).bfloat16().to(dtype)
    probs = (torch.rand(N, generator=g) + 0.25).to(torch.float32)
    dy = torch.randn(N, H, generator=g).bfloat16().to(dtype)
    return x, torch.tensor(counts, dtype=torch.int64), probs, dy


def run(module, x, counts, probs, dy):
    for p in module.parameters():
        p.grad = None
    xl = x.clone().requires_grad_(True)
    pl = probs.clone().requires_grad_(True)
    out, bias = module(xl, counts, pl)
    assert bias is None
    out.backward(dy)
    grads = {"x": xl.grad, "probs": pl.grad, **{n: p.grad.clone() for n, p in module.named_parameters()}}
    return out.detach(), grads


def compare(module, counts, dtype=torch.float64, counts_as=None):
    x, c, p, dy = inputs(counts, dtype)
    y_ref, g_ref = run(module, x, c, p, dy)
    assert mmc.apply(module) == [""]
    try:
        cc = c if counts_as is None else counts_as(c)
        y, g = run(module, x, cc, p, dy)
    finally:
        assert mmc.unapply(module) == [""]
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    errs = {"y": rel_err(y, y_ref)}
    for n, r in g_ref.items():
        assert g[n] is not None, f"no gradient reached {n}"
        errs[n] = rel_err(g[n].double(), r.double())
    if len(p) < 8:
        # d(probs)[r] is one dot product <dy_r, y_r / p_r> over H: with a few rows (N = 1) a near cancellation
        # is not averaged out, so the error is measured against the size of the terms, sum_h |dy_rh y_rh| / p_r
        terms = ((dy.double() * y_ref.double()).abs().sum(1) / p.double()).norm().item()
        errs["probs"] = (g["probs"].double() - g_ref["probs"].double()).norm().item() / max(
            g_ref["probs"].double().norm().item(), terms)
    bad = {k: v for k, v in errs.items() if not v <= TOL}
    assert not bad, f"above {TOL}: {bad} (all {errs})"
    return errs


CONFIGS = {
    "swiglu": dict(),
    "clamped": dict(activation_func_clamp_value=2.0),
    "gpt-oss": dict(activation_func=FC.quick_gelu, glu_linear_offset=1.0, activation_func_clamp_value=7.0,
                    add_bias_linear=True),
    "bias": dict(add_bias_linear=True),
    "interleaved": dict(moe_mlp_glu_interleave_size=1),
    "probs-on-input": dict(moe_apply_probs_on_input=True, moe_router_topk=1),
}
CLASSES = ["TEGroupedMLP", "SequentialMLP"]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("cls", CLASSES)
def test_matches_the_experts_module(cls, name):
    print(cls, name, compare(build(cls, config(**CONFIGS[name])), [9, 0, 14, 5]))


@pytest.mark.parametrize("counts", [[0, 0, 21, 0], [0, 1, 0, 0], [3, 3, 3, 3]], ids=["one-expert", "one-row", "even"])
@pytest.mark.parametrize("cls", CLASSES)
def test_counts(cls, counts):
    compare(build(cls, config()), counts)


@pytest.mark.parametrize("cls", CLASSES)
def test_counts_as_list_and_int32(cls):
    m = build(cls, config())
    compare(m, [4, 0, 6, 2], counts_as=lambda c: c.tolist())
    compare(m, [4, 0, 6, 2], counts_as=lambda c: c.to(torch.int32))


def test_single_expert_sequential():
    """SequentialMLP with one local expert takes its own path (no split by counts)."""
    compare(build("SequentialMLP", config(num_moe_experts=1), experts=1), [13])


@pytest.mark.parametrize("cls", CLASSES)
def test_bf16_parameters(cls):
    compare(build(cls, config(params_dtype=torch.bfloat16)), [7, 3, 0, 12], torch.bfloat16)


def test_weight_mapping():
    m = build("TEGroupedMLP", config(add_bias_linear=True))
    w1, w2, b1, b2, rebuild = mmc.mokgen_weights(m, dtype=None)
    for i in range(E):
        assert torch.equal(w1[i], getattr(m.linear_fc1, f"weight{i}"))     # [2F, H]: gate rows, then up rows
        assert torch.equal(w2[i], getattr(m.linear_fc2, f"weight{i}"))     # [H, F]
        assert torch.equal(b1[i], getattr(m.linear_fc1, f"bias{i}")) and torch.equal(b2[i], getattr(m.linear_fc2, f"bias{i}"))
    assert set(rebuild) == {"w1", "w2", "b1", "b2"}
    s = build("SequentialMLP", config())
    w1, w2, *_ = mmc.mokgen_weights(s, dtype=None)
    assert torch.equal(w1[2], s.local_experts[2].linear_fc1.weight) and torch.equal(w2[1], s.local_experts[1].linear_fc2.weight)


def test_layouts():
    lay = mmc.layout_of(build("TEGroupedMLP", config(**CONFIGS["gpt-oss"])))
    assert (lay.kind, lay.activation, lay.swiglu_limit, lay.bias) == ("grouped", "swiglu_oai", None, True)
    lay = mmc.layout_of(build("SequentialMLP", config(activation_func_clamp_value=2.0, moe_mlp_glu_interleave_size=1)))
    assert (lay.kind, lay.activation, lay.swiglu_limit, lay.gate_up_layout) == ("sequential", "swiglu", 2.0,
                                                                                "interleaved")


@pytest.mark.parametrize("kw,match", [
    (dict(gated_linear_unit=False), "gated_linear_unit=False"),
    (dict(activation_func=F.gelu), "activation gelu"),
    (dict(activation_func=FC.quick_gelu, glu_linear_offset=1.0), "quick_gelu"),
    (dict(moe_mlp_glu_interleave_size=32), "interleave_size=32"),
    (dict(fp8="hybrid"), "fp8"),
    (dict(use_te_activation_func=True), "use_te_activation_func"),
    (dict(moe_apply_probs_on_input=True, moe_router_topk=2), "moe_router_topk=1"),
])
def test_unsupported(kw, match):
    cfg = config()
    m = build("TEGroupedMLP", cfg)
    m.config = dataclasses.replace(cfg, **kw)
    with pytest.raises(mmc.UnsupportedExperts, match=match):
        mmc.apply(m)


def test_apply_on_a_model_and_buffers_refused():
    model = torch.nn.ModuleDict({"a": build("TEGroupedMLP", config()), "b": build("SequentialMLP", config())})
    assert mmc.apply(model) == ["a", "b"]
    x, c, p, _ = inputs([2, 2, 2, 2])
    with pytest.raises(mmc.UnsupportedExperts, match="output_buffer"):
        model["a"](x, c, p, output_buffer=torch.empty_like(x))
    assert mmc.unapply(model) == ["a", "b"]
    with pytest.raises(ValueError, match="no Megatron experts"):
        mmc.apply(torch.nn.Linear(2, 2))


def _real_experts():
    try:
        return importlib.import_module("megatron.core.transformer.moe.experts"), None
    except Exception as e:  # noqa: BLE001
        return None, (f"megatron-core not importable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                      "megatron-core 0.19.2 requires Python >= 3.12")


REAL, WHY_NOT = _real_experts()


@pytest.mark.skipif(REAL is None, reason=str(WHY_NOT))
@pytest.mark.parametrize("cls", CLASSES)
def test_real_signatures_match_the_copies(cls):
    real = list(inspect.signature(getattr(REAL, cls).forward).parameters)
    copy = list(inspect.signature(getattr(FC, cls).forward).parameters)
    assert real == copy
    assert list(inspect.signature(getattr(REAL, cls).__init__).parameters)[:3] == ["self", "num_local_experts",
                                                                                   "config"]
