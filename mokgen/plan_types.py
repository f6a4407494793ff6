"""The plan's types and the vocabulary every arch's plan rules share: :class:`Plan`, :class:`GemmPlan`,
:class:`BackwardPlan`, :class:`PlanError`, the tile constants their fields default to, and the small helpers the
shared solver (:mod:`mokgen.plan`) and an arch's own rules (e.g. :mod:`mokgen.sm100.plan`) both use: GEMM shapes,
expected M tiles, override parsing, the backward's streams.

Below both on purpose: :mod:`mokgen.plan` hands a plan to an arch's rules and they return one, so neither imports
the other's module to know what a plan is. Light: no sympy (the runtime rebuilds a plan from a cache entry's
``meta.json`` with :meth:`Plan.from_dict`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple

from .arch import ARCHS, Arch
from .space import SM90 as _SPACE
from .spec import Spec

__all__ = ["Arch", "ARCHS", "get_arch", "GemmPlan", "BackwardPlan", "Plan", "PlanError", "SharedSolver"]


class PlanError(ValueError):
    """No valid plan (or an invalid override); the message is one line starting with the field path."""


def get_arch(name: str) -> Arch:
    try:
        return ARCHS[name]
    except (KeyError, TypeError):
        raise PlanError(f"plan.arch: unknown arch {name!r}; known archs: {', '.join(ARCHS)}") from None


# ---- the tile constants a GemmPlan defaults to (sm_90a, bf16) ---------------------------------------------
BM = 128  # M tile: 2 consumer warpgroups x 64 rows (cooperative)
CONSUMER_WGS = 2
MIN_STAGES, MAX_STAGES = _SPACE.min_stages, _SPACE.max_stages
EPI_M, EPI_N, EPI_BUFFERS = BM, 32, 2  # epilogue sub-tile (both warpgroups' rows) staged through smem, double-buffered
BARRIER_BYTES = 1024
ELEM_BYTES = 2  # bf16
PRODUCER_REGS = 40  # setmaxnreg of the producer warpgroup
# Register split (setmaxnreg; 128 * producer + 256 * consumer <= 65536) by how the producer loads A: the
# cp.async row gather keeps 8 row addresses per thread in registers, the TMA producers almost nothing.
REGS = {"gather": (56, 224), "tma": (PRODUCER_REGS, 232), "tma_rows": (PRODUCER_REGS, 232)}
# Two CTAs per SM (GemmPlan.ctas_per_sm 2): 288 threads each (two consumer warpgroups and one producer warp) and
# no setmaxnreg; ptxas compiles every thread's code for the launch's 65536 / (2 * 288) -> 112 registers (it does not
# allocate past the launch bound where setmaxnreg raises it: a 384-thread two-CTA kernel failed at 80)
REGS_TWO_CTAS = (112, 112)
# Shared memory of one SM (sm_90a, sm_100a: 228 KiB), of which the hardware reserves 1 KiB per resident CTA
SMEM_PER_SM, SMEM_RESERVED_PER_CTA = 233472, 1024
Z_CHUNK = 16
# How the two consumer warpgroups share the work: "cooperative" = both on one 128-row tile (64 rows each);
# "pingpong" = each on its own 64-row tile, alternating, so one warpgroup's epilogue runs while the other's
# mainloop keeps the tensor cores busy (W tiles are then loaded once per 64 rows instead of 128).
CONSUMERS = _SPACE.values("consumer", "gemm1")
# "chain": routing, GEMM 1, GEMM 2, combine as separate launches; "fused": routing, then one persistent kernel
# for GEMM 1 + GEMM 2 + combine (templates/sm90/fused.py.j2), which needs gemm1.bn == gemm2.bn | hidden
SCHEDULES = _SPACE.values("schedule")
# The backward's four expert-grouped GEMMs (bf16 in, fp32 accumulate; docs/contract.md "Backward"):
#   dgrad1  dA' = dOg . W2          rows x I,  K = H   (dSwiGLU + router-gradient epilogue)
#   dgrad2  dxs = dz . W1           rows x H,  K = 2I  (plain store; combine sums each token's slots)
#   wgrad1  dW1[g] = dzᵀ . xg       2I x H per group, K = the group's rows (varlen-K)
#   wgrad2  dW2[g] = dOgᵀ . (s a)   H x I  per group, K = the group's rows
BACKWARD_GEMMS = ("dgrad1", "dgrad2", "wgrad1", "wgrad2")
BWD_STREAMS = _SPACE.values("streams", "bwd")  # BackwardPlan.streams (override bwd_streams)
X_COLS = _SPACE.values("x_cols", "bwd")  # BackwardPlan.x_cols (override bwd_x_cols)
PDL = _SPACE.values("pdl")  # Plan.pdl (override pdl)
WGRAD_DTYPE_KEYS = ("wgrad1_dtype", "wgrad2_dtype")


def _tile_m(consumer: str) -> int:
    """Rows of A per pipeline stage: the whole M tile (cooperative) or one warpgroup's half of it (pingpong)."""
    return BM if consumer == "cooperative" else BM // CONSUMER_WGS


