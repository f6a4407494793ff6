"""The MXFP8 layer (spec ``dtype: mxfp8``: e4m3 with one e8m0 scale per 32 elements along K) on a Blackwell GPU
(sm_100a): the compiled entry's forward and training step.

Skipped unless the visible GPU is sm_100a (the ``mxfp8`` marker, tests/conftest.py). NEVER RUN: no Blackwell GPU
has been available to this project, so nothing here has passed on hardware yet (the same launch sequence on the
CPU reference kernels: tests/test_mx_runtime.py). Per spec (default tools/specs/kimi-k2-mxfp8.yaml):

* y (inference forward and training forward) written into a NaN-poisoned buffer, against
  :func:`mokgen.reference.forward_mx` (float64 on the dequantized MXFP8 operands, h rounded to bf16 and quantized
  as the kernels do) within 1e-2; every gradient (dx, the router-weight gradient, dW1, dW2, and db1 / db2 with
  biases) written into NaN-poisoned ``out=`` buffers, against :func:`mokgen.reference.backward_mx` within 1e-2;
* the error against the BF16 float64 references (``forward`` / ``backward``): printed, and on the main case
  asserted in [0.02, 0.15] (MXFP8 really ran, and only at e4m3's resolution; 0.05-0.08 on the CPU);
* bitwise run to run and at half vs all the SMs' CTAs (``num_ctas``; 74 vs 148 on a B200: the ``ctas``
  fixture), forward and every gradient; the training forward's y has the inference forward's bits;
* special routings (one expert takes everything, empty experts: their dW exactly zero, skewed); T = 1 and an odd
  T (999);
* the weights' MXFP8 copies follow an in-place update (``optimizer.step()``): never stale.

Inputs are fresh random tensors (``mokgen.reference.random_inputs``, never zeros). ``MOKGEN_GPU_PRESETS``
(comma-separated preset names or YAML paths; a spec that is not mxfp8 gets ``dtype: mxfp8``, ``archs: [sm_100a]``)
picks others, ``MOKGEN_GPU_TOKENS`` caps T, ``MOKGEN_GPU_OVERRIDES`` (``k=v,...``) plan overrides
(``wgrad1_dtype=mxfp8,wgrad2_dtype=mxfp8``: the opt-in MXFP8 weight gradients, checked against backward_mx with
their operands quantized in 32-row blocks down the columns; never run either).
"""

import dataclasses
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

pytestmark = [pytest.mark.gpu, pytest.mark.mxfp8]

PRESETS = [str(Path(__file__).resolve().parents[1] / "tools" / "specs" / "kimi-k2-mxfp8.yaml")]
if os.environ.get("MOKGEN_GPU_PRESETS"):
    PRESETS = [p.strip() for p in os.environ["MOKGEN_GPU_PRESETS"].split(",") if p.strip()]
OVERRIDES = parse_overrides(os.environ.get("MOKGEN_GPU_OVERRIDES", ""))  # typed as the CLI's --set
# the weight gradients the overrides put in MXFP8 (wgrad*_dtype=mxfp8): backward_mx quantizes their operands too
MX_WGRADS = tuple(n for n in ("wgrad1", "wgrad2") if OVERRIDES.get(f"{n}_dtype") == "mxfp8")
TOL = 1e-2               # against the float64 references on the dequantized MXFP8 operands
BF16_BAND = (0.02, 0.15)  # against the BF16 float64 references (tests/test_mx_runtime.py: 0.05-0.08 on the CPU)
NAMES = ref.Grads._fields  # ("x", "topk_weight", "w1", "w2", "b1", "b2")
DEV = "cuda"


def load_mx_spec(name: str):
    """The spec of a preset name or YAML path, as an MXFP8 (sm_100a) spec."""
    spec = mokgen.load_spec(name)
    if spec.dtype != "mxfp8":
        spec = dataclasses.replace(spec, dtype="mxfp8", archs=("sm_100a",))
    return spec


