"""mokgen.fp8: the FP8 quantizers and emulated GEMMs, checked against an independent emulation written here.

The emulation uses no torch float8 arithmetic: e4m3's 256 codes are decoded from their bit patterns into a value
table, values are rounded to the nearest table entry with ties to the even code by hand, float32 roundings are
done with ``struct`` (C's double -> float conversion, round to nearest even), block sums with ``math.fsum``.
Every check compares codes / scales / outputs bit for bit, or against an error bound tight enough that a
perturbed input breaks it (shown next to it).
"""

import bisect
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mokgen import fp8

REPO = Path(__file__).resolve().parents[1]
U32 = 2.0 ** -24                                  # fp32 unit roundoff


# --------------------------------------------------------------------------------------------------------------
# the independent emulation


def _decode(c: int) -> float:
    sign = -1.0 if c >> 7 else 1.0
    e, m = (c >> 3) & 0xF, c & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    if e == 0:
        return sign * (m / 8.0) * 2.0 ** -6      # subnormals: 0.mmm * 2**(1 - bias), bias 7
    return sign * (1.0 + m / 8.0) * 2.0 ** (e - 7)


TABLE = [_decode(c) for c in range(256)]
POS = TABLE[:127]                                 # codes 0..126: 0, 2**-9, ..., 448, ascending


def f32(v: float) -> float:
    """v rounded to float32 (round to nearest even)."""
    return struct.unpack("f", struct.pack("f", v))[0]


def ref_code(v: float) -> int:
    """The e4m3 code of v: nearest finite value, ties to the even code (mantissa LSB 0), saturating at 448."""
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = min(abs(v), 448.0)
    i = bisect.bisect_left(POS, a)
    if POS[i] == a:
        return sign | i
    lo, hi = i - 1, i
    dl, dh = a - POS[lo], POS[hi] - a
    if dl != dh:
        return sign | (lo if dl < dh else hi)
    return sign | (lo if lo % 2 == 0 else hi)


def ref_scale(amax: float, pow2: bool) -> float:
    if amax == 0.0:
        return 1.0
    if pow2:
        e = -126
        while amax > 448.0 * 2.0 ** e:
            e += 1
        return 2.0 ** e
    return max(f32(amax / 448.0), 2.0 ** -126)


