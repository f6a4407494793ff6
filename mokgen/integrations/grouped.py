"""A grouped-experts op for frameworks that dispatch tokens themselves (torchtitan, Megatron-core).

Those frameworks hand their experts module rows that are already sorted by expert plus the per-expert counts
(torchtitan: ``GroupedExperts.forward(x, num_tokens_per_expert)``; Megatron-core: ``experts.forward(
permuted_local_hidden_states, tokens_per_expert, permuted_probs)``). :func:`grouped_experts` computes the
SwiGLU MLP of each row with its expert's weights, forward and backward on mokgen's GEMM kernels:

    y = mokgen.integrations.grouped.grouped_experts(x, counts, w1, w2, probs=None)

* ``x [N, H]`` (bf16; other float dtypes are cast, and y comes back in ``x.dtype``), rows sorted by expert:
  rows ``[sum(counts[:e]), sum(counts[:e+1]))`` belong to expert ``e``;
* ``counts [E]`` integer, on x's device or on the CPU (Megatron may keep ``tokens_per_expert`` there);
* ``w1 [E, 2I, H]`` (mokgen's layout: per expert the I gate rows, then the I up rows; ``gate_up_layout=
  "interleaved"``: gate 2j, up 2j+1), ``w2 [E, H, I]``, optional fp32 biases ``b1 [E, 2I]``, ``b2 [E, H]``;
* ``probs [N]`` or ``[N, 1]`` (optional): row r's output is scaled by ``probs[r]`` (after W2 and b2, as
  Megatron's experts scale the activation and the fc2 bias; on the GEMM 2 epilogue in fp32); it gets a gradient.

**No new kernel.** Sorted rows with counts are exactly an MoE layer with top-1 routing: row r is token r, its
one slot goes to expert ``e(r)`` with weight ``probs[r]`` (or 1). The spec is ``topk: 1, experts: E, ep: 1,
shared_experts: 0`` (:func:`grouped_spec`), and the call is :func:`mokgen.moe_forward`; autograd then gives dx,
dprobs (the router-weight gradient mokgen computes anyway), dW1, dW2 (and db1, db2) from the generated
backward kernels: no float atomics, bitwise deterministic.

**Row order.** ``e(r)`` is computed on the device from the counts (:func:`expert_ids`: a cumsum and a
``searchsorted`` of the row numbers, no host sync). mokgen's routing kernel groups slots by expert stably in
token order (docs/contract.md), so for sorted rows its permuted row space is the input's own order with each
group padded to the routing tile; the combine kernel writes row r's result to ``y[r]`` through ``slot_pos``, so
the output rows are the input rows whatever the permutation (the order only decides which rows share a tile).
Cost next to a grouped GEMM on the sorted rows: the routing kernel (N slots) and the combine's copy of the
output (N x H bf16), plus GEMM 1 reading x through the row indices.

**Counts.** They must sum to N and be >= 0. On x's device this is checked on the device, without a sync: if it
fails, every row gets the id E (out of range), the kernels drop every row (y = 0, zero gradients) and set the
routing error flag, which :func:`check_errors` (or ``CompiledMoE.check_errors``) raises as a
:class:`CountsError` (a ``mokgen.RoutingError``). Counts on the CPU with x on a GPU are checked on the host
right away (they are there already: no sync) and copied to the device with ``non_blocking=True`` (E integers).

**Weights rebuilt, not kept.** The framework adapters hand this op weights that are per-call copies (torchtitan's
``cat(w1, w3)``, Megatron's stacked per-expert weights). mokgen's backward needs w1 and w2 again, and saving the
copies would hold a second copy of the expert weights from the forward to the backward (and, under FSDP, an
unsharded one). ``rebuild={"w1": fn, ...}`` names a function that recomputes a weight from the parameters: the
autograd graph then keeps the function instead of the tensor (a ``saved_tensors_hooks`` pair that passes
every other saved tensor on to the hooks already active, e.g. activation checkpointing's), and the backward
calls it once (one more copy of that weight's bytes). The rebuild refuses to run if a parameter it reads was
modified in place since the forward (autograd's version-counter rule). Under ``torch.compile`` tracing the
hooks are skipped and the copies are saved.

**Kernels.** One spec per (H, I, E, activation, layout, bias), compiled once through mokgen's cache
(:func:`compiled_for`; ``tokens`` = :func:`configure`'s ``tokens``, default 16384 rows: the row count the plan
is chosen for, not a capacity: N varies per call without a recompile). :func:`set_compiler` /
:func:`reference_compiler` swap the factory (CPU tests: the reference kernels of :mod:`mokgen.reference`).

Framework adapters built on this op: :mod:`mokgen.integrations.torchtitan`, :mod:`mokgen.integrations.megatron`.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from .. import ops
from .common import CompiledSpecs, reference_compiler
from ..spec import DTYPES, Spec, SpecError

__all__ = [
    "DEFAULT_TOKENS",
    "CountsError",
    "Options",
    "configure",
    "options",
    "grouped_spec",
    "expert_ids",
    "grouped_experts",
    "cat_cast",
    "stack_cast",
    "set_compiler",
    "reference_compiler",
    "compiled_for",
    "check_errors",
]

DEFAULT_TOKENS = 16384


class CountsError(ops.RoutingError):
    """Expert counts that do not sum to the row count (or are negative): every row of that call was dropped."""


@dataclass
class Options:
    """The op's settings (:func:`configure`)."""

    tokens: int = DEFAULT_TOKENS                   # the row count N the plan is chosen for (any N runs)
    overrides: Mapping[str, Any] | None = None     # plan overrides for mokgen.compile
    dtype: str = "bf16"                            # the GEMMs' precision: "bf16", "fp8" (Hopper), "mxfp8" (sm_100a)


