"""The config space's constraints on sm_100a (:data:`mokgen.configs.ARCH_CONFIGS`): whether an override dict is legal
for a spec (:func:`check_config`, what ``mokgen tune`` enumerates) and whether a solved plan is one the tcgen05
templates render (:func:`check_plan`).

An override dict is legal where the plan's sm_100a rules take it (mokgen.sm100.plan: the knobs of
mokgen.sm100.space, the form of the kernels, an MXFP8 spec's fixed tiles, the 2-CTA form BF16 only, the budgets of
mokgen.sm100.rules): those rules are the one copy of the constraints, so the check is the plan's own one-line
refusal. A plan is checked from its fields, independently of how the solver chose them: every knob's value in
sm_100a's table, the sm_90a-only fields at their "not used" values, the tiles dividing their problem, the routing
tile of the 2-CTA form, and every kernel's tile within the TMEM and shared-memory budgets.

Above the plan (it solves); :mod:`mokgen.configs` dispatches here.
"""
from __future__ import annotations

from typing import Any, Mapping

from .. import plan as P
from .. import space as S
from . import rules
from .plan import TCGEN05_PAIR_BM

__all__ = ["check_config", "check_plan"]

# The fields of a GemmPlan that are sm_90a kernel options, at the value each takes where the option is not used (what
# an sm_100a plan carries: its kernels have none of them).
SM90_ONLY = {"w_hint": "normal", "a_hint": "normal", "promote": "serial", "mma_split": 1, "z_load": "direct",
             "epi_store": "smem"}


def check_config(spec: Any, arch: str, cfg: Mapping[str, Any]) -> list[str]:
    """Why the override dict ``cfg`` (its keys and values already in sm_100a's table) is illegal on ``spec``: the
    plan's sm_100a rules' refusal, else empty."""
    try:
        P.solve(spec, arch, **cfg)
    except P.PlanError as e:
        return [str(e).removeprefix("plan.")]
    return []


