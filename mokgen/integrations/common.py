"""What the framework bindings share: the CPU stand-in for compiled kernels (tests on machines without a GPU)
and undoing a forward patch."""

from __future__ import annotations

import types
from typing import Any, Callable, Iterable

import torch

from .. import ops
from ..spec import Spec


def reference_compiler(bm: int = 16) -> Callable[[Spec], Any]:
    """A factory of CPU ``CompiledMoE`` objects running mokgen's launch sequence with the reference kernels of
    :mod:`mokgen.reference` (training included), routing tile ``bm``: for tests on machines without a GPU."""
    from .. import reference

    def make(spec: Spec) -> Any:
        return ops.CompiledMoE(spec, bm, functions=reference.reference_kernels(spec, bm, training=True),
                               allow_cpu=True)

    return make


def restore_forward(modules: Iterable[tuple[str, torch.nn.Module]], patched: Callable[..., Any]) -> list[str]:
    """Remove the instance-level ``forward`` bound to ``patched`` from each module that has one (what an
    integration's ``apply`` set); returns those modules' names."""
    names = []
    for name, mod in modules:
        fwd = mod.__dict__.get("forward")
        if isinstance(fwd, types.MethodType) and fwd.__func__ is patched:
            del mod.__dict__["forward"]
            names.append(name)
    return names
