"""mokgen as a Hugging Face transformers experts backend (``pip install 'mokgen[transformers]'``).

Two ways in:

* transformers >= 5 (its experts interface, ``transformers.integrations.moe``): importing this module registers
  ``"mokgen"`` in ``ExpertsInterface`` (so ``ALL_EXPERTS_FUNCTIONS``); then

      import mokgen.integrations.transformers
      model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16, experts_implementation="mokgen")
      # or, on a model already built: model.set_experts_implementation("mokgen")

* any version with fused 3-D expert weights but without the interface: :func:`apply` binds the backend to
  every experts module of a model instance (Liger-style monkey patch; :func:`unapply` undoes it).

The backend is ``experts_forward(self, hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K])``: it
reads the module's ``gate_up_proj`` / ``down_proj`` (and ``gate_up_proj_bias`` / ``down_proj_bias``), the
decorator's layout flags (``is_transposed``, ``is_concatenated``, ``has_bias``, ``has_gate``) and the module's
gate function, derives a :class:`mokgen.spec.Spec` per distinct shape (compiled once through mokgen's cache;
T varies per call without a recompile: the kernels size everything from T at run time) and calls
:func:`mokgen.moe_forward` (autograd: the generated backward kernels).

Layouts (mokgen: ``w1 [E, 2I, H]`` gate rows then up rows, or interleaved; ``w2 [E, H, I]``; ``b1 [E, 2I]``,
``b2 [E, H]`` fp32):

* Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, Qwen3-Next, Qwen3.5-MoE, GLM-4-MoE (``@use_experts_implementation``
  defaults, the default gate ``silu(gate) * up`` over ``chunk(2)``): ``gate_up_proj [E, 2I, H]`` *is* w1
  (concat) and ``down_proj [E, H, I]`` *is* w2: passed as they are, no copy. Shared experts (DeepSeek-V3,
  Qwen2-MoE, Qwen3-Next, GLM-4-MoE, ...) are the model's own MLP modules, outside the experts module; they stay
  the model's code.
* GPT-OSS (``is_transposed=True, is_concatenated=False, has_bias=True``, gate ``(clamp(up, -7, 7) + 1) *
  g * sigmoid(1.702 g)`` with ``g = min(gate, 7)``: mokgen's ``swiglu_oai``): ``gate_up_proj [E, H, 2I]`` is
  w1 transposed with gate/up columns interleaved (mokgen's ``gate_up_layout: interleaved``), ``down_proj [E, I,
  H]`` is w2 transposed. The transposes are views; to make them contiguous without a copy per call the
  backend *relayouts the storage* of these two parameters once (the first call, or :func:`apply` /
  :func:`prepare`): ``p.data = p.data.transpose(1, 2).contiguous().transpose(1, 2)``. The Parameter objects,
  their names and shapes stay the model's (optimizers, ``state_dict``, ``save_pretrained``, which calls
  ``.contiguous()``, see the same tensors); only their strides change, and ``p.transpose(1, 2)`` is then the
  contiguous mokgen weight. Cost: one copy of those weights, once. Do it before wrapping the model in
  DDP / FSDP or creating the optimizer (:func:`prepare`), or turn it off with ``configure(relayout=False)``,
  which copies the transposed weights on every call instead (a warning says so). The biases are fp32 in
  mokgen: bf16 biases are cast per call (``E * (2I + H)`` elements, small next to the weights).
* DeepSeek-V4 (its ``_apply_gate``: ``silu(min(gate, L)) * clamp(up, -L, L)``): mokgen's ``swiglu`` with
  ``swiglu_limit: L``, concat, no copy (mapping checked on the CPU; no model-level test).

Anything else (another gate function, an activation other than SiLU, ``has_gate=False``, quantized weights,
dims that are no multiple of 64) raises :class:`UnsupportedExperts` on the first call (or in :func:`apply`)
naming the module class and the reason; nothing falls back silently.

Inputs per call: ``hidden_states`` to bf16 (a no-op for bf16 models), ``top_k_index`` to int32 (int64, what
``torch.topk`` returns, is accepted: one small cast), ``top_k_weights`` to fp32 (the routers of Qwen3-MoE and
friends return bf16); gradients flow back through these casts. Weights that are not bf16 (an fp32 model, or
fp32 master weights without autocast) are cast to bf16 per call, as autocast would, with a one-time warning:
mokgen computes in bf16 with fp32 accumulation.

Expert parallelism (transformers' ``EpRouterParallel``): slots routed to another rank's expert arrive with id
``num_experts`` (the local count) and weight 0, and their output must be 0. The backend runs mokgen's masking
mode (``moe_forward(..., masked=True)``, :meth:`mokgen.ops.CompiledMoE.masked_view`): ids ``>= num_experts``
are dropped by the routing kernel (no GEMM rows: unlike a remap to a real expert with weight 0, they cost no
compute), give exactly 0 and zero gradient, and are not routing errors; negative ids still are
(:func:`check_errors`). ``configure(masked=False)`` reports every id outside ``[0, num_experts)``. Expert
weights that are DTensors (transformers' EP shards them) are used through ``to_local()``. Multi-GPU expert
parallelism itself has not been run.

The spec: ``hidden`` / ``ffn`` from the weight shapes, ``experts`` / ``ep`` from the config's expert count and
the module's (``ep = config experts / local experts`` under EP), ``topk`` from the call's ``top_k_index``,
activation / limit / layout / bias from the layout above, ``shared_experts: 0``, and ``tokens`` =
``configure(tokens=...)`` (default 4096). ``tokens`` is not a capacity: the runtime sizes its workspace from
each call's T and the kernels take T at run time, so any T works with the same kernels. It is the T the plan
is chosen for (tile shapes, GEMM 1's A path, raster: :func:`mokgen.plan.solve`'s cost model runs at
``spec.tokens``) and the T at which the spec's memory bound (weights + workspace within one GPU) is checked;
set it to your training micro-batch's tokens per rank (batch x sequence). A tuning record for the shape
(``mokgen tune``) is keyed without ``tokens`` and picks its plan per call by T.

Testing on a machine without a GPU: :func:`set_compiler` swaps the factory that turns a spec into a
``CompiledMoE``; :func:`reference_compiler` gives one that runs mokgen's launch sequence with the reference
kernels of :mod:`mokgen.reference` on the CPU (what the CPU tests use).
"""

