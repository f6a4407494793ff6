"""The FP8 quantization kernels (templates/sm90/quant_*.py.j2) on the CPU: rendered for a dtype fp8 spec only,
signatures from the argument table, compiled for sm_90a and sm_100a with the e4m3 conversion in the PTX; the
kernels' scale arithmetic (bits, no division) emulated in torch against mokgen.fp8's pow2 scales; the reference
steps and launch helpers of mokgen.fp8_ops against mokgen.fp8's quantizers; the spec's fp8 validation."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from mokgen import fp8, fp8_ops, kernels
from mokgen.emit import EmitError, emit, emit_fp8_quant
from mokgen.plan import solve
from mokgen.spec import SpecError, load_spec

BASE = {"hidden": 1024, "ffn": 512, "experts": 8, "topk": 2, "tokens": 256}
QUANT = kernels.FP8_QUANT_KERNELS


def fp8_plan():
    return solve(load_spec({**BASE, "dtype": "fp8"}), "sm_90a")


def test_rendered_for_fp8_specs_only():
    """emit renders the quantizers the FP8 layer launches (the column forms too when a weight gradient is FP8);
    emit_fp8_quant renders any of them, the same text."""
    bf16w = solve(fp8_plan().spec, "sm_90a", wgrad1_dtype="bf16", wgrad2_dtype="bf16")
    src = emit(bf16w)
    assert {n for n in src.files if n.startswith("quant_")} == {f"{k}.py" for k in kernels.FP8_LAYER_KERNELS}
    for w8 in (emit(fp8_plan()), emit(solve(fp8_plan().spec, "sm_90a", wgrad1_dtype="bf16", wgrad2_dtype="fp8"))):
        assert {n for n in w8.files if n.startswith("quant_")} == {   # FP8 weight gradients: the default
            f"{k}.py" for k in kernels.FP8_LAYER_KERNELS + kernels.FP8_WGRAD_KERNELS}
    assert not any(n.startswith("quant_") for n in emit(solve(load_spec(BASE), "sm_90a")).files)
    every = emit_fp8_quant(bf16w)
    assert set(every) == {f"{k}.py" for k in QUANT}
    assert {n: t for n, t in every.items() if n in src.files} == {n: src.files[n] for n in src.files
                                                                   if n.startswith("quant_")}   # the same text
    assert list(emit_fp8_quant(fp8_plan(), ("quant_rows",))) == ["quant_rows.py"]
    with pytest.raises(EmitError, match="unknown kernel 'quant_x'"):
        emit_fp8_quant(fp8_plan(), ("quant_x",))


def test_weight_quantizer_forms():
    """The weights' quantizers take their CTA form from emit.QUANT_W_FORM (512 threads, no launch bound: measured
    fastest, bench/NOTES.md v35); emit_fp8_quant's ``params`` renders another form (tools/quant_bench.py
    --wt-forms) for the kernels whose table has those parameters and leaves the other quantizers alone."""
    from mokgen.emit import QUANT_W_FORM

    plan = fp8_plan()
    default = emit_fp8_quant(plan, ("quant_wt", "quant_w", "quant_rows"))
    assert QUANT_W_FORM == dict(threads=512, ctas_per_sm=0)
    for name in ("quant_wt.py", "quant_w.py"):
        assert "THREADS = 512\n" in default[name] and "min_blocks_per_mp" not in default[name]
    other = emit_fp8_quant(plan, ("quant_wt", "quant_rows"), params=dict(threads=256, ctas_per_sm=3))
    assert "THREADS = 256\n" in other["quant_wt.py"] and "CTAS_PER_SM = 3 " in other["quant_wt.py"]
    assert "min_blocks_per_mp=CTAS_PER_SM, preferred_smem_carveout=50," in other["quant_wt.py"]
    assert other["quant_rows.py"] == default["quant_rows.py"]   # no such parameters: untouched


def _fn_args(src: str, name: str) -> list[str]:
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == name)
    return [a.arg for a in fn.args.args]


def test_signatures_follow_the_table():
    for fname, text in emit_fp8_quant(fp8_plan()).items():
        k = fname[:-3]
        assert f'KERNEL_NAME = "{k}"' in text
        assert _fn_args(text, "launch") == list(kernels.names(k)) + ["stream"], k
        for a in kernels.ARGS[k]:
            assert a.fake in text, (k, a.name)
        for sym, div in kernels.SYMBOLS[k].items():
            assert f"{sym} = cute.sym_int32({'divisibility=' + div if div else ''})" in text
    wt, w = (emit_fp8_quant(fp8_plan())[f] for f in ("quant_wt.py", "quant_w.py"))
    assert "TRANSPOSE = True" in wt and "TRANSPOSE = False" in w and "mQt" not in w


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    pytest.importorskip("cutlass")
    from mokgen import build

    return {arch: build.build(emit_fp8_quant(fp8_plan()), arch, tmp_path_factory.mktemp(arch), jobs=2,
                              progress=False) for arch in ("sm_90a", "sm_100a")}


def _ops(ptx: str, prefix: str) -> list[str]:
    return re.findall(rf"^\s*(?:@%p\d+ )?({re.escape(prefix)}\S*)", ptx, re.M)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_compile_and_ptx(built, arch):
    """sm_90a and sm_100a (plain SIMT kernels); the e4m3 conversion is cvt.rn.satfinite.e4m3x2.f32 (nearest
    even, saturating), 16-byte global loads / stores, no flush-to-zero anywhere (subnormal inputs matter: a
    block of tiny values has scale 2**-126 and its elements times 2**126 are not small)."""
    art = built[arch]
    assert art.kernels == tuple(sorted(QUANT))
    # quant_w / quant_wt: 128 x 128 / THREADS elements a thread (emit.QUANT_W_FORM), 16 to a vector
    from mokgen.emit import QUANT_W_FORM

    per = 128 * 128 // QUANT_W_FORM["threads"]
    per_thread = {"quant_rows": (8, 2, 1), "quant_w": (per // 2, per // 8, per // 16),
                  "quant_wt": (per // 2, per // 8, 2 * (per // 16)), "quant_cols": (32, 8, 4)}
    for k, (cvts, loads, stores) in per_thread.items():
        ptx = (Path(art.dir) / f"{k}.ptx").read_text()
        assert f".target {arch}" in ptx
        assert ptx.count("cvt.rn.satfinite.e4m3x2.f32") == cvts, k   # 16 elements a vector, 2 per cvt
        assert _ops(ptx, "ld.global").count("ld.global.v4.b32") == loads == len(_ops(ptx, "ld.global")), k
        st = _ops(ptx, "st.global")
        assert st.count("st.global.v4.b32") == stores and set(st) <= {"st.global.v4.b32", "st.global.b32"}, k
        assert ".ftz" not in ptx and "div." not in ptx and "rcp." not in ptx, k
    assert "ld.shared.b8" in (Path(art.dir) / "quant_wt.ptx").read_text()  # the smem transpose


# --------------------------------------------------------------------------------------------------------------
# the kernels' scale arithmetic (templates/sm90/_fp8.py.j2 pow2_scale), emulated on int32 bits


def kernel_pow2_scale(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    bits = amax.to(torch.float32).view(torch.int32)
    e = (bits >> 23) - 8
    e = torch.where((bits & 0x7FFFFF) > 0x600000, e + 1, e)
    e = torch.clamp_min(e, 1)
    e = torch.where(amax == 0, torch.full_like(e, 127), e)
    return (e << 23).view(torch.float32), ((254 - e) << 23).view(torch.float32)


def boundary_amax() -> torch.Tensor:
    """Every binade's edges: 448 * 2**k and 1.75 * 2**k and their fp32 neighbours, 2**k, the floor region,
    subnormals, zero and the largest finite fp32 / bf16."""
    k = torch.arange(-150, 128, dtype=torch.float64)
    centers = torch.cat([448 * torch.exp2(k - 8), 1.75 * torch.exp2(k), torch.exp2(k)]).to(torch.float32)
    centers = centers[torch.isfinite(centers) & (centers > 0)]
    inf = torch.tensor(float("inf"))
    vals = torch.cat([centers, torch.nextafter(centers, inf), torch.nextafter(centers, -inf),
                      torch.tensor([0.0, 1e-45, 1e-40, 2.0 ** -126, 448 * 2.0 ** -126, 3.4028235e38, 3.3895314e38])])
    rand = torch.rand(10000, dtype=torch.float64).mul(277).sub(149).exp2().to(torch.float32)
    vals = torch.cat([vals, rand])
    return vals[torch.isfinite(vals) & (vals >= 0)]


def test_kernel_scale_bits_equal_fp8_pow2_scales():
    amax = boundary_amax()
    s, inv = kernel_pow2_scale(amax)
    want = fp8._scales(amax, pow2=True)
    assert torch.equal(s.view(torch.int32), want.view(torch.int32))
    assert torch.equal(s.double() * inv.double(), torch.ones_like(s, dtype=torch.float64))  # exact inverse
    # x * (1 / s) == x / s bit for bit for every |x| <= amax of the block (a power-of-two scale)
    x = amax * torch.rand(amax.shape)
    assert torch.equal((x * inv).view(torch.int32), (x / s).view(torch.int32))


def test_kernel_math_equals_fp8_quantizer():
    """The kernel's q = e4m3(x * inv) per 1x128 tile (torch emulation) equals fp8.quantize_1x128(pow2=True)."""
    x = special(torch.randn(64, 1024)).to(torch.bfloat16)
    xf = x.float().view(64, 8, 128)
    s, inv = kernel_pow2_scale(xf.abs().amax(-1))
    q = fp8.to_e4m3(xf * inv.unsqueeze(-1)).view(64, 1024)
    qr, sr = fp8.quantize_1x128(x, pow2=True)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)


