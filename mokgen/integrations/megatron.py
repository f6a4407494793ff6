"""mokgen as Megatron-core's experts (``pip install 'mokgen[megatron]'``; written against megatron-core 0.19.2,
``megatron/core/transformer/moe/experts.py``).

    import mokgen.integrations.megatron as mmc
    mmc.apply(model)          # every TEGroupedMLP / SequentialMLP of the model computes through mokgen

Megatron's MoE layer calls its experts module as ``experts(permuted_local_hidden_states [N, H],
tokens_per_expert [E], permuted_probs [N]) -> (output [N, H], output_bias=None)``, rows sorted by local expert.
:func:`experts_forward` computes the same on :func:`mokgen.integrations.grouped.grouped_experts` (forward and
backward on mokgen's kernels, deterministic). ``tokens_per_expert`` may be on the CPU (the token dispatcher
keeps it there for some configurations; TEGroupedMLP itself reads it with ``.tolist()``) or on the GPU: counts on
the GPU are never read by the host (no sync), counts on the CPU are checked there and copied (E integers).

What the experts compute (Megatron's config fields, read from ``module.config``):

* ``gated_linear_unit=True`` (required): fc1 produces ``2F`` features per row, split with ``chunk(2)``: the first
  F are the gate, the last F the linear (up) half: mokgen's ``concat`` layout. ``moe_mlp_glu_interleave_size=1``
  (gate and up alternating) is mokgen's ``interleaved`` layout; other interleave sizes are refused.
* ``activation_func=F.silu``, ``glu_linear_offset=0``: ``silu(gate) * up``, mokgen's ``swiglu``; with
  ``activation_func_clamp_value=L``: gate clamped above at L, up to [-L, L]: mokgen's ``swiglu_limit: L``.
  ``activation_func=quick_gelu`` (``g * sigmoid(1.702 g)``), ``glu_linear_offset=1``, clamp 7: the gpt-oss
  activation, mokgen's ``swiglu_oai``. Anything else raises :class:`UnsupportedExperts`, as do fp8 / fp4
  (``config.fp8`` / ``config.fp4``) and ``use_te_activation_func`` (a TE activation module mokgen cannot read).
* probs: Megatron scales the activation by ``permuted_probs`` before fc2 and adds the fc2 bias times the prob
  (``_apply_bias``); mokgen scales ``W2 a + b2`` by the prob in GEMM 2's epilogue: the same function, and
  ``permuted_probs`` gets its gradient. ``moe_apply_probs_on_input=True`` (top-1 only): x is scaled by the probs
  first (in x's dtype, as Megatron does) and the experts run with probs 1.
* biases (``add_bias_linear=True``): fc1's per-expert bias is mokgen's b1, fc2's b2 (fp32 in mokgen; cast).

Weights (the per-rank local experts; under expert TP each rank's fc1 shard is ``[gate_local; up_local]``, which
Megatron's checkpoint code splits the same way, so the SwiGLU of a shard is the rank's slice of the experts;
fc2's output is the rank's partial sum, as Megatron's own):

* ``TEGroupedMLP``: ``linear_fc1.weight{i} [2F, H]`` (TE GroupedLinear, one parameter per expert) *is* mokgen's
  ``w1[i]``, ``linear_fc2.weight{i} [H, F]`` *is* ``w2[i]``; biases ``bias{i}``. With TE's single grouped weight
  (``moe_single_grouped_weight``, TE >= 2.14 op fuser) ``linear_fc1.weight`` is used as one ``[E, 2F, H]`` view
  when it is a plain tensor of those elements (not verified against TE: it is not installable here).
* ``SequentialMLP``: ``local_experts[i].linear_fc1.weight [2F, H]``, ``local_experts[i].linear_fc2.weight
  [H, F]`` and their biases.

The per-expert parameters are **stacked per call** (``torch.stack``: one copy of ``3 E F H`` bf16 elements,
``6 E F H`` bytes written and read; in the backward each parameter gets its contiguous slice of the stacked
gradient, no copy). Why not a one-time relayout into one ``[E, 2F, H]`` buffer: Megatron's DDP moves every
parameter into its own contiguous param / grad buffers (bucketed, in reverse order, padded under the
distributed optimizer) and distributed checkpointing names ``weight{i}``; a relayout would be undone by the first
and break the second. The stacked copy is not kept for the backward: the autograd graph keeps a function that
stacks again (``grouped_experts(rebuild=...)``), so no second copy of the expert weights lives from forward to
backward; the backward pays one more stack (``6 E F H`` bytes written).

Not supported (raise): ``output_buffer`` / ``grad_input_buffer`` (the TE op-fuser path's zero-copy buffers),
fp8 / fp4, a TE activation module. Bypassed by the patched forward (mokgen's own kernels instead): TE's op fuser,
activation recompute of ``moe_act``, fine-grained activation offloading, ``delay_wgrad_compute`` (the weight
gradients come with the rest of the backward; ``backward_dw`` is left as it is).

megatron-core 0.19.2 requires Python >= 3.12 (its wheel is cp312), so it does not install on this project's
Python 3.11 machines: tests/test_megatron.py checks this adapter against a faithful copy of the experts'
contract (tests/megatron_contract.py), and against the real modules where megatron-core imports.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from . import grouped
from .common import restore_forward

__all__ = ["UnsupportedExperts", "ExpertsLayout", "layout_of", "mokgen_weights", "experts_forward", "apply",
           "unapply", "experts_modules", "EXPERTS_CLASSES"]

EXPERTS_CLASSES = ("TEGroupedMLP", "SequentialMLP")
OAI_ALPHA = 1.702
OAI_LIMIT = 7.0


class UnsupportedExperts(ValueError):
    """An experts module or config mokgen does not compute (the message names the class and the reason)."""


@dataclass(frozen=True)
class ExpertsLayout:
    kind: str                  # "grouped" (TEGroupedMLP: linear_fc1.weight{i}) or "sequential" (local_experts)
    experts: int
    activation: str            # mokgen's "swiglu" or "swiglu_oai"
    swiglu_limit: float | None
    gate_up_layout: str        # "concat" or "interleaved"
    bias: bool
    probs_on_input: bool


def _cls(m: torch.nn.Module) -> str:
    return type(m).__name__


def _act_name(fn: Any) -> str:
    if fn is torch.nn.functional.silu or isinstance(fn, torch.nn.SiLU):
        return "silu"
    return getattr(fn, "__name__", type(fn).__name__)


def _kind(module: torch.nn.Module) -> tuple[str, int]:
    fc1 = getattr(module, "linear_fc1", None)
    if fc1 is not None and isinstance(getattr(fc1, "num_gemms", None), int):
        return "grouped", fc1.num_gemms
    experts = getattr(module, "local_experts", None)
    if isinstance(experts, torch.nn.ModuleList) and len(experts):
        return "sequential", len(experts)
    raise UnsupportedExperts(f"{_cls(module)}: neither TEGroupedMLP-like (linear_fc1.num_gemms, weight{{i}}) nor "
                             "SequentialMLP-like (local_experts)")


def layout_of(module: torch.nn.Module) -> ExpertsLayout:
    """What a Megatron experts module computes, in mokgen's terms, or :class:`UnsupportedExperts`."""
    name = _cls(module)
    cfg = getattr(module, "config", None)
    if cfg is None:
        raise UnsupportedExperts(f"{name}: no .config (a Megatron TransformerConfig)")
    kind, E = _kind(module)
    n = getattr(module, "num_local_experts", E)
    if n != E:
        raise UnsupportedExperts(f"{name}: num_local_experts={n} but {E} expert weights")
    if not getattr(cfg, "gated_linear_unit", False):
        raise UnsupportedExperts(f"{name}: gated_linear_unit=False; mokgen computes gated (SwiGLU) experts only")
    if getattr(cfg, "fp8", None) or getattr(cfg, "fp4", None):
        raise UnsupportedExperts(f"{name}: fp8 / fp4 experts; mokgen computes bf16")
    if getattr(cfg, "use_te_activation_func", False):
        raise UnsupportedExperts(f"{name}: use_te_activation_func=True (a Transformer Engine activation module)")
    act = _act_name(getattr(cfg, "activation_func", None))
    offset = float(getattr(cfg, "glu_linear_offset", 0.0) or 0.0)
    clamp = getattr(cfg, "activation_func_clamp_value", None)
    if act == "silu" and offset == 0.0:
        activation, limit = "swiglu", (None if clamp is None else float(clamp))
        if limit is not None and not (math.isfinite(limit) and limit > 0):
            raise UnsupportedExperts(f"{name}: activation_func_clamp_value={clamp}; mokgen's limit must be > 0")
    elif act == "quick_gelu" and offset == 1.0 and clamp is not None and float(clamp) == OAI_LIMIT:
        activation, limit = "swiglu_oai", None
    else:
        raise UnsupportedExperts(f"{name}: activation {act} with glu_linear_offset={offset}, clamp {clamp}; mokgen "
                                 "computes silu (offset 0, any clamp) or quick_gelu (offset 1, clamp 7: gpt-oss)")
    inter = getattr(cfg, "moe_mlp_glu_interleave_size", None)
    if inter is None:
        layout = "concat"
    elif inter == 1:
        layout = "interleaved"
    else:
        raise UnsupportedExperts(f"{name}: moe_mlp_glu_interleave_size={inter}; mokgen reads gate/up as halves "
                                 "(None) or alternating rows (1)")
    probs_on_input = bool(getattr(cfg, "moe_apply_probs_on_input", False))
    if probs_on_input and getattr(cfg, "moe_router_topk", 1) != 1:
        raise UnsupportedExperts(f"{name}: moe_apply_probs_on_input needs moe_router_topk=1 (as Megatron asserts)")
    return ExpertsLayout(kind=kind, experts=E, activation=activation, swiglu_limit=limit, gate_up_layout=layout,
                         bias=bool(getattr(cfg, "add_bias_linear", False)), probs_on_input=probs_on_input)


