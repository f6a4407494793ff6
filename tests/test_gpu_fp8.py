"""The FP8 forward (spec ``dtype: fp8``) on a GPU (H200, sm_90a): e4m3 GEMMs with blockwise scales.

Per preset (its spec with ``dtype`` set to ``fp8``):

* the output, written into a NaN-poisoned buffer, against :func:`mokgen.reference.forward_fp8` (float64 on the
  dequantized operands, h rounded to bf16 and quantized as the kernels do) within 1e-2, and against the BF16
  float64 reference (the FP8 error itself: reported, bounded loosely);
* bitwise run-to-run and num_ctas (half vs all the SMs: 66 vs 132 on an H200) determinism; special routings;
  T = 1 and an odd T;
* the training forward's y equals the inference forward's, and its backward (BF16 kernels on the master weights,
  z saved by the FP8 GEMM 1) gives finite gradients close to the BF16 reference's;
* the weights' e4m3 copies follow in-place updates (``optimizer.step()``): never stale;
* no host sync under ``torch.cuda.set_sync_debug_mode("error")`` once the weights are quantized.

``MOKGEN_GPU_PRESETS`` (comma-separated) picks presets, ``MOKGEN_GPU_TOKENS`` caps T, ``MOKGEN_GPU_OVERRIDES``
(``k=v,...``, e.g. ``promote=overlap``) plan overrides.
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
from mokgen import plan as P  # noqa: E402
from mokgen.plan import parse_overrides  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.fp8]

PRESETS = ["qwen3-30b-a3b", "kimi-k2", "gpt-oss-120b"]
if os.environ.get("MOKGEN_GPU_PRESETS"):
    PRESETS = [p.strip() for p in os.environ["MOKGEN_GPU_PRESETS"].split(",") if p.strip()]
OVERRIDES = parse_overrides(os.environ.get("MOKGEN_GPU_OVERRIDES", ""))  # typed as the CLI's --set
TOL = 1e-2          # against the quantization-aware float64 reference
FP8_TOL = 0.12      # against the BF16 float64 reference (e4m3 keeps 3 mantissa bits: ~5-7% measured on CPU)


def _tokens(spec) -> int:
    cap = os.environ.get("MOKGEN_GPU_TOKENS")
    return min(spec.tokens, int(cap)) if cap else spec.tokens


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def run(moe, inp, **kw):
    return moe(inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2, inp.b1, inp.b2, **kw)


def check(spec, inp, y, what):
    assert not bool(y.isnan().any()), f"{what}: NaN in the output (an element was not written?)"
    err = ref.rel_err(y.float(), ref.forward_fp8(inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2, spec,
                                                 inp.b1, inp.b2))
    err16 = ref.rel_err(y.float(), ref.forward(inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2, spec,
                                               inp.b1, inp.b2))
    print(f"{what}: rel err {err:.3e} vs the fp8 reference, {err16:.3e} vs the bf16 reference")
    assert err <= TOL, f"{what}: relative error {err:.3e} > {TOL} against the quantization-aware reference"
    assert err16 <= FP8_TOL, f"{what}: relative error {err16:.3e} > {FP8_TOL} against the bf16 reference"


@pytest.fixture(scope="module", params=PRESETS)
def case(request):
    spec = dataclasses.replace(mokgen.load_spec(request.param), dtype="fp8")
    moe = mokgen.compile(spec, overrides=OVERRIDES)
    inp = ref.random_inputs(spec, tokens=_tokens(spec), device="cuda", seed=0)
    yield spec, moe, inp
    moe.check_errors()
    del inp
    torch.cuda.empty_cache()


def test_forward_matches_reference(case):
    spec, moe, inp = case
    out = torch.full((inp.x.shape[0], spec.hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = run(moe, inp, out=out)
    assert y is out
    torch.cuda.synchronize()
    check(spec, inp, y, spec.name)
    moe.check_errors()


def test_bitwise_deterministic(case, ctas):
    spec, moe, inp = case
    y1, y2 = run(moe, inp), run(moe, inp)
    y_half, y_full = run(moe, inp, num_ctas=ctas.half), run(moe, inp, num_ctas=ctas.full)
    torch.cuda.synchronize()
    assert torch.equal(bits(y1), bits(y2)), "run-to-run bits differ"
    assert torch.equal(bits(y_half), bits(y_full)), f"num_ctas {ctas.half} vs {ctas.full} bits differ"
    assert torch.equal(bits(y1), bits(y_half))


@pytest.mark.parametrize("routing", ["one_expert", "empty_experts", "skewed"])
def test_special_routing(case, routing):
    spec, moe, inp = case
    fresh = ref.random_inputs(spec, tokens=inp.x.shape[0], device="cuda", seed=1, routing=routing)
    cinp = inp._replace(topk_idx=fresh.topk_idx, topk_weight=fresh.topk_weight)
    y = run(moe, cinp, out=torch.full_like(inp.x, float("nan")))
    torch.cuda.synchronize()
    check(spec, cinp, y, f"{spec.name}/{routing}")


@pytest.mark.parametrize("tokens", [1, 999])
def test_small_and_odd_tokens(case, tokens):
    spec, moe, inp = case
    fresh = ref.random_inputs(spec, tokens=tokens, device="cuda", seed=2)
    cinp = inp._replace(x=fresh.x, topk_idx=fresh.topk_idx, topk_weight=fresh.topk_weight)
    y = run(moe, cinp, out=torch.full_like(fresh.x, float("nan")))
    torch.cuda.synchronize()
    check(spec, cinp, y, f"{spec.name}/T={tokens}")


def test_weights_requantized_after_update(case):
    spec, moe, inp = case
    w2 = inp.w2.clone()
    y1 = moe(inp.x, inp.topk_idx, inp.topk_weight, inp.w1, w2, inp.b1, inp.b2)
    with torch.no_grad():
        w2.mul_(0.5)   # as optimizer.step() does: in place, same storage, version bumped
    y2 = moe(inp.x, inp.topk_idx, inp.topk_weight, inp.w1, w2, inp.b1, inp.b2)
    torch.cuda.synchronize()
    check(spec, inp._replace(w2=w2), y2, f"{spec.name}/after an in-place weight update")
    assert not torch.equal(bits(y1), bits(y2))


def test_no_host_sync(case):
    spec, moe, inp = case
    run(moe, inp)   # weights quantized (and cached) outside the sync check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run(moe, inp)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_training_step(case):
    spec, moe, inp = case
    y_inf = run(moe, inp)
    y, saved = moe.forward_train(inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2, inp.b1, inp.b2)
    torch.cuda.synchronize()
    assert torch.equal(bits(y), bits(y_inf)), "forward_train's y differs from the inference forward's"
    dy = torch.randn_like(y)
    g = moe.backward(dy, saved, inp.x, inp.topk_weight, inp.w1, inp.w2, inp.b1, inp.b2)
    torch.cuda.synchronize()
    r = ref.backward(dy, inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2, spec, inp.b1, inp.b2)
    for name in ("x", "topk_weight", "w1", "w2"):
        got, want = getattr(g, name), getattr(r, name)
        assert bool(torch.isfinite(got).all()), f"{name}: not finite"
        err = ref.rel_err(got.float(), want)
        print(f"{spec.name}: grad {name} rel err {err:.3e} vs the bf16 reference (z from the FP8 GEMM 1)")
        assert err <= FP8_TOL, f"grad {name}: {err:.3e} > {FP8_TOL}"


def test_training_matches_reference_kernels(case):
    """Forward and every gradient of a training step against the same step on the reference kernels
    (mokgen.reference.reference_kernels: float32 math on the dequantized operands each kernel receives: the
    quantized x, h, dO and dz rows, the weights' e4m3 copies and their transposes), within 1e-2."""
    from mokgen.ops import CompiledMoE, fp8_reference_kernels

    spec, moe, inp = case
    refm = CompiledMoE(spec, moe.plan, functions=fp8_reference_kernels(spec, moe.plan))
    dy = torch.randn(inp.x.shape[0], spec.hidden, device="cuda", dtype=torch.bfloat16)
    outs = []
    for m in (moe, refm):
        y, saved = m.forward_train(inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2, inp.b1, inp.b2)
        g = m.backward(dy, saved, inp.x, inp.topk_weight, inp.w1, inp.w2, inp.b1, inp.b2)
        outs.append((y, g))
    torch.cuda.synchronize()
    (y, g), (y_r, g_r) = outs
    assert ref.rel_err(y.float(), y_r.double()) <= TOL
    for name in ("x", "topk_weight", "w1", "w2", "b1", "b2"):
        got, want = getattr(g, name), getattr(g_r, name)
        if want is None:
            continue
        assert bool(torch.isfinite(got).all()), f"grad {name}: not finite"
        err = ref.rel_err(got.float(), want.double())
        print(f"{spec.name}: grad {name} rel err {err:.3e} vs the reference kernels")
        assert err <= TOL, f"grad {name}: {err:.3e} > {TOL} against the reference kernels"


def _assert_same_step_bits(spec, m1, m2, inp, seed, what, grads=("x", "topk_weight", "w1", "w2")):
    """A training step of `m1` and of `m2` (random routing, then a skewed one drawn with `seed`): y has no NaN and
    y and the gradients `grads` have the same bits."""
    dy = torch.randn(inp.x.shape[0], spec.hidden, device="cuda", dtype=torch.bfloat16)
    fresh = ref.random_inputs(spec, tokens=inp.x.shape[0], device="cuda", seed=seed, routing="skewed")

    def step(m, c):
        y, saved = m.forward_train(c.x, c.topk_idx, c.topk_weight, c.w1, c.w2, c.b1, c.b2)
        return y, m.backward(dy, saved, c.x, c.topk_weight, c.w1, c.w2, c.b1, c.b2)

    for c in (inp, inp._replace(topk_idx=fresh.topk_idx, topk_weight=fresh.topk_weight)):
        (y1, g1), (y2, g2) = step(m1, c), step(m2, c)
        torch.cuda.synchronize()
        assert not bool(y2.isnan().any()), f"{spec.name}: NaN in y with {what}"
        assert torch.equal(bits(y1), bits(y2)), f"{spec.name}: y bits differ with {what}"
        for name in grads:
            a, b = getattr(g1, name), getattr(g2, name)
            assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                               b.view(torch.int16) if b.dtype == torch.bfloat16 else b), \
                f"{spec.name}: grad {name} bits differ with {what}"


