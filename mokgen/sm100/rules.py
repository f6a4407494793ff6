"""sm_100a (Blackwell) tile rules: the tensor-memory and shared-memory budgets of the tcgen05 GEMM kernels
(``templates/sm100/grouped_gemm.py.j2``, ``wgrad.py.j2``), in one place (issue 20: the plan's sm_100a rules).

:mod:`mokgen.sm100.plan` checks every GEMM of an sm_100a plan against them (``solve(spec, "sm_100a", ...)`` raises a
one-line :class:`~mokgen.plan.PlanError` naming the override and the budget it breaks) and ``mokgen plan --explain``
prints their figures; :mod:`mokgen.sm100.emit` renders each kernel with the tile :func:`kernel_tiles` derives and
asserts the same rules (``EmitError``) before rendering. The accounting follows the templates:

* TMEM (512 fp32 columns per SM): ``ACC_STAGES x PARTS`` accumulators of BN columns (the epilogue of tile i
  overlaps the mainloop of tile i + 1); MXFP8 also keeps the scales of one K step there, A's and one set per part,
  ``(BM / 32) x (BK / 32)`` columns each, and drops to one accumulator buffer where two do not fit beside them.
  The 2-CTA form (cta_group 2) gives each CTA of the pair its 128 rows of the 256-row tile: the same columns per
  CTA as a 1-CTA tile of the same N. tcgen05.alloc takes a power of two >= 32 columns.
* shared memory per CTA (the arch's ``smem_per_cta``): the stage ring (per stage the 128-row A box and PARTS W
  boxes of BN rows, BK deep; the 2-CTA form's CTA holds half of every W box; MXFP8: e4m3 boxes and their scale
  atoms, W's rows rounded up to 128), the bf16 epilogue buffers (128 x EPI_N x EPI_STAGES), the barriers (1024 B;
  MXFP8 also 1024 B of alignment per buffer).

Light on purpose: no sympy, no torch, no import of the plan (mokgen.sm100.plan imports this module).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..arch import ARCHS

ARCH = "sm_100a"   # this package's row of mokgen.arch.ARCHS (the one place the shared stages learn its name)

__all__ = ["ARCH", "Tile", "kernel_tiles", "TMEM_COLUMNS", "UMMA_M", "PAIR_M", "ACC_STAGES", "BARRIER_BYTES",
           "MIN_STAGES", "WGRAD_EPI", "mx_smem"]

TMEM_COLUMNS = 512    # fp32 columns of tensor memory per SM
UMMA_M = 128          # tcgen05.mma rows of one CTA (cta_group 1; each CTA's rows of a cta_group 2 tile)
PAIR_M = 2 * UMMA_M   # rows of a 2-CTA tile (cta_group 2: a CTA pair, cluster 2 along M)
UMMA_K = 16           # K of one bf16 tcgen05.mma
ACC_STAGES = 2        # accumulators in tensor memory (double-buffered)
BARRIER_BYTES = 1024  # the barriers, CLC response slots and TMEM address (and the alignment of the first buffer)
MX_ALIGN = 1024       # MXFP8: bytes of alignment per shared-memory buffer
SF_VEC = 32           # MXFP8: K elements per e8m0 scale
MIN_STAGES = 2        # the kernels' smallest ring (a stage loading while another is consumed)
WGRAD_EPI = (32, 2)   # the weight gradients' epilogue as emit renders them: EPI_N columns, EPI_STAGES buffers
KERNELS = ("gemm1", "gemm2", "dgrad1", "dgrad2", "wgrad1", "wgrad2")


@dataclass(frozen=True)
class Tile:
    """The tile one sm_100a GEMM kernel is rendered with: `parts` accumulators per tile (GEMM 1: gate and up) of
    `bn` columns each (the UMMA N), `bk` K per stage, `stages` ring stages, the epilogue's `epi_n` x
    `epi_stages` bf16 buffers; `mx` the block-scaled MXFP8 form, `pair` the 2-CTA form."""

    parts: int
    bn: int
    bk: int
    stages: int
    epi_n: int
    epi_stages: int
    mx: bool = False
    pair: bool = False

    # ---- tensor memory (columns per CTA) ----
    @property
    def sf_columns(self) -> int:
        """TMEM columns of the scales of one K step (MXFP8: A's, then one set per part; 0 for bf16)."""
        return (1 + self.parts) * (UMMA_M // 32) * (self.bk // SF_VEC) if self.mx else 0

    @property
    def acc_stages(self) -> int:
        """Accumulator buffers: two where they fit beside the scales, else one (MXFP8 GEMM 1)."""
        if self.mx and ACC_STAGES * self.parts * self.bn + self.sf_columns > TMEM_COLUMNS:
            return 1
        return ACC_STAGES

    @property
    def acc_columns(self) -> int:
        return self.acc_stages * self.parts * self.bn

    @property
    def tmem_columns(self) -> int:
        """TMEM columns the kernel uses (accumulators + scales)."""
        return self.acc_columns + self.sf_columns

    @property
    def tmem_alloc(self) -> int:
        """Columns tcgen05.alloc takes: a power of two >= 32."""
        return max(32, 1 << (self.tmem_columns - 1).bit_length())

    # ---- shared memory (bytes per CTA) ----
    @property
    def w_rows(self) -> int:
        """Rows of each W box one CTA holds: half of it in the 2-CTA form (the pair shares B)."""
        return self.bn // 2 if self.pair else self.bn

    @property
    def stage_bytes(self) -> int:
        """Bytes of one ring stage in one CTA (= the TMA bytes a stage's barrier expects, per CTA)."""
        if self.mx:
            sf = self.bk // SF_VEC
            return (UMMA_M * self.bk + self.parts * self.bn * self.bk + UMMA_M * sf
                    + self.parts * -(-self.bn // 128) * 128 * sf)
        return (UMMA_M + self.parts * self.w_rows) * self.bk * 2

    @property
    def fixed_bytes(self) -> int:
        """Bytes besides the ring: the bf16 epilogue buffers, the barriers (MXFP8: the buffers' alignment)."""
        epi = UMMA_M * self.epi_n * 2 * self.epi_stages + BARRIER_BYTES
        return epi + (3 + 2 * self.parts) * MX_ALIGN if self.mx else epi

    @property
    def smem_bytes(self) -> int:
        return self.stages * self.stage_bytes + self.fixed_bytes

    def stages_fit(self, limit: int, most: int | None = None) -> int:
        """The most ring stages that fit `limit` bytes beside the fixed buffers, capped at `most`."""
        fit = (limit - self.fixed_bytes) // self.stage_bytes
        return fit if most is None else min(fit, most)

    # ---- the rules ----
    def problems(self, limit: int) -> list[tuple[str, str]]:
        """What breaks the kernel's tile rules or budgets (TMEM columns, `limit` bytes of shared memory), as
        (field, one-line reason) pairs in the order the checks run; empty if the tile is valid."""
        out: list[tuple[str, str]] = []
        if self.mx:
            if self.bn != 128:
                out.append(("bn", f"the MXFP8 GEMMs take 128 columns per part (one scale atom of W), got {self.bn}"))
            if self.bk % 128:
                out.append(("bk", f"the MXFP8 GEMMs step K by whole scale atoms (multiples of 128), got {self.bk}"))
        elif self.bn % 16 or not 16 <= self.bn <= 256:
            out.append(("bn", f"the UMMA N is a multiple of 16 up to 256, got {self.bn}"))
        if self.pair:
            if self.mx:
                out.append(("cluster", "the 2-CTA form (cluster 2) is BF16 only so far; the MXFP8 GEMMs run 1-CTA "
                                       "tiles"))
            elif self.bn % 32:
                out.append(("bn", f"the 2-CTA form splits the tile's {self.bn} columns per part into two W boxes of "
                                  f"whole 16-row blocks: a multiple of 32"))
        if self.tmem_columns > TMEM_COLUMNS:
            out.append(("bn", f"TMEM: {self.tmem_text()} columns exceed the budget of {TMEM_COLUMNS} columns per SM"))
        if self.stages < MIN_STAGES:
            out.append(("stages", f"the ring needs at least {MIN_STAGES} stages, got {self.stages}"))
        elif self.smem_bytes > limit:
            out.append(("stages", f"{self.stages} stages {self.shape_text()} need {self.smem_bytes} B of shared "
                                  f"memory, budget {limit} B per CTA (at most {max(0, self.stages_fit(limit))} "
                                  f"stages fit)"))
        return out

    def tmem_text(self) -> str:
        text = (f"{self.acc_stages} x {self.parts} accumulator{'s' if self.acc_stages * self.parts > 1 else ''} of "
                f"{self.bn} columns")
        return text + (f" + {self.sf_columns} scale columns" if self.sf_columns else "") + f" = {self.tmem_columns}"

    def shape_text(self) -> str:
        return (f"of {UMMA_M}x{self.bn}" + (f" x {self.parts} parts" if self.parts > 1 else "") + f", bk {self.bk}"
                + (" (2-CTA: half of each W box per CTA)" if self.pair else "")
                + (" (e4m3 with scale atoms)" if self.mx else ""))

    def budget_text(self, limit: int) -> str:
        """One line of figures: TMEM columns used / 512 (and allocated), shared memory used / the budget."""
        return (f"TMEM {self.tmem_columns} / {TMEM_COLUMNS} columns (alloc {self.tmem_alloc}; "
                f"{self.acc_stages} x {self.parts} x {self.bn} accumulator"
                + (f" + {self.sf_columns} scale" if self.sf_columns else "") + " columns), "
                f"smem {self.smem_bytes} / {limit} B ({self.stages} stages x {self.stage_bytes} + {self.fixed_bytes})")


def mx_smem(parts: int, bn: int, bk: int, stages: int, epi_n: int, epi_stages: int) -> int:
    """Shared memory of an sm_100a MXFP8 grouped GEMM (bytes per CTA; see :class:`Tile`)."""
    return Tile(parts, bn, bk, stages, epi_n, epi_stages, mx=True).smem_bytes


def smem_limit(plan: Any) -> int:
    return ARCHS[plan.arch].smem_per_cta


def kernel_tiles(plan: Any) -> dict[str, Tile]:
    """The tile each sm_100a GEMM kernel of `plan` is rendered with (mokgen.sm100.emit renders these): ``gemm1``
    (also ``gemm1_train``) and ``gemm2`` from the plan's forward GEMMs (GEMM 1's bn counts gate + up: bn / 2 per
    part); with a backward, ``dgrad1`` / ``dgrad2`` (the plan's tile N on GEMM 2's K step and epilogue; BF16: as
    many stages as fit, at most the plan's; MXFP8: the plan's; the 2-CTA form where the plan's dgrad has cluster
    2, its CTA holding half of each W box) and ``wgrad1`` / ``wgrad2`` (also their ``_acc``
    forms: the plan's tile N and K step, epilogue WGRAD_EPI, as many stages as fit, at most the plan's; an MXFP8
    weight gradient, plan ``wgrad*_dtype=mxfp8``: the block-scaled tile with the plan's stages)."""
    mx = plan.spec.dtype == "mxfp8"
    limit = smem_limit(plan)
    out = {}
    for w in (1, 2):
        g = getattr(plan, f"gemm{w}")
        parts = 2 if w == 1 else 1
        out[f"gemm{w}"] = Tile(parts, g.bn // parts, g.bk, g.stages, g.epi_n, g.epi_stages, mx=mx,
                               pair=g.cluster == 2)
    bw = plan.backward
    if bw is None:
        return out
    g2 = plan.gemm2
    for name in ("dgrad1", "dgrad2"):
        d = getattr(bw, name)
        pair = d.cluster == 2   # plan dgrad*_cluster=2: the 2-CTA form (BF16)
        t = Tile(1, d.bn, g2.bk, d.stages, g2.epi_n, g2.epi_stages, mx=mx, pair=pair)
        out[name] = t if mx else Tile(1, d.bn, g2.bk, t.stages_fit(limit, most=d.stages), g2.epi_n, g2.epi_stages,
                                      pair=pair)
    for name in ("wgrad1", "wgrad2"):
        w = getattr(bw, name)
        wmx = mx and w.elem_bytes == 1   # plan wgrad*_dtype=mxfp8: the block-scaled form, the plan's stages
        t = Tile(1, w.bn, w.bk, w.stages, *WGRAD_EPI, mx=wmx)
        out[name] = t if wmx else Tile(1, w.bn, w.bk, t.stages_fit(limit, most=w.stages), *WGRAD_EPI)
    return out
