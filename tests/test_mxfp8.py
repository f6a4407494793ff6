"""MXFP8 for sm_100a (issue 20) on the CPU: the scale-factor layout the block-scaled tcgen05 MMA reads
(mokgen.fp8.pack_mx_scales / unpack_mx_scales / mx_sf_offset) against the CuTe DSL's own layout and a float64
emulation of the block-scaled GEMM that reads operand bytes and packed scales by address."""
from __future__ import annotations

import pytest
import torch

from mokgen import fp8


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
@pytest.mark.parametrize("shape", [(256, 384, 2), (128, 128, 1), (384, 2048, 3)])
def test_offset_is_the_dsl_layout(shape):
    """mx_sf_offset equals cutlass.utils.blockscaled_layout.tile_atom_to_shape_SF (the layout the GEMM kernels
    give the scale tensors their TMA reads), evaluated by the CuTe DSL at trace time (static shapes)."""
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
    from mokgen.plan import MX_BK, solve, tcgen05_mx_smem
    from mokgen.spec import load_spec

    plan = solve(load_spec(MX), "sm_100a")
    assert plan.backward is None and any(n.startswith("mxfp8: ") and "cannot train" in n for n in plan.notes)
    for which, g in ((1, plan.gemm1), (2, plan.gemm2)):
        parts = 2 if which == 1 else 1
        assert (g.bk, g.elem_bytes, g.cluster, g.a_load if which == 1 else "tma") == (MX_BK, 1, 1, "tma")
        fits = tcgen05_mx_smem(parts, g.bn // parts, g.bk, g.stages, g.epi_n, g.epi_stages)
        assert 2 <= g.stages and fits <= ARCHS["sm_100a"].smem_per_cta
        assert tcgen05_mx_smem(parts, g.bn // parts, g.bk, g.stages + 1, g.epi_n, g.epi_stages) > \
            ARCHS["sm_100a"].smem_per_cta                                   # the most that fit
    assert plan.gemm1.k_tiles == 1024 // MX_BK and plan.gemm2.k_tiles == 512 // MX_BK
    assert plan.gemm1.n_tiles == 512 // (plan.gemm1.bn // 2) and plan.gemm2.n_tiles == 1024 // plan.gemm2.bn


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
    from pathlib import Path

    from mokgen.plan import solve
    from mokgen.spec import load_spec

    spec = load_spec(Path(__file__).resolve().parent.parent / "tools" / "specs" / "kimi-k2-mxfp8.yaml")
    kimi = load_spec("kimi-k2")
    assert (spec.dtype, spec.archs) == ("mxfp8", ("sm_100a",))
    assert {k: v for k, v in spec.to_dict().items() if k not in ("name", "dtype", "archs")} == \
        {k: v for k, v in kimi.to_dict().items() if k not in ("name", "dtype", "archs")}
    assert solve(spec, "sm_100a").gemm1.elem_bytes == 1
