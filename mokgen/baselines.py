"""Plain-torch baselines for the MoE layer of ``docs/contract.md`` (one rank's share).

Every function here computes the SAME layer as ``mokgen.reference.forward``:

    y[t] = sum_k w[t,k] * (W2[e] a_e(x_t) + b2[e]) + sum_s (W2[s] a_s(x_t) + b2[s]),  e = topk_idx[t,k]

with ``x [T, H] bf16``, ``topk_idx [T, K] int32`` (local expert ids in ``[0, local_experts)``),
``topk_weight [T, K] fp32``, ``w1 [G, 2I, H] bf16``, ``w2 [G, H, I] bf16``, ``G = local_experts +
shared_experts`` (the shared experts are the LAST ``S`` groups, weight 1), optional ``b1 [G, 2I] fp32``,
``b2 [G, H] fp32``.

Baselines (what the benchmark compares mokgen against):

- :func:`torch_grouped_mm`: the pipeline a user has today. Stable argsort of the expert ids, ``index_select``
  gather, ``torch._grouped_mm``, SwiGLU in torch, ``torch._grouped_mm``, routing weight, ``index_add_`` into
  an fp32 output, shared experts as a dense MLP. No host synchronisation.
- :func:`torch_gemm_only`: only the two ``torch._grouped_mm`` calls on rows already permuted
  (:func:`prepare_gemm_only` builds them outside the timed region): the layer's speed if routing, gather,
  activation and combine were free.
- :func:`torch_loop`: a Python loop over experts with plain matmuls (syncs on the host; it is a baseline).
- :func:`dense_mm`: a dense bf16 matmul, the ceiling.
- :func:`dense_layer_mm`: the layer's two GEMMs as plain dense matmuls over all its rows at once (one weight
  matrix for every row: the same FLOPs as the layer, no routing, no groups); :func:`prepare_dense_layer` makes
  the operands. What cuBLAS's dense kernels would take for the layer's work.
- :func:`loop_reference`: the same layer in a wide dtype (float32/float64), a stand-in ground truth for when
  ``mokgen.reference`` is not importable.

FP8 peers (section (e); e4m3 with rowwise fp32 scales, the recipe torchao's MoE training uses on Hopper):

- :func:`torch_fp8_grouped_mm`: both GEMMs as ``torch._scaled_grouped_mm`` (2D x 3D, offs), quantization in
  plain torch, groups padded to 16 rows without a host sync, weights quantized inside the call (a training
  step) unless ``prequantized=``; ``emulate=True`` swaps the GEMM for dequantize + matmul (CPU).
  :func:`torch_fp8_grouped_mm_train` is its differentiable form (FP8 dgrad; FP8 2D x 2D or bf16 wgrad).
- :func:`prepare_fp8_gemm_only` / :func:`torch_fp8_gemm_only`: the two scaled grouped GEMMs alone.
- :func:`prepare_dense_fp8` / :func:`dense_fp8_mm`: the dense FP8 ceiling, ``torch._scaled_mm`` rowwise.
- :func:`torchao_fp8_grouped_mm`: torchao 0.18's ``_to_fp8_rowwise_then_scaled_grouped_mm`` for both GEMMs
  (lazy import; :func:`torchao_fp8_available`).

A ``spec`` argument is anything with the :class:`mokgen.spec.Spec` attributes used here (``ffn``,
``shared_experts``, ``activation``, ``swiglu_limit``, ``gate_up_layout`` and ``local_experts``, or
``experts`` and ``ep``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

__all__ = [
    "GemmOnlyInputs",
    "grouped_mm_available",
    "activation",
    "split_gate_up",
    "route",
    "torch_grouped_mm",
    "prepare_gemm_only",
    "torch_gemm_only",
    "torch_loop",
    "dense_mm",
    "DenseLayerInputs",
    "prepare_dense_layer",
    "dense_layer_mm",
    "loop_reference",
    "scaled_grouped_mm_available",
    "rowwise_scales",
    "quantize_rowwise",
    "dequantize_rowwise",
    "scaled_grouped_mm_emulated",
    "Fp8Weights",
    "quantize_weights_fp8",
    "Fp8Layout",
    "fp8_layout",
    "torch_fp8_grouped_mm",
    "group_colwise_quantize",
    "fp8_grouped_mm_train",
    "torch_fp8_grouped_mm_train",
    "Fp8GemmOnlyInputs",
    "prepare_fp8_gemm_only",
    "torch_fp8_gemm_only",
    "DenseFp8Inputs",
    "prepare_dense_fp8",
    "dense_fp8_mm",
    "torchao_fp8_available",
    "torchao_fp8_grouped_mm",
]

OAI_ALPHA = 1.702
OAI_LIMIT = 7.0


def _local_experts(spec: Any) -> int:
    le = getattr(spec, "local_experts", None)
    if le is None:
        le = spec.experts // spec.ep
    return int(le)


def _limit(spec: Any) -> float | None:
    lim = getattr(spec, "swiglu_limit", None)
    if spec.activation == "swiglu_oai" and lim is None:
        lim = OAI_LIMIT
    return None if lim is None else float(lim)


def grouped_mm_available(device: str | torch.device = "cpu") -> tuple[bool, str]:
    """Whether ``torch._grouped_mm`` runs on ``device`` with bf16 (and the reason when it does not)."""
    if not hasattr(torch, "_grouped_mm"):
        return False, f"torch {torch.__version__} has no torch._grouped_mm"
    try:
        a = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
        b = torch.ones(2, 16, 16, dtype=torch.bfloat16, device=device).transpose(-2, -1)
        offs = torch.tensor([8, 16], dtype=torch.int32, device=device)
        out = torch._grouped_mm(a, b, offs=offs)
        if out.shape != (16, 16) or float(out[0, 0]) != 16.0:
            return False, "torch._grouped_mm returned a wrong result"
    except Exception as e:  # noqa: BLE001 - any failure means "not available here"
        return False, f"torch._grouped_mm fails on {device}: {type(e).__name__}: {str(e).splitlines()[0]}"
    return True, ""


# ---------------------------------------------------------------------------------------------------------
# the activation
# ---------------------------------------------------------------------------------------------------------


def split_gate_up(h: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Split the GEMM1 output ``[..., 2I]`` into gate and up (``concat``: halves; ``interleaved``: even/odd)."""
    if layout == "concat":
        i = h.shape[-1] // 2
        return h[..., :i], h[..., i:]
    if layout == "interleaved":
        return h[..., 0::2], h[..., 1::2]
    raise ValueError(f"gate_up_layout: must be 'concat' or 'interleaved', got {layout!r}")