def check_plan(plan: Any) -> list[str]:
    """The constraints on a solved sm_100a :class:`mokgen.plan.Plan` (empty: it satisfies them all)."""
    sp_ = S.space(plan.arch)
    spec = plan.spec
    mx = spec.dtype == "mxfp8"
    out: list[str] = []
    if plan.schedule not in sp_.values("schedule"):
        out.append(f"schedule {plan.schedule!r} not in the {plan.arch} space")
    pair_bm = plan.bm == TCGEN05_PAIR_BM
    for which, name in ((1, "gemm1"), (2, "gemm2")):
        g = getattr(plan, name)
        for key in ("bn", "consumer", "cluster", "raster_group"):
            if getattr(g, key) not in sp_.values(key, name):
                out.append(f"{name}.{key} {getattr(g, key)!r} not in the {plan.arch} space")
        if not mx and not sp_.min_stages <= g.stages <= sp_.max_stages:   # MXFP8: as many as fit (the budgets)
            out.append(f"{name}.stages {g.stages} outside [{sp_.min_stages}, {sp_.max_stages}]")
        if g.a_load != "tma":   # GEMM 1: the gathered rows; GEMM 2: h
            out.append(f"{name}.a_load {g.a_load!r}: the {plan.arch} GEMMs read A by TMA tiles")
        out += _sm90_only(name, g)
        n, k = P._gemm_shape(spec, which)
        if which == 1 and spec.ffn % (g.bn // 2) and not _mx_partial_n(plan, g):   # the SwiGLU epilogue's tiles
            out.append(f"gemm1.bn {g.bn}: ffn {spec.ffn} % {g.bn // 2} != 0")
        if not _k_tiles_ok(g, k) or g.n_tiles != -(-n // g.bn):
            out.append(f"{name}: k_tiles/n_tiles do not match N {n}, K {k}")
        if g.cluster == 2 and not pair_bm:
            out.append(f"{name}.cluster 2: the 2-CTA form needs {TCGEN05_PAIR_BM}-row routing tiles, got {plan.bm}")
        if plan.bm % g.tile_m:
            out.append(f"{name}: {g.tile_m}-row tiles do not divide the routing tile {plan.bm}")
    if plan.backward is not None:
        out += _check_backward(plan)
    out += [f"{name}.{field}: {why}" for name, t in rules.kernel_tiles(plan).items()
            for field, why in t.problems(P.get_arch(plan.arch).smem_per_cta)]
    return out


def _mx_partial_n(plan: Any, g: Any) -> bool:
    """Does the SwiGLU epilogue of GEMM `g` (GEMM 1, dgrad1) take a partial last N tile? The MXFP8 GEMMs do (their
    tile N is fixed at 128 per part: ffn 2880 leaves 64 columns), slice by slice: ffn must hold whole epilogue
    slices (mokgen/sm100/emit.py)."""
    return plan.spec.dtype == "mxfp8" and g.elem_bytes == 1 and plan.spec.ffn % g.epi_n == 0


def _k_tiles_ok(g: Any, k: int) -> bool:
    """The MXFP8 GEMMs take a partial last K tile (TMA zero fill, whole scale atoms); the BF16 ones whole tiles."""
    return g.k_tiles == g.k_tiles_for(k) and (g.elem_bytes == 1 or k % g.bk == 0)


def _sm90_only(where: str, g: Any) -> list[str]:
    return [f"{where}.{f} {getattr(g, f)!r}: an sm_90a kernel option (the tcgen05 kernels' value is {v!r})"
            for f, v in SM90_ONLY.items() if getattr(g, f) != v]


def _check_backward(plan: Any) -> list[str]:
    """check_plan's part for the backward GEMMs (templates/sm100/grouped_gemm.py.j2's dgrads, wgrad.py.j2)."""
    sp_ = S.space(plan.arch)
    spec = plan.spec
    bw = plan.backward
    out: list[str] = []
    if bw.streams not in sp_.values("streams", "bwd"):
        out.append(f"backward.streams {bw.streams} not in the {plan.arch} space")
    for name in P.BACKWARD_GEMMS:
        g = getattr(bw, name)
        where = f"backward.{name}"
        m, n, k = P.backward_shape(spec, name)
        if g.consumer != "cooperative" or g.a_load != "tma":
            out.append(f"{where}: {g.consumer} tiles, a_load {g.a_load!r}: the {plan.arch} kernels run one CTA per "
                       f"128-row tile reading A by TMA")
        out += _sm90_only(where, g)
        if g.n_tiles != -(-n // g.bn) or (k is not None and not _k_tiles_ok(g, k)):
            out.append(f"{where}: k_tiles/n_tiles do not match N {n}, K {k}")
        if k is not None:   # a dgrad: the 2-CTA form its own opt-in, on 256-row routing tiles
            if g.cluster not in sp_.values("cluster", name):
                out.append(f"{where}.cluster {g.cluster} not in the {plan.arch} space")
            elif g.cluster == 2 and plan.bm != TCGEN05_PAIR_BM:
                out.append(f"{where}.cluster 2: the 2-CTA form needs {TCGEN05_PAIR_BM}-row routing tiles, got "
                           f"{plan.bm}")
            if g.bm != plan.bm:
                out.append(f"{where}: {g.bm}-row groups, routing tile {plan.bm}")
        else:   # a weight gradient: 1-CTA tiles; MXFP8 (wgrad*_dtype=mxfp8) only for an mxfp8 spec
            if g.cluster != 1:
                out.append(f"{where}.cluster {g.cluster}: the weight gradients run 1-CTA tiles")
            if g.elem_bytes == 1 and spec.dtype != "mxfp8":
                out.append(f"{where}: MXFP8 weight gradients are a choice of dtype mxfp8 specs, this one is "
                           f"{spec.dtype}")
            elif g.elem_bytes == 1 and plan.bm % g.bk:
                out.append(f"{where}: K step {g.bk} does not divide the routing tile {plan.bm}")
    if spec.ffn % bw.dgrad1.bn and not _mx_partial_n(plan, bw.dgrad1):
        out.append(f"backward.dgrad1.bn {bw.dgrad1.bn}: ffn {spec.ffn} % {bw.dgrad1.bn} != 0 (the dSwiGLU epilogue)")
    return out
