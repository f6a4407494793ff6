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