def _real(t: Any) -> torch.Tensor | None:
    return t if isinstance(t, torch.Tensor) and t.numel() > 0 else None


def _per_expert(module: torch.nn.Module, layout: ExpertsLayout, fc: str, what: str) -> list[torch.Tensor] | None:
    """The per-expert ``weight`` / ``bias`` tensors of fc1 or fc2 (None: a single grouped weight to view)."""
    E = layout.experts
    if layout.kind == "grouped":
        lin = getattr(module, fc)
        if what == "weight" and getattr(lin, "single_grouped_weight", False):
            return None
        ts = [_real(getattr(lin, f"{what}{i}", None)) for i in range(E)]
    else:
        ts = [_real(getattr(getattr(e, fc), what, None)) for e in module.local_experts]
    if any(t is None for t in ts):
        raise UnsupportedExperts(f"{_cls(module)}: {fc}.{what} missing for some experts")
    return ts


def _single_grouped(module: torch.nn.Module, fc: str, shape: tuple[int, int, int]) -> torch.Tensor:
    w = getattr(getattr(module, fc), "weight", None)
    if type(w) not in (torch.Tensor, torch.nn.Parameter) or w.numel() != math.prod(shape) or not w.is_contiguous():
        raise UnsupportedExperts(f"{_cls(module)}: {fc}.weight is a single grouped weight of type {type(w).__name__}"
                                 f"; mokgen views a plain contiguous tensor of {shape} elements only")
    return w.view(shape)


