"""The plan's sm_100a (Blackwell, tcgen05) rules: the form of its kernels, the MXFP8 GEMMs, the budget checks, and
their ``mokgen plan --explain`` lines.

:mod:`mokgen.plan` hands an sm_100a spec here (``ARCH_RULES``) and this module's functions are the hook: :func:`solve`
(the plan, from the shared solver handed in: :class:`~mokgen.plan_types.SharedSolver`), :func:`explain_gemm`,
:func:`explain_tile`, :func:`explain_clusters`, :func:`explain_backward_gemm` and :func:`explain_budgets` (the parts
of the explanation that differ from sm_90a's). It imports the plan's types (:mod:`mokgen.plan_types`) and the
sm_100a tile rules (:mod:`mokgen.sm100.rules`), never :mod:`mokgen.plan`.

Until sm_100a has a cost model of its own: the forward GEMMs are mokgen/sm100/emit.py's tcgen05 kernels, which read
GEMM 1's rows pre-gathered (a_load "tma"), run one CTA per 128-row UMMA tile (cooperative, cluster 1) in the chain
schedule; their tile N and default stages are solved here with the sm_90a rules and cost model (a bf16 1-CTA ring
costs the same bytes per stage on both archs). The backward's tiles (N, K step) come from the same rules; its
sm_90a-only knobs (dgrad1's z through the ring, the ring epilogue) are settled off, and its knobs are not
overridable yet (issue 20) but for the dgrads' 2-CTA form (``dgrad*_cluster``, below). The overrides are checked
against sm_100a's config space first (mokgen/sm100/space.py: the knobs its kernels take): a key of sm_90a's kernels
is a one-line PlanError naming sm_100a, never accepted and ignored. Every kernel's tile is then checked against the sm_100a budgets, the 512 TMEM columns
and the CTA's shared memory, by mokgen/sm100/rules.py (check_budgets; sm100/emit.py renders those tiles and asserts
the same rules): an override that breaks one is a PlanError here, the forward GEMMs' ``gemm*_stages`` bounded by the
sm_100a ring (the 2-CTA form's CTA holds half of each W box, so more stages fit). Opt-in, BF16: cluster 2
(``cluster`` for both forward GEMMs, ``gemm1_cluster`` / ``gemm2_cluster`` for one) plans the 2-CTA form, a CTA pair
(cluster of 2 along M) computing a 256-row tile with tcgen05.mma cta_group::2; a pair's rows must belong to one
group, so the routing tile (plan.bm) becomes TCGEN05_PAIR_BM and every kernel of the entry (routing, gather,
combine, the backward's GEMMs and weight gradients) follows it. The dgrads take the same form on their own opt-in
(``dgrad1_cluster`` / ``dgrad2_cluster`` = 2, BF16; the other backward knobs stay the defaults): a CTA pair on a
256-row tile with W read N-major, each CTA's epilogue (dgrad1's dSwiGLU and router-gradient partials) on its own
128 rows; it too sets 256-row routing tiles. A forward ``cluster=2`` does not pair the dgrads: each pair form is
its own opt-in (none has run on a GPU, so none is implied by another). The default stays 1-CTA: nothing of the
2-CTA form has run on a GPU.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from ..arch import Arch
from ..plan_types import (BACKWARD_GEMMS, MAX_STAGES, MIN_STAGES, WGRAD_DTYPE_KEYS, GemmPlan, Plan, PlanError,
                          SharedSolver, _gemm_override, _gemm_shape, _GemmCost, _int_override, _m_tiles, _pct,
                          _settle_streams, get_arch)
from ..space import legal_values, override_keys
from ..spec import Spec
from . import rules

ARCH = rules.ARCH

TCGEN05_CLUSTERS = (1, 2)   # 1: 1-CTA tiles (cta_group 1); 2: the 2-CTA form (cta_group 2)
TCGEN05_PAIR_BM = 256       # the 2-CTA form's routing tile: one pair tile (2 x 128 rows)


def _pair_choice(spec: Spec, arch: str, key: str, value: Any, who: str, one_cta: str) -> int:
    """An override's cluster on a tcgen05 arch: 1 (1-CTA tiles) or 2 (the 2-CTA form; BF16 only so far), else a
    one-line PlanError (`who` runs it, `one_cta` is what another dtype runs instead)."""
    if isinstance(value, bool) or value not in TCGEN05_CLUSTERS:
        raise PlanError(f"plan.{key}: the {arch} {who} run cluster 1 (1-CTA tiles) or 2 (a CTA pair on a "
                        f"{TCGEN05_PAIR_BM}-row tile, tcgen05 cta_group 2), got {value!r}")
    if value == 2 and spec.dtype != "bf16":
        raise PlanError(f"plan.{key}: the {arch} 2-CTA form (cluster 2) is BF16 only so far; dtype "
                        f"{spec.dtype} runs {one_cta}")
    return value


def _clusters(spec: Spec, arch: str, overrides: Mapping[str, Any]) -> dict[int, int]:
    """The forward GEMMs' cluster on a tcgen05 arch ({1: c1, 2: c2}): 1 unless overridden (:func:`_pair_choice`)."""
    out = {}
    for which in (1, 2):
        found = _gemm_override(overrides, which, "cluster")
        out[which] = 1 if found is None else _pair_choice(spec, arch, *found, "GEMMs", "1-CTA tiles")
    return out


