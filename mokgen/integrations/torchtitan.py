"""mokgen as torchtitan's grouped experts (``pip install 'mokgen[torchtitan]'``; written against torchtitan 0.3.0).

    import mokgen.integrations.torchtitan as mtt
    mtt.apply(model)          # every GroupedExperts module of the model computes through mokgen

torchtitan's ``GroupedExperts.forward(x [R, D], num_tokens_per_expert [E])`` receives rows already sorted by
expert (its token dispatcher permuted them; the routing scores are applied in the dispatcher's ``combine``, not
in the experts) and runs three ``torch._grouped_mm`` calls: ``silu(x W1^T) * (x W3^T)``, then ``W2^T``, in bf16,
returning ``type_as(x)``. :func:`experts_forward` computes the same on :func:`mokgen.integrations.grouped.
grouped_experts` (forward and backward on mokgen's kernels, counts kept on the device, deterministic).

Weights (torchtitan 0.3.0 names; 0.1 / 0.2 called them ``w1`` / ``w2`` / ``w3``, same shapes, also accepted):

* ``w1_EFD [E, F, D]`` gate, ``w3_EFD [E, F, D]`` up, ``w2_EDF [E, D, F]`` down (F = hidden_dim, D = dim).
* mokgen's ``w1 [E, 2F, D]`` is, per expert, the F gate rows then the F up rows: ``cat(w1_EFD, w3_EFD, dim=1)``.
  mokgen's ``w2 [E, D, F]`` *is* ``w2_EDF`` (no copy for bf16 parameters).

How w1 / w3 become mokgen's w1: **a copy per call**, written once (:func:`mokgen.integrations.grouped.cat_cast`).
Its cost, per layer and training step, with bf16 parameters: the forward reads w1_EFD and w3_EFD and writes the
``2 E F D``-element bf16 w1 (``4 E F D`` bytes read, ``4 E F D`` written), and the backward copies dW1's two
halves into contiguous gradients (the same again): ``16 E F D`` bytes moved (2.95 GB for E=64, F=1408, D=2048,
about 0.7 ms at 4 TB/s) and ``4 E F D`` bytes of transient memory. With fp32 parameters (no FSDP mixed
precision) torchtitan's own forward casts every weight with ``.bfloat16()``, and the cat is fused into that
cast (one write of bf16 w1): nothing extra. Why not (a) a one-time re-parametrization: in torchtitan the expert
weights do not keep their storage. FSDP2 all-gathers unsharded w1 / w3 into fresh per-parameter tensors every
forward, TP shards w1 / w3 along F (``Shard(1)``) separately, the model is built on the meta device and
materialized with ``to_empty``, and DCP checkpoints and the HF state-dict adapters name ``w1_EFD`` /
``w3_EFD``. A fused ``w13`` parameter would break the checkpoints and the sharding plan (all gate rows on one
TP rank, all up rows on the other); making w1_EFD / w3_EFD views into one ``[E, 2F, D]`` buffer would be undone
by each of the others, and would save only the forward half (a gradient of such a strided parameter must be
contiguous, so autograd copies it anyway). Under TP each rank's local shards ``[gate_local; up_local]`` are
exactly the SwiGLU of its F slice, so the mapping holds per rank (not run on several GPUs).

The per-call copy is not kept for the backward: the autograd graph keeps a function that rebuilds it from
w1_EFD / w3_EFD (``grouped_experts(rebuild=...)``), so the layer holds no second copy of its weights between
forward and backward (under FSDP2 the unsharded parameters are all-gathered again for the backward, as for
torchtitan's own experts). The rebuild is one more forward-side copy in the backward (``8 E F D`` bytes moved).

Parameters that are DTensors (FSDP / TP / EP) are used through ``to_local()``, as torchtitan does.

Testing without a GPU: :func:`mokgen.integrations.grouped.set_compiler` with ``reference_compiler()``.
torchtitan 0.3.0 needs ``triton`` to import (its token dispatcher imports its Triton kernels at import time;
torchtitan does not declare it): present with CUDA builds of torch, missing next to the CPU wheel.
"""

from __future__ import annotations

import types
from typing import Iterator

import torch

from . import grouped
from .common import restore_forward

__all__ = ["UnsupportedExperts", "weight_names", "mokgen_weights", "experts_forward", "apply", "unapply",
           "experts_modules"]

# (gate, down, up) parameter names: torchtitan 0.3.0's shape-suffixed names, then the older plain ones
_NAMES = (("w1_EFD", "w2_EDF", "w3_EFD"), ("w1", "w2", "w3"))


