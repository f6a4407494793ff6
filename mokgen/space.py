"""The config space: per arch and per kernel, every plan choice (knob), its legal values, and the constraints
(shared memory, registers, divisibility, what each template supports) a combination must satisfy.

One table serves three readers, so there is no second list of choices:

* ``mokgen.plan`` takes its legal values from here (tile N, stages, consumer modes, A-load paths, clusters,
  L2 hints, schedules, raster range) and its override keys (:func:`override_keys`);
* ``mokgen plan --set KEY=VALUE`` / ``solve(**overrides)`` are validated against the same values;
* :func:`enumerate_configs` yields the override dicts the solver ranks and ``mokgen tune`` compiles and times,
  each checked by :func:`check_config` (before solving) and :func:`check_plan` (on the solved plan).

Light on purpose: no sympy, no torch; :func:`check_plan` and :func:`enumerate_configs` import ``mokgen.plan``
when called (the plan module imports this one for its values).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

__all__ = ["Knob", "ArchSpace", "SPACES", "space", "override_keys", "legal_values", "check_config", "check_plan",
           "enumerate_configs", "SEARCH_AXES"]


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

    def knob(self, key: str, kernel: str | None = None) -> Knob:
        for k in self.knobs:
            if k.key == key and (kernel is None or kernel in k.kernels):
                return k
        raise KeyError(f"{self.arch}: no knob {key!r}" + (f" for {kernel}" if kernel else ""))

    def values(self, key: str, kernel: str | None = None) -> tuple[Any, ...]:
        return self.knob(key, kernel).values


_FWD = ("gemm1", "gemm2")
_BWD = ("dgrad1", "dgrad2", "wgrad1", "wgrad2")  # the backward GEMMs (mokgen.plan.BACKWARD_GEMMS)
_WGRAD = ("wgrad1", "wgrad2")
_BN = (64, 128, 192, 256)
_MIN_STAGES, _MAX_STAGES = 3, 7
_RASTER_MAX = 64

SM90 = ArchSpace(
    arch="sm_90a",
    templates="templates/sm90",
    knobs=(
        Knob("bn", _FWD, _BN, search=_BN,
             doc="tile N (GEMM 1: bn/2 gate + bn/2 up columns); widest that fits is not always best (waves, N tail)"),
        Knob("stages", _FWD, tuple(range(_MIN_STAGES, _MAX_STAGES + 1)),
             doc="pipeline stages; derived: as many as fit the shared memory (capped)"),
        Knob("consumer", _FWD, ("cooperative", "pingpong"), shared=True, search=("cooperative", "pingpong"),
             doc="two warpgroups on one 128-row tile, or each on its own 64-row tile (epilogue overlap, 64-row padding)"),
        Knob("a_load", ("gemm1",), ("gather", "tma", "tma_rows"), search=("gather", "tma"),
             doc="GEMM 1's A rows: cp.async gather in the producer, gather kernel + TMA, or one TMA box per row "
                 "(tma_rows measured slower everywhere: not searched)"),
        Knob("raster_group", _FWD, tuple(range(1, _RASTER_MAX + 1)), shared=True, search=None,
             doc="M tiles per raster panel; derived: L2 fit, tall panels where one group's W exceeds L2/4"),
        Knob("cluster", _FWD, (1, 2), shared=True, search=(1, 2),
             doc="CTAs per cluster along M (2: W tile multicast to the pair)"),
        Knob("w_hint", _FWD, ("normal", "first", "last"), shared=True, search=None,
             doc="L2 eviction priority of the W-tile TMA loads"),
        Knob("a_hint", _FWD, ("normal", "first", "last"), shared=True, search=None,
             doc="L2 eviction priority of TMA-loaded A tiles"),
        Knob("schedule", ("plan",), ("chain", "fused"), search=("chain", "fused"),
             doc="four launches, or routing + one persistent kernel"),
        Knob("consumer", ("dgrad1", "dgrad2"), ("cooperative", "pingpong"), search=("cooperative", "pingpong"),
             doc="backward dgrad GEMMs' consumer mode (derived from the routing tile)"),
        Knob("z_chunk", ("dgrad1",), (4, 8, 16, 32), search=(8, 16, 32),
             doc="dgrad1's dSwiGLU epilogue: z pairs per thread whose loads are issued together (registers)"),
        Knob("bn", _BWD, _BN, search=_BN,
             doc="backward GEMMs' tile N; derived: the widest dividing N that fits (dgrad1: must divide ffn, and "
                 "its z chunk follows as min(16, bn/4))"),
        Knob("stages", _BWD, tuple(range(_MIN_STAGES, _MAX_STAGES + 1)), search=(4, 5, 6),
             doc="backward GEMMs' pipeline stages; derived: as many as fit the shared memory (capped)"),
        Knob("raster_group", _WGRAD, tuple(range(1, _RASTER_MAX + 1)), search=(2, 4, 16),
             doc="wgrad: output M tiles per raster panel (derived: 8)"),
        Knob("epi_n", ("plan",), (32, 64), search=None,
             doc="columns per epilogue slice of the forward GEMMs (smem staging before the TMA store); 64 and 32 "
                 "measured within 1%"),
        Knob("epi_stages", ("plan",), (2, 4), search=None,
             doc="epilogue smem buffers of the forward GEMMs (more: fewer pipeline stages fit)"),
        Knob("epi_n", _WGRAD, (32, 64), search=(32, 64),
             doc="wgrad: columns per epilogue slice (bf16 store through smem and TMA)"),
        Knob("epi_stages", _WGRAD, (2, 4), search=(2, 4),
             doc="wgrad: epilogue smem buffers; as many as the tile has slices, and the tile's store never waits "
                 "for an earlier TMA store to have read its buffer (more smem: fewer stages may fit)"),
    ),
    min_stages=_MIN_STAGES,
    max_stages=_MAX_STAGES,
)

# sm_100a: the plan solves it with the sm_90a tile rules until its tcgen05 templates exist (emit refuses it)
SPACES: dict[str, ArchSpace] = {"sm_90a": SM90, "sm_100a": ArchSpace(**{**SM90.__dict__, "arch": "sm_100a"})}


def space(arch: str) -> ArchSpace:
    try:
        return SPACES[arch]
    except KeyError:
        raise KeyError(f"no config space for arch {arch!r}; known: {', '.join(SPACES)}") from None


def override_keys(arch: str = "sm_90a") -> tuple[str, ...]:
    """Every legal ``KEY`` of ``mokgen plan --set KEY=VALUE`` on ``arch`` (the knobs' keys, in table order)."""
    return tuple(dict.fromkeys(k for knob in space(arch).knobs for k in knob.keys()))


def legal_values(key: str, arch: str = "sm_90a") -> tuple[Any, ...]:
    """The legal values of override ``key`` (union over the knobs it sets)."""
    out: list[Any] = []
    for knob in space(arch).knobs:
        if key in knob.keys():
            out += [v for v in knob.values if v not in out]
    if not out:
        raise KeyError(f"unknown override {key!r}; allowed: {', '.join(override_keys(arch))}")
    return tuple(out)


def _resolved(cfg: Mapping[str, Any], kernel: str, key: str, default: Any) -> Any:
    return cfg.get(f"{kernel}_{key}", cfg.get(key, default))


def check_config(spec: Any, arch: str, cfg: Mapping[str, Any]) -> list[str]:
    """Why the override dict ``cfg`` is illegal on ``spec``/``arch`` before any solving (empty: legal so far):
    unknown keys, values outside the table, tile N divisibility, registers and shared memory of the tile,
    what the fused template supports."""
    from . import plan as P

    sp_ = space(arch)
    a = P.get_arch(arch)
    out: list[str] = []
    keys = override_keys(arch)
    for key, value in cfg.items():
        if key not in keys:
            out.append(f"{key}: unknown override")
        elif value not in legal_values(key, arch):
            out.append(f"{key}: {value!r} not in the space")
    if out:
        return out
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
    if out or not any(backward_kernel(k) in _BWD for k in cfg):
        return out
    return _check_backward_config(spec, arch, cfg)


def _check_backward_config(spec: Any, arch: str, cfg: Mapping[str, Any]) -> list[str]:
    """The backward GEMMs' knobs of ``cfg``: tile N (dgrad1: dividing ffn, with a z chunk dividing bn / 4), the
    consumer mode against the routing tile, stages within what fits the tile's shared memory."""
    from . import plan as P

    a = P.get_arch(arch)
    out: list[str] = []
    # the routing tile (64 rows when both forward GEMMs ping-pong): the forward part of cfg, solved
    try:
        bm = P.solve(spec, arch, **{k: v for k, v in cfg.items() if backward_kernel(k) not in _BWD}).bm
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
    return out


def check_plan(plan: Any) -> list[str]:
    """The constraints on a solved :class:`mokgen.plan.Plan` (empty: it satisfies them all): every knob's value in
    the table, tile N divisibility, the stage ring + epilogue buffers + barriers within the CTA's shared memory
    (as the templates allocate it), accumulator registers, tiles dividing the routing tile, the fused template's
    requirements. Recomputed from the plan's fields, independently of how the solver chose them."""
    from . import plan as P

    sp_ = space(plan.arch)
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
        if k % g.bk or g.k_tiles != k // g.bk or g.n_tiles != -(-n // g.bn):
            out.append(f"{name}: k_tiles/n_tiles do not match N {n}, K {k}")
        tile_m = g.tile_m
        stage = (tile_m + g.bn) * g.bk * P.ELEM_BYTES
        epi = (2 if g.consumer == "pingpong" else 1) * tile_m * P.EPI_N * P.ELEM_BYTES * P.EPI_BUFFERS
        smem = g.stages * stage + epi + P.BARRIER_BYTES
        if smem > a.smem_per_cta:
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
    if plan.schedule == "fused":
        g1, g2 = plan.gemm1, plan.gemm2
        if g1.bn != g2.bn or spec.hidden % g2.bn or g1.a_load != "gather":
            out.append("fused: needs gemm1.bn == gemm2.bn dividing hidden and the gathered A path")
        if "pingpong" in (g1.consumer, g2.consumer) or 2 in (g1.cluster, g2.cluster):
            out.append("fused: cooperative tiles, cluster 1 only")
    return out


def _check_backward_plan(plan: Any) -> list[str]:
    """check_plan's part for the backward GEMMs (what templates/sm90/grouped_gemm.py.j2 and wgrad.py.j2 need)."""
    from . import plan as P

    sp_ = space(plan.arch)
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
        if g.smem_bytes() > a.smem_per_cta:
            out.append(f"{where}: {g.stages} stages need {g.smem_bytes()} B of shared memory > {a.smem_per_cta}")
        if P._acc_regs(g.bn) + P.REG_OVERHEAD > P._consumer_regs(a):
            out.append(f"{where}: accumulator registers {P._acc_regs(g.bn)} + {P.REG_OVERHEAD} exceed "
                       f"{P._consumer_regs(a)}")
        if g.bn % g.epi_n or g.bk != sp_.bk or g.a_load != "tma":
            out.append(f"{where}: bn {g.bn} / epi_n {g.epi_n} / bk {g.bk} / a_load {g.a_load!r} do not fit the template")
        if g.n_tiles != -(-n // g.bn) or g.k_tiles != ((k // g.bk) if k is not None else 0):
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
    return out


# The axes tune searches by default (the knobs with a `search` tuple), in the order the candidates vary.
SEARCH_AXES = ("schedule", "gemm1_bn", "gemm2_bn", "gemm1_consumer", "gemm2_consumer", "gemm1_a_load", "cluster")


def _axis_values(arch: str, axis: str) -> tuple[Any, ...]:
    sp_ = space(arch)
    if axis == "schedule":
        return sp_.knob("schedule").search or ()
    if axis == "cluster":
        return sp_.knob("cluster", "gemm1").search or ()
    kernel, _, key = axis.partition("_")
    return sp_.knob(key, kernel).search or ()


def enumerate_configs(spec: Any, arch: str = "sm_90a", axes: tuple[str, ...] = SEARCH_AXES,
                      fixed: Mapping[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """Every override dict over ``axes`` (each axis over its knob's ``search`` values; ``fixed`` pins keys) that
    passes :func:`check_config`: what the solver ranks and tune compiles. Combinations a template cannot run are
    skipped here (the fused schedule takes only cooperative, cluster-1, gathered, equal-bn configs), so every
    config yielded solves (:func:`mokgen.plan.solve`) to a plan that passes :func:`check_plan` (tested)."""
    fixed = dict(fixed or {})
    free = [ax for ax in axes if ax not in fixed]
    for combo in itertools.product(*(_axis_values(arch, ax) for ax in free)):
        cfg = {**dict(zip(free, combo)), **fixed}
        if cfg.get("schedule") == "fused":  # the fused kernel has none of these choices: one point, not a product
            if (cfg.get("gemm1_consumer", "cooperative"), cfg.get("gemm2_consumer", "cooperative"),
                    cfg.get("gemm1_a_load", "gather"), cfg.get("cluster", 1)) != ("cooperative", "cooperative",
                                                                                  "gather", 1):
                continue
        if not check_config(spec, arch, cfg):
            yield cfg


# The backward axes `mokgen tune --train` searches, one at a time around the plan it starts from (each backward
# GEMM is its own launch: a knob of one kernel changes that kernel's time only, so the per-kernel winners are
# composed afterwards and the composition is timed too).
BACKWARD_SEARCH_AXES = ("dgrad1_bn", "dgrad1_consumer", "dgrad1_z_chunk", "dgrad1_stages",
                        "dgrad2_bn", "dgrad2_consumer", "dgrad2_stages",
                        "wgrad1_bn", "wgrad1_stages", "wgrad1_raster_group", "wgrad1_epi_n", "wgrad1_epi_stages",
                        "wgrad2_bn", "wgrad2_stages", "wgrad2_raster_group", "wgrad2_epi_n", "wgrad2_epi_stages")


def backward_kernel(key: str) -> str:
    """The backward GEMM an override key belongs to (``"wgrad1_raster_group"`` -> ``"wgrad1"``)."""
    return key.partition("_")[0]


def enumerate_backward_configs(spec: Any, arch: str = "sm_90a", fixed: Mapping[str, Any] | None = None,
                               axes: tuple[str, ...] = BACKWARD_SEARCH_AXES) -> Iterator[dict[str, Any]]:
    """The backward variants of the plan ``solve(spec, arch, **fixed)``: one override ``{axis: value}`` per
    axis and search value that passes :func:`check_config` together with ``fixed`` and changes the solved
    backward plan (a value equal to the derived one is the base itself; two keys giving the same plan are
    yielded once). Every variant solves to a plan that passes :func:`check_plan` (tested on every preset)."""
    from . import plan as P

    fixed = dict(fixed or {})
    sp_ = space(arch)
    base = P.solve(spec, arch, **fixed).backward
    seen = {base}
    for axis in axes:
        kernel, _, key = axis.partition("_")
        for value in sp_.knob(key, kernel).search or ():
            cfg = {axis: value}
            if check_config(spec, arch, {**fixed, **cfg}):
                continue
            bwd = P.solve(spec, arch, **fixed, **cfg).backward
            if bwd in seen:
                continue
            seen.add(bwd)
            yield cfg