DGRAD_CLUSTER_KEYS = ("dgrad1_cluster", "dgrad2_cluster")
# the overrides whose values the rules below check with a message of their own (the 2-CTA form, the MXFP8 weight
# gradients)
_OWN_MESSAGE = ("cluster", "gemm1_cluster", "gemm2_cluster", *DGRAD_CLUSTER_KEYS, *WGRAD_DTYPE_KEYS)


def _check_space(arch: str, key: str, value: Any) -> None:
    """Override `key` = `value` against the arch's config space (mokgen.sm100.space: the knobs its kernels take),
    else a one-line PlanError: a key of sm_90a's kernels (or none) naming the keys `arch` takes, a value outside the
    knob's naming its legal ones."""
    keys = override_keys(arch)
    if key not in keys:
        if key.startswith(("dgrad", "wgrad")):
            why = f"the {arch} backward GEMMs take the default tiles only so far (but dgrad*_cluster)"
        elif key in override_keys("sm_90a"):
            why = f"an sm_90a kernel option; the {arch} GEMMs do not take it"
        else:
            why = "unknown override"
        raise PlanError(f"plan.{key}: {why}; allowed on {arch}: {', '.join(keys)}")
    legal = legal_values(key, arch)
    if len(legal) == 1 and value != legal[0]:   # the one form its kernels run (schedule, consumers, GEMM 1's A)
        raise PlanError(f"plan.{key}: the {arch} kernels run {key} {legal[0]!r} only so far, got {value!r}")
    if key in _OWN_MESSAGE or (value in legal and not isinstance(value, bool)):
        return
    ints = all(isinstance(v, int) for v in legal) and list(legal) == list(range(legal[0], legal[-1] + 1))
    raise PlanError(f"plan.{key}: must be " + (f"in [{legal[0]}, {legal[-1]}]" if ints and len(legal) > 2 else
                                              f"one of {', '.join(map(str, legal))}") + f" on {arch}, got {value!r}")


def _dgrad_clusters(spec: Spec, arch: str, overrides: Mapping[str, Any]) -> dict[str, int]:
    """The dgrads' cluster on a tcgen05 arch ({"dgrad1": c, "dgrad2": c}): 1 unless ``dgrad1_cluster`` /
    ``dgrad2_cluster`` asks for 2 (:func:`_pair_choice`; BF16 training plans only so far). Opt-in per dgrad: a
    forward ``cluster=2`` leaves the dgrads 1-CTA (they are separate kernels with their own W reads; nothing of
    either pair form has run on a GPU, so neither is implied by the other)."""
    out = {}
    for key in DGRAD_CLUSTER_KEYS:
        name = key.removesuffix("_cluster")
        out[name] = _pair_choice(spec, arch, key, overrides.get(key, 1), "dgrads", f"{name} in 1-CTA tiles")
    return out