_OPTIONS = Options()
_WARNED: set[str] = set()


def options() -> Options:
    """The current settings (a copy)."""
    return dataclasses.replace(_OPTIONS)


def configure(*, tokens: int | None = None, overrides: Mapping[str, Any] | None = None,
              dtype: str | None = None) -> Options:
    """Change the settings given; returns the previous ones. ``tokens``: the row count per call you expect
    (tokens x top-k routed to this rank's experts; it picks the plan and bounds the spec's memory check).
    ``overrides``: plan overrides for ``mokgen.compile`` (``{}``: back to the solver's or the tuned plan).
    ``dtype``: the GEMMs' precision, the spec's ``dtype`` (``"bf16"``; ``"fp8"``: Hopper's blockwise e4m3, the
    operands quantized per call from the bf16 weights and rows, outputs and gradients bf16; ``"mxfp8"``:
    sm_100a's)."""
    global _OPTIONS
    old = options()
    new = dataclasses.replace(old)
    if tokens is not None:
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"tokens must be a positive int, got {tokens!r}")
        new.tokens = tokens
    if overrides is not None:
        new.overrides = dict(overrides) or None
    if dtype is not None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        new.dtype = dtype
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
# spec and kernels


def grouped_spec(hidden: int, ffn: int, experts: int, *, activation: str = "swiglu",
                 swiglu_limit: float | None = None, gate_up_layout: str = "concat", bias: bool = False,
                 tokens: int | None = None, dtype: str | None = None) -> Spec:
    """The top-1 spec of a grouped-experts call: ``experts`` groups (all local: ep 1), no shared experts, in
    ``dtype`` (default :func:`configure`'s). The name depends on the shape, the math and the dtype only, so
    every layer of one shape shares a cache entry."""
    tokens = _OPTIONS.tokens if tokens is None else tokens
    dtype = _OPTIONS.dtype if dtype is None else dtype
    name = f"grouped-h{hidden}-i{ffn}-e{experts}"
    if activation == "swiglu_oai":
        name += "-oai"
    elif swiglu_limit is not None:
        name += f"-lim{swiglu_limit:g}"
    if gate_up_layout == "interleaved":
        name += "-il"
    if bias and activation != "swiglu_oai":
        name += "-bias"
    if dtype != "bf16":
        name += f"-{dtype}"
    return Spec(name=name, hidden=hidden, ffn=ffn, experts=experts, ep=1, topk=1, tokens=tokens,
                shared_experts=0, activation=activation, swiglu_limit=swiglu_limit,
                gate_up_layout=gate_up_layout, bias=bias, dtype=dtype,
                archs=("sm_100a",) if dtype == "mxfp8" else ("sm_90a",))


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
    """Raise :class:`CountsError` if a call since the last check had counts that do not sum to its row count
    (or negative counts): those calls dropped every row. One host sync per device."""
    for moe in list(_COMPILED.values()):
        try:
            moe.check_errors()
        except ops.RoutingError as e:
            raise CountsError(f"mokgen grouped experts ({getattr(moe, 'name', '?')}): since the last check, a call's "
                              "counts did not sum to its row count (or held a negative count); every row of "
                              f"that call was dropped (output 0, zero gradients). [{e}]") from None


