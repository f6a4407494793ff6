"""Emit stage: Plan -> CuTe DSL kernel sources, rendered from the jinja2 templates in ``templates/``.

Output is deterministic (same plan, same bytes) and every file is headed by the spec, the plan and the hash of
the templates, so a generated file says exactly what produced it. Each kernel file is a standalone CuTe DSL
module defining ``KERNEL_NAME`` and ``compile(arch, extra_options="")`` (see docs/contract.md).

This module renders the sm_90a kernels and is the stage's entry (:func:`emit`): a plan for another arch goes to
that arch's renderer (:data:`ARCH_RENDERERS`: sm_100a's is mokgen/sm100/emit.py); what both arch renderers share (environment, header, template hash, Sources) is
mokgen/emit_base.py.
"""
from __future__ import annotations

from typing import Any, Mapping

import jinja2

from .emit_base import (TEMPLATE_DIR, EmitError, Renderer, Sources, _activation, _environment, _header, _table,
                        _w1_strides, pdl_params, template_hash)
from . import kernels
from .sm100 import emit as _sm100_emit
from .plan import (FP8_SPLIT_PROMOTES, L2_HINTS, Plan, epi_ring_problem, h_quant_problem, stage_scales_problem,
                   z_ring_problem, z_stage_problem)

__all__ = ["EXPERIMENTS", "EmitError", "Sources", "TEMPLATE_DIR", "emit", "emit_fp8_quant", "template_hash"]

_SMEM_BARRIERS = 1024


# Instrumentation that is not a plan choice (emit(plan, experimental=...)): "fused_profile" makes the fused
# kernel record per-CTA phase times (tools/kernel_check.py). Variants measured slower have left the templates
# (their numbers stay in bench/NOTES.md): GEMM 1 as two wgmma per k-block, the lagged gather signal, the fused
# kernel's st.global G2 epilogue. Choices that measured even are plan fields (epi_n, epi_stages).
EXPERIMENTS = ("fused_profile",)
# The archs with a renderer of their own (their package's emit.py), by arch; the others are this module's (sm_90a).
ARCH_RENDERERS = {_sm100_emit.ARCH: _sm100_emit.emit}


def _check_smem(plan: Plan, smem: int, what: str, g: Any = None) -> None:
    """`smem` bytes fit one CTA (of GEMM plan `g`, when given: its share of the SM with ctas_per_sm > 1)."""
    from .plan import get_arch, smem_budget

    a = get_arch(plan.arch)
    limit = a.smem_per_cta if g is None else smem_budget(a, g)
    if smem > limit:
        raise EmitError(f"{what} need {smem} bytes of shared memory, limit {limit}")


def _gemm_params(plan: Plan, which: int, save_z: bool = False) -> dict[str, Any]:
    """Forward GEMM `which` (1: gathered x . W1 with the SwiGLU epilogue, saving z when `save_z`; 2: h . W2 with
    the routing weight)."""
    spec = plan.spec
    g = (plan.train_gemm1 if save_z else plan.gemm1) if which == 1 else plan.gemm2
    H, I = spec.hidden, spec.ffn
    fp8 = spec.dtype == "fp8"
    sfx = "_fp8" if fp8 else ""
    if which == 1:
        if g.bn % 2:
            raise EmitError(f"plan.gemm1.bn: must be even (gate and up halves), got {g.bn}")
        n_stride, p_stride = _w1_strides(spec)
        h_quant = _h_quant(g)
        table = ("gemm1_train" if save_z else "gemm1") + ("_hq" if h_quant else "") + sfx
        return _grouped_params(
            plan, g, table, bn=g.bn // 2, n_out=I, k_dim=H, parts=2,
            n_stride=n_stride, k_stride=1, p_stride=p_stride, g_stride=2 * I * H, b_mn=False, epilogue="swiglu",
            save_z=save_z, has_bias=bool(spec.bias), a_gather=g.a_load == "gather", a_rows=g.a_load == "tma_rows",
            fp8=fp8, z_ring=save_z and _z_ring(g), h_quant=h_quant)
    return _grouped_params(
        plan, g, "gemm2" + sfx, bn=g.bn, n_out=H, k_dim=I, parts=1, n_stride=I, k_stride=1, p_stride=H * I,
        g_stride=H * I, b_mn=False, epilogue="weight", has_bias=bool(spec.bias), fp8=fp8)