# --------------------------------------------------------------------------------------------------------------
# reference steps and launch helpers


def special(x: torch.Tensor) -> torch.Tensor:
    """Random values with an all-zero 128x128 block, huge values, tiny (subnormal) values, a many-binade row."""
    x = x.clone()
    x[..., 0:128, 128:256] = 0
    x[..., 128:256, 0:128] *= 1e36
    x[..., 256:384, 0:128] *= 1e-38
    x[..., -1, :] *= torch.exp2(torch.linspace(-40, 40, x.shape[-1]))
    return x


def bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.uint8)


def test_reference_steps_equal_fp8():
    fns = fp8_ops.reference_quant_kernels()
    assert set(fns) == set(QUANT)
    x = special(torch.randn(512, 768)).to(torch.bfloat16)
    q, s = fp8_ops.quantize_rows(fns, x)
    qr, sr = fp8.quantize_1x128(x, pow2=True)
    assert q.dtype == torch.uint8 and torch.equal(q, bits(qr)) and torch.equal(bits(s), bits(sr))
    assert torch.equal(fp8_ops.as_e4m3(q).float(), qr.float())
    assert bool((s[0, 1] == 1.0)) and bool((q[0, 128:256] == 0).all())            # the all-zero tile
    assert bool((fp8_ops.as_e4m3(q).float().abs().amax(-1) <= 448).all())
    w = special(torch.randn(3, 384, 512)).to(torch.bfloat16)
    q, s = fp8_ops.quantize_w(fns, w)
    qr, sr = fp8.quantize_128x128(w, pow2=True)
    assert torch.equal(q, bits(qr)) and torch.equal(bits(s), bits(sr)) and s.shape == (3, 3, 4)
    q2, s2, qt, st = fp8_ops.quantize_w(fns, w, transpose=True)
    assert torch.equal(q2, q) and torch.equal(qt, q.mT) and torch.equal(st, s.mT) and qt.is_contiguous()
    qt, st = fp8_ops.quantize_cols(fns, x[:384])
    qr, sr = fp8.quantize_128x1(x[:384], pow2=True)
    assert qt.shape == (768, 384) and st.shape == (3, 768)   # q transposed (K-major), st row-block-major
    assert torch.equal(qt, bits(qr).T) and torch.equal(bits(st), bits(sr))
    # the wgrad tiles are the row tiles of the transposed input
    q1, s1 = fp8.quantize_1x128(x[:384].T.contiguous(), pow2=True)
    assert torch.equal(qt, bits(q1)) and torch.equal(st, s1.T)