# --------------------------------------------------------------------------------------------------------------
# counts -> expert ids


def _counts_error(counts: Sequence[int], rows: int) -> str | None:
    neg = [i for i, c in enumerate(counts) if c < 0]
    if neg:
        return f"counts[{neg[0]}] = {counts[neg[0]]} is negative"
    total = sum(counts)
    if total != rows:
        return f"counts sum to {total}, but x has {rows} rows"
    return None


def expert_ids(counts: torch.Tensor, rows: int, device: torch.device | str) -> torch.Tensor:
    """``[rows, 1]`` int32 expert id of each row of a sorted batch (rows of expert e after those of e-1), on
    ``device``, from ``counts [E]``, without a host sync when ``counts`` is on ``device``: ``searchsorted(
    cumsum(counts), arange(rows), right=True)``. Counts that do not sum to ``rows`` (or a negative count) make
    every id ``E``, which the routing kernel drops and reports (:func:`check_errors`). ``counts`` on the CPU
    with a CUDA ``device``: checked on the host (:class:`mokgen.MoEInputError` at once) and copied over
    (``non_blocking=True``)."""
    if not isinstance(counts, torch.Tensor) or counts.dim() != 1 or counts.is_floating_point() \
            or counts.is_complex() or counts.dtype == torch.bool:
        got = f"{tuple(counts.shape)} {counts.dtype}" if isinstance(counts, torch.Tensor) else type(counts).__name__
        raise ops.MoEInputError(f"mokgen grouped experts: counts must be a 1-D integer tensor [E], got {got}")
    device = torch.device(device)
    E = counts.shape[0]
    if counts.device.type == "cpu" and device.type != "cpu":
        why = _counts_error(counts.tolist(), rows)   # host memory: no device sync
        if why is not None:
            raise ops.MoEInputError(f"mokgen grouped experts: {why}")
        counts = counts.to(device=device, non_blocking=True)
    elif counts.device != device:
        counts = counts.to(device=device)
    ends = torch.cumsum(counts, 0)                                     # int64 [E]
    r = torch.arange(rows, device=device, dtype=ends.dtype)
    ids = torch.searchsorted(ends, r, right=True, out_int32=True)      # in [0, E]
    if E:
        ok = (ends[-1] == rows) & (counts >= 0).all()                  # device bools: no sync
        ids = torch.where(ok, ids, torch.full_like(ids, E))
    return ids.reshape(rows, 1)


# --------------------------------------------------------------------------------------------------------------
# weight helpers (differentiable copies that write their output once)


class _CatCast(torch.autograd.Function):
    """``cat(parts, dim)`` written straight into one ``dtype`` buffer (each part's cast fused with the copy);
    backward: each part's slice of the gradient as a contiguous tensor in that part's dtype (one copy each)."""

    @staticmethod
    def forward(ctx, dim: int, dtype: torch.dtype, *parts: torch.Tensor) -> torch.Tensor:
        shape = list(parts[0].shape)
        sizes = [p.shape[dim] for p in parts]
        shape[dim] = sum(sizes)
        out = torch.empty(shape, dtype=dtype, device=parts[0].device)
        start = 0
        for p, n in zip(parts, sizes):
            out.narrow(dim, start, n).copy_(p)
            start += n
        ctx.dim, ctx.sizes, ctx.dtypes = dim, sizes, [p.dtype for p in parts]
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        outs, start = [], 0
        for n, dt in zip(ctx.sizes, ctx.dtypes):
            outs.append(grad.narrow(ctx.dim, start, n).to(dtype=dt, memory_format=torch.contiguous_format))
            start += n
        return (None, None, *outs)


