"""FP8 quantization ground truth in plain torch (CPU or any device): what the FP8 kernels will have to match.

The quantization kernels (templates/sm90/quant_*.py.j2, ``dtype: fp8`` specs) match the blockwise quantizers
with ``pow2=True`` bit for bit (mokgen/fp8_ops.py, tests/test_fp8_kernels.py); ``dtype: mxfp8`` specs
(sm_100a only) quantize with :func:`quantize_mx` and the packing :func:`pack_mx_scales`. The module imports only
torch (not the spec, the plan, the compiler or the runtime). Two recipes:

1. **Blockwise e4m3** (DeepSeek-V3 / DeepGEMM, Hopper; TransformerEngine's Float8BlockScaling with ``pow2=True``):
   activations and output gradients scaled per 1x128 tile along the reduction dim K (:func:`quantize_1x128`),
   weights per 128x128 block (:func:`quantize_128x128`), the weight-gradient operands per 128x1 tile along the
   rows (:func:`quantize_128x1`; the rows -- tokens -- are the reduction dim of a wgrad). The GEMMs
   (:func:`gemm_1x128_128x128`, :func:`gemm_128x1_128x1`) sum e4m3 products per 128-wide K block and promote
   each block's sum, scaled, into an fp32 accumulator.
2. **MXFP8** (OCP Microscaling, Blackwell): e4m3 elements with one e8m0 scale (a power of two, stored as its
   8-bit biased exponent in a uint8 tensor) per 32 elements along K (:func:`quantize_mx`, :func:`gemm_mx`).

Scales are kept in their logical layout (``[rows, ceil(K/128)]`` and so on, row-major, unpadded); the
TMA-aligned / transposed / swizzled layouts the kernels read are a packing step on top of these. The MXFP8 one
is here: :func:`pack_mx_scales` / :func:`unpack_mx_scales` (the "SF atom" layout of Blackwell's block-scaled
MMA, :func:`mx_sf_offset`).

Decisions (each one is checked by ``tests/test_fp8.py``):

* **Rounding.** ``y = x / s`` is computed in float32 (IEEE division, correctly rounded), clamped to
  [-448, 448] and cast with ``.to(torch.float8_e4m3fn)``, which rounds to nearest, ties to even (checked against
  an e4m3 value table built from the bit patterns). On torch 2.13 (CPU) the cast itself already saturates
  out-of-range values to +-448, +-inf included; other torch versions / devices have produced NaN on overflow, so
  the clamp is explicit and the result does not depend on it. Inputs are converted to float32 first (exact for
  bf16 / fp16 / fp32). Note the two roundings for fp32 scales: x / s to fp32, then fp32 to e4m3 (that is what a
  kernel computing in fp32 does); with power-of-two scales the division is exact.
* **Blockwise scale.** ``s = amax / 448`` in float32 (amax over the block's real elements), floored at
  ``2**-126`` (fp32's smallest normal: only blocks with ``0 < amax < 448 * 2**-126`` are affected; they keep a
  normal scale and quantize into e4m3's lower range). ``pow2=True``: ``s`` = the smallest power of two
  ``>= 2**-126`` with ``amax / s <= 448`` (then quantization only rounds the element and dequantization,
  ``q * s``, is exact in fp32).
* **All-zero blocks** get scale 1.0 (an e8m0 code of 127 for MX) and quantize to zeros: 1 is a power of two,
  dequantizes to exact zeros, and keeps the GEMM's ``sa * sb`` products clear of underflow.
* **Edge blocks.** K (and N / M for the 128-row blocks) need not be multiples of the block: the last block is
  partial and behaves exactly as if padded with zeros (zeros do not change amax); ``q`` keeps the input's shape,
  the scale tensors have ``ceil(dim / block)`` entries.
* **NaN / Inf inputs** are rejected: a ValueError naming the function, the tensor (``name=``), the element and
  its block. Propagating would be worse than useless here: amax = inf makes s = inf and turns the block into
  NaNs and zeros, and torch's cast (measured above) silently turns +-inf into +-448.
* **MXFP8 scale rule** (the OCP Microscaling Formats spec v1.0, section 6.3, "conversion from vector of scalar
  floats"; restated in our words): the block's shared exponent is floor(log2(amax)) minus the element format's
  largest normal exponent (emax = 8 for e4m3, whose largest normal 448 = 1.75 * 2**8), clamped to e8m0's range
  [-127, 127]; elements are x / 2**exp rounded to nearest-even e4m3 with saturation to +-448. With this rule
  amax / 2**exp lies in [256, 512), so elements in (464, 512) * 2**exp saturate to 448 (relative error up to
  1/8); libraries that round the scale up instead (a "ceil" rule) trade that saturation for one bit less
  resolution on the rest of the block. We implement the spec's floor rule only. The e8m0 code is exp + 127
  (0 = 2**-127, 254 = 2**127; 255, e8m0's NaN, is never produced). From finite fp32 input the exponent is
  within [-157, 119], so only the lower clamp can fire (amax < 2**-119): such blocks quantize to nearly all
  zeros.
"""

