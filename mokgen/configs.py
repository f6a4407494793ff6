"""The config space's constraints and enumeration: whether a set of plan overrides is legal for a spec
(:func:`check_config`, before solving), whether a solved plan satisfies the templates' constraints
(:func:`check_plan`: shared memory, registers, divisibility, what each template supports), and the override dicts
the solver ranks and ``mokgen tune`` / ``tune --train`` compile and time (:func:`enumerate_configs`,
:func:`enumerate_backward_configs`).

The knob table itself (legal values, search values, override keys) is :mod:`mokgen.space`, which the plan reads;
this module needs the plan (it solves and inspects plans), so it sits above both. The constraints here are sm_90a's;
an arch with kernels of its own has its constraints in its package (:data:`ARCH_CONFIGS`; sm_100a:
mokgen/sm100/configs.py), checked after the override keys and values of its own table.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Iterator, Mapping

from . import plan as P
from .sm100 import configs as sm100_configs
from . import space as S

__all__ = ["check_config", "check_plan", "enumerate_configs", "enumerate_backward_configs", "ARCH_CONFIGS"]

# The archs whose constraints are their package's (check_config after the table's keys and values, check_plan): a
# module with check_config(spec, arch, cfg) and check_plan(plan). Adding an arch: its package's configs.py, its row.
ARCH_CONFIGS = {"sm_100a": sm100_configs}


def _resolved(cfg: Mapping[str, Any], kernel: str, key: str, default: Any) -> Any:
    return cfg.get(f"{kernel}_{key}", cfg.get(key, default))


def check_config(spec: Any, arch: str, cfg: Mapping[str, Any]) -> list[str]:
    """Why the override dict ``cfg`` is illegal on ``spec``/``arch`` before any solving (empty: legal so far):
    unknown keys, values outside the table, tile N divisibility, registers and shared memory of the tile,
    what the fused template supports."""
    sp_ = S.space(arch)
    a = P.get_arch(arch)
    out: list[str] = []
    keys = S.override_keys(arch)
    for key, value in cfg.items():
        if key not in keys:
            out.append(f"{key}: not a knob of {arch}")
        elif value not in S.legal_values(key, arch):
            out.append(f"{key}: {value!r} not in the {arch} space")
    if out:
        return out
    if (own := ARCH_CONFIGS.get(arch)) is not None:   # e.g. sm_100a: its kernels' constraints
        return own.check_config(spec, arch, cfg)
    if getattr(spec, "dtype", "bf16") == "fp8":
        return _check_fp8_config(spec, arch, cfg)
    if any(k.endswith("promote") for k in cfg):
        return [f"{k}: the promotion mode applies to FP8 specs" for k in cfg if k.endswith("promote")]
    if any(k in P.WGRAD_DTYPE_KEYS and v == "fp8" for k, v in cfg.items()):
        return [f"{k}: FP8 weight gradients apply to FP8 specs" for k, v in cfg.items()
                if k in P.WGRAD_DTYPE_KEYS and v == "fp8"]
    if "gemm1_h_quant" in cfg:
        return ["gemm1_h_quant: h's FP8 quantization applies to FP8 specs"]
    if cfg.get("bwd_x_cols") == "forward":
        return ["bwd_x_cols: x's column quantization applies to FP8 specs (an FP8 wgrad1)"]
    fused = cfg.get("schedule", "chain") == "fused"
    for which, kernel in ((1, "gemm1"), (2, "gemm2")):
        bn = cfg.get(f"{kernel}_bn")
        consumer = _resolved(cfg, kernel, "consumer", "cooperative")
        if bn is not None and (why := P._gemm_problem(spec, a, which, bn)):
            out.append(f"{kernel}_bn: {why}")
        if bn is not None and f"{kernel}_stages" in cfg:
            fit = min(sp_.max_stages, P._stages_fit(a, bn, consumer))
            if cfg[f"{kernel}_stages"] > fit:
                out.append(f"{kernel}_stages: {cfg[f'{kernel}_stages']} > {fit} that fit with bn {bn} ({consumer})")
        if fused:
            if consumer != "cooperative":
                out.append(f"{kernel}_consumer: the fused template's tiles are cooperative")
            if _resolved(cfg, kernel, "cluster", 1) != 1:
                out.append(f"{kernel}_cluster: the fused template runs one CTA per task")
            for hint in ("w_hint", "a_hint"):
                if _resolved(cfg, kernel, hint, "normal") != "normal":
                    out.append(f"{kernel}_{hint}: the fused template's loads take no L2 hints")
    if fused:
        b1, b2 = cfg.get("gemm1_bn"), cfg.get("gemm2_bn")
        if b1 is not None and b2 is not None and (b1 != b2 or spec.hidden % b2):
            out.append(f"schedule: fused needs gemm1_bn == gemm2_bn dividing hidden {spec.hidden}, got {b1}/{b2}")
        if cfg.get("gemm1_a_load", "gather") != "gather":
            out.append("gemm1_a_load: the fused template gathers its rows itself")
    if cfg.get("gemm1_a_load", "tma") != "tma" and "gemm1_a_hint" in cfg and cfg["gemm1_a_hint"] != "normal":
        out.append("gemm1_a_hint: GEMM 1 does not load A by TMA boxes of a tile")
    if out or not any(S.backward_kernel(k) in S._BWD for k in cfg):
        return out
    return _check_backward_config(spec, arch, cfg)


# What the FP8 form fixes (mokgen.plan.fp8_gemm): tile N 128, cooperative consumers, cluster 1, A by TMA tiles
# (GEMM 1's own gather an override of its own: plan.FP8_A_LOADS), the chain schedule, and the dgrads' tiles
# likewise; these overrides do not apply to an FP8 spec.
_FP8_FIXED = {"bn": "tile N 128", "consumer": "cooperative tiles", "a_load": "A by TMA tiles",
              "epi_n": "the forward epilogue staging"}


def _check_fp8_config(spec: Any, arch: str, cfg: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    if arch != "sm_90a":
        return [f"arch: dtype fp8 is planned for sm_90a, got {arch}"]
    if cfg.get("schedule", "chain") != "chain":
        out.append("schedule: the FP8 forward runs the chain schedule")
    for key in cfg:
        kernel, _, knob = key.partition("_") if key.startswith(("gemm", "dgrad")) else ("", "", key)
        if key in P.FP8_BN_KEYS:   # 128, or 256 in two wgmma halves (plan.fp8_widen)
            if cfg[key] not in P.FP8_BNS:
                out.append(f"{key}: FP8 tiles are {' or '.join(map(str, P.FP8_BNS))} columns wide")
            elif why := P.fp8_tile_shape_problem(spec, P.FP8_GEMM_INDEX[kernel], cfg[key]):
                out.append(f"{key}: {cfg[key]} columns {why}")
            elif cfg[key] != P.FP8_BN and cfg.get(f"{kernel}_promote", "serial") not in P.FP8_SPLIT_PROMOTES:
                out.append(f"{key}: {cfg[key]} columns promote their halves in turn (serial, or stagger), not "
                           f"{cfg[f'{kernel}_promote']}")
            elif cfg[key] != P.FP8_BN and kernel.startswith("gemm") and cfg.get(f"{kernel}_cluster",
                                                                                cfg.get("cluster", 1)) != 1:
                out.append(f"{key}: {cfg[key]} columns need cluster 1, got "
                           f"{cfg.get(f'{kernel}_cluster', cfg.get('cluster', 1))}")
        elif key == "gemm1_a_load":   # TMA tiles of quant_rows_gather's rows, or GEMM 1's own gather (plan)
            if cfg[key] not in P.FP8_A_LOADS:
                out.append(f"{key}: the FP8 GEMM 1 reads its rows by {' or '.join(P.FP8_A_LOADS)}, got {cfg[key]!r}")
            elif cfg[key] == "gather":   # against the config's own cluster and scale path
                g1 = P.solve(spec, arch).gemm1
                cluster = int(cfg.get("gemm1_cluster", cfg.get("cluster", 1)))
                staged = cfg.get("gemm1_scale_load", cfg.get("scale_load", "global")) == "stage"
                g1 = dataclasses.replace(g1, cluster=cluster, stage_scale_bytes=P.stage_scale_bytes(g1) if staged else 0)
                if why := P.fp8_gather_problem(spec, g1):
                    out.append(f"{key}: gather {why}")
        elif kernel.startswith("dgrad") and knob == "stages":   # within what fits the FP8 tile: the plan says
            try:
                P.solve(spec, arch, **{k: v for k, v in cfg.items() if k == key or k in P.FP8_BN_KEYS})
            except P.PlanError as e:
                out.append(str(e).removeprefix("plan."))
        elif kernel.startswith("dgrad") and knob in ("bn", "consumer"):
            out.append(f"{key}: the FP8 dgrad's tile is fixed ({knob})")
        elif knob in _FP8_FIXED and not kernel.startswith("wgrad"):
            out.append(f"{key}: fixed by the FP8 form ({_FP8_FIXED[knob]})")
    for key in [k for k in cfg if k.endswith("_promote") and cfg[k] == "stagger" and not k.startswith("wgrad")]:
        if not out and (why := P.stagger_problem(_fp8_gemm_of(P.solve(spec, arch), key.removesuffix("_promote")))):
            out.append(f"{key}: stagger {why}")
    if cfg.get("gemm1_h_quant") == "epilogue" and not out:   # against the GEMM 1 tile the rest of the config gives
        try:
            g1 = P.solve(spec, arch, **{k: v for k, v in cfg.items() if k != "gemm1_h_quant"}).gemm1
        except P.PlanError:
            g1 = None   # the rest is refused by the solver itself, which says why
        if g1 is not None and (why := P.h_quant_problem(dataclasses.replace(g1, h_quant="epilogue"))):
            out.append(f"gemm1_h_quant: epilogue {why}")
    if cfg.get("dgrad1_z_load") == "tma" and not out and (why := P.z_stage_problem(P.solve(spec, arch).backward.dgrad1)):
        out.append(f"dgrad1_z_load: tma {why}")
    if "dgrad1_z_chunk" in cfg and not out:   # against the FP8 dgrad1's tile
        d1 = P.solve(spec, arch).backward.dgrad1
        if (d1.bn // 4) % cfg["dgrad1_z_chunk"]:
            out.append(f"dgrad1_z_chunk: {cfg['dgrad1_z_chunk']} does not divide the {d1.bn // 4} z pairs a thread "
                       f"holds (FP8 dgrad1 bn {d1.bn})")
    # the FP8 weight gradients: asked for, or the default where it applies
    fp8_w = {n for n in ("wgrad1", "wgrad2") if cfg.get(f"{n}_dtype", P.FP8_WGRAD_DEFAULT if
                                                        P.wgrad_default_applies(spec, n, cfg) else "bf16") == "fp8"}
    if cfg.get("bwd_x_cols") == "forward" and "wgrad1" not in fp8_w:
        out.append("bwd_x_cols: 'forward' quantizes x's columns for an FP8 wgrad1 (wgrad1_dtype=fp8)")
    for n in ("wgrad1", "wgrad2"):
        if f"{n}_promote" in cfg and n not in fp8_w:
            out.append(f"{n}_promote: the promotion applies to FP8 weight gradients ({n}_dtype=fp8)")
        if n in fp8_w and cfg.get(f"{n}_bn", P.FP8_BN) not in P.FP8_BNS:
            out.append(f"{n}_bn: FP8 weight gradients run 128 x 128 or 128 x 256 tiles")
        elif (n in fp8_w and cfg.get(f"{n}_bn") == 2 * P.FP8_BN
              and cfg.get(f"{n}_promote", "serial") not in P.FP8_SPLIT_PROMOTES):
            out.append(f"{n}_promote: the 128 x 256 FP8 weight gradient promotes its halves in turn (serial, or "
                       f"stagger)")
    wgrad = {k: v for k, v in cfg.items() if k.startswith("wgrad") and S.backward_kernel(k) not in fp8_w
             and not k.endswith(("_dtype", "_promote"))}
    if not out and wgrad:   # the BF16 weight-gradient GEMMs: their own constraints
        out += _check_backward_config(spec, arch, wgrad)
    if not out and any(S.backward_kernel(k) in fp8_w and not k.endswith("_dtype") for k in cfg):
        try:   # the FP8 tiles' knobs (stages within what fits, ...): the plan says
            P.solve(spec, arch, **{k: v for k, v in cfg.items() if S.backward_kernel(k) in fp8_w})
        except P.PlanError as e:
            out.append(str(e).removeprefix("plan."))
    return out


def _fp8_gemm_of(plan: Any, name: str) -> Any:
    return getattr(plan, name) if name in ("gemm1", "gemm2") else getattr(plan.backward, name)


def _check_backward_config(spec: Any, arch: str, cfg: Mapping[str, Any]) -> list[str]:
    """The backward GEMMs' knobs of ``cfg``: tile N (dgrad1: dividing ffn, with a z chunk dividing bn / 4), the
    consumer mode against the routing tile, stages within what fits the tile's shared memory."""
    a = P.get_arch(arch)
    out: list[str] = []
    # the routing tile (64 rows when both forward GEMMs ping-pong): the forward part of cfg, solved
    try:
        bm = P.solve(spec, arch, **{k: v for k, v in cfg.items() if S.backward_kernel(k) not in S._BWD}).bm
    except P.PlanError as e:
        return [str(e).removeprefix("plan.")]
    for name in P.BACKWARD_GEMMS:
        bn = cfg.get(f"{name}_bn")
        if bn is not None and (why := P._backward_bn_problem(spec, a, name, bn)):
            out.append(f"{name}_bn: {why}")
            continue
        g = P._backward_gemm(spec, a, name, bm, bn)
        consumer = cfg.get(f"{name}_consumer", g.consumer)
        if consumer == "cooperative" and g.bm < P.BM:
            out.append(f"{name}_consumer: 128-row cooperative tiles would span two {g.bm}-row routing tiles")
            continue
        g = P._with_consumer(a, g, consumer)
        if f"{name}_stages" in cfg and cfg[f"{name}_stages"] > (most := P._stages_most(a, g)):
            out.append(f"{name}_stages: {cfg[f'{name}_stages']} > {most} that fit with bn {g.bn} ({consumer})")
        if name == "dgrad1" and "dgrad1_z_chunk" in cfg and (g.bn // 4) % cfg["dgrad1_z_chunk"]:
            out.append(f"dgrad1_z_chunk: {cfg['dgrad1_z_chunk']} does not divide the {g.bn // 4} z pairs a thread "
                       f"holds (dgrad1 bn {g.bn})")
        if name == "dgrad1" and cfg.get("dgrad1_z_load") == "tma" and (why := P.z_stage_problem(g)):
            out.append(f"dgrad1_z_load: tma {why}")
        if cfg.get(f"{name}_epi_store") == "ring" and (why := P.epi_ring_problem(g)[0]):
            out.append(f"{name}_epi_store: ring {why}")
    return out


def check_plan(plan: Any) -> list[str]:
    """The constraints on a solved :class:`mokgen.plan.Plan` (empty: it satisfies them all): every knob's value in
    the table, tile N divisibility, the stage ring + epilogue buffers + barriers within the CTA's shared memory
    (as the templates allocate it), accumulator registers, tiles dividing the routing tile, the fused template's
    requirements. Recomputed from the plan's fields, independently of how the solver chose them. An arch with
    constraints of its own (:data:`ARCH_CONFIGS`, e.g. sm_100a: its TMEM and shared-memory budgets) checks its plans
    itself."""
    if (own := ARCH_CONFIGS.get(plan.arch)) is not None:
        return own.check_plan(plan)
    sp_ = S.space(plan.arch)
    a = P.get_arch(plan.arch)
    spec = plan.spec
    out: list[str] = []
    if plan.schedule not in sp_.values("schedule"):
        out.append(f"schedule {plan.schedule!r} not in the space")
    for which, name in ((1, "gemm1"), (2, "gemm2")):
        g = getattr(plan, name)
        for key in ("bn", "consumer", "cluster", "w_hint", "a_hint"):
            if getattr(g, key) not in sp_.values(key, name):
                out.append(f"{name}.{key} {getattr(g, key)!r} not in the space")
        if g.raster_group not in sp_.values("raster_group", name):
            out.append(f"{name}.raster_group {g.raster_group} not in the space")
        if not sp_.min_stages <= g.stages <= sp_.max_stages:
            out.append(f"{name}.stages {g.stages} outside [{sp_.min_stages}, {sp_.max_stages}]")
        if which == 1:
            if g.a_load not in sp_.values("a_load", "gemm1"):
                out.append(f"gemm1.a_load {g.a_load!r} not in the space")
            if spec.ffn % (g.bn // 2):
                out.append(f"gemm1.bn {g.bn}: ffn {spec.ffn} % {g.bn // 2} != 0")
        elif g.a_load != "tma":
            out.append(f"gemm2.a_load {g.a_load!r}: GEMM 2 reads h by TMA")
        n, k = P._gemm_shape(spec, which)
        if (k % g.bk and g.elem_bytes != 1) or g.k_tiles != g.k_tiles_for(k) or g.n_tiles != -(-n // g.bn):
            out.append(f"{name}: k_tiles/n_tiles do not match N {n}, K {k}")
        tile_m = g.tile_m
        if (smem := g.smem_bytes()) > a.smem_per_cta:   # stages, scales, epilogue buffers (none with the ring)
            out.append(f"{name}: {g.stages} stages need {smem} B of shared memory > {a.smem_per_cta}")
        if P._acc_regs(g.bn) + P.REG_OVERHEAD > P._consumer_regs(a):
            out.append(f"{name}: accumulator registers {P._acc_regs(g.bn)} + {P.REG_OVERHEAD} exceed "
                       f"{P._consumer_regs(a)}")
        if plan.bm % tile_m:
            out.append(f"{name}: {tile_m}-row tiles do not divide the routing tile {plan.bm}")
        if g.a_hint != "normal" and g.a_load != "tma":
            out.append(f"{name}.a_hint {g.a_hint!r} but A is not loaded by TMA tiles")
    if plan.backward is not None:
        out += _check_backward_plan(plan)
    fp8_gemms = [("gemm1", plan.gemm1), ("gemm2", plan.gemm2)] + (
        [("backward.dgrad1", plan.backward.dgrad1), ("backward.dgrad2", plan.backward.dgrad2)] if plan.backward else [])
    for name, g in fp8_gemms:
        if g.mma_split != 1 and (g.mma_split != 2 or g.elem_bytes != 1 or g.promote not in P.FP8_SPLIT_PROMOTES
                                 or g.bn % 2 or (name in ("gemm1", "backward.dgrad1") and g.bn != 2 * P.FP8_BN)):
            out.append(f"{name}.mma_split {g.mma_split}: 2 only for FP8 gemm1 (its two 128-column parts) / gemm2 / "
                       f"dgrad1 / dgrad2 tiles with serial or staggered promotion")
        if g.mma_split == 2 and g.promote == "stagger" and (why := P.stagger_problem(g)) is not None:
            out.append(f"{name}.promote stagger: {why}")
        if (why := P.stage_scales_problem(g)) is not None:
            out.append(f"{name}.stage_scale_bytes {g.stage_scale_bytes}: {why}")
        if g.h_quant not in sp_.values("h_quant", "gemm1") or (g.h_quant != "kernel" and name != "gemm1"):
            out.append(f"{name}.h_quant {g.h_quant!r}: GEMM 1's choice, one of "
                       f"{', '.join(sp_.values('h_quant', 'gemm1'))}")
        elif (why := P.h_quant_problem(g)) is not None:
            out.append(f"{name}.h_quant {g.h_quant}: {why}")
        if g.promote not in sp_.values("promote", "gemm1"):
            out.append(f"{name}.promote {g.promote!r} not in the space")
        elif g.promote != "serial" and g.elem_bytes != 1:
            out.append(f"{name}.promote {g.promote!r}: the promotion applies to FP8 GEMMs")
        elif g.promote == "stagger" and (why := P.stagger_problem(g)) is not None:
            out.append(f"{name}.promote stagger {why}")
    if plan.schedule == "fused":
        g1, g2 = plan.gemm1, plan.gemm2
        if g1.bn != g2.bn or spec.hidden % g2.bn or g1.a_load != "gather":
            out.append("fused: needs gemm1.bn == gemm2.bn dividing hidden and the gathered A path")
        if "pingpong" in (g1.consumer, g2.consumer) or 2 in (g1.cluster, g2.cluster):
            out.append("fused: cooperative tiles, cluster 1 only")
    return out


def _check_backward_plan(plan: Any) -> list[str]:
    """check_plan's part for the backward GEMMs (what templates/sm90/grouped_gemm.py.j2 and wgrad.py.j2 need)."""
    sp_ = S.space(plan.arch)
    a = P.get_arch(plan.arch)
    spec = plan.spec
    out: list[str] = []
    for name in P.BACKWARD_GEMMS:
        g = getattr(plan.backward, name)
        where = f"backward.{name}"
        m, n, k = P.backward_shape(spec, name)
        if g.bn not in sp_.values("bn", name):
            out.append(f"{where}.bn {g.bn} not in the space")
            continue
        if not sp_.min_stages <= g.stages <= sp_.max_stages:
            out.append(f"{where}.stages {g.stages} outside [{sp_.min_stages}, {sp_.max_stages}]")
        if g.smem_bytes() > (lim := P.smem_budget(a, g)):
            out.append(f"{where}: {g.stages} stages need {g.smem_bytes()} B of shared memory > {lim}"
                       + (f" ({g.ctas_per_sm} CTAs per SM)" if g.ctas_per_sm > 1 else ""))
        if (why := P.ctas_per_sm_problem(g, a)) is not None:
            out.append(f"{where}.ctas_per_sm: {why}")
        if P._acc_regs(g.bn) + P.REG_OVERHEAD > P._consumer_regs(a):
            out.append(f"{where}: accumulator registers {P._acc_regs(g.bn)} + {P.REG_OVERHEAD} exceed "
                       f"{P._consumer_regs(a)}")
        bk = 128 if g.elem_bytes == 1 else sp_.bk   # FP8 dgrads: one scale block per stage
        if g.bn % g.epi_n or g.bk != bk or g.a_load != "tma":
            out.append(f"{where}: bn {g.bn} / epi_n {g.epi_n} / bk {g.bk} / a_load {g.a_load!r} do not fit the template")
        if g.n_tiles != -(-n // g.bn) or g.k_tiles != (0 if k is None else g.k_tiles_for(k)):
            out.append(f"{where}: k_tiles/n_tiles do not match N {n}, K {k}")
        if k is not None:  # a dgrad: rows of the padded row space, tiles inside one routing tile
            if g.consumer not in sp_.values("consumer", name):
                out.append(f"{where}.consumer {g.consumer!r} not in the space")
            if g.bm != plan.bm or plan.bm % g.tile_m:
                out.append(f"{where}: {g.tile_m}-row tiles on {g.bm}-row groups, routing tile {plan.bm}")
        else:  # a wgrad: one 128-row cooperative output tile, RASTER output M tiles per panel
            if g.bm != sp_.bm or g.consumer != "cooperative":
                out.append(f"{where}: the wgrad template takes 128-row cooperative tiles, got {g.bm} {g.consumer}")
            if g.raster_group not in sp_.values("raster_group", name):
                out.append(f"{where}.raster_group {g.raster_group} not in the space")
    d1 = plan.backward.dgrad1
    if spec.ffn % d1.bn:
        out.append(f"backward.dgrad1.bn {d1.bn}: ffn {spec.ffn} % {d1.bn} != 0 (the dSwiGLU epilogue)")
    if d1.z_chunk not in sp_.values("z_chunk", "dgrad1") or (d1.bn // 4) % d1.z_chunk:
        out.append(f"backward.dgrad1.z_chunk {d1.z_chunk} not in the space or not dividing bn/4 = {d1.bn // 4}")
    for name in ("gemm1", "gemm2") + P.BACKWARD_GEMMS:
        g = getattr(plan, name, None) or getattr(plan.backward, name)
        if g.epi_store not in sp_.values("epi_store", "gemm2"):
            out.append(f"{name}.epi_store {g.epi_store!r} not in the space")
        elif g.epi_store == "ring" and (why := P.epi_ring_problem(g, 2 if name == "gemm1" else 1)[0]):
            out.append(f"{name}.epi_store ring: {why}")
    g1 = plan.gemm1
    if g1.z_store not in sp_.values("z_store", "gemm1"):
        out.append(f"gemm1.z_store {g1.z_store!r} not in the space")
    elif g1.z_store == "ring" and (why := P.z_ring_problem(g1)):
        out.append(f"gemm1.z_store ring: {why}")
    if d1.z_load not in sp_.values("z_load", "dgrad1"):
        out.append(f"backward.dgrad1.z_load {d1.z_load!r} not in the space")
    elif d1.z_load == "tma" and (why := P.z_stage_problem(d1)):
        out.append(f"backward.dgrad1.z_load tma: {why}")
    return out


def enumerate_configs(spec: Any, arch: str = "sm_90a", axes: tuple[str, ...] | None = None,
                      fixed: Mapping[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """Every override dict over ``axes`` (default: the arch's forward axes for the spec's dtype, what its form
    leaves free: :meth:`mokgen.space.ArchSpace.forward_axes`; each axis over its knob's ``search`` values; ``fixed``
    pins keys) that passes :func:`check_config`: what the solver ranks and tune compiles. Combinations a template
    cannot run are skipped here (the fused schedule takes only cooperative, cluster-1, gathered, equal-bn configs),
    so every config yielded solves (:func:`mokgen.plan.solve`) to a plan that passes :func:`check_plan` (tested)."""
    fixed = dict(fixed or {})
    if axes is None:
        axes = S.space(arch).forward_axes(getattr(spec, "dtype", "bf16"))
    free = [ax for ax in axes if ax not in fixed]
    for combo in itertools.product(*(S.axis_values(arch, ax) for ax in free)):
        cfg = {**dict(zip(free, combo)), **fixed}
        if cfg.get("schedule") == "fused":  # the fused kernel has none of these choices: one point, not a product
            if (cfg.get("gemm1_consumer", "cooperative"), cfg.get("gemm2_consumer", "cooperative"),
                    cfg.get("gemm1_a_load", "gather"), cfg.get("cluster", 1)) != ("cooperative", "cooperative",
                                                                                  "gather", 1):
                continue
        if not check_config(spec, arch, cfg):
            yield cfg


def enumerate_backward_configs(spec: Any, arch: str = "sm_90a", fixed: Mapping[str, Any] | None = None,
                               axes: tuple[str, ...] | None = None) -> Iterator[dict[str, Any]]:
    """The backward variants of the plan ``solve(spec, arch, **fixed)``: one override ``{axis: value}`` per
    axis (default: the arch's backward axes, :attr:`mokgen.space.ArchSpace.backward_axes`) and search value that passes :func:`check_config` together with ``fixed`` and changes the solved
    backward plan (a value equal to the derived one is the base itself; two keys giving the same plan are
    yielded once). Every variant solves to a plan that passes :func:`check_plan` (tested on every preset)."""
    fixed = dict(fixed or {})
    sp_ = S.space(arch)
    axes = sp_.backward_axes if axes is None else axes
    base = P.solve(spec, arch, **fixed).backward
    seen = {base}
    for axis in axes:
        if axis in fixed:   # fixed by the caller (a base plan's choice): not an axis around it
            continue
        kernel, _, key = axis.partition("_")
        for value in sp_.knob(key, kernel).search or ():
            cfg = {axis: value}
            if check_config(spec, arch, {**fixed, **cfg}):
                continue
            bwd = P.solve(spec, arch, **{**fixed, **cfg}).backward
            if bwd in seen:
                continue
            seen.add(bwd)
            yield cfg
