"""The config space's types: a :class:`Knob` (one plan choice of some kernels: its legal values, the values tune
searches) and an :class:`ArchSpace` (one arch's knobs, the kernel constants the constraints use and the axes tune
searches). Each arch's table is built on these: sm_90a's in :mod:`mokgen.space`, sm_100a's in
:mod:`mokgen.sm100.space`; :data:`mokgen.space.SPACES` collects them.

Below both on purpose (an arch's package imports this, :mod:`mokgen.space` imports the arch's table): no import
cycle. Light: no sympy, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Knob", "ArchSpace"]


@dataclass(frozen=True)
class Knob:
    """One plan choice of some kernels. Override keys: ``<kernel>_<key>`` per kernel, and ``<key>`` for all of
    them where ``shared`` (``consumer=pingpong`` sets both forward GEMMs; ``gemm2_consumer`` only GEMM 2)."""

    key: str
    kernels: tuple[str, ...]  # kernel names ("gemm1", "gemm2", "dgrad1", ...) or ("plan",) for plan-wide knobs
    values: tuple[Any, ...]  # every legal value
    shared: bool = False  # the bare key applies to every kernel of the knob
    search: tuple[Any, ...] | None = None  # values tune searches by default; None: derived by the plan's rules
    doc: str = ""

    def keys(self) -> tuple[str, ...]:
        if self.kernels == ("plan",):
            return (self.key,)
        own = tuple(f"{k}_{self.key}" for k in self.kernels)
        return own + ((self.key,) if self.shared else ())


@dataclass(frozen=True)
class ArchSpace:
    """The knobs of one arch's templates and the kernel constants the constraints use."""

    arch: str
    templates: str  # the template family that implements these knobs
    knobs: tuple[Knob, ...]
    bm: int = 128  # cooperative M tile (2 consumer warpgroups x 64 rows)
    bk: int = 64
    min_stages: int = 3
    max_stages: int = 7
    search_axes: tuple[str, ...] = ()  # the forward override keys tune searches (each over its knob's `search`)
    backward_axes: tuple[str, ...] = ()  # the backward keys tune --train searches, one at a time
    dtype_axes: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (spec dtype, its forward axes) where its form differs

    def knob(self, key: str, kernel: str | None = None) -> Knob:
        for k in self.knobs:
            if k.key == key and (kernel is None or kernel in k.kernels):
                return k
        raise KeyError(f"{self.arch}: no knob {key!r}" + (f" for {kernel}" if kernel else ""))

    def values(self, key: str, kernel: str | None = None) -> tuple[Any, ...]:
        return self.knob(key, kernel).values

    def forward_axes(self, dtype: str = "bf16") -> tuple[str, ...]:
        """The forward axes tune searches for a spec of `dtype` (what that dtype's form leaves free)."""
        return dict(self.dtype_axes).get(dtype, self.search_axes)