def solve(spec: Spec, arch: str, overrides: Mapping[str, Any], shared: SharedSolver) -> Plan:
    """The plan of an arch whose GEMMs are mokgen/sm100/emit.py's tcgen05 kernels (arch.py: has_tcgen05; sm_100a):
    the forward in their form and the backward with the default tiles; ``wgrad*_dtype`` (mxfp8 specs): a weight
    gradient in MXFP8 (:func:`_mx_wgrads`). The tile N and stages start from `shared`'s solve (the sm_90a rules and
    cost model) in the chain schedule with cooperative tiles; `shared`'s replan rebuilds the plan on the 2-CTA form's
    routing tiles."""
    wgrad_dtypes = {k: overrides[k] for k in WGRAD_DTYPE_KEYS if k in overrides}
    overrides = {k: v for k, v in overrides.items() if k not in wgrad_dtypes}
    for key, value in {**overrides, **wgrad_dtypes}.items():   # the knobs its kernels take (mokgen.sm100.space)
        _check_space(arch, key, value)
    if spec.dtype not in ("bf16", "mxfp8"):
        raise PlanError(f"plan.arch: dtype {spec.dtype} is not planned for {arch} yet (blockwise e4m3 is Hopper's "
                        f"recipe, sm_90a); on {arch} the FP8 format is dtype mxfp8 (e8m0 scales per 32 elements)")
    clusters = _clusters(spec, arch, overrides)
    dclusters = _dgrad_clusters(spec, arch, overrides)
    # the forward GEMMs' stages: checked against the sm_100a budgets below (check_budgets), not the sm_90a rules
    stage_overrides = {k: overrides[k] for k in ("gemm1_stages", "gemm2_stages") if k in overrides}
    if spec.dtype == "mxfp8":
        for key in overrides:
            if key.split("_")[-1] in ("bn", "bk", "stages") or key.endswith(("epi_n", "epi_stages")):
                raise PlanError(f"plan.{key}: the {arch} MXFP8 GEMMs take their fixed tiles so far (GEMM 1 128 x "
                                f"{MX_BN[1]}, GEMM 2 128 x {MX_BN[2]}, K tile {MX_BK}, as many stages as fit)")
    rest = {k: v for k, v in overrides.items()
            if k not in ("schedule", "consumer", "bwd_streams", "cluster", "gemm1_cluster", "gemm2_cluster")
            and k not in DGRAD_CLUSTER_KEYS and k not in stage_overrides}
    plan = shared.solve(spec, arch, schedule="chain", consumer="cooperative", **rest)
    g1 = dataclasses.replace(plan.gemm1, a_load="tma", cluster=1)
    g2 = dataclasses.replace(plan.gemm2, cluster=1)
    for key, value in stage_overrides.items():
        stages = _int_override(key, value)
        if not MIN_STAGES <= stages <= MAX_STAGES:
            raise PlanError(f"plan.{key}: must be in [{MIN_STAGES}, {MAX_STAGES}], got {stages}")
        if key == "gemm1_stages":
            g1 = dataclasses.replace(g1, stages=stages)
        else:
            g2 = dataclasses.replace(g2, stages=stages)
    pair_notes: tuple[str, ...] = ()
    if 2 in clusters.values() or 2 in dclusters.values():   # the 2-CTA form: the plan rebuilt on 256-row routing
        g1 = dataclasses.replace(g1, bm=TCGEN05_PAIR_BM, cluster=clusters[1])   # tiles
        g2 = dataclasses.replace(g2, bm=TCGEN05_PAIR_BM, cluster=clusters[2])
        plan = shared.replan(plan, g1, g2)
        paired = [f"GEMM {w}" for w in (1, 2) if clusters[w] == 2] + [n for n, c in dclusters.items() if c == 2]
        pair_notes = (f"overrides: {', '.join(f'{k}={overrides[k]}' for k in sorted(overrides) if k.endswith('cluster'))}"
                      f": {' and '.join(paired)} in the 2-CTA form (a CTA pair on a {TCGEN05_PAIR_BM}-row tile, "
                      f"tcgen05.mma cta_group 2), routing tiles of {TCGEN05_PAIR_BM} rows; never run on a GPU",)
    backward = plan.backward
    for key in DGRAD_CLUSTER_KEYS:
        if backward is None and dclusters[key.removesuffix("_cluster")] == 2:
            raise PlanError(f"plan.{key}: this plan has no backward kernels")
    if backward is not None:   # the tcgen05 dgrads read z and write dz from registers and store through smem
        backward = dataclasses.replace(backward, **{
            n: dataclasses.replace(getattr(backward, n), consumer="cooperative", cluster=dclusters.get(n, 1),
                                   z_load="direct", epi_store="smem")
            for n in BACKWARD_GEMMS})
    notes = tuple(n for n in plan.notes if not n.startswith("overrides: consumer=cooperative")
                  and not n.startswith("overrides: schedule=chain"))
    notes += (f"{arch}: the tcgen05 GEMMs (GEMM 1 on gathered rows, the backward's dgrads with W read N-major and "
              f"varlen-K weight gradients), chain schedule; compiled here, never run on a Blackwell GPU (issue 20)",)
    notes += pair_notes
    plan = dataclasses.replace(plan, gemm1=g1, gemm2=g2, backward=backward, notes=notes)
    if spec.dtype == "mxfp8":
        plan = _mxfp8_form(plan)
    plan = _mx_wgrads(plan, wgrad_dtypes)
    plan = _settle_streams(plan, overrides.get("bwd_streams"))
    check_budgets(plan, overrides)
    return plan