def activation(g: torch.Tensor, u: torch.Tensor, spec: Any) -> torch.Tensor:
    """The spec's activation on gate ``g`` and up ``u``, computed in their dtype.

    swiglu: ``silu(g) * u``; with a limit L: ``g = min(g, L)``, ``u = clamp(u, -L, L)`` first.
    swiglu_oai: ``g = min(g, 7)``, ``u = clamp(u, -7, 7)``, ``g * sigmoid(1.702 g) * (u + 1)``.
    """
    lim = _limit(spec)
    if lim is not None:
        g = g.clamp(max=lim)
        u = u.clamp(min=-lim, max=lim)
    if spec.activation == "swiglu":
        return F.silu(g) * u
    if spec.activation == "swiglu_oai":
        return g * torch.sigmoid(OAI_ALPHA * g) * (u + 1)
    raise ValueError(f"activation: must be 'swiglu' or 'swiglu_oai', got {spec.activation!r}")


def _mlp(xr: torch.Tensor, w1e: torch.Tensor, w2e: torch.Tensor, b1e, b2e, spec: Any) -> torch.Tensor:
    """One expert's MLP on rows ``xr`` with plain matmuls; returns ``W2 a + b2`` (bf16 without bias, fp32 with).

    With matching wide dtypes (``loop_reference``) everything is computed in that dtype.
    """
    h = F.linear(xr, w1e)
    if b1e is not None:
        h = h.float() + b1e if h.dtype == torch.bfloat16 else h + b1e.to(h.dtype)
    g, u = split_gate_up(h, spec.gate_up_layout)
    a = activation(g, u, spec).to(xr.dtype)
    o = F.linear(a, w2e)
    if b2e is not None:
        o = o.float() + b2e if o.dtype == torch.bfloat16 else o + b2e.to(o.dtype)
    return o


def _shared(x, w1, w2, b1, b2, spec, L: int, y32: torch.Tensor) -> None:
    """Add the shared experts (the last S groups, weight 1) to ``y32`` as dense MLPs."""
    for s in range(int(spec.shared_experts)):
        gi = L + s
        o = _mlp(x, w1[gi], w2[gi], None if b1 is None else b1[gi], None if b2 is None else b2[gi], spec)
        y32.add_(o)


# ---------------------------------------------------------------------------------------------------------
# (a) the grouped-GEMM pipeline a user has today
# ---------------------------------------------------------------------------------------------------------