def _gemm_shape(spec: Spec, which: int) -> tuple[int, int]:
    """(N, K) of GEMM1 or GEMM2."""
    return (2 * spec.ffn, spec.hidden) if which == 1 else (spec.hidden, spec.ffn)


@dataclass(frozen=True)
class GemmPlan:
    """One expert-grouped GEMM. Tile t of the persistent loop maps to panel = t // (raster_group * n_tiles) and,
    inside the panel, m = panel * raster_group + t % raster_group, n = (t // raster_group) % n_tiles: the M tile
    varies fastest, so the B tile is reused by raster_group consecutive tiles while the panel's A rows stay in L2."""

    bm: int
    bn: int
    bk: int
    stages: int
    consumer_wgs: int  # 2 = cooperative: each warpgroup computes 64 rows of the 128-row tile
    epi_m: int
    epi_n: int
    raster_group: int
    a_load: str  # "gather" (cp.async row gather, GEMM1) or "tma"
    n_tiles: int
    k_tiles: int
    cluster: int = 1  # CTAs per cluster along M: 2 = pairs of M tiles share (multicast) their W tile
    consumer: str = "cooperative"  # see CONSUMERS
    w_hint: str = "normal"  # L2 eviction priority of the W-tile loads (see L2_HINTS)
    a_hint: str = "normal"  # ... of the A-tile loads where TMA reads them (GEMM 2; GEMM 1 with a_load "tma")
    epi_stages: int = EPI_BUFFERS  # epilogue smem buffers of epi_n columns (per consumer warpgroup in ping-pong)
    # dgrad1's dSwiGLU epilogue: z pairs per thread whose loads are issued together (at most the bn / 4 pairs a
    # thread holds; more in flight hide more latency, each costs 2 registers)
    z_chunk: int = Z_CHUNK
    elem_bytes: int = ELEM_BYTES  # bytes per operand element: 2 (bf16) or 1 (e4m3, FP8 specs: see fp8_gemm)
    promote: str = "serial"  # FP8: "serial", "stagger" or "overlap" (templates/sm90/_blocks.py.j2 mainloop_fp8*)
    # dgrad1's z: "tma" = through the stage ring (z_stage_problem), "direct" = global loads by the consumer threads
    z_load: str = "direct"
    # GEMM 1 of a training step (gemm1_train) stores z: "ring" = through the stage ring beside its output, TMA-stored
    # by the storer warp (z_ring_problem), "direct" = 4-byte global stores by the consumer threads
    z_store: str = "direct"
    # the bf16 output: "ring" = through the stage ring, TMA-stored by a storer warp (epi_ring_problem); "smem" =
    # through the epi_stages buffers of epi_n columns, TMA-stored by the first consumer warp
    epi_store: str = "smem"
    # FP8: wgmma issues per K block along N. 2 = the tile's bn columns computed as two halves of bn / 2, each
    # summed into the per-block accumulator and promoted in turn (128 x 256 FP8 tiles: the whole-tile fp32
    # accumulator plus one half-width per-block one fit the registers; see fp8_widen)
    mma_split: int = 1
    # FP8 GEMM 1: who quantizes h per 1 x 128 for GEMM 2: "kernel" = the quant_rows_used launch after GEMM 1,
    # "epilogue" = GEMM 1's epilogue (its 256-column tile's 128 outputs are one scale block per row: h_quant_problem)
    h_quant: str = "kernel"
    # FP8 weight gradients: bytes of fp32 scales each stage also holds (the K block's scales of the tile's A and B
    # columns, TMA-loaded with the operands: (tile_m + bn) * 4); 0 elsewhere
    stage_scale_bytes: int = 0
    # persistent CTAs resident per SM: 1, or 2 (BF16 weight gradients of tile N <= 128 on sm_90a): the kernel then
    # launches two CTAs per SM, each with half the SM's shared memory (stages refit) and registers (REGS_TWO_CTAS),
    # so that one CTA's epilogue runs while the other's wgmma keeps the tensor cores busy (the hardware's ping-pong)
    ctas_per_sm: int = 1

    @property
    def tile_m(self) -> int:
        """Rows per tile of the persistent loop (and per pipeline stage)."""
        return _tile_m(self.consumer)

    @property
    def regs(self) -> tuple[int, int]:
        """(producer, consumer) registers per thread (setmaxnreg), by how A is loaded (REGS), or the two-CTA split."""
        return REGS_TWO_CTAS if self.ctas_per_sm == 2 else REGS[self.a_load]

    def k_tiles_for(self, k: int) -> int:
        """K tiles of this GEMM for a K of k: 1-byte operands (FP8, MXFP8) take a partial last tile (TMA reads zeros
        past K), bf16 ones whole tiles (where K must divide, the checks say so)."""
        return -(-k // self.bk) if self.elem_bytes == 1 else k // self.bk

    def panel_tiles(self, group_m: int) -> int:
        """Raster panel height in the kernel's work units (tiles of tile_m rows, or cluster pairs of them): the
        plan's raster_group counts routing tiles of group_m rows, so the panels span the same rows whatever the
        tile and cluster."""
        return max(1, self.raster_group * (group_m // self.tile_m) // self.cluster)

    def smem_bytes(self, parts_bn: int | None = None) -> int:
        """Shared memory of the grouped-GEMM kernel: the stage ring, the epilogue buffers (none where the output
        goes through the stage ring, epi_store "ring": the kernel allocates none), the barriers."""
        bn = self.bn if parts_bn is None else parts_bn
        epi_sets = 0 if self.epi_store == "ring" else 2 if self.consumer == "pingpong" else 1
        return (self.stages * ((self.tile_m + bn) * self.bk * self.elem_bytes + self.stage_scale_bytes)
                + epi_sets * self.tile_m * self.epi_n * ELEM_BYTES * self.epi_stages + BARRIER_BYTES)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["ctas_per_sm"] == 1:   # plans from before the knob keep their dicts (and cache keys)
            del d["ctas_per_sm"]
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GemmPlan:
        return cls(**_fields(cls, data, "plan.gemm"))


@dataclass(frozen=True)
class BackwardPlan:
    """Tiles of the backward GEMMs (GemmPlan each; a wgrad's k_tiles is 0: its K is each group's rows), and how
    the backward's kernels are launched: ``streams`` 1 (one stream, in order) or 2 (after dgrad1, the weight
    gradients and the x-row gather run on a second stream beside dgrad2 and the combine, so each kernel's last,
    partial wave is filled by the other stream's work; dgrad2 then writes into a buffer of its own, one more
    [rows, hidden] bf16 tensor alive during the backward). The kernels and their bits are the same either way."""

    dgrad1: GemmPlan
    dgrad2: GemmPlan
    wgrad1: GemmPlan
    wgrad2: GemmPlan
    streams: int = 1
    # the training forward's GEMM 1 (gemm1_train) where it differs from the inference GEMM 1 (plan.gemm1): its A
    # rows by TMA from the gather kernel's rows and z through the stage ring (see _settle_z_store); None: as gemm1
    gemm1_train: GemmPlan | None = None
    # x's 128 x 1 column form for an FP8 wgrad1: quantized in the backward ("backward": quant_cols_gather) or by the
    # training forward's x quantizer with its 1 x 128 rows, from one read, and saved ("forward": quant_both_gather)
    x_cols: str = "backward"

    def __post_init__(self) -> None:
        if isinstance(self.streams, bool) or self.streams not in BWD_STREAMS:
            raise PlanError(f"plan.backward.streams: must be one of {', '.join(map(str, BWD_STREAMS))}, "
                            f"got {self.streams!r}")
        if self.x_cols not in X_COLS:
            raise PlanError(f"plan.backward.x_cols: must be one of {', '.join(X_COLS)}, got {self.x_cols!r}")
        if self.x_cols == "forward" and self.wgrad1.elem_bytes != 1:
            raise PlanError("plan.bwd_x_cols: 'forward' quantizes x's columns for an FP8 wgrad1 (an FP8 spec with "
                            "wgrad1_dtype fp8); this wgrad1 reads bf16 rows")

    def to_dict(self) -> dict[str, Any]:
        d = {**{n: getattr(self, n).to_dict() for n in BACKWARD_GEMMS}, "streams": self.streams}
        if self.gemm1_train is not None:
            d["gemm1_train"] = self.gemm1_train.to_dict()
        if self.x_cols != "backward":   # plans from before the knob keep their dicts (and cache keys)
            d["x_cols"] = self.x_cols
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "BackwardPlan":
        d = _fields(cls, data, "plan.backward")
        g1t = d.get("gemm1_train")
        return cls(**{n: GemmPlan.from_dict(d[n]) for n in BACKWARD_GEMMS}, streams=d.get("streams", 1),
                   gemm1_train=GemmPlan.from_dict(g1t) if g1t is not None else None,
                   x_cols=d.get("x_cols", "backward"))


def fused_tiles_ok(spec: Spec, g1: GemmPlan, g2: GemmPlan) -> bool:
    """The fused kernel shares one B operand of bn rows between its GEMMs: gemm1.bn == gemm2.bn | hidden."""
    return g1.bn == g2.bn and spec.hidden % g2.bn == 0


@dataclass(frozen=True)
class Plan:
    spec: Spec
    arch: str
    gemm1: GemmPlan
    gemm2: GemmPlan
    bm: int
    cap_rows: int
    max_m_tiles: int
    chunk_rows: int  # MoK overlap granularity: GEMM2 may start on a chunk of rows once GEMM1 has written them
    waves1: float
    waves2: float
    predicted_ms: float
    predicted_tflops: float
    notes: tuple[str, ...] = ()
    schedule: str = "chain"  # see SCHEDULES
    backward: BackwardPlan | None = None  # the training kernels' tiles (None: a plan dict from before them)
    pdl: str = "off"  # programmatic dependent launch of the layer's kernels (the sm_90a templates; see PDL)

    def __post_init__(self) -> None:
        if self.pdl not in PDL:
            raise PlanError(f"plan.pdl: must be one of {', '.join(PDL)}, got {self.pdl!r}")
        if self.pdl != "off" and self.arch != "sm_90a":
            raise PlanError(f"plan.pdl: programmatic dependent launch is built into the sm_90a templates only, not "
                            f"{self.arch}'s")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"plan.schedule: must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.schedule == "fused":
            if not fused_tiles_ok(self.spec, self.gemm1, self.gemm2) or self.gemm1.a_load != "gather":
                raise PlanError(
                    f"plan.schedule: 'fused' needs gemm1.bn == gemm2.bn dividing hidden {self.spec.hidden} and "
                    f"gemm1.a_load 'gather', got bn {self.gemm1.bn}/{self.gemm2.bn}, a_load {self.gemm1.a_load!r}")
        if "pingpong" in (self.gemm1.consumer, self.gemm2.consumer) and self.schedule == "fused":
            raise PlanError("plan.consumer: the fused schedule's tiles are cooperative (128 rows per task)")
        for name, g in (("gemm1", self.gemm1), ("gemm2", self.gemm2)):
            if g.consumer not in CONSUMERS:
                raise PlanError(f"plan.{name}.consumer: must be one of {', '.join(CONSUMERS)}, got {g.consumer!r}")
            if g.bm % g.tile_m:
                raise PlanError(f"plan.{name}.bm: {g.bm} is not a multiple of its {g.tile_m}-row tiles")
        if not self.gemm1.bm == self.gemm2.bm == self.bm:
            raise PlanError(
                f"plan.bm: GEMM1 and GEMM2 must share the M tile, got {self.gemm1.bm}, {self.gemm2.bm}, {self.bm}")
        object.__setattr__(self, "notes", tuple(self.notes))

    @property
    def train_gemm1(self) -> GemmPlan:
        """The training forward's GEMM 1 (gemm1_train): ``backward.gemm1_train`` where the plan splits it off,
        else the inference GEMM 1."""
        g1t = self.backward.gemm1_train if self.backward is not None else None
        return g1t if g1t is not None else self.gemm1

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d.update(spec=self.spec.to_dict(), gemm1=self.gemm1.to_dict(), gemm2=self.gemm2.to_dict(),
                 notes=list(self.notes), backward=self.backward.to_dict() if self.backward else None)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        d = _fields(cls, data, "plan")
        d.update(spec=Spec.from_dict(d["spec"]), gemm1=GemmPlan.from_dict(d["gemm1"]),
                 gemm2=GemmPlan.from_dict(d["gemm2"]))
        if d.get("backward") is not None:
            d["backward"] = BackwardPlan.from_dict(d["backward"])
        return cls(**d)

    def canonical_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))


def smem_budget(arch: Arch, g: GemmPlan) -> int:
    """Bytes of shared memory one CTA of GEMM `g` may use: the arch's per-CTA limit, or with ctas_per_sm CTAs
    sharing an SM its share of the SM's (less the 1 KiB the hardware reserves per CTA)."""
    if g.ctas_per_sm == 1:
        return arch.smem_per_cta
    return min(arch.smem_per_cta, SMEM_PER_SM // g.ctas_per_sm - SMEM_RESERVED_PER_CTA)


def _fields(cls: type, data: Mapping[str, Any], where: str) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    optional = {f.name for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    if not isinstance(data, Mapping) or not names - optional <= set(data) <= names:
        got = sorted(data) if isinstance(data, Mapping) else type(data).__name__
        raise PlanError(f"{where}: expected the keys {sorted(names)}, got {got}")
    return dict(data)


def _m_tiles(spec: Spec, bm: int = BM) -> int:
    """Expected M tiles of `bm` rows at spec.tokens under random routing: each routed group's row count is
    spread around T*K/E, so its padding to a multiple of bm averages (bm-1)/2 rows (the remainders are close
    to uniform; the H200 runs measured gpt-oss-120b at 185 tiles of 128 where this gives 191); every shared
    group gets exactly T rows."""
    routed = (spec.routed_rows + spec.local_experts * (bm - 1) / 2) / bm
    return max(1, round(routed)) + spec.shared_experts * -(-spec.tokens // bm)


@dataclass(frozen=True)
class _GemmCost:
    flops: int  # useful flops
    bytes: int  # HBM traffic: weights (+ biases), A rows, output rows
    tiles: int
    row_eff: float  # useful / padded rows
    n_eff: float  # N / (n_tiles * bn): below 1 with a partial N tile
    wave_eff: float  # tiles / (ceil(waves) * sms)
    mainloop_eff: float
    compute_ms: float
    memory_ms: float

    @property
    def eff(self) -> float:
        return self.row_eff * self.n_eff * self.wave_eff * self.mainloop_eff

    @property
    def ms(self) -> float:
        return max(self.compute_ms, self.memory_ms)

    @property
    def bound(self) -> str:
        return "memory" if self.memory_ms > self.compute_ms else "compute"


# ---- helpers every arch's rules use ----------------------------------------------------------------------------
def _gemm_override(overrides: Mapping[str, Any], which: int, name: str) -> tuple[str, Any] | None:
    """(key, value) of the override of `name` for GEMM `which`: ``gemm<which>_<name>`` wins over ``<name>``."""
    for key in (f"gemm{which}_{name}", name):
        if key in overrides:
            return key, overrides[key]
    return None


def _int_override(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"plan.{key}: must be an integer, got {value!r}")
    return value


def _settle_streams(plan: Plan, streams: Any) -> Plan:
    """The backward's streams: the ``bwd_streams`` override (checked), else BackwardPlan's default of one stream
    (two measured no faster on any shape: bench/NOTES.md v13)."""
    if streams is None:
        return plan
    if plan.backward is None:
        raise PlanError("plan.bwd_streams: this plan has no backward kernels")
    if isinstance(streams, bool) or streams not in BWD_STREAMS:
        raise PlanError(f"plan.bwd_streams: must be one of {', '.join(map(str, BWD_STREAMS))}, got {streams!r}")
    return dataclasses.replace(plan, backward=dataclasses.replace(plan.backward, streams=streams),
                               notes=plan.notes + (f"overrides: bwd_streams={streams}",))


def _settle_x_cols(plan: Plan, x_cols: Any) -> Plan:
    """Where an FP8 wgrad1's x columns are quantized: the ``bwd_x_cols`` override (checked by BackwardPlan), else
    the backward (BackwardPlan's default)."""
    if x_cols is None:
        return plan
    if plan.backward is None:
        raise PlanError("plan.bwd_x_cols: this plan has no backward kernels")
    if x_cols not in X_COLS:
        raise PlanError(f"plan.bwd_x_cols: must be one of {', '.join(X_COLS)}, got {x_cols!r}")
    if x_cols == "forward" and plan.train_gemm1.a_load == "gather":
        raise PlanError("plan.bwd_x_cols: forward makes x's two FP8 forms from quant_both_gather's one read of the "
                        "routed rows for a TMA-fed training GEMM 1; this one gathers x's per-token rows itself "
                        "(gemm1_a_load gather): the columns stay the backward's")
    return dataclasses.replace(plan, backward=dataclasses.replace(plan.backward, x_cols=x_cols),
                               notes=plan.notes + (f"overrides: bwd_x_cols={x_cols}",))


def _settle_pdl(plan: Plan, pdl: Any) -> Plan:
    """Programmatic dependent launch: the ``pdl`` override (checked by Plan), else the plan's default (off)."""
    if pdl is None:
        return plan
    return dataclasses.replace(plan, pdl=pdl, notes=plan.notes + (f"overrides: pdl={pdl}",))


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


class SharedSolver(NamedTuple):
    """What the shared solver (:mod:`mokgen.plan`) hands an arch's own rules (``mokgen.plan.ARCH_RULES``):
    ``solve(spec, arch, **overrides)``, its plan by the sm_90a rules and cost model, and ``replan(plan, gemm1,
    gemm2)``, `plan` rebuilt around other forward GEMMs (cost, capacity, chunk and backward tiles for their routing
    tile; the notes of its own kept)."""

    solve: Callable[..., Plan]
    replan: Callable[[Plan, GemmPlan, GemmPlan], Plan]