def cat_cast(parts: Sequence[torch.Tensor], dim: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``torch.cat(parts, dim)`` as a contiguous ``dtype`` tensor, differentiable: one write of the output in the
    forward (fp32 parts are cast as they are copied: the traffic of the casts alone) and one contiguous copy per
    part in the backward (its gradient slice, in its own dtype)."""
    return _CatCast.apply(dim, dtype, *parts)


def stack_cast(parts: Sequence[torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``torch.stack(parts)`` as a contiguous ``dtype`` tensor, differentiable (one copy of the parts in the
    forward; the backward hands each part its contiguous slice of the gradient: no copy for ``dtype`` parts)."""
    if all(p.dtype == dtype for p in parts):
        return torch.stack(list(parts))
    return cat_cast([p.unsqueeze(0) for p in parts], 0, dtype)


# --------------------------------------------------------------------------------------------------------------
# rebuilding weights in the backward instead of saving them


class _Rebuild:
    """What the autograd graph keeps instead of a weight copy: the function that recomputes it, and the
    versions of the tensors it reads (checked when it runs)."""

    __slots__ = ("fn", "name", "sources", "versions")

    def __init__(self, fn: Callable[[], torch.Tensor], name: str, sources: Sequence[torch.Tensor]):
        self.fn, self.name = fn, name
        self.sources = list(sources)
        self.versions = [t._version for t in self.sources]

    def __call__(self) -> torch.Tensor:
        for t, v in zip(self.sources, self.versions):
            if t._version != v:
                raise RuntimeError(f"mokgen grouped experts: a parameter {self.name} is rebuilt from was modified "
                                   f"in place between the forward and the backward (version {v} -> "
                                   f"{t._version}); the backward would use other weights than the forward")
        with torch.no_grad():
            return self.fn()


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a is b:
        return True
    try:
        return (a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
                and a.storage_offset() == b.storage_offset() and a.device == b.device
                and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):   # tensors without a storage (fake, functional)
        return False


def _outer_hooks():
    top = getattr(getattr(torch._C, "_autograd", None), "_top_saved_tensors_default_hooks", None)
    if top is None:
        return None
    try:
        return top(False)
    except Exception:  # noqa: BLE001 - an older signature: behave as if there were none
        return None


class _RebuildHooks(torch.autograd.graph.saved_tensors_hooks):
    """Pack the listed tensors as :class:`_Rebuild` recipes; every other saved tensor goes to the hooks that were
    active before (or is kept as is)."""

    def __init__(self, recipes: list[tuple[torch.Tensor, _Rebuild]]):
        outer = _outer_hooks()
        outer_pack, outer_unpack = outer if outer is not None else (None, None)

        def pack(t: torch.Tensor) -> Any:
            for src, recipe in recipes:
                if _same_tensor(t, src):
                    return recipe
            return ("outer", outer_pack(t)) if outer_pack is not None else t

        def unpack(obj: Any) -> torch.Tensor:
            if isinstance(obj, _Rebuild):
                return obj()
            if isinstance(obj, tuple) and len(obj) == 2 and obj[0] == "outer":
                return outer_unpack(obj[1])
            return obj

        super().__init__(pack, unpack)


# --------------------------------------------------------------------------------------------------------------
# the op


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as a contiguous ``dtype`` tensor (itself when it is one; else one differentiable copy)."""
    if t.dtype == dtype and t.is_contiguous():
        return t
    return t.to(dtype=dtype, memory_format=torch.contiguous_format).contiguous()


def _err(msg: str) -> ops.MoEInputError:
    return ops.MoEInputError(f"mokgen grouped experts: {msg}")


def grouped_experts(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                    probs: torch.Tensor | None = None, b1: torch.Tensor | None = None,
                    b2: torch.Tensor | None = None, *, activation: str = "swiglu",
                    swiglu_limit: float | None = None, gate_up_layout: str = "concat",
                    rebuild: Mapping[str, tuple[Callable[[], torch.Tensor], Sequence[torch.Tensor]]] | None = None,
                    moe: Any = None) -> torch.Tensor:
    """``y [N, H]`` (in ``x.dtype``): row r through its expert's MLP, ``y[r] = p_r (W2[e] act(W1[e] x_r + b1[e])
    + b2[e])`` with ``e`` the expert whose count range holds r and ``p_r = probs[r]`` (1 without probs).
    Differentiable in x, probs, w1, w2, b1, b2 (mokgen's backward kernels). See the module docstring for the
    layouts, the row order and the counts check. ``moe``: a ``CompiledMoE`` of :func:`grouped_spec`'s spec
    (default: :func:`compiled_for` of the spec the shapes give). ``rebuild``: ``{"w1" | "w2" | "b1" | "b2":
    (fn, sources)}``: that argument is a copy that ``fn()`` recomputes bit for bit from ``sources`` (the
    parameters it reads); the backward calls it instead of keeping the copy (module docstring)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise _err(f"x must be [N, H], got {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if not isinstance(w1, torch.Tensor) or not isinstance(w2, torch.Tensor) or w1.dim() != 3 or w2.dim() != 3:
        raise _err("w1 must be [E, 2I, H] and w2 [E, H, I]")
    N, H = x.shape
    E, I2, H1 = w1.shape
    I = I2 // 2
    if H1 != H or I2 % 2 or tuple(w2.shape) != (E, H, I):
        raise _err(f"shapes do not fit: x {tuple(x.shape)}, w1 {tuple(w1.shape)} (want [E, 2I, H={H}]), w2 "
                   f"{tuple(w2.shape)} (want [E, H, I])")
    if isinstance(counts, torch.Tensor) and tuple(counts.shape) != (E,):
        raise _err(f"counts must be [E={E}] (one count per expert of w1), got {tuple(counts.shape)}")
    bias = b1 is not None or b2 is not None
    if bias and (b1 is None or b2 is None):
        raise _err("give both b1 [E, 2I] and b2 [E, H], or neither")
    if moe is None:
        try:
            spec = grouped_spec(H, I, E, activation=activation, swiglu_limit=swiglu_limit,
                                gate_up_layout=gate_up_layout, bias=bias)
        except SpecError as e:
            raise _err(f"H={H}, I={I}, {E} experts: {e}") from None
        moe = compiled_for(spec)
    dev = x.device
    idx = expert_ids(counts, N, dev)
    if probs is None:
        w = torch.ones((N, 1), dtype=torch.float32, device=dev)
    else:
        if not isinstance(probs, torch.Tensor) or probs.numel() != N or probs.dim() not in (1, 2) \
                or (probs.dim() == 2 and probs.shape[1] != 1):
            raise _err(f"probs must be [N={N}] or [N, 1], got "
                       f"{tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__}")
        w = _as(probs.reshape(N, 1), torch.float32)
    if w1.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16:
        _warn_once(f"cast:{w1.dtype}:{w2.dtype}",
                   f"mokgen grouped experts: expert weights are {w1.dtype} / {w2.dtype}; they are cast to bfloat16 "
                   "on every call (mokgen computes in bf16 with fp32 accumulation, as under autocast)")
    xb = _as(x, torch.bfloat16)
    w1b, w2b = _as(w1, torch.bfloat16), _as(w2, torch.bfloat16)
    if bias:
        b1, b2 = _as(b1, torch.float32), _as(b2, torch.float32)
    args = dict(w1=w1b, w2=w2b, b1=b1, b2=b2)
    recipes = []
    for name, (fn, sources) in (rebuild or {}).items():
        if name not in args:
            raise _err(f"rebuild: unknown argument {name!r} (w1, w2, b1 or b2)")
        if args[name] is not None:
            dt = args[name].dtype
            recipes.append((args[name], _Rebuild(lambda f=fn, dt=dt: _as(f(), dt), name, sources)))
    if not recipes or not torch.is_grad_enabled() or torch.compiler.is_compiling():
        y = ops.moe_forward(xb, idx, w, w1b, w2b, b1, b2, moe=moe)
    else:
        try:
            with _RebuildHooks(recipes):
                y = ops.moe_forward(xb, idx, w, w1b, w2b, b1, b2, moe=moe)
        finally:
            recipes.clear()   # the graph keeps the hooks (and so their closure): drop the copies it must not keep
    return y if y.dtype == x.dtype else y.to(x.dtype)