class UnsupportedExperts(ValueError):
    """A module that is not torchtitan's SwiGLU GroupedExperts (the message says why)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    if type(t).__name__ == "DTensor" and hasattr(t, "to_local"):
        return t.to_local()
    return t


def _param(module: torch.nn.Module, name: str) -> torch.Tensor | None:
    t = getattr(module, name, None)
    return t if isinstance(t, torch.Tensor) else None


def weight_names(module: torch.nn.Module) -> tuple[str, str, str]:
    """(gate, down, up) parameter names of a torchtitan GroupedExperts, or :class:`UnsupportedExperts`."""
    for names in _NAMES:
        ts = [_param(module, n) for n in names]
        if all(t is not None and t.dim() == 3 for t in ts):
            return names
    raise UnsupportedExperts(f"{type(module).__name__}: expected 3-D expert weights w1_EFD / w2_EDF / w3_EFD "
                             "(torchtitan 0.3) or w1 / w2 / w3 (earlier torchtitan)")


def mokgen_weights(module: torch.nn.Module, dtype: torch.dtype | None = torch.bfloat16
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w1 [E, 2F, D], w2 [E, D, F])`` in mokgen's layout for this call: w1 = ``cat(gate, up, dim=1)`` (one
    differentiable copy, cast to ``dtype`` on the way), w2 the down weight itself (cast when not ``dtype``).
    ``dtype=None``: in the parameters' dtype (the layout mapping alone, for float64 checks)."""
    gn, dn, un = weight_names(module)
    gate, down, up = (_local(getattr(module, n)) for n in (gn, dn, un))
    E, F, D = gate.shape
    if tuple(up.shape) != (E, F, D) or tuple(down.shape) != (E, D, F):
        raise UnsupportedExperts(f"{type(module).__name__}: {gn} {tuple(gate.shape)}, {un} {tuple(up.shape)}, "
                                 f"{dn} {tuple(down.shape)}: expected [E, F, D], [E, F, D], [E, D, F]")
    if bias_names := [n for n in ("b1", "b2", "b3", "mlp1_bias", "mlp2_bias") if _param(module, n) is not None]:
        raise UnsupportedExperts(f"{type(module).__name__}: has biases {bias_names} (torchtitan's gpt-oss experts); "
                                 "this adapter maps the bias-free SwiGLU GroupedExperts")
    dt = dtype if dtype is not None else torch.promote_types(gate.dtype, up.dtype)
    w1 = grouped.cat_cast([gate, up], 1, dt)
    w2 = down if dtype is None or (down.dtype == dtype and down.is_contiguous()) else \
        down.to(dtype=dtype, memory_format=torch.contiguous_format)
    return w1, w2


def experts_forward(self: torch.nn.Module, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """torchtitan's ``GroupedExperts.forward(x [R, D], num_tokens_per_expert [E])`` through mokgen; returns
    ``[R, D]`` in ``x.dtype`` (torchtitan's ``type_as(x)``)."""
    w1, w2 = mokgen_weights(self)
    gn, dn, un = weight_names(self)
    gate, down, up = (_local(getattr(self, n)) for n in (gn, dn, un))
    rebuild = {"w1": (lambda: grouped.cat_cast([gate, up], 1, torch.bfloat16), (gate, up))}
    if w2 is not down:   # a cast copy (fp32 parameters): rebuilt too
        rebuild["w2"] = (lambda: down.to(torch.bfloat16), (down,))
    return grouped.grouped_experts(x, num_tokens_per_expert, w1, w2, rebuild=rebuild)


def _patched_forward(self: torch.nn.Module, x: torch.Tensor, num_tokens_per_expert: torch.Tensor,
                     *args, **kwargs) -> torch.Tensor:
    return experts_forward(self, x, num_tokens_per_expert)


def experts_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every torchtitan GroupedExperts in ``model`` (by class name, or the module itself)."""
    for name, mod in model.named_modules():
        if type(mod).__name__ == "GroupedExperts":
            yield name, mod


def apply(model: torch.nn.Module) -> list[str]:
    """Bind :func:`experts_forward` as ``forward`` of every ``GroupedExperts`` in ``model`` (the model itself may
    be one), checking each first. Returns their names; ``ValueError`` if there is none. Parameters, names,
    sharding plans and checkpoints stay torchtitan's. Apply before ``torch.compile`` of the model."""
    mods = list(experts_modules(model))
    if not mods:
        raise ValueError(f"mokgen: no torchtitan GroupedExperts module in {type(model).__name__}")
    for _name, mod in mods:
        weight_names(mod)
        mod.forward = types.MethodType(_patched_forward, mod)
    return [n for n, _ in mods]


def unapply(model: torch.nn.Module) -> list[str]:
    """Undo :func:`apply`. Returns the names of the modules restored."""
    return restore_forward(experts_modules(model), _patched_forward)