def test_promote_modes_same_bits(case):
    """The FP8 GEMMs' promotion modes (plan promote: serial, stagger = the two warpgroups one K block apart,
    overlap = two per-block accumulators) add the same products in the same order per accumulator: the forward
    and every gradient of a training step have the same bits under each (random and skewed routing)."""
    spec, moe, inp = case
    for mode in [m for m in ("serial", "stagger", "overlap") if m != moe.plan.gemm2.promote]:
        other = mokgen.compile(spec, overrides={**OVERRIDES, "promote": mode})
        _assert_same_step_bits(spec, moe, other, inp, 2, f"promote={mode}")
        other.check_errors()


def test_pdl_same_bits(case):
    """Programmatic dependent launch (plan pdl) in each mode: the FP8 step's quantizers, GEMMs and combines give the
    same forward and gradient bits as the plan's own (each kernel waits for the previous grid before its first
    memory access)."""
    spec, moe, inp = case
    for mode in [m for m in ("off", "exit", "tail") if m != moe.plan.pdl]:
        other = mokgen.compile(spec, overrides={**OVERRIDES, "pdl": mode})
        _assert_same_step_bits(spec, moe, other, inp, 12, f"pdl={mode}")
        other.check_errors()


def test_a_load_same_bits(case):
    """GEMM 1's A path (plan gemm1.a_load): "tma" = quant_rows_gather's routed rows read by TMA tiles, "gather" =
    x quantized once per token (quant_rows) and its e4m3 rows gathered by GEMM 1's producer warps (cp.async), the
    scales read by token; with the output ring (warps 2-3 gather) and with epilogue buffers (all four warps
    gather). Same operands, same products in the same order: the inference forward has the same bits either way
    (into a NaN-poisoned output: every element written), with random and skewed routing, T = 1 and an odd T, and 66
    vs 132 CTAs; and a training step (the training GEMM 1 gathers too, z through the ring) the same forward and
    gradient bits."""
    spec, moe, inp = case
    if spec.hidden % 128:
        pytest.skip("the FP8 gather reads whole 128-wide K blocks: hidden must be a multiple of 128")
    own = (moe.plan.gemm1.a_load, moe.plan.gemm1.epi_store)
    skewed = ref.random_inputs(spec, tokens=inp.x.shape[0], device="cuda", seed=14, routing="skewed")
    cases = [("random", inp), ("skewed", inp._replace(topk_idx=skewed.topk_idx, topk_weight=skewed.topk_weight))]
    for t in (1, 999):
        f = ref.random_inputs(spec, tokens=t, device="cuda", seed=15 + t)
        cases.append((f"T={t}", inp._replace(x=f.x, topk_idx=f.topk_idx, topk_weight=f.topk_weight)))
    for mode, epi in [v for v in (("tma", "ring"), ("gather", "ring"), ("gather", "smem")) if v != own]:
        ov = {**OVERRIDES, "gemm1_a_load": mode, "gemm1_epi_store": epi}
        other = mokgen.compile(spec, overrides=ov)
        what_ov = ",".join(f"{k}={v}" for k, v in ov.items())
        assert ("gemm1" in other.fp8_a_gather) == (mode == "gather")
        assert (other.plan.gemm1.a_load, other.plan.gemm1.epi_store) == (mode, epi)
        for what, c in cases:
            ya = run(moe, c)
            yb = run(other, c, out=torch.full_like(c.x, float("nan")))
            torch.cuda.synchronize()
            assert not bool(yb.isnan().any()), f"{spec.name}/{what}: NaN with {what_ov}"
            assert torch.equal(bits(ya), bits(yb)), f"{spec.name}/{what}: bits differ with {what_ov}"
        y_half, y_full = run(other, inp, num_ctas=66), run(other, inp, num_ctas=132)
        torch.cuda.synchronize()
        assert torch.equal(bits(y_half), bits(y_full)), f"{what_ov}: 66 vs 132 CTAs bits differ"
        if epi == "ring":
            _assert_same_step_bits(spec, moe, other, inp, 16, what_ov)
        other.check_errors()


