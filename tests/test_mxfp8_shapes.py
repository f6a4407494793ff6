"""MXFP8 (dtype mxfp8, sm_100a; issue 20) beyond kimi-k2-mxfp8: a gpt-oss-like layer (swiglu_oai with biases,
interleaved gate / up, ep 4, odd tile counts) and a small-expert layer like qwen3-30b-a3b (ffn 768 < hidden 2048, top
8), each planned, emitted and compiled for sm_100a (all nineteen kernels of the training entry, the block-scaled
tcgen05 MMA checked in the PTX as for the other MXFP8 builds: tests/test_mxfp8.py check_mx_ptx), and a small version
of each run as a training step on the CPU reference kernels against the float64 references. The specs are inline
(no files under tools/specs or generated/). What mxfp8 refuses (hidden / ffn not multiples of 64, bf16's rule) is
checked to be a one-line SpecError; multiples of 64 that are not of 128 (gpt-oss's real 2880) are taken, with
partial last tiles (tests/test_mx_partial.py; every preset below, gpt-oss-120b included). Nothing here runs on a
GPU."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from mokgen import reference as R
from mokgen.spec import SpecError, load_spec
from test_sass import needs_sass

MX = {"dtype": "mxfp8", "archs": ["sm_100a"]}
# gpt-oss's other features at the multiple of 128 above its 2880 (which the preset tests below take, partial last
# tiles): 2944 = 23 x 128, an odd count of whole N and K tiles in every GEMM
GPT_OSS_MX = {"name": "gpt-oss-mx", "hidden": 2944, "ffn": 2944, "experts": 128, "topk": 4, "ep": 4, "tokens": 2048,
              "activation": "swiglu_oai", "bias": True, "gate_up_layout": "interleaved", **MX}
# qwen3-30b-a3b's experts: hidden 2048, moe ffn 768 (6 tiles of 128 per part), 128 experts, top 8
QWEN3_MX = {"name": "qwen3-30b-a3b-mx", "hidden": 2048, "ffn": 768, "experts": 128, "topk": 8, "tokens": 2048, **MX}
SHAPES = {"gpt-oss": GPT_OSS_MX, "qwen3": QWEN3_MX}
# small versions with the same features for the CPU training step
TINY = {"gpt-oss": {**GPT_OSS_MX, "name": "gpt-oss-mx-tiny", "hidden": 384, "ffn": 384, "experts": 8, "ep": 2,
                    "tokens": 64},
        "qwen3": {**QWEN3_MX, "name": "qwen3-mx-tiny", "hidden": 256, "ffn": 128, "experts": 16, "tokens": 64}}


def _plan(shape):
    from mokgen.plan import solve

    return solve(load_spec(SHAPES[shape]), "sm_100a")


@pytest.mark.parametrize("changes,field,message", [
    # multiples of 32 (whole scale blocks) but not of 64: the K_BLOCK rule of every dtype refuses them
    ({**QWEN3_MX, "hidden": 1056, "ffn": 800}, "hidden", "must be a positive multiple of 64, got 1056"),
    ({**QWEN3_MX, "ffn": 800}, "ffn", "must be a positive multiple of 64, got 800"),
])
def test_refusals(changes, field, message):
    """Shapes dtype mxfp8 does not take are refused when the spec is built, with one line naming the field, the
    rule and the value, as bf16 refuses them; multiples of 64 that are not of 128 (gpt-oss's 2880, 1088 / 832) are
    taken."""
    with pytest.raises(SpecError) as e:
        load_spec(changes)
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"spec.{field}: ") and message in text, text
    assert f"got {changes[field]}" in text
    with pytest.raises(SpecError):
        load_spec({k: v for k, v in changes.items() if k not in ("dtype", "archs")})
    for taken in ({**GPT_OSS_MX, "hidden": 2880, "ffn": 2880}, {**GPT_OSS_MX, "ffn": 2880},
                  {**QWEN3_MX, "hidden": 1088, "ffn": 832}, {**QWEN3_MX, "ffn": 832}):
        assert load_spec(taken).dtype == "mxfp8"


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_plan(shape):
    """The MXFP8 plan of each shape: K tile 128, 128 W rows (one scale atom) per part, e4m3 operands, whole K
    tiles; the weight gradients those of the BF16 plan of the same shape."""
    from mokgen.arch import ARCHS
    from mokgen.plan import solve
    from mokgen.sm100.plan import MX_BK, tcgen05_mx_smem

    plan = _plan(shape)
    spec = plan.spec
    H, I = spec.hidden, spec.ffn
    assert spec.dtype == "mxfp8" and any(n.startswith("mxfp8: ") for n in plan.notes)
    bw = plan.backward
    for which, g, n_out, k_dim in ((1, plan.gemm1, I, H), (2, plan.gemm2, H, I), ("dgrad1", bw.dgrad1, I, H),
                                   ("dgrad2", bw.dgrad2, H, 2 * I)):
        parts = 2 if which == 1 else 1
        assert (g.bk, g.elem_bytes, g.cluster) == (MX_BK, 1, 1), which
        assert g.bn // parts == 128 and n_out % 128 == 0 and k_dim % MX_BK == 0, which
        assert (g.n_tiles, g.k_tiles) == (n_out // 128, k_dim // MX_BK), which
        assert 2 <= g.stages and tcgen05_mx_smem(parts, 128, g.bk, g.stages, g.epi_n, g.epi_stages) <= \
            ARCHS["sm_100a"].smem_per_cta, which
    bf16 = solve(load_spec({k: v for k, v in SHAPES[shape].items() if k not in ("dtype", "archs")}), "sm_100a")
    assert (bw.wgrad1, bw.wgrad2) == (bf16.backward.wgrad1, bf16.backward.wgrad2)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_emit(shape):
    """The nineteen kernels of the training entry, rendered with the shape's dimensions, tile counts, groups and
    features (gpt-oss: interleaved W1 rows quantized into concat order, z in the interleaved order, biases,
    swiglu_oai clamped at 7)."""
    from mokgen.emit import emit
    from test_mxfp8 import MX_KERNELS, MX_TRAIN

    plan = _plan(shape)
    spec = plan.spec
    H, I, G = spec.hidden, spec.ffn, spec.groups
    src = emit(plan)
    assert src.kernels == sorted(MX_KERNELS + MX_TRAIN)
    f = src.files
    for k, n_out, k_dim in (("gemm1", I, H), ("gemm1_train", I, H), ("gemm2", H, I), ("dgrad1", I, H),
                            ("dgrad2", H, 2 * I)):
        text = f[f"{k}.py"]
        assert f"N_OUT = {n_out} " in text and f"K_DIM = {k_dim} " in text and f"GROUPS = {G} " in text, k
        assert f"N_TILES = {n_out // 128} " in text and f"K_TILES = {k_dim // 128}\n" in text, k
        assert "MX = True" in text and "AB_TYPE = cutlass.Float8E4M3FN" in text, k
        assert f"HAS_BIAS = {spec.bias and not k.startswith('dgrad')}" in text, k
    g1 = f["gemm1.py"]
    assert f"N_STRIDE = {H} " in g1 and f"P_STRIDE = {I * H} " in g1   # quant_mx_w1's concat order
    inter = spec.gate_up_layout == "interleaved"
    assert ("Z_N = 2 " in g1) == inter and ("Z_P = 1 " in g1) == inter
    assert ("INTERLEAVE = True" in f["quant_mx_w1.py"]) == inter
    for k in ("gemm1", "gemm1_train", "dgrad1"):
        assert (f"({spec.activation}, limit 7.0)" in f[f"{k}.py"]) == (spec.activation == "swiglu_oai"), k
        assert ("ACT_LIMIT = 7.0" in f[f"{k}.py"]) == (spec.activation == "swiglu_oai"), k
    for k, kd in (("quant_mx_gather", H), ("quant_mx_used", I), ("quant_mx_dz", 2 * I)):
        assert f"K_DIM = {kd} " in f[f"{k}.py"], k
    assert f"R_ROWS = {H} " in f["quant_mx_w2_cols.py"] and f"C_COLS = {I} " in f["quant_mx_w2_cols.py"]
    assert f"R_ROWS = {2 * I} " in f["quant_mx_w1_cols.py"] and f"C_COLS = {H} " in f["quant_mx_w1_cols.py"]


@pytest.fixture(scope="module", params=sorted(SHAPES))
def built(request, tmp_path_factory):
    pytest.importorskip("cutlass")
    from mokgen import build
    from mokgen.emit import emit

    plan = _plan(request.param)
    return plan, build.build(emit(plan), "sm_100a", tmp_path_factory.mktemp(request.param), jobs=2,
                             progress=False)


@pytest.mark.slow
def test_compile_for_sm100a(built):
    """Every kernel of the shape's training entry compiles for sm_100a; the forward GEMMs and the dgrads issue the
    block-scaled MMA (kind::mxf8f6f4.block_scale, e8m0 scales per 32) with their tiles' scale copies, TMA loads and
    instruction descriptor, the quantizers their e4m3 conversions (check_mx_ptx, as for tests/test_mxfp8.py's
    build); the weight gradients the bf16 kind::f16 MMA; every PTX targets sm_100a (check_mx_build)."""
    check_mx_build(*built)


@pytest.mark.slow
@needs_sass
def test_sass_for_sm100a(built):
    """The shape's kernels disassembled (tests/test_sass.py): UTCQMMA with TMEM scale operands and UTCCP in the
    forward GEMMs and dgrads, UTCHMMA in the weight gradients, TMEM / TMA / mbarrier / CLC in every GEMM, no HGMMA."""
    from mokgen import build
    from test_sass import check_sm100_sass

    check_sm100_sass(build.sass_texts(built[1]), mx=True)


def check_mx_build(plan, art) -> None:
    """The PTX of an MXFP8 training entry built for sm_100a (test_compile_for_sm100a's and the presets' checks):
    check_mx_ptx, every kernel targeting sm_100a, the block-scaled MMA in the forward GEMMs and the dgrads only,
    the bf16 kind::f16 MMA in the weight gradients, no tcgen05 elsewhere; the activation's constants in GEMM 1 and
    dgrad1 (swiglu_oai's clamp at 7 and its 1.702; none of them for plain swiglu)."""
    from mokgen import build
    from test_mxfp8 import check_mx_ptx

    check_mx_ptx(plan, art)
    report = build.ptx_report(art)
    assert all(r["target"] for r in report.values()), report
    for k in ("gemm1", "gemm2", "gemm1_train", "dgrad1", "dgrad2"):
        assert report[k]["block_scale"] and report[k]["tcgen05"] and not report[k]["wgmma.mma_async"], k
    for k in ("wgrad1", "wgrad2", "wgrad1_acc", "wgrad2_acc"):
        ptx = (Path(art.dir) / f"{k}.ptx").read_text()
        assert report[k]["tcgen05"] and not report[k]["block_scale"], k
        assert "tcgen05.mma.cta_group::1.kind::f16" in ptx and "block_scale" not in ptx, k
    for k in ("routing", "combine", "gather") + tuple(k for k in art.kernels if k.startswith("quant_mx")):
        assert not report[k]["tcgen05"] and not report[k]["block_scale"], k
    # the activation reached the kernels: swiglu_oai clamps at 7.0 in GEMM 1's epilogue (fp32 0x40E00000) and in
    # dgrad1's (z is bf16: the compares and clamps run in bf16 against 0x40E0 / -7 0xC0E0), whose gradient also
    # holds the 1.702 of the sigmoid (0x3FD9DB23); plain swiglu has none of them
    oai = plan.spec.activation == "swiglu_oai"
    for k in ("gemm1", "gemm1_train"):
        assert bool(re.search(r"\b0f40E00000\b", (Path(art.dir) / f"{k}.ptx").read_text())) == oai, k
    d1 = (Path(art.dir) / "dgrad1.ptx").read_text()
    assert bool(re.search(r"\b0f3FD9DB23\b", d1)) == oai
    assert bool(re.search(r"mov\.b16\s+%rs\d+, 0x40E0;", d1) and re.search(r"mov\.b16\s+%rs\d+, 0xC0E0;", d1)
                and "min.bf16" in d1 and "setp.gt.bf16" in d1) == oai


def _args(inp):
    return (inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2, inp.b1, inp.b2)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_emit_mx_wgrads(shape):
    """The opt-in MXFP8 weight gradients (wgrad1_dtype=mxfp8, wgrad2_dtype=mxfp8) rendered with the shape's
    dimensions and tile counts (gpt-oss: 23 x 128 = 2944 columns, odd tile counts), the three column quantizers with
    their column counts; the other kernels are the default plan's, byte for byte but for the plan hash header."""
    from mokgen.emit import emit
    from mokgen.plan import solve

    spec = load_spec(SHAPES[shape])
    H, I = spec.hidden, spec.ffn
    both = emit(solve(spec, "sm_100a", wgrad1_dtype="mxfp8", wgrad2_dtype="mxfp8")).files
    default = emit(_plan(shape)).files
    for k, m_out, n_out in (("wgrad1", 2 * I, H), ("wgrad2", H, I)):
        for name in (k, k + "_acc"):
            text = both[f"{name}.py"]
            assert "MX = True" in text and f"M_OUT = {m_out} " in text and f"N_OUT = {n_out} " in text, name
            assert f"M_TILES = {m_out // 128} " in text and f"N_TILES = {n_out // 128} " in text, name
            assert f"GROUPS = {spec.groups} " in text and "BN = 128 " in text and "BK = 128 " in text, name
    for k, cols in (("quant_mx_cols_gather", H), ("quant_mx_dz_cols", 2 * I), ("quant_mx_sa_cols", I)):
        assert f"C_COLS = {cols} " in both[f"{k}.py"], k
    body = lambda t: t.split("\n", 4)[4]   # noqa: E731  (the header's plan line (4th) differs: another plan)
    for f in set(default) & set(both) - {f"{w}{s}.py" for w in ("wgrad1", "wgrad2") for s in ("", "_acc")}:
        assert body(default[f]) == body(both[f]), f
    assert ("gather.py" in both) == spec.bias   # db2 sums the bf16 dO rows


@pytest.mark.parametrize("wgrads", ["bf16", "mxfp8"])
@pytest.mark.parametrize("shape", sorted(TINY))
def test_training_step_on_reference_kernels(shape, wgrads):
    """A small version of each shape (its features, ep, top-k) run forward and backward on the CPU reference
    kernels (the MXFP8 runtime path: quantizers writing the kernels' bytes, GEMMs on the dequantized packed
    operands) against the float64 references on the dequantized operands (rel. err < 1e-2) and against the BF16
    float64 reference (MXFP8's resolution: in [0.02, 0.15]), as tests/test_mx_runtime.py does for its shapes; with
    the BF16 weight gradients (the default) and with both in MXFP8 (wgrad*_dtype=mxfp8: the reference quantizes
    their operands in 32-row blocks down the columns, backward_mx's mx_wgrads)."""
    from mokgen.ops import CompiledMoE
    from mokgen.plan import solve

    from mokgen.kernels import mx_wgrads

    spec = load_spec(TINY[shape])
    T, H = spec.tokens, spec.hidden
    pl = solve(spec, "sm_100a", wgrad1_dtype=wgrads, wgrad2_dtype=wgrads)
    mxw = mx_wgrads(pl)
    assert mxw == (("wgrad1", "wgrad2") if wgrads == "mxfp8" else ())
    moe = CompiledMoE(spec, pl, functions=R.reference_kernels(spec, pl.bm, training=True, mx_wgrads=mxw),
                      allow_cpu=True, arch="sm_100a")
    assert moe.mx and moe.trainable
    inp = R.random_inputs(spec, tokens=T, seed=3)
    a = _args(inp)
    y = moe(*a)
    assert R.rel_err(y.float(), R.forward_mx(*a[:5], spec, b1=a[5], b2=a[6])) < 1e-2
    assert 0.02 < R.rel_err(y.float(), R.forward(*a[:5], spec, b1=a[5], b2=a[6])) < 0.15
    y2, saved = moe.forward_train(*a)
    assert torch.equal(y, y2)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(4)).bfloat16()
    g = moe.backward(dy, saved, inp.x, inp.topk_weight, inp.w1, inp.w2, inp.b1, inp.b2)
    rm = R.backward_mx(dy, *a[:5], spec, b1=a[5], b2=a[6], mx_wgrads=mxw)
    r16 = R.backward(dy, *a[:5], spec, b1=a[5], b2=a[6])
    names = ("x", "topk_weight", "w1", "w2") + (("b1", "b2") if spec.bias else ())
    for name in names:
        got = getattr(g, name).float()
        assert bool(torch.isfinite(got).all()), name
        assert R.rel_err(got, getattr(rm, name)) < 1e-2, name
        if name not in ("b1", "b2"):
            assert 0.02 < R.rel_err(got, getattr(r16, name)) < 0.15, name


# ---- every BF16 preset's shape in MXFP8 (issue 20: "every preset's sm_100a kernels ... MXFP8 forward + backward") --
# every BF16 preset; gpt-oss-120b's hidden = ffn = 2880 (not a multiple of 128) with partial last K / N tiles
MX_PRESETS = ["deepseek-v3", "deepseek-v4-pro", "glm-5", "gpt-oss-120b", "kimi-k2", "qwen3-235b-a22b",
              "qwen3-30b-a3b", "qwen3.5-397b-a17b"]


def _preset_mx(name: str) -> dict:
    """The preset's spec in MXFP8 for sm_100a, named ``<preset>-mxfp8`` (kimi-k2's is tools/specs/kimi-k2-mxfp8.yaml)."""
    return {**load_spec(name).to_dict(), "name": f"{name}-mxfp8", **MX}


def test_preset_mxfp8_specs():
    """Every BF16 preset (tests/test_sm100.py's list) is taken in MXFP8, gpt-oss-120b's 2880 included."""
    from test_sm100 import BF16_PRESETS

    assert sorted(MX_PRESETS) == sorted(BF16_PRESETS)
    odd = []
    for name in MX_PRESETS:
        spec = load_spec(_preset_mx(name))
        assert spec.dtype == "mxfp8" and spec.hidden % 64 == 0 and spec.ffn % 64 == 0, name
        if spec.hidden % 128 or spec.ffn % 128:
            odd.append(name)
    assert odd == ["gpt-oss-120b"]


@pytest.fixture(scope="module", params=MX_PRESETS)
def preset_built(request, tmp_path_factory):
    pytest.importorskip("cutlass")
    from mokgen import build
    from mokgen.emit import emit
    from mokgen.plan import solve

    plan = solve(load_spec(_preset_mx(request.param)), "sm_100a")
    return plan, build.build(emit(plan), "sm_100a", tmp_path_factory.mktemp(request.param), jobs=2, progress=False)


@pytest.mark.slow
def test_preset_compiles_for_sm100a(preset_built):
    """The preset's MXFP8 training entry (nineteen kernels) planned, emitted and built for sm_100a, its PTX checked
    as the shapes' above (check_mx_build)."""
    check_mx_build(*preset_built)


@pytest.mark.slow
@needs_sass
def test_preset_sass_for_sm100a(preset_built):
    """The preset's MXFP8 kernels disassembled: block-scaled UTCQMMA in the forward GEMMs and dgrads, UTCHMMA in the
    weight gradients, TMEM / TMA / mbarrier / CLC in every GEMM, no HGMMA anywhere (tests/test_sass.py)."""
    from mokgen import build
    from test_sass import check_sm100_sass

    check_sm100_sass(build.sass_texts(preset_built[1]), mx=True)
