"""Blackwell (sm_100a) kernel sources, rendered from ``templates/sm100/`` (issue 20; CPU compile-verified only).

Not wired into :func:`mokgen.emit.emit` yet (its arch check stays sm_90a until the sm_100a forms of every kernel
exist): :func:`render_grouped_gemm` renders the sm_100a expert-grouped GEMM 2 (``templates/sm100/grouped_gemm.py.j2``)
for a plan solved with ``mokgen.plan.solve(spec, "sm_100a")``, with the parameter names the sm_90a
``_grouped_params`` computes, so the two templates share one render context as far as their features overlap.
"""
from __future__ import annotations

from typing import Any

from . import kernels
from .emit import EmitError, _environment, _header, template_hash
from .plan import Plan, get_arch

TEMPLATE = "sm100/grouped_gemm.py.j2"
UMMA_M = 128          # tcgen05.mma rows of one CTA (cta_group 1)
ACC_STAGES = 2        # accumulators in tensor memory (double-buffered)
TMEM_COLUMNS = 512    # fp32 columns of tensor memory per SM
BARRIER_BYTES = 1024


def smem_bytes(bn: int, bk: int, stages: int, epi_n: int, epi_stages: int) -> int:
    """Shared memory of the sm_100a grouped GEMM: the A + W stage ring, the epilogue buffers, the barriers."""
    return stages * (UMMA_M + bn) * bk * 2 + UMMA_M * epi_n * 2 * epi_stages + BARRIER_BYTES


def grouped_params(plan: Plan, which: int = 2, *, bn: int | None = None, stages: int | None = None) -> dict[str, Any]:
    """The render context of templates/sm100/grouped_gemm.py.j2 for forward GEMM `which` of `plan` (2 only so
    far: h . W2 with the routing weight, and the bias when the spec has one). `bn` / `stages` override the plan's
    tile N and ring depth (e.g. a 256-wide tile whose last N tile is partial)."""
    if which != 2:
        raise EmitError(f"render_grouped_gemm: only GEMM 2 has an sm_100a template so far, got which={which}")
    if plan.arch != "sm_100a":
        raise EmitError(f"plan.arch: the sm_100a templates need a plan solved for sm_100a, got {plan.arch!r}")
    spec = plan.spec
    if spec.dtype != "bf16":
        raise EmitError(f"spec.dtype: the sm_100a grouped GEMM is BF16 only so far, got {spec.dtype!r}")
    g = plan.gemm2
    H, I = spec.hidden, spec.ffn
    bn = g.bn if bn is None else bn
    stages = g.stages if stages is None else stages
    what = "plan.gemm2"
    if bn % 16 or not 16 <= bn <= 256:
        raise EmitError(f"{what}.bn: the UMMA N of cta_group 1 is a multiple of 16 up to 256, got {bn}")
    if ACC_STAGES * bn > TMEM_COLUMNS:
        raise EmitError(f"{what}.bn: {ACC_STAGES} accumulators of {bn} columns exceed {TMEM_COLUMNS} TMEM columns")
    if plan.bm % UMMA_M:
        raise EmitError(f"plan.bm: routing tiles of {plan.bm} rows are not a multiple of the {UMMA_M}-row UMMA tile")
    if I % g.bk or g.bk % 16:
        raise EmitError(f"{what}.bk: {g.bk} must divide K={I} and be a multiple of the UMMA K (16)")
    if bn % g.epi_n:
        raise EmitError(f"{what}.epi_n: {g.epi_n} does not divide the tile's {bn} columns")
    smem = smem_bytes(bn, g.bk, stages, g.epi_n, g.epi_stages)
    limit = get_arch(plan.arch).smem_per_cta
    if smem > limit:
        raise EmitError(f"{what}: {stages} stages of bn {bn} need {smem} bytes of shared memory, limit {limit}")
    return dict(
        args=kernels.ARGS["gemm2"],
        symbols=kernels.SYMBOLS["gemm2"],
        n_out=H,
        k_dim=I,
        groups=spec.groups,
        parts=1,
        n_stride=I,
        k_stride=1,
        g_stride=H * I,
        epilogue="weight",
        has_bias=bool(spec.bias),
        bm=UMMA_M,
        group_m=plan.bm,
        bn=bn,
        bk=g.bk,
        stages=stages,
        acc_stages=ACC_STAGES,
        epi_n=g.epi_n,
        epi_stages=g.epi_stages,
        raster=max(1, g.raster_group * (plan.bm // UMMA_M)),
        n_tiles=-(-H // bn),
        k_tiles=I // g.bk,
    )


def render_grouped_gemm(plan: Plan, which: int = 2, *, bn: int | None = None, stages: int | None = None,
                        name: str | None = None) -> str:
    """The sm_100a kernel source of forward GEMM `which` for `plan` (a standalone CuTe DSL module defining
    ``KERNEL_NAME`` and ``compile(arch)``, as every emitted kernel; docs/contract.md)."""
    params = grouped_params(plan, which, bn=bn, stages=stages)
    name = name or f"gemm{which}"
    spec = plan.spec
    return _environment().get_template(TEMPLATE).render(
        header=_header(plan, TEMPLATE, template_hash()), name=name, spec_name=spec.name,
        title=f"GEMM {which} of {spec.name} (sm_100a): h x W2, routing weight in the epilogue -> ys", **params)


def tile_walk(num_m: int, n_tiles: int, raster: int) -> list[tuple[int, int]]:
    """The Python model of the kernel's tile order: panels of `raster` M tiles (the last one shorter), inside a
    panel every N tile of the panel's M tiles with M fastest."""
    out = []
    for p0 in range(0, num_m, raster):
        rows = min(raster, num_m - p0)
        for n in range(n_tiles):
            out.extend((p0 + i, n) for i in range(rows))
    return out
