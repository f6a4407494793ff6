"""What the framework bindings share: their compiled kernels per spec (made once, by a factory tests can swap),
the CPU stand-in for compiled kernels (tests on machines without a GPU), and undoing a forward patch."""

from __future__ import annotations

import threading
import types
from typing import Any, Callable, Iterable, Mapping

import torch

from .. import ops
from ..spec import Spec


class CompiledSpecs:
    """A binding's compiled kernels: spec -> ``CompiledMoE``, each made once per process by a factory (by default
    ``mokgen.compile`` with the binding's plan overrides, or one set by :meth:`set_factory`, e.g.
    :func:`reference_compiler`). :meth:`drop` forgets
    them (new options mean other specs or plans); ``epoch`` counts the drops, for callers that cache state derived
    from these objects."""

    def __init__(self, overrides: Callable[[], Mapping[str, Any] | None]):
        """``overrides``: the binding's current plan overrides, read by the default factory (``mokgen.compile``)."""
        self.lock = threading.RLock()
        self.objects: dict[Spec, Any] = {}
        self.epoch = 0
        self._overrides = overrides
        self._factory = self._default

    def _default(self, spec: Spec) -> Any:
        from ..driver import compile as _compile   # the compiler side, on first use (ops never imports it)

        return _compile(spec, overrides=self._overrides())

    def get(self, spec: Spec) -> Any:
        moe = self.objects.get(spec)
        if moe is None:
            with self.lock:
                moe = self.objects.get(spec)
                if moe is None:
                    moe = self.objects[spec] = self._factory(spec)
        return moe

    def set_factory(self, fn: Callable[[Spec], Any] | None) -> Callable[[Spec], Any]:
        """Make objects with ``fn`` from now on (None: the default); returns the previous factory and drops the
        objects it made."""
        with self.lock:
            old, self._factory = self._factory, fn or self._default
            self.drop()
        return old

    def drop(self) -> None:
        with self.lock:
            self.objects.clear()
            self.epoch += 1


def reference_compiler(bm: int = 16, fp8_overrides: Mapping[str, Any] | None = None) -> Callable[[Spec], Any]:
    """A factory of CPU ``CompiledMoE`` objects running mokgen's launch sequence with the reference kernels of
    :mod:`mokgen.reference` (training included), routing tile ``bm``: for tests on machines without a GPU. FP8
    specs (``dtype: fp8``) run the launch sequence of their sm_90a plan (the quantize steps; its routing tile),
    solved with ``fp8_overrides`` (e.g. ``wgrad1_dtype="fp8"``: the FP8 weight gradients and their quantizers);
    MXFP8 specs that of their sm_100a plan (``fp8_overrides`` e.g. ``wgrad1_dtype="mxfp8"``)."""
    from .. import reference

    def make(spec: Spec) -> Any:
        if getattr(spec, "dtype", "bf16") == "fp8":   # the FP8 launch sequence (quantize steps) follows a plan
            from .. import plan as P

            pl = P.solve(spec, "sm_90a", **dict(fp8_overrides or {}))
            return ops.CompiledMoE(spec, pl, functions=ops.fp8_reference_kernels(spec, pl), allow_cpu=True)
        if getattr(spec, "dtype", "bf16") == "mxfp8":   # the MXFP8 launch sequence of its sm_100a plan
            from .. import kernels
            from .. import plan as P

            pl = P.solve(spec, "sm_100a", **dict(fp8_overrides or {}))
            fns = reference.reference_kernels(spec, pl.bm, training=True, mx_wgrads=kernels.mx_wgrads(pl))
            return ops.CompiledMoE(spec, pl, functions=fns, allow_cpu=True, arch="sm_100a")
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
