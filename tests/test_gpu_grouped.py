"""The grouped-experts op and its torchtitan / Megatron adapters on a GPU (H200, sm_90a), with the compiled
kernels (``mokgen.compile`` of the top-1 grouped specs, built once into the cache).

* y and every gradient against the float64 loop of tests/test_grouped.py (rel. err <= 1e-2): empty experts,
  one expert taking every row, N = 1, probs None / given, a gpt-oss-like shape with biases;
* the same bits on a rerun (y and every gradient);
* no host sync: forward and backward under ``torch.cuda.set_sync_debug_mode("error")`` with the counts on the
  device (and the rebuild hooks the adapters use);
* counts on the CPU give the same bits as counts on the device; bad counts on the device drop every row and
  ``check_errors`` raises CountsError;
* the torchtitan and Megatron adapters against the modules of tests/framework_contracts.py (and torchtitan's own
  GroupedExperts where it imports) in bf16: forward and every gradient within 1e-2.

Run from the repository root:

    PYTHONPATH=$PWD python -m pytest -q -m gpu tests/test_gpu_grouped.py

``MOKGEN_GPU_GROUPED_ROWS`` sets N for the large cases (default 8192).
"""

from __future__ import annotations

import os

import pytest
import torch

import framework_contracts as FC
import mokgen.integrations.megatron as mmc
import mokgen.integrations.torchtitan as mtt
from mokgen.integrations import grouped as G
from mokgen.reference import rel_err
from test_grouped import loop_reference

pytestmark = [pytest.mark.gpu, pytest.mark.training]
DEV = "cuda"
TOL = 1e-2
ROWS = int(os.environ.get("MOKGEN_GPU_GROUPED_ROWS", "8192"))
SHAPES = {   # (H, I, E, math)
    "qwen3-like": (2048, 768, 32, dict()),
    "gpt-oss-like": (2880 // 64 * 64, 2880 // 64 * 64, 8, dict(activation="swiglu_oai", bias=True,
                                                              layout="interleaved")),
}


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels():
    old = G.set_compiler(None)   # mokgen.compile: the real kernels
    yield
    G.set_compiler(old)


