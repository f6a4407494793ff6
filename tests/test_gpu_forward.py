"""The compiled forward on a GPU (H200, sm_90a), against the float64 reference.

Per preset: poisoned output fully written and within 1e-2 relative error; bitwise run-to-run and num_ctas (half vs
all the SMs: 66 vs 132 on an H200, the ``ctas`` fixture) determinism; special routings (one expert takes
everything, empty experts, skewed); T = 1000 (no tile multiple); out-of-range ids (RoutingError with check=True,
sticky flag for check_errors); no host sync under ``torch.cuda.set_sync_debug_mode("error")``; CUDA-graph capture
and replay.

``MOKGEN_GPU_TOKENS`` caps the token count (default: each preset's own ``tokens``);
``MOKGEN_GPU_PRESETS`` (comma-separated) picks presets; ``MOKGEN_GPU_OVERRIDES`` (``k=v,...``, e.g.
``schedule=chain``) plan overrides for ``mokgen.compile``.
"""

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("mokgen") is None:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mokgen  # noqa: E402
from mokgen import reference as ref  # noqa: E402
from mokgen.plan import parse_overrides  # noqa: E402
from mokgen.ops import ArchMismatchError, CompiledMoE, RoutingError  # noqa: E402

pytestmark = pytest.mark.gpu

PRESETS = ["kimi-k2", "deepseek-v4-pro", "qwen3.5-397b-a17b", "qwen3-30b-a3b", "gpt-oss-120b"]
if os.environ.get("MOKGEN_GPU_PRESETS"):
    PRESETS = [p.strip() for p in os.environ["MOKGEN_GPU_PRESETS"].split(",") if p.strip()]
TOL = 1e-2
OVERRIDES = parse_overrides(os.environ.get("MOKGEN_GPU_OVERRIDES", ""))  # typed as the CLI's --set


def _tokens(spec) -> int:
    cap = os.environ.get("MOKGEN_GPU_TOKENS")
    return min(spec.tokens, int(cap)) if cap else spec.tokens


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def run(moe, inp, **kw):
    return moe(inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2, inp.b1, inp.b2, **kw)


def reference(spec, inp, topk_idx=None, x=None):
    return ref.forward(inp.x if x is None else x, inp.topk_idx if topk_idx is None else topk_idx, inp.topk_weight,
                       inp.w1, inp.w2, spec, inp.b1, inp.b2, dtype=torch.float64)


def check_close(y, y_ref, what=""):
    assert y.dtype == torch.bfloat16
    assert not bool(y.isnan().any()), f"{what}: NaN in the output (an element was not written?)"
    err = ref.rel_err(y.float(), y_ref)
    assert err <= TOL, f"{what}: relative error {err:.3e} > {TOL}"


def with_routing(spec, inp, routing, tokens=None, seed=1):
    """New topk_idx / topk_weight (and x when tokens changes) for the case's weights."""
    T = inp.x.shape[0] if tokens is None else tokens
    fresh = ref.random_inputs(spec, tokens=T, device="cuda", seed=seed, routing=routing)
    x = inp.x if tokens is None else fresh.x
    out = inp._replace(x=x, topk_idx=fresh.topk_idx, topk_weight=fresh.topk_weight)
    del fresh
    return out


@pytest.fixture(scope="module", params=PRESETS)
def case(request):
    spec = mokgen.load_spec(request.param)
    moe = mokgen.compile(spec, overrides=OVERRIDES)
    inp = ref.random_inputs(spec, tokens=_tokens(spec), device="cuda", seed=0)
    yield spec, moe, inp
    moe.check_errors()
    del inp
    torch.cuda.empty_cache()