def test_x_cols_same_bits(case):
    """x's 128 x 1 columns for the FP8 wgrad1 made by the training forward's x quantizer (plan bwd_x_cols "forward":
    quant_both_gather, saved) or in the backward (quant_cols_gather): the same forward and gradient bits."""
    spec, moe, inp = case
    if "wgrad1" not in moe.fp8_wgrads:
        pytest.skip("this plan's wgrad1 reads bf16 rows")
    mode = "forward" if moe.plan.backward.x_cols == "backward" else "backward"
    other = mokgen.compile(spec, overrides={**OVERRIDES, "bwd_x_cols": mode})
    assert other.x_cols_fwd == (mode == "forward")
    _assert_same_step_bits(spec, moe, other, inp, 13, f"bwd_x_cols={mode}")
    other.check_errors()


def test_scale_load_same_bits(case):
    """Where the FP8 GEMMs read their scales (plan scale_load: "global" = the consumer threads' global loads,
    "stage" = a producer warp's copies into a shared-memory ring) changes no product and no order: the forward
    and every gradient of a training step have the same bits under the other form, also with 128-column GEMM 2 /
    dgrad2 tiles against the default 256-column ones, with GEMM 1's 256-column tile (its parts as two wgmma
    halves; where ffn is a multiple of 128) and with the staggered promotion (random and skewed routing)."""
    spec, moe, inp = case
    flip = "global" if moe.plan.gemm2.stage_scale_bytes else "stage"
    variants = [{"scale_load": flip}, {"scale_load": "stage", "gemm2_bn": 128, "dgrad2_bn": 128},
                {"scale_load": "stage", "promote": "stagger"}]
    if spec.ffn % 128 == 0:
        variants += [{"scale_load": "stage", "gemm1_bn": 256}, {"scale_load": "global", "gemm1_bn": 256}]
    for ov in variants:
        other = mokgen.compile(spec, overrides={**OVERRIDES, **ov})
        staged = [n for n in ("gemm1", "gemm2") if getattr(other.plan, n).stage_scale_bytes]
        staged += [n for n in ("dgrad1", "dgrad2") if getattr(other.plan.backward, n).stage_scale_bytes]
        assert staged == ([] if ov["scale_load"] == "global" else ["gemm1", "gemm2", "dgrad1", "dgrad2"]), staged
        _assert_same_step_bits(spec, moe, other, inp, 4, ov)
        other.check_errors()