def route(topk_idx: torch.Tensor, L: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routing metadata on the device, no host sync.

    Returns ``perm`` (flattened ``t*K + k`` slot of each permuted row, stable: rows of one expert in (t, k)
    order), ``sorted_e`` (the expert of each permuted row) and ``offs`` (int32 cumulative row ends, ``[L]``).
    Counts come from an integer ``scatter_add_`` (``torch.bincount`` would read the maximum on the host).
    """
    flat = topk_idx.reshape(-1).long()
    perm = torch.argsort(flat, stable=True)
    sorted_e = flat.index_select(0, perm)
    counts = torch.zeros(L, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    return perm, sorted_e, offs


def torch_grouped_mm(x, topk_idx, topk_weight, w1, w2, spec, b1=None, b2=None) -> torch.Tensor:
    """The user's pipeline: argsort, gather, ``_grouped_mm``, SwiGLU, ``_grouped_mm``, weight, ``index_add_``.

    Shared experts are a dense SwiGLU MLP added to the fp32 accumulator. Returns ``y [T, H]`` in ``x.dtype``.
    No host synchronisation (safe under ``torch.cuda.set_sync_debug_mode("error")``).
    """
    T, K = topk_idx.shape
    L = _local_experts(spec)
    perm, sorted_e, offs = route(topk_idx, L)
    tok = torch.div(perm, K, rounding_mode="floor")
    xg = x.index_select(0, tok)
    h = torch._grouped_mm(xg, w1[:L].transpose(-2, -1), offs=offs)  # [M, 2I]
    if b1 is not None:
        h = h.float() + b1.index_select(0, sorted_e)
    g, u = split_gate_up(h, spec.gate_up_layout)
    a = activation(g, u, spec).to(x.dtype)
    o = torch._grouped_mm(a, w2[:L].transpose(-2, -1), offs=offs)  # [M, H]
    w_row = topk_weight.reshape(-1).index_select(0, perm).to(torch.float32)
    if b2 is not None:
        yr = (o.float() + b2.index_select(0, sorted_e)) * w_row[:, None]
    else:
        yr = o * w_row[:, None]  # bf16 * fp32 -> fp32
    y32 = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    _shared(x, w1, w2, b1, b2, spec, L, y32)
    y32.index_add_(0, tok, yr)
    return y32.to(x.dtype)


# ---------------------------------------------------------------------------------------------------------
# (b) the two grouped GEMMs alone
# ---------------------------------------------------------------------------------------------------------


class GemmOnlyInputs(NamedTuple):
    xg: torch.Tensor  # [M, H] rows of x, permuted (routed groups, then one group of T rows per shared expert)
    hg: torch.Tensor  # [M, I] an activation-shaped input for GEMM2
    w1t: torch.Tensor  # [G, H, 2I] view of w1
    w2t: torch.Tensor  # [G, I, H] view of w2
    offs: torch.Tensor  # [G] int32 cumulative row ends


def prepare_gemm_only(x, topk_idx, w1, w2, spec, generator: torch.Generator | None = None) -> GemmOnlyInputs:
    """Set up :func:`torch_gemm_only` (outside the timed region): permuted rows with the real routing counts,
    plus ``T`` rows for each shared expert as one more group each."""
    T = x.shape[0]
    L = _local_experts(spec)
    S = int(spec.shared_experts)
    I = w2.shape[-1]
    perm, _, offs = route(topk_idx, L)
    K = topk_idx.shape[1]
    tok = torch.div(perm, K, rounding_mode="floor")
    parts = [x.index_select(0, tok)] + [x] * S
    xg = torch.cat(parts, 0).contiguous()
    routed = int(T * K)
    extra = torch.arange(1, S + 1, device=x.device, dtype=torch.int32) * T + routed
    offs = torch.cat([offs, extra]).to(torch.int32)
    hg = torch.randn(xg.shape[0], I, device=x.device, generator=generator, dtype=torch.float32)
    hg = hg.to(x.dtype)
    return GemmOnlyInputs(xg, hg, w1.transpose(-2, -1), w2.transpose(-2, -1), offs)


def torch_gemm_only(inp: GemmOnlyInputs) -> torch.Tensor:
    """Only the two ``torch._grouped_mm`` calls (GEMM1 output discarded, GEMM2 on a prepared input)."""
    h = torch._grouped_mm(inp.xg, inp.w1t, offs=inp.offs)
    o = torch._grouped_mm(inp.hg, inp.w2t, offs=inp.offs)
    return h, o


# ---------------------------------------------------------------------------------------------------------
# (c) a Python loop over experts
# ---------------------------------------------------------------------------------------------------------


def torch_loop(x, topk_idx, topk_weight, w1, w2, spec, b1=None, b2=None) -> torch.Tensor:
    """A Python loop over the local experts with plain matmuls (``nonzero`` syncs; fine for a baseline)."""
    T = x.shape[0]
    L = _local_experts(spec)
    idx = topk_idx.long()
    y32 = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    _shared(x, w1, w2, b1, b2, spec, L, y32)
    for e in range(L):
        tok, slot = torch.nonzero(idx == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        o = _mlp(x.index_select(0, tok), w1[e], w2[e], None if b1 is None else b1[e],
                 None if b2 is None else b2[e], spec)
        y32.index_add_(0, tok, o * topk_weight[tok, slot].to(torch.float32)[:, None])
    return y32.to(x.dtype)


# ---------------------------------------------------------------------------------------------------------
# (d) dense ceiling and a wide-dtype stand-in reference
# ---------------------------------------------------------------------------------------------------------


def dense_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The dense ceiling: one bf16 matmul (``a [M, K] @ b [K, N]``)."""
    return torch.mm(a, b)


class DenseLayerInputs(NamedTuple):
    x: torch.Tensor  # [rows, H]
    w1t: torch.Tensor  # [H, 2I]
    h: torch.Tensor  # [rows, I]
    w2t: torch.Tensor  # [I, H]


def prepare_dense_layer(x, w1, w2, rows: int, generator: torch.Generator | None = None) -> DenseLayerInputs:
    """Operands of :func:`dense_layer_mm`: ``rows`` rows (x repeated), group 0's weights (transposed views, as
    ``torch_gemm_only`` passes them) and a random activation-shaped input for the second GEMM."""
    reps = -(-rows // x.shape[0])
    xr = x.repeat(reps, 1)[:rows].contiguous()
    h = torch.randn(rows, w2.shape[-1], device=x.device, generator=generator, dtype=torch.float32).to(x.dtype)
    return DenseLayerInputs(xr, w1[0].transpose(0, 1), h, w2[0].transpose(0, 1))


def dense_layer_mm(inp: DenseLayerInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``x @ W1^T`` ([rows, 2I]) and ``h @ W2^T`` ([rows, H]) as two dense ``torch.mm`` calls."""
    return torch.mm(inp.x, inp.w1t), torch.mm(inp.h, inp.w2t)


def loop_reference(x, topk_idx, topk_weight, w1, w2, spec, b1=None, b2=None,
                   dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The layer computed in ``dtype`` (weights cast one expert at a time); returns ``y [T, H]`` in ``dtype``."""
    T = x.shape[0]
    L = _local_experts(spec)
    G = w1.shape[0]
    xd = x.to(dtype)
    idx = topk_idx.long()
    y = torch.zeros(T, x.shape[1], dtype=dtype, device=x.device)
    for gi in range(G):
        b1e = None if b1 is None else b1[gi].to(dtype)
        b2e = None if b2 is None else b2[gi].to(dtype)
        if gi >= L:  # shared expert: every token, weight 1
            y += _mlp(xd, w1[gi].to(dtype), w2[gi].to(dtype), b1e, b2e, spec)
            continue
        tok, slot = torch.nonzero(idx == gi, as_tuple=True)
        if tok.numel() == 0:
            continue
        o = _mlp(xd.index_select(0, tok), w1[gi].to(dtype), w2[gi].to(dtype), b1e, b2e, spec)
        y.index_add_(0, tok, o * topk_weight[tok, slot].to(dtype)[:, None])
    return y


# ---------------------------------------------------------------------------------------------------------
# (e) FP8 (e4m3, rowwise scales): torch's scaled grouped GEMM pipeline and torchao's MoE training GEMM
# ---------------------------------------------------------------------------------------------------------
#
# The recipe torchao's MoE training uses on Hopper ("FP8 rowwise"): every GEMM operand is quantized to
# float8_e4m3fn with one fp32 scale per row along the reduction dim K -- for the activations A [M, K] one scale
# per row (token), for the weights W [G, N, K] one scale per (expert, output column n) -- and the GEMM is
# ``torch._scaled_grouped_mm`` with a bf16 output.
#
# Calling convention of ``torch._scaled_grouped_mm`` (torch 2.8 .. 2.11, CUDA, sm_90 / sm_100), 2D x 3D:
#
#     out [M, N] bf16 = torch._scaled_grouped_mm(a [M, K] e4m3 row-major, b_t [G, K, N] e4m3 column-major
#                                                (= w [G, N, K] contiguous, .transpose(-2, -1)),
#                                                scale_a [M] fp32 (1-D, contiguous), scale_b [G, N] fp32,
#                                                offs=[G] int32 cumulative group END offsets,
#                                                out_dtype=torch.bfloat16, use_fast_accum=False|True)
#
# ``out[r] = scale_a[r] * scale_b[g] * (a[r] @ b_t[g])`` for the rows r of group g; K and N must be multiples of
# 16. The scales MULTIPLY (they are dequantization scales; torchao computes 448/amax and passes reciprocals).
# Group sizes: torchao documents "group sizes must be divisible by 16" for this GEMM and torchtitan pads token
# groups to 16 for FP8; torch itself does not check. We therefore pad every group to a multiple of ``align`` (16)
# rows, WITHOUT a host sync: the padded buffer has the static upper bound ``ceil16(T*K + 15*L)`` rows (plus
# ``ceil16(T)`` per shared expert), padding rows are zeros (scale 1), and the LAST routed group absorbs the
# slack up to that bound so that ``offs[-1] == rows`` (no row is outside every group; its padding rows cost at
# most ``15*L`` rows of GEMM work). ``align=1`` turns padding off (to measure whether torch needs it).

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
FP8_GROUP_ALIGN = 16


def scaled_grouped_mm_available(device: str | torch.device = "cpu") -> tuple[bool, str]:
    """Whether ``torch._scaled_grouped_mm`` (e4m3, rowwise fp32 scales, 2D x 3D) runs on ``device`` and gives a
    right answer (and the reason when it does not)."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        return False, f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    try:
        a = torch.ones(32, 32, device=device).to(E4M3)
        w = torch.ones(2, 32, 32, device=device)
        w[1] *= 2
        b = w.to(E4M3)
        sa = torch.full((32,), 0.5, device=device)
        sb = torch.full((2, 32), 2.0, device=device)
        offs = torch.tensor([16, 32], dtype=torch.int32, device=device)
        out = torch._scaled_grouped_mm(a, b.transpose(-2, -1), sa, sb, offs=offs, out_dtype=torch.bfloat16)
        if out.shape != (32, 32) or float(out[0, 0]) != 32.0 or float(out[16, 0]) != 64.0:
            return False, "torch._scaled_grouped_mm returned a wrong result"
    except Exception as e:  # noqa: BLE001 - any failure means "not available here"
        return False, (f"torch._scaled_grouped_mm fails on {device}: {type(e).__name__}: "
                       f"{(str(e).splitlines() or [''])[0][:200]}")
    return True, ""


def _pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= s (s > 0)."""
    m, e = torch.frexp(s)
    return torch.where(m == 0.5, s, torch.ldexp(torch.ones_like(s), e))


def rowwise_scales(t: torch.Tensor, pow2: bool = False) -> torch.Tensor:
    """fp32 dequantization scales of ``t`` along its last dim: ``amax / 448`` (``t.shape[:-1]``).

    All-zero rows get 1.0 (they quantize to zeros; ``mokgen.fp8``'s convention); scales are floored at 2**-126.
    ``pow2``: rounded up to a power of two (torchao's ``round_scales_to_power_of_2``: its multiplier 448/amax is
    rounded down, i.e. the scale up). No host sync; NaN/Inf are not checked (a baseline, not a reference).
    """
    amax = t.detach().abs().amax(dim=-1).to(torch.float32)
    s = torch.clamp_min(amax / E4M3_MAX, 2.0 ** -126)
    if pow2:
        s = _pow2_ceil(s)
    return torch.where(amax == 0, torch.ones_like(s), s)


def quantize_rowwise(t: torch.Tensor, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``t [..., K]`` -> ``(q [..., K] float8_e4m3fn contiguous, scale [...] fp32)`` with ``q * scale ~ t``.

    ``q = to_e4m3(clamp(t / scale, -448, 448))`` in fp32 (round to nearest even, saturating)."""
    s = rowwise_scales(t, pow2)
    q = t.detach().to(torch.float32).div(s.unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q.contiguous(), s


def dequantize_rowwise(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return q.to(dtype) * s.to(dtype).unsqueeze(-1)


def scaled_grouped_mm_emulated(a, b_t, scale_a, scale_b, offs, out_dtype: torch.dtype | None = torch.bfloat16,
                               compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What ``torch._scaled_grouped_mm`` (2D x 3D, and 2D x 2D: scales ``[G*N]`` / ``[G*K]``) computes, by dequantization and a matmul per group in
    ``compute_dtype`` (reads ``offs`` on the host: CPU tests and dry runs). Rows past ``offs[-1]`` are zeros.
    ``out_dtype=None`` keeps ``compute_dtype``."""
    if a.dim() == 2 and b_t.dim() == 2:  # 2D x 2D (a wgrad): out[g] = a[:, rows of g] @ b_t[rows of g]
        N, K = a.shape[0], b_t.shape[1]
        G = offs.shape[0]
        out = torch.zeros(G, N, K, dtype=compute_dtype, device=a.device)
        sa, sb = scale_a.reshape(G, N).to(compute_dtype), scale_b.reshape(G, K).to(compute_dtype)
        start = 0
        for g, end in enumerate(offs.tolist()):
            if end > start:
                out[g] = (a[:, start:end].to(compute_dtype) * sa[g][:, None]) @ (
                    b_t[start:end].to(compute_dtype) * sb[g][None, :])
            start = end
        return out if out_dtype is None else out.to(out_dtype)
    M, N = a.shape[0], b_t.shape[-1]
    ad = a.to(compute_dtype) * scale_a.reshape(-1).to(compute_dtype)[:, None]
    out = torch.zeros(M, N, dtype=compute_dtype, device=a.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            bg = b_t[g].to(compute_dtype) * scale_b[g].reshape(-1).to(compute_dtype)[None, :]
            out[start:end] = ad[start:end] @ bg
        start = end
    return out if out_dtype is None else out.to(out_dtype)


def _sgmm(a, b_t, sa, sb, offs, use_fast_accum: bool = False, emulate: bool = False) -> torch.Tensor:
    if emulate:
        return scaled_grouped_mm_emulated(a, b_t, sa, sb, offs)
    return torch._scaled_grouped_mm(a, b_t, sa, sb, offs=offs, out_dtype=torch.bfloat16,
                                    use_fast_accum=use_fast_accum)


class Fp8Weights(NamedTuple):
    w1q: torch.Tensor  # [G, 2I, H] e4m3, contiguous (K = H innermost)
    s1: torch.Tensor  # [G, 2I] fp32: one scale per output column of GEMM1 per expert
    w2q: torch.Tensor  # [G, H, I] e4m3, contiguous
    s2: torch.Tensor  # [G, H] fp32


def quantize_weights_fp8(w1: torch.Tensor, w2: torch.Tensor, pow2: bool = False) -> Fp8Weights:
    """Both expert weights rowwise along their K (H for w1, I for w2): what the pipeline does every forward."""
    w1q, s1 = quantize_rowwise(w1, pow2)
    w2q, s2 = quantize_rowwise(w2, pow2)
    return Fp8Weights(w1q, s1, w2q, s2)


class Fp8Layout(NamedTuple):
    """Rows of the FP8 grouped GEMMs: routed groups padded to ``align`` rows, then one group per shared expert."""

    src: torch.Tensor  # [Mp] int64 token of each padded row; T (a zero row appended to x) for padding rows
    dest: torch.Tensor  # [R] padded row of each real row (routed rows in route() order, then shared experts')
    tok: torch.Tensor  # [R] token of each real row
    expert: torch.Tensor  # [R] group of each real row
    row_group: torch.Tensor  # [Mp] group of each padded row (padding rows: some group; their output is unused)
    weight: torch.Tensor  # [R] fp32 routing weight of each real row (1 for the shared experts)
    offs: torch.Tensor  # [G] int32 cumulative padded group ends; offs[-1] == Mp


def _ceil(n: int, a: int) -> int:
    return -(-n // a) * a


def fp8_layout(topk_idx, topk_weight, L: int, S: int, align: int = FP8_GROUP_ALIGN) -> Fp8Layout:
    """The padded row layout (no host sync: the row count is the static bound ``ceil(T*K + (align-1)*L)`` plus
    ``ceil(T)`` per shared expert, ``align`` multiples; the last routed group takes the slack)."""
    T, K = topk_idx.shape
    dev = topk_idx.device
    R = T * K
    perm, sorted_e, offs = route(topk_idx, L)
    ends = offs.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (counts + (align - 1)) // align * align
    pends = torch.cumsum(padded, 0)
    pstart = pends - padded
    Rp = _ceil(R + (align - 1) * L, align) if align > 1 else R
    dest_r = torch.arange(R, device=dev) - (ends - counts).index_select(0, sorted_e) + pstart.index_select(0, sorted_e)
    tok_r = torch.div(perm, K, rounding_mode="floor")
    w_r = topk_weight.reshape(-1).index_select(0, perm).to(torch.float32)
    pends = torch.cat([pends[:-1], pends.new_full((1,), Rp)])
    Tp = _ceil(T, align) if align > 1 else T
    Mp = Rp + S * Tp
    src = torch.full((Mp,), T, dtype=torch.int64, device=dev)
    src.index_copy_(0, dest_r, tok_r)
    row_group = torch.full((Mp,), L - 1, dtype=torch.int64, device=dev)
    row_group.index_copy_(0, dest_r, sorted_e)
    ar = torch.arange(T, device=dev)
    dests, toks, experts, weights, ends_s = [dest_r], [tok_r], [sorted_e], [w_r], [pends]
    for s in range(S):
        base = Rp + s * Tp
        src[base:base + T] = ar
        row_group[base:base + Tp] = L + s
        dests.append(ar + base)
        toks.append(ar)
        experts.append(torch.full((T,), L + s, dtype=torch.int64, device=dev))
        weights.append(torch.ones(T, dtype=torch.float32, device=dev))
        ends_s.append(pends.new_full((1,), base + Tp))
    return Fp8Layout(src, torch.cat(dests), torch.cat(toks), torch.cat(experts), row_group, torch.cat(weights),
                     torch.cat(ends_s).to(torch.int32))


def _gather_fp8_rows(q: torch.Tensor, s: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``src`` of (q, s) with index ``q.shape[0]`` meaning a zero row of scale 1 (gathered as uint8 bytes)."""
    qb = torch.cat([q.view(torch.uint8), q.new_zeros(1, q.shape[1]).view(torch.uint8)])
    sx = torch.cat([s, s.new_ones(1)])
    return qb.index_select(0, src).view(E4M3), sx.index_select(0, src)


def _gather_rows(x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(1, x.shape[1])]).index_select(0, src)


def _fp8_activation(h, b1, lay: Fp8Layout, spec, dtype) -> torch.Tensor:
    if b1 is not None:
        h = h.float() + b1.index_select(0, lay.row_group)
    g, u = split_gate_up(h, spec.gate_up_layout)
    return activation(g, u, spec).to(dtype)


def _fp8_combine(o, b2, lay: Fp8Layout, T: int) -> torch.Tensor:
    orow = o.index_select(0, lay.dest)
    if b2 is not None:
        yr = (orow.float() + b2.index_select(0, lay.expert)) * lay.weight[:, None]
    else:
        yr = orow * lay.weight[:, None]  # bf16 * fp32 -> fp32
    y32 = torch.zeros(T, o.shape[1], dtype=torch.float32, device=o.device)
    y32.index_add_(0, lay.tok, yr)
    return y32


def group_colwise_quantize(t: torch.Tensor, offs: torch.Tensor, pow2: bool = False):
    """``t [M, C]`` quantized per (row group, column): the operands of a wgrad, whose reduction dim is the rows
    of one group. Returns ``(q [M, C] e4m3, scale [G, C] fp32)``; no host sync (``offs[-1] == M`` expected)."""
    M, C = t.shape
    G = offs.shape[0]
    rg = torch.searchsorted(offs.long(), torch.arange(M, device=t.device), right=True).clamp_(max=G - 1)
    ta = t.detach().abs().to(torch.float32)
    amax = torch.zeros(G, C, dtype=torch.float32, device=t.device)
    amax.scatter_reduce_(0, rg[:, None].expand(M, C), ta, reduce="amax", include_self=True)
    s = torch.clamp_min(amax / E4M3_MAX, 2.0 ** -126)
    if pow2:
        s = _pow2_ceil(s)
    s = torch.where(amax == 0, torch.ones_like(s), s)
    q = t.detach().to(torch.float32).div(s.index_select(0, rg)).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, s


def _fp8_t(q: torch.Tensor) -> torch.Tensor:
    """A contiguous transpose of a 2-D e4m3 tensor (moved as bytes)."""
    return q.view(torch.uint8).t().contiguous().view(E4M3)


class _Fp8GroupedMM(torch.autograd.Function):
    """``out [M, N] = a [M, K] @ w[g]^T`` per group (w ``[G, N, K]``), FP8 rowwise in forward and backward.

    forward: a rowwise along K, w rowwise along K; ``_scaled_grouped_mm`` 2D x 3D.
    dgrad: ``dA = dY W``: dY rowwise along N, w rowwise along N (``quantize_rowwise(w^T)``, [G, K, N]).
    wgrad ``"fp8"``: ``dW[g] = dY_g^T A_g`` as ``_scaled_grouped_mm`` 2D x 2D (``dY^T [N, M]`` row-major,
    ``A [M, K]`` column-major, per-group column scales ``[G*N]`` / ``[G*K]``: torchao's recipe); ``"bf16"``:
    ``torch._grouped_mm(a^T, dY, offs)`` in bf16 (torch's own backward of ``_grouped_mm``)."""

    @staticmethod
    def forward(ctx, a, w, offs, wgrad, pow2, use_fast_accum, emulate):
        aq, sa = quantize_rowwise(a, pow2)
        wq, sw = quantize_rowwise(w, pow2)
        ctx.save_for_backward(a, w, offs)
        ctx.cfg = (wgrad, pow2, use_fast_accum, emulate)
        return _sgmm(aq, wq.transpose(-2, -1), sa, sw, offs, use_fast_accum, emulate)

    @staticmethod
    def backward(ctx, dy):
        a, w, offs = ctx.saved_tensors
        wgrad, pow2, use_fast_accum, emulate = ctx.cfg
        dy = dy.contiguous().to(a.dtype)
        da = dw = None
        if ctx.needs_input_grad[0]:
            dq, sd = quantize_rowwise(dy, pow2)
            wtq, swt = quantize_rowwise(w.transpose(-2, -1), pow2)  # [G, K, N]: rowwise along N
            da = _sgmm(dq, wtq.transpose(-2, -1), sd, swt, offs, use_fast_accum, emulate)
        if ctx.needs_input_grad[1]:
            if wgrad == "fp8":
                dq, sd = group_colwise_quantize(dy, offs, pow2)  # [M, N], [G, N]
                aq, sa = group_colwise_quantize(a, offs, pow2)  # [M, K], [G, K]
                mat_a = _fp8_t(dq)  # [N, M] row-major
                mat_b = _fp8_t(aq).t()  # [M, K] column-major
                sa_, sb_ = sd.reshape(-1), sa.reshape(-1)
                if emulate:
                    dw = scaled_grouped_mm_emulated(mat_a, mat_b, sa_, sb_, offs)
                else:
                    dw = torch._scaled_grouped_mm(mat_a, mat_b, sa_, sb_, offs=offs, out_dtype=torch.bfloat16,
                                                  use_fast_accum=use_fast_accum)
            elif emulate:
                dw = torch.zeros_like(w)
                start = 0
                for g, end in enumerate(offs.tolist()):
                    if end > start:
                        dw[g] = (dy[start:end].float().t() @ a[start:end].float()).to(w.dtype)
                    start = end
            else:
                dw = torch._grouped_mm(a.t(), dy, offs=offs).transpose(-2, -1)
            dw = dw.to(w.dtype)
        return da, dw, None, None, None, None, None


def fp8_grouped_mm_train(a, w, offs, *, wgrad: str = "fp8", pow2: bool = False, use_fast_accum: bool = False,
                         emulate: bool = False) -> torch.Tensor:
    """Differentiable FP8 grouped GEMM (see :class:`_Fp8GroupedMM`): ``a [M, K]`` bf16 rows (groups padded to
    16, ``offs[-1] == M``), ``w [G, N, K]`` bf16 master weights; bf16 ``[M, N]``."""
    if wgrad not in ("fp8", "bf16"):
        raise ValueError(f"wgrad: 'fp8' or 'bf16', got {wgrad!r}")
    return _Fp8GroupedMM.apply(a, w, offs, wgrad, pow2, use_fast_accum, emulate)


def torch_fp8_grouped_mm_train(x, topk_idx, topk_weight, w1, w2, spec, b1=None, b2=None, *,
                               wgrad: str = "fp8", align: int = FP8_GROUP_ALIGN, pow2: bool = False,
                               use_fast_accum: bool = False, emulate: bool = False) -> torch.Tensor:
    """The training form of :func:`torch_fp8_grouped_mm`: differentiable in x, topk_weight, w1, w2, b1, b2.
    bf16 rows are gathered into the padded layout and quantized inside :func:`fp8_grouped_mm_train` (it keeps
    the bf16 operands for the backward, as torchao does); everything else is the same torch code."""
    T = topk_idx.shape[0]
    L = _local_experts(spec)
    lay = fp8_layout(topk_idx, topk_weight, L, int(spec.shared_experts), align)
    kw = dict(wgrad=wgrad, pow2=pow2, use_fast_accum=use_fast_accum, emulate=emulate)
    xp = _gather_rows(x, lay.src)
    h = fp8_grouped_mm_train(xp, w1, lay.offs, **kw)
    a = _fp8_activation(h, b1, lay, spec, x.dtype)
    o = fp8_grouped_mm_train(a, w2, lay.offs, **kw)
    w_r = lay.weight
    if topk_weight.requires_grad:  # the routing weights of the routed rows, differentiably (shared: 1)
        perm, _, _ = route(topk_idx, L)
        w_r = torch.cat([topk_weight.reshape(-1).index_select(0, perm).to(torch.float32), lay.weight[perm.numel():]])
    lay = lay._replace(weight=w_r)
    return _fp8_combine(o, b2, lay, T).to(x.dtype)


def torch_fp8_grouped_mm(x, topk_idx, topk_weight, w1, w2, spec, b1=None, b2=None, *,
                         prequantized: Fp8Weights | None = None, align: int = FP8_GROUP_ALIGN, pow2: bool = False,
                         use_fast_accum: bool = False, emulate: bool = False) -> torch.Tensor:
    """torch's FP8 MoE pipeline: the layer of :func:`torch_grouped_mm` with both GEMMs as rowwise-scaled
    ``torch._scaled_grouped_mm`` (e4m3 operands, fp32 scales, bf16 output).

    Steps: :func:`route`; x quantized rowwise ONCE per token (a row's scale does not depend on its expert), its
    fp8 rows gathered into the padded layout of :func:`fp8_layout` (routed groups padded to ``align`` rows, the
    shared experts as S more groups of T rows: one grouped GEMM covers routed and shared experts); weights
    quantized rowwise along K INSIDE the call (a training step: the master weights change every step; torchao
    does the same) unless ``prequantized`` (:func:`quantize_weights_fp8`) is given; GEMM1; b1 (fp32) and the
    activation in torch (bf16 without bias, fp32 with, as :func:`torch_grouped_mm`); the activation quantized
    rowwise; GEMM2; b2, routing weight, ``index_add_`` into fp32. No host sync (``emulate=False``).

    ``pow2``: power-of-two scales (torchao's choice); ``use_fast_accum``: the GEMMs' fast accumulation (torchao
    passes True); ``emulate``: :func:`scaled_grouped_mm_emulated` instead of the GEMM (CPU; syncs).
    Returns ``y [T, H]`` in ``x.dtype``.
    """
    T = topk_idx.shape[0]
    L = _local_experts(spec)
    S = int(spec.shared_experts)
    lay = fp8_layout(topk_idx, topk_weight, L, S, align)
    wq = prequantized if prequantized is not None else quantize_weights_fp8(w1, w2, pow2)
    xq, sx = quantize_rowwise(x, pow2)
    a1, sa1 = _gather_fp8_rows(xq, sx, lay.src)
    h = _sgmm(a1, wq.w1q.transpose(-2, -1), sa1, wq.s1, lay.offs, use_fast_accum, emulate)  # [Mp, 2I]
    a = _fp8_activation(h, b1, lay, spec, x.dtype)
    a2, sa2 = quantize_rowwise(a, pow2)
    o = _sgmm(a2, wq.w2q.transpose(-2, -1), sa2, wq.s2, lay.offs, use_fast_accum, emulate)  # [Mp, H]
    return _fp8_combine(o, b2, lay, T).to(x.dtype)


class Fp8GemmOnlyInputs(NamedTuple):
    a1: torch.Tensor  # [Mp, H] e4m3 rows of x in the padded layout
    sa1: torch.Tensor  # [Mp] fp32
    w1t: torch.Tensor  # [G, H, 2I] e4m3 column-major view
    s1: torch.Tensor  # [G, 2I]
    a2: torch.Tensor  # [Mp, I] e4m3, an activation-shaped input for GEMM2
    sa2: torch.Tensor  # [Mp]
    w2t: torch.Tensor  # [G, I, H] e4m3 column-major view
    s2: torch.Tensor  # [G, H]
    offs: torch.Tensor  # [G] int32 padded group ends


def prepare_fp8_gemm_only(x, topk_idx, w1, w2, spec, generator: torch.Generator | None = None, *,
                          align: int = FP8_GROUP_ALIGN, pow2: bool = False) -> Fp8GemmOnlyInputs:
    """Set up :func:`torch_fp8_gemm_only` outside the timed region: the pipeline's padded layout (real routing
    counts, shared experts as groups of T rows), x and a random activation quantized, the weights quantized."""
    T, K = topk_idx.shape
    L = _local_experts(spec)
    lay = fp8_layout(topk_idx, torch.ones(T, K, device=x.device), L, int(spec.shared_experts), align)
    wq = quantize_weights_fp8(w1, w2, pow2)
    xq, sx = quantize_rowwise(x, pow2)
    a1, sa1 = _gather_fp8_rows(xq, sx, lay.src)
    hg = torch.randn(a1.shape[0], w2.shape[-1], device=x.device, generator=generator, dtype=torch.float32)
    a2, sa2 = quantize_rowwise(hg.to(x.dtype), pow2)
    return Fp8GemmOnlyInputs(a1, sa1, wq.w1q.transpose(-2, -1), wq.s1, a2, sa2, wq.w2q.transpose(-2, -1), wq.s2,
                             lay.offs)


def torch_fp8_gemm_only(inp: Fp8GemmOnlyInputs, use_fast_accum: bool = False, emulate: bool = False):
    """Only the two ``torch._scaled_grouped_mm`` calls on pre-permuted, pre-quantized rows (padded layout)."""
    h = _sgmm(inp.a1, inp.w1t, inp.sa1, inp.s1, inp.offs, use_fast_accum, emulate)
    o = _sgmm(inp.a2, inp.w2t, inp.sa2, inp.s2, inp.offs, use_fast_accum, emulate)
    return h, o


class DenseFp8Inputs(NamedTuple):
    a: torch.Tensor  # [M, K] e4m3 row-major
    b_t: torch.Tensor  # [K, N] e4m3 column-major (a transposed view of [N, K])
    sa: torch.Tensor  # [M, 1] fp32
    sb: torch.Tensor  # [1, N] fp32


def prepare_dense_fp8(a: torch.Tensor, b: torch.Tensor, pow2: bool = False) -> DenseFp8Inputs:
    """Operands of :func:`dense_fp8_mm` for ``a [M, K] @ b [K, N]`` (as :func:`dense_mm` takes them), rowwise
    along K: one scale per row of a, one per column of b."""
    aq, sa = quantize_rowwise(a, pow2)
    bq, sb = quantize_rowwise(b.transpose(0, 1), pow2)  # [N, K] contiguous
    return DenseFp8Inputs(aq, bq.transpose(0, 1), sa.unsqueeze(1), sb.unsqueeze(0))


def dense_fp8_mm(inp: DenseFp8Inputs, use_fast_accum: bool = False, emulate: bool = False) -> torch.Tensor:
    """The dense FP8 ceiling: ``torch._scaled_mm(a, b_t, scale_a=[M,1], scale_b=[1,N], out_dtype=bf16)``
    (rowwise scaling; sm_90 needs a bf16 output for it)."""
    if emulate:
        return ((inp.a.float() * inp.sa) @ (inp.b_t.float() * inp.sb)).to(torch.bfloat16)
    return torch._scaled_mm(inp.a, inp.b_t, scale_a=inp.sa, scale_b=inp.sb, out_dtype=torch.bfloat16,
                            use_fast_accum=use_fast_accum)


# --- torchao ------------------------------------------------------------------------------------------------

TORCHAO_ENTRY = "torchao.prototype.moe_training._to_fp8_rowwise_then_scaled_grouped_mm"


def _torchao_fn():
    """torchao's FP8-rowwise differentiable grouped GEMM (lazy import; raises ImportError without torchao)."""
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm  # type: ignore

    return _to_fp8_rowwise_then_scaled_grouped_mm


def torchao_fp8_available(device: str | torch.device = "cuda") -> tuple[bool, str]:
    """Whether torchao's FP8 MoE training GEMM can run on ``device``: torchao importable (0.18's
    ``prototype.moe_training``), triton present (its quantization kernels), ``torch._scaled_grouped_mm`` working."""
    try:
        _torchao_fn()
        import torchao  # type: ignore

        ver = getattr(torchao, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        return False, f"import {TORCHAO_ENTRY}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
    try:
        from torch.utils._triton import has_triton

        if not has_triton():
            return False, f"torchao {ver}: triton is not available (its FP8 quantization kernels are triton)"
    except Exception:  # noqa: BLE001
        pass
    ok, why = scaled_grouped_mm_available(device)
    if not ok:
        return False, f"torchao {ver}: {why}"
    return True, ""


def torchao_fp8_grouped_mm(x, topk_idx, topk_weight, w1, w2, spec, b1=None, b2=None, *,
                           align: int = FP8_GROUP_ALIGN) -> torch.Tensor:
    """The layer with torchao's FP8 training GEMM for both expert GEMMs:
    ``_to_fp8_rowwise_then_scaled_grouped_mm(A [Mp, K] bf16, w.transpose(-2, -1), offs, out_dtype=bf16,
    pad_token_groups_for_grouped_mm=False)`` (torchao 0.18 asserts on ``=True``; the rows come already padded
    to 16 per group by :func:`fp8_layout`). torchao quantizes A and the weights itself (triton kernels,
    power-of-two rowwise scales, ``use_fast_accum=True``) on every call, and is differentiable (its backward:
    FP8 dgrad and FP8 wgrad). Routing, activation and combine are the same torch code as
    :func:`torch_fp8_grouped_mm`."""
    fn = _torchao_fn()
    T = topk_idx.shape[0]
    L = _local_experts(spec)
    lay = fp8_layout(topk_idx, topk_weight, L, int(spec.shared_experts), align)
    xp = _gather_rows(x, lay.src)
    h = fn(xp, w1.transpose(-2, -1), lay.offs, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False)
    a = _fp8_activation(h, b1, lay, spec, x.dtype)
    o = fn(a, w2.transpose(-2, -1), lay.offs, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False)
    return _fp8_combine(o, b2, lay, T).to(x.dtype)