def _dgrad_params(plan: Plan, name: str) -> dict[str, Any]:
    """The backward's dgrad GEMMs: W read N-major (transposed), A = contiguous rows by TMA.
    dgrad1: dOg [rows, H] . W2[g] (N = I) -> dSwiGLU epilogue; dgrad2: dz [rows, 2I] . W1[g] (N = H) -> store."""
    spec = plan.spec
    H, I = spec.hidden, spec.ffn
    g = getattr(plan.backward, name)
    if spec.dtype == "fp8":   # e4m3 operands; W from its K-major transposed copy (quant_wt): [G, N, K]
        n_out, k_dim = (I, H) if name == "dgrad1" else (H, 2 * I)
        if name == "dgrad1" and I % g.bn:
            raise EmitError(f"plan.backward.dgrad1.bn: {g.bn} must divide ffn {I} (the dSwiGLU epilogue)")
        return _grouped_params(plan, g, name + "_fp8", bn=g.bn, n_out=n_out, k_dim=k_dim, parts=1, n_stride=k_dim,
                               k_stride=1, p_stride=n_out * k_dim, g_stride=n_out * k_dim, b_mn=False,
                               epilogue="dswiglu" if name == "dgrad1" else "store", fp8=True,
                               z_tma=name == "dgrad1" and _z_tma(g))
    if name == "dgrad1":
        if I % g.bn:
            raise EmitError(f"plan.backward.dgrad1.bn: {g.bn} must divide ffn {I} (the dSwiGLU epilogue)")
        if (g.bn // 4) % g.z_chunk:
            raise EmitError(f"plan.backward.dgrad1.z_chunk: {g.z_chunk} must divide the {g.bn // 4} z pairs a thread "
                            f"holds")
        return _grouped_params(plan, g, name, bn=g.bn, n_out=I, k_dim=H, parts=1, n_stride=1, k_stride=I,
                               p_stride=H * I, g_stride=H * I, b_mn=True, epilogue="dswiglu", z_tma=_z_tma(g))
    return _grouped_params(plan, g, name, bn=g.bn, n_out=H, k_dim=2 * I, parts=1, n_stride=1, k_stride=H,
                           p_stride=2 * I * H, g_stride=2 * I * H, b_mn=True, epilogue="store")


def _z_ring(g: Any) -> bool:
    """GEMM 1's z (training) through the stage ring (plan z_store "ring"), checked against the tile it needs."""
    if g.z_store != "ring":
        return False
    if (why := z_ring_problem(g)) is not None:
        raise EmitError(f"plan.gemm1.z_store: ring {why}")
    return True


def _h_quant(g: Any) -> bool:
    """GEMM 1 quantizes h per 1 x 128 in its epilogue (plan h_quant "epilogue"), checked against its tile."""
    if g.h_quant == "kernel":
        return False
    if (why := h_quant_problem(g)) is not None:
        raise EmitError(f"plan.gemm1.h_quant: {g.h_quant} {why}")
    return True


def _z_tma(g: Any) -> bool:
    """dgrad1's z through the stage ring (plan z_load "tma"), checked against the tile it needs."""
    if g.z_load != "tma":
        return False
    if (why := z_stage_problem(g)) is not None:
        raise EmitError(f"plan.backward.dgrad1.z_load: tma {why}")
    return True


def _grouped_params(plan: Plan, g: Any, kernel: str, *, bn: int, n_out: int, k_dim: int, parts: int,
                    n_stride: int, k_stride: int, p_stride: int, g_stride: int, b_mn: bool, epilogue: str,
                    save_z: bool = False, has_bias: bool = False, a_gather: bool = False,
                    a_rows: bool = False, fp8: bool = False, z_tma: bool = False, z_ring: bool = False,
                    h_quant: bool = False) -> dict[str, Any]:
    """The render context of templates/sm90/grouped_gemm.py.j2 for kernel `kernel` of GEMM plan `g`: the
    problem's strides from the spec, every tile and pipeline choice from the plan."""
    spec = plan.spec
    producer_regs, consumer_regs = g.regs
    what = f"plan.{'backward.' if kernel.startswith('dgrad') else ''}{kernel.split('_')[0]}"
    _check_smem(plan, g.smem_bytes(parts * bn), f"{what}: {g.stages} stages")
    if k_dim % g.bk and not fp8:
        raise EmitError(f"{what}.bk: {g.bk} does not divide K={k_dim}")
    if bn % g.epi_n:
        raise EmitError(f"{what}.epi_n: {g.epi_n} does not divide the tile's {bn} columns")
    activation, act_limit = _activation(spec)
    z_n, z_p = (s // spec.hidden for s in _w1_strides(spec))
    fp8_params = _fp8_params(what, g, bn=bn, n_out=n_out, k_dim=k_dim, parts=parts, n_stride=n_stride,
                             k_stride=k_stride, p_stride=p_stride, a_gather=a_gather) if fp8 else {}
    epi_ring, epi_w = _epi_ring(g, parts, what)
    return dict(
        **fp8_params,
        fp8=fp8,
        stage_scales=fp8 and _stage_scales(what, g, a_rows=a_rows),
        **_table(kernel),
        n_out=n_out,
        k_dim=k_dim,
        groups=spec.groups,
        parts=parts,
        n_stride=n_stride,
        k_stride=k_stride,
        p_stride=p_stride,
        g_stride=g_stride,
        b_mn=b_mn,
        epilogue=epilogue,
        save_z=save_z,
        z_n=z_n,
        z_p=z_p,
        has_bias=has_bias,
        bm=g.tile_m,
        group_m=plan.bm,
        pingpong=g.consumer == "pingpong",
        bn=bn,
        bk=g.bk,
        stages=g.stages,
        epi_n=g.epi_n,
        epi_stages=g.epi_stages,
        raster=g.panel_tiles(plan.bm),
        n_tiles=-(-n_out // bn),
        k_tiles=-(-k_dim // g.bk) if fp8 else k_dim // g.bk,   # FP8: a partial last K block (TMA zero-fills)
        a_gather=a_gather,
        a_rows=a_rows,
        producer_regs=producer_regs,
        consumer_regs=consumer_regs,
        activation=activation,
        act_limit=act_limit,
        single_mma=parts == 2,
        mma_split=g.mma_split if fp8 else 1,
        z_chunk=g.z_chunk,
        z_tma=z_tma,
        z_pipe=epilogue == "dswiglu" and g.z_load == "pipe",   # dgrad1's z by global loads, chunks pipelined
        z_ring=z_ring,
        h_quant=h_quant,
        epi_ring=epi_ring,
        epi_w=epi_w,
        gather_split=a_gather and epi_ring,   # warps 2-3 gather, warp 1 stores the ring (plan.epi_ring_problem)
        cluster=g.cluster,
        w_policy=L2_HINTS[g.w_hint],
        w_hint_name=g.w_hint,
        a_policy=L2_HINTS[g.a_hint] if not (a_gather or a_rows) else None,
        a_hint_name=g.a_hint,
    )


def _stage_scales(what: str, g: Any, *, a_rows: bool) -> bool:
    """Whether FP8 GEMM `g` stages its scales in shared memory (plan stage_scale_bytes, the scale_load "stage"
    form): a producer warp copies each K block's A-row and W-block scales into a ring of their own, so the
    consumers' promotion reads shared memory instead of waiting on global loads (checked: stage_scales_problem;
    one TMA box per gathered row, a_rows, is no tile of contiguous rows either)."""
    if g.stage_scale_bytes == 0:
        return False
    if (why := stage_scales_problem(g)) is not None or a_rows:
        raise EmitError(f"{what}.stage_scale_bytes {g.stage_scale_bytes}: "
                        f"{why or 'staged scales need TMA-loaded A tiles, not one box per gathered row'}")
    return True


def _fp8_params(what: str, g: Any, *, bn: int, n_out: int, k_dim: int, parts: int, n_stride: int, k_stride: int,
                p_stride: int, a_gather: bool) -> dict[str, Any]:
    """The FP8 form's constants: where a tile's W rows fall in the 128 x 128 scale blocks (sb_n, sb_p: W rows
    per output column and per part), checked so that each part of a tile reads one scale block per K block."""
    if g.bk != 128 or k_dim % 16:
        raise EmitError(f"{what}.bk: FP8 K blocks are 128 wide (one scale per stage; K a multiple of 16), got bk "
                        f"{g.bk}, K {k_dim}")
    if k_stride != 1:
        raise EmitError(f"{what}: FP8 wgmma reads K-major operands only (W needs a transposed copy)")
    if g.consumer != "cooperative":
        raise EmitError(f"{what}: the FP8 form runs cooperative consumers (got {g.consumer})")
    if a_gather and k_dim % g.bk:   # a row's last K block would read past the row (TMA tiles zero-fill it)
        raise EmitError(f"{what}.a_load: the FP8 cp.async gather reads whole 128-wide K blocks of each row, so K must "
                        f"be a multiple of 128, got {k_dim}")
    # mma_split 2: two 128-column wgmma halves of one part's tile, or GEMM 1's two parts of 128 columns each
    if g.mma_split not in (1, 2) or (g.mma_split == 2 and (g.promote not in FP8_SPLIT_PROMOTES or bn % 2
                                                            or (parts == 2 and bn != 128) or parts > 2)):
        raise EmitError(f"{what}.mma_split: {g.mma_split} (2: one part's two halves or two parts of 128 columns, "
                        f"serial or staggered promotion; got parts {parts}, promote {g.promote}, bn {bn})")
    sb_n, sb_p = n_stride // k_dim, p_stride // k_dim
    half = bn if parts == 2 else bn // g.mma_split   # the output columns of one wgmma issue
    span = half * sb_n   # the W rows one wgmma issue covers: within one scale block
    if n_stride % k_dim or p_stride % k_dim or 128 % span or not (parts == 1 or sb_p % span == 0 or sb_p < sb_n):
        raise EmitError(f"{what}.bn: a tile's {bn} columns of each part must lie in one 128-row scale block of W "
                        f"({sb_n} W rows per column, parts {sb_p} rows apart)")
    w_rows = parts * n_out
    return dict(sb_n=sb_n, sb_p=sb_p, sb_rows=-(-w_rows // 128), promote=g.promote)


# the fused kernel's bounded waits (fused.py.j2 wait_count) and combine granularity; its sync workspace layout
# is mokgen.ops.FUSED_SYNC_HEAD + max_m_tiles
FUSED_TIMEOUT_NS = 2_000_000_000
FUSED_TOK_PER_TASK = 8


def _fused_params(plan: Plan) -> dict[str, Any]:
    spec = plan.spec
    g1, g2 = plan.gemm1, plan.gemm2
    H, I = spec.hidden, spec.ffn
    bn1 = g1.bn // 2
    if g1.bn != g2.bn or H % g2.bn or I % bn1:
        raise EmitError(f"plan: the fused kernel needs gemm1.bn == gemm2.bn dividing hidden {H} (and bn/2 | ffn "
                        f"{I}), got {g1.bn}/{g2.bn}")
    if g1.bk != g2.bk or H % g1.bk or I % g1.bk:
        raise EmitError(f"plan: the fused kernel needs one bk dividing hidden and ffn, got {g1.bk}/{g2.bk}")
    if g1.a_load != "gather":
        raise EmitError(f"plan.gemm1.a_load: the fused kernel gathers its rows itself, got {g1.a_load!r}")
    stages = min(g1.stages, g2.stages)
    # the stage ring (A tile + one B operand of g2.bn rows), G2's epilogue buffers, the barriers
    smem = (stages * (plan.bm * g1.bk + g2.bn * g1.bk) * 2 + plan.bm * g2.epi_n * 2 * g2.epi_stages
            + _SMEM_BARRIERS)
    _check_smem(plan, smem, f"plan: {stages} fused stages")
    n_stride, p_stride = _w1_strides(spec)
    activation, act_limit = _activation(spec)
    producer_regs, consumer_regs = g1.regs
    return dict(
        **_table("fused"),
        hidden=H, ffn=I, groups=spec.groups, topk=spec.topk, slots=spec.topk + spec.shared_experts,
        w1_n_stride=n_stride, w1_p_stride=p_stride, has_bias=bool(spec.bias), bm=plan.bm, bn1=bn1, bk=g1.bk,
        stages=stages, raster=g1.raster_group, chunk_m=max(1, plan.chunk_rows // plan.bm),
        epi_n=g2.epi_n, epi_stages=g2.epi_stages,
        tok_per_task=FUSED_TOK_PER_TASK, producer_regs=producer_regs, consumer_regs=consumer_regs,
        timeout_ns=FUSED_TIMEOUT_NS, activation=activation, act_limit=act_limit,
    )


def emit(plan: Plan, experimental: tuple[str, ...] = ()) -> Sources:
    unknown = sorted(set(experimental) - set(EXPERIMENTS))
    if unknown:
        raise EmitError(f"experimental: unknown {unknown}; known {list(EXPERIMENTS)}")
    own = ARCH_RENDERERS.get(plan.arch)
    if own is not None:   # e.g. Blackwell: its own GEMM template, the SIMT kernels shared (mokgen/sm100/emit.py)
        if experimental:
            raise EmitError(f"experimental: {list(experimental)} are sm_90a kernels' options")
        return own(plan)
    if plan.arch != "sm_90a":
        raise EmitError(f"plan.arch: kernel templates exist for sm_90a and sm_100a, got {plan.arch!r}")
    spec = plan.spec
    render = Renderer(plan)
    if spec.dtype == "fp8":  # the quantization kernels the layer launches; the FP8 GEMMs are planned separately
        render.files.update(emit_fp8_quant(plan, fp8_quant_kernels(plan), env=render.env, thash=render.thash))
    fused = plan.schedule == "fused"
    render.routing(zero_sync=fused)
    if fused:
        render("sm90/fused.py.j2", "fused",
               f"Fused MoE forward of {spec.name}: gathered GEMM 1 + SwiGLU, GEMM 2 + routing weight, combine",
               **_fused_params(plan), profile="fused_profile" in experimental)
        return render.sources()
    training = plan.backward is not None
    # GEMM 1's TMA rows (FP8: quant_rows_gather's instead); the backward gathers rows of dO and x with it (and
    # gemm1_train's), unless FP8's quantizers gather them all
    if kernels.uses_gather_kernel(plan) or (training and kernels.gather_in_training(plan)):
        render.gather()
    render("sm90/grouped_gemm.py.j2", "gemm1",
           f"GEMM 1 of {spec.name}: gathered token rows x W1 (gate, up), SwiGLU epilogue -> h", **_gemm_params(plan, 1))
    render("sm90/grouped_gemm.py.j2", "gemm2",
           f"GEMM 2 of {spec.name}: h x W2, routing weight in the epilogue -> ys", **_gemm_params(plan, 2))
    render.combine()
    if spec.ep > 1 and spec.dtype == "bf16":   # expert parallelism's kernels (issue 22): routing, pull, push
        render.ep()
    if training:
        render("sm90/grouped_gemm.py.j2", "gemm1_train",
               f"GEMM 1 of {spec.name} for training: as gemm1, and saves the pre-activation z for the backward",
               **_gemm_params(plan, 1, save_z=True))
        render("sm90/grouped_gemm.py.j2", "dgrad1",
               f"Backward GEMM dgrad1 of {spec.name}: dO rows x W2 (transposed), dSwiGLU + router-gradient epilogue",
               **_dgrad_params(plan, "dgrad1"))
        render("sm90/grouped_gemm.py.j2", "dgrad2",
               f"Backward GEMM dgrad2 of {spec.name}: dz x W1 (transposed) -> per-slot dx rows",
               **_dgrad_params(plan, "dgrad2"))
        for name, what in (("wgrad1", "dW1 = dzᵀ . x rows"), ("wgrad2", "dW2 = dO rowsᵀ . (s a)")):
            for acc in (False, True):
                render("sm90/wgrad.py.j2", name + ("_acc" if acc else ""),
                       f"Backward GEMM {name} of {spec.name}: {what} per expert group (varlen K)"
                       + (", added into fp32 main_grad" if acc else ""), **_wgrad_params(plan, name, acc))
    return render.sources()


# the FP8 quantization kernels: template, title, template parameters (every size is symbolic: nothing from the plan)
# the weights' quantizers' CTA: threads (256: half a block row a thread; 512: a quarter) and the launch bound's CTAs
# per SM (0: none; ptxas then fits the registers to one CTA)
QUANT_W_FORM = dict(threads=512, ctas_per_sm=0)
FP8_QUANT = {
    "quant_rows": ("sm90/quant_rows.py.j2", "FP8 quantization of rows: 1x128 tiles (x, h, dO)",
                   dict(threads=256, bounded=False, gather=False)),
    "quant_rows_used": ("sm90/quant_rows.py.j2", "FP8 quantization of the used rows of the padded row space "
                        "(meta[0] * BM): 1x128 tiles (h)", dict(threads=256, bounded=True, gather=False)),
    "quant_rows_gather": ("sm90/quant_rows.py.j2", "FP8 quantization of gathered token rows (x[row_src[r]] for the "
                          "used rows): GEMM 1's A operand", dict(threads=256, bounded=False, gather=True)),
    "quant_w": ("sm90/quant_w.py.j2", "FP8 quantization of weights: 128x128 blocks",
                dict(transpose=False, **QUANT_W_FORM)),
    "quant_wt": ("sm90/quant_w.py.j2", "FP8 quantization of weights: 128x128 blocks, and the transposed copy",
                 dict(transpose=True, **QUANT_W_FORM)),
    "quant_cols": ("sm90/quant_cols.py.j2", "FP8 quantization of columns: 128x1 tiles, transposed out (wgrad)",
                   dict(bounded=False, gather=False, rows_too=False)),
    "quant_cols_used": ("sm90/quant_cols.py.j2", "FP8 quantization of the used rows' columns (meta[0] * BM): "
                        "128x1 tiles, transposed out (the wgrads' s a)", dict(bounded=True, gather=False, rows_too=False)),
    "quant_cols_gather": ("sm90/quant_cols.py.j2", "FP8 quantization of gathered token rows' columns (x[row_src[r]] "
                          "for the used rows): 128x1 tiles, transposed out (the wgrads' x, dO rows)",
                          dict(bounded=False, gather=True, rows_too=False)),
    "quant_both_used": ("sm90/quant_cols.py.j2", "FP8 quantization of the used rows (meta[0] * BM) along both dims "
                        "from one read: 1x128 row tiles and 128x1 column tiles, transposed (dz: dgrad2's and "
                        "wgrad1's operands)", dict(bounded=True, gather=False, rows_too=True)),
    "quant_both_gather": ("sm90/quant_cols.py.j2", "FP8 quantization of gathered token rows along both dims from one "
                          "read: 1x128 row tiles and 128x1 column tiles, transposed (dO: dgrad1's and wgrad2's "
                          "operands)", dict(bounded=False, gather=True, rows_too=True)),
}


def fp8_quant_kernels(plan: Plan) -> tuple[str, ...]:
    """The FP8 quantizers an FP8 plan's layer launches (mokgen.kernels.fp8_layer_kernels, and FP8_WGRAD_KERNELS when
    a training plan runs a weight gradient in FP8): what :func:`emit` renders for it."""
    backward = plan.backward if plan.schedule == "chain" else None
    wgrad8 = backward is not None and any(getattr(backward, n).elem_bytes == 1 for n in ("wgrad1", "wgrad2"))
    return kernels.fp8_layer_kernels(plan) + (kernels.FP8_WGRAD_KERNELS if wgrad8 else ())


def emit_fp8_quant(plan: Plan, kernels_: tuple[str, ...] | None = None, *, env: jinja2.Environment | None = None,
                   thash: str | None = None, params: Mapping[str, Any] | None = None) -> dict[str, str]:
    """{file name: source} of the FP8 quantization kernels (``kernels_``: a subset of :data:`FP8_QUANT`, default
    all) for ``plan``'s spec: templates/sm90/quant_*.py.j2, signatures from the argument table. :func:`emit`
    includes them when ``plan.spec.dtype == "fp8"``; the FP8 GEMM emit can call this directly. The kernels take
    every size at run time, so only the header depends on the plan. ``params`` replaces template parameters of
    the table (a benchmark's forms, e.g. tools/quant_bench.py's ``QUANT_W_FORM`` variants)."""
    env = env or _environment()
    thash = thash or template_hash()
    out: dict[str, str] = {}
    for name in kernels_ or tuple(FP8_QUANT):
        if name not in FP8_QUANT:
            raise EmitError(f"emit_fp8_quant: unknown kernel {name!r}; known {list(FP8_QUANT)}")
        template, title, table_params = FP8_QUANT[name]
        out[f"{name}.py"] = env.get_template(template).render(
            header=_header(plan, template, thash), name=name, title=title, spec_name=plan.spec.name, bm=plan.bm,
            **pdl_params(plan), **{**table_params, **{k: v for k, v in (params or {}).items() if k in table_params}},
            **_table(name))
    return out


def _wgrad_params(plan: Plan, name: str, accumulate: bool) -> dict[str, Any]:
    """templates/sm90/wgrad.py.j2: out[g] (M x N) = A[rows of g]ᵀ . B[rows of g], fp32 accumulate."""
    from .plan import backward_shape, ctas_per_sm_problem, get_arch

    g = getattr(plan.backward, name)
    m, n, _ = backward_shape(plan.spec, name)
    producer_regs, consumer_regs = g.regs
    fp8 = g.elem_bytes == 1
    what = f"plan.backward.{name}"
    if fp8:   # e4m3 operands per 128 x 1 tile: one 128-row scale block per K step, so per routing tile
        if plan.spec.dtype != "fp8":
            raise EmitError(f"{what}.elem_bytes: FP8 weight gradients belong to dtype fp8 specs, got "
                            f"{plan.spec.dtype}")
        if g.promote not in ("serial", "stagger", "overlap"):
            raise EmitError(f"{what}.promote: the FP8 weight gradients promote serial, stagger or overlap, got "
                            f"{g.promote!r}")
        if g.bk != 128 or plan.bm % g.bk or g.bn != 128 * g.mma_split or g.mma_split not in (1, 2):
            raise EmitError(f"{what}: FP8 wgrad tiles are 128 x 128 (or 128 x 256 in two wgmma halves, mma_split 2) "
                            f"with 128-row K steps that divide the routing tile (got bn {g.bn}, mma_split "
                            f"{g.mma_split}, bk {g.bk}, routing tile {plan.bm})")
        if g.mma_split == 2 and g.promote not in FP8_SPLIT_PROMOTES:
            raise EmitError(f"{what}.promote: the 128 x 256 FP8 wgrad promotes its halves in turn (serial, or "
                            f"stagger), got {g.promote!r}")
    if (why := ctas_per_sm_problem(g, get_arch(plan.arch))) is not None:
        raise EmitError(f"{what}.ctas_per_sm: {why}")
    if not accumulate:
        _check_smem(plan, g.smem_bytes(), f"{what}: {g.stages} stages", g)
    epi_ring, epi_w = _epi_ring(g, 1, what) if not accumulate else (False, 0)
    table = name + ("_acc" if accumulate else "") + ("_fp8" if fp8 else "")
    return dict(m_out=m, n_out=n, groups=plan.spec.groups, group_m=plan.bm, bm=g.bm, bn=g.bn, bk=g.bk,
                stages=g.stages, epi_n=g.epi_n, epi_stages=g.epi_stages, raster=g.raster_group,
                accumulate=accumulate, producer_regs=producer_regs, consumer_regs=consumer_regs,
                epi_ring=epi_ring, epi_w=epi_w, fp8=fp8, promote=g.promote if fp8 else "serial",
                mma_split=g.mma_split if fp8 else 1, ctas_per_sm=g.ctas_per_sm, **_table(table))


def _epi_ring(g: Any, parts: int, what: str) -> tuple[bool, int]:
    """(the output goes through the stage ring, its box width): plan epi_store "ring", checked against the tile."""
    if g.epi_store != "ring":
        return False, 0
    why, w = epi_ring_problem(g, parts)
    if why is not None:
        raise EmitError(f"{what}.epi_store: ring {why}")
    return True, w