def test_dgrad1_wide_same_bits(case):
    """dgrad1's 256-column tile (dgrad1_bn=256: two wgmma halves promoted in turn, the dSwiGLU epilogue over 256
    columns; where ffn is a multiple of 256) makes the same products in the same order per element as the
    128-column tile: y, dx, dW1 and dW2 have the same bits; the router gradient sums its per-tile partials over
    256 columns instead of 128 (another association), so it is checked against the 128-column one's value."""
    spec, moe, inp = case
    if spec.ffn % 256:
        pytest.skip(f"ffn {spec.ffn} is no multiple of 256")
    base = {k: v for k, v in OVERRIDES.items() if k != "dgrad1_bn"}
    m128 = mokgen.compile(spec, overrides={**base, "dgrad1_bn": 128})
    m256 = mokgen.compile(spec, overrides={**base, "dgrad1_bn": 256})
    assert (m128.plan.backward.dgrad1.bn, m256.plan.backward.dgrad1.bn) == (128, 256)
    _assert_same_step_bits(spec, m128, m256, inp, 5, "dgrad1_bn=256", grads=("x", "w1", "w2"))
    dy = torch.randn(inp.x.shape[0], spec.hidden, device="cuda", dtype=torch.bfloat16)
    g1, g2 = (m.backward(dy, m.forward_train(inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2, inp.b1,
                                             inp.b2)[1], inp.x, inp.topk_weight, inp.w1, inp.w2, inp.b1, inp.b2)
              for m in (m128, m256))
    torch.cuda.synchronize()
    err = ref.rel_err(g2.topk_weight.float(), g1.topk_weight.double())
    print(f"{spec.name}: router gradient, 256- vs 128-column dgrad1: rel err {err:.3e}")
    assert bool(torch.isfinite(g2.topk_weight).all()) and err <= 1e-3
    m128.check_errors()
    m256.check_errors()