def mokgen_weights(module: torch.nn.Module, layout: ExpertsLayout | None = None, *,
                   dtype: torch.dtype | None = torch.bfloat16):
    """``(w1 [E, 2F, H], w2 [E, H, F], b1 [E, 2F] | None, b2 [E, H] | None, rebuild)`` for this call: the
    per-expert parameters stacked (one differentiable copy; ``dtype`` w1 / w2, fp32 biases; ``dtype=None``: the
    parameters' dtype, for float64 checks) and the ``rebuild`` mapping for :func:`grouped.grouped_experts`."""
    layout = layout or layout_of(module)
    E = layout.experts
    wdt = dtype
    bdt = torch.float32 if dtype is not None else None
    rebuild: dict[str, Any] = {}

    def stacked(name: str, ts: list[torch.Tensor], dt: torch.dtype | None) -> torch.Tensor:
        dt = dt or ts[0].dtype
        rebuild[name] = (lambda: grouped.stack_cast(ts, dt), tuple(ts))
        return grouped.stack_cast(ts, dt)

    out = []
    for fc, name in (("linear_fc1", "w1"), ("linear_fc2", "w2")):
        ts = _per_expert(module, layout, fc, "weight")
        if ts is None:
            first = getattr(getattr(module, fc), "weight")
            rows = first.numel() // E
            cols = getattr(module.config, "hidden_size", None)
            if fc == "linear_fc2":
                shape = (E, cols, rows // cols) if cols else None
            else:
                shape = (E, rows // cols, cols) if cols else None
            if shape is None:
                raise UnsupportedExperts(f"{_cls(module)}: single grouped weight without config.hidden_size")
            w = _single_grouped(module, fc, shape)
            out.append(w if wdt is None or w.dtype == wdt else w.to(wdt))
        else:
            out.append(stacked(name, ts, wdt))
    w1, w2 = out
    b1 = b2 = None
    if layout.bias:
        b1 = stacked("b1", _per_expert(module, layout, "linear_fc1", "bias"), bdt)
        b2 = stacked("b2", _per_expert(module, layout, "linear_fc2", "bias"), bdt)
    if w1.dim() != 3 or w2.dim() != 3 or w1.shape[0] != E or w1.shape[1] != 2 * w2.shape[2] \
            or w1.shape[2] != w2.shape[1]:
        raise UnsupportedExperts(f"{_cls(module)}: fc1 {tuple(w1.shape)} / fc2 {tuple(w2.shape)} do not fit "
                                 "[E, 2F, H] / [E, H, F]")
    return w1, w2, b1, b2, rebuild


def experts_forward(self: torch.nn.Module, permuted_local_hidden_states: torch.Tensor,
                    tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor | None,
                    output_buffer: torch.Tensor | None = None, grad_input_buffer: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, None]:
    """Megatron's experts ``forward`` through mokgen: ``(output [N, H] in the input's dtype, None)``."""
    if output_buffer is not None or grad_input_buffer is not None:
        raise UnsupportedExperts(f"{_cls(self)}: output_buffer / grad_input_buffer (TE op-fuser zero-copy buffers) "
                                 "are not supported by mokgen's experts")
    layout = layout_of(self)
    x = permuted_local_hidden_states
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    counts = tokens_per_expert
    if not isinstance(counts, torch.Tensor):
        counts = torch.tensor(list(counts), dtype=torch.int64)
    probs = None if permuted_probs is None else permuted_probs.reshape(-1)
    if layout.probs_on_input and probs is not None:
        x = (probs.unsqueeze(-1) * x).to(x.dtype)
        probs = None
    w1, w2, b1, b2, rebuild = mokgen_weights(self, layout)
    y = grouped.grouped_experts(x, counts, w1, w2, probs, b1, b2, activation=layout.activation,
                                swiglu_limit=layout.swiglu_limit, gate_up_layout=layout.gate_up_layout,
                                rebuild=rebuild)
    return y.reshape(shape), None


def _patched_forward(self: torch.nn.Module, permuted_local_hidden_states: torch.Tensor,
                     tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor | None = None,
                     *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    return experts_forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs, *args, **kwargs)


def experts_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every ``TEGroupedMLP`` / ``SequentialMLP`` in ``model`` (class name, exactly: the
    inference subclasses are left alone)."""
    for name, mod in model.named_modules():
        if _cls(mod) in EXPERTS_CLASSES:
            yield name, mod


def apply(model: torch.nn.Module) -> list[str]:
    """Bind :func:`experts_forward` as ``forward`` of every Megatron experts module of ``model`` (the model itself
    may be one), each checked first (:class:`UnsupportedExperts`). Returns their names; ``ValueError`` if there
    is none. Parameters, names, DDP buffers and checkpoints stay Megatron's; works before or after DDP wrapping."""
    mods = list(experts_modules(model))
    if not mods:
        raise ValueError(f"mokgen: no Megatron experts module ({', '.join(EXPERTS_CLASSES)}) in {_cls(model)}")
    for _n, mod in mods:
        layout_of(mod)
    for _n, mod in mods:
        mod.forward = types.MethodType(_patched_forward, mod)
    return [n for n, _ in mods]


def unapply(model: torch.nn.Module) -> list[str]:
    """Undo :func:`apply`. Returns the names of the modules restored."""
    return restore_forward(experts_modules(model), _patched_forward)
