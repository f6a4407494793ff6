"""Blackwell (sm_100a) kernel sources, rendered from ``templates/sm100/`` (issue 20; CPU compile-verified only).

:func:`emit` is what :func:`mokgen.emit.emit` returns for a plan solved for sm_100a: the forward (routing,
gather, GEMM 1, GEMM 2, combine) and, for a training plan, the backward (GEMM 1 saving z, the two dgrads, the four
weight-gradient kernels). The GEMMs come from ``templates/sm100/grouped_gemm.py.j2`` (tcgen05.mma, accumulators in
tensor memory, TMA loads; the dgrads read W N-major, dgrad1 with the dSwiGLU + router-gradient epilogue) and
``templates/sm100/wgrad.py.j2`` (varlen-K, both operands MN-major, bf16 or the fp32 main_grad form); routing,
gather and combine are the SIMT kernels of ``templates/sm90/`` (plain loads, stores and integer atomics: no
Hopper-only instruction), rendered unchanged and compiled for sm_100a. Everything here is compiled and checked on
the CPU in CI; nothing has run on a Blackwell GPU. :func:`render_grouped_gemm` renders the expert-grouped GEMMs
with the parameter names the sm_90a ``_grouped_params`` computes, so the two templates share one render context as
far as their features overlap.
"""
from __future__ import annotations

from typing import Any

from .. import kernels
from ..emit_base import EmitError, Renderer, Sources, _activation, _environment, _header, _w1_strides, template_hash
from ..plan_types import Plan
from .rules import ARCH, ACC_STAGES, PAIR_M, SF_VEC, UMMA_M, WGRAD_EPI, Tile, kernel_tiles, smem_limit

TEMPLATE = "sm100/grouped_gemm.py.j2"
# UMMA_M, PAIR_M, ACC_STAGES, TMEM_COLUMNS, BARRIER_BYTES and the tile budgets: mokgen/sm100/rules.py (the plan's
# sm_100a rules; the checks below assert the same)
BACKWARD = ("dgrad1", "dgrad2")   # the backward GEMMs rendered so far (their tile: GEMM 2's, or the bn given)
# The GEMMs' persistent tile walk: Cluster Launch Control (one CTA per tile; a CTA takes over the tiles of CTAs it
# cancels before they launch: MoK's scheduler, balancing tiles of uneven length and SMs other kernels hold), or the
# static b, b + grid, ... walk (False: the form the first version shipped, kept renderable for comparison).
CLC = True


