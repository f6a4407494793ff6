"""The generated backward on a GPU (H200, sm_90a), against the float64 reference (``mokgen.reference.backward``).

Per preset: every gradient (dx, d topk_weight, dw1, dw2, db1, db2) within 1e-2 relative error, no NaN, every
element written (y and every gradient are written into caller-owned buffers filled with NaN before the call, so an
element the kernels skip reads NaN by construction; the intermediates' likely blocks of the caching allocator are
NaN-filled too, a best effort; main_grad buffers are pre-filled and compared as an accumulation; experts without
rows must get exact zeros), through ``moe.forward_train`` / ``moe.backward`` and through autograd; special routings
(one expert takes everything, empty experts, skewed); T = 1000 (no tile multiple) and T = 1; bitwise run-to-run and
num_ctas (half vs all the SMs: 66 vs 132 on an H200, the ``ctas`` fixture) determinism; two layers of one spec
interleaved (f1, f2, b2, b1) give the bits of each run alone; fp32 main_grad accumulation (low level, and over 3
micro-batches through ``mokgen.MoE(main_grad=True)``, deterministic); a whole forward+backward step captured in a
CUDA graph replays with the eager bits; ``torch.compile(fullgraph=True)`` of a module using ``mokgen.MoE`` gives
the eager bits forward and backward.

The default list is five presets and tools/specs/dbrx-like.yaml (the few-large-experts class: 16 experts, 2048
rows each at its 8192 tokens; first run with ``MOKGEN_GPU_TOKENS=4096``). ``MOKGEN_GPU_PRESETS`` (comma-separated
preset names or YAML paths) picks others; ``MOKGEN_GPU_TOKENS`` caps the token count (default:
each preset's own ``tokens``: the float64 reference is fast on an H200, and every preset then has many waves of
tiles); ``MOKGEN_GPU_OVERRIDES`` (``k=v,...``) plan overrides for ``mokgen.compile``.
"""

import importlib.util
import os
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

if importlib.util.find_spec("mokgen") is None:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mokgen  # noqa: E402
from mokgen import kernels as mk  # noqa: E402
from mokgen import reference as ref  # noqa: E402
from mokgen.plan_types import PlanError  # noqa: E402
from mokgen.plan import parse_overrides  # noqa: E402
from test_gpu_fp8 import FP8_TOL  # noqa: E402  (FP8 gradients against the BF16 reference)
from mokgen.ops import cap_rows  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.training]

# the presets, and a bench spec of the few-large-experts class (16 experts of FFN 10752: long varlen-K wgrads)
PRESETS = ["kimi-k2", "deepseek-v4-pro", "qwen3.5-397b-a17b", "qwen3-30b-a3b", "gpt-oss-120b",
           str(Path(__file__).resolve().parents[1] / "tools" / "specs" / "dbrx-like.yaml")]
if os.environ.get("MOKGEN_GPU_PRESETS"):
    PRESETS = [p.strip() for p in os.environ["MOKGEN_GPU_PRESETS"].split(",") if p.strip()]
TOL = 1e-2
# An FP8 spec (dtype: fp8): y against the quantization-aware float64 reference (ref.forward_fp8) within TOL; the
# gradients (no quantization-aware backward reference exists) against the BF16 one within FP8_GRAD_TOL, the gross
# check tests/test_gpu_fp8.py makes with the same bound (e4m3 keeps 3 mantissa bits: 5-7% measured). That suite
# holds FP8's accuracy checks; here FP8 specs get the structural ones (bits across CTA counts, streams, graphs,
# interleaved layers, the same bits through torch.compile).
FP8_GRAD_TOL = FP8_TOL
OVERRIDES = parse_overrides(os.environ.get("MOKGEN_GPU_OVERRIDES", ""))  # typed as the CLI's --set
NAMES = ref.Grads._fields            # ("x", "topk_weight", "w1", "w2", "b1", "b2")
DEV = "cuda"


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def _tokens(spec) -> int:
    cap = os.environ.get("MOKGEN_GPU_TOKENS")
    return min(spec.tokens, int(cap)) if cap else spec.tokens


# --------------------------------------------------------------------------------------------------------------
# helpers


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of t (as an integer tensor of its element size), for bitwise comparisons."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same_bits(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


rel_err = ref.rel_err  # ||a - b|| / ||b|| in float64, a slab at a time


def poison_free_memory(*like: torch.Tensor | None, shapes=()) -> None:
    """Fill blocks of the caching allocator with NaN and free them (tensors like ``like`` and bf16 tensors of
    ``shapes``), so that the next allocations of these sizes (a call's intermediates) are likely to start as NaN: a
    read of an element no kernel wrote then fails the NaN / error checks. Outputs need no such luck: they are
    written into the poisoned buffers of :func:`nan_like`."""
    held = [torch.full(t.shape, float("nan"), dtype=t.dtype, device=t.device) for t in like
            if t is not None and t.is_floating_point()]
    held += [torch.full(sh, float("nan"), dtype=torch.bfloat16, device=DEV) for sh in shapes]
    del held