def test_dgrad1_z_paths_same_bits(case):
    """The FP8 dgrad1's z paths (z_load: tma through the stage ring, direct chunked loads, pipe = the next chunk's
    loads before a chunk's math) do the same dSwiGLU math in the same order: a training step's outputs and every
    gradient have the same bits under each path the tile allows (random and skewed routing)."""
    spec, moe, inp = case
    d1 = moe.plan.backward.dgrad1
    others = [z for z in ("tma", "direct", "pipe") if z != d1.z_load and not (z == "tma" and P.z_stage_problem(d1))]
    for z in others:
        other = mokgen.compile(spec, overrides={**OVERRIDES, "dgrad1_z_load": z})
        assert other.plan.backward.dgrad1.z_load == z
        _assert_same_step_bits(spec, moe, other, inp, 6, f"dgrad1_z_load={z}")
        other.check_errors()


def test_wgrad_split_stagger_same_bits(case, ctas):
    """The 128 x 256 FP8 weight gradients with their warpgroups staggered by one half (the default,
    plan.FP8_WGRAD_SPLIT_PROMOTE: warpgroup 1 starts a tile once warpgroup 0's first half has retired) add the same
    products in the same order as the serial split tile (``wgrad*_promote=serial``): a training step has the same
    bits (random and skewed routing), also at half the SMs' CTAs."""
    spec, moe, inp = case
    base = {k: v for k, v in OVERRIDES.items() if not k.startswith(("wgrad1_", "wgrad2_"))}
    wide = {f"{n}_{k}": v for n in ("wgrad1", "wgrad2") for k, v in (("dtype", "fp8"), ("bn", 256))}
    ms = mokgen.compile(spec, overrides={**base, **wide, "wgrad1_promote": "serial", "wgrad2_promote": "serial"})
    mt = mokgen.compile(spec, overrides={**base, **wide, "wgrad1_promote": "stagger", "wgrad2_promote": "stagger"})
    for n in ("wgrad1", "wgrad2"):
        assert (getattr(ms.plan.backward, n).promote, getattr(mt.plan.backward, n).promote) == ("serial", "stagger")
        assert getattr(mt.plan.backward, n).mma_split == 2
    _assert_same_step_bits(spec, ms, mt, inp, 8, "the staggered split wgrads")
    dy = torch.randn(inp.x.shape[0], spec.hidden, device="cuda", dtype=torch.bfloat16)
    g = [m.backward(dy, m.forward_train(inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2, inp.b1, inp.b2,
                                        num_ctas=c)[1], inp.x, inp.topk_weight, inp.w1, inp.w2, inp.b1, inp.b2,
                    num_ctas=c) for m, c in ((ms, ctas.full), (mt, ctas.half))]
    torch.cuda.synchronize()
    for n in ("w1", "w2"):
        assert torch.equal(bits(getattr(g[0], n)), bits(getattr(g[1], n))), f"d{n}: {ctas.half} CTAs staggered"
    ms.check_errors()
    mt.check_errors()