from __future__ import annotations

import torch

__all__ = [
    "E4M3",
    "E4M3_MAX",
    "E4M3_EMAX",
    "BLOCK",
    "MX_BLOCK",
    "E8M0_BIAS",
    "MIN_SCALE",
    "to_e4m3",
    "quantize_1x128",
    "quantize_128x128",
    "quantize_128x1",
    "dequantize_1x128",
    "dequantize_128x128",
    "dequantize_128x1",
    "gemm_1x128_128x128",
    "gemm_1x128_128x128_f64",
    "gemm_128x1_128x1",
    "gemm_128x1_128x1_f64",
    "round_significand",
    "quantize_mx",
    "dequantize_mx",
    "mx_scale_values",
    "gemm_mx",
    "gemm_mx_f64",
    "MX_SF_ROWS",
    "MX_SF_COLS",
    "MX_SF_ATOM",
    "mx_sf_bytes",
    "mx_sf_offset",
    "pack_mx_scales",
    "unpack_mx_scales",
]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0          # largest finite e4m3 (fn: no infinities, S.1111.111 is NaN)
E4M3_EMAX = 8             # exponent of e4m3's largest normal: 448 = 1.75 * 2**8
BLOCK = 128               # the blockwise recipe's tile along the reduction dim
MX_BLOCK = 32             # MXFP8: elements per e8m0 scale
E8M0_BIAS = 127
E8M0_MIN_EXP = -127       # code 0
E8M0_MAX_EXP = 127        # code 254 (255 is NaN)
MIN_SCALE = 2.0 ** -126   # floor of the blockwise fp32 scales
_EXACT_WINDOW = 1 << 16   # products of e4m3 pairs summed in float64 stay exact up to this many terms


# --------------------------------------------------------------------------------------------------------------
# helpers