from __future__ import annotations

import dataclasses
import math
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch

from .. import ops
from .common import CompiledSpecs, reference_compiler, restore_forward
from ..spec import DTYPES, Spec, SpecError

__all__ = [
    "KEY",
    "DEFAULT_TOKENS",
    "UnsupportedExperts",
    "ExpertsLayout",
    "Options",
    "configure",
    "options",
    "layout_of",
    "derive_spec",
    "spec_for",
    "mokgen_weights",
    "relayout_",
    "prepare",
    "experts_forward",
    "register",
    "registered",
    "apply",
    "unapply",
    "experts_modules",
    "check_errors",
    "set_compiler",
    "reference_compiler",
    "compiled_for",
]

KEY = "mokgen"
DEFAULT_TOKENS = 4096
OAI_ALPHA = 1.702
OAI_LIMIT = 7.0


class UnsupportedExperts(ValueError):
    """An experts module whose layout or math mokgen does not compute (the message names the class and why)."""


@dataclass(frozen=True)
class ExpertsLayout:
    """How one experts module stores its weights and what its gate computes, in mokgen's terms."""

    kind: str                 # "swiglu" (default gate), "gpt_oss", "deepseek_v4": which gate was recognized
    transposed: bool          # gate_up_proj [E, H, 2I] and down_proj [E, I, H] (else [E, 2I, H] / [E, H, I])
    gate_up_layout: str       # mokgen's "concat" (gate rows, then up rows) or "interleaved" (gate 2j, up 2j+1)
    bias: bool                # gate_up_proj_bias [E, 2I] and down_proj_bias [E, H]
    activation: str           # mokgen's "swiglu" or "swiglu_oai"
    swiglu_limit: float | None


@dataclass
class Options:
    """The backend's settings (:func:`configure`)."""

    tokens: int = DEFAULT_TOKENS              # the T the plan is chosen for (not a capacity: any T runs)
    masked: bool = True                       # ids >= num_experts are masked slots (transformers' EP sentinel)
    relayout: bool = True                     # transposed layouts: relayout the storage once, not a copy per call
    overrides: Mapping[str, Any] | None = None   # plan overrides for mokgen.compile (e.g. {"gemm1_bn": 128})
    dtype: str = "bf16"                       # the experts' GEMM precision: "bf16", "fp8" (Hopper), "mxfp8" (sm_100a)