def test_wide_stagger_same_bits(case):
    """The 256-column FP8 GEMMs with their warpgroups one half apart (``gemm*_bn=256, gemm*_promote=stagger``, and
    dgrad2's; opt-in) add the same products in the same order as the serial halves: the inference forward and a
    training step have the same bits (random and skewed routing)."""
    spec, moe, inp = case
    base = {k: v for k, v in OVERRIDES.items() if not k.startswith(("gemm1_", "gemm2_", "dgrad2_", "promote"))}
    ser = mokgen.compile(spec, overrides=base)
    ov = {}
    for name in ("gemm1", "gemm2", "dgrad2"):
        g = getattr(ser.plan, name, None) or getattr(ser.plan.backward, name)
        if g.mma_split == 2 and P.stagger_problem(g) is None:
            ov.update({f"{name}_bn": 256, f"{name}_promote": "stagger"})
    if not ov:
        pytest.skip("no 256-column FP8 GEMM with enough K blocks to stagger")
    st = mokgen.compile(spec, overrides={**base, **ov})
    y1, y2 = run(ser, inp), run(st, inp)
    torch.cuda.synchronize()
    check(spec, inp, y2, "wide stagger")
    assert torch.equal(bits(y1), bits(y2)), f"inference forward bits differ with {ov}"
    _assert_same_step_bits(spec, ser, st, inp, 9, f"stagger {sorted(ov)}")
    ser.check_errors()
    st.check_errors()


def test_h_quant_epilogue_same_bits(case):
    """gemm1_h_quant=epilogue: GEMM 1 writes h's e4m3 rows and 1 x 128 scales in its epilogue (no quant_rows_used
    launch), the bounded quantizer's math on the bf16 h: the forward and every gradient of a training step have
    the same bits as with the quant_rows_used launch, and so does the inference forward (where ffn is a multiple
    of 128: the 256-column GEMM 1)."""
    spec, moe, inp = case
    if spec.ffn % 128:
        pytest.skip(f"ffn {spec.ffn} is no multiple of 128 (the 128-column GEMM 1 holds half a scale block a row)")
    base = {k: v for k, v in OVERRIDES.items() if k != "gemm1_h_quant"}
    mk = mokgen.compile(spec, overrides={**base, "gemm1_h_quant": "kernel"})
    me = mokgen.compile(spec, overrides={**base, "gemm1_h_quant": "epilogue"})
    assert (mk.plan.gemm1.h_quant, me.plan.gemm1.h_quant) == ("kernel", "epilogue")
    assert "quant_rows_used" not in me.launch_sequence(training=False)
    y1, y2 = run(mk, inp), run(me, inp)
    torch.cuda.synchronize()
    check(spec, inp, y2, "h_quant=epilogue")
    assert torch.equal(bits(y1), bits(y2)), "inference forward bits differ with h_quant=epilogue"
    _assert_same_step_bits(spec, mk, me, inp, 6, "gemm1_h_quant=epilogue")
    mk.check_errors()
    me.check_errors()


