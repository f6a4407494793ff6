"""The MoE layer in plain torch: the ground truth every test compares against.

Everything here follows ``docs/contract.md`` ("The layer the kernels compute"):

* inputs ``x [T, H]``, ``topk_idx [T, K]`` (local expert ids), ``topk_weight [T, K]``,
  ``w1 [G, 2I, H]``, ``w2 [G, H, I]``, optional ``b1 [G, 2I]``, ``b2 [G, H]``; G = local experts + shared
  experts, the shared experts being the LAST S groups (every token visits each, weight 1);
* ``w1`` layout "concat" (rows [0, I) gate, [I, 2I) up) or "interleaved" (row 2j gate_j, 2j+1 up_j);
* activations: ``swiglu`` a = silu(g) * u; ``swiglu`` with a limit L: g = min(g, L), u = clamp(u, -L, L);
  ``swiglu_oai``: g = min(g, L), u = clamp(u, -L, L) (L = 7 unless the spec says otherwise),
  a = g * sigmoid(1.702 g) * (u + 1). Biases are added to g / u before the clamp.
* ``y[t] = sum_k w[t,k] * (W2[e] a_e(x_t) + b2[e]) + sum_s (W2[s] a_s(x_t) + b2[s])``, e = idx[t, k].

A slot whose expert id is out of range (< 0 or >= local experts) contributes nothing here, exactly like the
kernels, which drop it (``slot_pos = -1``) and raise the routing error flag.

The module has four parts:

1. :func:`forward` / :func:`backward` / :func:`backward_autograd`: the layer's math, computed in ``dtype``
   (float64 by default) after upcasting every input.
2. :func:`random_inputs`: inputs with the distributions the tests use, several routing patterns.
3. :func:`rel_err`: ``||a - b|| / ||b||``.
4. ``ref_routing`` / ``ref_gemm1`` / ``ref_gemm2`` / ``ref_combine`` (and :func:`reference_kernels`): each
   device kernel's contract (workspace layout included) executed in torch, with the kernels' exact argument
   lists. They let the runtime (``mokgen.ops``) be tested on a CPU, and let a kernel author compare one kernel's
   workspace output against its reference on the GPU.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple

import torch

__all__ = [
    "LayerConfig",
    "layer_config",
    "forward",
    "backward",
    "backward_autograd",
    "forward_mx",
    "backward_mx",
    "Grads",
    "MoEInputs",
    "random_inputs",
    "ROUTING_MODES",
    "rel_err",
    "ref_routing",
    "ref_gather",
    "ref_gemm1",
    "ref_gemm2",
    "ref_combine",
    "reference_kernels",
]

OAI_ALPHA = 1.702
OAI_DEFAULT_LIMIT = 7.0
ROUTING_MODES = ("random", "one_expert", "skewed", "empty_experts")


# --------------------------------------------------------------------------------------------------------------
# configuration


@dataclass(frozen=True)
class LayerConfig:
    """The fields of a :class:`mokgen.spec.Spec` that the layer's math needs (duck-typed, so a Spec, a mapping or
    any object with these attributes works; missing optional fields take the defaults below)."""

    hidden: int = 0
    ffn: int = 0
    experts: int = 0
    topk: int = 0
    ep: int = 1
    tokens: int = 0
    shared_experts: int = 0
    activation: str = "swiglu"
    swiglu_limit: float | None = None
    gate_up_layout: str = "concat"
    bias: bool = False
    dtype: str = "bf16"   # "fp8": the forward GEMMs read e4m3 operands with blockwise scales (gemm*_fp8 tables);
    #                       "mxfp8": e4m3 with e8m0 codes per 32 along K, packed (gemm*_mx tables, sm_100a)

    @property
    def local_experts(self) -> int:
        return self.experts // self.ep

    @property
    def groups(self) -> int:
        return self.local_experts + self.shared_experts

    @property
    def limit(self) -> float | None:
        """The clamp actually applied: swiglu_oai always clamps (7.0 unless the spec sets a limit)."""
        if self.activation == "swiglu_oai":
            return OAI_DEFAULT_LIMIT if self.swiglu_limit is None else float(self.swiglu_limit)
        return None if self.swiglu_limit is None else float(self.swiglu_limit)


_FIELDS = tuple(LayerConfig.__dataclass_fields__)


def layer_config(spec_or_cfg: Any) -> LayerConfig:
    """Normalize a Spec, a preset name / YAML path, a mapping, or an attribute object into a LayerConfig."""
    if isinstance(spec_or_cfg, LayerConfig):
        return spec_or_cfg
    if isinstance(spec_or_cfg, (str, os.PathLike)):
        from .spec import load_spec  # lazy: the spec module is only needed for names and files

        spec_or_cfg = load_spec(spec_or_cfg)
    if isinstance(spec_or_cfg, Mapping):
        get = spec_or_cfg.get
    else:
        def get(name, default=None, _o=spec_or_cfg):
            return getattr(_o, name, default)
    kw = {}
    for f in _FIELDS:
        v = get(f, None)
        if v is not None:
            kw[f] = v
    cfg = LayerConfig(**kw)
    if cfg.activation not in ("swiglu", "swiglu_oai"):
        raise ValueError(f"activation: must be 'swiglu' or 'swiglu_oai', got {cfg.activation!r}")
    if cfg.gate_up_layout not in ("concat", "interleaved"):
        raise ValueError(f"gate_up_layout: must be 'concat' or 'interleaved', got {cfg.gate_up_layout!r}")
    return cfg


# --------------------------------------------------------------------------------------------------------------
# the layer's math


def _split_gate_up(z: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    if layout == "interleaved":
        return z[:, 0::2], z[:, 1::2]
    i = z.shape[1] // 2
    return z[:, :i], z[:, i:]


def _merge_gate_up(dg: torch.Tensor, du: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "interleaved":
        return torch.stack((dg, du), dim=-1).reshape(dg.shape[0], 2 * dg.shape[1])
    return torch.cat((dg, du), dim=1)


def _activation(g: torch.Tensor, u: torch.Tensor, cfg: LayerConfig) -> torch.Tensor:
    """a(g, u) for pre-activations that already include b1 (clamps applied here)."""
    lim = cfg.limit
    if lim is not None:
        g = torch.clamp(g, max=lim)
        u = torch.clamp(u, min=-lim, max=lim)
    if cfg.activation == "swiglu_oai":
        return g * torch.sigmoid(OAI_ALPHA * g) * (u + 1.0)
    return torch.nn.functional.silu(g) * u


def _activation_backward(g_raw: torch.Tensor, u_raw: torch.Tensor, da: torch.Tensor, cfg: LayerConfig):
    """(a, dg_raw, du_raw) given da = dL/da; derivative of the clamps follows torch.clamp (inclusive bounds)."""
    lim = cfg.limit
    if lim is not None:
        g = torch.clamp(g_raw, max=lim)
        u = torch.clamp(u_raw, min=-lim, max=lim)
        mg = (g_raw <= lim).to(da.dtype)
        mu = ((u_raw >= -lim) & (u_raw <= lim)).to(da.dtype)
    else:
        g, u, mg, mu = g_raw, u_raw, None, None
    if cfg.activation == "swiglu_oai":
        s = torch.sigmoid(OAI_ALPHA * g)
        glu = g * s                                   # g * sigmoid(alpha g)
        a = glu * (u + 1.0)
        dglu = s + OAI_ALPHA * glu * (1.0 - s)        # d/dg [g sigmoid(alpha g)]
        dg = da * dglu * (u + 1.0)
        du = da * glu
    else:
        s = torch.sigmoid(g)
        silu = g * s
        a = silu * u
        dg = da * u * s * (1.0 + g * (1.0 - s))       # silu'(g) = s (1 + g (1 - s))
        du = da * silu
    if mg is not None:
        dg = dg * mg
        du = du * mu
    return a, dg, du


def _check_shapes(x, topk_idx, topk_weight, w1, w2, b1, b2, cfg: LayerConfig):
    if x.dim() != 2 or w1.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"expected x [T,H], w1 [G,2I,H], w2 [G,H,I]; got {tuple(x.shape)}, "
                         f"{tuple(w1.shape)}, {tuple(w2.shape)}")
    T, H = x.shape
    G, I2, H1 = w1.shape
    I = I2 // 2
    if H1 != H or tuple(w2.shape) != (G, H, I) or I2 != 2 * I:
        raise ValueError(f"inconsistent shapes: x {tuple(x.shape)}, w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != T or tuple(topk_weight.shape) != tuple(topk_idx.shape):
        raise ValueError(f"topk_idx / topk_weight must be [T={T}, K]; got {tuple(topk_idx.shape)}, "
                         f"{tuple(topk_weight.shape)}")
    S = cfg.shared_experts
    if not 0 <= S <= G:
        raise ValueError(f"shared_experts={S} but w1 has only {G} groups")
    if b1 is not None and tuple(b1.shape) != (G, I2):
        raise ValueError(f"b1 must be [{G}, {I2}], got {tuple(b1.shape)}")
    if b2 is not None and tuple(b2.shape) != (G, H):
        raise ValueError(f"b2 must be [{G}, {H}], got {tuple(b2.shape)}")
    return T, H, G, I, topk_idx.shape[1], G - S, S


def _routed_groups(topk_idx: torch.Tensor, E: int):
    """Yield (group, flat slot ids) for each local expert with at least one valid slot, slots in (t, k) order.
    One host sync (the counts)."""
    flat = topk_idx.reshape(-1).long()
    key = torch.where((flat >= 0) & (flat < E), flat, torch.full_like(flat, E))
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=E + 1).tolist()
    start = 0
    for e in range(E):
        n = counts[e]
        if n:
            yield e, order[start:start + n]
        start += n


def _expert_forward(xg, g, w1, w2, b1, b2, cfg, dtype):
    z = xg @ w1[g].to(dtype).t()
    if b1 is not None:
        z = z + b1[g].to(dtype)
    gate, up = _split_gate_up(z, cfg.gate_up_layout)
    a = _activation(gate, up, cfg)
    o = a @ w2[g].to(dtype).t()
    if b2 is not None:
        o = o + b2[g].to(dtype)
    return o


def forward(x, topk_idx, topk_weight, w1, w2, spec_or_cfg, b1=None, b2=None, dtype=torch.float64,
            out_dtype=None) -> torch.Tensor:
    """y [T, H] computed in ``dtype`` (every input upcast first), returned in ``out_dtype`` (default: ``dtype``).

    Differentiable (autograd flows to x, topk_weight, w1, w2, b1, b2). Weights are upcast one group at a time,
    so memory stays near one float64 expert. One host sync (the per-expert counts).
    """
    cfg = layer_config(spec_or_cfg)
    T, H, G, I, K, E, S = _check_shapes(x, topk_idx, topk_weight, w1, w2, b1, b2, cfg)
    xd = x.to(dtype)
    wflat = topk_weight.reshape(-1).to(dtype)
    y = torch.zeros(T, H, dtype=dtype, device=x.device)
    if T:
        for e, slots in _routed_groups(topk_idx, E):
            t = torch.div(slots, K, rounding_mode="floor")
            o = _expert_forward(xd[t], e, w1, w2, b1, b2, cfg, dtype)
            y = y.index_add(0, t, o * wflat[slots].unsqueeze(1))
        for s in range(S):
            y = y + _expert_forward(xd, E + s, w1, w2, b1, b2, cfg, dtype)
    return y.to(out_dtype or dtype)


def forward_fp8(x, topk_idx, topk_weight, w1, w2, spec_or_cfg, b1=None, b2=None, dtype=torch.float64,
                out_dtype=None) -> torch.Tensor:
    """The FP8 forward's ground truth (spec dtype "fp8"), in ``dtype``: what the e4m3 kernels compute up to their
    fp32 accumulation order. x is quantized per 1 x 128 and the weights per 128 x 128 (power-of-two scales,
    :mod:`mokgen.fp8`), the layer runs on the dequantized values, and between the GEMMs h is rounded to bf16 and
    quantized per 1 x 128 (as the kernels store h and quantize it for GEMM 2). Not differentiable."""
    from . import fp8

    cfg = layer_config(spec_or_cfg)
    T, H, G, I, K, E, S = _check_shapes(x, topk_idx, topk_weight, w1, w2, b1, b2, cfg)
    q, sx = fp8.quantize_1x128(x.float(), pow2=True)
    xd = fp8.dequantize_1x128(q, sx, out_dtype=dtype)
    w1d = torch.stack([fp8.dequantize_128x128(*fp8.quantize_128x128(w1[g].float(), pow2=True), out_dtype=dtype)
                       for g in range(G)])
    w2d = torch.stack([fp8.dequantize_128x128(*fp8.quantize_128x128(w2[g].float(), pow2=True), out_dtype=dtype)
                       for g in range(G)])

    def expert(xg, g):
        z = xg @ w1d[g].t()
        if b1 is not None:
            z = z + b1[g].to(dtype)
        gate, up = _split_gate_up(z, cfg.gate_up_layout)
        h = _activation(gate, up, cfg).to(torch.bfloat16).float()
        hd = fp8.dequantize_1x128(*fp8.quantize_1x128(h, pow2=True), out_dtype=dtype)
        o = hd @ w2d[g].t()
        if b2 is not None:
            o = o + b2[g].to(dtype)
        return o

    wflat = topk_weight.reshape(-1).to(dtype)
    y = torch.zeros(T, H, dtype=dtype, device=x.device)
    if T:
        for e, slots in _routed_groups(topk_idx, E):
            t = torch.div(slots, K, rounding_mode="floor")
            y = y.index_add(0, t, expert(xd[t], e) * wflat[slots].unsqueeze(1))
        for s_ in range(S):
            y = y + expert(xd, E + s_)
    return y.to(out_dtype or dtype)


def _mx_values(t: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """t quantized by mokgen.fp8.quantize_mx along its last dim (32-blocks), dequantized exactly in ``dtype``."""
    from . import fp8

    return fp8.dequantize_mx(*fp8.quantize_mx(t), out_dtype=dtype)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(t.dtype)


def _mx_operands(x, w1, w2, dtype):
    """x, W1, W2 dequantized from their MXFP8 forward forms (32-blocks along H, H, I: rows of each)."""
    return _mx_values(x, dtype), _mx_values(w1, dtype), _mx_values(w2, dtype)


def forward_mx(x, topk_idx, topk_weight, w1, w2, spec_or_cfg, b1=None, b2=None, dtype=torch.float64,
               out_dtype=None) -> torch.Tensor:
    """The MXFP8 forward's ground truth (spec dtype "mxfp8"), in ``dtype``: x's rows and the weights' rows
    quantized by :func:`mokgen.fp8.quantize_mx` (32-blocks along K) and dequantized exactly, the layer run on those
    values; between the GEMMs h is rounded to bf16 and quantized along I (the kernels store h in bf16 and
    quant_mx_used quantizes it). What the MXFP8 kernels compute up to their accumulation order. Not
    differentiable (:func:`backward_mx` is its training step's reference)."""
    cfg = layer_config(spec_or_cfg)
    T, H, G, I, K, E, S = _check_shapes(x, topk_idx, topk_weight, w1, w2, b1, b2, cfg)
    xd, w1d, w2d = _mx_operands(x, w1, w2, dtype)

    def expert(xg, g):
        z = xg @ w1d[g].t()
        if b1 is not None:
            z = z + b1[g].to(dtype)
        gate, up = _split_gate_up(z, cfg.gate_up_layout)
        o = _mx_values(_bf16(_activation(gate, up, cfg)), dtype) @ w2d[g].t()
        if b2 is not None:
            o = o + b2[g].to(dtype)
        return o

    wflat = topk_weight.reshape(-1).to(dtype)
    y = torch.zeros(T, H, dtype=dtype, device=x.device)
    if T:
        for e, slots in _routed_groups(topk_idx, E):
            t = torch.div(slots, K, rounding_mode="floor")
            y = y.index_add(0, t, expert(xd[t], e) * wflat[slots].unsqueeze(1))
        for s_ in range(S):
            y = y + expert(xd, E + s_)
    return y.to(out_dtype or dtype)


class Grads(NamedTuple):
    x: torch.Tensor
    topk_weight: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    b1: torch.Tensor | None
    b2: torch.Tensor | None


def backward(dy, x, topk_idx, topk_weight, w1, w2, spec_or_cfg, b1=None, b2=None,
             dtype=torch.float64) -> Grads:
    """Hand-written backward of :func:`forward` (all grads in ``dtype``), the math the backward kernels will use.

    Per routed slot (t, k) with expert e, writing z = W1[e] x_t + b1[e] (split into gate g / up u), a = act(z),
    w = topk_weight[t, k]:

    * dA' = dy_t W2[e]                (the down-projection's dgrad, *before* the routing weight)
    * dS[t, k] = <dA', a> + <dy_t, b2[e]>      (SonicMoE: <dy_t, W2 a + b2> without materializing W2 a)
    * dA = w dA';  dz = act'(z) * dA (clamp masks included);  dx_t += dz W1[e]
    * dW1[e] += dz^T x_t, db1[e] += dz;  dW2[e] += (w dy_t)^T a, db2[e] += w dy_t
    Shared experts: the same with w = 1 and no dS. Out-of-range slots get dS = 0.
    """
    cfg = layer_config(spec_or_cfg)
    T, H, G, I, K, E, S = _check_shapes(x, topk_idx, topk_weight, w1, w2, b1, b2, cfg)
    dev = x.device
    xd, dyd = x.to(dtype), dy.to(dtype)
    wflat = topk_weight.reshape(-1).to(dtype)
    dx = torch.zeros(T, H, dtype=dtype, device=dev)
    dS = torch.zeros(T * K, dtype=dtype, device=dev)
    dw1 = torch.zeros(G, 2 * I, H, dtype=dtype, device=dev)
    dw2 = torch.zeros(G, H, I, dtype=dtype, device=dev)
    db1 = torch.zeros(G, 2 * I, dtype=dtype, device=dev) if b1 is not None else None
    db2 = torch.zeros(G, H, dtype=dtype, device=dev) if b2 is not None else None

    def one_group(g, t, w):
        """w: routing weights of the rows (None for a shared expert). Returns dS of the rows (or None)."""
        xg = xd if t is None else xd[t]
        dyg = dyd if t is None else dyd[t]
        W1, W2 = w1[g].to(dtype), w2[g].to(dtype)
        z = xg @ W1.t()
        if b1 is not None:
            z = z + b1[g].to(dtype)
        g_raw, u_raw = _split_gate_up(z, cfg.gate_up_layout)
        dAp = dyg @ W2                                         # [n, I]
        dA = dAp if w is None else dAp * w.unsqueeze(1)
        a, dg, du = _activation_backward(g_raw, u_raw, dA, cfg)
        dz = _merge_gate_up(dg, du, cfg.gate_up_layout)        # [n, 2I]
        dxg = dz @ W1
        if t is None:
            dx.add_(dxg)
        else:
            dx.index_add_(0, t, dxg)
        dw1[g] += dz.t() @ xg
        dyw = dyg if w is None else dyg * w.unsqueeze(1)
        dw2[g] += dyw.t() @ a
        if db1 is not None:
            db1[g] += dz.sum(0)
        if db2 is not None:
            db2[g] += dyw.sum(0)
        if w is None:
            return None
        ds = (dAp * a).sum(1)
        if b2 is not None:
            ds = ds + dyg @ b2[g].to(dtype)
        return ds

    if T:
        for e, slots in _routed_groups(topk_idx, E):
            t = torch.div(slots, K, rounding_mode="floor")
            dS[slots] = one_group(e, t, wflat[slots])
        for s in range(S):
            one_group(E + s, None, None)
    return Grads(dx, dS.reshape(T, K), dw1, dw2, db1, db2)


def _mx_cols(t: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """t [n, C] quantized in 32-row blocks down each column (rows padded with zeros to a multiple of 32: a group's
    padding rows, which quantize as zero), dequantized exactly in ``dtype``, the padding dropped."""
    n = t.shape[0]
    pad = torch.cat([t, t.new_zeros((-n % 32, t.shape[1]))]) if n % 32 else t
    return _mx_values(pad.t(), dtype).t()[:n]


def backward_mx(dy, x, topk_idx, topk_weight, w1, w2, spec_or_cfg, b1=None, b2=None,
                dtype=torch.float64, mx_wgrads: tuple[str, ...] = ()) -> Grads:
    """The MXFP8 training step's ground truth (spec dtype "mxfp8"), in ``dtype``: the gradients the MXFP8
    kernels compute, up to their accumulation order. Per routed slot (t, k) of expert e, weight w:

    * the forward on the MXFP8 operands (:func:`forward_mx`): z = Q(x_t) Q(W1[e])^T + b1, stored in bf16 (gemm1_train
      writes z in bf16; the backward reads it);
    * dgrad1: dA' = Q(dy_t) Qc(W2[e]) (dO's row quantized along H; W2 quantized in 32-blocks down its columns, along
      H: quant_mx_w2_cols); dz = act'(z) * w dA', stored in bf16; dS = <dA', a>;
    * dgrad2: dx_t += Q(dz) Qc(W1[e]) (dz quantized along 2I; W1 in 32-blocks along 2I in the spec's layout);
    * the BF16 weight gradients on the bf16 tensors: dW2[e] += dy_t^T bf16(w a), dW1[e] += dz^T x_t; db1 += dz,
      db2 += w dy_t; ``mx_wgrads`` (plan ``wgrad*_dtype=mxfp8``): those named on the operands quantized in 32-row
      blocks down each column, the expert's rows in token order from its first (Qr: :func:`_mx_cols`):
      dW1[e] = Qr(dz)^T Qr(x_e), dW2[e] = Qr(dy_e)^T Qr(bf16(w a)).

    Q: quantize_mx along the last dim then dequantize, exactly; Qc: the same down the columns. Shared experts as
    in :func:`backward` (w = 1, no dS)."""
    cfg = layer_config(spec_or_cfg)
    T, H, G, I, K, E, S = _check_shapes(x, topk_idx, topk_weight, w1, w2, b1, b2, cfg)
    dev = x.device
    xq, w1q, _ = _mx_operands(x, w1, w2, dtype)
    xb, dyb = x.to(dtype), dy.to(dtype)
    dyq = _mx_values(dy, dtype)
    w2c = _mx_values(w2.transpose(1, 2), dtype).transpose(1, 2)            # [G, H, I], blocks along H
    w1c = _mx_values(w1.transpose(1, 2), dtype).transpose(1, 2)            # [G, 2I, H], blocks along 2I
    wflat = topk_weight.reshape(-1).to(dtype)
    dx = torch.zeros(T, H, dtype=dtype, device=dev)
    dS = torch.zeros(T * K, dtype=dtype, device=dev)
    dw1 = torch.zeros(G, 2 * I, H, dtype=dtype, device=dev)
    dw2 = torch.zeros(G, H, I, dtype=dtype, device=dev)
    db1 = torch.zeros(G, 2 * I, dtype=dtype, device=dev) if b1 is not None else None
    db2 = torch.zeros(G, H, dtype=dtype, device=dev) if b2 is not None else None

    def one_group(g, t, w):
        sel = (lambda v: v) if t is None else (lambda v: v[t])
        z = sel(xq) @ w1q[g].t()
        if b1 is not None:
            z = z + b1[g].to(dtype)
        g_raw, u_raw = _split_gate_up(_bf16(z), cfg.gate_up_layout)
        dAp = sel(dyq) @ w2c[g]                                             # [n, I]
        dA = dAp if w is None else dAp * w.unsqueeze(1)
        a, dg, du = _activation_backward(g_raw, u_raw, dA, cfg)
        dz = _bf16(_merge_gate_up(dg, du, cfg.gate_up_layout))              # [n, 2I]
        dxg = _mx_values(dz, dtype) @ w1c[g]
        if t is None:
            dx.add_(dxg)
        else:
            dx.index_add_(0, t, dxg)
        dw1[g] += (_mx_cols(dz, dtype).t() @ _mx_cols(sel(xb), dtype) if "wgrad1" in mx_wgrads
                   else dz.t() @ sel(xb))
        sa = _bf16(a if w is None else a * w.unsqueeze(1))
        dw2[g] += (_mx_cols(sel(dyb), dtype).t() @ _mx_cols(sa, dtype) if "wgrad2" in mx_wgrads
                   else sel(dyb).t() @ sa)
        if db1 is not None:
            db1[g] += dz.sum(0)
        if db2 is not None:
            db2[g] += (sel(dyb) if w is None else sel(dyb) * w.unsqueeze(1)).sum(0)
        if w is None:
            return None
        ds = (dAp * a).sum(1)
        if b2 is not None:
            ds = ds + sel(dyb) @ b2[g].to(dtype)
        return ds

    if T:
        for e, slots in _routed_groups(topk_idx, E):
            t = torch.div(slots, K, rounding_mode="floor")
            dS[slots] = one_group(e, t, wflat[slots])
        for s in range(S):
            one_group(E + s, None, None)
    return Grads(dx, dS.reshape(T, K), dw1, dw2, db1, db2)


def backward_autograd(dy, x, topk_idx, topk_weight, w1, w2, spec_or_cfg, b1=None, b2=None,
                      dtype=torch.float64) -> Grads:
    """The same grads as :func:`backward`, by autograd through :func:`forward` (the check on the hand-written one)."""
    leaves = [t.detach().to(dtype).requires_grad_(True) if t is not None else None
              for t in (x, topk_weight, w1, w2, b1, b2)]
    xl, wl, w1l, w2l, b1l, b2l = leaves
    y = forward(xl, topk_idx, wl, w1l, w2l, spec_or_cfg, b1l, b2l, dtype=dtype)
    inputs = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(y, inputs, dy.to(dtype), allow_unused=True)
    it = iter(grads)
    out = []
    for leaf in leaves:
        if leaf is None:
            out.append(None)
        else:
            g = next(it)
            out.append(torch.zeros_like(leaf) if g is None else g)
    return Grads(*out)


# --------------------------------------------------------------------------------------------------------------
# inputs


class MoEInputs(NamedTuple):
    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weight: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    b1: torch.Tensor | None
    b2: torch.Tensor | None


def _sample_idx(T: int, K: int, pool: torch.Tensor, probs: torch.Tensor | None, gen, device) -> torch.Tensor:
    """[T, K] ids drawn from ``pool`` (distinct per token when K <= len(pool), else with replacement)."""
    n = pool.numel()
    if T == 0:
        return torch.zeros(0, K, dtype=torch.int32, device=device)
    if probs is None:
        if K <= n:
            pick = torch.rand(T, n, generator=gen, device=device).argsort(dim=1)[:, :K]
        else:
            pick = torch.randint(0, n, (T, K), generator=gen, device=device)
    else:
        p = probs.to(device=device, dtype=torch.float32).expand(T, n).contiguous()
        pick = torch.multinomial(p, K, replacement=K > n, generator=gen)
    return pool.to(device)[pick].to(torch.int32).contiguous()


def random_inputs(spec, tokens: int | None = None, device: str | torch.device = "cpu", seed: int = 0,
                  routing: str = "random") -> MoEInputs:
    """Random inputs for one rank's layer.

    x ~ N(0, 1); w1 ~ N(0, 1/H), w2 ~ N(0, 1/I) (bf16); b1, b2 ~ N(0, 0.1^2) fp32 when ``spec.bias``;
    topk_weight = softmax over the K slots of N(0, 1) logits (fp32, positive, rows sum to 1).
    topk_idx int32 local expert ids, by ``routing``:

    * ``random``: uniform; distinct experts per token when K <= local experts, else sampled with replacement
      (the ep > 1 case where one rank holds fewer experts than K);
    * ``one_expert``: every (t, k) slot goes to the LAST local expert: one group of T*K rows, all others empty;
    * ``skewed``: Zipf-like popularity (p_e ~ 1/(rank+1)^1.2 over a random expert order);
    * ``empty_experts``: only odd-numbered experts receive tokens (expert 0 and every even one stay empty).
    """
    if routing not in ROUTING_MODES:
        raise ValueError(f"routing must be one of {ROUTING_MODES}, got {routing!r}")
    cfg = layer_config(spec)
    T = cfg.tokens if tokens is None else int(tokens)
    H, I, K, E, G = cfg.hidden, cfg.ffn, cfg.topk, cfg.local_experts, cfg.groups
    if min(H, I, K, E) <= 0:
        raise ValueError(f"spec needs positive hidden, ffn, topk and local experts; got {cfg}")
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    bf = torch.bfloat16

    x = torch.randn(T, H, generator=gen, device=device, dtype=bf)
    w1 = torch.randn(G, 2 * I, H, generator=gen, device=device, dtype=bf).mul_(1.0 / math.sqrt(H))
    w2 = torch.randn(G, H, I, generator=gen, device=device, dtype=bf).mul_(1.0 / math.sqrt(I))
    b1 = b2 = None
    if cfg.bias:
        b1 = torch.randn(G, 2 * I, generator=gen, device=device, dtype=torch.float32).mul_(0.1)
        b2 = torch.randn(G, H, generator=gen, device=device, dtype=torch.float32).mul_(0.1)

    experts = torch.arange(E, dtype=torch.int64)
    if routing == "random":
        idx = _sample_idx(T, K, experts, None, gen, device)
    elif routing == "one_expert":
        idx = torch.full((T, K), E - 1, dtype=torch.int32, device=device)
    elif routing == "skewed":
        perm = torch.randperm(E, generator=torch.Generator().manual_seed(seed))
        probs = torch.empty(E)
        probs[perm] = 1.0 / torch.arange(1, E + 1, dtype=torch.float32) ** 1.2
        idx = _sample_idx(T, K, experts, probs / probs.sum(), gen, device)
    else:  # empty_experts
        pool = experts[1::2] if E > 1 else experts
        idx = _sample_idx(T, K, pool, None, gen, device)
    logits = torch.randn(T, K, generator=gen, device=device, dtype=torch.float32)
    topk_weight = torch.softmax(logits, dim=1).contiguous()
    return MoEInputs(x, idx, topk_weight, w1, w2, b1, b2)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| accumulated in float64 a slab of rows at a time (one float64 copy of gpt-oss-120b's w1,
    2.1e9 elements, would be 17 GB); the absolute ||a - b|| when b is all zeros; NaN if either holds a NaN."""
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch {tuple(a.shape)} vs {tuple(b.shape)}")
    a2 = a.detach().reshape(a.shape[0] if a.dim() > 1 else 1, -1)
    b2 = b.detach().reshape(a2.shape)
    step = max(1, (1 << 25) // max(1, a2.shape[1]))
    num = torch.zeros((), dtype=torch.float64, device=a.device)
    den = torch.zeros((), dtype=torch.float64, device=a.device)
    for i in range(0, a2.shape[0], step):
        ai, bi = a2[i:i + step].to(torch.float64), b2[i:i + step].to(torch.float64)
        num += (ai - bi).square().sum()
        den += bi.square().sum()
    num, den = math.sqrt(num.item()), math.sqrt(den.item())
    return num / den if den > 0 else num


# --------------------------------------------------------------------------------------------------------------
# reference kernels: the device workspace contract executed in torch (docs/contract.md, "Device workspace")


def ref_routing(topk_idx, topk_weight, row_src, row_w, tile_group, meta, slot_pos, *, local_experts: int,
                shared_experts: int, bm: int) -> None:
    """Fill the workspace like the ``routing`` kernel.

    Padded permuted row space: group g gets ceil(count_g / bm) * bm rows, groups in order 0..G-1, rows inside a
    group in (t, k) order; shared group E+s holds every token in t order. Writes, for the used rows only,
    ``row_src`` (token, padding 0) and ``row_w`` (weight, padding 0, shared 1); all of ``tile_group`` (group of
    each used M tile, -1 after); ``slot_pos [T, K+S]`` (row of each slot, -1 for an out-of-range id);
    ``meta[0]`` = used tiles. ``meta[1]`` is only ever SET to 1 (on an out-of-range id), never cleared: the
    runtime owns clearing it, which makes it a sticky error flag. meta[2], meta[3] are left alone.
    """
    E, S = local_experts, shared_experts
    G = E + S
    T, K = topk_idx.shape
    dev = row_src.device
    flat = topk_idx.reshape(-1).to(dev).long()
    valid = (flat >= 0) & (flat < E)
    if not bool(valid.all()):
        meta[1] = 1
    key = torch.where(valid, flat, torch.full_like(flat, E))
    order = torch.argsort(key, stable=True)
    counts_e = torch.bincount(key, minlength=E + 1)                           # [E+1], last = invalid
    counts = torch.cat([counts_e[:E], torch.full((S,), T, dtype=counts_e.dtype, device=dev)])
    padded = (counts + bm - 1) // bm * bm
    offsets = torch.cumsum(padded, 0) - padded                               # [G]
    used = int(padded.sum())
    if used > row_src.numel() or used // bm > tile_group.numel():
        raise RuntimeError(f"workspace too small: {used} rows needed, {row_src.numel()} allocated")

    row_src[:used] = 0
    row_w[:used] = 0
    slot_pos.fill_(-1)
    # routed slots: rank inside the group = position in the stable sort minus the group's start
    sorted_key = key[order]
    start = torch.cumsum(counts_e, 0) - counts_e
    rank = torch.arange(T * K, device=dev) - start[sorted_key]
    ok = sorted_key < E
    dest = offsets[sorted_key[ok]] + rank[ok]
    src_slots = order[ok]
    sp = torch.full((T * K,), -1, dtype=torch.int64, device=dev)
    sp[src_slots] = dest
    slot_pos[:, :K] = sp.reshape(T, K).to(slot_pos.dtype)
    row_src[dest] = torch.div(src_slots, K, rounding_mode="floor").to(row_src.dtype)
    row_w[dest] = topk_weight.reshape(-1).to(dev)[src_slots].to(row_w.dtype)
    # shared experts
    tok = torch.arange(T, device=dev)
    for s in range(S):
        d = offsets[E + s] + tok
        slot_pos[:, K + s] = d.to(slot_pos.dtype)
        row_src[d] = tok.to(row_src.dtype)
        row_w[d] = 1.0
    tile_group.fill_(-1)
    tiles = torch.repeat_interleave(torch.arange(G, device=dev), padded // bm)
    tile_group[:tiles.numel()] = tiles.to(tile_group.dtype)
    meta[0] = used // bm


def _used_group_tiles(tile_group, meta, bm):
    """[(group, first row, end row)] of the used M tiles (consecutive tiles of one group merged)."""
    n = int(meta[0])
    tg = tile_group[:n].tolist()
    out, m = [], 0
    while m < n:
        g, m0 = tg[m], m
        while m < n and tg[m] == g:
            m += 1
        out.append((g, m0 * bm, m * bm))
    return out


def ref_gather(x, row_src, meta, xg, *, bm: int) -> None:
    """xg[r] = x[row_src[r]] for the used rows (the optional ``gather`` kernel of plans whose GEMM 1 loads A
    by TMA)."""
    n = int(meta[0]) * bm
    xg[:n] = x[row_src[:n].long()]


def ref_gemm1(x, w1, b1, row_src, tile_group, meta, h, num_ctas, *, cfg: LayerConfig, bm: int,
              gathered: bool = False) -> None:
    """h[r] = act(W1[g] x[row_src[r]] + b1[g]) for the used rows (fp32 math, bf16 store); padding rows
    gather token 0 like the kernel. With ``gathered=True`` the first argument is ``xg`` (rows already
    gathered: A[r] is used as is). ``num_ctas`` must not change the result (ignored here)."""
    for g, r0, r1 in _used_group_tiles(tile_group, meta, bm):
        xs = (x[r0:r1] if gathered else x[row_src[r0:r1].long()]).float()
        z = xs @ w1[g].float().t()
        if cfg.bias:
            z = z + b1[g].float()
        gate, up = _split_gate_up(z, cfg.gate_up_layout)
        h[r0:r1] = _activation(gate, up, cfg).to(h.dtype)


def ref_gemm2(h, w2, b2, row_w, tile_group, meta, ys, num_ctas, *, cfg: LayerConfig, bm: int) -> None:
    """ys[r] = row_w[r] * (W2[g] h[r] + b2[g]) for the used rows (fp32 math, bf16 store; padding rows -> 0)."""
    for g, r0, r1 in _used_group_tiles(tile_group, meta, bm):
        o = h[r0:r1].float() @ w2[g].float().t()
        if cfg.bias:
            o = o + b2[g].float()
        ys[r0:r1] = (o * row_w[r0:r1].float().unsqueeze(1)).to(ys.dtype)


def dequantize_rows(q, s) -> torch.Tensor:
    """float32 values of e4m3 rows ``q [R, K]`` (their bytes, uint8) with 1 x 128 scales ``s [R, K / 128]``."""
    v = q.view(torch.float8_e4m3fn).float()
    return v * s.float().repeat_interleave(128, dim=-1)[..., :v.shape[-1]]


def dequantize_weights(q, s) -> torch.Tensor:
    """float32 values of e4m3 weights ``q [G, N, K]`` (bytes) with 128 x 128 block scales ``s [G, N/128, K/128]``."""
    v = q.view(torch.float8_e4m3fn).float()
    e = s.float().repeat_interleave(128, dim=-2).repeat_interleave(128, dim=-1)
    return v * e[..., :v.shape[-2], :v.shape[-1]]


def ref_gemm1_fp8(a, w, bias, row, tile_group, meta, sa, sb, out, num_ctas, *, cfg: LayerConfig, bm: int,
                  z=None, tokens: bool = False) -> None:
    """The FP8 GEMM 1 (table ``gemm1_fp8`` / ``gemm1_train_fp8``): :func:`ref_gemm1` (or, with ``z``,
    :func:`ref_gemm1_train`) on the dequantized operands; A holds the gathered rows (quant_rows_gather's q), of
    which the used ones are read, or with ``tokens`` (the inference GEMM 1 of plan gemm1.a_load "gather") the
    token rows (quant_rows' q), gathered through ``row`` as the BF16 GEMM 1 gathers x."""
    if (a.shape[0] == row.shape[0]) == tokens:   # the padded row space has more rows than there are tokens
        raise ValueError(f"ref_gemm1_fp8: a has {a.shape[0]} rows for a padded row space of {row.shape[0]}: "
                         + ("token rows, but this GEMM 1 was bound to read gathered rows (reference_kernels' "
                            "fp8_a_gather names the GEMM 1 kernels that gather)" if not tokens else
                            "gathered rows, but this GEMM 1 was bound to gather token rows (fp8_a_gather)"))
    wd = dequantize_weights(w, sb)
    n = int(meta[0]) * bm
    xd = dequantize_rows(a, sa) if tokens else dequantize_rows(a[:n], sa[:n])
    if z is None:
        ref_gemm1(xd, wd, bias, row, tile_group, meta, out, num_ctas, cfg=cfg, bm=bm, gathered=not tokens)
    else:
        ref_gemm1_train(xd, wd, bias, row, tile_group, meta, out, z, num_ctas, cfg=cfg, bm=bm, gathered=not tokens)


def ref_gemm2_fp8(a, w, bias, row, tile_group, meta, sa, sb, out, num_ctas, *, cfg: LayerConfig, bm: int) -> None:
    """The FP8 GEMM 2 (table ``gemm2_fp8``): :func:`ref_gemm2` on the dequantized h rows and W2."""
    ref_gemm2(dequantize_rows(a, sa), dequantize_weights(w, sb), bias, row, tile_group, meta, out, num_ctas,
              cfg=cfg, bm=bm)


def ref_dgrad1_fp8(a, w, bias, row, tile_group, meta, sa, sb, out, z, dz, ds, num_ctas, *, cfg: LayerConfig,
                   bm: int) -> None:
    """The FP8 dgrad1 (table ``dgrad1_fp8``): :func:`ref_dgrad1` on the dequantized gathered dO rows and W2 (``w``
    is W2's transposed copy [G, I, H])."""
    n = int(meta[0]) * bm
    ref_dgrad1(dequantize_rows(a[:n], sa[:n]), dequantize_weights(w, sb).transpose(1, 2), bias, row, tile_group,
               meta, out, z, dz, ds, num_ctas, cfg=cfg, bm=bm)


def ref_dgrad2_fp8(a, w, bias, row, tile_group, meta, sa, sb, out, num_ctas, *, bm: int) -> None:
    """The FP8 dgrad2 (table ``dgrad2_fp8``): :func:`ref_dgrad2` on the dequantized dz rows and W1 (``w`` is W1's
    transposed copy [G, H, 2I])."""
    n = int(meta[0]) * bm
    ref_dgrad2(dequantize_rows(a[:n], sa[:n]), dequantize_weights(w, sb).transpose(1, 2), bias, row, tile_group,
               meta, out, num_ctas, bm=bm)


def _concat_to_layout(w: torch.Tensor, layout: str) -> torch.Tensor:
    """W1 rows in concat order [G, 2I, K] (gate n, then up n: quant_mx_w1's order) -> the spec's gate / up layout."""
    if layout != "interleaved":
        return w
    G, I2, K = w.shape
    return torch.stack((w[:, :I2 // 2], w[:, I2 // 2:]), dim=2).reshape(G, I2, K)


def ref_gemm1_mx(a, w, bias, row, tile_group, meta, sfa, sfw, out, num_ctas, *, cfg: LayerConfig, bm: int,
                 z=None) -> None:
    """The MXFP8 GEMM 1 (table ``gemm1_mx`` / ``gemm1_train_mx``): :func:`ref_gemm1` (with ``z``,
    :func:`ref_gemm1_train`) in float32 on the dequantized packed operands: A = the gathered rows quant_mx_gather
    wrote (its used rows, their codes read at mx_sf_offset), W1 = quant_mx_w1's bits in concat order with codes
    packed per (group, part), put back in the spec's gate / up layout (the bias and z keep that layout)."""
    from .mx_ops import dequantize_rows as dq_rows, dequantize_w

    n = int(meta[0]) * bm
    xd = dq_rows(a, sfa, n)
    wd = _concat_to_layout(dequantize_w(w, sfw, parts=2), cfg.gate_up_layout)
    if z is None:
        ref_gemm1(xd, wd, bias, row, tile_group, meta, out, num_ctas, cfg=cfg, bm=bm, gathered=True)
    else:
        ref_gemm1_train(xd, wd, bias, row, tile_group, meta, out, z, num_ctas, cfg=cfg, bm=bm, gathered=True)


def ref_gemm2_mx(a, w, bias, row, tile_group, meta, sfa, sfw, out, num_ctas, *, cfg: LayerConfig, bm: int) -> None:
    """The MXFP8 GEMM 2 (table ``gemm2_mx``): :func:`ref_gemm2` on the dequantized h rows (quant_mx_used) and W2
    (quant_mx_w2)."""
    from .mx_ops import dequantize_rows as dq_rows, dequantize_w

    n = int(meta[0]) * bm
    ref_gemm2(dq_rows(a, sfa, n), dequantize_w(w, sfw, parts=1), bias, row, tile_group, meta, out, num_ctas,
              cfg=cfg, bm=bm)


def ref_dgrad1_mx(a, w, bias, row, tile_group, meta, sfa, sfw, out, z, dz, ds, num_ctas, *, cfg: LayerConfig,
                  bm: int) -> None:
    """The MXFP8 dgrad1 (table ``dgrad1_mx``): :func:`ref_dgrad1` on the dequantized dO rows (quant_mx_gather) and
    W2's column form ``w`` [G, H, I] (quant_mx_w2_cols: 32-blocks along H, dgrad1's K)."""
    from .mx_ops import dequantize_rows as dq_rows, dequantize_w_cols

    n = int(meta[0]) * bm
    ref_dgrad1(dq_rows(a, sfa, n), dequantize_w_cols(w, sfw), bias, row, tile_group, meta, out, z, dz, ds,
               num_ctas, cfg=cfg, bm=bm)


def ref_dgrad2_mx(a, w, bias, row, tile_group, meta, sfa, sfw, out, num_ctas, *, bm: int) -> None:
    """The MXFP8 dgrad2 (table ``dgrad2_mx``): :func:`ref_dgrad2` on the dequantized dz rows (quant_mx_dz) and
    W1's column form ``w`` [G, 2I, H] (quant_mx_w1_cols, the spec's layout: 32-blocks along 2I, dgrad2's K)."""
    from .mx_ops import dequantize_rows as dq_rows, dequantize_w_cols

    n = int(meta[0]) * bm
    ref_dgrad2(dq_rows(a, sfa, n), dequantize_w_cols(w, sfw), bias, row, tile_group, meta, out, num_ctas, bm=bm)


def ref_combine(ys, slot_pos, y) -> None:
    """y[t] = sum_j ys[slot_pos[t, j]] over j = 0..K+S-1 in that order, fp32 accumulation, slots < 0 skipped."""
    T, J = slot_pos.shape
    acc = torch.zeros(T, ys.shape[1], dtype=torch.float32, device=ys.device)
    for j in range(J):
        p = slot_pos[:, j].long()
        v = ys[p.clamp(min=0)].float()
        acc += torch.where((p >= 0).unsqueeze(1), v, torch.zeros_like(v))
    y.copy_(acc.to(y.dtype))


def ref_gemm1_train(x, w1, b1, row_src, tile_group, meta, h, z, num_ctas, *, cfg: LayerConfig, bm: int,
                    gathered: bool = False) -> None:
    """As :func:`ref_gemm1`, and z[r] = W1[g] x[row_src[r]] + b1[g] (bf16, W1's row order) for the used rows."""
    for g, r0, r1 in _used_group_tiles(tile_group, meta, bm):
        xs = (x[r0:r1] if gathered else x[row_src[r0:r1].long()]).float()
        zz = xs @ w1[g].float().t()
        if cfg.bias:
            zz = zz + b1[g].float()
        z[r0:r1] = zz.to(z.dtype)
        gate, up = _split_gate_up(zz, cfg.gate_up_layout)
        h[r0:r1] = _activation(gate, up, cfg).to(h.dtype)


def ref_dgrad1(dog, w2, b2, row_w, tile_group, meta, sa, z, dz, ds, num_ctas, *, cfg: LayerConfig,
               bm: int) -> None:
    """For the used rows r of group g, with dA' = dO_g[r] W2[g] (fp32) and s = row_w[r]: dz[r] = act'(z[r]) * s dA'
    (W1's row order), sa[r] = s * act(z[r]), and ds[r, n] = sum of dA' * a over dgrad1's N tile n (ds has one
    column per N tile)."""
    I = cfg.ffn
    n_tiles = ds.shape[1]
    for g, r0, r1 in _used_group_tiles(tile_group, meta, bm):
        dap = dog[r0:r1].float() @ w2[g].float()
        s = row_w[r0:r1].float().unsqueeze(1)
        gate, up = _split_gate_up(z[r0:r1].float(), cfg.gate_up_layout)
        a, dg, du = _activation_backward(gate, up, dap * s, cfg)
        dz[r0:r1] = _merge_gate_up(dg, du, cfg.gate_up_layout).to(dz.dtype)
        sa[r0:r1] = (a * s).to(sa.dtype)
        ds[r0:r1] = (dap * a).view(r1 - r0, n_tiles, I // n_tiles).sum(2)


def ref_dgrad2(dz, w1, b1, row_w, tile_group, meta, out, num_ctas, *, bm: int) -> None:
    """out[r] = dz[r] W1[g] (bf16 store) for the used rows: the per-slot rows of dx."""
    for g, r0, r1 in _used_group_tiles(tile_group, meta, bm):
        out[r0:r1] = (dz[r0:r1].float() @ w1[g].float()).to(out.dtype)


def ref_wgrad(a, b, group_start, out, num_ctas, *, accumulate: bool = False) -> None:
    """out[g] (=, or += in fp32 when ``accumulate``) sum over rows r in [group_start[g], group_start[g+1]) of
    a[r]ᵀ b[r] (fp32 math)."""
    gs = group_start.tolist()
    for g in range(len(gs) - 1):
        r0, r1 = gs[g], gs[g + 1]
        val = a[r0:r1].float().t() @ b[r0:r1].float()
        if accumulate:
            out[g] += val
        else:
            out[g] = val.to(out.dtype)


def ref_wgrad_fp8(a, sa, b, sb, group_start, out, num_ctas, *, accumulate: bool = False) -> None:
    """The FP8 weight gradient (tables ``wgrad*_fp8`` / ``wgrad*_acc_fp8``): out[g] (=, or += in fp32) the sum
    over the group's 128-row blocks kb of (the block's e4m3 products summed exactly, rounded to fp32) times
    sa[kb, m] sb[kb, n], added in block order in fp32 -- the kernel's per-block promotion with an ideal block
    accumulator (mokgen.fp8.gemm_128x1_128x1's arithmetic). a [M, rows] / b [N, rows]: e4m3 bits transposed
    (quant_cols*), sa [rows / 128, M] / sb [rows / 128, N] their scales; any device."""
    from . import fp8

    gs = group_start.tolist()
    qa, qb = a.view(fp8.E4M3), b.view(fp8.E4M3)
    for g in range(len(gs) - 1):
        r0, r1 = gs[g], gs[g + 1]
        val = torch.zeros(out.shape[1:], dtype=torch.float32, device=out.device)
        for k0 in range(r0, r1, fp8.BLOCK):
            kb = k0 // fp8.BLOCK
            part = (qa[:, k0:k0 + fp8.BLOCK].double() @ qb[:, k0:k0 + fp8.BLOCK].double().T).float()
            val = val + (part * sa[kb].float().unsqueeze(1)) * sb[kb].float().unsqueeze(0)
        if accumulate:
            out[g] += val
        else:
            out[g] = val.to(out.dtype)


def ref_wgrad_mx(a, sfa, b, sfb, group_start, out, num_ctas, *, accumulate: bool = False) -> None:
    """The MXFP8 weight gradient (tables ``wgrad*_mx`` / ``wgrad*_acc_mx``, plan ``wgrad*_dtype=mxfp8``): out[g]
    (=, or += in fp32) the sum over the group's rows of a[r]ᵀ b[r] on the dequantized operands, a [rows, M] / b
    [rows, N] e4m3 bits in 32-row blocks down each column (quant_mx_cols_*) with their codes packed as the
    [M | N, rows / 32] matrices' (read by address). The products of e4m3 values times powers of two summed in
    float64 (exact up to 2**16 terms of a row block), rounded once to fp32: the ideal accumulator of the
    block-scaled MMA, whose internal order is not public (a kernel is compared with it within a tolerance)."""
    from .mx_ops import dequantize_cols

    gs = group_start.tolist()
    rows = gs[-1]
    if rows == 0:
        if not accumulate:
            out.zero_()
        return
    da = dequantize_cols(a, sfa, rows).double()
    db = dequantize_cols(b, sfb, rows).double()
    for g in range(len(gs) - 1):
        r0, r1 = gs[g], gs[g + 1]
        val = (da[r0:r1].t() @ db[r0:r1]).float()
        if accumulate:
            if r1 > r0:   # a group with no rows leaves its main_grad untouched
                out[g] += val
        else:
            out[g] = val.to(out.dtype)


def reference_kernels(spec_or_cfg, bm: int, gather: bool = False, fused: bool = False,
                      training: bool = False, fp8_wgrads: tuple[str, ...] = (),
                      gather_train: bool | None = None, mx_wgrads: tuple[str, ...] = (),
                      fp8_h_quant: bool = False, fp8_a_gather: tuple[str, ...] = ()) -> dict[str, Callable[..., None]]:
    """{kernel name: callable} with the device kernels' exact argument lists (the table in mokgen/kernels.py,
    from which the templates' signatures and the runtime's launches derive too), the plan's constants bound. A
    stand-in for the functions of a loaded ``libmokgen.so``. ``gather=True``: the variant with a ``gather``
    kernel (GEMM 1 then reads ``xg`` instead of gathering rows of x); ``gather_train``: the same for gemm1_train
    (default ``gather``; a plan whose training GEMM 1 is split off, ``ops.uses_gather_kernel(plan, training=True)``).
    ``fused=True``: the fused schedule's two kernels, ``routing`` (which also zeroes ``sync`` but for its sticky
    ``sync[2]``) and ``fused`` (GEMM 1, GEMM 2 and combine). A dtype "fp8" / "mxfp8" spec gets its GEMMs under the
    same names with its argument tables (``gemm*_fp8`` / ``gemm*_mx``: float32 math on the dequantized operands)
    and its quantizers (:mod:`mokgen.fp8_ops` / :mod:`mokgen.mx_ops`). ``fp8_wgrads``: the weight gradients ("wgrad1", "wgrad2") a
    dtype "fp8" plan runs in FP8 (plan ``wgrad*_dtype=fp8``): their ``wgrad*_fp8`` tables, and the column
    quantizers. ``mx_wgrads``: likewise for a dtype "mxfp8" plan's MXFP8 weight gradients (plan
    ``wgrad*_dtype=mxfp8``): their ``wgrad*_mx`` tables (the column quantizers are bound for every MXFP8 training
    set). ``fp8_h_quant``: a dtype "fp8" plan whose GEMM 1 quantizes h in its epilogue (plan gemm1.h_quant
    "epilogue"): GEMM 1's ``gemm1*_hq_fp8`` tables, h's e4m3 rows and scales written as quant_rows_used would.
    ``fp8_a_gather``: the GEMM 1 kernels ("gemm1", "gemm1_train") of a dtype "fp8" plan that gather x's per-token
    e4m3 rows (plan gemm1.a_load "gather": their ``a`` / ``sa`` are quant_rows' [T, H] rows and scales, read
    through ``row``); the others read quant_rows_gather's rows."""
    from .kernels import bind

    if set(fp8_a_gather) - {"gemm1", "gemm1_train"}:
        raise ValueError(f"fp8_a_gather: names of GEMM 1 kernels (gemm1, gemm1_train), got {fp8_a_gather!r}")
    if set(fp8_wgrads) - {"wgrad1", "wgrad2"}:
        raise ValueError(f"fp8_wgrads: names of weight gradients (wgrad1, wgrad2), got {fp8_wgrads!r}")
    if set(mx_wgrads) - {"wgrad1", "wgrad2"}:
        raise ValueError(f"mx_wgrads: names of weight gradients (wgrad1, wgrad2), got {mx_wgrads!r}")

    cfg = layer_config(spec_or_cfg)
    E, S = cfg.local_experts, cfg.shared_experts

    def routing(idx, weight, row_src, row_w, tile_group, meta, slot_pos, sync=None):
        ref_routing(idx, weight, row_src, row_w, tile_group, meta, slot_pos, local_experts=E, shared_experts=S, bm=bm)
        if sync is not None:
            keep = sync[2].clone()
            sync.zero_()
            sync[2] = keep

    if fused:
        def fused_(x, w1, b1, w2, b2, row_src, row_w, tile_group, meta, slot_pos, h, ys, y, sync, num_ctas):
            ref_gemm1(x, w1, b1, row_src, tile_group, meta, h, num_ctas, cfg=cfg, bm=bm)
            ref_gemm2(h, w2, b2, row_w, tile_group, meta, ys, num_ctas, cfg=cfg, bm=bm)
            ref_combine(ys, slot_pos, y)

        return {"routing": bind("routing", routing, table="routing_sync"), "fused": bind("fused", fused_)}

    def gemm1(a, w, bias, row, tile_group, meta, out, num_ctas):
        ref_gemm1(a, w, bias, row, tile_group, meta, out, num_ctas, cfg=cfg, bm=bm, gathered=gather)

    def gemm2(a, w, bias, row, tile_group, meta, out, num_ctas):
        ref_gemm2(a, w, bias, row, tile_group, meta, out, num_ctas, cfg=cfg, bm=bm)

    impls: dict[str, Callable[..., None]] = {
        "routing": routing, "gemm1": gemm1, "gemm2": gemm2,
        "combine": lambda ys, slot_pos, y: ref_combine(ys, slot_pos, y),
    }
    tables: dict[str, str] = {}
    bound: dict[str, Callable[..., None]] = {}   # steps bound already (the MXFP8 quantizers)
    if cfg.dtype == "fp8":   # the FP8 forward GEMMs: same kernel names, the gemm*_fp8 argument tables
        def gemm1_fp8(a, w, bias, row, tile_group, meta, sa, sb, out, num_ctas):
            ref_gemm1_fp8(a, w, bias, row, tile_group, meta, sa, sb, out, num_ctas, cfg=cfg, bm=bm,
                          tokens="gemm1" in fp8_a_gather)

        def gemm2_fp8(a, w, bias, row, tile_group, meta, sa, sb, out, num_ctas):
            ref_gemm2_fp8(a, w, bias, row, tile_group, meta, sa, sb, out, num_ctas, cfg=cfg, bm=bm)

        from .fp8_ops import ref_quant_rows, ref_quant_rows_gather, ref_quant_rows_used, ref_quant_w

        def gemm1_hq_fp8(a, w, bias, row, tile_group, meta, sa, sb, out, hq, hs, num_ctas, z=None):
            """GEMM 1 quantizing h in its epilogue (tables gemm1_hq_fp8 and, with z, gemm1_train_hq_fp8)."""
            ref_gemm1_fp8(a, w, bias, row, tile_group, meta, sa, sb, out, num_ctas, cfg=cfg, bm=bm, z=z,
                          tokens=("gemm1" if z is None else "gemm1_train") in fp8_a_gather)
            ref_quant_rows_used(out, meta, hq, hs, bm=bm)

        impls.update(gemm1=gemm1_hq_fp8 if fp8_h_quant else gemm1_fp8, gemm2=gemm2_fp8)
        tables.update(gemm1="gemm1_hq_fp8" if fp8_h_quant else "gemm1_fp8", gemm2="gemm2_fp8")

        impls.update(quant_rows=ref_quant_rows, quant_w=ref_quant_w,
                     quant_rows_gather=lambda x, row_src, meta, q, s: ref_quant_rows_gather(x, row_src, meta, q, s,
                                                                                            bm=bm),
                     quant_rows_used=lambda x, meta, q, s: ref_quant_rows_used(x, meta, q, s, bm=bm))
    if cfg.dtype == "mxfp8":   # the MXFP8 GEMMs (gemm*_mx tables) and quantizers (mokgen/mx_ops.py)
        def gemm1_mx(a, w, bias, row, tile_group, meta, sfa, sfw, out, num_ctas):
            ref_gemm1_mx(a, w, bias, row, tile_group, meta, sfa, sfw, out, num_ctas, cfg=cfg, bm=bm)

        def gemm2_mx(a, w, bias, row, tile_group, meta, sfa, sfw, out, num_ctas):
            ref_gemm2_mx(a, w, bias, row, tile_group, meta, sfa, sfw, out, num_ctas, cfg=cfg, bm=bm)

        impls.update(gemm1=gemm1_mx, gemm2=gemm2_mx)
        tables.update(gemm1="gemm1_mx", gemm2="gemm2_mx")
        from .mx_ops import MX_BACKWARD_QUANT, MX_WGRAD_QUANT, reference_quant_kernels as mx_quant

        mxq = mx_quant(bm, cfg.gate_up_layout)
        bound.update({k: v for k, v in mxq.items() if training or k not in MX_BACKWARD_QUANT + MX_WGRAD_QUANT})
    if gather or training:
        impls["gather"] = lambda x, row_src, meta, xg: ref_gather(x, row_src, meta, xg, bm=bm)
    if training:
        def gemm1_train(a, w, bias, row, tile_group, meta, out, z, num_ctas):
            ref_gemm1_train(a, w, bias, row, tile_group, meta, out, z, num_ctas, cfg=cfg, bm=bm,
                            gathered=gather if gather_train is None else gather_train)

        def dgrad1(a, w, bias, row, tile_group, meta, out, z, dz, ds, num_ctas):
            ref_dgrad1(a, w, bias, row, tile_group, meta, out, z, dz, ds, num_ctas, cfg=cfg, bm=bm)

        def dgrad2(a, w, bias, row, tile_group, meta, out, num_ctas):
            ref_dgrad2(a, w, bias, row, tile_group, meta, out, num_ctas, bm=bm)

        impls.update(gemm1_train=gemm1_train, dgrad1=dgrad1, dgrad2=dgrad2)
        if cfg.dtype == "fp8":
            def gemm1_train_fp8(a, w, bias, row, tile_group, meta, sa, sb, out, z, num_ctas):
                ref_gemm1_fp8(a, w, bias, row, tile_group, meta, sa, sb, out, num_ctas, cfg=cfg, bm=bm, z=z,
                              tokens="gemm1_train" in fp8_a_gather)

            def dgrad1_fp8(a, w, bias, row, tile_group, meta, sa, sb, out, z, dz, ds, num_ctas):
                ref_dgrad1_fp8(a, w, bias, row, tile_group, meta, sa, sb, out, z, dz, ds, num_ctas, cfg=cfg, bm=bm)

            def dgrad2_fp8(a, w, bias, row, tile_group, meta, sa, sb, out, num_ctas):
                ref_dgrad2_fp8(a, w, bias, row, tile_group, meta, sa, sb, out, num_ctas, bm=bm)

            from .fp8_ops import ref_quant_wt

            impls.update(gemm1_train=gemm1_hq_fp8 if fp8_h_quant else gemm1_train_fp8, dgrad1=dgrad1_fp8,
                         dgrad2=dgrad2_fp8, quant_wt=ref_quant_wt)
            tables.update(gemm1_train="gemm1_train_hq_fp8" if fp8_h_quant else "gemm1_train_fp8",
                          dgrad1="dgrad1_fp8", dgrad2="dgrad2_fp8")
        if cfg.dtype == "mxfp8":
            def gemm1_train_mx(a, w, bias, row, tile_group, meta, sfa, sfw, out, z, num_ctas):
                ref_gemm1_mx(a, w, bias, row, tile_group, meta, sfa, sfw, out, num_ctas, cfg=cfg, bm=bm, z=z)

            def dgrad1_mx(a, w, bias, row, tile_group, meta, sfa, sfw, out, z, dz, ds, num_ctas):
                ref_dgrad1_mx(a, w, bias, row, tile_group, meta, sfa, sfw, out, z, dz, ds, num_ctas, cfg=cfg, bm=bm)

            def dgrad2_mx(a, w, bias, row, tile_group, meta, sfa, sfw, out, num_ctas):
                ref_dgrad2_mx(a, w, bias, row, tile_group, meta, sfa, sfw, out, num_ctas, bm=bm)

            impls.update(gemm1_train=gemm1_train_mx, dgrad1=dgrad1_mx, dgrad2=dgrad2_mx)
            tables.update(gemm1_train="gemm1_train_mx", dgrad1="dgrad1_mx", dgrad2="dgrad2_mx")
        for name in ("wgrad1", "wgrad2"):
            for acc in (False, True):
                kernel = name + ("_acc" if acc else "")
                if name in mx_wgrads:
                    if cfg.dtype != "mxfp8":
                        raise ValueError(f"mx_wgrads: MXFP8 weight gradients belong to dtype mxfp8, got {cfg.dtype}")
                    impls[kernel] = (lambda a, sfa, b, sfb, group_start, out, num_ctas, _acc=acc:
                                     ref_wgrad_mx(a, sfa, b, sfb, group_start, out, num_ctas, accumulate=_acc))
                    tables[kernel] = kernel + "_mx"
                elif name in fp8_wgrads:
                    if cfg.dtype != "fp8":
                        raise ValueError(f"fp8_wgrads: FP8 weight gradients belong to dtype fp8, got {cfg.dtype}")
                    impls[kernel] = (lambda a, sa, b, sb, group_start, out, num_ctas, _acc=acc:
                                     ref_wgrad_fp8(a, sa, b, sb, group_start, out, num_ctas, accumulate=_acc))
                    tables[kernel] = kernel + "_fp8"
                else:
                    impls[kernel] = (lambda a, b, group_start, out, num_ctas, _acc=acc:
                                     ref_wgrad(a, b, group_start, out, num_ctas, accumulate=_acc))
        if fp8_wgrads:
            from .fp8_ops import reference_quant_kernels

            q = reference_quant_kernels(bm)
            bound.update({k: q[k] for k in ("quant_cols_used", "quant_cols_gather", "quant_both_used",
                                            "quant_both_gather")})
    return {**{name: bind(name, impl, table=tables.get(name)) for name, impl in impls.items()}, **bound}