_OPTIONS = Options()
_WARNED: set[str] = set()


def options() -> Options:
    """The current settings (a copy)."""
    return dataclasses.replace(_OPTIONS)


def configure(*, tokens: int | None = None, masked: bool | None = None, relayout: bool | None = None,
              overrides: Mapping[str, Any] | None = None, dtype: str | None = None) -> Options:
    """Change the backend's settings (those given); returns the previous ones. A new ``tokens``, ``overrides``
    or ``dtype`` means other specs or plans: modules derive their specs again on their next call. ``dtype``:
    the precision of the experts' GEMMs, the spec's ``dtype`` (``"bf16"``; ``"fp8"``: Hopper's blockwise e4m3
    training, weights and activations quantized per call from the model's bf16 tensors, outputs and gradients
    bf16; ``"mxfp8"``: Blackwell's, sm_100a only). The parameters stay the model's bf16 master weights."""
    global _OPTIONS
    old = options()
    new = dataclasses.replace(old)
    if tokens is not None:
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"tokens must be a positive int, got {tokens!r}")
        new.tokens = tokens
    if dtype is not None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        new.dtype = dtype
    if masked is not None:
        new.masked = bool(masked)
    if relayout is not None:
        new.relayout = bool(relayout)
    if overrides is not None:
        new.overrides = dict(overrides) or None   # {}: back to the solver's (or the tuning record's) plan
    with _KERNELS.lock:
        if (new.tokens, new.overrides, new.dtype) != (old.tokens, old.overrides, old.dtype):
            _KERNELS.drop()
        _OPTIONS = new
    return old