def grouped_params(plan: Plan, which: int = 2, *, bn: int | None = None, stages: int | None = None,
                   save_z: bool = False) -> dict[str, Any]:
    """The render context of templates/sm100/grouped_gemm.py.j2 for forward GEMM `which` of `plan` (or, with
    ``which="dgrad2"``, the backward's dgrad2: dz [rows, 2I] . W1[g] with W1 read N-major, plain store; with
    ``which="dgrad1"``, dgrad1: dO rows . W2[g] with W2 read N-major, the dSwiGLU + router-gradient epilogue; their
    tile is GEMM 2's unless `bn` / `stages` are given (emit passes the plan's backward tiles); each in the 2-CTA
    form where the plan's dgrad has cluster 2 (``dgrad1_cluster`` / ``dgrad2_cluster``, BF16).

    which=2: h . W2 with the routing weight (and the bias when the spec has one); `bn` is the tile N.
    which=1: xg . W1 (gate and up parts, two TMEM accumulators per tile) with the SwiGLU epilogue (bias per W1 row
    when the spec has one); `save_z` also stores z in W1's row order (table gemm1_train). A is always the
    pre-gathered xg [rows, H] by plain TMA tiles (sm_90a a_load "tma"), whatever the plan's a_load. `bn` is the N
    per part (default: half the plan's gemm1.bn, which counts gate + up as on sm_90a).
    `bn` / `stages` override the plan's tile N and ring depth (e.g. a 256-wide GEMM 2 tile whose last N tile is
    partial)."""
    if which not in (1, 2, "dgrad1", "dgrad2"):
        raise EmitError(f"render_grouped_gemm: which is 1 or 2 (the forward GEMMs), 'dgrad1' or 'dgrad2', got "
                        f"which={which}")
    # the 2-CTA form (a forward GEMM planned with cluster 2, a dgrad with dgrad*_cluster 2): a CTA pair computes a
    # PAIR_M x bn tile, each CTA loading half of every W box (for the dgrads' N-major W: half the tile's N columns;
    # cute's 2-CTA TMA partition of B splits N whatever W's major mode) and draining its own 128 rows
    if which in (1, 2):
        pair = (plan.gemm1 if which == 1 else plan.gemm2).cluster == 2
    else:
        pair = plan.backward is not None and getattr(plan.backward, which).cluster == 2
    if save_z and which != 1:
        raise EmitError("render_grouped_gemm: save_z is GEMM 1's (which=1)")
    if plan.arch != ARCH:
        raise EmitError(f"plan.arch: the sm_100a templates need a plan solved for sm_100a, got {plan.arch!r}")
    spec = plan.spec
    mx = spec.dtype == "mxfp8"
    if spec.dtype not in ("bf16", "mxfp8"):
        raise EmitError(f"spec.dtype: the sm_100a grouped GEMMs are BF16 and MXFP8, got dtype {spec.dtype!r}")
    H, I = spec.hidden, spec.ffn
    parts = 2 if which == 1 else 1
    g = plan.gemm1 if which == 1 else plan.gemm2
    what = f"plan.backward.{which}" if which in BACKWARD else f"plan.gemm{which}"
    if bn is None:
        if g.bn % parts:
            raise EmitError(f"{what}.bn: must be even (gate and up halves), got {g.bn}")
        bn = g.bn // parts
    stages = g.stages if stages is None else stages
    n_out, k_dim = {1: (I, H), 2: (H, I), "dgrad1": (I, H), "dgrad2": (H, 2 * I)}[which]
    tile = Tile(parts, bn, g.bk, stages, g.epi_n, g.epi_stages, mx=mx, pair=pair)
    _check_tile(plan, what, tile)
    if plan.bm % UMMA_M:
        raise EmitError(f"plan.bm: routing tiles of {plan.bm} rows are not a multiple of the {UMMA_M}-row UMMA tile")
    if pair and plan.bm != PAIR_M:
        raise EmitError(f"plan.bm: the 2-CTA form (cluster 2) needs {PAIR_M}-row routing tiles (a pair's rows in one "
                        f"group), got {plan.bm}")
    # MXFP8: K a multiple of the 32-element scale blocks suffices (hidden / ffn 2880: the last K tile partial, its
    # e4m3 data past K read as zeros by TMA, the scale atoms padded with code 127 by the quantizers)
    if (k_dim % SF_VEC if mx else k_dim % g.bk) or g.bk % 16:
        raise EmitError(f"{what}.bk: {g.bk} must " + (f"be a multiple of the UMMA K (16), K={k_dim} one of the "
                        f"{SF_VEC}-element scale blocks" if mx else f"divide K={k_dim} and be a multiple of the "
                        f"UMMA K (16)"))
    if bn % g.epi_n:
        raise EmitError(f"{what}.epi_n: {g.epi_n} does not divide the tile's {bn} columns")
    # the SwiGLU epilogues (GEMM 1, dgrad1) address z, dz and the bias by column: a partial last N tile (MXFP8's
    # 128 columns per part over ffn 2880) skips its slices past N_OUT, so N_OUT must hold whole slices
    n_partial = which in (1, "dgrad1") and n_out % bn != 0
    if n_partial and not (mx and n_out % g.epi_n == 0):
        raise EmitError(f"{what}.bn: the SwiGLU epilogue needs whole N tiles" + (f" or whole {g.epi_n}-column "
                        f"slices" if mx else "") + f", {bn} per part does not divide ffn {I}")
    k_stride, b_mn = 1, False
    if which == 1:
        # MXFP8: quant_mx_w1 writes the e4m3 W1 in concat order (gate rows, then up rows) whatever the spec's
        # layout, so that each part's rows and their scale atoms are contiguous
        n_stride, p_stride = (H, I * H) if mx else _w1_strides(spec)
        g_stride = 2 * I * H
    # the dgrads read W N-major (the UMMA's B operand MN-major), BF16 and MXFP8 alike: the block-scaled
    # kind::mxf8f6f4 MMA takes 8-bit operands MN-major too (PTX ISA: transpose A / B, bits 15 / 16 of the
    # instruction descriptor; the CuTe DSL's MmaMXF8F6F4Op), its scales always along K: MXFP8 reads the e4m3 copies
    # quant_mx_w*_cols write in W's layout, their 32-blocks along K
    elif which == "dgrad2":   # W1 [G, 2I, H] as (N = H, K = 2I): N contiguous, K strided by H
        n_stride, k_stride, p_stride, g_stride, b_mn = 1, H, 2 * I * H, 2 * I * H, True
    elif which == "dgrad1":   # W2 [G, H, I] as (N = I, K = H): N contiguous, K strided by I
        n_stride, k_stride, p_stride, g_stride, b_mn = 1, I, H * I, H * I, True
    else:
        n_stride, p_stride, g_stride = I, H * I, H * I
    z_n, z_p = (s // H for s in _w1_strides(spec))
    if which in (1, "dgrad1") and z_n == 1 and z_p % g.epi_n:
        raise EmitError(f"{what}.epi_n: {g.epi_n} must divide the up block's offset {z_p} in z (concat)")
    activation, act_limit = _activation(spec)
    table = ("gemm1_train" if save_z else "gemm1") if which == 1 else "gemm2" if which == 2 else which
    table += "_mx" if mx else ""
    return dict(
        table=table,
        args=kernels.ARGS[table],
        symbols=kernels.SYMBOLS[table],
        n_out=n_out,
        k_dim=k_dim,
        groups=spec.groups,
        parts=parts,
        n_stride=n_stride,
        k_stride=k_stride,
        b_mn=b_mn,
        p_stride=p_stride,
        g_stride=g_stride,
        epilogue={1: "swiglu", 2: "weight", "dgrad1": "dswiglu", "dgrad2": "store"}[which],
        pair=pair,
        save_z=save_z,
        z_n=z_n,
        z_p=z_p,
        activation=activation,
        act_limit=act_limit,
        has_bias=bool(spec.bias) and which not in BACKWARD,
        mx=mx,
        bm=UMMA_M,
        group_m=plan.bm,
        bn=bn,
        bk=g.bk,
        stages=stages,
        acc_stages=tile.acc_stages,
        epi_n=g.epi_n,
        epi_stages=g.epi_stages,
        raster=max(1, g.raster_group * (plan.bm // (PAIR_M if pair else UMMA_M))),
        n_tiles=-(-n_out // bn),
        n_partial=n_partial,
        k_tiles=-(-k_dim // g.bk),
        clc=CLC,
    )


def render_grouped_gemm(plan: Plan, which: int = 2, *, bn: int | None = None, stages: int | None = None,
                        save_z: bool = False, name: str | None = None) -> str:
    """The sm_100a kernel source of forward GEMM `which` for `plan` (a standalone CuTe DSL module defining
    ``KERNEL_NAME`` and ``compile(arch)``, as every emitted kernel; docs/contract.md); which=1 with `save_z`:
    GEMM 1 for training (``gemm1_train``); which="dgrad1" / "dgrad2": the backward's dgrads (compiled and checked
    in CI; the 2-CTA form where the plan's dgrad has cluster 2; never run on a GPU)."""
    params = grouped_params(plan, which, bn=bn, stages=stages, save_z=save_z)
    name = name or ("gemm1_train" if save_z else which if which in BACKWARD else f"gemm{which}")
    spec = plan.spec
    if which == "dgrad1":
        title = (f"dgrad1 of {spec.name} (sm_100a): gathered dO rows x W2 (read N-major), dSwiGLU + router-gradient "
                 f"epilogue -> s a, dz, ds")
    elif which == "dgrad2":
        title = (f"dgrad2 of {spec.name} (sm_100a): dz x W1 (read N-major) -> the data gradient per slot (the combine "
                 f"sums each token's slots)")
    elif which == 1:
        title = (f"GEMM 1 of {spec.name} (sm_100a): gathered token rows x W1 (gate, up), SwiGLU epilogue -> h"
                 + (", saving the pre-activation z for the backward" if save_z else ""))
    else:
        title = f"GEMM 2 of {spec.name} (sm_100a): h x W2, routing weight in the epilogue -> ys"
    return _environment().get_template(TEMPLATE).render(
        header=_header(plan, TEMPLATE, template_hash()), name=name, spec_name=spec.name, title=title, **params)


def tile_walk(num_m: int, n_tiles: int, raster: int) -> list[tuple[int, int]]:
    """The Python model of the kernel's tile order: panels of `raster` M tiles (the last one shorter), inside a
    panel every N tile of the panel's M tiles with M fastest."""
    out = []
    for p0 in range(0, num_m, raster):
        rows = min(raster, num_m - p0)
        for n in range(n_tiles):
            out.extend((p0 + i, n) for i in range(rows))
    return out


def _check_tile(plan: Plan, what: str, tile: Tile) -> None:
    """The tcgen05 GEMMs' tile rules and budgets (mokgen.sm100.rules.Tile.problems: the UMMA N, the TMEM columns of
    the accumulators (and MXFP8 scales), the stage ring and epilogue buffers in shared memory, the 2-CTA form's W
    half boxes): the plan checks the same (mokgen.plan solves no sm_100a plan that breaks them), so this fails
    only for a tile given here or a plan built by hand."""
    problems = tile.problems(smem_limit(plan))
    if problems:
        field, why = problems[0]
        raise EmitError(f"{what}.{field}: {why}")


def fit_stages(plan: Plan, bn: int, bk: int, epi_n: int, epi_stages: int, parts: int = 1,
               most: int | None = None) -> int:
    """The most stages of the sm_100a GEMMs' bf16 ring (`parts` W boxes of `bn` rows, `bk` deep) that fit the shared
    memory beside the epilogue buffers and barriers, capped at `most` (mokgen.sm100.rules.Tile.stages_fit)."""
    return Tile(parts, bn, bk, 0, epi_n, epi_stages).stages_fit(smem_limit(plan), most)


def emit(plan: Plan) -> Sources:
    """The sm_100a sources of `plan`: routing, gather (GEMM 1 reads the gathered rows by TMA tiles; the backward
    gathers dO's and x's rows with it), gemm1, gemm2 (templates/sm100/grouped_gemm.py.j2), combine (the shared
    SIMT templates) and, where the plan has a backward, gemm1_train, dgrad1, dgrad2 (grouped_gemm.py.j2) and the
    weight gradients wgrad1 / wgrad2 and their fp32 main_grad forms (wgrad.py.j2), each with its backward tile
    from the plan (stages: as many as fit)."""
    if plan.arch != ARCH:
        raise EmitError(f"plan.arch: mokgen.sm100.emit renders sm_100a kernels, got {plan.arch!r}")
    spec = plan.spec
    if spec.dtype not in ("bf16", "mxfp8"):
        raise EmitError(f"spec.dtype: the sm_100a kernels are BF16 and MXFP8, got {spec.dtype!r}")
    mx = spec.dtype == "mxfp8"
    if plan.schedule != "chain" or plan.gemm1.a_load != "tma":
        raise EmitError("plan: an sm_100a plan runs the chain schedule and GEMM 1 on gathered rows (a_load 'tma'; "
                        "mokgen.plan.solve(spec, 'sm_100a') gives that form)")
    for name in ("gemm1", "gemm2"):   # sm_90a kernel options the tcgen05 GEMMs do not have: refused, not ignored
        g = getattr(plan, name)
        got = (g.consumer, g.w_hint, g.a_hint, g.promote, g.epi_store, g.mma_split)
        if got != ("cooperative", "normal", "normal", "serial", "smem", 1):
            raise EmitError(f"plan.{name}: the sm_100a GEMMs take one CTA per 128-row tile with no L2 hints, no FP8 "
                            f"promotion, the epilogue through smem (consumer, w_hint, a_hint, promote, epi_store, "
                            f"mma_split: got {got}; mokgen.plan.solve(spec, 'sm_100a') gives that form)")
    render = Renderer(plan)
    bw = plan.backward
    render.routing()
    if mx:   # x's rows gathered by the quantizer; h quantized between the GEMMs; W1 / W2 once; the MXFP8 weight
        # gradients' column quantizers (plan wgrad*_dtype=mxfp8)
        for name in MX_QUANT + (MX_QUANT_BACKWARD if bw is not None else ()) + kernels.mx_wgrad_quantizers(plan):
            render.files[f"{name}.py"] = render_quant_mx(plan, name)
    if not mx or (bw is not None and kernels.gather_in_training(plan)):   # MXFP8 training: the bf16 dO / x rows of
        render.gather()                                                    # the BF16 weight gradients (and db2)
    render.files["gemm1.py"] = render_grouped_gemm(plan, 1)
    render.files["gemm2.py"] = render_grouped_gemm(plan, 2)
    render.combine()
    if bw is not None:
        for name in BACKWARD + WGRADS:
            g = getattr(bw, name)
            cluster = 1 if g.cluster == 2 and name in BACKWARD and not mx else g.cluster   # the dgrads' pair form
            if (g.consumer, cluster, g.z_load, g.epi_store) != ("cooperative", 1, "direct", "smem"):
                raise EmitError(f"plan.backward.{name}: the sm_100a backward GEMMs take cooperative 128-row tiles, "
                                f"cluster 1 (BF16 dgrads: 1 or 2), z_load 'direct', epi_store 'smem' (got "
                                f"{g.consumer}, {g.cluster}, "
                                f"{g.z_load!r}, {g.epi_store!r}; mokgen.plan.solve(spec, 'sm_100a') gives that form)")
        render.files["gemm1_train.py"] = render_grouped_gemm(plan, 1, save_z=True)
        g2 = plan.gemm2
        tiles = kernel_tiles(plan)   # the tiles the plan checked (mokgen.sm100.rules)
        for name in BACKWARD:
            d, t = getattr(bw, name), tiles[name]
            if mx and d.bk != g2.bk:
                raise EmitError(f"plan.backward.{name}.bk: the MXFP8 dgrads step K by GEMM 2's {g2.bk}, got {d.bk}")
            render.files[f"{name}.py"] = render_grouped_gemm(plan, name, bn=t.bn, stages=t.stages)
        for name in WGRADS:
            t = tiles[name]
            tile = dict(bn=t.bn, bk=t.bk, stages=t.stages, epi_n=t.epi_n, epi_stages=t.epi_stages,
                        raster=getattr(bw, name).raster_group, mx=t.mx)
            for acc in (False, True):
                render.files[f"{name}{'_acc' if acc else ''}.py"] = render_wgrad(plan, name, accumulate=acc, **tile)
    return render.sources()


WGRAD_TEMPLATE = "sm100/wgrad.py.j2"
WGRADS = ("wgrad1", "wgrad2")


def wgrad_params(plan: Plan, which: str, *, accumulate: bool = False, bn: int = 256, bk: int = 64,
                 stages: int | None = None, epi_n: int = WGRAD_EPI[0], epi_stages: int = WGRAD_EPI[1],
                 raster: int = 8, mx: bool = False) -> dict[str, Any]:
    """The render context of templates/sm100/wgrad.py.j2 for the weight gradient `which`: wgrad1 dW1[g] = dzᵀ xg
    (M = 2I, N = H), wgrad2 dW2[g] = dOgᵀ (s a) (M = H, N = I), the reduction over each group's rows (varlen-K);
    ``accumulate``: the fp32 main_grad form (table ``<which>_acc``). The tile is given here (an sm_100a plan has
    no backward section yet): BM 128 (the UMMA M), `bn` columns, `bk` rows per stage, as many stages as fit
    unless `stages` is given. ``mx``: the MXFP8 form (dtype mxfp8 specs, plan ``wgrad*_dtype=mxfp8``; table
    ``<which>[_acc]_mx``): e4m3 operands with e8m0 scales per 32 rows, the block-scaled MMA, 128 x 128 tiles, K step
    128."""
    if which not in WGRADS:
        raise EmitError(f"render_wgrad: which is 'wgrad1' or 'wgrad2', got {which!r}")
    if plan.arch != ARCH:
        raise EmitError(f"plan.arch: the sm_100a templates need a plan solved for sm_100a, got {plan.arch!r}")
    spec = plan.spec
    if spec.dtype not in ("bf16", "mxfp8"):   # MXFP8 training: BF16 weight gradients from the bf16 tensors
        raise EmitError(f"spec.dtype: the sm_100a weight gradients are BF16 (for bf16 and mxfp8 specs), got "
                        f"{spec.dtype!r}")
    H, I = spec.hidden, spec.ffn
    m_out, n_out = (2 * I, H) if which == "wgrad1" else (H, I)
    what = f"plan.backward.{which}"
    if mx and spec.dtype != "mxfp8":
        raise EmitError(f"{what}: the MXFP8 weight gradient (wgrad*_dtype=mxfp8) belongs to dtype mxfp8 specs, got "
                        f"{spec.dtype!r}")
    if stages is None:
        stages = Tile(1, bn, bk, 0, epi_n, epi_stages, mx=mx).stages_fit(smem_limit(plan))
    _check_tile(plan, what, Tile(1, bn, bk, stages, epi_n, epi_stages, mx=mx))
    if mx and plan.bm % 128:
        raise EmitError(f"{what}.bk: the MXFP8 weight gradient needs routing tiles of whole 128-row scale atoms, got "
                        f"{plan.bm}")
    if bk % 16 or plan.bm % bk:
        raise EmitError(f"{what}.bk: {bk} must be a multiple of the UMMA K (16) dividing the routing tile {plan.bm} "
                        f"(every group starts on a multiple of it)")
    if bn % epi_n or (accumulate and n_out % epi_n):
        raise EmitError(f"{what}.epi_n: {epi_n} must divide the tile's {bn} columns"
                        + (f" and N {n_out} (the fp32 read-add-write goes by whole slices)" if accumulate else ""))
    table = which + ("_acc" if accumulate else "") + ("_mx" if mx else "")
    return dict(args=kernels.ARGS[table], symbols=kernels.SYMBOLS[table], mx=mx, m_out=m_out, n_out=n_out,
                groups=spec.groups, group_m=plan.bm, accumulate=accumulate, bm=UMMA_M, bn=bn, bk=bk, stages=stages,
                acc_stages=ACC_STAGES, epi_n=epi_n, epi_stages=epi_stages, raster=raster,
                m_tiles=-(-m_out // UMMA_M), n_tiles=-(-n_out // bn), clc=CLC)


def render_wgrad(plan: Plan, which: str, *, accumulate: bool = False, name: str | None = None, **tile: Any) -> str:
    """The sm_100a kernel source of the weight gradient `which` (``"wgrad1"`` / ``"wgrad2"``; ``accumulate``: the
    fp32 main_grad form ``<which>_acc``) for `plan`: compiled and checked in CI; not yet part of an sm_100a plan."""
    params = wgrad_params(plan, which, accumulate=accumulate, **tile)
    name = name or which + ("_acc" if accumulate else "")
    spec = plan.spec
    what = ("dW1[g] = dz^T . xg (2I x H)" if which == "wgrad1" else "dW2[g] = dOg^T . (s a) (H x I)")
    title = (f"{name} of {spec.name} (sm_100a): {what} per group, reduced over the group's rows"
             + (" in MXFP8 (e4m3, e8m0 scales per 32 rows)" if params["mx"] else "")
             + (", added into the fp32 main_grad" if accumulate else ", bf16"))
    return _environment().get_template(WGRAD_TEMPLATE).render(
        header=_header(plan, WGRAD_TEMPLATE, template_hash()), name=name, spec_name=spec.name, title=title, **params)


QUANT_MX_TEMPLATE = "sm100/quant_mx.py.j2"
MX_QUANT = tuple(kernels.MX_QUANT_KERNELS)   # quant_mx_gather, quant_mx_used, quant_mx_w1, quant_mx_w2
MX_QUANT_BACKWARD = tuple(kernels.MX_QUANT_BACKWARD)   # quant_mx_dz, quant_mx_w2_cols, quant_mx_w1_cols
MX_QUANT_WGRAD = tuple(kernels.MX_QUANT_WGRAD)   # quant_mx_cols_gather, quant_mx_sa_cols, quant_mx_dz_cols
MX_QUANT_TABLES = {**kernels.MX_QUANT_KERNELS, **kernels.MX_QUANT_BACKWARD, **kernels.MX_QUANT_WGRAD}


def quant_mx_params(plan: Plan, name: str) -> dict[str, Any]:
    """The render context of templates/sm100/quant_mx.py.j2 for MXFP8 quantizer `name`: ``quant_mx_gather`` (x's
    rows gathered by row_src -> GEMM 1's A, K = H; the backward launches it on dO for dgrad1's A),
    ``quant_mx_used`` (h's used rows -> GEMM 2's A, K = I), ``quant_mx_w1`` (W1 [G, 2I, H] -> concat row order),
    ``quant_mx_w2`` (W2 [G, H, I]); for training: ``quant_mx_dz`` (dz's used rows -> dgrad2's A, K = 2I: the
    bounded form), ``quant_mx_w2_cols`` (W2 [G, H, I] with 32-blocks along H: dgrad1's B, (N = I, K = H)) and
    ``quant_mx_w1_cols`` (W1 [G, 2I, H], its rows in the spec's layout, 32-blocks along 2I: dgrad2's B, (N = H,
    K = 2I)), the column form; for MXFP8 weight gradients (plan ``wgrad*_dtype=mxfp8``) the column forms over the
    row space, 32-row blocks down every column, rows of routing weight 0 (padding) as zero: ``quant_mx_cols_gather`` (x's / dO's rows
    gathered, H columns: wgrad1's B, wgrad2's A), ``quant_mx_sa_cols`` (s a, I columns: wgrad2's B) and
    ``quant_mx_dz_cols`` (dz, 2I columns: wgrad1's A)."""
    if name not in MX_QUANT_TABLES:
        raise EmitError(f"render_quant_mx: unknown kernel {name!r}; the MXFP8 quantizers are "
                        f"{', '.join(MX_QUANT_TABLES)}")
    if plan.arch != ARCH or plan.spec.dtype != "mxfp8":
        raise EmitError(f"plan: the MXFP8 quantizers are rendered for dtype mxfp8 plans on sm_100a, got dtype "
                        f"{plan.spec.dtype!r} on {plan.arch!r}")
    spec = plan.spec
    H, I = spec.hidden, spec.ffn
    table = MX_QUANT_TABLES[name]
    form = {"quant_mx_gather": "gather", "quant_mx_used": "used", "quant_mx_dz": "used",
            "quant_mx_w2_cols": "cols", "quant_mx_w1_cols": "cols", "quant_mx_cols_gather": "rows_gather",
            "quant_mx_sa_cols": "rows_used", "quant_mx_dz_cols": "rows_used"}.get(name, "w")
    k_dim = {"quant_mx_gather": H, "quant_mx_used": I, "quant_mx_w1": H, "quant_mx_w2": I, "quant_mx_dz": 2 * I,
             "quant_mx_w2_cols": H, "quant_mx_w1_cols": 2 * I, "quant_mx_cols_gather": H, "quant_mx_sa_cols": I,
             "quant_mx_dz_cols": 2 * I}[name]
    # the column form: w [G, R_ROWS, C_COLS] with R_ROWS the dgrad's K (= k_dim), C_COLS its N
    # the row-space column forms: x [rows | T, C_COLS], C_COLS = k_dim (the wgrad's M or N; K is the rows)
    c_cols = {"quant_mx_w2_cols": I, "quant_mx_w1_cols": H}.get(name, k_dim if form.startswith("rows_") else 0)
    if form.startswith("rows_") and c_cols % 128:
        raise EmitError(f"render_quant_mx: {name}'s {c_cols} columns are not a multiple of 128 (the MXFP8 weight "
                        f"gradients need whole scale atoms: plan wgrad*_dtype=mxfp8 refuses it)")
    # hidden / ffn multiples of 64 but not of 128 (gpt-oss-120b's 2880): a row's last 128-element tile (k_pad), a
    # (group, part) block's last 128 rows of W (n_pad), the column form's last 128 columns (c_pad) are partial; the
    # kernels pad the scale atoms there with code 127
    parts = 2 if name == "quant_mx_w1" else 1
    n_rows = 2 * I if name == "quant_mx_w1" else H
    if k_dim % SF_VEC or (form == "w" and n_rows // parts % 64) or (form == "cols" and c_cols % 64):
        raise EmitError(f"render_quant_mx: {name} needs K = {k_dim} a multiple of {SF_VEC} and its weight rows or "
                        f"columns multiples of 64 (spec: hidden and ffn multiples of 64)")
    return dict(args=kernels.ARGS[table], symbols=kernels.SYMBOLS[table], form=form, k_dim=k_dim, bm=plan.bm,
                threads=256, groups=spec.groups, n_rows=n_rows, parts=parts, r_rows=k_dim, c_cols=c_cols,
                interleave=name == "quant_mx_w1" and spec.gate_up_layout == "interleaved",
                k_pad=k_dim % 128 != 0, n_pad=form == "w" and n_rows // parts % 128 != 0,
                c_pad=form == "cols" and c_cols % 128 != 0)


def render_quant_mx(plan: Plan, name: str) -> str:
    """The sm_100a source of the MXFP8 quantizer `name` (see :func:`quant_mx_params`)."""
    params = quant_mx_params(plan, name)
    what = {"quant_mx_gather": "x's rows gathered by row_src (GEMM 1's A; dO's rows for dgrad1's A)",
            "quant_mx_used": "h's used rows (GEMM 2's A)", "quant_mx_w1": "W1 (concat row order)", "quant_mx_w2": "W2",
            "quant_mx_dz": "dz's used rows (dgrad2's A)",
            "quant_mx_w2_cols": "W2 [G, H, I] along H (dgrad1's B, read MN-major as (N = I, K = H))",
            "quant_mx_w1_cols": "W1 [G, 2I, H] along 2I (dgrad2's B, read MN-major as (N = H, K = 2I))",
            "quant_mx_cols_gather": "x's / dO's rows gathered, 32-row blocks down each column (wgrad1's B, wgrad2's A)",
            "quant_mx_sa_cols": "s a's used rows, 32-row blocks down each column (wgrad2's B)",
            "quant_mx_dz_cols": "dz's used rows, 32-row blocks down each column (wgrad1's A)"}[name]
    title = f"{name} of {plan.spec.name} (sm_100a): MXFP8 quantization of {what}"
    return _environment().get_template(QUANT_MX_TEMPLATE).render(
        header=_header(plan, QUANT_MX_TEMPLATE, template_hash()), name=name, spec_name=plan.spec.name, title=title,
        **params)