# The overrides that shape each sm_100a kernel's tile (mokgen.sm100.rules.kernel_tiles), by the field a rule
# checks: a broken budget is reported against the first of them that was given. The dgrads run GEMM 2's K step and
# epilogue; the backward's own tiles are not overridable on sm_100a yet.
_TCGEN05_KNOBS = {
    "stages": ("{k}_stages", "epi_stages", "epi_n", "{k}_bn", "{k}_cluster", "cluster"),
    "bn": ("{k}_bn", "{k}_cluster", "cluster"),
    "bk": ("{k}_bn",),
    "cluster": ("{k}_cluster", "cluster"),
}
_TCGEN05_TITLES = {"gemm1": "GEMM 1", "gemm2": "GEMM 2", "dgrad1": "dgrad1", "dgrad2": "dgrad2", "wgrad1": "wgrad1",
                   "wgrad2": "wgrad2"}


def check_budgets(plan: Plan, overrides: Mapping[str, Any]) -> None:
    """Every GEMM kernel of an sm_100a plan (forward, dgrads, weight gradients; BF16 or MXFP8) within its tile rules
    and budgets (mokgen.sm100.rules: the 512 TMEM columns per SM, the CTA's shared memory), else a one-line
    PlanError naming the override that broke it (or the plan's GEMM where none did) and the budget."""
    limit = get_arch(plan.arch).smem_per_cta
    for name, tile in rules.kernel_tiles(plan).items():
        problems = tile.problems(limit)
        if not problems:
            continue
        field, why = problems[0]
        keys = [k.format(k=name) for k in _TCGEN05_KNOBS.get(field, ())]
        if name.startswith("dgrad"):   # GEMM 2's K step and epilogue
            keys = [k for k in keys if k in ("epi_stages", "epi_n", f"{name}_cluster")]
        key = next((k for k in keys if k in overrides), None)
        where = key or (name if name.startswith("gemm") else f"backward.{name}")
        raise PlanError(f"plan.{where}: {_TCGEN05_TITLES[name]} on {plan.arch}: {why}")


# MXFP8 on tcgen05 (dtype mxfp8, sm_100a): e4m3 operands, one e8m0 scale per 32 K elements, the block-scaled MMA
# (kind::mxf8f6f4.block_scale) reading the scales from tensor memory. K tile 128 (one scale-factor atom column:
# 4 scales per row, mokgen.fp8.pack_mx_scales); tile N per part 128 (one 128-row SF atom of W per K step; GEMM 1:
# gate and up, bn 256 in the plan's count). Training: the dgrads in the same form (tile N 128, K tile 128, their
# W copies read MN-major with scales along K), the weight gradients BF16 from the bf16 tensors (the sm_100a wgrads).
MX_BK = 128
# hidden / ffn not a multiple of MX_BK (gpt-oss-120b's 2880; the spec takes multiples of 64, whole 32-element scale
# blocks): each GEMM whose K or N it is has a partial last tile
MX_PARTIAL = ("the last K / N tile partial: the e4m3 data past the end read as zeros (TMA out of bounds), the scale "
              "tensors padded to whole 128-row x 4-block atoms (their extra codes written as 127 by the quantizers), "
              "the columns past N not stored")
