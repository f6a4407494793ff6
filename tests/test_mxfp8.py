"""MXFP8 for sm_100a (issue 20) on the CPU: the scale-factor layout the block-scaled tcgen05 MMA reads
(mokgen.fp8.pack_mx_scales / unpack_mx_scales / mx_sf_offset) against the CuTe DSL's own layout and a float64
emulation of the block-scaled GEMM that reads operand bytes and packed scales by address; the dtype mxfp8 spec and
plan; the MXFP8 forward kernels (rendered, the quantizers' arithmetic emulated in torch against mokgen.fp8 bit for
bit, compiled for sm_100a with the block-scaled tcgen05 instructions in their PTX). Nothing here runs on a GPU."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from mokgen import fp8, kernels


def _codes(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 255, shape, generator=g, dtype=torch.uint8)   # every code but 255 (NaN)


@pytest.mark.parametrize("rows,kblocks", [(1, 1), (3, 2), (128, 4), (130, 5), (300, 9), (256, 8), (37, 90)])
def test_pack_round_trip(rows, kblocks):
    e = _codes(2, rows, kblocks, seed=rows)
    p = fp8.pack_mx_scales(e)
    assert p.dtype == torch.uint8 and p.shape == (2, fp8.mx_sf_bytes(rows, kblocks)) and p.is_contiguous()
    assert fp8.mx_sf_bytes(rows, kblocks) == -(-rows // 128) * -(-kblocks // 4) * 512
    assert torch.equal(fp8.unpack_mx_scales(p, rows, kblocks), e)
    # every logical scale at its offset; every other byte is the fill
    r = torch.arange(rows).view(-1, 1)
    kb = torch.arange(kblocks).view(1, -1)
    off = fp8.mx_sf_offset(r, kb, kblocks)
    assert torch.equal(p[1][off], e[1]) and torch.equal(p[0][off], e[0])
    assert off.unique().numel() == rows * kblocks
    pad = torch.ones(p.shape[-1], dtype=torch.bool)
    pad[off.flatten()] = False
    assert bool((p[:, pad] == 127).all())
    assert bool((fp8.pack_mx_scales(e, fill=0)[:, pad] == 0).all())


def test_offset_by_hand():
    """The atom: row r of a 128-row block at (r % 32) * 16 + (r // 32) * 4, K block j of 4 at + j; atoms
    K-fastest."""
    assert fp8.mx_sf_offset(0, 0, 8) == 0
    assert fp8.mx_sf_offset(0, 3, 8) == 3
    assert fp8.mx_sf_offset(1, 0, 8) == 16
    assert fp8.mx_sf_offset(32, 0, 8) == 4
    assert fp8.mx_sf_offset(97, 2, 8) == 16 + 12 + 2
    assert fp8.mx_sf_offset(0, 4, 8) == 512            # the next K group: the next atom
    assert fp8.mx_sf_offset(128, 0, 8) == 1024         # the next row block: after its 2 K groups
    assert fp8.mx_sf_offset(128, 0, 9) == 1536         # 9 blocks: 3 K groups (the last padded)


def test_pack_checks_inputs():
    with pytest.raises(TypeError, match="pack_mx_scales: e must be a uint8"):
        fp8.pack_mx_scales(torch.zeros(4, 4))
    with pytest.raises(ValueError, match=r"fill must be an e8m0 code in \[0, 254\]"):
        fp8.pack_mx_scales(torch.zeros(4, 4, dtype=torch.uint8), fill=255)
    with pytest.raises(ValueError, match="packs into 512 bytes, got 511"):
        fp8.unpack_mx_scales(torch.zeros(511, dtype=torch.uint8), 4, 4)


def emulated_block_scaled_gemm(qa: torch.Tensor, sfa: torch.Tensor, qb: torch.Tensor, sfb: torch.Tensor,
                               K: int, offset=fp8.mx_sf_offset) -> torch.Tensor:
    """A [M, K] x B [N, K]^T in float64 as the block-scaled MMA reads its operands: A / B as e4m3 bytes (uint8),
    the scale of (row m, K block kb) as the byte at mx_sf_offset(m, kb) of the packed buffer (not the logical
    tensor), 2**(byte - 127); per 32-element K block the block's exact product sum times both scales."""
    M, N, KB = qa.shape[0], qb.shape[0], -(-K // 32)
    a = qa.view(fp8.E4M3).to(torch.float64)
    b = qb.view(fp8.E4M3).to(torch.float64)
    out = torch.zeros(M, N, dtype=torch.float64)
    m, n = torch.arange(M), torch.arange(N)
    for kb in range(KB):
        sa = torch.exp2(sfa[offset(m, kb, KB)].to(torch.float64) - 127)
        sb = torch.exp2(sfb[offset(n, kb, KB)].to(torch.float64) - 127)
        k0, k1 = kb * 32, min(K, kb * 32 + 32)
        out += (a[:, k0:k1] @ b[:, k0:k1].T) * sa.view(-1, 1) * sb.view(1, -1)
    return out


def _operand(rows, K, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, K, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-20, 20, (rows, 1), generator=g)).to(torch.float64)   # rows of many binades
    x[:, :32] *= 1e-3                                                                        # blocks unlike their row
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("M,N,K", [(1, 1, 32), (5, 3, 40), (128, 128, 128), (130, 257, 300), (64, 200, 1024)])
def test_emulation_reading_packed_bytes_equals_gemm_mx_f64(M, N, K):
    qa, ea = fp8.quantize_mx(_operand(M, K, 1))
    qb, eb = fp8.quantize_mx(_operand(N, K, 2))
    want = fp8.gemm_mx_f64(qa, ea, qb, eb)
    got = emulated_block_scaled_gemm(qa.view(torch.uint8), fp8.pack_mx_scales(ea), qb.view(torch.uint8),
                                     fp8.pack_mx_scales(eb), K)
    assert torch.allclose(got, want, rtol=1e-12, atol=0)
    if M * N > 1:   # the packed bytes read row-major (the logical layout's addressing): a different GEMM
        wrong = emulated_block_scaled_gemm(qa.view(torch.uint8), fp8.pack_mx_scales(ea), qb.view(torch.uint8),
                                           fp8.pack_mx_scales(eb), K, offset=lambda r, kb, KB: r * KB + kb)
        assert not torch.allclose(wrong, want, rtol=1e-6)


def test_grouped_weights_pack_per_expert():
    """Expert weights W [G, N, K] quantized along K, packed per expert: expert g's scales are the g-th block of
    mx_sf_bytes(N, KB) bytes (the GEMMs' SFB view is one batch per expert, or per (expert, gate / up part))."""
    G, N, K = 3, 256, 192
    w = torch.stack([_operand(N, K, 10 + g) for g in range(G)])
    qw, ew = fp8.quantize_mx(w)
    p = fp8.pack_mx_scales(ew)
    assert p.shape == (G, fp8.mx_sf_bytes(N, K // 32))
    qa, ea = fp8.quantize_mx(_operand(7, K, 3))
    for g in range(G):
        got = emulated_block_scaled_gemm(qa.view(torch.uint8), fp8.pack_mx_scales(ea), qw[g].view(torch.uint8),
                                         p.flatten()[g * p.shape[1]:], K)
        assert torch.allclose(got, fp8.gemm_mx_f64(qa, ea, qw[g], ew[g]), rtol=1e-12, atol=0)
    # [G, N] rows packed as one [G * N, K] matrix: the same bytes when N is a multiple of 128
    assert torch.equal(fp8.pack_mx_scales(ew.reshape(G * N, -1)), p.flatten())


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(256, 384, 2), (128, 128, 1), (384, 2048, 3), (320, 192, 3), (2880, 2880, 2)])
def test_offset_is_the_dsl_layout(shape):
    """mx_sf_offset equals cutlass.utils.blockscaled_layout.tile_atom_to_shape_SF (the layout the GEMM kernels
    give the scale tensors their TMA reads), evaluated by the CuTe DSL at trace time (static shapes); with rows or
    K not multiples of 128 (gpt-oss-120b's 2880) each batch spans whole atoms, mx_sf_bytes of them."""
    pytest.importorskip("cutlass")
    import cutlass.cute as cute
    import cutlass.utils.blockscaled_layout as bl

    R, K, L = shape
    coords = [(m, k, l) for m in sorted({0, 1, 31, 32, 33, 63, 64, 127, R // 2 + 5, R - 1})
              for k in sorted({0, 31, 32, 95, 96, 127, K // 2 + 1, K - 1}) for l in range(L)]
    got = []

    @cute.jit
    def trace():
        lay = bl.tile_atom_to_shape_SF(shape, 32)
        for c in coords:
            got.append(cute.crd2idx(c, lay))

    cute.compile(trace, options="--gpu-arch sm_100a")
    want = [l * fp8.mx_sf_bytes(R, K // 32) + fp8.mx_sf_offset(m, k // 32, K // 32) for m, k, l in coords]
    assert [int(v) for v in got] == want


# --------------------------------------------------------------------------------------------------------------
# spec and plan


MX = {"hidden": 1024, "ffn": 512, "experts": 8, "topk": 2, "tokens": 256, "dtype": "mxfp8", "archs": ["sm_100a"]}


def test_plan_mxfp8_on_sm100():
    from mokgen.arch import ARCHS
    from mokgen.plan import solve
    from mokgen.sm100.plan import MX_BK, tcgen05_mx_smem
    from mokgen.spec import load_spec

    plan = solve(load_spec(MX), "sm_100a")
    assert any(n.startswith("mxfp8: ") and "weight gradients BF16" in n for n in plan.notes)
    bw = plan.backward
    for which, g in ((1, plan.gemm1), (2, plan.gemm2), ("dgrad1", bw.dgrad1), ("dgrad2", bw.dgrad2)):
        parts = 2 if which == 1 else 1
        assert (g.bk, g.elem_bytes, g.cluster, g.a_load if which == 1 else "tma") == (MX_BK, 1, 1, "tma")
        assert g.bn // parts == 128                                          # one scale atom of W per part
        fits = tcgen05_mx_smem(parts, g.bn // parts, g.bk, g.stages, g.epi_n, g.epi_stages)
        assert 2 <= g.stages and fits <= ARCHS["sm_100a"].smem_per_cta
        assert tcgen05_mx_smem(parts, g.bn // parts, g.bk, g.stages + 1, g.epi_n, g.epi_stages) > \
            ARCHS["sm_100a"].smem_per_cta                                   # the most that fit
    assert plan.gemm1.k_tiles == 1024 // MX_BK and plan.gemm2.k_tiles == 512 // MX_BK
    assert plan.gemm1.n_tiles == 512 // (plan.gemm1.bn // 2) and plan.gemm2.n_tiles == 1024 // plan.gemm2.bn
    # the dgrads: dgrad1 (N = I, K = H), dgrad2 (N = H, K = 2I); the weight gradients keep the BF16 sm_100a tiles
    assert (bw.dgrad1.n_tiles, bw.dgrad1.k_tiles) == (512 // 128, 1024 // MX_BK)
    assert (bw.dgrad2.n_tiles, bw.dgrad2.k_tiles) == (1024 // 128, 2 * 512 // MX_BK)
    bf16 = solve(load_spec({k: v for k, v in MX.items() if k not in ("dtype", "archs")}), "sm_100a").backward
    assert (bw.wgrad1, bw.wgrad2) == (bf16.wgrad1, bf16.wgrad2) and bw.wgrad1.elem_bytes == 2


def test_plan_mxfp8_refusals():
    from mokgen.plan import PlanError, solve
    from mokgen.spec import load_spec

    spec = load_spec(MX)
    for arch in ("sm_90a",):
        with pytest.raises(PlanError, match=r"^plan.arch: dtype mxfp8 .* is planned for sm_100a, got 'sm_90a'"):
            solve(spec, arch)
    with pytest.raises(PlanError, match=r"^plan.gemm2_bn: the sm_100a MXFP8 GEMMs take their fixed tiles"):
        solve(spec, "sm_100a", gemm2_bn=256)
    with pytest.raises(PlanError, match=r"^plan.arch: dtype fp8 is not planned for sm_100a yet .* on sm_100a the FP8 "
                       r"format is dtype mxfp8"):
        solve(load_spec({**MX, "dtype": "fp8", "archs": ["sm_90a"]}), "sm_100a")


def test_kimi_k2_mxfp8_spec_file():
    from mokgen.plan import solve
    from mokgen.spec import load_spec

    spec = load_spec(Path(__file__).resolve().parent.parent / "tools" / "specs" / "kimi-k2-mxfp8.yaml")
    kimi = load_spec("kimi-k2")
    assert (spec.dtype, spec.archs) == ("mxfp8", ("sm_100a",))
    assert {k: v for k, v in spec.to_dict().items() if k not in ("name", "dtype", "archs")} == \
        {k: v for k, v in kimi.to_dict().items() if k not in ("name", "dtype", "archs")}
    assert solve(spec, "sm_100a").gemm1.elem_bytes == 1


# --------------------------------------------------------------------------------------------------------------
# the MXFP8 kernels: rendered for dtype mxfp8 plans, signatures from the argument table, the quantizers' math on
# the CPU against mokgen.fp8, compiled for sm_100a with the block-scaled tcgen05 instructions in the PTX

MX_KERNELS = ("combine", "gemm1", "gemm2", "quant_mx_gather", "quant_mx_used", "quant_mx_w1", "quant_mx_w2", "routing")
# a training plan's (every sm_100a plan has its backward): the MXFP8 dgrads and their quantizers, GEMM 1 saving z,
# the bf16 row gather and BF16 weight gradients
MX_TRAIN = ("dgrad1", "dgrad2", "gather", "gemm1_train", "quant_mx_dz", "quant_mx_w1_cols", "quant_mx_w2_cols",
            "wgrad1", "wgrad1_acc", "wgrad2", "wgrad2_acc")
TABLES = {"gemm1": "gemm1_mx", "gemm2": "gemm2_mx", "gemm1_train": "gemm1_train_mx", "dgrad1": "dgrad1_mx",
          "dgrad2": "dgrad2_mx", "gather": "gather", "wgrad1": "wgrad1", "wgrad1_acc": "wgrad1_acc", "wgrad2": "wgrad2",
          "wgrad2_acc": "wgrad2_acc", **kernels.MX_QUANT_KERNELS, **kernels.MX_QUANT_BACKWARD}


def _mx_plan(**changes):
    from mokgen.plan import solve
    from mokgen.spec import load_spec

    return solve(load_spec({**MX, **changes}), "sm_100a")


def _fn_args(src: str, name: str) -> list[str]:
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == name)
    return [a.arg for a in fn.args.args]


@pytest.mark.parametrize("changes", [{}, {"gate_up_layout": "interleaved", "bias": True}])
def test_emit_mxfp8_forward(changes):
    from mokgen.emit import emit

    src = emit(_mx_plan(**changes))
    # the forward's kernels (x's rows gathered by their quantizer) and the training kernels
    assert src.kernels == sorted(MX_KERNELS + MX_TRAIN) and set(TABLES) | {"routing", "combine"} == set(src.kernels)
    for k, table in TABLES.items():
        text = src.files[f"{k}.py"]
        assert f'KERNEL_NAME = "{k}"' in text
        assert _fn_args(text, "launch") == list(kernels.names(table)) + ["stream"], k
        for a in kernels.ARGS[table]:
            assert a.fake in text, (k, a.name)
        for sym, div in kernels.SYMBOLS[table].items():
            assert f"{sym} = cute.sym_int32({'divisibility=' + div if div else ''})" in text
    g1, g2 = src.files["gemm1.py"], src.files["gemm2.py"]
    assert "MX = True" in g1 and "MX = True" in g2 and "make_blockscaled_trivial_tiled_mma" in g1
    # GEMM 1 reads W1 in quant_mx_w1's concat order whatever the spec's layout; the bias keeps the spec's strides
    assert "N_STRIDE = 1024" in g1 and "P_STRIDE = 524288" in g1
    inter = changes.get("gate_up_layout") == "interleaved"
    assert ("Z_N = 2" in g1) == inter and ("INTERLEAVE = True" in src.files["quant_mx_w1.py"]) == inter
    assert "INTERLEAVE = False" in src.files["quant_mx_w2.py"]
    assert ("HAS_BIAS = True" in g1) == bool(changes.get("bias"))


def test_bf16_kernels_keep_their_form():
    from mokgen.emit import emit
    from mokgen.sm100.emit import render_quant_mx
    from mokgen.emit_base import EmitError
    from mokgen.plan import solve
    from mokgen.spec import load_spec

    plan = solve(load_spec({k: v for k, v in MX.items() if k not in ("dtype", "archs")}), "sm_100a")
    src = emit(plan)
    assert "MX = False" in src.files["gemm1.py"] and "blockscaled" not in src.files["gemm1.py"]
    assert not any(k.startswith("quant_") for k in src.kernels) and "gather" in src.kernels
    with pytest.raises(EmitError, match="MXFP8 quantizers are rendered for dtype mxfp8 plans"):
        render_quant_mx(plan, "quant_mx_w1")
    with pytest.raises(EmitError, match="unknown kernel 'quant_mx_x'"):
        render_quant_mx(_mx_plan(), "quant_mx_x")


def test_runtime_takes_mxfp8():
    """mokgen/ops.py launches the MXFP8 kernel set for an mxfp8 plan (tests/test_mx_runtime.py runs it on the
    reference kernels): the nineteen kernels of the training entry, x's rows gathered by their quantizer."""
    from mokgen import reference as ref
    from mokgen.ops import CompiledMoE

    plan = _mx_plan()
    fns = ref.reference_kernels(plan.spec, plan.bm, training=True)
    moe = CompiledMoE(plan.spec, plan, functions=fns, allow_cpu=True, arch="sm_100a")
    assert moe.mx and moe.trainable and not moe.gather and sorted(moe.kernels) == sorted(MX_KERNELS + MX_TRAIN)
    assert moe.launch_sequence(training=False)[:3] == ("routing", "quant_mx_gather", "gemm1")


# ---- the quantizers' arithmetic, emulated in torch with the kernel's formulas


def kernel_e8m0(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """templates/sm100/quant_mx.py.j2's e8m0_code on int32 bits: c = max(E - 8, 0) (E: amax's biased exponent),
    127 for a zero amax; inv = the fp32 with biased exponent 254 - c."""
    c = torch.clamp_min((amax.to(torch.float32).view(torch.int32) >> 23) - 8, 0)
    c = torch.where(amax == 0, torch.full_like(c, 127), c)
    return c, ((254 - c) << 23).view(torch.float32)


def _template_expr(text: str, start: str) -> str:
    """The Python expression assigned by the line that starts with `start` (continued over parentheses)."""
    i = text.index(start) + len(start)
    depth, j = 0, i
    while True:
        ch = text[j]
        depth += ch == "("
        depth -= ch == ")"
        if ch == "\n" and depth == 0:
            return " ".join(text[i:j].split())
        j += 1


def kernel_offsets(text: str, rows: torch.Tensor, kb: torch.Tensor, k_blocks: int) -> torch.Tensor:
    """The scale-byte offsets the rendered quantizer computes (its `off = ...` expression, evaluated on tensors)."""
    expr = _template_expr(text, "off = ")
    return eval(expr, {"row": rows, "kb": kb, "K_BLOCKS": k_blocks, "SF_ROWS": 128, "SF_ATOM": 512})


def emulate_quantizer(text: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantizer's math on the CPU for rows x [R, K] bf16: per 32-block amax, its code and inverse, q = e4m3(x *
    inv) (to_e4m3: nearest even, saturating as cvt.rn.satfinite), the code bytes at the kernel's offsets."""
    R, K = x.shape
    xf = x.float().view(R, K // 32, 32)
    c, inv = kernel_e8m0(xf.abs().amax(-1))
    q = fp8.to_e4m3(xf * inv.unsqueeze(-1)).view(R, K).view(torch.uint8)
    sf = torch.full((fp8.mx_sf_bytes(R, K // 32),), 255, dtype=torch.uint8)   # 255: never written
    sf[kernel_offsets(text, torch.arange(R).view(-1, 1), torch.arange(K // 32).view(1, -1), K // 32)] = c.to(torch.uint8)
    return q, sf


def boundary_rows(K: int) -> torch.Tensor:
    """bf16 rows whose 32-blocks have amax on every binade edge (1.75 * 2**k, 2**k and their bf16 neighbours,
    subnormals, zero blocks, bf16's largest), values that round at e4m3's half-way points and saturate."""
    k = torch.arange(-133, 128, dtype=torch.float64)
    amax = torch.cat([torch.exp2(k), 1.75 * torch.exp2(k), 1.8125 * torch.exp2(k), 1.9921875 * torch.exp2(k)])
    amax = amax[torch.isfinite(amax.to(torch.bfloat16).float())].to(torch.bfloat16)
    amax = torch.cat([amax, torch.tensor([0.0, 3.3895e38, 9.2e-41], dtype=torch.bfloat16)])
    nb = K // 32
    rows = -(-amax.numel() // nb)
    g = torch.Generator().manual_seed(3)
    base = torch.rand(rows * nb, 32, generator=g) * 2 - 1
    a = torch.cat([amax, amax[: rows * nb - amax.numel()]]).float()
    blocks = base * a.view(-1, 1)
    blocks[:, 0] = a
    blocks[1::7, 1] = a[1::7] * (1 + 1 / 16 + 1 / 32)   # near the top of the binade: e4m3 rounding / saturation
    return blocks.view(rows, K).to(torch.bfloat16)


@pytest.mark.parametrize("K,name", [(128, "quant_mx_used"), (512, "quant_mx_used"), (512, "quant_mx_dz")])
def test_quantizer_math_equals_quantize_mx(K, name):
    from mokgen.sm100.emit import render_quant_mx

    text = render_quant_mx(_mx_plan(), name)
    # quant_mx_dz: the bounded form over dz's 2I columns (dgrad2's A); quant_mx_used over h's I
    assert f"K_DIM = {2 * 512 if name == 'quant_mx_dz' else 512} " in text
    x = boundary_rows(K)
    x = torch.cat([x, torch.randn(-x.shape[0] % 128 + 256, K).to(torch.bfloat16)])   # whole atoms (rows % 128 == 0)
    q, sf = emulate_quantizer(text, x)
    qr, er = fp8.quantize_mx(x)
    assert torch.equal(q, qr.view(torch.uint8))
    assert torch.equal(sf, fp8.pack_mx_scales(er))            # every byte written, at pack_mx_scales' places
    assert {0, 127}.issubset(set(er.flatten().tolist()))       # the clamp and the zero block were exercised
    # the kernel's offset expression is mokgen.fp8.mx_sf_offset
    r, kb = torch.arange(1000).view(-1, 1), torch.arange(64).view(1, -1)
    assert torch.equal(kernel_offsets(text, r, kb, 64), fp8.mx_sf_offset(r, kb, 64))


def test_quantizer_math_can_fail():
    """The emulation is sensitive: a code one too small (the spec's rounding of the exponent) differs."""
    x = boundary_rows(128)
    xf = x.float().view(x.shape[0], 4, 32)
    c, _ = kernel_e8m0(xf.abs().amax(-1))
    _, er = fp8.quantize_mx(x)
    assert torch.equal(c.to(torch.uint8), er.view(-1, 4))
    assert not torch.equal(torch.clamp_min(c - 1, 0).to(torch.uint8), er.view(-1, 4))


@pytest.mark.parametrize("layout", ["concat", "interleaved"])
def test_w1_quantizer_writes_concat_order(layout):
    """quant_mx_w1's row map (its index lines, run on Python ints) puts W1's row (n, p) at output row p * I + n of
    each group; the emulated quantizer on those rows equals quantize_mx of W1 in concat order, packed per
    (group, part) as GEMM 1's scale view (batch g * 2 + p of I rows) reads it."""
    from mokgen.sm100.emit import render_quant_mx

    plan = _mx_plan(gate_up_layout=layout, hidden=256, ffn=256)
    text = render_quant_mx(plan, "quant_mx_w1")
    G, I, H = plan.spec.groups, 256, 256
    body = text[text.index("    n_rows = GROUPS * N_ROWS"):text.index("    v = cute.local_tile")]
    lines = "\n".join(line[4:] for line in body.splitlines()[1:])
    src_of = []
    for row in range(G * 2 * I):
        ns = {"row": row, "N_ROWS": 2 * I, "n_rows": G * 2 * I, "cutlass": type("C", (), {"min": staticmethod(min)})}
        exec(lines, ns)
        src_of.append(ns["src"])
    w = torch.randn(G, 2 * I, H).to(torch.bfloat16)
    if layout == "interleaved":
        concat = torch.cat([w[:, 0::2], w[:, 1::2]], dim=1)
    else:
        concat = w
    assert torch.equal(w.reshape(G * 2 * I, H)[torch.tensor(src_of)], concat.reshape(G * 2 * I, H))
    q, sf = emulate_quantizer(text, w.reshape(G * 2 * I, H)[torch.tensor(src_of)])
    qr, er = fp8.quantize_mx(concat)
    assert torch.equal(q.view(G, 2 * I, H), qr.view(torch.uint8))
    assert torch.equal(sf, fp8.pack_mx_scales(er.reshape(G * 2, I, H // 32)).flatten())


# ---- the backward's weight copies: the column form (quant_mx_w2_cols, quant_mx_w1_cols), 32-blocks down W's columns


def cols_offsets(text: str, g, c, rb, r_blocks: int, sf_group: int) -> torch.Tensor:
    """The rendered column quantizer's code offsets (its `off = ...` expression on tensors): group g, scale row c
    (w's column), K block rb (w's 32-row block)."""
    expr = _template_expr(text, "off = ")
    return eval(expr, {"g": g, "row": c, "kb": rb, "K_BLOCKS": r_blocks, "SF_GROUP": sf_group, "SF_ROWS": 128,
                       "SF_ATOM": 512})


def emulate_cols_quantizer(text: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The column quantizer's math on the CPU for w [G, R, C] bf16: per (group, 32 rows, column) block its amax,
    code and inverse (kernel_e8m0), q = e4m3(w * inv) in w's layout, the code bytes at the kernel's offsets."""
    G, R, C = w.shape
    wf = w.float().view(G, R // 32, 32, C)
    c, inv = kernel_e8m0(wf.abs().amax(2))                                 # [G, R / 32, C]
    q = fp8.to_e4m3(wf * inv.unsqueeze(2)).view(G, R, C).view(torch.uint8)
    sf = torch.full((G * C * R // 32,), 255, dtype=torch.uint8)              # 255: never written
    off = cols_offsets(text, torch.arange(G).view(-1, 1, 1), torch.arange(C).view(1, 1, -1),
                       torch.arange(R // 32).view(1, -1, 1), R // 32, C * R // 32)
    sf[off] = c.to(torch.uint8)
    return q, sf


def _cols_weights(G: int, R: int, C: int) -> torch.Tensor:
    """w [G, R, C] bf16 whose column blocks (32 rows of one column) have amax on every binade edge, zero blocks,
    subnormals, values that round half-way and saturate (boundary_rows, turned so its blocks run down columns)."""
    b = boundary_rows(R)                                                     # [n, R], blocks along R
    n = G * C
    b = torch.cat([b] * -(-n // b.shape[0]))[:n] if b.shape[0] < n else b[:n]
    g = torch.Generator().manual_seed(5)
    b = b[torch.randperm(n, generator=g)]
    return b.view(G, C, R).transpose(1, 2).contiguous()


@pytest.mark.parametrize("name,layout", [("quant_mx_w2_cols", "concat"), ("quant_mx_w1_cols", "concat"),
                                         ("quant_mx_w1_cols", "interleaved")])
def test_cols_quantizer_math_equals_quantize_mx(name, layout):
    """The column form (the dgrads' W copies) emulated with its rendered formulas equals mokgen.fp8.quantize_mx of
    each group's transposed matrix, W[g].mT (its K = W's rows), bit for bit: q in W's layout (q.mT of the
    reference), the codes at pack_mx_scales' bytes of the [C, R / 32] scale matrix, group after group."""
    from mokgen.sm100.emit import render_quant_mx

    plan = _mx_plan(hidden=256, ffn=384, gate_up_layout=layout)
    text = render_quant_mx(plan, name)
    G, H, I = plan.spec.groups, 256, 384
    R, C = (H, I) if name == "quant_mx_w2_cols" else (2 * I, H)
    assert f"R_ROWS = {R} " in text and f"C_COLS = {C} " in text and "INTERLEAVE" not in text
    w = _cols_weights(G, R, C)
    q, sf = emulate_cols_quantizer(text, w)
    qr, er = fp8.quantize_mx(w.transpose(1, 2))                              # [G, C, R], [G, C, R / 32]
    assert torch.equal(q, qr.view(torch.uint8).transpose(1, 2))
    assert torch.equal(sf, fp8.pack_mx_scales(er).flatten())                 # every byte written, in place
    assert {0, 127}.issubset(set(er.flatten().tolist()))
    # the same codes read the other way (blocks along C, the forward's direction) are a different quantization
    _, er_rows = fp8.quantize_mx(w)
    assert not torch.equal(sf, fp8.pack_mx_scales(er_rows).flatten())


@pytest.mark.parametrize("which", ["dgrad1", "dgrad2"])
def test_dgrad_operands_give_the_dequantized_product(which):
    """The dgrads' MXFP8 operands as the kernels write and read them: A by the row quantizers (dgrad1: dO's rows
    along H, quant_mx_gather's formulas; dgrad2: dz along 2I, quant_mx_dz's), B by the column quantizer in W's
    layout; a float64 block-scaled GEMM reading B MN-major (element (n, k) of group g at g*K*N + k*N + n) and both
    scale buffers by the GEMMs' SF views (mx_sf_offset over (rows, K), group g's block of mx_sf_bytes(N, K / 32):
    tile_atom_to_shape_SF, test_offset_is_the_dsl_layout) equals the float64 product of the dequantized operands
    (fp8.gemm_mx_f64 with W[g]'s K along its rows), for every group."""
    from mokgen.sm100.emit import render_quant_mx

    plan = _mx_plan(hidden=256, ffn=128, gate_up_layout="interleaved")
    G, H, I = plan.spec.groups, 256, 128
    K, N = (H, I) if which == "dgrad1" else (2 * I, H)
    a = _operand(130, K, 7)
    w = torch.stack([_operand(K, N, 20 + g) for g in range(G)])             # [G, K, N]: W2 [G, H, I] / W1 [G, 2I, H]
    qa, sfa = emulate_quantizer(render_quant_mx(plan, "quant_mx_gather" if which == "dgrad1" else "quant_mx_dz"),
                                torch.cat([a, torch.zeros(126, K, dtype=torch.bfloat16)]))
    qw, sfw = emulate_cols_quantizer(render_quant_mx(plan, f"quant_mx_w{2 if which == 'dgrad1' else 1}_cols"), w)
    qa_r, ea_r = fp8.quantize_mx(a)
    for g in range(G):
        b_nk = qw[g].T.contiguous()                                          # the UMMA's (N, K) view of the bytes
        got = emulated_block_scaled_gemm(qa[:130], sfa, b_nk, sfw[g * fp8.mx_sf_bytes(N, K // 32):], K)
        qb_r, eb_r = fp8.quantize_mx(w[g].T)
        want = fp8.gemm_mx_f64(qa_r, ea_r, qb_r, eb_r)
        assert torch.allclose(got, want, rtol=1e-12, atol=0), g
        # and near the exact product: MXFP8's error (e4m3: 3 mantissa bits), not a layout's
        exact = a.double() @ w[g].double()
        assert (got - exact).norm() / exact.norm() < 0.08, g


# ---- compiled for sm_100a


def _desc_base(ptx: str) -> int:
    """The first block-scaled MMA's instruction descriptor with the tiled MMA's runtime negate fields off: the
    constant of the selp pair (differing in bit 13, negate A) the descriptor is or-ed from."""
    pairs = {(int(a), int(b)) for a, b in re.findall(r"selp\.b32\s+%r\d+, (\d+), (\d+), %p\d+;", ptx)}
    bases = {b for a, b in pairs if a - b == 1 << 13}
    assert len(bases) == 1, pairs
    return bases.pop()


@pytest.fixture(scope="module")
def mx_built(tmp_path_factory):
    pytest.importorskip("cutlass")
    from mokgen import build
    from mokgen.emit import emit

    plan = _mx_plan(gate_up_layout="interleaved", bias=True)
    return plan, build.build(emit(plan), "sm_100a", tmp_path_factory.mktemp("mx"), jobs=2, progress=False)


@pytest.mark.slow
def test_mxfp8_kernels_compile_for_sm100a(mx_built):
    plan, art = mx_built
    check_mx_ptx(plan, art)


def check_mx_ptx(plan, art) -> None:
    """The PTX of a built MXFP8 training entry (`art`, built from `plan`): the block-scaled tcgen05 MMA, its scale
    copies, TMA loads and instruction descriptor in the forward GEMMs and the dgrads (per the plan's tiles), the
    dgrad1 / gemm1_train epilogue stores, the quantizers' instructions (tests/test_mxfp8_shapes.py runs it on other
    shapes)."""
    from mokgen import build

    assert art.kernels == tuple(sorted(MX_KERNELS + MX_TRAIN))
    report = build.ptx_report(art)
    for k in ("gemm1", "gemm2", "gemm1_train", "dgrad1", "dgrad2"):
        ptx = (Path(art.dir) / f"{k}.ptx").read_text()
        assert report[k]["target"] and report[k]["tcgen05"] and report[k]["cp.async.bulk.tensor"], (k, report[k])
        parts = 2 if k.startswith("gemm1") else 1
        g = getattr(plan.backward, k) if k.startswith("dgrad") else plan.gemm1 if parts == 2 else plan.gemm2
        mma = re.findall(r"tcgen05\.mma\.\S+", ptx)
        assert mma and set(mma) == {"tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.block32.collector::a::discard"}
        cps = re.findall(r"tcgen05\.cp\.\S+", ptx)
        assert cps and set(cps) == {"tcgen05.cp.cta_group::1.32x128b.warpx4"}   # 128 rows x 16 B: one scale atom
        # per K stage: BK / 32 MMAs per part, and one scale copy for A and one per part
        assert len(mma) * (1 + parts) == len(cps) * parts * (g.bk // 32), (len(mma), len(cps))
        for op in ("tcgen05.alloc.cta_group::1", "tcgen05.dealloc.cta_group::1", "tcgen05.ld.sync.aligned.32x32b",
                   "tcgen05.commit.cta_group::1", "tcgen05.wait::ld", "mbarrier.try_wait"):
            assert op in ptx, (k, op)
        assert "wgmma" not in ptx and "kind::f16" not in ptx
        # TMA: per K stage A (2d), W (3d for GEMM 2; GEMM 1's (N, K, part, group) 4d) and the scale atoms of A
        # (3d) and W (4d), one per part; the output by 2d TMA stores
        loads = {d: len(re.findall(rf"cp\.async\.bulk\.tensor\.{d}d\.shared::cta\.global", ptx)) for d in (2, 3, 4)}
        assert loads[2] > 0 and (loads[2], loads[3], loads[4]) == (
            (loads[2], loads[2], 4 * loads[2]) if parts == 2 else (loads[2], 2 * loads[2], loads[2])), loads
        assert "cp.async.bulk.tensor.2d.global.shared::cta" in ptx
        # the instruction descriptor (PTX ISA, kind::mxf8f6f4): A / B e4m3 (bits 7-12 zero), A K-major (bit 15
        # clear), B K-major (bit 16 clear) in the forward GEMMs and MN-major (bit 16 set: W read N-major) in the
        # dgrads, N >> 3 in bits 17-22, e8m0 scales (bit 23), M = 128 (bits 24-28: 128 >> 4)
        d = _desc_base(ptx)
        assert (d >> 7) & 0x3F == 0 and not d & (1 << 15), hex(d)
        assert bool(d & (1 << 16)) == k.startswith("dgrad"), (k, hex(d))
        assert (d >> 17) & 0x3F == (g.bn // parts) >> 3 and d >> 23 & 1 and (d >> 24) & 0x1F == 128 >> 4, hex(d)
        if k == "dgrad1":   # the BF16 dgrad1's epilogue: per 32-column slice a thread's z runs in and dz runs out
            slices = g.bn // 32   # as 16-byte vectors (gate and up: 4 each), one ds value per row and tile
            assert ptx.count("ld.global.v4") == 2 * 4 * slices and ptx.count("st.global.v4") == 2 * 4 * slices
            assert ptx.count("st.global.b32") == 1 and ptx.count("ex2.approx") >= g.bn
        if k == "gemm1_train":   # z from registers, 16-byte vectors
            assert ptx.count("st.global.v4") == 2 * 4 * (g.bn // 2 // 32), k
    for k in tuple(kernels.MX_QUANT_KERNELS) + ("quant_mx_dz",):
        ptx = (Path(art.dir) / f"{k}.ptx").read_text()
        assert re.search(r"^\.target\s+sm_100a\b", ptx, re.M)
        # 16 elements a lane: 8 cvt (2 a cvt), two 16-byte loads, one 16-byte store of e4m3 and one byte of code
        assert ptx.count("cvt.rn.satfinite.e4m3x2.f32") == 8, k
        assert ptx.count("ld.global.v4.b32") == 2 and ptx.count("st.global.v4.b32") == 1, k
        assert ptx.count("st.global.b8") == 1 and "shfl.sync.bfly" in ptx, k
        assert ".ftz" not in ptx and "div." not in ptx and "rcp." not in ptx, k
    H, I = plan.spec.hidden, plan.spec.ffn
    for k, (r_rows, c_cols) in (("quant_mx_w1_cols", (2 * I, H)), ("quant_mx_w2_cols", (H, I))):
        ptx = (Path(art.dir) / f"{k}.ptx").read_text()
        # 8 columns x 32 rows a thread: 32 16-byte loads, 128 cvt (2 a cvt), 32 8-byte stores of e4m3, 8 code bytes
        # (and, where w's rows or columns do not fill whole scale atoms (hidden / ffn 2880), the padding branch's 8
        # code bytes of 127)
        pad = bool(r_rows % 128 or c_cols % 128)
        assert ptx.count("cvt.rn.satfinite.e4m3x2.f32") == 128, k
        assert ptx.count("ld.global.v4.b32") == 32 and ptx.count("st.global.v2.b32") == 32, k
        assert ptx.count("st.global.b8") == (16 if pad else 8) and "shfl" not in ptx, k
        assert ".ftz" not in ptx and "div." not in ptx and "rcp." not in ptx, k


@pytest.mark.slow
def test_mokgen_compile_mxfp8_spec(tmp_path, monkeypatch, capsys):
    """`mokgen compile tools/specs/kimi-k2-mxfp8.yaml --arch sm_100a` builds the training entry (the eight forward
    kernels and eleven of the backward) and reports tcgen05 in every GEMM; its PTX holds the block-scaled MMA in the
    forward GEMMs and the dgrads, the bf16 kind::f16 MMA in the weight gradients."""
    pytest.importorskip("cutlass")
    from mokgen import cli

    monkeypatch.setenv("MOKGEN_CACHE_DIR", str(tmp_path))
    spec = Path(__file__).resolve().parent.parent / "tools" / "specs" / "kimi-k2-mxfp8.yaml"
    assert cli.main(["compile", str(spec), "--arch", "sm_100a", "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert "kimi-k2-mxfp8 sm_100a: 19 kernel(s)" in out
    for k in MX_KERNELS + MX_TRAIN:
        assert re.search(rf"^{k}\s", out, re.M), k
    # columns: wgmma, tma, mbarrier, tcgen05, clusterlaunchcontrol, block-scaled mma, target arch
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()
            if line.split() and line.split()[0] in MX_KERNELS + MX_TRAIN}
    assert "block-scaled mma" in out
    for k in ("gemm1", "gemm2", "gemm1_train", "dgrad1", "dgrad2"):
        assert rows[k] == ["-", "yes", "yes", "yes", "yes", "yes", "yes"], (k, rows[k])
    for k in ("wgrad1", "wgrad2", "wgrad1_acc", "wgrad2_acc"):   # BF16 weight gradients: kind::f16
        assert rows[k] == ["-", "yes", "yes", "yes", "yes", "-", "yes"], (k, rows[k])
    assert all(r[-1] == "yes" for r in rows.values()) and "in MXFP8" in out
    entry = next(Path(tmp_path).glob("sm_100a/*/meta.json")).parent
    for k in ("gemm1", "gemm2", "gemm1_train", "dgrad1", "dgrad2"):
        assert "kind::mxf8f6f4.block_scale" in (entry / f"{k}.ptx").read_text(), k
    for k in ("wgrad1", "wgrad2"):
        ptx = (entry / f"{k}.ptx").read_text()
        assert "tcgen05.mma.cta_group::1.kind::f16" in ptx and "block_scale" not in ptx, k


@pytest.mark.slow
def test_mokgen_compile_api_builds_and_loads_mxfp8(monkeypatch, tmp_path):
    """mokgen.compile of an mxfp8 spec on sm_100a builds the training entry and loads it, as for a BF16 sm_100a
    spec: a CompiledMoE with the MXFP8 launches; on this CPU machine it cannot run (CUDA tensors needed, and no
    Blackwell GPU: never run on one)."""
    pytest.importorskip("cutlass")
    import mokgen
    from mokgen import reference as ref
    from mokgen.ops import CompiledMoE, MoEInputError

    monkeypatch.setenv("MOKGEN_CACHE_DIR", str(tmp_path / "cache"))
    moe = mokgen.compile({**MX, "name": "mx-api", "hidden": 256, "ffn": 128}, arch="sm_100a")
    assert isinstance(moe, CompiledMoE) and moe.mx and moe.trainable and moe.arch == "sm_100a"
    assert sorted(moe.kernels) == sorted(MX_KERNELS + MX_TRAIN)
    inp = ref.random_inputs(moe.spec, tokens=16, seed=0)
    with pytest.raises(MoEInputError, match="inputs must be CUDA tensors"):
        moe(inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2)