def ref_quantize(x: torch.Tensor, br: int, bc: int, pow2: bool):
    """(codes uint8 [R, C], scales float64 [nR, nC]) by loops over the blocks of a 2-D float32 tensor."""
    R, C = x.shape
    xs = x.tolist()
    nR, nC = -(-R // br), -(-C // bc)
    codes = [[0] * C for _ in range(R)]
    scales = [[0.0] * nC for _ in range(nR)]
    for bi in range(nR):
        for bj in range(nC):
            rows = range(bi * br, min(R, (bi + 1) * br))
            cols = range(bj * bc, min(C, (bj + 1) * bc))
            amax = max(abs(xs[r][c]) for r in rows for c in cols)
            s = ref_scale(amax, pow2)
            scales[bi][bj] = s
            for r in rows:
                for c in cols:
                    codes[r][c] = ref_code(f32(xs[r][c] / s))
    return torch.tensor(codes, dtype=torch.uint8), torch.tensor(scales, dtype=torch.float64)


def floor_log2(a: float) -> int:
    e = 0
    while 2.0 ** e > a:
        e -= 1
    while 2.0 ** (e + 1) <= a:
        e += 1
    return e


def ref_mx(x: torch.Tensor, block: int):
    R, C = x.shape
    xs = x.tolist()
    nC = -(-C // block)
    codes = [[0] * C for _ in range(R)]
    ecodes = [[0] * nC for _ in range(R)]
    for r in range(R):
        for bj in range(nC):
            cols = range(bj * block, min(C, (bj + 1) * block))
            amax = max(abs(xs[r][c]) for c in cols)
            e = 0 if amax == 0 else min(127, max(-127, floor_log2(amax) - 8))
            ecodes[r][bj] = e + 127
            for c in cols:
                codes[r][c] = ref_code(f32(xs[r][c] / 2.0 ** e))
    return torch.tensor(codes, dtype=torch.uint8), torch.tensor(ecodes, dtype=torch.uint8)


def values(q: torch.Tensor) -> list:
    """The float64 values of e4m3 codes, through the table (not torch's float8 conversion)."""
    return [[TABLE[c] for c in row] for row in q.view(torch.uint8).tolist()]


def ref_gemm(qa, sa_of, qb, sb_of, K: int, kblock: int, acc_bits=None) -> torch.Tensor:
    """out[m][n] by loops: per K block the exact product sum (or a sequential sum rounded to acc_bits significant
    bits after each add) -> fp32, times fp32(sa * sb), added into an fp32 accumulator."""
    A, B = values(qa), values(qb)
    out = []
    for m in range(len(A)):
        row = []
        for n in range(len(B)):
            acc = 0.0
            for kb, k0 in enumerate(range(0, K, kblock)):
                ks = range(k0, min(K, k0 + kblock))
                if acc_bits is None:
                    part = math.fsum(A[m][k] * B[n][k] for k in ks)
                else:
                    part = 0.0
                    for k in ks:
                        part = round_bits(part + A[m][k] * B[n][k], acc_bits)
                scale = f32(sa_of(m, kb) * sb_of(n, kb))
                acc = f32(acc + f32(f32(part) * scale))
            row.append(acc)
        out.append(row)
    return torch.tensor(out, dtype=torch.float32)


def round_bits(v: float, bits: int) -> float:
    if v == 0.0:
        return 0.0
    m, e = math.frexp(v)
    return math.ldexp(round(m * 2 ** bits), e - bits)   # Python's round(): half to even


def codes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def randx(shape, seed, spread=3.0):
    """Normal values whose magnitude varies by up to 10**spread between rows and columns (so blocks differ)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    rs = 10.0 ** (spread * (torch.rand(shape[0], 1, generator=g) - 0.5))
    cs = 10.0 ** (spread * (torch.rand(1, shape[1], generator=g) - 0.5))
    return (x * rs * cs).float()


# --------------------------------------------------------------------------------------------------------------
# e4m3 itself: torch's dtype and cast against the table


def test_table_matches_torch_decoding():
    t = torch.arange(256, dtype=torch.uint8).view(fp8.E4M3).to(torch.float64).tolist()
    for c in range(256):
        assert (math.isnan(t[c]) and math.isnan(TABLE[c])) or t[c] == TABLE[c], c
    assert POS[-1] == 448.0 == fp8.E4M3_MAX and POS[1] == 2.0 ** -9
    assert [c for c in range(256) if math.isnan(TABLE[c])] == [0x7F, 0xFF]


def test_torch_cast_rounds_to_nearest_even():
    """Every midpoint between neighbouring e4m3 values (a tie), the float32 neighbours of each midpoint and of
    each value, and random values: torch's cast (which fp8.to_e4m3 relies on) equals the table rounding."""
    vals = []
    for lo, hi in zip(POS[:-1], POS[1:]):
        mid = (lo + hi) / 2
        vals += [lo, mid, hi]
        t = torch.tensor([mid, lo], dtype=torch.float32)
        vals += torch.nextafter(t, torch.full_like(t, math.inf)).tolist()
        vals += torch.nextafter(t, torch.full_like(t, -math.inf)).tolist()
    vals += (torch.randn(4000, generator=torch.Generator().manual_seed(0)) * 60).tolist()
    vals += [-v for v in vals]
    x = torch.tensor(vals, dtype=torch.float32)
    got = codes(x.to(fp8.E4M3)).tolist()
    want = [ref_code(v) for v in x.tolist()]
    assert got == want
    assert codes(fp8.to_e4m3(x)).tolist() == want
    # the ties, by hand: 1.0625 -> 1.0 (even), 1.1875 -> 1.25 (even), 17 -> 16, 19 -> 20, 2**-10 -> 0
    ties = torch.tensor([1.0625, 1.1875, 17.0, 19.0, 2.0 ** -10, 3 * 2.0 ** -10, 432.0])
    assert fp8.to_e4m3(ties).double().tolist() == [1.0, 1.25, 16.0, 20.0, 0.0, 2.0 ** -8, 448.0]


def test_to_e4m3_saturates():
    big = torch.tensor([448.0, 449.0, 463.99, 464.0, 480.0, 1e6, 3e38, math.inf])
    assert fp8.to_e4m3(big).double().tolist() == [448.0] * 8
    assert fp8.to_e4m3(-big).double().tolist() == [-448.0] * 8
    assert torch.isnan(fp8.to_e4m3(torch.tensor([math.nan])).double()).all()


# --------------------------------------------------------------------------------------------------------------
# blockwise quantizers


QUANTIZERS = {
    "1x128": (fp8.quantize_1x128, fp8.dequantize_1x128, 1, 128),
    "128x128": (fp8.quantize_128x128, fp8.dequantize_128x128, 128, 128),
    "128x1": (fp8.quantize_128x1, fp8.dequantize_128x1, 128, 1),
}
# shapes with partial edge blocks along every blocked dim
SHAPES = {"1x128": (3, 300), "128x128": (130, 260), "128x1": (260, 5)}


@pytest.mark.parametrize("pow2", [False, True], ids=["fp32-scale", "pow2-scale"])
@pytest.mark.parametrize("kind", list(QUANTIZERS))
def test_quantize_matches_emulation(kind, pow2):
    quant, _, br, bc = QUANTIZERS[kind]
    x = randx(SHAPES[kind], seed=1)
    x[0, 0] = -0.0
    q, s = quant(x, pow2=pow2)
    rq, rs = ref_quantize(x, br, bc, pow2)
    assert q.dtype == fp8.E4M3 and q.shape == x.shape and s.dtype == torch.float32
    assert s.shape == rs.shape
    assert torch.equal(s.double(), rs)
    assert torch.equal(codes(q), rq)


@pytest.mark.parametrize("kind", list(QUANTIZERS))
def test_scales_by_hand(kind):
    """Blocks whose amax is picked: 448 -> 1, 1 -> fp32(1/448) (pow2: 2**-8, since 1/2**-9 = 512 > 448),
    448 * 2**-3 -> 2**-3 for both, just above it -> pow2 2**-2."""
    quant, _, br, bc = QUANTIZERS[kind]
    amaxes = [448.0, 1.0, 448.0 * 2 ** -3, f32(448.0 * 2 ** -3 * (1 + 2 ** -20))]
    want32 = [1.0, f32(1 / 448), 2.0 ** -3, f32(amaxes[3] / 448)]
    want2 = [1.0, 2.0 ** -8, 2.0 ** -3, 2.0 ** -2]
    nb = len(amaxes)
    x = torch.zeros(br * nb if br > 1 else 2, bc * nb if bc > 1 else 2)
    for i, a in enumerate(amaxes):
        r, c = (i * br if br > 1 else 0), (i * bc if bc > 1 else 0)
        x[r, c] = -a                                  # the sign does not matter
        x[r + (br > 1), c + (bc > 1)] = a / 3         # a smaller element in the same block
    for pow2, want in ((False, want32), (True, want2)):
        _, s = quant(x, pow2=pow2)
        diag = [s[i if br > 1 else 0, i if bc > 1 else 0].item() for i in range(nb)]
        assert diag == want, (pow2, diag)


def test_pow2_scales_at_every_binade_boundary():
    """amax = 448 * 2**k and its float32 neighbours, k from -133 to 119: the smallest power of two >= 2**-126 with
    amax / s <= 448 (checked by the exact loop of ref_scale), and the fp32 scale fp32(amax / 448)."""
    base = torch.tensor([448.0 * 2.0 ** k for k in range(-133, 120)], dtype=torch.float32)
    amax = torch.cat([base, torch.nextafter(base, torch.full_like(base, math.inf)),
                      torch.nextafter(base, torch.zeros_like(base))])
    x = torch.zeros(len(amax), 2)
    x[:, 1] = amax
    for pow2 in (False, True):
        _, s = fp8.quantize_1x128(x, pow2=pow2)
        assert s[:, 0].tolist() == [ref_scale(a, pow2) for a in amax.tolist()]


def test_quantize_ties_and_saturation_by_hand():
    """A block with amax 448 has scale 1 (fp32 and pow2), so its elements are rounded as they are."""
    row = [448.0, 1.0625, 1.1875, -17.0, 19.0, 2.0 ** -10, 3 * 2.0 ** -10, -1e-30, 300.0]
    want = [448.0, 1.0, 1.25, -16.0, 20.0, 0.0, 2.0 ** -8, -0.0, 288.0]
    x = torch.tensor([row])
    for pow2 in (False, True):
        q, s = fp8.quantize_1x128(x, pow2=pow2)
        assert s.tolist() == [[1.0]]
        assert q.double().tolist() == [want]
        assert codes(q)[0, 7].item() == 0x80          # -1e-30 keeps its sign: -0
    # fp32 scale: amax / fp32(amax / 448) can land just above 448 (here 448.00003); it saturates to 448, never NaN
    x = torch.tensor([[2.3035430908203125, -0.3]])
    q, s = fp8.quantize_1x128(x)
    assert f32(x[0, 0].item() / s.item()) > 448.0 and q[0, 0].item() == 448.0
    # x / s is a division, not a multiplication by 1 / s: here fp32(x / s) = 336, a tie (320 | 352) that goes to
    # the even 320, while fp32(x * fp32(1 / s)) = 336.00003 would round to 352
    x = torch.tensor([[0.9249807000160217, 0.6937355399131775]])
    q, s = fp8.quantize_1x128(x)
    assert f32(x[0, 1].item() / s.item()) == 336.0 and f32(x[0, 1].item() * f32(1 / s.item())) > 336.0
    assert q[0, 1].item() == 320.0


def test_every_nonzero_block_reaches_448_with_fp32_scales():
    x = randx((6, 512), seed=2)
    q, s = fp8.quantize_1x128(x)
    blk = q.double().abs().reshape(6, 4, 128).amax(-1)
    assert (blk == 448.0).all()
    q2, _ = fp8.quantize_1x128(x, pow2=True)
    blk2 = q2.double().abs().reshape(6, 4, 128).amax(-1)
    assert ((blk2 >= 224.0) & (blk2 <= 448.0)).all() and (blk2 < 448.0).any()   # amax / s in (224, 448]


@pytest.mark.parametrize("kind", list(QUANTIZERS))
def test_zero_blocks(kind):
    quant, deq, br, bc = QUANTIZERS[kind]
    x = randx(SHAPES[kind], seed=3)
    x[: br if br > 1 else 1, : bc if bc > 1 else 1] = 0.0       # block (0, 0) all zero
    for pow2 in (False, True):
        q, s = quant(x, pow2=pow2)
        assert s[0, 0].item() == 1.0
        assert (codes(q)[: br if br > 1 else 1, : bc if bc > 1 else 1] == 0).all()
        if not pow2:                                            # (a power-of-two scale may be 1)
            assert (s[1:, 1:] != 1.0).all()                     # the other blocks are scaled
        assert (deq(q, s)[: br if br > 1 else 1, : bc if bc > 1 else 1] == 0).all()
    q, s = quant(torch.zeros(3, 3))
    assert (s == 1.0).all() and (codes(q) == 0).all()


def test_tiny_blocks_keep_a_normal_scale():
    """amax below 448 * 2**-126: the scale stops at 2**-126 (fp32's smallest normal), for both scale kinds."""
    x = torch.tensor([[1e-38, -3e-39, 1e-45, 0.0]], dtype=torch.float32)
    for pow2 in (False, True):
        q, s = fp8.quantize_1x128(x, pow2=pow2)
        rq, rs = ref_quantize(x, 1, 128, pow2)
        assert s.item() == 2.0 ** -126 == rs.item()
        assert torch.equal(codes(q), rq)


@pytest.mark.parametrize("kind", list(QUANTIZERS))
def test_edge_blocks_equal_zero_padding(kind):
    quant, _, br, bc = QUANTIZERS[kind]
    x = randx(SHAPES[kind], seed=4)
    R, C = x.shape
    xp = torch.nn.functional.pad(x, (0, (-C) % max(bc, 1), 0, (-R) % max(br, 1)))
    q, s = quant(x)
    qp, sp = quant(xp)
    assert torch.equal(s, sp)
    assert torch.equal(codes(q), codes(qp)[:R, :C])
    assert s.shape == (-(-R // br), -(-C // bc))


def test_128x1_is_1x128_transposed_and_batches_work():
    x = randx((260, 7), seed=5)
    q, s = fp8.quantize_128x1(x)
    qt, st = fp8.quantize_1x128(x.T.contiguous())
    assert torch.equal(s, st.T) and torch.equal(codes(q), codes(qt).T)
    w = torch.stack([randx((130, 200), seed=6), randx((130, 200), seed=7)])
    qw, sw = fp8.quantize_128x128(w, pow2=True)
    for g in range(2):
        qg, sg = fp8.quantize_128x128(w[g], pow2=True)
        assert torch.equal(sw[g], sg) and torch.equal(codes(qw[g]), codes(qg))
    xb = randx((5, 300), seed=8).bfloat16()
    qb, sb = fp8.quantize_1x128(xb)
    rq, rs = ref_quantize(xb.float(), 1, 128, False)
    assert torch.equal(codes(qb), rq) and torch.equal(sb.double(), rs)


@pytest.mark.parametrize("kind", list(QUANTIZERS))
def test_quantization_error_bound(kind):
    """|dequant - x| <= 2**-4 |x| for every element whose scaled value is an e4m3 normal (>= 2**-6): 3 mantissa
    bits, round to nearest (+ 2**-20 for the fp32 roundings of x / s). Elements in e4m3's subnormal range
    are within half a subnormal step, 2**-10 * s. The bound is nearly reached (it is not loose)."""
    quant, deq, br, bc = QUANTIZERS[kind]
    x = randx(SHAPES[kind], seed=9)
    for pow2 in (False, True):
        q, s = quant(x, pow2=pow2)
        d = deq(q, s, torch.float64)
        se = s.double().repeat_interleave(br, 0).repeat_interleave(bc, 1)[: x.shape[0], : x.shape[1]]
        xd = x.double()
        err = (d - xd).abs()
        normal = xd.abs() / se >= 2.0 ** -6
        rel = err[normal] / xd.abs()[normal]
        assert rel.max().item() <= 2.0 ** -4 + 2.0 ** -20
        assert rel.max().item() > 2.0 ** -4 * 0.9
        assert (err[~normal] <= 2.0 ** -10 * se[~normal] * (1 + 2.0 ** -20)).all()


def test_pow2_dequantization_is_exact_in_fp32():
    x = randx((4, 300), seed=10)
    q, s = fp8.quantize_1x128(x, pow2=True)
    m, _ = torch.frexp(s)
    assert (m == 0.5).all()
    assert torch.equal(fp8.dequantize_1x128(q, s).double(), fp8.dequantize_1x128(q, s, torch.float64))
    q, s = fp8.quantize_1x128(x)                    # fp32 scales: q * s needs up to 28 bits, fp32 rounds some
    assert not torch.equal(fp8.dequantize_1x128(q, s).double(), fp8.dequantize_1x128(q, s, torch.float64))


def test_nonfinite_inputs_raise_naming_tensor_and_block():
    x = randx((3, 300), seed=11)
    x[1, 130] = math.nan
    with pytest.raises(ValueError, match=r"quantize_1x128: x has a non-finite value \(nan\) at \[1, 130\], "
                                         r"in 1x128 block \(1, 1\)"):
        fp8.quantize_1x128(x)
    w = torch.zeros(2, 130, 260)
    w[1, 129, 5] = math.inf
    with pytest.raises(ValueError, match=r"quantize_128x128: w1 .*\(inf\) at \[1, 129, 5\], in 128x128 block "
                                         r"\(1, 1, 0\)"):
        fp8.quantize_128x128(w, name="w1")
    g = torch.zeros(260, 4)
    g[200, 3] = -math.inf
    with pytest.raises(ValueError, match=r"quantize_128x1: dy .*\(-inf\) at \[200, 3\], in 128x1 block \(1, 3\)"):
        fp8.quantize_128x1(g, pow2=True, name="dy")
    m = torch.ones(2, 70)
    m[0, 40] = math.nan
    with pytest.raises(ValueError, match=r"quantize_mx: x .*at \[0, 40\], in 32 block \(0, 1\)"):
        fp8.quantize_mx(m)


def test_bad_arguments():
    with pytest.raises(TypeError):
        fp8.quantize_1x128(torch.ones(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="at least 2 dims"):
        fp8.quantize_128x128(torch.ones(3))
    q, s = fp8.quantize_1x128(torch.ones(2, 300))
    with pytest.raises(ValueError, match=r"s must have shape \[2, 3\]"):
        fp8.dequantize_1x128(q, s[:, :2])
    with pytest.raises(TypeError):
        fp8.dequantize_1x128(q.float(), s)
    qw, sw = fp8.quantize_128x128(torch.ones(4, 300))
    with pytest.raises(ValueError, match="promote_every"):
        fp8.gemm_1x128_128x128(q, s, qw, sw, promote_every=96)
    with pytest.raises(ValueError, match="acc_bits"):
        fp8.gemm_1x128_128x128(q, s, qw, sw, acc_bits=30)
    with pytest.raises(ValueError, match=r"sb must have shape \[1, 3\]"):
        fp8.gemm_1x128_128x128(q, s, qw, sw.T)


# --------------------------------------------------------------------------------------------------------------
# the blockwise GEMMs


def gemm_operands(M, N, K, seed, pow2=False):
    a = randx((M, K), seed=seed)
    b = randx((N, K), seed=seed + 1)
    return (*fp8.quantize_1x128(a, pow2=pow2), *fp8.quantize_128x128(b, pow2=pow2))


def abs_gemm(qa, sa, qb, sb):
    """sum_k |a_k b_k| on the dequantized operands (the scale of fp32 summation errors)."""
    return fp8.dequantize_1x128(qa, sa, torch.float64).abs() @ fp8.dequantize_128x128(qb, sb, torch.float64).abs().T


@pytest.mark.parametrize("pow2", [False, True], ids=["fp32-scale", "pow2-scale"])
def test_gemm_matches_emulation_bitwise(pow2):
    M, N, K = 3, 130, 300                            # 2 N blocks, 3 K blocks (the last one partial)
    qa, sa, qb, sb = gemm_operands(M, N, K, seed=20, pow2=pow2)
    out = fp8.gemm_1x128_128x128(qa, sa, qb, sb)
    sal, sbl = sa.tolist(), sb.tolist()
    want = ref_gemm(qa, lambda m, kb: sal[m][kb], qb, lambda n, kb: sbl[n // 128][kb], K, 128)
    assert out.dtype == torch.float32 and out.shape == (M, N)
    assert torch.equal(out, want)


def test_gemm_f64_reference_and_fp32_bound():
    """The float64 reference is the plain product of the dequantized operands; the emulation is within the
    fp32 rounding bound (n_kblocks + 3) * 2**-24 * sum|a b| of it, and a wrong scale index breaks the bound."""
    M, N, K = 4, 260, 520
    qa, sa, qb, sb = gemm_operands(M, N, K, seed=21)
    ref = fp8.gemm_1x128_128x128_f64(qa, sa, qb, sb)
    A = torch.tensor(values(qa)) * sa.double().repeat_interleave(128, 1)[:, :K]
    B = torch.tensor(values(qb)) * sb.double().repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
    assert torch.allclose(ref, A @ B.T, rtol=1e-14, atol=0)
    bound = (5 + 3) * U32 * abs_gemm(qa, sa, qb, sb)

    def within(out):
        return bool(((out.double() - ref).abs() <= bound).all())

    assert within(fp8.gemm_1x128_128x128(qa, sa, qb, sb))
    assert within(fp8.gemm_1x128_128x128(qa, sa, qb, sb, promote_every=32))
    assert not within(fp8.gemm_1x128_128x128(qa, sa, qb, sb.flip(1)))          # K blocks' scales swapped
    assert not within(fp8.gemm_1x128_128x128(qa, sa, qb, sb, acc_bits=14))     # a 14-bit accumulator


def test_dgrad_uses_transposed_weight_blocks():
    dy = randx((3, 260), seed=22)                   # dY [M, N]
    w = randx((260, 200), seed=23)                  # W [N, K]
    qd, sd = fp8.quantize_1x128(dy)
    qw, sw = fp8.quantize_128x128(w)
    out = fp8.gemm_1x128_128x128(qd, sd, qw.T.contiguous(), sw.T.contiguous())
    ref = fp8.dequantize_1x128(qd, sd, torch.float64) @ fp8.dequantize_128x128(qw, sw, torch.float64)
    bound = (3 + 3) * U32 * (fp8.dequantize_1x128(qd, sd, torch.float64).abs()
                             @ fp8.dequantize_128x128(qw, sw, torch.float64).abs())
    assert ((out.double() - ref).abs() <= bound).all()
    assert (ref - dy.double() @ w.double()).abs().max() > 0       # it is the quantized product, not the exact


def test_wgrad_gemm():
    """dW [N, K] = dY [M, N]^T @ X [M, K], both 128x1 along the tokens M: bitwise against the loops, within the
    fp32 bound of the float64 reference."""
    M, N, K = 300, 5, 7
    qa, sa = fp8.quantize_128x1(randx((M, N), seed=24))
    qb, sb = fp8.quantize_128x1(randx((M, K), seed=25))
    out = fp8.gemm_128x1_128x1(qa, sa, qb, sb)
    sal, sbl = sa.tolist(), sb.tolist()
    want = ref_gemm(fp8.to_e4m3(qa.T.float()), lambda n, mb: sal[mb][n], fp8.to_e4m3(qb.T.float()),
                    lambda k, mb: sbl[mb][k], M, 128)
    assert out.shape == (N, K) and torch.equal(out, want)
    ref = fp8.gemm_128x1_128x1_f64(qa, sa, qb, sb)
    da, db = fp8.dequantize_128x1(qa, sa, torch.float64), fp8.dequantize_128x1(qb, sb, torch.float64)
    assert torch.allclose(ref, da.T @ db, rtol=1e-14, atol=0)
    assert ((out.double() - ref).abs() <= (3 + 3) * U32 * (da.abs().T @ db.abs())).all()


def test_round_significand():
    g = torch.Generator().manual_seed(26)
    x = (torch.randn(2000, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-8, 8, (2000,), generator=g))
    x = torch.cat([x, torch.tensor([0.0, 1 + 2.0 ** -14, 1 + 3 * 2.0 ** -14, -(1 + 2.0 ** -14), 2.0 ** -30])])
    for bits in (3, 14, 24):
        got = fp8.round_significand(x, bits).tolist()
        assert got == [round_bits(v, bits) for v in x.tolist()]
    # ties at 14 bits: 1 + 2**-14 -> 1 (even), 1 + 3 * 2**-14 -> 1 + 2**-12 (even)
    assert fp8.round_significand(torch.tensor([1 + 2.0 ** -14, 1 + 3 * 2.0 ** -14]), 14).tolist() == \
        [1.0, 1 + 2.0 ** -12]


def test_gemm_acc_bits_matches_emulation_bitwise():
    M, N, K = 2, 3, 300
    qa, sa, qb, sb = gemm_operands(M, N, K, seed=27)
    sal, sbl = sa.tolist(), sb.tolist()
    for bits, every in ((14, 128), (14, 64), (10, 128)):
        out = fp8.gemm_1x128_128x128(qa, sa, qb, sb, promote_every=every, acc_bits=bits)
        want = ref_gemm(qa, lambda m, kb: sal[m][kb // (128 // every)], qb,
                        lambda n, kb: sbl[n // 128][kb // (128 // every)], K, every, acc_bits=bits)
        assert torch.equal(out, want), (bits, every)


def test_promotion_reduces_the_narrow_accumulator_error():
    """DeepSeek-V3 section 3.3: with a ~14-bit accumulator, K = 4096 summed in one accumulator is measurably
    worse than promoting to fp32 every 128 elements. Unit scales so one accumulator may span all of K."""
    M, N, K = 16, 16, 4096
    g = torch.Generator().manual_seed(28)
    qa = fp8.to_e4m3(torch.randn(M, K, generator=g) * 16)
    qb = fp8.to_e4m3(torch.randn(N, K, generator=g) * 16)
    sa = torch.ones(M, K // 128)
    sb = torch.ones(1, K // 128)
    ref = fp8.gemm_1x128_128x128_f64(qa, sa, qb, sb)

    def rel(out):
        return ((out.double() - ref).norm() / ref.norm()).item()

    e_ideal = rel(fp8.gemm_1x128_128x128(qa, sa, qb, sb))
    e_promo = rel(fp8.gemm_1x128_128x128(qa, sa, qb, sb, promote_every=128, acc_bits=14))
    e_none = rel(fp8.gemm_1x128_128x128(qa, sa, qb, sb, promote_every=K, acc_bits=14))
    print(f"\nK={K}, 14-bit accumulator: rel. error without promotion {e_none:.3e}, promoted every 128 "
          f"{e_promo:.3e}, ideal accumulator {e_ideal:.3e}")
    assert e_ideal < 1e-6
    assert e_none > 2 * e_promo > 2 * e_ideal
    # one accumulator over K blocks whose scales differ cannot exist
    qa2, sa2, qb2, sb2 = gemm_operands(2, 3, 512, seed=29)
    with pytest.raises(ValueError, match="scales differ"):
        fp8.gemm_1x128_128x128(qa2, sa2, qb2, sb2, promote_every=512)


# --------------------------------------------------------------------------------------------------------------
# MXFP8


def test_mx_scale_codes_by_hand():
    blocks = [  # (amax, another element, e8m0 code, q of amax, q of the other element)
        (1.0, 0.5, 119, 256.0, 128.0),              # floor(log2 1) - 8 = -8
        (448.0, -3.0, 127, 448.0, -3.0),            # 8 - 8 = 0
        (500.0, 1.0, 127, 448.0, 1.0),              # 8 - 8 = 0, and 500 saturates to 448
        (512.0, 3.0, 128, 256.0, 1.5),              # 9 - 8 = 1
        (0.75, 0.0, 118, 384.0, 0.0),               # -1 - 8 = -9
        (0.0, 0.0, 127, 0.0, 0.0),                  # all zero: scale 1
        (2.0 ** -119, 0.0, 0, 256.0, 0.0),          # -127: the lowest e8m0 code, reached exactly
        (2.0 ** -130, 0.0, 0, 0.125, 0.0),          # -138 clamped to -127 (an fp32 subnormal amax)
        (3e38, 1e36, 246, 448.0, 1.5),              # 127 - 8 = 119; 3e38 / 2**119 = 451.3 saturates
    ]
    x = torch.zeros(1, 32 * len(blocks))
    for i, (a, o, *_) in enumerate(blocks):
        x[0, 32 * i + 3] = a
        x[0, 32 * i + 17] = o
    q, e = fp8.quantize_mx(x)
    assert e.dtype == torch.uint8 and e.shape == (1, len(blocks))
    assert e[0].tolist() == [b[2] for b in blocks]
    qv = q.double()[0]
    assert [qv[32 * i + 3].item() for i in range(len(blocks))] == [b[3] for b in blocks]
    assert [qv[32 * i + 17].item() for i in range(len(blocks))] == [b[4] for b in blocks]


def test_mx_matches_emulation():
    g = torch.Generator().manual_seed(30)
    x = torch.randn(6, 80, generator=g) * 10.0 ** torch.randint(-30, 30, (6, 1), generator=g).float()
    x[2, 64:] = 0.0                                   # a zero edge block (K = 80: the last block has 16)
    x[3, 5] = 2.0 ** 7 * 1.99                         # amax just under a power of two
    q, e = fp8.quantize_mx(x)
    rq, re = ref_mx(x, 32)
    assert torch.equal(e, re)
    assert torch.equal(codes(q), rq)
    q16, e16 = fp8.quantize_mx(x, block=16)
    rq16, re16 = ref_mx(x, 16)
    assert torch.equal(e16, re16) and torch.equal(codes(q16), rq16)
    assert q.shape == x.shape and e.shape == (6, 3)


def test_mx_scales_and_dequantize():
    codes_ = torch.arange(255, dtype=torch.uint8)
    vals = fp8.mx_scale_values(codes_)
    assert vals.tolist() == [2.0 ** (c - 127) for c in range(255)]
    if hasattr(torch, "float8_e8m0fnu"):           # torch's own e8m0 decoding agrees
        assert torch.equal(codes_.view(torch.float8_e8m0fnu).to(torch.float64), vals)
    with pytest.raises(ValueError, match="255"):
        fp8.mx_scale_values(torch.tensor([255], dtype=torch.uint8))
    x = randx((4, 70), seed=31)
    q, e = fp8.quantize_mx(x)
    d = fp8.dequantize_mx(q, e, out_dtype=torch.float64)
    want = torch.tensor(values(q)) * torch.tensor([[2.0 ** (c - 127) for c in r] for r in e.tolist()]
                                                  ).repeat_interleave(32, 1)[:, :70]
    assert torch.equal(d, want)
    with pytest.raises(ValueError, match="e must have shape"):
        fp8.dequantize_mx(q, e[:, :2])


def test_mx_error_bound_and_saturation():
    """Scaled values below 448 are within 2**-4 (relative, e4m3 normals); the floor rule lets scaled values
    reach [448, 512): those saturate to 448, relative error < 1/8."""
    g = torch.Generator().manual_seed(32)
    x = torch.randn(64, 256, generator=g)
    q, e = fp8.quantize_mx(x)
    d = fp8.dequantize_mx(q, e, out_dtype=torch.float64)
    s = fp8.mx_scale_values(e).repeat_interleave(32, 1)
    y = x.double() / s
    rel = (d - x.double()).abs() / x.double().abs()
    normal = (y.abs() >= 2.0 ** -6) & (y.abs() <= 448.0)
    sat = y.abs() > 464.0                              # past the midpoint 448..(480, not representable)
    assert rel[normal].max().item() <= 2.0 ** -4
    assert sat.any() and (q.double().abs()[sat] == 448.0).all()
    assert rel[sat].max().item() < 1 / 8 and rel[sat].max().item() > 2.0 ** -4
    assert (y.abs().reshape(64, 8, 32).amax(-1) >= 256).all() and (y.abs() < 512).all()


def test_mx_gemm():
    M, N, K = 3, 5, 80
    a = randx((M, K), seed=33, spread=6)
    b = randx((N, K), seed=34, spread=6)
    qa, ea = fp8.quantize_mx(a)
    qb, eb = fp8.quantize_mx(b)
    out = fp8.gemm_mx(qa, ea, qb, eb)
    A, B = values(qa), values(qb)
    eal, ebl = ea.tolist(), eb.tolist()
    want = []
    for m in range(M):
        row = []
        for n in range(N):
            acc = 0.0
            for kb, k0 in enumerate(range(0, K, 32)):
                part = math.fsum(A[m][k] * B[n][k] for k in range(k0, min(K, k0 + 32)))
                acc = f32(acc + f32(part * 2.0 ** (eal[m][kb] + ebl[n][kb] - 254)))
            row.append(acc)
        want.append(row)
    assert torch.equal(out, torch.tensor(want, dtype=torch.float32))
    ref = fp8.gemm_mx_f64(qa, ea, qb, eb)
    da = fp8.dequantize_mx(qa, ea, out_dtype=torch.float64)
    db = fp8.dequantize_mx(qb, eb, out_dtype=torch.float64)
    assert torch.allclose(ref, da @ db.T, rtol=1e-14, atol=0)
    bound = (3 + 2) * U32 * (da.abs() @ db.abs().T)
    assert ((out.double() - ref).abs() <= bound).all()
    assert not ((fp8.gemm_mx(qa, ea, qb, eb.flip(1)).double() - ref).abs() <= bound).all()


# --------------------------------------------------------------------------------------------------------------
# packaging


def test_fp8_imports_only_torch():
    code = ("import sys; import mokgen.fp8; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('cutlass', 'sympy', 'yaml', 'jinja2', "
            "'tvm_ffi') or m in ('mokgen.spec', 'mokgen.plan', 'mokgen.ops', 'mokgen.driver', 'mokgen.reference')); "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stdout + r.stderr


def test_spec_accepts_fp8_and_mxfp8_on_their_archs():
    from mokgen.spec import SpecError, load_spec

    base = dict(name="t", hidden=256, ffn=256, experts=8, topk=2, tokens=256, archs=["sm_90a"])
    assert load_spec(dict(base, dtype="fp8")).dtype == "fp8"
    with pytest.raises(SpecError, match=r"spec.archs\[0\]: dtype mxfp8 .* targets sm_100a, got 'sm_90a'"):
        load_spec(dict(base, dtype="mxfp8"))
    assert load_spec(dict(base, dtype="mxfp8", archs=["sm_100a"])).dtype == "mxfp8"