MX_BN = {1: 256, 2: 128}   # plan.gemm*.bn (GEMM 1 counts gate + up)
MX_SF_STAGE = 512          # bytes of one 128-row x 4-scale SF atom (one K step of 128 rows)
MX_MAX_STAGES = 16


def tcgen05_mx_smem(parts: int, bn: int, bk: int, stages: int, epi_n: int, epi_stages: int) -> int:
    """Shared memory of an sm_100a MXFP8 grouped GEMM (mokgen.sm100.rules, which mokgen.sm100.emit checks too): per
    stage the A box (128 x bk e4m3), `parts` W boxes (bn x bk), their scale atoms (A: 128 rows, W: bn rows rounded up to
    128, bk / 32 scales each); the bf16 epilogue buffers; barriers; 1024 bytes of alignment per buffer."""
    return rules.mx_smem(parts, bn, bk, stages, epi_n, epi_stages)


def _mx_gemm(a: Arch, g: GemmPlan, parts: int, bn: int, n_out: int, k_dim: int) -> GemmPlan:
    """GEMM plan `g` in the MXFP8 form: e4m3 (elem_bytes 1), tile N `bn` (counting every part), K tile MX_BK, as
    many stages as fit the shared memory with their scale atoms (mokgen.sm100.rules), at most MX_MAX_STAGES. Where
    `k_dim` (or `n_out`) is not a multiple of 128 the last K (N) tile is partial (:data:`MX_PARTIAL`)."""
    tile = rules.Tile(parts, bn // parts, MX_BK, 0, g.epi_n, g.epi_stages, mx=True)
    return dataclasses.replace(g, bn=bn, bk=MX_BK, elem_bytes=1,
                               stages=tile.stages_fit(a.smem_per_cta, most=MX_MAX_STAGES),
                               n_tiles=-(-n_out // (bn // parts)), k_tiles=-(-k_dim // MX_BK))


def _mxfp8_form(plan: Plan) -> Plan:
    """The MXFP8 form of an sm_100a plan: GEMM 1 / GEMM 2 with e4m3 operands (elem_bytes 1), K tile MX_BK, tile N
    MX_BN, as many stages as fit the shared memory (tcgen05_mx_smem); the backward's dgrads in the same form (tile
    N 128: one scale atom of W; dgrad1 (N = I, K = H), dgrad2 (N = H, K = 2I)), its weight gradients BF16 with the
    sm_100a tiles (they read the bf16 tensors, as the Hopper FP8 path's do)."""
    a = get_arch(plan.arch)
    H, I = plan.spec.hidden, plan.spec.ffn
    gemms = {f"gemm{w}": _mx_gemm(a, getattr(plan, f"gemm{w}"), 2 if w == 1 else 1, MX_BN[w],
                                  I if w == 1 else H, H if w == 1 else I) for w in (1, 2)}
    backward = plan.backward
    if backward is not None:
        backward = dataclasses.replace(backward, dgrad1=_mx_gemm(a, backward.dgrad1, 1, MX_BN[2], I, H),
                                       dgrad2=_mx_gemm(a, backward.dgrad2, 1, MX_BN[2], H, 2 * I))
    note = (f"mxfp8: e4m3 GEMMs with e8m0 scales per 32 along K on the block-scaled tcgen05 MMA, K tile {MX_BK}, "
            f"tile N {MX_BN[1] // 2} per part (GEMM 1) / {MX_BN[2]} (GEMM 2, dgrad1, dgrad2: W read MN-major by the "
            f"dgrads); the weight gradients BF16 from the bf16 tensors")
    notes = (note,)
    odd = [f"{n} {v} = {v // MX_BK} x {MX_BK} + {v % MX_BK}" for n, v in (("hidden", H), ("ffn", I)) if v % MX_BK]
    if odd:
        notes += (f"mxfp8: {', '.join(odd)}: {MX_PARTIAL}",)
    return dataclasses.replace(plan, backward=backward, notes=plan.notes + notes, **gemms)


# MXFP8 weight gradients on tcgen05 (plan ``wgrad1_dtype`` / ``wgrad2_dtype`` = "mxfp8", dtype mxfp8 specs; opt-in:
# nothing of it has run on a GPU, so the default stays the BF16 weight gradients, as Hopper's FP8 weight gradients
# were opt-in until measured, bench/NOTES.md v16-v17): both operands e4m3 with one e8m0 code per 32 rows of a column
# (the wgrad's K), 128 x 128 tiles (one SF atom of A's and of B's columns per K step), K step 128 rows (4 scales: a
# whole atom; the routing tile is a multiple of it, so no 32-row block straddles two groups).
TCGEN05_WGRAD_DTYPES = ("bf16", "mxfp8")
MX_WGRAD_BN = 128


def _mx_wgrads(plan: Plan, wgrad_dtypes: Mapping[str, Any]) -> Plan:
    """The ``wgrad*_dtype`` overrides of an sm_100a plan: "bf16" (the default) or "mxfp8" (dtype mxfp8 specs with
    a backward), each refused in one line otherwise."""
    a = get_arch(plan.arch)
    spec = plan.spec
    for key in WGRAD_DTYPE_KEYS:
        if key not in wgrad_dtypes:
            continue
        value = wgrad_dtypes[key]
        name = key.removesuffix("_dtype")
        if value not in TCGEN05_WGRAD_DTYPES:
            hint = " (blockwise FP8 weight gradients are sm_90a's, dtype fp8)" if value == "fp8" else ""
            raise PlanError(f"plan.{key}: the {plan.arch} weight gradients are one of "
                            f"{', '.join(TCGEN05_WGRAD_DTYPES)}, got {value!r}{hint}")
        if value == "bf16":
            continue
        if spec.dtype != "mxfp8":
            raise PlanError(f"plan.{key}: MXFP8 weight gradients are a choice of dtype mxfp8 specs, this one is "
                            f"{spec.dtype}")
        if plan.backward is None:
            raise PlanError(f"plan.{key}: this plan has no backward kernels")
        if plan.bm % MX_BK:
            raise PlanError(f"plan.{key}: MXFP8 weight gradients step K by {MX_BK} rows inside a routing tile, got "
                            f"routing tiles of {plan.bm} rows")
        odd = [f"{n} {v}" for n, v in (("hidden", spec.hidden), ("ffn", spec.ffn)) if v % MX_BK]
        if odd:
            raise PlanError(f"plan.{key}: MXFP8 weight gradients need hidden and ffn multiples of {MX_BK} (their "
                            f"column quantizers and tiles cover whole 128-column scale atoms; not built for partial "
                            f"ones yet), got {', '.join(odd)}; the default BF16 weight gradients take it")
        g = getattr(plan.backward, name)
        m_out, n_out = (2 * spec.ffn, spec.hidden) if name == "wgrad1" else (spec.hidden, spec.ffn)
        tile = rules.Tile(1, MX_WGRAD_BN, MX_BK, 0, *rules.WGRAD_EPI, mx=True)
        w = dataclasses.replace(g, bn=MX_WGRAD_BN, bk=MX_BK, elem_bytes=1,
                                stages=tile.stages_fit(a.smem_per_cta, most=MX_MAX_STAGES),
                                n_tiles=-(-n_out // MX_WGRAD_BN))
        note = (f"overrides: {key}=mxfp8: {name} (M = {m_out}, N = {n_out}) on the block-scaled tcgen05 MMA, e4m3 "
                f"operands with e8m0 scales per 32 rows (the reduction), 128 x {MX_WGRAD_BN} tiles, K step {MX_BK} "
                f"rows; never run on a GPU")
        plan = dataclasses.replace(plan, backward=dataclasses.replace(plan.backward, **{name: w}),
                                   notes=plan.notes + (note,))
    return plan


def _explain_mx_gemm(spec: Spec, arch: Arch, which: int, g: GemmPlan, c: _GemmCost) -> list[str]:
    """The MXFP8 (sm_100a) GEMMs' explain lines: what _mxfp8_form fixed, the stage ring with its scale atoms."""
    n, k = _gemm_shape(spec, which)
    title = ("GEMM1  h = SwiGLU(x[rows] . w1ᵀ)", "GEMM2  ys = row_w * (h . w2ᵀ)")[which - 1]
    parts = 2 if which == 1 else 1
    used = tcgen05_mx_smem(parts, g.bn // parts, g.bk, g.stages, g.epi_n, g.epi_stages)
    waves = c.tiles / arch.sms
    return [
        f"{title}: N = {n}, K = {k}, MXFP8 (e4m3, one e8m0 scale per 32 along K, block-scaled tcgen05 MMA)",
        "  A: " + ("x's rows gathered and quantized by quant_mx_gather" if which == 1 else
                   "h's used rows quantized by quant_mx_used") + ", read by TMA tiles; their scales by TMA in "
        "512-byte atoms, tcgen05.cp into tensor memory",
        f"  bn = {g.bn}" + (f" ({g.bn // 2} gate + {g.bn // 2} up columns)" if which == 1 else "")
        + f", bk = {g.bk} (fixed: one scale atom of 4 x 32 K elements per stage)",
        f"  smem: {g.stages} stages (the most that fit) = {used} of {arch.smem_per_cta} B with the epilogue "
        f"{g.tile_m}x{g.epi_n} x{g.epi_stages} buffers",
        f"  raster_group = {g.raster_group}; tiles = {_m_tiles(spec, g.bm)} M x {g.n_tiles} N = {c.tiles}; waves = "
        f"{waves:.2f} -> {math.ceil(waves)} (wave efficiency {_pct(c.wave_eff)})",
        "  cost below: the BF16 model's (nothing measured: no Blackwell GPU here)",
    ]


def _explain_bf16_gemm(spec: Spec, arch: Arch, which: int, g: GemmPlan, c: _GemmCost) -> list[str]:
    """The BF16 tcgen05 (sm_100a) GEMMs' explain lines: the kernels' form (templates/sm100/grouped_gemm.py.j2),
    not the sm_90a warpgroup rules; their TMEM and smem figures are the budgets section's (mokgen.sm100.rules)."""
    n, k = _gemm_shape(spec, which)
    title = ("GEMM1  h = SwiGLU(x[rows] . w1ᵀ)", "GEMM2  ys = row_w * (h . w2ᵀ)")[which - 1]
    pair = g.cluster == 2
    waves = c.tiles / arch.sms
    m_ctas = _m_tiles(spec, g.bm) * (g.bm // g.tile_m)
    return [
        f"{title}: N = {n}, K = {k}, BF16 tcgen05.mma "
        + (f"cta_group::2 (a CTA pair, cluster 2 along M, on {g.bm}-row tiles; each CTA loads half of every W box)"
           if pair else f"cta_group::1 (one CTA per {g.tile_m}-row tile)"),
        "  A: " + ("the rows gathered by the gather kernel, read by TMA tiles" if which == 1 else
                   "h's rows, read by TMA tiles"),
        f"  bn = {g.bn}" + (f": {g.bn // 2} gate + {g.bn // 2} up columns, two accumulators per tile" if which == 1
                            else f": hidden {n} % {g.bn} = {n % g.bn}") + f", bk = {g.bk}",
        "  accumulators in tensor memory, double-buffered (the epilogue warpgroup drains tile i while the MMA warp "
        "runs tile i + 1); warps: 4 epilogue, 1 MMA, 1 TMA; tiles handed out by Cluster Launch Control",
        f"  raster_group = {g.raster_group}; CTA tiles = {m_ctas} M" + (f" ({m_ctas // 2} pairs)" if pair else "")
        + f" x {g.n_tiles} N = {c.tiles}; waves = {c.tiles} / {arch.sms} = {waves:.2f} -> {math.ceil(waves)} "
        f"(wave efficiency {_pct(c.wave_eff)})",
        "  stages, TMEM and shared memory: the budgets section below; cost below: the sm_90a model's (nothing "
        "measured on sm_100a)",
    ]


def explain_budgets(plan: Plan) -> list[str]:
    """An sm_100a plan's budgets, a line per GEMM kernel: the tile it is rendered with (mokgen.sm100.rules.
    kernel_tiles), its TMEM columns used of 512 and its shared memory used of the CTA's budget."""
    limit = get_arch(plan.arch).smem_per_cta
    tiles = rules.kernel_tiles(plan)
    also = {"gemm1": " + gemm1_train" if plan.backward is not None else "", "wgrad1": " + _acc", "wgrad2": " + _acc"}
    lines = [f"{plan.arch} budgets (mokgen.sm100.rules, the tiles the kernels are rendered with): TMEM "
             f"{rules.TMEM_COLUMNS} columns per SM, shared memory {limit} B per CTA"]
    for name, t in tiles.items():
        rows = f"{rules.PAIR_M} (2-CTA: {rules.UMMA_M} per CTA)" if t.pair else f"{rules.UMMA_M}"
        cols = f"{t.parts} x {t.bn}" if t.parts > 1 else f"{t.bn}"
        lines.append(f"  {name + also.get(name, ''):<20} {rows} x {cols}, bk {t.bk}, {t.stages} stages, epilogue "
                     f"{t.epi_n}x{t.epi_stages}{', MXFP8' if t.mx else ''}: {t.budget_text(limit)}")
    return lines


def explain_gemm(spec: Spec, arch: Arch, which: int, g: GemmPlan, c: _GemmCost) -> list[str]:
    """Forward GEMM `which`'s explain lines: the MXFP8 form (dtype mxfp8) or the BF16 tcgen05 one."""
    if spec.dtype == "mxfp8":
        return _explain_mx_gemm(spec, arch, which, g, c)
    return _explain_bf16_gemm(spec, arch, which, g, c)


def explain_tile(g: GemmPlan) -> str:
    """How a GEMM's CTAs cover its tile (the explain header): the tcgen05 CTA, or the CTA pair of the 2-CTA form."""
    return (f"{g.bm if g.cluster == 2 else g.tile_m} rows ("
            + ("a CTA pair, tcgen05 cta_group::2: 128 rows each" if g.cluster == 2 else "one CTA, tcgen05 cta_group::1")
            + ")")


def explain_clusters(plan: Plan) -> str:
    """The schedule line's clusters: which forward GEMMs (and, in a training plan, which dgrads) run in the 2-CTA
    form."""
    line = (f"; CTA pairs (cta_group::2): GEMM 1 {'yes' if plan.gemm1.cluster == 2 else 'no'}, GEMM 2 "
            f"{'yes' if plan.gemm2.cluster == 2 else 'no'}")
    bw = plan.backward
    if bw is not None and 2 in (bw.dgrad1.cluster, bw.dgrad2.cluster):   # the default plans' line unchanged
        line += (f", dgrad1 {'yes' if bw.dgrad1.cluster == 2 else 'no'}, dgrad2 "
                 f"{'yes' if bw.dgrad2.cluster == 2 else 'no'}")
    return line


def explain_backward_gemm(spec: Spec, name: str, g: GemmPlan) -> tuple[str, str]:
    """(its operands' form, its tile line) of backward GEMM `name`: the tcgen05 kernels keep their stages, TMEM and
    shared memory for the budgets section."""
    if g.elem_bytes == 1 and spec.dtype == "mxfp8":   # the block-scaled tcgen05 MMA
        form = ("MXFP8 e4m3, e8m0 scales per 32 rows of each column (quant_mx_cols_*), both operands MN-major, "
                "block-scaled tcgen05 MMA (wgrad*_dtype=mxfp8)" if name.startswith("wgrad") else
                "MXFP8 e4m3, e8m0 scales per 32 along K, block-scaled tcgen05 MMA (W's column copy MN-major)")
    elif name.startswith("dgrad") and g.cluster == 2:
        form = (f"BF16, a CTA pair (dgrad{name[-1]}_cluster=2: cluster 2 along M, tcgen05.mma cta_group::2 on "
                f"{TCGEN05_PAIR_BM}-row tiles, each CTA loads half of every W box (W read N-major: half the tile's "
                f"N columns) and runs the epilogue of its own 128 rows; compiled, never run on a GPU)")
    else:
        form = "BF16"
    rows = f"{TCGEN05_PAIR_BM} (2 x {g.tile_m})" if name.startswith("dgrad") and g.cluster == 2 else f"{g.tile_m}"
    return form, (f"    tile {rows} x {g.bn}, K step {g.bk}, raster {g.raster_group}, accumulators in tensor "
                  f"memory (stages, TMEM and smem: the budgets below)")