def nan_like(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else torch.full_like(t, float("nan"))


def intermediate_shapes(moe, T: int) -> list[tuple[int, int]]:
    """The [rows, cols] bf16 buffers a training step allocates (gathered rows, h / dA, z / dz, ys)."""
    cap = cap_rows(T, moe.cfg.topk, moe.cfg.shared_experts, moe.cfg.groups, moe.bm)
    return [(cap, moe.cfg.hidden), (cap, moe.cfg.ffn), (cap, 2 * moe.cfg.ffn), (cap, moe.cfg.hidden)]


class Case(NamedTuple):
    spec: object
    moe: object
    inp: ref.MoEInputs
    dy: torch.Tensor
    y_ref: torch.Tensor
    g_ref: ref.Grads


def make_dy(T: int, H: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(T, H, generator=g, device=DEV, dtype=torch.float32).to(torch.bfloat16)


def grad_tol(spec) -> float:
    """The gradients' tolerance against the BF16 float64 reference (tests/test_gpu_streams.py uses it too)."""
    return FP8_GRAD_TOL if spec.dtype == "fp8" else TOL


def forward_ref(spec):
    """The float64 forward reference y is checked against (an FP8 spec's quantization-aware one; tests/test_gpu_streams.py
    uses it too)."""
    return ref.forward_fp8 if spec.dtype == "fp8" else ref.forward


def reference(spec, inp: ref.MoEInputs, dy: torch.Tensor):
    """(y, Grads) in float64 on the GPU, kept as float32 copies (half the memory; rounding costs 6e-8)."""
    args = (inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2, spec, inp.b1, inp.b2)
    y = forward_ref(spec)(*args, dtype=torch.float64).float()
    g = ref.backward(dy, *args, dtype=torch.float64)
    return y, ref.Grads(*(None if t is None else t.float() for t in g))


def with_routing(spec, inp, routing, tokens=None, seed=1):
    """New topk_idx / topk_weight (and x when tokens changes) for the case's weights."""
    T = inp.x.shape[0] if tokens is None else tokens
    fresh = ref.random_inputs(spec, tokens=T, device=DEV, seed=seed, routing=routing)
    x = inp.x if tokens is None else fresh.x
    out = inp._replace(x=x, topk_idx=fresh.topk_idx, topk_weight=fresh.topk_weight)
    del fresh
    return out


def train_call(moe, inp, dy, *, num_ctas=None, w1_main_grad=None, w2_main_grad=None, poison=True):
    """forward_train + backward through the low-level API; (y, Grads). y and every gradient are written into
    NaN-filled buffers of their own (``out=``), so an element no kernel writes reads NaN."""
    T = inp.x.shape[0]
    if poison:
        poison_free_memory(shapes=intermediate_shapes(moe, T))
    y_out = torch.full((T, moe.cfg.hidden), float("nan"), dtype=torch.bfloat16, device=inp.x.device)
    y, saved = moe.forward_train(inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2, inp.b1, inp.b2, out=y_out)
    assert y is y_out
    assert isinstance(saved.nbytes, int) and saved.nbytes >= 0
    if poison:
        poison_free_memory(shapes=intermediate_shapes(moe, T))
    out = ref.Grads(nan_like(inp.x), nan_like(inp.topk_weight), None if w1_main_grad is not None else nan_like(inp.w1),
                    None if w2_main_grad is not None else nan_like(inp.w2), nan_like(inp.b1), nan_like(inp.b2))
    g = moe.backward(dy, saved, inp.x, inp.topk_weight, inp.w1, inp.w2, inp.b1, inp.b2,
                     w1_main_grad=w1_main_grad, w2_main_grad=w2_main_grad, out=out, num_ctas=num_ctas)
    assert isinstance(g, ref.Grads), type(g)
    for name, got, buf in zip(NAMES, g, out):
        assert buf is None or got is buf, f"d{name} was not written into its out= buffer"
    return y, g


def check_y(y, y_ref, what):
    assert y.dtype == torch.bfloat16 and y.shape == y_ref.shape, (what, y.dtype, tuple(y.shape))
    assert not bool(y.isnan().any()), f"{what}: NaN in y (an element was not written?)"
    err = rel_err(y, y_ref)
    assert err <= TOL, f"{what}: y relative error {err:.3e} > {TOL}"


def check_grads(g, g_ref, inp, what, skip=(), tol=TOL):
    """Each gradient: present exactly when its input is (b1/b2 only with biases), the input's shape and dtype,
    finite, within ``tol`` of the reference (:func:`grad_tol` of the spec)."""
    for name in NAMES:
        if name in skip:
            continue
        t, r, x = getattr(g, name), getattr(g_ref, name), getattr(inp, name)
        if x is None:
            assert t is None, f"{what}: d{name} should be None (no {name})"
            continue
        assert t is not None, f"{what}: d{name} missing"
        assert t.shape == x.shape, f"{what}: d{name} shape {tuple(t.shape)} != {tuple(x.shape)}"
        assert t.dtype == x.dtype, f"{what}: d{name} dtype {t.dtype} != {x.dtype}"
        assert bool(torch.isfinite(t).all()), f"{what}: d{name} has NaN/inf (an element was not written?)"
        err = rel_err(t, r)
        assert err <= tol, f"{what}: d{name} relative error {err:.3e} > {tol}"


def check_accumulated(added, expected, abs_sum, what):
    """Element by element: ``added`` (an fp32 accumulation) against ``expected`` (the fp32 sum of bf16
    gradients whose magnitudes sum to ``abs_sum``): each bf16 rounding is at most 2^-8 relative, so 2^-7 * abs_sum
    plus a small absolute slack for fp32 summation order. A tile the kernel skipped fails here even where a
    Frobenius norm would hide it."""
    slack = 1e-3 * abs_sum.abs().mean().item() + 1e-30
    bad = (added - expected).abs() > (2.0 ** -7) * abs_sum + slack
    bad |= ~torch.isfinite(added)
    n = int(bad.sum())
    assert n == 0, f"{what}: {n} of {added.numel()} elements off (first at {torch.nonzero(bad)[0].tolist()})"


def check_empty_experts_zero(spec, inp, g, what):
    """Local experts that received no rows get exactly zero weight (and bias) gradients: the varlen-K wgrad
    GEMM must still write its K = 0 tiles."""
    counts = torch.bincount(inp.topk_idx.reshape(-1).long(), minlength=spec.local_experts)
    empty = torch.nonzero(counts[:spec.local_experts] == 0).flatten().tolist()
    for name in ("w1", "w2", "b1", "b2"):
        t = getattr(g, name)
        if t is None or not empty:
            continue
        sub = t[empty]
        assert bool((sub == 0).all()), f"{what}: d{name} of the empty experts {empty[:8]} is not exactly zero"
    return empty


def leaves_of(inp):
    """Fresh autograd leaves sharing the inputs' storage (the shared case inputs are never marked)."""
    return [None if t is None else t.detach().requires_grad_(True)
            for t in (inp.x, inp.topk_weight, inp.w1, inp.w2, inp.b1, inp.b2)]


def autograd_call(moe, inp, dy, leaves=None):
    x, tw, w1, w2, b1, b2 = leaves if leaves is not None else leaves_of(inp)
    # the op allocates its outputs itself: the tests compare these bits with train_call's, whose outputs are
    # written into NaN-filled buffers (so equal bits mean every element was written here too)
    poison_free_memory(inp.x, shapes=intermediate_shapes(moe, inp.x.shape[0]))
    y = mokgen.moe_forward(x, inp.topk_idx, tw, w1, w2, b1, b2, moe=moe)
    poison_free_memory(inp.x, inp.topk_weight, inp.w1, inp.w2, inp.b1, inp.b2)
    y.backward(dy)
    return y.detach(), ref.Grads(*(None if t is None else t.grad for t in (x, tw, w1, w2, b1, b2)))


# --------------------------------------------------------------------------------------------------------------
# the per-preset case


@pytest.fixture(scope="module", params=PRESETS)
def case(request):
    spec = mokgen.load_spec(request.param)
    moe = mokgen.compile(spec, overrides=OVERRIDES)
    inp = ref.random_inputs(spec, tokens=_tokens(spec), device=DEV, seed=0)
    dy = make_dy(inp.x.shape[0], spec.hidden, seed=100)
    y_ref, g_ref = reference(spec, inp, dy)
    yield Case(spec, moe, inp, dy, y_ref, g_ref)
    del inp, dy, y_ref, g_ref
    moe.check_errors()
    torch.cuda.empty_cache()


def test_grads_match_reference(case):
    spec, moe, inp, dy, y_ref, g_ref = case
    y, g = train_call(moe, inp, dy)
    sync()
    check_y(y, y_ref, f"{spec.name}/forward_train")
    check_grads(g, g_ref, inp, f"{spec.name}/backward", tol=grad_tol(spec))
    moe.check_errors()


def test_autograd_grads_match_reference(case):
    spec, moe, inp, dy, y_ref, g_ref = case
    y, g = autograd_call(moe, inp, dy)
    sync()
    check_y(y, y_ref, f"{spec.name}/moe_forward")
    check_grads(g, g_ref, inp, f"{spec.name}/autograd", tol=grad_tol(spec))
    # the autograd path runs the same kernels as the low-level one: the same bits
    y2, g2 = train_call(moe, inp, dy)
    sync()
    assert same_bits(y, y2), "moe_forward vs forward_train bits differ"
    for name in NAMES:
        assert same_bits(getattr(g, name), getattr(g2, name)), f"autograd vs moe.backward: d{name} bits differ"
    moe.check_errors()


def test_bitwise_deterministic(case, ctas):
    spec, moe, inp, dy, _, _ = case
    half, full = ctas
    y1, g1 = train_call(moe, inp, dy, poison=False)
    y2, g2 = train_call(moe, inp, dy)
    y_half, g_half = train_call(moe, inp, dy, num_ctas=half)
    y_full, g_full = train_call(moe, inp, dy, num_ctas=full)
    sync()
    assert same_bits(y1, y2), "forward_train: run-to-run bits differ"
    assert same_bits(y_half, y_full), f"forward_train: num_ctas {half} vs {full} bits differ"
    assert same_bits(y1, y_half), f"forward_train: default num_ctas vs {half} bits differ"
    for name in NAMES:
        assert same_bits(getattr(g1, name), getattr(g2, name)), f"d{name}: run-to-run bits differ"
        assert same_bits(getattr(g_half, name), getattr(g_full, name)), \
            f"d{name}: num_ctas {half} vs {full} bits differ"
        assert same_bits(getattr(g1, name), getattr(g_half, name)), f"d{name}: default num_ctas vs {half} bits differ"


def assert_same_step_bits(spec, m1, m2, inp, dy, seed: int, what: str) -> None:
    """A training step of `m1` and of `m2` on `inp`'s routing and on a skewed one drawn with `seed`: y and every
    gradient have the same bits (`what` names the difference between the two plans in the message)."""
    for c in (inp, with_routing(spec, inp, "skewed", seed=seed)):
        y1, g1 = train_call(m1, c, dy)
        y2, g2 = train_call(m2, c, dy)
        sync()
        assert same_bits(y1, y2), f"{spec.name}: y bits differ between {what}"
        for name in NAMES:
            assert same_bits(getattr(g1, name), getattr(g2, name)), f"{spec.name}: d{name} bits differ between {what}"


def test_dgrad1_z_paths_same_bits(case):
    """dgrad1's z paths, through the stage ring by TMA (z_load "tma": dz written over z in shared memory and
    TMA-stored), global loads by the consumer threads a chunk at a time ("direct") and the same loads with the
    next chunk's issued before a chunk's math ("pipe"), do the same math in the same order: every output and
    gradient has the same bits, on random and on skewed routing (the ring's z stages interleave with the K stages
    of tiles of every group size). Each path the tile allows is compared with the plan's own."""
    from mokgen.plan import z_stage_problem

    spec, moe, inp, dy, _, _ = case
    d1 = moe.plan.backward.dgrad1
    others = [z for z in ("tma", "direct", "pipe") if z != d1.z_load and not (z == "tma" and z_stage_problem(d1))]
    for other in others:
        moe2 = mokgen.compile(spec, overrides={**OVERRIDES, "dgrad1_z_load": other})
        assert moe2.plan.backward.dgrad1.z_load == other
        assert_same_step_bits(spec, moe, moe2, inp, dy, 3, f"dgrad1 z_load {d1.z_load} and {other}")
        moe2.check_errors()


def test_pdl_same_bits(case):
    """Programmatic dependent launch (plan pdl) changes when each kernel may start, never what it reads: under each
    mode y and every gradient have the same bits as the plan's own, on random and skewed routing (a kernel that
    touched memory before its wait for the previous grid would read rows, tiles or scales half written)."""
    spec, moe, inp, dy, _, _ = case
    for other in [m for m in ("off", "exit", "tail") if m != moe.plan.pdl]:
        moe2 = mokgen.compile(spec, overrides={**OVERRIDES, "pdl": other})
        assert moe2.plan.pdl == other
        assert_same_step_bits(spec, moe, moe2, inp, dy, 11, f"pdl={moe.plan.pdl} and pdl={other}")
        moe2.check_errors()


def test_ring_gather_same_bits(case):
    """GEMM 1 gathering its rows with warps 2-3 beside the ring's storer (``gemm1_a_load=gather,
    gemm1_epi_store=ring``, opt-in in BF16): the training GEMM 1 gathers too, with z through the ring, and y and
    every gradient have the same bits as the plan's own, on random and skewed routing."""
    spec, moe, inp, dy, _, _ = case
    ov = {**OVERRIDES, "gemm1_a_load": "gather", "gemm1_epi_store": "ring"}
    try:
        moe2 = mokgen.compile(spec, overrides=ov)
    except PlanError as e:   # e.g. ping-pong tiles: no ring
        pytest.skip(f"{spec.name}: {e}")
    assert (moe2.plan.train_gemm1.a_load, moe2.plan.train_gemm1.z_store) == ("gather", "ring")
    assert_same_step_bits(spec, moe, moe2, inp, dy, 17, "gemm1_a_load=gather,gemm1_epi_store=ring")
    moe2.check_errors()


def test_gemm1_z_store_paths_same_bits(case):
    """GEMM 1's two z paths in training, through the stage ring (z_store "ring": z written into ring stages beside
    the output and TMA-stored by the storer warp) and 4-byte global stores by the consumer threads ("direct"),
    both on TMA-loaded rows with the output through the ring: the same y and every gradient bit for bit (the
    backward reads z, so a wrong or missing z element changes the gradients), on random and skewed routing."""
    from mokgen.plan import PlanError

    spec, moe, inp, dy, _, _ = case
    base = {**OVERRIDES, "gemm1_a_load": "tma"}
    try:
        ring = mokgen.compile(spec, overrides={**base, "gemm1_z_store": "ring"})
    except PlanError as e:
        pytest.skip(f"{spec.name}: no z ring ({e})")
    direct = mokgen.compile(spec, overrides={**base, "gemm1_z_store": "direct"})
    assert (ring.plan.gemm1.z_store, direct.plan.gemm1.z_store) == ("ring", "direct")
    assert_same_step_bits(spec, direct, ring, inp, dy, 5, "gemm1 z_store direct and ring")
    ring.check_errors()


def test_backward_streams_same_bits(case):
    """The backward on one stream and on two (plan.backward.streams: the weight gradients on a side stream beside
    dgrad2 and the combine) launches the same kernels on the same data: y, every gradient and the fp32 main_grad
    accumulation have the same bits, on random and skewed routing. (The whole suite runs on the two-stream plan
    with MOKGEN_GPU_OVERRIDES=bwd_streams=2: CUDA graph, torch.compile, half vs all the SMs' CTAs.)"""
    spec, moe, inp, dy, _, _ = case
    other = 2 if moe.plan.backward.streams == 1 else 1
    moe2 = mokgen.compile(spec, overrides={**OVERRIDES, "bwd_streams": other})
    assert moe2.plan.backward.streams == other
    assert_same_step_bits(spec, moe, moe2, inp, dy, 4, f"backward streams {moe.plan.backward.streams} and {other}")
    mgs = []
    for m in (moe, moe2):
        mg1 = torch.full(inp.w1.shape, 0.5, dtype=torch.float32, device=DEV)
        mg2 = torch.full(inp.w2.shape, -0.25, dtype=torch.float32, device=DEV)
        train_call(m, inp, dy, w1_main_grad=mg1, w2_main_grad=mg2)
        mgs.append((mg1, mg2))
    sync()
    assert same_bits(mgs[0][0], mgs[1][0]) and same_bits(mgs[0][1], mgs[1][1]), \
        f"{spec.name}: main_grad bits differ between 1 and 2 backward streams"
    moe2.check_errors()


@pytest.mark.parametrize("routing", ["one_expert", "empty_experts", "skewed"])
def test_special_routing(case, routing, ctas):
    spec, moe, inp, dy, _, _ = case
    c = with_routing(spec, inp, routing)
    y_ref, g_ref = reference(spec, c, dy)
    y, g = train_call(moe, c, dy)
    sync()
    what = f"{spec.name}/{routing}"
    check_y(y, y_ref, what)
    check_grads(g, g_ref, c, what, tol=grad_tol(spec))
    empty = check_empty_experts_zero(spec, c, g, what)
    if routing in ("one_expert", "empty_experts") and spec.local_experts > 1:
        assert empty, f"{what}: the routing left no expert empty (test inputs wrong)"
    y_half, g_half = train_call(moe, c, dy, num_ctas=ctas.half)
    sync()
    assert same_bits(y, y_half), f"{what}: y bits differ with {ctas.half} CTAs"
    for name in NAMES:
        assert same_bits(getattr(g, name), getattr(g_half, name)), f"{what}: d{name} bits differ with {ctas.half} CTAs"
    moe.check_errors()


@pytest.mark.parametrize("tokens", [1000, 1])
def test_tokens_not_a_tile_multiple(case, tokens):
    spec, moe, inp, _, _, _ = case
    c = with_routing(spec, inp, "random", tokens=tokens, seed=2)
    dy = make_dy(tokens, spec.hidden, seed=101)
    y_ref, g_ref = reference(spec, c, dy)
    y, g = train_call(moe, c, dy)
    sync()
    check_y(y, y_ref, f"{spec.name}/T={tokens}")
    if spec.dtype == "fp8":
        # against the same step on the reference kernels (float32 math on the quantized operands each kernel
        # receives) within TOL; the BF16 reference's FP8 bound only where a gradient has enough elements for a
        # norm: at T = 1 the router gradient has K values, and its distance to the BF16 reference spread 0.03-0.12
        # over 12 seeds in the CPU emulation (bench/NOTES.md v37), 0.171 once on an H100
        check_grads(g, reference_kernel_grads(moe, c, dy), c, f"{spec.name}/T={tokens} (reference kernels)")
        check_grads(g, g_ref, c, f"{spec.name}/T={tokens}", tol=grad_tol(spec),
                    skip=("topk_weight",) if tokens * spec.topk < 64 else ())
    else:
        check_grads(g, g_ref, c, f"{spec.name}/T={tokens}", tol=grad_tol(spec))
    check_empty_experts_zero(spec, c, g, f"{spec.name}/T={tokens}")
    moe.check_errors()


def reference_kernel_grads(moe, inp, dy):
    """The gradients of a training step of ``moe``'s plan on the reference kernels (mokgen.reference.reference_kernels,
    as tests/test_gpu_fp8.py::test_training_matches_reference_kernels runs them)."""
    refm = mokgen.ops.CompiledMoE(moe.spec, moe.plan, functions=mokgen.ops.fp8_reference_kernels(moe.spec, moe.plan),
                                  allow_cpu=DEV == "cpu")
    args = (inp.x, inp.topk_weight, inp.w1, inp.w2, inp.b1, inp.b2)
    _, saved = refm.forward_train(inp.x, inp.topk_idx, *args[1:])
    g = refm.backward(dy, saved, *args)
    sync()
    return ref.Grads(*(None if t is None else t.float() for t in g))


def test_interleaved_layers(case):
    """Two layers of one spec (one CompiledMoE): f1, f2, b2, b1 give the bits of f1, b1 and f2, b2 run alone;
    the state one call saves is never overwritten by another call."""
    spec, moe, inp1, dy1, _, _ = case
    inp2 = ref.random_inputs(spec, tokens=inp1.x.shape[0], device=DEV, seed=5)
    dy2 = make_dy(inp1.x.shape[0], spec.hidden, seed=102)

    # alone
    ya1, ga1 = train_call(moe, inp1, dy1, poison=False)
    ya2, ga2 = train_call(moe, inp2, dy2, poison=False)
    # interleaved, low level
    y1, s1 = moe.forward_train(inp1.x, inp1.topk_idx, inp1.topk_weight, inp1.w1, inp1.w2, inp1.b1, inp1.b2)
    y2, s2 = moe.forward_train(inp2.x, inp2.topk_idx, inp2.topk_weight, inp2.w1, inp2.w2, inp2.b1, inp2.b2)
    gi2 = moe.backward(dy2, s2, inp2.x, inp2.topk_weight, inp2.w1, inp2.w2, inp2.b1, inp2.b2)
    gi1 = moe.backward(dy1, s1, inp1.x, inp1.topk_weight, inp1.w1, inp1.w2, inp1.b1, inp1.b2)
    sync()
    assert same_bits(y1, ya1) and same_bits(y2, ya2), "forward bits differ when interleaved"
    for name in NAMES:
        assert same_bits(getattr(gi1, name), getattr(ga1, name)), f"layer 1 d{name} differs when interleaved"
        assert same_bits(getattr(gi2, name), getattr(ga2, name)), f"layer 2 d{name} differs when interleaved"

    # interleaved through autograd (the way two layers of a model run)
    l1, l2 = leaves_of(inp1), leaves_of(inp2)
    o1 = mokgen.moe_forward(l1[0], inp1.topk_idx, *l1[1:], moe=moe)
    o2 = mokgen.moe_forward(l2[0], inp2.topk_idx, *l2[1:], moe=moe)
    d2 = torch.autograd.grad(o2, [t for t in l2 if t is not None], dy2)
    d1 = torch.autograd.grad(o1, [t for t in l1 if t is not None], dy1)
    sync()
    for d, ga, lv in ((d1, ga1, l1), (d2, ga2, l2)):
        names = [n for n, t in zip(NAMES, lv) if t is not None]
        for name, t in zip(names, d):
            assert same_bits(t, getattr(ga, name)), f"autograd, interleaved: d{name} differs from alone"
    moe.check_errors()


def test_main_grad_accumulates(case):
    """w1_main_grad / w2_main_grad (fp32, pre-filled): the weight gradients are added into them in fp32 (every
    element: the pre-fill is kept where nothing is added), g.w1 / g.w2 are None, the rest unchanged."""
    spec, moe, inp, dy, _, g_ref = case
    _, g_bf16 = train_call(moe, inp, dy, poison=False)
    gen = torch.Generator(device=DEV).manual_seed(7)
    scale1 = g_ref.w1.abs().mean().item()
    scale2 = g_ref.w2.abs().mean().item()
    pre1 = torch.randn(inp.w1.shape, generator=gen, device=DEV).mul_(scale1)
    pre2 = torch.randn(inp.w2.shape, generator=gen, device=DEV).mul_(scale2)
    mg1, mg2 = pre1.clone(), pre2.clone()
    y, g = train_call(moe, inp, dy, w1_main_grad=mg1, w2_main_grad=mg2)
    sync()
    assert g.w1 is None and g.w2 is None, "with main_grad buffers, g.w1 / g.w2 must be None"
    for name in ("x", "topk_weight", "b1", "b2"):
        assert same_bits(getattr(g, name), getattr(g_bf16, name)), f"d{name} changed with main_grad"
    for mg, pre, r, gb, n in ((mg1, pre1, g_ref.w1, g_bf16.w1, "w1"), (mg2, pre2, g_ref.w2, g_bf16.w2, "w2")):
        assert mg.dtype == torch.float32 and bool(torch.isfinite(mg).all()), f"{n}.main_grad not finite"
        added = mg - pre
        err, tol = rel_err(added, r), grad_tol(spec)
        assert err <= tol, f"{spec.name}: {n}.main_grad - prefill vs reference: {err:.3e} > {tol}"
        err = rel_err(added, gb.float())
        assert err <= TOL, f"{spec.name}: {n}.main_grad - prefill vs the bf16 gradient: {err:.3e} > {TOL}"
        check_accumulated(added, gb.float(), gb.float().abs(), f"{spec.name}: {n}.main_grad")
        del added
    # deterministic: the same accumulation again gives the same bits
    mg1b, mg2b = pre1.clone(), pre2.clone()
    train_call(moe, inp, dy, w1_main_grad=mg1b, w2_main_grad=mg2b)
    sync()
    assert same_bits(mg1, mg1b) and same_bits(mg2, mg2b), "main_grad accumulation bits differ run to run"


def test_main_grad_keeps_empty_experts(case):
    spec, moe, inp, dy, _, _ = case
    if spec.local_experts == 1:
        pytest.skip(f"{spec.name}: one local expert, which every token routes to: no expert can be empty")
    c = with_routing(spec, inp, "empty_experts")
    pre1 = torch.randn(inp.w1.shape, device=DEV)
    pre2 = torch.randn(inp.w2.shape, device=DEV)
    mg1, mg2 = pre1.clone(), pre2.clone()
    train_call(moe, c, dy, w1_main_grad=mg1, w2_main_grad=mg2)
    sync()
    counts = torch.bincount(c.topk_idx.reshape(-1).long(), minlength=spec.local_experts)
    empty = torch.nonzero(counts == 0).flatten().tolist()
    used = torch.nonzero(counts > 0).flatten().tolist()
    assert empty and used, f"{spec.name}: the empty_experts routing left no expert empty (test inputs wrong)"
    assert same_bits(mg1[empty], pre1[empty]) and same_bits(mg2[empty], pre2[empty]), \
        "main_grad of experts without rows changed"
    assert not torch.equal(mg1[used], pre1[used]), "main_grad of the used experts did not change"


def test_cuda_graph_forward_backward(case):
    """A whole step (forward, backward into .grad) captured in a CUDA graph replays with the eager bits, and
    recomputes on new data copied into the static inputs and after the weights change in place."""
    spec, moe, inp, dy, _, _ = case
    leaves = leaves_of(inp._replace(x=inp.x.clone(), topk_weight=inp.topk_weight.clone(), w1=inp.w1.clone(),
                                    w2=inp.w2.clone()))   # own weights: the test changes them in place
    x_s, tw_s, w1, w2, b1, b2 = leaves
    idx_s, dy_s = inp.topk_idx.clone(), dy.clone()

    def step():
        for t in leaves:
            if t is not None:
                t.grad = None
        y = mokgen.moe_forward(x_s, idx_s, tw_s, w1, w2, b1, b2, moe=moe)
        y.backward(dy_s)
        return y.detach()

    def grads():
        return [None if t is None else t.grad for t in leaves]

    y_e = step()
    g_e = [None if t is None else t.clone() for t in grads()]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):                       # warm-up on a side stream (autograd buffers)
            step()
    torch.cuda.current_stream().wait_stream(s)
    for t in leaves:
        if t is not None:
            t.grad = None
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y_s = step()
    g_s = grads()
    assert all((a is None) == (b is None) for a, b in zip(g_s, g_e))
    y_s.fill_(float("nan"))
    for t in g_s:
        if t is not None:
            t.fill_(float("nan"))
    g.replay()
    sync()
    assert same_bits(y_s, y_e), "graph replay: y bits differ from eager"
    for name, a, b in zip(NAMES, g_s, g_e):
        assert same_bits(a, b), f"graph replay: d{name} bits differ from eager"
    g.replay()
    sync()
    for name, a, b in zip(NAMES, g_s, g_e):
        assert same_bits(a, b), f"second replay: d{name} bits differ"
    # new data in the static inputs
    fresh = ref.random_inputs(spec, tokens=inp.x.shape[0], device=DEV, seed=9)
    dy_new = make_dy(inp.x.shape[0], spec.hidden, seed=103)
    with torch.no_grad():
        x_s.copy_(fresh.x)
        tw_s.copy_(fresh.topk_weight)
        idx_s.copy_(fresh.topk_idx)
        dy_s.copy_(dy_new)
    g.replay()
    sync()
    y_n, g_n = autograd_call(moe, inp._replace(x=fresh.x, topk_idx=fresh.topk_idx, topk_weight=fresh.topk_weight),
                             dy_new)
    sync()
    assert same_bits(y_s, y_n), "graph replay on new data: y differs from eager"
    for name, a in zip(NAMES, g_s):
        assert same_bits(a, getattr(g_n, name)), f"graph replay on new data: d{name} differs from eager"
    # the weights changed in place (as optimizer.step() does) between replays: a replay computes with the new
    # ones (FP8 / MXFP8: their quantized copies are made again inside the graph, every replay)
    with torch.no_grad():
        w1.mul_(0.5)
        w2.mul_(-1.5)
    g.replay()
    sync()
    y_w, g_w = autograd_call(moe, inp._replace(x=fresh.x, topk_idx=fresh.topk_idx, topk_weight=fresh.topk_weight,
                                               w1=w1.detach(), w2=w2.detach()), dy_new)
    sync()
    assert not same_bits(y_w, y_n), "the weights' change did not change y"
    assert same_bits(y_s, y_w), "graph replay after a weight update: y differs from eager"
    for name, a in zip(NAMES, g_s):
        assert same_bits(a, getattr(g_w, name)), f"graph replay after a weight update: d{name} differs from eager"
    del g
    moe.check_errors()


# --------------------------------------------------------------------------------------------------------------
# the checks themselves: a perturbed kernel must fail them


class perturbed:
    """Within the block, ``moe``'s kernel ``kernel`` runs as usual and then its output argument is changed:
    ``scale`` multiplies all of it by 1.05, ``skip`` puts NaN back into its first ``rows`` rows (what a tile the
    kernel never wrote reads in a poisoned buffer)."""

    def __init__(self, moe, kernel: str, how: str, out_arg: str = "out", rows: int = 64, table: str | None = None):
        self.moe, self.kernel, self.how, self.rows = moe, kernel, how, rows
        self.args = mk.names(table or kernel)   # the argument table the runtime launches it with
        self.pos = self.args.index(out_arg)

    def __enter__(self):
        fns = self.moe._fns
        self.orig = orig = fns[self.kernel]

        def wrapper(*args):
            assert len(args) == len(self.args), f"{self.kernel}: launched with {len(args)} arguments, its table " \
                f"has {len(self.args)} (perturbed with the wrong table)"
            r = orig(*args)
            t = args[self.pos]
            if self.how == "scale":
                t.mul_(1.05)
            else:
                t.view(-1, t.shape[-1])[: self.rows].fill_(float("nan"))
            return r

        fns[self.kernel] = wrapper
        return self

    def __exit__(self, *exc):
        self.moe._fns[self.kernel] = self.orig
        return False


# (kernel, its output argument, how, the check that must fail: "y" or the gradient's name)
PERTURBATIONS = [("gemm2", "out", "scale", "y"), ("combine", "y", "skip", "y"), ("dgrad2", "out", "scale", "x"),
                 ("dgrad1", "ds", "scale", "topk_weight"), ("wgrad1", "out", "scale", "w1"),
                 ("wgrad2", "out", "skip", "w2")]


def assert_checks_catch(case_, kernel, out_arg, how, target):
    """The suite's own checks (check_y / check_grads on train_call's outputs) fail with ``kernel`` perturbed,
    naming the perturbed output, and pass again once it is restored."""
    spec, moe, inp, dy, y_ref, g_ref = case_
    if spec.dtype == "fp8" and target != "y":
        pytest.skip("FP8: a 5% perturbation of a gradient hides under FP8_GRAD_TOL; tests/test_gpu_fp8.py checks "
                    "FP8's gradients against quantization-aware references")
    table = f"{kernel}_fp8" if spec.dtype == "fp8" and f"{kernel}_fp8" in mk.ARGS else kernel   # FP8's gemm2_fp8
    with perturbed(moe, kernel, how, out_arg, table=table):
        y, g = train_call(moe, inp, dy)
        sync()
        with pytest.raises(AssertionError, match=("y" if target == "y" else f"d{target}") + r"\b"):
            if target == "y":
                check_y(y, y_ref, f"{spec.name}/{kernel} {how}")
            else:
                check_grads(g, g_ref, inp, f"{spec.name}/{kernel} {how}",
                            skip=tuple(n for n in NAMES if n != target))
    y, g = train_call(moe, inp, dy)
    sync()
    check_y(y, y_ref, f"{spec.name}/restored")
    check_grads(g, g_ref, inp, f"{spec.name}/restored", tol=grad_tol(spec))


@pytest.mark.parametrize("kernel,out_arg,how,target", PERTURBATIONS, ids=[f"{p[0]}-{p[2]}" for p in PERTURBATIONS])
def test_checks_catch_a_perturbed_kernel(case, kernel, out_arg, how, target):
    assert_checks_catch(case, kernel, out_arg, how, target)


# --------------------------------------------------------------------------------------------------------------
# nn.Module: main_grad over micro-batches, torch.compile


def _module_preset() -> str:
    return "qwen3-30b-a3b" if "qwen3-30b-a3b" in PRESETS else PRESETS[0]


def _module_kw(spec):
    """Compile the module's kernels with the suite's overrides (the default plan without any)."""
    return {"compiled": mokgen.compile(spec, overrides=OVERRIDES)} if OVERRIDES else {}


@pytest.mark.parametrize("name", PRESETS)
def test_module_main_grad_micro_batches(name):
    """mokgen.MoE(main_grad=True) over 3 micro-batches: w1.main_grad / w2.main_grad end as the pre-fill plus
    the fp32 sum of the per-micro-batch gradients (bf16-level tolerance), w1.grad / w2.grad stay None, biases
    accumulate in .grad; the whole accumulation is deterministic."""
    spec = mokgen.load_spec(name)
    torch.manual_seed(0)
    layer = mokgen.MoE(spec, device=DEV, main_grad=True, **_module_kw(spec))
    T = _tokens(spec)
    micro = [ref.random_inputs(spec, tokens=T, device=DEV, seed=20 + i) for i in range(3)]
    dys = [make_dy(T, spec.hidden, seed=200 + i) for i in range(3)]
    gen = torch.Generator(device=DEV).manual_seed(8)
    pre1 = torch.randn(layer.w1.shape, generator=gen, device=DEV).mul_(1e-3)
    pre2 = torch.randn(layer.w2.shape, generator=gen, device=DEV).mul_(1e-3)

    def accumulate():
        layer.w1.main_grad = pre1.clone()
        layer.w2.main_grad = pre2.clone()
        layer.zero_grad(set_to_none=True)
        for mb, d in zip(micro, dys):
            x = mb.x.clone().requires_grad_(True)
            tw = mb.topk_weight.clone().requires_grad_(True)
            layer(x, mb.topk_idx, tw).backward(d)
            assert x.grad is not None and tw.grad is not None
        sync()
        assert layer.w1.grad is None and layer.w2.grad is None, "main_grad=True must leave w1.grad / w2.grad None"
        return (layer.w1.main_grad, layer.w2.main_grad,
                None if layer.b1 is None else layer.b1.grad, None if layer.b2 is None else layer.b2.grad)

    mg1, mg2, gb1, gb2 = accumulate()
    # the per-micro-batch gradients, one at a time through the plain (bf16-gradient) path, summed in fp32
    w = [p.detach() for p in (layer.w1, layer.w2)]
    b = [None if p is None else p.detach() for p in (layer.b1, layer.b2)]
    moe = layer.compiled
    sums = [torch.zeros_like(pre1), torch.zeros_like(pre2)]
    abs_sums = [torch.zeros_like(pre1), torch.zeros_like(pre2)]
    bsums = [None if p is None else torch.zeros_like(p) for p in b]
    for mb, d in zip(micro, dys):
        _, g = train_call(moe, mb._replace(w1=w[0], w2=w[1], b1=b[0], b2=b[1]), d, poison=False)
        for s_, a_, gg in zip(sums, abs_sums, (g.w1, g.w2)):
            s_ += gg.float()
            a_ += gg.float().abs()
        for s_, gg in zip(bsums, (g.b1, g.b2)):
            if s_ is not None:
                s_ += gg
        del g
    sync()
    for mg, pre, s_, a_, n in ((mg1, pre1, sums[0], abs_sums[0], "w1"), (mg2, pre2, sums[1], abs_sums[1], "w2")):
        assert mg.dtype == torch.float32 and bool(torch.isfinite(mg).all()), f"{n}.main_grad not finite"
        added = mg - pre
        err = rel_err(added, s_)
        assert err <= TOL, f"{name}: {n}.main_grad - prefill vs fp32 sum of micro-batch grads: {err:.3e} > {TOL}"
        check_accumulated(added, s_, a_, f"{name}: {n}.main_grad over 3 micro-batches")
        del added
    del sums, abs_sums
    for gb, s_, n in ((gb1, bsums[0], "b1"), (gb2, bsums[1], "b2")):
        if s_ is not None:
            assert gb is not None and rel_err(gb, s_) <= TOL, f"{name}: {n}.grad accumulation"
    # accumulate() gives the layer fresh main_grad tensors: the first results stay as they are
    r1, r2, rb1, rb2 = mg1, mg2, gb1, gb2
    mg1b, mg2b, gb1b, gb2b = accumulate()
    assert same_bits(r1, mg1b) and same_bits(r2, mg2b), "main_grad accumulation is not deterministic"
    assert same_bits(rb1, gb1b) and same_bits(rb2, gb2b), "bias grad accumulation is not deterministic"
    layer.check_errors()


class _Block(torch.nn.Module):
    """A small module around mokgen.MoE; the scalings are exact in bf16, so compiled and eager must agree
    bit for bit."""

    def __init__(self, spec, **kw):
        super().__init__()
        self.moe = mokgen.MoE(spec, device=DEV, **kw)

    def forward(self, x, topk_idx, topk_weight):
        return self.moe(x * 2.0, topk_idx, topk_weight) * 0.5


def test_torch_compile_fullgraph():
    name = _module_preset()
    spec = mokgen.load_spec(name)
    torch.manual_seed(0)
    block = _Block(spec, **_module_kw(spec))
    block.moe.compiled                               # load the kernels outside the traced region
    inp = ref.random_inputs(spec, tokens=512, device=DEV, seed=4)
    dy = make_dy(512, spec.hidden, seed=104)

    def run(fn):
        block.zero_grad(set_to_none=True)
        x = inp.x.clone().requires_grad_(True)
        tw = inp.topk_weight.clone().requires_grad_(True)
        y = fn(x, inp.topk_idx, tw)
        y.backward(dy)
        sync()
        return [y.detach(), x.grad, tw.grad] + [None if p is None else p.grad
                                                for p in (block.moe.w1, block.moe.w2, block.moe.b1, block.moe.b2)]

    eager = run(block)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    got = run(compiled)
    got2 = run(compiled)                             # the second call runs the cached graph
    labels = ["y", "dx", "dtopk_weight", "dw1", "dw2", "db1", "db2"]
    for lab, a, b, c in zip(labels, eager, got, got2):
        assert same_bits(a, b), f"torch.compile: {lab} differs from eager"
        assert same_bits(b, c), f"torch.compile: {lab} differs between compiled calls"
    # the block computes MoE(2x) / 2
    y_ref = forward_ref(spec)(inp.x * 2, inp.topk_idx, inp.topk_weight, block.moe.w1.detach(), block.moe.w2.detach(),
                        spec, None if block.moe.b1 is None else block.moe.b1.detach(),
                        None if block.moe.b2 is None else block.moe.b2.detach()) * 0.5
    check_y(got[0], y_ref, f"{name}/torch.compile")
    block.moe.check_errors()