def test_forward_matches_reference(case):
    spec, moe, inp = case
    T = inp.x.shape[0]
    out = torch.full((T, spec.hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = run(moe, inp, out=out)
    assert y is out
    torch.cuda.synchronize()
    check_close(y, reference(spec, inp), spec.name)
    moe.check_errors()


def test_bitwise_deterministic(case, ctas):
    spec, moe, inp = case
    y1 = run(moe, inp)
    y2 = run(moe, inp)
    y_half = run(moe, inp, num_ctas=ctas.half)
    y_full = run(moe, inp, num_ctas=ctas.full)
    torch.cuda.synchronize()
    assert torch.equal(bits(y1), bits(y2)), "run-to-run bits differ"
    assert torch.equal(bits(y_half), bits(y_full)), f"num_ctas {ctas.half} vs {ctas.full} bits differ"
    assert torch.equal(bits(y1), bits(y_half))


@pytest.mark.parametrize("routing", ["one_expert", "empty_experts", "skewed"])
def test_special_routing(case, routing, ctas):
    spec, moe, inp = case
    case_inp = with_routing(spec, inp, routing)
    out = torch.full_like(case_inp.x, float("nan"))
    y = run(moe, case_inp, out=out)
    torch.cuda.synchronize()
    check_close(y, reference(spec, case_inp), f"{spec.name}/{routing}")
    assert torch.equal(bits(y), bits(run(moe, case_inp, num_ctas=ctas.half)))
    moe.check_errors()


def test_tokens_not_a_tile_multiple(case):
    spec, moe, inp = case
    case_inp = with_routing(spec, inp, "random", tokens=1000, seed=2)
    out = torch.full((1000, spec.hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = run(moe, case_inp, out=out)
    torch.cuda.synchronize()
    check_close(y, reference(spec, case_inp), f"{spec.name}/T=1000")
    one = with_routing(spec, inp, "random", tokens=1, seed=3)
    check_close(run(moe, one), reference(spec, one), f"{spec.name}/T=1")
    empty = with_routing(spec, inp, "random", tokens=0, seed=3)
    assert run(moe, empty).shape == (0, spec.hidden)


def test_out_of_range_index(case):
    spec, moe, inp = case
    bad = inp.topk_idx.clone()
    bad[5, 0] = spec.local_experts
    bad[7, bad.shape[1] - 1] = -1
    with pytest.raises(RoutingError, match=r"2 topk_idx value\(s\) outside"):
        run(moe, inp._replace(topk_idx=bad), check=True)
    moe.check_errors()                       # reported already
    # unchecked: the bad slots are dropped, the flag stays set across a clean call until check_errors()
    y = run(moe, inp._replace(topk_idx=bad))
    run(moe, inp)
    torch.cuda.synchronize()
    check_close(y, reference(spec, inp, topk_idx=bad), f"{spec.name}/dropped slots")
    with pytest.raises(RoutingError):
        moe.check_errors()
    moe.check_errors()
    run(moe, inp, check=True)


def test_no_host_sync(case):
    spec, moe, inp = case
    run(moe, inp)                            # device state created, SM count cached
    torch.cuda.synchronize()
    out = torch.full((inp.x.shape[0], spec.hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = run(moe, inp)
        y = run(moe, inp, out=out)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert y is out
    check_close(y, reference(spec, inp), f"{spec.name}/no host sync")


def test_cuda_graph_replay(case):
    spec, moe, inp = case
    y_eager = run(moe, inp)
    x_static = inp.x.clone()
    out = torch.full_like(y_eager, float("nan"))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run(moe, inp._replace(x=x_static), out=out)   # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run(moe, inp._replace(x=x_static), out=out)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(bits(out), bits(y_eager)), "graph replay bits differ from eager"
    # new data in the static input: the replay computes on it
    x_new = torch.randn_like(inp.x)
    x_static.copy_(x_new)
    g.replay()
    y_new = run(moe, inp._replace(x=x_new))
    torch.cuda.synchronize()
    assert torch.equal(bits(out), bits(y_new))
    del g


def test_arch_mismatch_is_refused(case):
    spec, moe, inp = case
    other = "sm_100a" if torch.cuda.get_device_capability()[0] == 9 else "sm_90a"
    wrong = CompiledMoE(spec, moe.plan, functions=moe._fns, arch=other)
    try:
        with pytest.raises(ArchMismatchError, match=f"built for {other}"):
            run(wrong, inp)
    finally:
        wrong.close()


@pytest.mark.training
def test_module_forward_backward():
    """nn.Module on one preset (fewer tokens): the forward and every gradient (x, topk_weight, w1, w2, and the
    biases where the spec has them) through the generated kernels, against the float64 reference."""
    name = "qwen3-30b-a3b" if "qwen3-30b-a3b" in PRESETS else PRESETS[0]
    spec = mokgen.load_spec(name)
    torch.manual_seed(0)
    layer = mokgen.MoE(spec, device="cuda")
    inp = ref.random_inputs(spec, tokens=256, device="cuda", seed=4)
    x = inp.x.clone().requires_grad_(True)
    tw = inp.topk_weight.clone().requires_grad_(True)
    y = layer(x, inp.topk_idx, tw)
    params = [layer.w1, layer.w2, layer.b1, layer.b2]
    w1, w2, b1, b2 = (None if p is None else p.detach() for p in params)
    args = (x.detach(), inp.topk_idx, tw.detach(), w1, w2, spec, b1, b2)
    check_close(y.detach(), ref.forward(*args, dtype=torch.float64), f"{name}/MoE module")
    g = torch.Generator(device="cuda").manual_seed(104)
    dy = torch.randn(y.shape, generator=g, device="cuda").to(torch.bfloat16)
    y.backward(dy)
    want = ref.backward(dy, *args, dtype=torch.float64)
    got = ref.Grads(x.grad, tw.grad, *(None if p is None else p.grad for p in params))
    for gname, gt, wt in zip(ref.Grads._fields, got, want):
        if wt is None:
            assert gt is None, f"{name}: d{gname} should be None"
            continue
        assert gt is not None, f"{name}: d{gname} missing"
        assert not bool(gt.isnan().any()), f"{name}: NaN in d{gname}"
        err = ref.rel_err(gt.float(), wt)
        assert err <= TOL, f"{name}/MoE module: d{gname} relative error {err:.3e} > {TOL}"
    layer.check_errors()