def test_saturation_reference():
    """Outside the pow2 kernels nothing exceeds 448 s; mokgen.fp8.to_e4m3 (the reference's cast) saturates what
    would: the kernels' cvt.rn.satfinite does the same on the GPU (tests/test_gpu_fp8_quant.py)."""
    y = torch.tensor([447.0, 448.0, 463.9, 464.0, 500.0, 1e30, -1e30, -449.0])
    assert fp8.to_e4m3(y).float().tolist() == [448.0, 448.0, 448.0, 448.0, 448.0, 448.0, -448.0, -448.0]


def test_helpers_check_their_inputs():
    fns = fp8_ops.reference_quant_kernels()
    with pytest.raises(ValueError, match=r"x.shape\[1\] must be a multiple of 16"):
        fp8_ops.quantize_rows(fns, torch.zeros(4, 100, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="bfloat16"):
        fp8_ops.quantize_rows(fns, torch.zeros(4, 128))
    with pytest.raises(ValueError, match=r"x.shape\[0\] must be a multiple of 128"):
        fp8_ops.quantize_cols(fns, torch.zeros(100, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        fp8_ops.quantize_w(fns, torch.zeros(1, 256, 128, dtype=torch.bfloat16).mT)
    q, s = fp8_ops.quantize_rows(fns, torch.zeros(0, 256, dtype=torch.bfloat16))  # no launch for no rows
    assert q.shape == (0, 256) and s.shape == (0, 2)
    with pytest.raises(TypeError, match="quant_rows"):
        fns["quant_rows"](1, 2)


@pytest.mark.parametrize("changes,fragment", [
    ({"dtype": "fp8", "hidden": 1000}, "spec.hidden: must be a positive multiple of 64"),   # bf16's; 1088 is fine
    ({"dtype": "mxfp8"}, "spec.archs[0]: dtype mxfp8"),
    ({"dtype": "fp8", "archs": ["sm_100a"]}, "spec.archs[0]: dtype fp8"),
])
def test_spec_fp8_validation(changes, fragment):
    with pytest.raises(SpecError) as info:
        load_spec({**BASE, **changes})
    assert str(info.value).startswith(fragment) and "\n" not in str(info.value)
    assert load_spec({**BASE, "dtype": "fp8"}).dtype == "fp8" and load_spec(BASE).dtype == "bf16"
    # dims that are not multiples of the 128-wide blocks: partial edge blocks (gpt-oss-120b's 2880)
    assert load_spec({**BASE, "dtype": "fp8", "hidden": 1088, "ffn": 576}).hidden == 1088


def test_partial_blocks_match_the_reference():
    """K (and W's N) multiples of 16 but not of 128: the last 1x128 / 128x128 block is partial, as if
    zero-padded (mokgen.fp8's edge semantics); the helpers allocate ceil(K / 128) scale blocks."""
    fns = fp8_ops.reference_quant_kernels()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 2880, generator=g).bfloat16()
    q, s = fp8_ops.quantize_rows(fns, x)
    qr, sr = fp8.quantize_1x128(x, pow2=True)
    assert s.shape == (7, 23) and torch.equal(s, sr) and torch.equal(q, qr.view(torch.uint8))
    w = torch.randn(2, 2880, 5760 - 64, generator=g).bfloat16()
    q, s, qt, st = fp8_ops.quantize_w(fns, w, transpose=True)
    qr, sr = fp8.quantize_128x128(w, pow2=True)
    assert s.shape == (2, 23, 45) and torch.equal(s, sr) and torch.equal(q, qr.view(torch.uint8))
    assert torch.equal(qt, q.mT) and torch.equal(st, s.mT)