def _warn_once(key: str, msg: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(msg, stacklevel=3)


# --------------------------------------------------------------------------------------------------------------
# layouts


def _cls(module: torch.nn.Module) -> str:
    return type(module).__name__


def _param(module: torch.nn.Module, name: str) -> torch.Tensor | None:
    t = getattr(module, name, None)
    return t if isinstance(t, torch.Tensor) else None


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's local shard (differentiable), any other tensor as it is."""
    if t is not None and hasattr(t, "to_local") and type(t).__name__ == "DTensor":
        return t.to_local()
    return t


def _gate_name(module: torch.nn.Module) -> str | None:
    """``Class._apply_gate``'s qualified name, or None for transformers' default gate (or none at all)."""
    fn = getattr(type(module), "_apply_gate", None)
    if fn is None:
        return None
    if getattr(fn, "__name__", "") == "_default_apply_gate" and "integrations.moe" in getattr(fn, "__module__", ""):
        return None
    return getattr(fn, "__qualname__", repr(fn))


def _is_silu(module: torch.nn.Module) -> bool:
    act = getattr(module, "act_fn", None)
    if act is not None:
        return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation" or act is torch.nn.functional.silu
    hidden_act = getattr(getattr(module, "config", None), "hidden_act", None)
    return hidden_act in ("silu", "swish")


def _hidden_size(module: torch.nn.Module) -> int | None:
    for name in ("hidden_dim", "hidden_size"):
        v = getattr(module, name, None)
        if isinstance(v, int):
            return v
    v = getattr(getattr(module, "config", None), "hidden_size", None)
    return v if isinstance(v, int) else None


def _infer_transposed(module: torch.nn.Module, gate_up: torch.Tensor) -> bool:
    """Without the decorator's ``is_transposed``: from the class (GPT-OSS) or from which weight dim is H."""
    if _cls(module) == "GptOssExperts":
        return True
    H = _hidden_size(module)
    a, b = gate_up.shape[1], gate_up.shape[2]
    if H is not None and (a == H) != (b == H):
        return a == H
    raise UnsupportedExperts(f"{_cls(module)}: cannot tell whether gate_up_proj {tuple(gate_up.shape)} is "
                             "transposed (set the module's is_transposed attribute)")


def layout_of(module: torch.nn.Module) -> ExpertsLayout:
    """The :class:`ExpertsLayout` of an experts module (``@use_experts_implementation``'s flags where present,
    else inferred), or :class:`UnsupportedExperts` saying why mokgen cannot compute it."""
    name = _cls(module)
    if getattr(module, "has_gate", True) is False:
        raise UnsupportedExperts(f"{name}: has_gate=False (an up projection without a gate); mokgen computes "
                                 "gated (SwiGLU) experts only")
    gate_up, down = _local(_param(module, "gate_up_proj")), _local(_param(module, "down_proj"))
    if gate_up is None or down is None:
        raise UnsupportedExperts(f"{name}: expects 3-D gate_up_proj and down_proj tensors (fused experts); "
                                 "per-expert nn.Linear modules (transformers < 5) would need a stacked copy per call")
    if gate_up.dim() != 3 or down.dim() != 3:
        raise UnsupportedExperts(f"{name}: gate_up_proj / down_proj must be 3-D, got {tuple(gate_up.shape)} and "
                                 f"{tuple(down.shape)}")
    if not (gate_up.is_floating_point() and down.is_floating_point()) or gate_up.element_size() < 2:
        raise UnsupportedExperts(f"{name}: expert weights are {gate_up.dtype} / {down.dtype} (quantized?); mokgen "
                                 "takes bf16 (or fp32 / fp16, cast to bf16 per call)")
    transposed = getattr(module, "is_transposed", None)
    if transposed is None:
        transposed = _infer_transposed(module, gate_up)
    has_bias = getattr(module, "has_bias", None)
    if has_bias is None:
        has_bias = _param(module, "gate_up_proj_bias") is not None
    if has_bias and (_param(module, "gate_up_proj_bias") is None or _param(module, "down_proj_bias") is None):
        raise UnsupportedExperts(f"{name}: has_bias=True but gate_up_proj_bias / down_proj_bias are missing")
    concatenated = getattr(module, "is_concatenated", None)
    gate = _gate_name(module)
    if gate is None:   # transformers' default: gate, up = chunk(2); act_fn(gate) * up
        if not _is_silu(module):
            act = getattr(module, "act_fn", None) or getattr(getattr(module, "config", None), "hidden_act", None)
            raise UnsupportedExperts(f"{name}: activation {act!r}; mokgen computes SwiGLU (silu(gate) * up) only")
        if concatenated is False:
            raise UnsupportedExperts(f"{name}: is_concatenated=False but the default gate splits gate_up with "
                                     "chunk(2) (concatenated): inconsistent flags")
        kind, layout, act, limit = "swiglu", "concat", "swiglu", None
    elif gate.endswith("GptOssExperts._apply_gate"):
        alpha, lim = getattr(module, "alpha", OAI_ALPHA), getattr(module, "limit", OAI_LIMIT)
        if not (math.isclose(float(alpha), OAI_ALPHA) and float(lim) == OAI_LIMIT):
            raise UnsupportedExperts(f"{name}: alpha={alpha}, limit={lim}; mokgen's swiglu_oai is alpha 1.702, "
                                     "limit 7")
        if concatenated is True:
            raise UnsupportedExperts(f"{name}: is_concatenated=True but its gate reads gate ::2 / up 1::2")
        kind, layout, act, limit = "gpt_oss", "interleaved", "swiglu_oai", None
    elif gate.endswith("DeepseekV4Experts._apply_gate"):
        lim = getattr(module, "limit", None)
        if not _is_silu(module) or lim is None or not float(lim) > 0:
            raise UnsupportedExperts(f"{name}: expected silu and a positive limit, got act_fn "
                                     f"{getattr(module, 'act_fn', None)!r}, limit {lim!r}")
        kind, layout, act, limit = "deepseek_v4", "concat", "swiglu", float(lim)
    else:
        raise UnsupportedExperts(f"{name}: its gate {gate} is not one mokgen computes (supported: transformers' "
                                 "default silu(gate) * up, GPT-OSS's, DeepSeek-V4's clamped SwiGLU)")
    return ExpertsLayout(kind=kind, transposed=bool(transposed), gate_up_layout=layout, bias=bool(has_bias),
                         activation=act, swiglu_limit=limit)


def _dims(module: torch.nn.Module, layout: ExpertsLayout) -> tuple[int, int, int]:
    """(E local, H, I) from the weight shapes (a DTensor's local shard), checked against each other."""
    gate_up, down = _local(module.gate_up_proj), _local(module.down_proj)
    if layout.transposed:
        E, H, I2 = gate_up.shape
        want_down = (E, I2 // 2, H)
    else:
        E, I2, H = gate_up.shape
        want_down = (E, H, I2 // 2)
    if I2 % 2 or tuple(down.shape) != want_down:
        raise UnsupportedExperts(f"{_cls(module)}: gate_up_proj {tuple(gate_up.shape)} and down_proj "
                                 f"{tuple(down.shape)} do not fit (transposed={layout.transposed})")
    if layout.bias:
        b1, b2 = _local(module.gate_up_proj_bias), _local(module.down_proj_bias)
        if tuple(b1.shape) != (E, I2) or tuple(b2.shape) != (E, H):
            raise UnsupportedExperts(f"{_cls(module)}: biases {tuple(b1.shape)} / {tuple(b2.shape)}, expected "
                                     f"{(E, I2)} / {(E, H)}")
    n = getattr(module, "num_experts", E)
    if n != E:
        raise UnsupportedExperts(f"{_cls(module)}: num_experts={n} but the weights hold {E} experts")
    return E, H, I2 // 2


def _config_experts(module: torch.nn.Module) -> int | None:
    cfg = getattr(module, "config", None)
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        v = getattr(cfg, name, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def spec_for(layout: ExpertsLayout, hidden: int, ffn: int, experts: int, topk: int, *, ep: int = 1,
             tokens: int | None = None, dtype: str | None = None) -> Spec:
    """The mokgen spec of one rank's experts: ``experts`` local experts (of ``experts * ep``), top-``topk``, in
    ``dtype`` (default :func:`configure`'s). The name depends on the shape, the math and the dtype only, so
    models of different families with one shape share a cache entry."""
    tokens = _OPTIONS.tokens if tokens is None else tokens
    dtype = _OPTIONS.dtype if dtype is None else dtype
    name = f"hf-h{hidden}-i{ffn}-e{experts}" + (f"x{ep}" if ep > 1 else "") + f"-k{topk}"
    if layout.activation == "swiglu_oai":
        name += "-oai"
    else:
        if layout.swiglu_limit is not None:
            name += f"-lim{layout.swiglu_limit:g}"
        if layout.gate_up_layout == "interleaved":
            name += "-il"
    if layout.bias and layout.activation != "swiglu_oai":
        name += "-bias"
    if dtype != "bf16":
        name += f"-{dtype}"
    return Spec(name=name, hidden=hidden, ffn=ffn, experts=experts * ep, ep=ep, topk=topk, tokens=tokens,
                shared_experts=0, activation=layout.activation, swiglu_limit=layout.swiglu_limit,
                gate_up_layout=layout.gate_up_layout, bias=layout.bias, dtype=dtype,
                archs=("sm_100a",) if dtype == "mxfp8" else ("sm_90a",))


def derive_spec(module: torch.nn.Module, topk: int | None = None, *, tokens: int | None = None) -> Spec:
    """The spec for an experts module (``topk``: the call's K; default the config's ``num_experts_per_tok``).
    Raises :class:`UnsupportedExperts` for what mokgen cannot compute (the spec's own bounds included)."""
    layout = layout_of(module)
    E, H, I = _dims(module, layout)
    if topk is None:
        topk = getattr(getattr(module, "config", None), "num_experts_per_tok", None)
        if not isinstance(topk, int):
            raise UnsupportedExperts(f"{_cls(module)}: no topk given and no config.num_experts_per_tok")
    total = _config_experts(module)
    ep = total // E if total is not None and total > E and total % E == 0 else 1
    try:
        return spec_for(layout, H, I, E, topk, ep=ep, tokens=tokens)
    except SpecError as e:
        raise UnsupportedExperts(f"{_cls(module)} (H={H}, I={I}, {E} experts, top-{topk}): {e}") from None


# --------------------------------------------------------------------------------------------------------------
# weights


@torch.no_grad()
def relayout_(module: torch.nn.Module) -> bool:
    """For a transposed layout (GPT-OSS): store ``gate_up_proj`` / ``down_proj`` so that their transposes (the
    mokgen weights) are contiguous: ``p.data = p.data.transpose(1, 2).contiguous().transpose(1, 2)``, once. The
    Parameters keep their identity, names and shapes (only the strides change); their existing ``.grad`` are
    relaid the same way. True if something was relaid. DTensors are left alone (a copy per call then)."""
    layout = layout_of(module)
    if not layout.transposed:
        return False
    done = False
    for name in ("gate_up_proj", "down_proj"):
        p = getattr(module, name)
        if type(p).__name__ == "DTensor" or p.transpose(1, 2).is_contiguous():
            continue
        p.data = p.data.transpose(1, 2).contiguous().transpose(1, 2)
        if p.grad is not None:
            p.grad = p.grad.transpose(1, 2).contiguous().transpose(1, 2)
        done = True
    return done


def _as_mokgen(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` as a contiguous ``dtype`` tensor: itself when it is one, else one (differentiable) copy. ``dtype``
    None: ``t`` as it is (the layout mapping alone, for tests in float64)."""
    if dtype is None or (t.dtype == dtype and t.is_contiguous()):
        return t
    if t.dtype == dtype:
        return t.contiguous()
    return t.to(dtype=dtype, memory_format=torch.contiguous_format).contiguous()   # one copy (a no-op contiguous)


def mokgen_weights(module: torch.nn.Module, layout: ExpertsLayout | None = None, *,
                   dtype: torch.dtype | None = torch.bfloat16
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(w1 [E, 2I, H], w2 [E, H, I], b1 [E, 2I] | None, b2 [E, H] | None)`` in mokgen's layout for this call.
    Views of the module's parameters where the layout allows (the concat families, and GPT-OSS after
    :func:`relayout_`), differentiable copies otherwise (a one-time warning names them): w1 / w2 as contiguous
    ``dtype`` (bf16, mokgen's), biases fp32. ``dtype=None``: the views only, in the parameters' dtype and
    strides (the layout mapping without the kernels' dtype rules)."""
    layout = layout or layout_of(module)
    gate_up, down = _local(module.gate_up_proj), _local(module.down_proj)
    if layout.transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    b1 = b2 = None
    if layout.bias:
        b1, b2 = _local(module.gate_up_proj_bias), _local(module.down_proj_bias)
    if dtype is None:
        return gate_up, down, b1, b2
    if not (gate_up.is_contiguous() and down.is_contiguous()):
        _warn_once(f"layout-copy:{_cls(module)}",
                   f"mokgen: {_cls(module)}'s expert weights are copied on every call to make them contiguous in "
                   "mokgen's layout (no relayout: configure(relayout=False), DTensor weights, or non-contiguous "
                   "parameters); mokgen.integrations.transformers.prepare(model) relayouts them once")
    if gate_up.dtype != dtype or down.dtype != dtype:
        _warn_once(f"cast:{gate_up.dtype}",
                   f"mokgen: expert weights are {gate_up.dtype}; they are cast to {dtype} on every call (mokgen "
                   "computes in bf16 with fp32 accumulation, as under autocast). Keep bf16 weights to avoid the copy.")
    w1, w2 = _as_mokgen(gate_up, dtype), _as_mokgen(down, dtype)
    if layout.bias:
        b1, b2 = _as_mokgen(b1, torch.float32), _as_mokgen(b2, torch.float32)
    return w1, w2, b1, b2


# --------------------------------------------------------------------------------------------------------------
# compiled kernels


_KERNELS = CompiledSpecs(lambda: _OPTIONS.overrides)
_COMPILED = _KERNELS.objects   # spec -> CompiledMoE of this binding (read by check_errors and the GPU tests)


def set_compiler(fn: Callable[[Spec], Any] | None) -> Callable[[Spec], Any]:
    """Set the factory that turns a spec into a ``CompiledMoE`` (None: ``mokgen.compile``); returns the previous
    one and forgets the objects the previous one made."""
    return _KERNELS.set_factory(fn)


def compiled_for(spec: Spec) -> Any:
    """The ``CompiledMoE`` of ``spec`` (built or loaded through mokgen's cache once per process)."""
    return _KERNELS.get(spec)


def check_errors() -> None:
    """Raise :class:`mokgen.RoutingError` if any call of this backend since the last check saw a bad expert id
    (negative, or in ``configure(masked=False)`` also ``>= num_experts``). One host sync per device."""
    for moe in list(_COMPILED.values()):
        moe.check_errors()


# --------------------------------------------------------------------------------------------------------------
# the backend


@dataclass
class _State:
    """What a module keeps between calls (a plain attribute: not a parameter, buffer or submodule)."""

    epoch: int
    layout: ExpertsLayout
    specs: dict[int, Spec] = field(default_factory=dict)


_ATTR = "_mokgen_hf_state"


def _state(module: torch.nn.Module) -> _State:
    st = module.__dict__.get(_ATTR)
    if st is None or st.epoch != _KERNELS.epoch:
        st = _State(_KERNELS.epoch, layout_of(module))
        module.__dict__[_ATTR] = st
    return st


def _spec_of(module: torch.nn.Module, st: _State, topk: int) -> Spec:
    spec = st.specs.get(topk)
    if spec is None:
        spec = st.specs[topk] = derive_spec(module, topk)
    return spec


def experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts interface: ``[T, H]`` (or ``[..., H]``) hidden states, ``[T, K]`` expert ids and
    routing weights -> ``[T, H]`` in ``hidden_states.dtype``, through :func:`mokgen.moe_forward`."""
    st = _state(self)
    H = hidden_states.shape[-1]
    K = top_k_index.shape[-1]
    spec = _spec_of(self, st, K)
    if H != spec.hidden:
        raise ops.MoEInputError(f"mokgen {spec.name}: hidden_states has {H} features, the experts {spec.hidden}")
    moe = compiled_for(spec)
    if st.layout.transposed and _OPTIONS.relayout and not self.gate_up_proj.transpose(1, 2).is_contiguous():
        relayout_(self)   # once (or again after the parameters were replaced)
    w1, w2, b1, b2 = mokgen_weights(self, st.layout)
    x = _as_mokgen(hidden_states.reshape(-1, H), torch.bfloat16)
    idx = _as_mokgen(top_k_index.reshape(-1, K), torch.int32)   # int64 from torch.topk: one small cast
    w = _as_mokgen(top_k_weights.reshape(-1, K), torch.float32)
    y = ops.moe_forward(x, idx, w, w1, w2, b1, b2, moe=moe, masked=_OPTIONS.masked)
    return y.to(hidden_states.dtype).reshape(hidden_states.shape)


def _registered_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return experts_forward(self, hidden_states, top_k_index, top_k_weights)


def register() -> bool:
    """Register ``"mokgen"`` in transformers' ``ExpertsInterface`` (done when this module is imported). False
    when the installed transformers has no experts interface (use :func:`apply`)."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        return False
    ExpertsInterface.register(KEY, experts_forward)
    return True


def registered() -> bool:
    """Is ``"mokgen"`` in transformers' ``ALL_EXPERTS_FUNCTIONS``?"""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return False
    return KEY in ALL_EXPERTS_FUNCTIONS


def _looks_like_experts(module: torch.nn.Module) -> bool:
    gate_up, down = _param(module, "gate_up_proj"), _param(module, "down_proj")
    return gate_up is not None and down is not None and gate_up.dim() == 3 and down.dim() == 3


def experts_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every fused experts module (3-D ``gate_up_proj`` and ``down_proj``) in ``model``."""
    for name, mod in model.named_modules():
        if _looks_like_experts(mod):
            yield name, mod


def prepare(model: torch.nn.Module) -> list[str]:
    """Check every experts module of ``model`` (raises :class:`UnsupportedExperts`) and relayout the transposed
    ones now (:func:`relayout_`; call it before DDP / FSDP wrapping or creating the optimizer). Returns the
    names of the experts modules."""
    names = []
    for name, mod in experts_modules(model):
        layout_of(mod)
        if _OPTIONS.relayout:
            relayout_(mod)
        names.append(name)
    return names


def apply(model: torch.nn.Module, *, tokens: int | None = None) -> list[str]:
    """Liger-style patch for transformers versions without the experts interface (works with it too): bind
    the mokgen backend as ``forward`` of every fused experts module of this model instance (checked and, if
    transposed, relaid first: :func:`prepare`). ``tokens``: :func:`configure`'s. Returns the patched modules'
    names; raises :class:`UnsupportedExperts` if a module cannot be computed, ``ValueError`` if there is none
    (transformers < 5 keeps experts as a ModuleList of per-expert MLPs, which is not supported)."""
    if tokens is not None:
        configure(tokens=tokens)
    names = prepare(model)
    if not names:
        lists = [n for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and n.endswith("experts")]
        hint = (f" ({lists[0]} is a ModuleList of per-expert MLPs, transformers < 5: mokgen needs the fused "
                "[E, 2I, H] weights)") if lists else ""
        raise ValueError(f"mokgen: no fused experts module (3-D gate_up_proj / down_proj) in "
                         f"{type(model).__name__}{hint}")
    for _name, mod in experts_modules(model):
        mod.forward = types.MethodType(_registered_forward, mod)
    return names


def unapply(model: torch.nn.Module) -> list[str]:
    """Undo :func:`apply` (the relaid storage stays; it computes the same). Returns the modules' names."""
    return restore_forward(experts_modules(model), _registered_forward)


register()
