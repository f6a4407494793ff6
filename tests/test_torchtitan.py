"""mokgen's torchtitan adapter (mokgen.integrations.torchtitan) on a CPU, with mokgen's reference kernels.

Against torchtitan's own ``GroupedExperts`` (torchtitan 0.3.0, ``torchtitan.models.common.moe``) where it
imports, and always against the faithful copy of its contract in tests/framework_contracts.py (torchtitan 0.3.0
installs from PyPI but imports ``triton``, which it does not declare and which the CPU wheel of torch does not
bring; it is an optional extra, not in ``dev``):

* forward and every gradient (x, w1_EFD, w2_EDF, w3_EFD) through ``apply`` against the module's own forward
  (rel. err <= 1e-2), counts with empty experts, one expert, N = 1, float64 and bf16 parameters;
* the real module against the copy (the copy is faithful), the weight mapping (w2 not copied for bf16
  parameters, w1 = cat(w1_EFD, w3_EFD) in that order), the older names w1 / w2 / w3, apply / unapply,
  modules that are not torchtitan's SwiGLU experts.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import framework_contracts as FC
import mokgen.integrations.torchtitan as mtt
from mokgen.integrations import grouped as G
from mokgen.reference import rel_err

TOL = 1e-2
D, F, E = 64, 128, 4


def _real_module():
    try:
        return importlib.import_module("torchtitan.models.common.moe").GroupedExperts, None
    except Exception as e:  # noqa: BLE001 - any import failure: say which
        return None, f"torchtitan not importable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


REAL, WHY_NOT = _real_module()
SOURCES = ["copy", pytest.param("torchtitan", marks=pytest.mark.skipif(REAL is None, reason=str(WHY_NOT)))]


@pytest.fixture(autouse=True)
def reference_kernels():
    old = G.set_compiler(G.reference_compiler())
    yield
    G.set_compiler(old)


def build(source: str, dtype=torch.float64, seed=0) -> torch.nn.Module:
    if source == "copy":
        m = FC.GroupedExperts(FC.GroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E))
    else:
        m = REAL(REAL.Config(dim=D, hidden_dim=F, num_experts=E))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return m.to(dtype)


def run(module, x, counts, dy):
    for p in module.parameters():
        p.grad = None
    xl = x.clone().requires_grad_(True)
    y = module(xl, counts)
    y.backward(dy)
    return y.detach(), {"x": xl.grad, **{n: p.grad.clone() for n, p in module.named_parameters()}}


def inputs(counts, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    N = sum(counts)
    x = torch.randn(N, D, generator=g).bfloat16().to(dtype)   # bf16-representable: the same x for both
    dy = torch.randn(N, D, generator=g).bfloat16().to(dtype)
    return x, torch.tensor(counts, dtype=torch.int64), dy


def compare(module, counts, dtype=torch.float64):
    x, c, dy = inputs(counts, dtype)
    y_ref, g_ref = run(module, x, c, dy)
    names = mtt.apply(module)
    try:
        assert names == [""]
        y, g = run(module, x, c, dy)
    finally:
        assert mtt.unapply(module) == [""]
    assert y.dtype == x.dtype and y.shape == y_ref.shape
    errs = {"y": rel_err(y, y_ref), **{n: rel_err(g[n], g_ref[n]) for n in g_ref}}
    bad = {k: v for k, v in errs.items() if not v <= TOL}
    assert not bad, f"above {TOL}: {bad} (all {errs})"
    return errs


COUNTS = {"empty-experts": [9, 0, 14, 5], "one-expert": [0, 0, 0, 21], "one-row": [0, 1, 0, 0]}


@pytest.mark.parametrize("case", list(COUNTS))
@pytest.mark.parametrize("source", SOURCES)
def test_matches_the_experts_module(source, case):
    print(source, case, compare(build(source), COUNTS[case]))


@pytest.mark.parametrize("source", SOURCES)
def test_bf16_parameters(source):
    print(source, compare(build(source, torch.bfloat16), [7, 3, 0, 12], torch.bfloat16))


@pytest.mark.skipif(REAL is None, reason=str(WHY_NOT))
def test_the_copy_is_faithful():
    real, copy = build("torchtitan"), build("copy")
    assert [(n, tuple(p.shape)) for n, p in real.named_parameters()] == \
           [(n, tuple(p.shape)) for n, p in copy.named_parameters()]
    x, c, dy = inputs([9, 0, 14, 5])
    y_r, g_r = run(real, x, c, dy)
    y_c, g_c = run(copy, x, c, dy)
    assert rel_err(y_r, y_c) <= TOL
    assert all(rel_err(g_r[n], g_c[n]) <= TOL for n in g_c)


def test_weight_mapping():
    m = build("copy", torch.bfloat16)
    w1, w2 = mtt.mokgen_weights(m)
    assert w2 is m.w2_EDF                                   # bf16: the parameter itself
    assert torch.equal(w1[:, :F], m.w1_EFD) and torch.equal(w1[:, F:], m.w3_EFD)   # gate rows, then up rows
    assert w1.is_contiguous() and w1.dtype == torch.bfloat16
    w1, w2 = mtt.mokgen_weights(build("copy", torch.float64), dtype=None)
    assert w1.dtype == torch.float64


def test_older_parameter_names():
    """torchtitan 0.1 / 0.2 named the weights w1 / w2 / w3 (same shapes)."""
    new = build("copy")

    class OldGroupedExperts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = torch.nn.Parameter(new.w1_EFD.detach().clone())
            self.w2 = torch.nn.Parameter(new.w2_EDF.detach().clone())
            self.w3 = torch.nn.Parameter(new.w3_EFD.detach().clone())

    old = OldGroupedExperts()
    assert mtt.weight_names(old) == ("w1", "w2", "w3")
    x, c, _ = inputs([5, 5, 0, 2])
    y_new = mtt.experts_forward(new, x, c)
    y_old = mtt.experts_forward(old, x, c)
    assert torch.equal(y_new, y_old)


def test_apply_finds_nested_modules_and_refuses_others():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner_experts = build("copy")
            self.other = torch.nn.Linear(4, 4)

    model = torch.nn.Sequential(Block(), Block())
    assert mtt.apply(model) == ["0.inner_experts", "1.inner_experts"]
    x, c, _ = inputs([3, 0, 4, 1])
    y = model[0].inner_experts(x, c)
    assert y.shape == x.shape
    assert mtt.unapply(model) == ["0.inner_experts", "1.inner_experts"]
    with pytest.raises(ValueError, match="no torchtitan GroupedExperts"):
        mtt.apply(torch.nn.Linear(4, 4))
    with pytest.raises(mtt.UnsupportedExperts):
        mtt.weight_names(torch.nn.Linear(4, 4))

    class GroupedExperts(torch.nn.Module):   # gpt-oss style: biases
        def __init__(self):
            super().__init__()
            self.w1 = torch.nn.Parameter(torch.zeros(E, F, D))
            self.w2 = torch.nn.Parameter(torch.zeros(E, D, F))
            self.w3 = torch.nn.Parameter(torch.zeros(E, F, D))
            self.b1 = torch.nn.Parameter(torch.zeros(E, F))

    with pytest.raises(mtt.UnsupportedExperts, match="biases"):
        mtt.mokgen_weights(GroupedExperts())