def _as_f32(x, name: str, fn: str, min_dim: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point() or x.element_size() < 2:
        raise TypeError(f"{fn}: {name} must be a float16 / bfloat16 / float32 / float64 tensor, got {x.dtype}")
    if x.dim() < min_dim:
        raise ValueError(f"{fn}: {name} must have at least {min_dim} dims, got shape {tuple(x.shape)}")
    return x.detach().to(torch.float32)


def _check_finite(x: torch.Tensor, name: str, fn: str, block: tuple[int, ...]) -> None:
    """Raise on the first non-finite element; ``block`` gives the block extent along the trailing dims."""
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        lead = idx[: len(idx) - len(block)]
        blk = lead + tuple(i // b for i, b in zip(idx[len(lead):], block))
        shape = "x".join(str(b) for b in block)
        raise ValueError(f"{fn}: {name} has a non-finite value ({x[idx].item()}) at {list(idx)}, in {shape} "
                         f"block {blk}; FP8 quantization needs finite inputs")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block_amax(x: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """amax of |x| over (br x bc) blocks of the two trailing dims; partial edge blocks count their real elements
    only (the same as zero padding)."""
    *lead, R, C = x.shape
    nR, nC = _cdiv(R, br), _cdiv(C, bc)
    a = torch.nn.functional.pad(x.abs(), (0, nC * bc - C, 0, nR * br - R))
    return a.reshape(*lead, nR, br, nC, bc).amax(dim=(-3, -1))


def _expand(s: torch.Tensor, br: int, bc: int, R: int, C: int) -> torch.Tensor:
    return s.repeat_interleave(br, dim=-2).repeat_interleave(bc, dim=-1)[..., :R, :C]


def _pow2_at_least(s: torch.Tensor) -> torch.Tensor:
    """s = max(fp32(amax / 448), MIN_SCALE) rounded up to a power of two: the smallest power of two p >= MIN_SCALE
    with amax / p <= 448. Rounding amax / 448 to fp32 cannot move it across a power of two 2**k: from below it
    can only reach 2**k itself (still correct), and from above it cannot reach 2**k, because the fp32 amax
    nearest above 448 * 2**k is 448 * 2**k + 2**(k - 15), whose quotient 2**k * (1 + 2**-23.8) rounds up
    (tests/test_fp8.py checks the boundaries of every binade against the exact definition)."""
    m, e = torch.frexp(s)                                              # s = m * 2**e, 0.5 <= m < 1
    return torch.where(m == 0.5, s, torch.ldexp(torch.ones_like(s), e))


def _scales(amax: torch.Tensor, pow2: bool) -> torch.Tensor:
    s = torch.clamp_min(amax / E4M3_MAX, MIN_SCALE)
    if pow2:
        s = _pow2_at_least(s)
    return torch.where(amax == 0, torch.ones_like(s), s)


def to_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Round float values (already scaled) to e4m3: nearest, ties to even, saturating to +-448. NaN stays NaN."""
    return torch.clamp(y.to(torch.float32), -E4M3_MAX, E4M3_MAX).to(E4M3)


def _quantize_blocks(x, br: int, bc: int, pow2: bool, name: str, fn: str):
    x = _as_f32(x, name, fn, 2)
    _check_finite(x, name, fn, (br, bc))
    R, C = x.shape[-2:]
    s = _scales(_block_amax(x, br, bc), pow2)
    q = to_e4m3(x / _expand(s, br, bc, R, C))
    return q, s


def _dequantize_blocks(q, s, br: int, bc: int, fn: str, out_dtype):
    if not isinstance(q, torch.Tensor) or q.dtype != E4M3:
        raise TypeError(f"{fn}: q must be a float8_e4m3fn tensor, got {getattr(q, 'dtype', type(q).__name__)}")
    if q.dim() < 2:
        raise ValueError(f"{fn}: q must have at least 2 dims, got shape {tuple(q.shape)}")
    R, C = q.shape[-2:]
    want = (*q.shape[:-2], _cdiv(R, br), _cdiv(C, bc))
    if tuple(s.shape) != want:
        raise ValueError(f"{fn}: s must have shape {list(want)} for q of shape {list(q.shape)}, got {list(s.shape)}")
    return q.to(out_dtype) * _expand(s.to(out_dtype), br, bc, R, C)


# --------------------------------------------------------------------------------------------------------------
# blockwise e4m3 (DeepSeek-V3 / DeepGEMM; TransformerEngine Float8BlockScaling with pow2=True)


def quantize_1x128(x: torch.Tensor, pow2: bool = False, name: str = "x"):
    """Activations / output gradients: x [..., M, K] -> (q e4m3 [..., M, K], s fp32 [..., M, ceil(K/128)]), one
    scale per row per 128 channels of K (the reduction dim of the fprop / dgrad GEMMs); x ~= q * s."""
    return _quantize_blocks(x, 1, BLOCK, pow2, name, "quantize_1x128")


def quantize_128x128(w: torch.Tensor, pow2: bool = False, name: str = "w"):
    """Weights: w [..., N, K] -> (q e4m3 [..., N, K], s fp32 [..., ceil(N/128), ceil(K/128)]), one scale per
    128x128 block. The blocks are square, so the transposed weight of the dgrad uses (q.mT, s.mT) as is."""
    return _quantize_blocks(w, BLOCK, BLOCK, pow2, name, "quantize_128x128")


def quantize_128x1(x: torch.Tensor, pow2: bool = False, name: str = "x"):
    """Weight-gradient operands: x [..., M, K] (rows = tokens, the wgrad's reduction dim) -> (q e4m3 [..., M, K],
    s fp32 [..., ceil(M/128), K]), one scale per 128 rows per column. Equals quantize_1x128 of x.mT, transposed."""
    return _quantize_blocks(x, BLOCK, 1, pow2, name, "quantize_128x1")


def dequantize_1x128(q, s, out_dtype=torch.float32):
    """q * s for a :func:`quantize_1x128` pair (one rounding in float32 unless s is a power of two; float64 is
    exact)."""
    return _dequantize_blocks(q, s, 1, BLOCK, "dequantize_1x128", out_dtype)


def dequantize_128x128(q, s, out_dtype=torch.float32):
    """q * s for a :func:`quantize_128x128` pair."""
    return _dequantize_blocks(q, s, BLOCK, BLOCK, "dequantize_128x128", out_dtype)


def dequantize_128x1(q, s, out_dtype=torch.float32):
    """q * s for a :func:`quantize_128x1` pair."""
    return _dequantize_blocks(q, s, BLOCK, 1, "dequantize_128x1", out_dtype)


def round_significand(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Round float64 values to ``bits`` significant bits (the leading one included), nearest, ties to even; the
    exponent range is left unbounded (a model of a narrow accumulator's mantissa, not of its range)."""
    m, e = torch.frexp(x.to(torch.float64))           # x = m * 2**e, 0.5 <= |m| < 1
    return torch.round(m * float(2 ** bits)) * torch.exp2((e - bits).to(torch.float64))


def _check_gemm_operands(fn, qa, sa, qb, sb, sa_shape, sb_shape):
    for nm, q in (("qa", qa), ("qb", qb)):
        if not isinstance(q, torch.Tensor) or q.dtype != E4M3 or q.dim() != 2:
            raise TypeError(f"{fn}: {nm} must be a 2-D float8_e4m3fn tensor, got "
                            f"{getattr(q, 'dtype', type(q).__name__)} {tuple(getattr(q, 'shape', ()))}")
    for nm, s, want in (("sa", sa, sa_shape), ("sb", sb, sb_shape)):
        if tuple(s.shape) != tuple(want):
            raise ValueError(f"{fn}: {nm} must have shape {list(want)}, got {list(s.shape)}")


def _promoted_gemm(fn, qa, sa_rows, qb, sb_rows, kblock, promote_every, acc_bits):
    """out [M, N] fp32 = sum over windows w of fp32(part_w) * fp32(sa_rows[m, kb(w)] * sb_rows[n, kb(w)]),
    accumulated in fp32 in K order (a multiply, then an add: two roundings).

    qa [M, K], qb [N, K] e4m3; sa_rows [M, nKB], sb_rows [N, nKB] the scale of each row's K block. A window is
    ``promote_every`` consecutive K elements (it must divide ``kblock`` or be a multiple of it; a window over
    several K blocks needs their scales equal). part_w: with ``acc_bits=None`` the exact sum of the window's
    products (float64 is exact: every product has <= 8 significant bits in [2**-18, 2**17.7]) rounded once to
    fp32 -- an ideal accumulator, independent of summation order; with ``acc_bits=b`` the products are added in
    K order and the partial sum is rounded to b significant bits after every addition (round_significand)."""
    M, K = qa.shape
    N = qb.shape[0]
    if qb.shape[1] != K:
        raise ValueError(f"{fn}: qa and qb disagree on K: {K} vs {qb.shape[1]}")
    if not isinstance(promote_every, int) or promote_every <= 0 or (
            promote_every % kblock and kblock % promote_every):
        raise ValueError(f"{fn}: promote_every must be a positive divisor or multiple of {kblock}, "
                         f"got {promote_every!r}")
    if promote_every > _EXACT_WINDOW:
        raise ValueError(f"{fn}: promote_every must be <= {_EXACT_WINDOW}, got {promote_every}")
    if acc_bits is not None and (not isinstance(acc_bits, int) or not 2 <= acc_bits <= 24):
        raise ValueError(f"{fn}: acc_bits must be None or an int in [2, 24], got {acc_bits!r}")
    a = qa.to(torch.float64)
    b = qb.to(torch.float64)
    sa32 = sa_rows.to(torch.float32)
    sb32 = sb_rows.to(torch.float32)
    acc = torch.zeros(M, N, dtype=torch.float32)
    for k0 in range(0, K, promote_every):
        k1 = min(K, k0 + promote_every)
        kb0, kb1 = k0 // kblock, (k1 - 1) // kblock
        if kb1 > kb0 and not (bool((sa32[:, kb0:kb1 + 1] == sa32[:, kb0:kb0 + 1]).all())
                              and bool((sb32[:, kb0:kb1 + 1] == sb32[:, kb0:kb0 + 1]).all())):
            raise ValueError(f"{fn}: promote_every={promote_every} spans K blocks {kb0}..{kb1} whose scales "
                             f"differ; an accumulator can only be rescaled when it is promoted")
        if acc_bits is None:
            part = a[:, k0:k1] @ b[:, k0:k1].T
        else:
            part = torch.zeros(M, N, dtype=torch.float64)
            for k in range(k0, k1):
                part = round_significand(part + a[:, k:k + 1] * b[:, k], acc_bits)
        scale = sa32[:, kb0:kb0 + 1] * sb32[:, kb0].unsqueeze(0)        # fp32 [M, N]
        acc = acc + part.to(torch.float32) * scale
    return acc


def gemm_1x128_128x128(qa, sa, qb, sb, promote_every: int = BLOCK, acc_bits: int | None = None) -> torch.Tensor:
    """The emulated blockwise FP8 GEMM ``A [M, K] @ B [N, K]^T`` -> fp32 [M, N], as the Hopper kernel computes it.

    (qa, sa) from :func:`quantize_1x128` (sa [M, ceil(K/128)]), (qb, sb) from :func:`quantize_128x128`
    (sb [ceil(N/128), ceil(K/128)]). Per 128-wide K block (or per ``promote_every`` K elements) the e4m3
    products are summed, the sum is multiplied by ``sa[m, kb] * sb[n // 128, kb]`` and added into an fp32
    accumulator ("promotion", DeepSeek-V3 section 3.3). ``acc_bits=14`` models the Hopper FP8 tensor core's
    narrow accumulator inside a window (see :func:`_promoted_gemm` for the exact arithmetic). The dgrad
    ``dY [M, N] @ W [N, K]`` is ``gemm_1x128_128x128(q_dy, s_dy, q_w.T, s_w.T)``."""
    fn = "gemm_1x128_128x128"
    M, K = qa.shape if isinstance(qa, torch.Tensor) and qa.dim() == 2 else (0, 0)
    N = qb.shape[0] if isinstance(qb, torch.Tensor) and qb.dim() == 2 else 0
    _check_gemm_operands(fn, qa, sa, qb, sb, (M, _cdiv(K, BLOCK)), (_cdiv(N, BLOCK), _cdiv(K, BLOCK)))
    sb_rows = sb.repeat_interleave(BLOCK, dim=0)[:N]
    return _promoted_gemm(fn, qa, sa, qb, sb_rows, BLOCK, promote_every, acc_bits)


def gemm_1x128_128x128_f64(qa, sa, qb, sb) -> torch.Tensor:
    """The float64 reference of :func:`gemm_1x128_128x128`: dequantize both operands exactly, multiply."""
    return dequantize_1x128(qa, sa, torch.float64) @ dequantize_128x128(qb, sb, torch.float64).T


def gemm_128x1_128x1(qa, sa, qb, sb, promote_every: int = BLOCK, acc_bits: int | None = None) -> torch.Tensor:
    """The emulated wgrad ``A [M, N]^T @ B [M, K]`` -> fp32 [N, K] (M = tokens, the reduction dim): both operands
    from :func:`quantize_128x1` (sa [ceil(M/128), N], sb [ceil(M/128), K]); per 128 rows the products are summed
    and promoted with ``sa[mb, n] * sb[mb, k]``, as in :func:`gemm_1x128_128x128`."""
    fn = "gemm_128x1_128x1"
    M, N = qa.shape if isinstance(qa, torch.Tensor) and qa.dim() == 2 else (0, 0)
    K = qb.shape[1] if isinstance(qb, torch.Tensor) and qb.dim() == 2 else 0
    _check_gemm_operands(fn, qa, sa, qb, sb, (_cdiv(M, BLOCK), N), (_cdiv(M, BLOCK), K))
    if qb.shape[0] != M:
        raise ValueError(f"{fn}: qa and qb disagree on M (rows): {M} vs {qb.shape[0]}")
    return _promoted_gemm(fn, qa.T, sa.T, qb.T, sb.T, BLOCK, promote_every, acc_bits)


def gemm_128x1_128x1_f64(qa, sa, qb, sb) -> torch.Tensor:
    """The float64 reference of :func:`gemm_128x1_128x1`."""
    return dequantize_128x1(qa, sa, torch.float64).T @ dequantize_128x1(qb, sb, torch.float64)


# --------------------------------------------------------------------------------------------------------------
# MXFP8 (OCP Microscaling: e4m3 elements, one e8m0 scale per 32 along the last dim)


def quantize_mx(x: torch.Tensor, block: int = MX_BLOCK, name: str = "x"):
    """x [..., K] -> (q e4m3 [..., K], e uint8 [..., ceil(K/block)]): e is the e8m0 code (biased exponent) of the
    block's scale 2**(e - 127), chosen by the OCP MX v1.0 rule (module docstring); x ~= q * 2**(e - 127)."""
    fn = "quantize_mx"
    if not isinstance(block, int) or block <= 0:
        raise ValueError(f"{fn}: block must be a positive int, got {block!r}")
    x = _as_f32(x, name, fn, 1)
    x2 = x.unsqueeze(-2)                                               # [..., 1, K]: reuse the 2-D blocking
    _check_finite(x, name, fn, (block,))
    amax = _block_amax(x2, 1, block).squeeze(-2)                       # [..., nKB]
    _, e = torch.frexp(amax)                                           # amax = m * 2**e, m in [0.5, 1)
    exp = torch.clamp(e - 1 - E4M3_EMAX, E8M0_MIN_EXP, E8M0_MAX_EXP)  # floor(log2(amax)) - emax, clamped
    exp = torch.where(amax == 0, torch.zeros_like(exp), exp)
    scale = torch.exp2(exp.to(torch.float64))                          # 2**-127 .. 2**127: exact in float64
    K = x.shape[-1]
    y = (x.to(torch.float64) / scale.repeat_interleave(block, dim=-1)[..., :K]).to(torch.float32)
    return to_e4m3(y), (exp + E8M0_BIAS).to(torch.uint8)


def mx_scale_values(e: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """The scales 2**(e - 127) of e8m0 codes (uint8); code 255 (e8m0's NaN) is rejected."""
    if not isinstance(e, torch.Tensor) or e.dtype != torch.uint8:
        raise TypeError(f"mx_scale_values: e must be a uint8 tensor of e8m0 codes, got {getattr(e, 'dtype', e)}")
    if bool((e == 255).any()):
        raise ValueError("mx_scale_values: e8m0 code 255 is NaN")
    return torch.exp2(e.to(torch.float64) - E8M0_BIAS).to(dtype)


def dequantize_mx(q, e, block: int = MX_BLOCK, out_dtype=torch.float32):
    """q * 2**(e - 127) for a :func:`quantize_mx` pair (computed in float64, exact, then cast to out_dtype)."""
    fn = "dequantize_mx"
    if not isinstance(q, torch.Tensor) or q.dtype != E4M3 or q.dim() < 1:
        raise TypeError(f"{fn}: q must be a float8_e4m3fn tensor, got {getattr(q, 'dtype', type(q).__name__)}")
    K = q.shape[-1]
    want = (*q.shape[:-1], _cdiv(K, block))
    if tuple(e.shape) != want:
        raise ValueError(f"{fn}: e must have shape {list(want)} for q of shape {list(q.shape)}, got {list(e.shape)}")
    s = mx_scale_values(e).repeat_interleave(block, dim=-1)[..., :K]
    return (q.to(torch.float64) * s).to(out_dtype)


def gemm_mx(qa, ea, qb, eb, block: int = MX_BLOCK) -> torch.Tensor:
    """The emulated block-scaled GEMM ``A [M, K] @ B [N, K]^T`` -> fp32 [M, N] on :func:`quantize_mx` operands.

    Per ``block`` K elements: the exact sum of the e4m3 products times 2**(ea + eb - 254), rounded once to fp32
    and added into an fp32 accumulator in K order. Blackwell's block-scaled MMA applies the scales inside the
    tensor core; its internal order and precision are not public, so this is the ideal-accumulator model and a
    kernel is compared with it within a tolerance, not bit for bit."""
    fn = "gemm_mx"
    M, K = qa.shape if isinstance(qa, torch.Tensor) and qa.dim() == 2 else (0, 0)
    N = qb.shape[0] if isinstance(qb, torch.Tensor) and qb.dim() == 2 else 0
    _check_gemm_operands(fn, qa, ea, qb, eb, (M, _cdiv(K, block)), (N, _cdiv(K, block)))
    if qb.shape[1] != K:
        raise ValueError(f"{fn}: qa and qb disagree on K: {K} vs {qb.shape[1]}")
    a = qa.to(torch.float64)
    b = qb.to(torch.float64)
    sa = mx_scale_values(ea)
    sb = mx_scale_values(eb)
    acc = torch.zeros(M, N, dtype=torch.float32)
    for kb, k0 in enumerate(range(0, K, block)):
        k1 = min(K, k0 + block)
        part = (a[:, k0:k1] @ b[:, k0:k1].T) * (sa[:, kb:kb + 1] * sb[:, kb].unsqueeze(0))
        acc = acc + part.to(torch.float32)
    return acc


def gemm_mx_f64(qa, ea, qb, eb, block: int = MX_BLOCK) -> torch.Tensor:
    """The float64 reference of :func:`gemm_mx` on the exactly dequantized operands."""
    return dequantize_mx(qa, ea, block, torch.float64) @ dequantize_mx(qb, eb, block, torch.float64).T


# --------------------------------------------------------------------------------------------------------------
# the MXFP8 scale-factor layout of Blackwell's block-scaled MMA (tcgen05.mma ... kind::mxf8f6f4.block_scale)
#
# The MMA reads its e8m0 scales from tensor memory, where tcgen05.cp copies them from shared memory, where TMA
# loads them from global memory in 512-byte "SF atoms": one atom holds the scales of 128 rows (of A's M or B's N)
# times 4 consecutive 32-element K blocks (128 elements of K). Inside an atom, row r (0 <= r < 128) and K block
# j (0 <= j < 4) sit at byte (r % 32) * 16 + (r // 32) * 4 + j: the four 32-row quarters interleaved 4 bytes
# apart, so each 16-byte line holds rows r, r + 32, r + 64, r + 96 (the layout cutlass.utils.blockscaled_layout's
# BlockScaledBasicChunk describes, ((32, 4), (32, 4)) : ((16, 4), (0, 1)) over (rows, K elements), and the PTX
# ISA's "scale factor A / B layout" for a scale vector of 32). Atoms are laid out K-fastest: the atom of row
# block rb and K-block group kg starts at byte (rb * ceil(KB / 4) + kg) * 512 (tile_atom_to_shape_SF's order
# (2, 1, 3)); a batch (an expert's weights) is the next ceil(R / 128) * ceil(KB / 4) atoms. Rows and K blocks
# past the logical ones pad the last atoms (their bytes are a fill code, 127 = scale 1.0 by default: the MMA
# multiplies them with TMA's zero fill of the out-of-bounds operand elements).

MX_SF_ROWS = 128          # rows per SF atom
MX_SF_COLS = 4            # 32-element K blocks per SF atom
MX_SF_ATOM = MX_SF_ROWS * MX_SF_COLS   # bytes per SF atom


def mx_sf_bytes(rows: int, kblocks: int) -> int:
    """Bytes of the packed scales of one [rows, kblocks] matrix (whole atoms: padded to 128 rows x 4 blocks)."""
    return _cdiv(rows, MX_SF_ROWS) * _cdiv(kblocks, MX_SF_COLS) * MX_SF_ATOM


def mx_sf_offset(r, kb, kblocks: int):
    """Byte offset of the scale of row ``r``, K block ``kb`` in the packed layout of a matrix with ``kblocks``
    K blocks (ints or integer tensors, broadcast): the address arithmetic of the quantize kernels
    (templates/sm100/quant_mx.py.j2), the layout the block-scaled GEMMs' TMA reads."""
    groups = _cdiv(kblocks, MX_SF_COLS)
    return (((r // MX_SF_ROWS) * groups + kb // MX_SF_COLS) * MX_SF_ATOM
            + (r % 32) * 16 + ((r % MX_SF_ROWS) // 32) * 4 + kb % MX_SF_COLS)


def pack_mx_scales(e: torch.Tensor, fill: int = E8M0_BIAS) -> torch.Tensor:
    """e8m0 codes in their logical layout, uint8 ``[..., R, KB]`` (KB = ceil(K / 32), :func:`quantize_mx`'s),
    -> the SF-atom byte layout the block-scaled MMA reads, uint8 ``[..., mx_sf_bytes(R, KB)]``, every leading
    index (a batch: an expert) packed on its own; padding rows / blocks get ``fill`` (not 255: e8m0's NaN)."""
    fn = "pack_mx_scales"
    if not isinstance(e, torch.Tensor) or e.dtype != torch.uint8 or e.dim() < 2:
        raise TypeError(f"{fn}: e must be a uint8 tensor of e8m0 codes with at least 2 dims, got "
                        f"{getattr(e, 'dtype', type(e).__name__)} {tuple(getattr(e, 'shape', ()))}")
    if not isinstance(fill, int) or not 0 <= fill <= 254:
        raise ValueError(f"{fn}: fill must be an e8m0 code in [0, 254], got {fill!r}")
    *lead, R, KB = e.shape
    nR, nG = _cdiv(R, MX_SF_ROWS), _cdiv(KB, MX_SF_COLS)
    p = torch.full((*lead, nR * MX_SF_ROWS, nG * MX_SF_COLS), fill, dtype=torch.uint8, device=e.device)
    p[..., :R, :KB] = e
    # (rb, q, r32, kg, j) -> (rb, kg, r32, q, j): row = rb * 128 + q * 32 + r32, block = kg * 4 + j
    p = p.reshape(*lead, nR, 4, 32, nG, MX_SF_COLS)
    n = len(lead)
    p = p.permute(*range(n), n, n + 3, n + 2, n + 1, n + 4)
    return p.reshape(*lead, nR * nG * MX_SF_ATOM).contiguous()


def unpack_mx_scales(packed: torch.Tensor, rows: int, kblocks: int) -> torch.Tensor:
    """The inverse of :func:`pack_mx_scales`: uint8 ``[..., mx_sf_bytes(rows, kblocks)]`` -> ``[..., rows,
    kblocks]`` (the padding dropped)."""
    fn = "unpack_mx_scales"
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() < 1:
        raise TypeError(f"{fn}: packed must be a uint8 tensor, got {getattr(packed, 'dtype', type(packed).__name__)}")
    if rows < 0 or kblocks < 0 or packed.shape[-1] != mx_sf_bytes(rows, kblocks):
        raise ValueError(f"{fn}: a [{rows}, {kblocks}] matrix packs into {mx_sf_bytes(rows, kblocks)} bytes, got "
                         f"{packed.shape[-1]}")
    *lead, _ = packed.shape
    nR, nG = _cdiv(rows, MX_SF_ROWS), _cdiv(kblocks, MX_SF_COLS)
    n = len(lead)
    p = packed.reshape(*lead, nR, nG, 32, 4, MX_SF_COLS).permute(*range(n), n, n + 3, n + 2, n + 1, n + 4)
    return p.reshape(*lead, nR * MX_SF_ROWS, nG * MX_SF_COLS)[..., :rows, :kblocks].contiguous()