def counts_for(E: int, N: int, kind: str, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    if kind == "one-expert":
        c = [0] * E
        c[E // 2] = N
        return c
    if kind == "one-row":
        c = [0] * E
        c[1] = N
        return c
    w = torch.rand(E, generator=g)
    w[::3] = 0                                    # empty experts
    c = torch.multinomial(w / w.sum(), N, replacement=True, generator=g).bincount(minlength=E)
    return c.tolist()


def case(shape: str, counts: list[int], probs: bool = True, seed: int = 0):
    H, I, E, m = SHAPES[shape]
    g = torch.Generator(device=DEV).manual_seed(seed)
    N = sum(counts)
    t = dict(x=torch.randn(N, H, generator=g, device=DEV).bfloat16(),
             w1=(torch.randn(E, 2 * I, H, generator=g, device=DEV) / H ** 0.5).bfloat16(),
             w2=(torch.randn(E, H, I, generator=g, device=DEV) / I ** 0.5).bfloat16(),
             probs=(torch.rand(N, generator=g, device=DEV) * 0.9 + 0.05) if probs else None,
             b1=torch.randn(E, 2 * I, generator=g, device=DEV) * 0.1 if m.get("bias") else None,
             b2=torch.randn(E, H, generator=g, device=DEV) * 0.1 if m.get("bias") else None)
    dy = torch.randn(N, H, generator=g, device=DEV).bfloat16()
    kw = dict(activation=m.get("activation", "swiglu"), gate_up_layout=m.get("layout", "concat"))
    return t, dy, kw, torch.tensor(counts, device=DEV)


def run(t, counts, dy, kw):
    leaves = {n: v.clone().requires_grad_(True) for n, v in t.items() if v is not None}
    a = {n: leaves.get(n) for n in t}
    y = G.grouped_experts(a["x"], counts, a["w1"], a["w2"], a["probs"], a["b1"], a["b2"], **kw)
    y.backward(dy)
    return y.detach(), {n: v.grad for n, v in leaves.items()}


@pytest.mark.parametrize("kind", ["mixed", "one-expert", "one-row"])
@pytest.mark.parametrize("probs", [True, False], ids=["probs", "no-probs"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_against_float64_and_bits(shape, probs, kind):
    E = SHAPES[shape][2]
    counts = counts_for(E, 1 if kind == "one-row" else ROWS, kind)
    t, dy, kw, c = case(shape, counts, probs)
    y, g = run(t, c, dy, kw)
    y2, g2 = run(t, c, dy, kw)
    torch.cuda.synchronize()
    assert torch.equal(y.view(torch.int16), y2.view(torch.int16)), "y differs on a rerun"
    for n in g:
        assert torch.equal(g[n], g2[n]), f"d{n} differs on a rerun"
    refs = {n: v.double().requires_grad_(True) for n, v in t.items() if v is not None}
    r = {n: refs.get(n) for n in t}
    lim = None
    y_ref = loop_reference(r["x"], counts, r["w1"], r["w2"], r["probs"], r["b1"], r["b2"],
                           activation=kw["activation"], limit=lim, layout=kw["gate_up_layout"])
    y_ref.backward(dy.double())
    errs = {"y": rel_err(y.float(), y_ref), **{n: rel_err(g[n].double(), refs[n].grad) for n in g}}
    if kind == "one-row" and "probs" in errs:   # one dot product over H: against the size of its terms
        terms = ((dy.double() * y_ref.detach()).abs().sum(1) / r["probs"].detach()).norm().item()
        errs["probs"] = (g["probs"].double() - refs["probs"].grad).norm().item() / max(refs["probs"].grad.norm().item(),
                                                                                        terms)
    bad = {k: v for k, v in errs.items() if not v <= TOL}
    assert not bad, f"{shape}/{kind}: above {TOL}: {bad} (all {errs})"
    print(shape, kind, errs)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_fp8(shape):
    """configure(dtype="fp8"): the op on mokgen's FP8 kernels, mixed counts with empty experts: the same bits on
    a rerun, every result within FP8's error of the float64 loop (tests/test_grouped.py::test_fp8 measured 6-8% on
    the CPU reference kernels; 0.12 here) and further from it than the BF16 kernels' on the same inputs."""
    E = SHAPES[shape][2]
    counts = counts_for(E, ROWS, "mixed")
    t, dy, kw, c = case(shape, counts)
    y16, g16 = run(t, c, dy, kw)
    old = G.configure(dtype="fp8")
    try:
        y, g = run(t, c, dy, kw)
        y2, g2 = run(t, c, dy, kw)
    finally:
        G.configure(dtype=old.dtype)
    torch.cuda.synchronize()
    assert torch.equal(y.view(torch.int16), y2.view(torch.int16)), "FP8 y differs on a rerun"
    assert all(torch.equal(g[n], g2[n]) for n in g), "FP8 gradients differ on a rerun"
    refs = {n: v.double().requires_grad_(True) for n, v in t.items() if v is not None}
    r = {n: refs.get(n) for n in t}
    y_ref = loop_reference(r["x"], counts, r["w1"], r["w2"], r["probs"], r["b1"], r["b2"],
                           activation=kw["activation"], layout=kw["gate_up_layout"])
    y_ref.backward(dy.double())
    errs = {"y": rel_err(y.float(), y_ref), **{n: rel_err(g[n].double(), refs[n].grad) for n in g}}
    e16 = {"y": rel_err(y16.float(), y_ref), **{n: rel_err(g16[n].double(), refs[n].grad) for n in g16}}
    bad = {k: v for k, v in errs.items() if not v <= 0.12}
    assert not bad, f"{shape} FP8: above 0.12: {bad} (all {errs})"
    assert all(errs[k] > e16[k] for k in ("y", "x", "w1", "w2")), (errs, e16)
    print(shape, "fp8", errs, "bf16", e16)


def test_no_rows():
    t, dy, kw, c = case("qwen3-like", [0] * 32)
    y, g = run(t, c, dy, kw)
    assert y.shape == (0, 2048) and all(not v.any() for v in g.values())


def test_no_host_sync():
    counts = counts_for(32, ROWS, "mixed")
    t, dy, kw, c = case("qwen3-like", counts)
    run(t, c, dy, kw)                      # warm: kernels loaded, device state created
    gate = t["w1"][:, :768].clone().requires_grad_(True)
    up = t["w1"][:, 768:].clone().requires_grad_(True)
    module = FC.GroupedExperts(FC.GroupedExperts.Config(dim=2048, hidden_dim=768, num_experts=32)).to(DEV)
    with torch.no_grad():
        module.w1_EFD.copy_(gate)
        module.w3_EFD.copy_(up)
        module.w2_EDF.copy_(t["w2"])
    module.bfloat16()
    mtt.experts_forward(module, t["x"], c).sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y, g = run(t, c, dy, kw)
        yt = mtt.experts_forward(module, t["x"], c)   # the adapter: cat per call, rebuild hooks
        yt.backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    G.check_errors()


def test_host_counts_same_bits_and_bad_counts():
    counts = counts_for(32, ROWS, "mixed")
    t, dy, kw, c = case("qwen3-like", counts)
    y_dev, g_dev = run(t, c, dy, kw)
    y_host, g_host = run(t, c.cpu(), dy, kw)
    assert torch.equal(y_dev.view(torch.int16), y_host.view(torch.int16))
    assert all(torch.equal(g_dev[n], g_host[n]) for n in g_dev)
    bad = c.clone()
    bad[0] += 1
    y_bad, _ = run(t, bad, dy, kw)
    assert not y_bad.any()
    with pytest.raises(G.CountsError):
        G.check_errors()
    G.check_errors()


def _compare(module, forward_args, dy):
    def once():
        for p in module.parameters():
            p.grad = None
        args = [a.clone().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                for a in forward_args]
        out = module(*args)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(dy)
        return out.detach(), [a.grad for a in args if isinstance(a, torch.Tensor) and a.requires_grad] + \
            [p.grad.clone() for p in module.parameters()]

    y_ref, g_ref = once()
    names = mmc.apply(module) if "MLP" in type(module).__name__ else mtt.apply(module)
    try:
        y, g = once()
    finally:
        (mmc.unapply if "MLP" in type(module).__name__ else mtt.unapply)(module)
    assert names == [""]
    errs = [rel_err(y.float(), y_ref.float())] + [rel_err(a.float(), b.float()) for a, b in zip(g, g_ref)]
    assert max(errs) <= TOL, errs
    return max(errs)


def _init(module, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    with torch.no_grad():
        for n, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g, device=DEV) * (0.1 if "bias" in n else p.shape[-1] ** -0.5))
    return module


def test_torchtitan_adapter():
    E, D, F_ = 16, 1024, 512
    counts = torch.tensor(counts_for(E, ROWS, "mixed"), device=DEV)
    x = torch.randn(ROWS, D, device=DEV).bfloat16()
    dy = torch.randn(ROWS, D, device=DEV).bfloat16()
    mods = [FC.GroupedExperts(FC.GroupedExperts.Config(dim=D, hidden_dim=F_, num_experts=E))]
    try:
        from torchtitan.models.common.moe import GroupedExperts
        mods.append(GroupedExperts(GroupedExperts.Config(dim=D, hidden_dim=F_, num_experts=E)))
    except Exception:  # noqa: BLE001 - torchtitan is optional
        pass
    for m in mods:
        print(type(m).__module__, _compare(_init(m.to(DEV)).bfloat16(), (x, counts), dy))


@pytest.mark.parametrize("cls", ["TEGroupedMLP", "SequentialMLP"])
@pytest.mark.parametrize("kw", [dict(), dict(activation_func=FC.quick_gelu, glu_linear_offset=1.0,
                                             activation_func_clamp_value=7.0, add_bias_linear=True)],
                         ids=["swiglu", "gpt-oss"])
def test_megatron_adapter(cls, kw):
    E, H, F_ = 8, 1024, 512
    cfg = FC.TransformerConfig(hidden_size=H, moe_ffn_hidden_size=F_, num_moe_experts=E, params_dtype=torch.bfloat16,
                               **kw)
    m = _init(getattr(FC, cls)(E, cfg).to(DEV))
    counts = torch.tensor(counts_for(E, ROWS, "mixed"), device=DEV)
    x = torch.randn(ROWS, H, device=DEV).bfloat16()
    probs = torch.rand(ROWS, device=DEV) * 0.9 + 0.05
    dy = torch.randn(ROWS, H, device=DEV).bfloat16()
    print(cls, _compare(m, (x, counts.cpu(), probs), dy))