def _tokens(spec) -> int:
    cap = os.environ.get("MOKGEN_GPU_TOKENS")
    return min(spec.tokens, int(cap)) if cap else spec.tokens


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same_bits(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def nan_like(t):
    return None if t is None else torch.full_like(t, float("nan"))


def make_dy(T: int, H: int, seed: int, device=DEV) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(T, H, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)


def with_routing(spec, inp, routing="random", tokens=None, seed=1):
    """New topk_idx / topk_weight (and x when tokens is given) for the case's weights."""
    T = inp.x.shape[0] if tokens is None else tokens
    fresh = ref.random_inputs(spec, tokens=T, device=inp.x.device, seed=seed, routing=routing)
    x = inp.x if tokens is None else fresh.x
    return inp._replace(x=x, topk_idx=fresh.topk_idx, topk_weight=fresh.topk_weight)


def forward(moe, inp, **kw):
    """The inference forward, y written into a NaN-filled buffer."""
    out = torch.full((inp.x.shape[0], moe.cfg.hidden), float("nan"), dtype=torch.bfloat16, device=inp.x.device)
    y = moe(inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2, inp.b1, inp.b2, out=out, **kw)
    assert y is out
    return y


def train_step(moe, inp, dy, num_ctas=None):
    """forward_train + backward, y and every gradient written into NaN-filled buffers of their own (an element no
    kernel writes reads NaN); (y, Grads)."""
    T = inp.x.shape[0]
    y_out = torch.full((T, moe.cfg.hidden), float("nan"), dtype=torch.bfloat16, device=inp.x.device)
    y, saved = moe.forward_train(inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2, inp.b1, inp.b2, out=y_out,
                                 num_ctas=num_ctas)
    assert y is y_out
    out = ref.Grads(*(nan_like(t) for t in (inp.x, inp.topk_weight, inp.w1, inp.w2, inp.b1, inp.b2)))
    g = moe.backward(dy, saved, inp.x, inp.topk_weight, inp.w1, inp.w2, inp.b1, inp.b2, out=out, num_ctas=num_ctas)
    for name, got, buf in zip(NAMES, g, out):
        assert buf is None or got is buf, f"d{name} was not written into its out= buffer"
    return y, g


def _args(spec, inp):
    return (inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2, spec, inp.b1, inp.b2)


def check_y(spec, inp, y, what, band=False) -> None:
    assert y.dtype == torch.bfloat16 and tuple(y.shape) == (inp.x.shape[0], spec.hidden), (what, y.dtype, y.shape)
    assert not bool(y.isnan().any()), f"{what}: NaN in y (an element was not written?)"
    err = ref.rel_err(y.float(), ref.forward_mx(*_args(spec, inp)))
    err16 = ref.rel_err(y.float(), ref.forward(*_args(spec, inp)))
    print(f"{what}: y rel err {err:.3e} vs the mxfp8 reference, {err16:.3e} vs the bf16 reference")
    assert err <= TOL, f"{what}: y relative error {err:.3e} > {TOL} against the mxfp8 reference"
    if band:
        assert BF16_BAND[0] < err16 < BF16_BAND[1], f"{what}: y {err16:.3e} from the bf16 reference, not in {BF16_BAND}"


def check_grads(spec, inp, dy, g, what, band=False) -> None:
    """Each gradient: present exactly when its input is, the input's shape and dtype, every element written (no
    NaN: the out= buffers were NaN), within TOL of backward_mx; the distance to the BF16 backward printed."""
    rm = ref.backward_mx(dy, *_args(spec, inp), mx_wgrads=MX_WGRADS)
    r16 = ref.backward(dy, *_args(spec, inp))
    for name in NAMES:
        t, want, like = getattr(g, name), getattr(rm, name), getattr(inp, name)
        if like is None:
            assert t is None, f"{what}: d{name} should be None (no {name})"
            continue
        assert t is not None and t.shape == like.shape and t.dtype == like.dtype, \
            f"{what}: d{name} {None if t is None else (tuple(t.shape), t.dtype)} is not like {name}"
        assert bool(torch.isfinite(t).all()), f"{what}: d{name} has NaN/inf (an element was not written?)"
        err = ref.rel_err(t.float(), want)
        err16 = ref.rel_err(t.float(), getattr(r16, name))
        print(f"{what}: d{name} rel err {err:.3e} vs the mxfp8 reference, {err16:.3e} vs the bf16 reference")
        assert err <= TOL, f"{what}: d{name} relative error {err:.3e} > {TOL} against the mxfp8 reference"
        if band and name not in ("b1", "b2"):
            assert BF16_BAND[0] < err16 < BF16_BAND[1], \
                f"{what}: d{name} {err16:.3e} from the bf16 reference, not in {BF16_BAND}"


@pytest.fixture(scope="module", params=PRESETS)
def case(request):
    spec = load_mx_spec(request.param)
    moe = mokgen.compile(spec, overrides=OVERRIDES)
    assert moe.mx and moe.trainable, f"{spec.name}: the entry is not an MXFP8 training entry"
    inp = ref.random_inputs(spec, tokens=_tokens(spec), device=DEV, seed=0)
    dy = make_dy(inp.x.shape[0], spec.hidden, seed=100, device=DEV)
    yield spec, moe, inp, dy
    moe.check_errors()
    del inp, dy
    torch.cuda.empty_cache()


def test_forward_matches_reference(case):
    spec, moe, inp, _ = case
    y = forward(moe, inp)
    torch.cuda.synchronize()
    check_y(spec, inp, y, spec.name, band=True)
    moe.check_errors()


def test_training_step_matches_reference(case):
    spec, moe, inp, dy = case
    y, g = train_step(moe, inp, dy)
    y_inf = forward(moe, inp)
    torch.cuda.synchronize()
    assert same_bits(y, y_inf), f"{spec.name}: forward_train's y differs from the inference forward's"
    check_y(spec, inp, y, f"{spec.name}/train", band=True)
    check_grads(spec, inp, dy, g, f"{spec.name}/train", band=True)
    moe.check_errors()


def test_bitwise_deterministic(case, ctas):
    spec, moe, inp, dy = case
    half, full = ctas
    runs = [train_step(moe, inp, dy), train_step(moe, inp, dy), train_step(moe, inp, dy, num_ctas=half),
            train_step(moe, inp, dy, num_ctas=full)]
    ys = [forward(moe, inp), forward(moe, inp, num_ctas=half), forward(moe, inp, num_ctas=full)]
    torch.cuda.synchronize()
    for i, what in ((1, "run to run"), (2, f"default vs {half} CTAs"), (3, f"default vs {full} CTAs")):
        assert same_bits(runs[0][0], runs[i][0]), f"{spec.name}: forward_train y bits differ: {what}"
        for name in NAMES:
            assert same_bits(getattr(runs[0][1], name), getattr(runs[i][1], name)), \
                f"{spec.name}: d{name} bits differ: {what}"
    for i, y in enumerate(ys):
        assert same_bits(ys[0], y), f"{spec.name}: inference y bits differ ({[None, half, full][i]} CTAs)"
    assert same_bits(ys[0], runs[0][0]), f"{spec.name}: inference and training forward bits differ"


@pytest.mark.parametrize("routing", ["one_expert", "empty_experts", "skewed"])
def test_special_routing(case, routing, ctas):
    spec, moe, inp, dy = case
    c = with_routing(spec, inp, routing, seed=1)
    what = f"{spec.name}/{routing}"
    y, g = train_step(moe, c, dy)
    y_half, g_half = train_step(moe, c, dy, num_ctas=ctas.half)
    torch.cuda.synchronize()
    check_y(spec, c, y, what)
    check_grads(spec, c, dy, g, what)
    counts = torch.bincount(c.topk_idx.reshape(-1).long(), minlength=spec.local_experts)
    empty = torch.nonzero(counts[:spec.local_experts] == 0).flatten().tolist()
    if routing in ("one_expert", "empty_experts") and spec.local_experts > 1:
        assert empty, f"{what}: the routing left no expert empty (test inputs wrong)"
    for name in ("w1", "w2", "b1", "b2"):
        t = getattr(g, name)
        if t is not None and empty:
            assert bool((t[empty] == 0).all()), f"{what}: d{name} of the empty experts {empty[:8]} is not exactly zero"
    assert same_bits(y, y_half), f"{what}: y bits differ with {ctas.half} CTAs"
    for name in NAMES:
        assert same_bits(getattr(g, name), getattr(g_half, name)), f"{what}: d{name} bits differ with {ctas.half} CTAs"
    moe.check_errors()


@pytest.mark.parametrize("tokens", [1, 999])
def test_small_and_odd_tokens(case, tokens):
    spec, moe, inp, _ = case
    c = with_routing(spec, inp, "random", tokens=tokens, seed=2)
    dy = make_dy(tokens, spec.hidden, seed=101 + tokens, device=inp.x.device)
    y_inf = forward(moe, c)
    y, g = train_step(moe, c, dy)
    torch.cuda.synchronize()
    what = f"{spec.name}/T={tokens}"
    check_y(spec, c, y_inf, what)
    assert same_bits(y, y_inf), f"{what}: forward_train's y differs from the inference forward's"
    check_grads(spec, c, dy, g, what)
    moe.check_errors()


def test_weights_requantized_after_update(case):
    spec, moe, inp, _ = case
    w2 = inp.w2.clone()
    c = inp._replace(w2=w2)
    y1 = forward(moe, c)
    with torch.no_grad():
        w2.mul_(0.5)   # as optimizer.step() does: in place, same storage, version bumped
    y2 = forward(moe, c)
    torch.cuda.synchronize()
    check_y(spec, c, y2, f"{spec.name}/after an in-place weight update")
    assert not same_bits(y1, y2)