def test_fp8_wgrads_same_bits_across_promotions_and_ctas(case, ctas):
    """With FP8 weight gradients (MOKGEN_GPU_OVERRIDES wgrad1_dtype=fp8 / wgrad2_dtype=fp8): dW1 / dW2 have the
    same bits under every promotion (serial; stagger: the two warpgroups one K block apart on tiles of at least
    STAGES blocks; overlap: the next block's wgmma queued before a block's promotion), across half and all the SMs' CTAs (66 / 132 on an H200) and from run to run (random and
    skewed routing); dx and the router gradient equal the BF16-wgrad step's bits (the weight gradients feed
    nothing else); dW against the BF16 weight gradients: e4m3's resolution (reported)."""
    spec, moe, inp = case
    if not moe.fp8_wgrads:
        pytest.skip("the plan's weight gradients are BF16 (set MOKGEN_GPU_OVERRIDES=wgrad1_dtype=fp8,...)")
    modes = ("serial", "stagger", "overlap")
    flips = [{f"{n}_promote": modes[(modes.index(getattr(moe.plan.backward, n).promote) + shift) % 3]
              for n in moe.fp8_wgrads} for shift in (1, 2)]
    others = [mokgen.compile(spec, overrides={**OVERRIDES, **flip}) for flip in flips]
    bf16w = mokgen.compile(spec, overrides={k: v for k, v in OVERRIDES.items()
                                            if not k.startswith(("wgrad1_", "wgrad2_"))})
    dy = torch.randn(inp.x.shape[0], spec.hidden, device="cuda", dtype=torch.bfloat16)
    fresh = ref.random_inputs(spec, tokens=inp.x.shape[0], device="cuda", seed=3, routing="skewed")

    def step(m, c, **kw):
        y, saved = m.forward_train(c.x, c.topk_idx, c.topk_weight, c.w1, c.w2, c.b1, c.b2, **kw)
        return m.backward(dy, saved, c.x, c.topk_weight, c.w1, c.w2, c.b1, c.b2, **kw)

    def same(a, b):
        return torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                           b.view(torch.int16) if b.dtype == torch.bfloat16 else b)

    for c in (inp, inp._replace(topk_idx=fresh.topk_idx, topk_weight=fresh.topk_weight)):
        runs = [step(moe, c), step(moe, c), step(moe, c, num_ctas=ctas.half), step(bf16w, c)]
        runs += [step(o, c) for o in others]
        torch.cuda.synchronize()
        for n in ("w1", "w2"):
            g = getattr(runs[0], n)
            assert bool(torch.isfinite(g).all()), f"{spec.name}: d{n} not finite"
            for i, what in ((1, "run to run"), (2, f"{ctas.half} vs {ctas.full} CTAs"),
                            (4, f"promotion {flips[0]}"), (5, f"promotion {flips[1]}")):
                assert same(g, getattr(runs[i], n)), f"{spec.name}: d{n} bits differ: {what}"
            err = ref.rel_err(g.float(), getattr(runs[3], n).double())
            print(f"{spec.name}: FP8 d{n} vs the BF16 weight gradient: rel err {err:.3e}")
            assert err < 0.1, f"d{n}: {err:.3e} from the BF16 weight gradient"
        assert same(runs[0].x, runs[3].x) and same(runs[0].topk_weight, runs[3].topk_weight)
    for o in others:
        o.check_errors()
