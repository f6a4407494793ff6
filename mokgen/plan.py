"""The plan stage: `Spec` + `Arch` -> `Plan` (tile shapes, pipeline depth, raster, overlap chunk, capacity).

The kernels compute two expert-grouped GEMMs over the padded permuted row space (docs/contract.md):
GEMM1 ``h = SwiGLU(x[rows] . w1ᵀ)`` (N = 2*ffn, K = hidden) and GEMM2 ``ys = h . w2ᵀ`` (N = hidden, K = ffn).
The rules the sm_90a kernels impose are written as sympy expressions and solved for each candidate tile;
a cost model ranks the candidates and `explain` prints the whole derivation with its numbers. An arch whose
kernels differ has its own rules in its package (sm_100a: mokgen/sm100/plan.py), reached through one table,
:data:`ARCH_RULES`; the plan's types are mokgen/plan_types.py, below both. sympy is
imported on the first solve (:func:`_rules`), not with this module: the runtime rebuilds a plan from a cache
entry's ``meta.json`` with :meth:`Plan.from_dict`, which needs none of it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from typing import Any, Iterable, Mapping

from .arch import ARCHS, Arch  # the one arch table (re-exported: plan.ARCHS, plan.Arch)
from .plan_types import (  # the plan's types and shared vocabulary (re-exported: plan.Plan, plan.PlanError, ...)
    BACKWARD_GEMMS, BARRIER_BYTES, BM, CONSUMER_WGS, CONSUMERS, ELEM_BYTES, EPI_BUFFERS, EPI_M, EPI_N,
    MAX_STAGES, MIN_STAGES, PRODUCER_REGS, SCHEDULES, WGRAD_DTYPE_KEYS, Z_CHUNK, BackwardPlan, GemmPlan, Plan,
    PlanError, SharedSolver, _gemm_override, _gemm_shape, _GemmCost, _int_override, _m_tiles, _pct,
    _settle_pdl, _settle_streams, _settle_x_cols, _tile_m, fused_tiles_ok, get_arch, smem_budget,
)
from .sm100 import plan as _sm100_plan  # the sm_100a plan rules (ARCH_RULES)
from .space import SM90 as _SPACE, override_keys as _override_keys  # legal values: the config space
from .spec import Spec

__all__ = [
    "Arch", "ARCHS", "get_arch", "GemmPlan", "BackwardPlan", "Plan", "PlanError",
    "cap_rows", "candidates", "solve", "explain", "OVERRIDES", "parse_overrides",
]


# ---- kernel constants (sm_90a, bf16) ---------------------------------------------------------------------
# (the tile constants a GemmPlan defaults to, BM, MIN_STAGES / MAX_STAGES, the epilogue's, ...: mokgen/plan_types.py)
BK = 64  # K tile; the spec guarantees hidden % 64 == ffn % 64 == 0
BN_CHOICES = _SPACE.values("bn", "gemm1")
WARPGROUP = 128  # threads
RASTER_MAX = 8
# Tall panels where one group's weights for a GEMM exceed L2/4 (they cannot stay in L2 from one panel to the
# next, so every panel re-reads them from DRAM) and the routed groups span several panels (not _small_groups).
# Measured with ncu on the H200 (bench/NOTES.md v5): GEMM 1, whose A rows come from x (shared by every panel),
# reads 23-42% less from DRAM with panels of 32 M tiles than of 8; GEMM 2, whose h rows belong to one panel,
# 12-30% less at 16 and more again at 32 once the panel's h rows stop fitting beside the streamed W tiles.
TALL_RASTER = {1: 32, 2: 16}
# GEMM 1 of specs with small routed groups (_small_groups) that still span two or more 128-row tiles
# (SMALL_GROUPS_PANEL_MIN_ROWS; e.g. qwen3-30b-a3b, 128 experts x ~256 rows) takes panels of 16 M tiles, though
# no one group's W overflows L2. Measured on the H100 (bench/NOTES.md v28): qwen3-30b-a3b's training GEMM 1 read
# 1.68 GB from DRAM with panels of 8 M tiles, 1.36 with 16, 1.27 with 32 (ncu; 0.673 / 0.584 / 0.544 ms), and
# forward+backward ran 2.943 / 2.899 / 2.935 ms (BF16) and 2.456 / 2.293 / 2.382 (FP8) in one process;
# gpt-oss-120b (128-row groups: one tile each) was fastest at 8 (11.33 / 11.40 / 11.72 ms), so it keeps the fit.
SMALL_GROUPS_GEMM1_RASTER = 16
SMALL_GROUPS_PANEL_MIN_ROWS = 256
# Epilogue staging choices (plan.gemm*.epi_n / epi_stages; overrides epi_n, epi_stages): 32-column slices in
# 2 buffers; 64 columns or 4 buffers measured within 1% on the H200 (bench/NOTES.md v2).
EPI_NS = _SPACE.values("epi_n")
EPI_STAGE_CHOICES = _SPACE.values("epi_stages")
REG_OVERHEAD = 64  # consumer registers besides the accumulator (addresses, epilogue, SwiGLU): an estimate
# Mainloop efficiency of one tile relative to the measured peak, by tile N. Guesses, to be replaced by tune
# measurements: narrow tiles re-read A more often per flop and keep fewer wgmma in flight.
MAINLOOP_EFF = {256: 1.0, 192: 0.95, 128: 0.88, 64: 0.7}
# How GEMM1 gets its A rows: "gather" = GEMM1's producer warpgroup gathers the routed rows of x with cp.async
# into the swizzled A tile (fused, no extra pass); "tma" = a gather kernel writes them contiguously first and
# GEMM1 loads them by TMA; "tma_rows" = one (1, BK) TMA box of x per row (no extra pass, no cp.async).
# Measured on the H200 (bench/NOTES.md v4, end to end, same process): with small routed groups the extra pass
# pays: gpt-oss-120b (128 rows per expert) 2.24-2.27 vs 2.60 ms, qwen3-30b-a3b (256 rows) 0.704 vs 0.724 ms;
# with groups of 2000+ rows the fused gather is as fast or faster (v2: kimi-k2 2.698 vs 2.722 ms, glm-5 2.266
# vs 2.370). So GEMM 1 gathers in its producer when the routed groups average at least GATHER_MIN_GROUP_ROWS
# rows, else by the gather kernel + TMA. "tma_rows" measured slower everywhere (the TMA unit issuing 128 small
# boxes per stage: kimi-k2 2.72 vs 2.56 ms) and is only an override.
GEMM1_A_LOAD = "gather"
GATHER_MIN_GROUP_ROWS = 1024
# The wgrad GEMMs' epilogue staging. A wgrad tile's reduction is its group's rows, so where routed groups are
# tiny the bf16 epilogue (stmatrix -> smem -> TMA store, 32-column slices through 2 buffers, each reuse waiting
# for the TMA store of two slices back) is most of a tile's time. Measured on the H200 (bench/NOTES.md v10,
# sustained step timelines, same call): gpt-oss-120b (128 rows per expert, 2 K steps a tile) wgrad1 2.50 ->
# 1.98 ms and wgrad2 1.29 -> 1.02 ms with the whole 128 x 256 tile buffered (64-column slices, 4 buffers: no
# wait inside a tile; 3 stages fit beside them); qwen3-30b-a3b (256 rows, 4 K steps) within the run-to-run
# spread; dbrx-like (2048 rows), glm-5 and qwen3.5-397b-a17b 4-14% slower (the ring loses a stage). So the
# whole-tile staging is used where the routed groups average at most WGRAD_TILE_EPI_MAX_ROWS rows.
WGRAD_TILE_EPI_MAX_ROWS = 192
# The Hopper BF16 wgrads' output path. Since v12 the default is the stage ring (_with_epi_store): a tile's output
# goes to a storer warp through E_STAGES ring stages, which, where a tile has no more K steps than the ring has
# stages, are the next tile's prefetch. Measured on the H100 (bench/NOTES.md v21, bench_backward, one call each,
# 3-4 interleaved rounds): qwen3-30b-a3b (256 rows per expert, 4 K steps) f+b 3.017 vs 3.111 and 2.943 vs
# 3.070 ms with the whole tile buffered in shared memory (WGRAD_TILE_EPI, 3 stages) instead of the ring;
# gpt-oss-120b (128 rows) 11.17 vs 11.12 and 11.60 vs 11.50 (within the spread); kimi-k2, glm-5 and
# deepseek-v4-pro (2000+ rows) within 0.6% either way. So the BF16 wgrads of specs whose routed groups average
# more than WGRAD_TILE_EPI_MAX_ROWS and at most WGRAD_SMEM_EPI_MAX_ROWS rows (4 K steps of 64) store through
# the whole-tile buffers (epi_store "smem"); the others keep the ring.
WGRAD_SMEM_EPI_MAX_ROWS = 256
# ... and in that same class (routed groups averaging more than WGRAD_TILE_EPI_MAX_ROWS and at most
# WGRAD_SMEM_EPI_MAX_ROWS rows; BF16 wgrads of Hopper BF16 specs) their tile N is 128 instead of the widest that
# divides. Measured on the H100, bench_backward, mokgen only, same process, interleaved rounds (bench/NOTES.md v34,
# v35): qwen3-30b-a3b forward+backward 2.876 vs 2.932 ms (3 rounds), 2.860 vs 2.912 (6 rounds), 2.826 vs 2.899
# (6 rounds, another lease), and as the default against wgrad*_bn=256 2.880 vs 2.905 (6 rounds): 0.9-2.5% faster
# in all four calls. Outside the class it lost: gpt-oss-120b (128 rows) 11.057 vs 10.804 ms, qwen3.5-397b-a17b
# (~2560 rows) 3.331 vs 3.288 (v34). Not measured on the H200.
WGRAD_SMALL_GROUPS_BN = 128
WGRAD_TILE_EPI = dict(epi_n=64, epi_stages=4)
# the widest wgrad tile N with two CTAs per SM (GemmPlan.ctas_per_sm): a 128 x 128 tile's accumulator is 64
# registers per consumer thread, within the 112 a thread of two 288-thread CTAs has (REGS_TWO_CTAS)
TWO_CTAS_MAX_BN = 128


def ctas_per_sm_problem(g: GemmPlan, arch: Arch) -> str | None:
    """Why GEMM plan `g` cannot run with its ctas_per_sm (one-line reason), or None: more than one CTA per SM is
    the sm_90a BF16 weight-gradient template's form (templates/sm90/wgrad.py.j2), for tile N <= TWO_CTAS_MAX_BN."""
    if g.ctas_per_sm not in _SPACE.values("ctas_per_sm", "wgrad1"):
        return f"must be one of {', '.join(map(str, _SPACE.values('ctas_per_sm', 'wgrad1')))}, got {g.ctas_per_sm}"
    if g.ctas_per_sm > 1 and (g.k_tiles != 0 or g.elem_bytes != ELEM_BYTES or g.bn > TWO_CTAS_MAX_BN
                              or arch.has_tcgen05):
        return (f"{g.ctas_per_sm} CTAs per SM are built for sm_90a BF16 weight gradients of tile N <= "
                f"{TWO_CTAS_MAX_BN} only (got tile N {g.bn}{', FP8' if g.elem_bytes == 1 else ''} on {arch.name})")
    return None
A_LOADS = _SPACE.values("a_load", "gemm1")
OVERRIDES = _override_keys("sm_90a")  # every knob's keys (mokgen.space)
CLUSTERS = _SPACE.values("cluster", "gemm1")
# L2 eviction priority of a GEMM's TMA loads (W tiles: w_hint; A tiles loaded by TMA: a_hint), as the 64-bit
# cache policies of createpolicy.fractional (fraction 1.0): "normal" issues no hint
L2_HINTS = {"normal": None, "first": 0x12F0000000000000, "last": 0x14F0000000000000}
# Mainloop efficiency of a ping-pong tile relative to a cooperative one, per GEMM, from the H200 (bench/NOTES.md
# v3): GEMM 1 ran 4-6% slower per flop (its W tiles are loaded once per 64 rows instead of 128), GEMM 2's hidden
# epilogue was worth up to 8-19% in short bursts but nothing in the sustained, power-capped benchmark. What
# ping-pong does win is padding: both GEMMs ping-pong pad the routed groups to 64 rows instead of 128.
PINGPONG_EFF = {1: 0.95, 2: 1.0}
RASTER_OVERRIDE_MAX = max(_SPACE.values("raster_group", "gemm1"))

# ---- the rules, symbolically -------------------------------------------------------------------------------
_RULES = ("STAGE_BYTES", "STAGES_FIT", "PANEL_BYTES", "RASTER_FIT", "CHUNK_MIN")


@functools.lru_cache(maxsize=None)
def _rules() -> types.SimpleNamespace:
    """The symbols and rules (``STAGE_BYTES``, ``STAGES_FIT``, ``PANEL_BYTES``, ``RASTER_FIT``, ``CHUNK_MIN``;
    also module attributes, e.g. ``plan.STAGES_FIT``), built on first use: sympy is imported here."""
    import sympy as sp

    r = types.SimpleNamespace(sp=sp)
    r.smem, r.epi, r.bar = sp.symbols("smem_cta epi_bytes barrier_bytes", positive=True)
    r.bm, r.bn, r.bk, r.k, r.n, r.l2, r.sms = sp.symbols("BM BN BK K N L2 C", positive=True)
    r.stages, r.raster, r.chunk = sp.symbols("stages r T_chunk", positive=True)
    r.STAGE_BYTES = ELEM_BYTES * r.bk * (r.bm + r.bn)
    # stages * STAGE_BYTES + epilogue + barriers <= smem_per_cta
    r.STAGES_FIT = sp.solve(sp.Eq(r.stages * r.STAGE_BYTES + r.epi + r.bar, r.smem), r.stages)[0]
    # the panel's A rows (r M tiles) plus the B tile streamed across them stay within half the L2
    r.PANEL_BYTES = ELEM_BYTES * r.k * (r.raster * r.bm + r.bn)
    r.RASTER_FIT = sp.solve(sp.Eq(r.PANEL_BYTES, r.l2 / 2), r.raster)[0]
    # MoK overlap: a chunk of T_chunk rows must hold >= 2 waves of tiles, (T_chunk/BM) * (N/BN) >= 2*C
    r.CHUNK_MIN = sp.solve(sp.Eq((r.chunk / r.bm) * (r.n / r.bn), 2 * r.sms), r.chunk)[0]
    return r


def __getattr__(name: str) -> Any:
    if name in _RULES:
        return getattr(_rules(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _epi_bytes() -> int:
    return EPI_M * EPI_N * ELEM_BYTES * EPI_BUFFERS


def _stage_bytes(bn: int, consumer: str = "cooperative") -> int:
    r = _rules()
    return int(r.STAGE_BYTES.subs({r.bk: BK, r.bm: _tile_m(consumer), r.bn: bn}))


@functools.lru_cache(maxsize=4096)  # pure in hashable args; sympy subs are slow
def _stages_bound(arch: Arch, bn: int, consumer: str = "cooperative", ring: bool = False) -> Any:
    """STAGES_FIT for tile N `bn`: beside the epilogue buffers, or with `ring` (the ring epilogue) none."""
    r = _rules()
    values = {r.smem: arch.smem_per_cta, r.epi: 0 if ring else _epi_bytes(), r.bar: BARRIER_BYTES, r.bk: BK,
              r.bm: _tile_m(consumer), r.bn: bn}
    return r.STAGES_FIT.subs(values)


def _stages_fit(arch: Arch, bn: int, consumer: str = "cooperative") -> int:
    return int(_rules().sp.floor(_stages_bound(arch, bn, consumer)))


def _consumer_regs(arch: Arch) -> int:
    """Registers per consumer thread once the producer warpgroup has given its share back (multiple of 8)."""
    free = (arch.regs_per_sm - WARPGROUP * PRODUCER_REGS) // (CONSUMER_WGS * WARPGROUP)
    return min(255, free) // 8 * 8


def _acc_regs(bn: int) -> int:
    """fp32 accumulator registers per consumer thread: each warpgroup holds (BM / wgs) x BN."""
    return BM // CONSUMER_WGS * bn // WARPGROUP


@functools.lru_cache(maxsize=4096)  # pure in hashable args; sympy subs are slow
def _raster_bound(arch: Arch, k: int, bn: int) -> Any:
    r = _rules()
    return r.RASTER_FIT.subs({r.l2: arch.l2_bytes, r.k: k, r.bm: BM, r.bn: bn})


def _raster_group(arch: Arch, k: int, bn: int) -> int:
    """The largest power of two <= the L2 bound, capped at RASTER_MAX (1 if even one M tile overflows)."""
    fit = int(_rules().sp.floor(_raster_bound(arch, k, bn)))
    return min(RASTER_MAX, 1 << max(0, fit.bit_length() - 1))


@functools.lru_cache(maxsize=4096)  # pure in hashable args; sympy subs are slow
def _chunk_rows(arch: Arch, n_tiles: int, bm: int = BM) -> int:
    """Smallest multiple of bm whose row tiles times `n_tiles` reach 2 waves (N/BN = n_tiles, partial tile included)."""
    r = _rules()
    rows = r.CHUNK_MIN.subs({r.bm: bm, r.bn: 1, r.n: n_tiles, r.sms: arch.sms})
    return bm * int(r.sp.ceiling(rows / bm))


def cap_rows(spec: Spec, bm: int, tokens: int) -> int:
    """Worst-case padded rows for `tokens` tokens: T*K + S*T + G*(BM-1), rounded up to BM (nothing dropped)."""
    worst = tokens * spec.topk + spec.shared_experts * tokens + spec.groups * (bm - 1)
    return -(-worst // bm) * bm


BWD_BN_CHOICES = (256, 192, 128, 64)  # widest first; 64 always divides (the spec keeps H, I multiples of 64)


def backward_shape(spec: Spec, name: str) -> tuple[int, int, int | None]:
    """(M, N, K) of a backward GEMM; M is None for the dgrads (rows of the padded row space), K None for the
    wgrads (each group's rows)."""
    H, I = spec.hidden, spec.ffn
    return {"dgrad1": (None, I, H), "dgrad2": (None, H, 2 * I), "wgrad1": (2 * I, H, None),
            "wgrad2": (H, I, None)}[name]


def _backward_bn_problem(spec: Spec, arch: Arch, name: str, bn: Any) -> str | None:
    """Why tile N `bn` cannot be used for backward GEMM `name`, or None: one of the tile N choices whose
    accumulator fits the registers and whose ring fits MIN_STAGES stages; dgrad1's dSwiGLU epilogue also needs
    whole tiles of I (it reads z and writes dz per column). dgrad2 and the wgrads may end on a partial N tile
    (TMA boxes are clipped at the extents; the wgrads' fp32 main_grad epilogue predicates its columns)."""
    if (why := _gemm_problem(spec, arch, 2, bn)) is not None:
        return why
    if name == "dgrad1" and spec.ffn % bn:
        return f"dgrad1's dSwiGLU epilogue needs whole tiles of ffn: {spec.ffn} % {bn} = {spec.ffn % bn}"
    return None


def _stages_most(arch: Arch, g: GemmPlan) -> int:
    """The most pipeline stages (capped at MAX_STAGES) whose ring, with `g`'s epilogue buffers (none for a ring
    epilogue) and the barriers, fits the CTA's shared memory (GemmPlan.smem_bytes; its share of the SM's with
    ctas_per_sm 2: smem_budget)."""
    fixed = dataclasses.replace(g, stages=0).smem_bytes()
    return min(MAX_STAGES, (smem_budget(arch, g) - fixed) // ((g.tile_m + g.bn) * g.bk * g.elem_bytes
                                                              + g.stage_scale_bytes))


def _backward_gemm(spec: Spec, arch: Arch, name: str, bm: int, bn: int | None = None,
                   ring: bool = False) -> GemmPlan:
    """Cooperative 128-row tiles; by default the widest tile N that divides N and fits (dgrad1's dSwiGLU epilogue
    needs whole tiles of I: it reads z and writes dz per column); `bn` (an override, checked by the caller with
    :func:`_backward_bn_problem`) replaces it, and the stages, raster and z chunk follow from it by the same rules.
    A wgrad's output path is :func:`_wgrad_output`'s, or with `ring` (an explicit ``epi_store`` ring) the ring's
    own staging and stages wherever the tile allows it."""
    m, n, k = backward_shape(spec, name)
    if bn is None and k is None and _wgrad_small_groups(spec, arch) and n % WGRAD_SMALL_GROUPS_BN == 0:
        bn = WGRAD_SMALL_GROUPS_BN
    if bn is None:
        bn = next(b for b in BWD_BN_CHOICES if n % b == 0 and _gemm_problem(spec, arch, 2, b) is None)
    g = GemmPlan(
        bm=bm if k is not None else BM, bn=bn, bk=BK,
        stages=min(MAX_STAGES, _stages_fit(arch, bn)),
        consumer_wgs=CONSUMER_WGS, epi_m=EPI_M, epi_n=EPI_N,
        raster_group=_raster_group(arch, k, bn) if k is not None else RASTER_MAX,
        a_load="tma", n_tiles=-(-n // bn), k_tiles=(k // BK) if k is not None else 0,
    )
    if name == "dgrad1":
        g = _with_z_load(dataclasses.replace(g, z_chunk=min(Z_CHUNK, bn // 4)))
    tiny_groups = spec.routed_rows <= WGRAD_TILE_EPI_MAX_ROWS * spec.local_experts
    if k is None and tiny_groups and bn % WGRAD_TILE_EPI["epi_n"] == 0:
        g = dataclasses.replace(g, **WGRAD_TILE_EPI)   # tiny groups: the whole tile's epilogue buffered
        g = dataclasses.replace(g, stages=min(g.stages, _stages_most(arch, g)))
    # a dgrad tile must not span two routing tiles (groups): with 64-row routing tiles, 64-row ping-pong tiles
    if k is not None and bm < BM:
        g = _with_consumer(arch, g, "pingpong")
    g = _wgrad_output(spec, arch, g) if k is None and not ring else _with_epi_store(g)
    return _ring_stages(arch, g) if g.epi_store == "ring" else g


def _wgrad_small_groups(spec: Spec, arch: Arch) -> bool:
    """The class whose BF16 wgrads get the whole-tile smem output path and 128-column tiles by default: a Hopper
    BF16 spec whose routed groups average more than WGRAD_TILE_EPI_MAX_ROWS and at most WGRAD_SMEM_EPI_MAX_ROWS
    rows. FP8 specs' and sm_100a's wgrads keep theirs (not measured)."""
    return (spec.dtype == "bf16" and not arch.has_tcgen05
            and WGRAD_TILE_EPI_MAX_ROWS * spec.local_experts < spec.routed_rows
            <= WGRAD_SMEM_EPI_MAX_ROWS * spec.local_experts)


def _wgrad_smem_rows(spec: Spec, arch: Arch, g: GemmPlan) -> bool:
    """Whether wgrad `g` stores its output through whole-tile smem buffers by default (WGRAD_SMEM_EPI_MAX_ROWS): a
    BF16 wgrad of the _wgrad_small_groups class whose tile N the buffers' slices divide."""
    return (_wgrad_small_groups(spec, arch) and g.elem_bytes == ELEM_BYTES
            and g.bn % WGRAD_TILE_EPI["epi_n"] == 0)


def _wgrad_output(spec: Spec, arch: Arch, g: GemmPlan) -> GemmPlan:
    """Wgrad `g` with its default output path: whole-tile smem buffers (WGRAD_TILE_EPI, as many stages as then fit)
    where _wgrad_smem_rows, else the stage ring where the tile allows (_with_epi_store)."""
    if not _wgrad_smem_rows(spec, arch, g):
        return _with_epi_store(g)
    g = dataclasses.replace(g, epi_store="smem", **WGRAD_TILE_EPI)
    return dataclasses.replace(g, stages=_stages_most(arch, g))


def backward_plan(spec: Spec, arch: Arch, bm: int) -> BackwardPlan:
    return BackwardPlan(**{n: _backward_gemm(spec, arch, n, bm) for n in BACKWARD_GEMMS})


# ---- candidates ----------------------------------------------------------------------------------------------
def _gemm_problem(spec: Spec, arch: Arch, which: int, bn: Any) -> str | None:
    """Why tile N `bn` cannot be used for GEMM `which`, or None."""
    if isinstance(bn, bool) or not isinstance(bn, int) or bn not in BN_CHOICES:
        return f"tile N must be one of {', '.join(map(str, BN_CHOICES))}, got {bn!r}"
    if which == 1 and spec.ffn % (bn // 2):
        return (f"a GEMM1 tile of {bn} columns holds {bn // 2} gate + {bn // 2} up outputs, "
                f"but ffn {spec.ffn} % {bn // 2} = {spec.ffn % (bn // 2)}")
    if _stages_fit(arch, bn) < MIN_STAGES:
        return f"{MIN_STAGES} stages of {_stage_bytes(bn)} B do not fit {arch.smem_per_cta} B of shared memory"
    if _acc_regs(bn) + REG_OVERHEAD > _consumer_regs(arch):
        return (f"{_acc_regs(bn)} accumulator registers + {REG_OVERHEAD} exceed "
                f"{_consumer_regs(arch)} per consumer thread")
    return None


def _small_groups(spec: Spec) -> bool:
    """Do the routed groups average fewer than GATHER_MIN_GROUP_ROWS rows?"""
    return spec.routed_rows < GATHER_MIN_GROUP_ROWS * spec.local_experts


def _gemm1_a_load(spec: Spec) -> str:
    """GEMM 1's A path: the fused cp.async gather unless the routed groups are small (see GATHER_MIN_GROUP_ROWS)."""
    return "tma" if _small_groups(spec) else GEMM1_A_LOAD


def _group_w_bytes(spec: Spec, which: int) -> int:
    """Bytes of one group's weights for GEMM `which`."""
    n, k = _gemm_shape(spec, which)
    return n * k * ELEM_BYTES


def _tall_raster(spec: Spec, arch: Arch, which: int) -> bool:
    """Does GEMM `which` take TALL_RASTER panels? (see there)"""
    return not _small_groups(spec) and _group_w_bytes(spec, which) > arch.l2_bytes // 4


def _small_groups_panel(spec: Spec, arch: Arch, which: int) -> bool:
    """Does GEMM `which` take SMALL_GROUPS_GEMM1_RASTER panels? (GEMM 1 on sm_90a, where it was measured, of a
    spec whose routed groups are small but average at least SMALL_GROUPS_PANEL_MIN_ROWS rows)"""
    return (which == 1 and arch.name == "sm_90a" and _small_groups(spec)
            and spec.routed_rows >= SMALL_GROUPS_PANEL_MIN_ROWS * spec.local_experts)


def _panel_rule(spec: Spec, arch: Arch, which: int, k: int, bn: int) -> int:
    """GEMM `which`'s raster panel (M tiles): tall where one group's W overflows L2/4 (TALL_RASTER) or GEMM 1's
    groups are small (SMALL_GROUPS_GEMM1_RASTER), else the L2 fit (_raster_group)."""
    if _tall_raster(spec, arch, which):
        return TALL_RASTER[which]
    if _small_groups_panel(spec, arch, which):
        return SMALL_GROUPS_GEMM1_RASTER
    return _raster_group(arch, k, bn)


def _gemm_plan(spec: Spec, arch: Arch, which: int, bn: int) -> GemmPlan:
    n, k = _gemm_shape(spec, which)
    return GemmPlan(
        bm=BM, bn=bn, bk=BK,
        stages=min(MAX_STAGES, _stages_fit(arch, bn)),
        consumer_wgs=CONSUMER_WGS, epi_m=EPI_M, epi_n=EPI_N,
        raster_group=_panel_rule(spec, arch, which, k, bn),
        a_load=_gemm1_a_load(spec) if which == 1 else "tma",
        n_tiles=-(-n // bn), k_tiles=k // BK,
    )


# The FP8 forward GEMMs' mainloop efficiency against the arch's dense FP8 rate (Arch.peak_fp8_tflops), per GEMM and
# promotion ("wide": 128 x 256 tiles in two wgmma halves, serial), fitted to the H200's FP8 forward records
# (mokgen.costmodel.fit_fp8: ce02f25 kernels, 19 records of 6 shapes; tests/test_costmodel_fp8.py checks that
# these constants are the fit of the committed records). Replaces the BF16 model for FP8 plans.
# With it two fitted terms: FP8_WEIGHT_COEF x the e4m3 weights' bytes over HBM (the weight stream's cost beside the
# compute: gpt-oss-120b's 3.2 GB per layer) and FP8_TILE_MS per (group x N tile) start-up. Fitted relative rms
# error 1.9% (the BF16 model's constants on the same records: 8.4%). "stagger" has no record: serial's value;
# GEMM 1's wide form (the default since bench/NOTES.md v26) has no H200 record either: it takes the overlap
# form's value, the form it replaced, as a floor (on the H100, same process, its forward ran 4-10% faster; the
# serial value it had before predicted it slower, and tune's model kept fewer wide candidates for that).
FP8_MAINLOOP_EFF = {(1, "overlap"): 0.850, (1, "serial"): 0.794, (1, "stagger"): 0.794, (1, "wide"): 0.850,
                    (2, "overlap"): 0.809, (2, "serial"): 0.772, (2, "stagger"): 0.772, (2, "wide"): 0.727}
FP8_WEIGHT_COEF = 0.238
FP8_TILE_MS = 0.0099e-3


def fp8_eff_key(which: int, g: GemmPlan) -> tuple[int, str]:
    """The FP8_MAINLOOP_EFF key of FP8 forward GEMM `which` (1, 2)."""
    return which, "wide" if g.mma_split == 2 else g.promote


def _gemm_cost(spec: Spec, arch: Arch, which: int, g: GemmPlan) -> _GemmCost:
    n, k = _gemm_shape(spec, which)
    m_tiles = _m_tiles(spec, g.bm)
    padded = m_tiles * g.bm
    tiles = m_tiles * (g.bm // g.tile_m) * g.n_tiles
    row_eff = spec.rows / padded
    n_eff = n / (g.n_tiles * g.bn)
    wave_eff = tiles / (-(-tiles // arch.sms) * arch.sms)
    fp8 = g.elem_bytes == 1 and arch.peak_fp8_tflops > 0
    if fp8:
        mainloop_eff = FP8_MAINLOOP_EFF[fp8_eff_key(which, g)]
    else:
        mainloop_eff = MAINLOOP_EFF[g.bn] * (PINGPONG_EFF[which] if g.consumer == "pingpong" else 1.0)
    flops = 2 * spec.rows * n * k
    a_rows = spec.rows if which == 1 else padded  # GEMM1 gathers only real rows; GEMM2 reads all of h
    out_cols = spec.ffn if which == 1 else spec.hidden
    bias_bytes = 4 * spec.groups * n if spec.bias else 0
    nbytes = g.elem_bytes * (spec.groups * n * k + a_rows * k) + ELEM_BYTES * padded * out_cols + bias_bytes
    peak = arch.peak_fp8_tflops if fp8 else arch.peak_bf16_tflops
    compute_ms = flops / (peak * 1e9 * row_eff * n_eff * wave_eff * mainloop_eff)
    if fp8:   # the fitted FP8 model's other terms (FP8_WEIGHT_COEF, FP8_TILE_MS)
        compute_ms += (FP8_WEIGHT_COEF * spec.groups * n * k * g.elem_bytes / (arch.hbm_tbps * 1e9)
                       + FP8_TILE_MS * spec.groups * g.n_tiles)
    memory_ms = nbytes / (arch.hbm_tbps * 1e9)
    return _GemmCost(flops, nbytes, tiles, row_eff, n_eff, wave_eff, mainloop_eff, compute_ms, memory_ms)


def _glue_bytes(spec: Spec, g1: GemmPlan) -> int:
    """Routing (indices/weights in; row_src, row_w, slot_pos out), the row gather when GEMM1 loads A by TMA
    (rows of x in, xg out) and combine (ys rows in, y out)."""
    slots = spec.tokens * (spec.topk + spec.shared_experts)
    routing = 8 * spec.routed_rows + 8 * _m_tiles(spec, g1.bm) * g1.bm + 4 * slots
    gather = 2 * ELEM_BYTES * spec.rows * spec.hidden if g1.a_load == "tma" else 0
    if g1.elem_bytes == 1:   # FP8: x's rows gathered and quantized (quant_rows_gather), h's quantized (quant_rows_used)
        padded = _m_tiles(spec, g1.bm) * g1.bm
        gather = (spec.rows * spec.hidden * (ELEM_BYTES + 1 + 4 / 128)
                  + padded * spec.ffn * (ELEM_BYTES + 1 + 4 / 128))
    combine = 4 * slots + ELEM_BYTES * spec.rows * spec.hidden + ELEM_BYTES * spec.tokens * spec.hidden
    return routing + gather + combine


def _costs(spec: Spec, arch: Arch, g1: GemmPlan, g2: GemmPlan) -> tuple[_GemmCost, _GemmCost, float]:
    """(GEMM1 cost, GEMM2 cost, routing + combine ms)."""
    return _gemm_cost(spec, arch, 1, g1), _gemm_cost(spec, arch, 2, g2), _glue_bytes(spec, g1) / (arch.hbm_tbps * 1e9)


def _rank_key(spec: Spec, arch: Arch, plan: Plan) -> tuple:
    """Predicted time; ties (memory-bound GEMMs) go to cooperative tiles (ping-pong reads W twice as often from
    L2: on gpt-oss-120b it measured 3% slower although it computes fewer padding rows), then to the faster
    mainloop, then to wider tiles."""
    c1, c2, _ = _costs(spec, arch, plan.gemm1, plan.gemm2)
    return (plan.predicted_ms, plan.gemm1.consumer != "cooperative", c1.compute_ms + c2.compute_ms,
            -plan.gemm1.bn, -plan.gemm2.bn)


def _make_plan(spec: Spec, arch: Arch, g1: GemmPlan, g2: GemmPlan, notes: tuple[str, ...] = (),
               schedule: str = "chain") -> Plan:
    c1, c2, glue_ms = _costs(spec, arch, g1, g2)
    ms = c1.ms + c2.ms + glue_ms
    bm = g1.bm
    cap = cap_rows(spec, bm, spec.tokens)
    return Plan(
        spec=spec, arch=arch.name, gemm1=g1, gemm2=g2, bm=bm,
        cap_rows=cap, max_m_tiles=cap // bm,
        chunk_rows=max(_chunk_rows(arch, g1.n_tiles, bm), _chunk_rows(arch, g2.n_tiles, bm)),
        waves1=round(c1.tiles / arch.sms, 3), waves2=round(c2.tiles / arch.sms, 3),
        predicted_ms=float(f"{ms:.6g}"), predicted_tflops=round(spec.flops_forward / ms / 1e9, 1),
        notes=_auto_notes(spec, arch, g2, c1, c2) + notes, schedule=schedule,
        backward=backward_plan(spec, arch, bm),
    )


def _with_prediction(spec: Spec, arch: Arch, plan: Plan) -> Plan:
    """`plan` with its predicted time and waves recomputed from its GEMMs as they are now (the FP8 form replaces
    the GEMMs of a solved BF16 plan)."""
    c1, c2, glue_ms = _costs(spec, arch, plan.gemm1, plan.gemm2)
    ms = c1.ms + c2.ms + glue_ms
    return dataclasses.replace(plan, waves1=round(c1.tiles / arch.sms, 3), waves2=round(c2.tiles / arch.sms, 3),
                               predicted_ms=float(f"{ms:.6g}"),
                               predicted_tflops=round(spec.flops_forward / ms / 1e9, 1))


def _auto_notes(spec: Spec, arch: Arch, g2: GemmPlan, c1: _GemmCost, c2: _GemmCost) -> tuple[str, ...]:
    notes = []
    if not arch.has_wgmma:
        notes.append(f"{arch.name}: tiles and cost from the sm_90a rules and model (nothing measured on {arch.name})")
    if spec.hidden % g2.bn:
        notes.append(
            f"GEMM2 bn {g2.bn} leaves a partial N tile: hidden {spec.hidden} % {g2.bn} = {spec.hidden % g2.bn}")
    ridge = arch.peak_bf16_tflops / arch.hbm_tbps
    for name, c in (("GEMM1", c1), ("GEMM2", c2)):
        if c.bound == "memory":
            notes.append(f"{name} is memory bound at T={spec.tokens}: "
                         f"{c.flops / c.bytes:.0f} flop/B < ridge {ridge:.0f} flop/B")
    return tuple(notes)


def candidates(spec: Spec, arch: str = "sm_90a") -> list[Plan]:
    """Every valid (GEMM1 bn, GEMM2 bn) plan, best first (FP8 specs: the FP8 forms of the cooperative BF16
    candidates, distinct ones only, in the BF16 ranking), each GEMM's output path settled as :func:`solve` does."""
    _mxfp8_arch(spec, arch)
    if (own := _own_rules(arch)) is not None:   # e.g. sm_100a: one form (its rules) until it has its own ranking
        return [own.solve(spec, arch, {}, _shared_solver())]
    return [_settle_z_store(_fp8_wgrad_default(spec, arch, _settle_epi_store(_fp8_a_load_default(spec, p), {})), None)
            for p in _candidates_any(spec, arch)]


def _fp8_a_load_default(spec: Spec, plan: Plan) -> Plan:
    """FP8 candidate `plan` with GEMM 1's default A path (fp8_default_a_load), as solve gives it."""
    if spec.dtype != "fp8" or fp8_default_a_load(spec, plan.gemm1) != "gather":
        return plan
    a = _fp8_arch(plan.arch)
    return _with_forward_gemms(spec, a, plan, _fp8_gather_gemm1(a, plan.gemm1), plan.gemm2)


def _fp8_wgrad_default(spec: Spec, arch: str, plan: Plan) -> Plan:
    """`plan` with the FP8 weight gradients an FP8 training plan gets by default (FP8_WGRAD_DEFAULT), as solve."""
    if spec.dtype != "fp8" or plan.backward is None:
        return plan
    plan = _wgrad_dtypes(spec, arch, plan, dict.fromkeys(WGRAD_DTYPE_KEYS, FP8_WGRAD_DEFAULT), WGRAD_DTYPE_KEYS)
    return _widen_fp8_wgrads(spec, arch, plan, ("wgrad1", "wgrad2"))


def _widen_fp8_wgrads(spec: Spec, arch: str, plan: Plan, names: Iterable[str]) -> Plan:
    """`plan` (with its backward kernels) with FP8 weight gradients `names` on fp8_wgrad_wide's 128 x 256 tile."""
    return dataclasses.replace(plan, backward=dataclasses.replace(plan.backward, **{
        n: fp8_wgrad_wide(spec, _fp8_arch(arch), n, getattr(plan.backward, n)) for n in names}))


def _candidates_any(spec: Spec, arch: str = "sm_90a", fp8_wide: tuple[str, ...] | None = None) -> list[Plan]:
    if spec.dtype == "fp8":
        a = _fp8_arch(arch)
        out, seen = [], set()
        for p in _candidates(spec, arch):
            if p.gemm1.consumer == p.gemm2.consumer == "cooperative":
                q = fp8_plan(spec, a, p, wide=fp8_wide)
                if (key := q.canonical_json()) not in seen:
                    seen.add(key)
                    out.append(q)
        return out
    return _candidates(spec, arch)


def _candidates(spec: Spec, arch: str = "sm_90a") -> list[Plan]:
    a = get_arch(arch)
    g1s = [_gemm_plan(spec, a, 1, bn) for bn in BN_CHOICES if _gemm_problem(spec, a, 1, bn) is None]
    g2s = [_gemm_plan(spec, a, 2, bn) for bn in BN_CHOICES if _gemm_problem(spec, a, 2, bn) is None]
    plans = [_make_plan(spec, a, g1, g2) for g1 in g1s for g2 in g2s]  # bn 64 always fits: never empty
    # Both GEMMs ping-pong (64-row routing tile), where the best cooperative plan is compute bound in both GEMMs:
    # there padding rows cost flops.
    # Memory-bound GEMMs gain nothing from fewer padding rows and lose W-tile bandwidth (gpt-oss-120b measured
    # 3% slower). Mixed plans are reachable through the gemm*_consumer overrides.
    plans.sort(key=lambda p: _rank_key(spec, a, p))
    best = plans[0]
    if _gemm_cost(spec, a, 1, best.gemm1).bound == _gemm_cost(spec, a, 2, best.gemm2).bound == "compute":
        plans += [_make_plan(spec, a, *_routing_tile(_with_consumer(a, g1, "pingpong"), _with_consumer(a, g2, "pingpong")))
                  for g1 in g1s for g2 in g2s]
    return sorted(plans, key=lambda p: _rank_key(spec, a, p))


def _with_consumer(arch: Arch, g: GemmPlan, consumer: str) -> GemmPlan:
    """`g` with `consumer` tiles and as many stages as then fit (a z path through the ring falls back where the
    new tiles cannot take it: _with_z_load)."""
    g = dataclasses.replace(g, consumer=consumer, stages=min(MAX_STAGES, _stages_fit(arch, g.bn, consumer)))
    return _with_z_load(g) if g.z_load == "tma" else g


def _epi_buffers_text(g: GemmPlan) -> str:
    """--explain's words for GEMM `g`'s epilogue buffers (none with the ring epilogue)."""
    if g.epi_store == "ring":
        return "no epilogue buffers (the output goes through the stage ring, TMA-stored by the storer warp)"
    return f"epilogue {g.tile_m}x{g.epi_n} x{g.epi_stages} buffers"


def z_stage_problem(g: GemmPlan) -> str | None:
    """Why dgrad1 plan `g` cannot take its z through the stage ring (z_load "tma"), or None. A z stage is one
    (128, ZQ) bf16 box of gate and one of up (or two of interleaved pairs) in the shared memory of one W stage,
    exactly: ZQ = bn * bk * elem_bytes / 512 must be 32 or 64 columns (a 64- or 128-byte swizzle row) and divide
    bn. The producer loads the tile's bn / ZQ z stages right after its K stages; the consumers write dz over z
    and TMA-store it. Cooperative 128-row tiles without clusters only (the ping-pong ring skips the other
    warpgroup's stages by a fixed count)."""
    if g.consumer != "cooperative" or g.cluster != 1 or g.tile_m != BM:
        return f"needs cooperative {BM}-row tiles without clusters, got {g.consumer} tiles, cluster {g.cluster}"
    stage = g.bn * g.bk * g.elem_bytes
    zq = stage // (2 * g.tile_m * 2)
    if zq not in (32, 64) or stage != 2 * g.tile_m * zq * 2 or g.bn % zq:
        return f"a W stage of {stage} bytes (bn {g.bn}, bk {g.bk}) holds no z stage of 32 or 64 whole columns"
    return None


def z_ring_problem(g: GemmPlan) -> str | None:
    """Why GEMM 1 plan `g` cannot store a training step's z through the stage ring (z_store "ring"), or None.
    The tile's z (bn / 2 gate and bn / 2 up columns) goes in z stages laid out as dgrad1's (z_stage_problem:
    a (128, ZQ) gate box and an up box per W stage), handed to the consumers after the tile's K stages together
    with its output's epilogue stages and TMA-stored by the same storer warp: so the output must go through the
    ring too (epi_store "ring"). FP8's W stage (e4m3, 128 deep) has the bytes of BF16's (64 deep): same z stages."""
    if g.epi_store != "ring":
        return f"needs the output through the ring too (epi_store ring), got epi_store {g.epi_store}"
    if (why := z_stage_problem(g)) is not None:
        return why
    zq = g.bn * g.bk * g.elem_bytes // (2 * g.tile_m * 2)
    if (g.bn // 2) % zq:
        return f"z stages of {zq} columns do not divide the tile's {g.bn // 2} columns per part"
    return None


def _train_gemm1(plan: Plan, a_load_given: bool) -> GemmPlan | None:
    """The training GEMM 1 with z through the stage ring, or None where it cannot be: A rows by TMA (the
    gather kernel's rows; unless ``gemm1_a_load`` was given, which then holds for training too), the output through
    the ring. Measured on the H200, same process (bench/NOTES.md v17, forward+backward): glm-5 6.84 vs 7.33 ms,
    dbrx-like 63.39 vs 64.84, kimi-k2 8.40 vs 8.45 against the gather-fed GEMM 1 with z stored by the consumers;
    the inference forward stays on the fused gather (with TMA rows it ran 2.60 vs 2.48 ms on glm-5). An FP8 GEMM 1
    that gathers its rows with warps 2-3 beside the ring's storer warp (a_load "gather", epi_store "ring") keeps
    them: z goes through its ring too."""
    g = plan.gemm1
    if g.a_load != "tma" and z_ring_problem(g) is not None:
        if a_load_given:
            return None
        g = _with_epi_store(dataclasses.replace(g, a_load="tma"), parts=2)
    if z_ring_problem(g) is not None:
        return None
    return dataclasses.replace(g, z_store="ring")


def _settle_z_store(plan: Plan, mode: Any, a_load_given: bool = False) -> Plan:
    """GEMM 1's z path in training (``gemm1_z_store`` override, checked). BF16 and FP8 training plans of the chain
    schedule default to "ring" where :func:`_train_gemm1` finds a tile for it: the training GEMM 1 is then its own
    plan (``backward.gemm1_train``), the inference GEMM 1 unchanged, or, where GEMM 1 reads A by TMA already (FP8:
    quant_rows_gather's rows), one GEMM 1 plan for both (the inference GEMM 1 stores no z). FP8 measured on the
    H200, same process (bench/NOTES.md v19, forward+backward kimi-k2-fp8, two rounds each): 6.17 / 6.35 ms with the
    ring, 6.04 / 6.16 with the overlapped wgrad promotion too, against 7.23 / 6.25 direct and serial. "direct"
    keeps the old path."""
    legal = _SPACE.values("z_store", "gemm1")
    if mode is not None and mode not in legal:
        raise PlanError(f"plan.gemm1_z_store: must be one of {', '.join(legal)}, got {mode!r}")
    split = (plan.backward is not None and plan.schedule == "chain" and plan.spec.dtype in ("bf16", "fp8")
             and mode != "direct")
    if split and (g1t := _train_gemm1(plan, a_load_given)) is not None:
        if g1t == dataclasses.replace(plan.gemm1, z_store="ring"):   # A by TMA (or FP8's ring gather): one plan
            plan = dataclasses.replace(plan, gemm1=g1t)
        else:
            plan = dataclasses.replace(plan, backward=dataclasses.replace(plan.backward, gemm1_train=g1t))
        note = ("overrides: gemm1_z_store=ring" if mode == "ring" else
                "training GEMM 1 (gemm1_train): z through the stage ring" +
                (", A rows by TMA from " + ("quant_rows_gather" if plan.spec.dtype == "fp8" else "the gather kernel")
                 + " (inference keeps the fused gather)" if plan.gemm1.a_load != "tma" else ""))
        return dataclasses.replace(plan, notes=plan.notes + (note,))
    if mode is None:
        return plan
    if mode == "ring" and (why := z_ring_problem(plan.gemm1)) is not None:
        raise PlanError(f"plan.gemm1_z_store: ring {why}")
    return dataclasses.replace(plan, gemm1=dataclasses.replace(plan.gemm1, z_store=mode),
                               notes=plan.notes + (f"overrides: gemm1_z_store={mode}",))


def _with_z_load(g: GemmPlan) -> GemmPlan:
    """dgrad1's default z path: through the stage ring where it fits (measured faster: bench/NOTES.md v12)."""
    return dataclasses.replace(g, z_load="tma" if z_stage_problem(g) is None else "direct")


def _routing_tile(g1: GemmPlan, g2: GemmPlan) -> tuple[GemmPlan, GemmPlan]:
    """Both GEMMs on the routing tile (rows each group is padded to): the larger of their tiles, so 64 rows when
    both are ping-pong, which pads small groups (many experts) less."""
    bm = max(g1.tile_m, g2.tile_m)
    return dataclasses.replace(g1, bm=bm), dataclasses.replace(g2, bm=bm)


def parse_overrides(text: str, what: str = "plan") -> dict[str, Any]:
    """``"k=v,k=v"`` (or ``+``-joined) -> plan overrides for :func:`solve`, integer values converted: the one
    KEY=VALUE parser (the CLI's ``--set``, the benchmark's ``--variants``, the tools' plan names). ``what`` names
    the source in the error message."""
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.replace("+", ",").split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise PlanError(f"{what}: expected KEY=VALUE, got {part!r}")
        out[key.strip()] = int(value) if value.strip().lstrip("-").isdigit() else value.strip()
    return out


EPI_KERNELS = ("gemm1", "gemm2") + BACKWARD_GEMMS   # the GEMMs whose output path is a plan choice (epi_store)


def epi_ring_problem(g: GemmPlan, parts: int = 1) -> tuple[str | None, int]:
    """(why plan `g` cannot store its output through the stage ring, or None; the box width EPI_W). The tile's
    bn / parts bf16 output columns go in (128, EPI_W) boxes that fill W stages exactly (EPI_W 64 or 32: a 128- or
    64-byte swizzle row), handed to the consumers by the producer after the tile's K stages and TMA-stored by warp
    1 of the producer warpgroup, idle where one warp issues every TMA load (a_load "tma"), or where GEMM 1 gathers
    its A rows with warps 2-3 only (a_load "gather": warp 0 loads W; opt-in: _ring_by_default). Cooperative
    128-row tiles without clusters (a cluster's stages are released to both producers)."""
    if g.ctas_per_sm != 1:
        return f"needs one CTA per SM (the producer warpgroup's storer warp; {g.ctas_per_sm} CTAs per SM have one producer warp)", 0
    if (g.consumer != "cooperative" or g.cluster != 1 or g.tile_m != BM
            or g.a_load not in ("tma", "gather")):
        return (f"needs cooperative {BM}-row tiles, no cluster and TMA-loaded or gathered A (got {g.consumer}, "
                f"cluster {g.cluster}, a_load {g.a_load})"), 0
    stage = g.bn * g.bk * g.elem_bytes
    for w in (64, 32):
        if stage % (g.tile_m * w * 2) == 0 and (g.bn // parts) % w == 0:
            return None, w
    return f"a W stage of {stage} bytes holds no whole number of (128, 64 or 32) bf16 boxes of its tile", 0


def _ring_by_default(g: GemmPlan) -> bool:
    """Whether the stage ring is GEMM `g`'s default output path where its tile allows it: with TMA-loaded A
    (measured faster: bench/NOTES.md v12); a gathering GEMM 1 keeps its four gathering warps and the epilogue buffers
    unless ``gemm1_epi_store=ring`` asks for the two-warp form (FP8: slower on glm-5 and kimi-k2, NOTES v31)."""
    return g.a_load == "tma"


def _with_epi_store(g: GemmPlan, parts: int = 1, chain: bool = True) -> GemmPlan:
    """The default output path: "ring" where the tile allows it and :func:`_ring_by_default` holds, and the GEMM
    is its own launch (`chain`: not inside the fused forward kernel), else "smem"."""
    ring = chain and _ring_by_default(g) and epi_ring_problem(g, parts)[0] is None
    return dataclasses.replace(g, epi_store="ring" if ring else "smem")


def _settle_epi_store(plan: Plan, overrides: Mapping[str, Any], given: Iterable[str] = ()) -> Plan:
    """Every GEMM's output path: ``<kernel>_epi_store`` / ``epi_store`` overrides where given (checked), else the
    default (:func:`_with_epi_store`; the backward GEMMs are their own launches whatever the forward schedule),
    re-derived here because overrides of other knobs (consumer, tile N, cluster) change what the tile allows.
    A ring asked for on a wgrad whose default is the whole-tile buffers (:func:`_wgrad_smem_rows`) gets the
    ring's own staging (epi_n, epi_stages) and stages, as on the shapes whose default is the ring, except those
    of them named in `given` (the other overrides of the solve)."""
    given = set(given)
    legal = _SPACE.values("epi_store", "gemm2")
    gemms = {"gemm1": plan.gemm1, "gemm2": plan.gemm2}
    if plan.backward is not None:
        gemms.update({n: getattr(plan.backward, n) for n in BACKWARD_GEMMS})
    for name, g in gemms.items():
        parts, forward = (2 if name == "gemm1" else 1), name in ("gemm1", "gemm2")
        why, _ = epi_ring_problem(g, parts)
        key = next((k for k in (f"{name}_epi_store", "epi_store") if k in overrides), None)
        if key is None:
            if name.startswith("wgrad") and _wgrad_smem_rows(plan.spec, get_arch(plan.arch), g):
                # the backward plan's default (_wgrad_output); its buffers and stages as they stand (overrides kept)
                gemms[name] = dataclasses.replace(g, epi_store="smem")
            else:
                gemms[name] = _with_epi_store(g, parts, chain=plan.schedule == "chain" or not forward)
            continue
        mode = overrides[key]
        if mode not in legal:
            raise PlanError(f"plan.{key}: must be one of {', '.join(legal)}, got {mode!r}")
        if mode == "ring" and forward and plan.schedule != "chain":
            raise PlanError(f"plan.{key}: ring needs the chain schedule (the fused kernel has its own epilogue)")
        if mode == "ring" and why is not None:
            if key != "epi_store":   # the shared key asks for it where it fits
                raise PlanError(f"plan.{key}: ring {why}")
            mode = "smem"
        if mode == "ring" and name.startswith("wgrad") and _wgrad_smem_rows(plan.spec, get_arch(plan.arch), g):
            own = _backward_gemm(plan.spec, get_arch(plan.arch), name, plan.bm, g.bn, ring=True)
            g = dataclasses.replace(g, **{f: getattr(own, f) for f in ("epi_n", "epi_stages", "stages")
                                          if f"{name}_{f}" not in given})
        gemms[name] = dataclasses.replace(g, epi_store=mode)   # its stages against the path: _fit_epilogue
    for name, g in gemms.items():
        gemms[name] = _fit_epilogue(get_arch(plan.arch), name, g, given)
    backward = plan.backward and dataclasses.replace(plan.backward, **{n: gemms[n] for n in BACKWARD_GEMMS})
    return dataclasses.replace(plan, gemm1=gemms["gemm1"], gemm2=gemms["gemm2"], backward=backward)


def _ring_stages(arch: Arch, g: GemmPlan) -> GemmPlan:
    """Ring-epilogue GEMM `g` with the most stages that fit (no epilogue buffers beside them), never fewer than it
    has; a staggered FP8 promotion keeps as many stages as the tile has K blocks at most (stagger_problem)."""
    most = min(MAX_STAGES, _stages_most(arch, g))
    if g.promote == "stagger" and g.k_tiles:
        most = min(most, g.k_tiles)
    return dataclasses.replace(g, stages=max(g.stages, most))


def _fit_epilogue(arch: Arch, name: str, g: GemmPlan, given: set[str]) -> GemmPlan:
    """GEMM `name`'s stages against its output path, once that is settled: a ring epilogue has no epilogue buffers,
    so their bytes hold more stages (the most that fit, unless `given` names its stages); a GEMM whose stages were
    fitted to the ring and that stores through the buffers after all (two CTAs per SM, a cluster: epi_ring_problem)
    gets them back: the default buffers where its own are not asked for and no longer leave MIN_STAGES, then the
    stages that fit (a stage count asked for that does not fit is an error, on either path)."""
    ring = g.epi_store == "ring"
    if ring and f"{name}_stages" not in given:
        return _ring_stages(arch, g)
    if g.smem_bytes() <= smem_budget(arch, g):
        return g
    own_epi = {f"{name}_epi_n", f"{name}_epi_stages", "epi_n", "epi_stages"} & given
    if not ring and _stages_most(arch, g) < MIN_STAGES and not own_epi:
        g = dataclasses.replace(g, epi_n=EPI_N, epi_stages=EPI_BUFFERS)
    most = _stages_most(arch, g)
    if (f"{name}_stages" in given and g.stages > most) or most < MIN_STAGES:
        beside = "the stage ring's output" if ring else f"its epilogue buffers ({g.epi_stages} x {g.epi_n} columns)"
        raise PlanError(f"plan.{name}_stages: {g.stages} stages of {name}'s {g.tile_m} x {g.bn} tile and {beside} "
                        f"do not fit {smem_budget(arch, g)} B of shared memory (at most {most})")
    return dataclasses.replace(g, stages=min(g.stages, most))


def solve(spec: Spec, arch: str = "sm_90a", **overrides: Any) -> Plan:
    """The best plan for `spec` on `arch` (FP8 specs: see :func:`fp8_plan`); every GEMM's output path last
    (:func:`_settle_epi_store`)."""
    epi = {k: v for k, v in overrides.items() if k == "epi_store" or k.endswith("_epi_store")}
    for k in epi:
        if k != "epi_store" and k.removesuffix("_epi_store") not in EPI_KERNELS:
            raise PlanError(f"plan.{k}: unknown override; allowed: {', '.join(OVERRIDES)}")
    _mxfp8_arch(spec, arch)
    if (own := _own_rules(arch)) is not None:   # e.g. sm_100a: its kernels' form
        return own.solve(spec, arch, overrides, _shared_solver())
    streams = overrides.get("bwd_streams")
    rest = {k: v for k, v in overrides.items()
            if k not in epi and k not in ("bwd_streams", "bwd_x_cols", "gemm1_z_store", "pdl")}
    plan = _settle_epi_store(_solve_dtype(spec, arch, **rest), epi, given=rest)
    plan = _settle_z_store(plan, overrides.get("gemm1_z_store"), "gemm1_a_load" in overrides)
    plan = _settle_x_cols(_settle_streams(plan, streams), overrides.get("bwd_x_cols"))
    return _settle_pdl(plan, overrides.get("pdl"))


# ---- the archs with plan rules of their own --------------------------------------------------------------------
# An arch whose kernels are not sm_90a's has its rules in its package's plan.py (sm_100a: mokgen/sm100/plan.py), a
# module with solve(spec, arch, overrides, shared) -> Plan (`shared`: this module's solver, SharedSolver) and the
# explain parts that differ: explain_gemm, explain_tile, explain_clusters, explain_backward_gemm, explain_budgets.
# The other archs are this module's (sm_90a's rules). Adding an arch: its package, and its row here.
ARCH_RULES = {_sm100_plan.ARCH: _sm100_plan}


def _own_rules(arch: str) -> Any:
    """The plan rules of `arch` where it has its own (ARCH_RULES), else None; an unknown arch is a PlanError."""
    get_arch(arch)
    return ARCH_RULES.get(arch)


def _shared_solver() -> SharedSolver:
    """This module's solver as an arch's own rules use it: the sm_90a rules and cost model, and :func:`_replan`."""
    return SharedSolver(solve=_solve, replan=_replan)


def _replan(plan: Plan, g1: GemmPlan, g2: GemmPlan) -> Plan:
    """`plan` rebuilt around forward GEMMs `g1`, `g2` (cost, capacity, chunk and backward tiles for their routing
    tile); the notes of its own (not the cost model's) kept after the new plan's."""
    spec, a = plan.spec, get_arch(plan.arch)
    c1, c2, _ = _costs(spec, a, plan.gemm1, plan.gemm2)
    own = tuple(n for n in plan.notes if n not in _auto_notes(spec, a, plan.gemm2, c1, c2))
    new = _make_plan(spec, a, g1, g2)
    return dataclasses.replace(new, notes=new.notes + own)


def _mxfp8_arch(spec: Spec, arch: str) -> None:
    """dtype mxfp8 is planned only where the GEMMs are tcgen05's (sm_100a)."""
    if spec.dtype == "mxfp8" and not get_arch(arch).has_tcgen05:
        raise PlanError(f"plan.arch: dtype mxfp8 (Blackwell's block-scaled MMA) is planned for sm_100a, got "
                        f"{arch!r}; Hopper's FP8 is dtype fp8")


WGRAD_PROMOTE_KEYS = ("wgrad1_promote", "wgrad2_promote")
# the promotions of the 128 x 256 FP8 weight gradient: its halves in turn, the two warpgroups either together
# ("serial") or one half apart ("stagger": warpgroup 1 starts a tile once warpgroup 0's first half has retired,
# so one's wgmma runs while the other promotes; tiles of at least STAGES K blocks). The same products in the same
# order: the same bits (GPU test_wgrad_split_stagger_same_bits). "stagger" is the default: measured on an H100
# (bench/NOTES.md v27), sustained timelines with the forms interleaved, each wgrad over dgrad2 of the same item
# (the unchanged kernel, against the run-order drift): wgrad1 1.248 / 1.314 vs 1.322 (kimi-k2-fp8), 1.318 vs
# 1.401 (glm-5-fp8); wgrad2 0.641 / 0.673 vs 0.691, 0.663 vs 0.674; bench_backward 5 rounds interleaved,
# forward+backward kimi-k2-fp8 5.828 vs 5.985 ms (lower in 5 of 5 rounds), glm-5-fp8 5.074 vs 5.126,
# qwen3.5-397b-a17b-fp8 2.549 vs 2.603 (mixed rounds: within noise). One of FP8_SPLIT_PROMOTES.
FP8_WGRAD_SPLIT_PROMOTE = "stagger"


# An FP8 training plan's weight gradients: FP8 unless overridden (``wgrad*_dtype=bf16``). Measured on the H200,
# same process, with the rebuilt column quantizers (bench/NOTES.md v17): forward+backward kimi-k2-fp8 6.37 vs 6.69
# ms, glm-5-fp8 5.53 vs 5.69, qwen3-30b-a3b-fp8 2.17 vs 2.19; the 300-step training check 0.12% from BF16's loss.
FP8_WGRAD_DEFAULT = "fp8"
# ... the promotion of their 128 x 128 tile: "overlap" (the next K block's wgmma queued before this block's promotion, two per-block
# accumulators; the same products in the same order as "serial", so the same bits). Measured on the H200, same
# process (bench/NOTES.md v19, forward+backward kimi-k2-fp8, two rounds each): 6.17 / 6.50 ms alone, 6.04 / 6.16
# with GEMM 1's z ring, against 7.23 / 6.25 serial with z direct (a ~2-3% gain for the pair, not for overlap
# alone). ``wgrad*_promote`` overrides it.
FP8_WGRAD_PROMOTE = "overlap"
# ... and their tile: 128 x 256 (fp8_wgrad_wide: its two column halves promoted in turn, FP8_WGRAD_SPLIT_PROMOTE)
# wherever no ``wgrad*_bn`` and no promotion of the 128 x 128 tile alone (overlap) is asked for. Measured on the
# H100, same process, 3 rounds (bench/NOTES.md v23), forward+backward against the 128 x 128 overlapped form:
# kimi-k2-fp8 6.441 vs 6.463 ms, glm-5-fp8 5.347 vs 5.502, deepseek-v4-pro-fp8 7.000 vs 7.183,
# qwen3.5-397b-a17b-fp8 2.513 vs 2.539, gpt-oss-120b-fp8 8.367 vs 8.398, qwen3-30b-a3b-fp8 2.243 vs 2.244: never
# slower, 0-2.9% faster (both serial then). The 128 x 128 forms stay reachable (``wgrad*_bn=128``, with any
# promotion; ``wgrad*_promote=overlap`` alone) and tune --train searches them.


def wgrad_default_applies(spec: Spec, name: str, overrides: Mapping[str, Any]) -> bool:
    """Does weight gradient `name` of an FP8 spec take FP8_WGRAD_DEFAULT under `overrides`? Where neither its dtype
    nor a BF16 tile N (``wgrad*_bn`` other than FP8's) is asked for."""
    return (spec.dtype == "fp8" and f"{name}_dtype" not in overrides
            and overrides.get(f"{name}_bn", FP8_BN) == FP8_BN)


def _solve_dtype(spec: Spec, arch: str = "sm_90a", **overrides: Any) -> Plan:
    defaults = {f"{n}_dtype" for n in ("wgrad1", "wgrad2") if wgrad_default_applies(spec, n, overrides)}
    wgrad_dtypes = {k: overrides.pop(k) for k in WGRAD_DTYPE_KEYS if k in overrides}
    wgrad_dtypes.update({k: FP8_WGRAD_DEFAULT for k in defaults})
    wgrad_promotes = {k: overrides.pop(k) for k in WGRAD_PROMOTE_KEYS if k in overrides}
    # an FP8 weight gradient's tile: fp8_wgrad_wide's 128 x 256 (the default: see FP8_WGRAD_PROMOTE), or
    # fp8_wgrad's 128 x 128 where ``wgrad*_bn=128`` or the overlapped promotion (a form of the 128 x 128 tile only)
    # is asked for; its stages apply to that tile
    fp8_stages, fp8_wide = {}, []
    for key, value in wgrad_dtypes.items():
        name = key.removesuffix("_dtype")
        if value != "fp8":
            continue
        if f"{name}_bn" in overrides:
            bn = _int_override(f"{name}_bn", overrides[f"{name}_bn"])
            if bn not in FP8_BNS:
                raise PlanError(f"plan.{name}_bn: FP8 weight gradients run 128 x 128 or 128 x 256 tiles ({key}=fp8), "
                                f"got {bn}")
            if bn == 2 * FP8_BN:
                fp8_wide.append(name)
                overrides.pop(f"{name}_bn")
        elif wgrad_promotes.get(f"{name}_promote", "serial") in FP8_SPLIT_PROMOTES:   # the default tile
            fp8_wide.append(name)
        if f"{name}_stages" in overrides:
            fp8_stages[name] = overrides.pop(f"{name}_stages")
    plan = _solve_dtype_gemms(spec, arch, **overrides)
    if plan.backward is None:   # no training kernels: nothing to default
        wgrad_dtypes = {k: v for k, v in wgrad_dtypes.items() if k not in defaults}
        fp8_stages = {k: v for k, v in fp8_stages.items() if f"{k}_dtype" not in defaults}
        fp8_wide = [n for n in fp8_wide if f"{n}_dtype" not in defaults]
    plan = _wgrad_dtypes(spec, arch, plan, wgrad_dtypes, defaults)   # an asked-for FP8 one needs the backward
    if fp8_wide:
        plan = _widen_fp8_wgrads(spec, arch, plan, fp8_wide)
    for name, value in fp8_stages.items():
        g = getattr(plan.backward, name)
        stages, most = _int_override(f"{name}_stages", value), _stages_most(get_arch(arch), g)
        if not MIN_STAGES <= stages <= most:
            raise PlanError(f"plan.{name}_stages: must be in [{MIN_STAGES}, {most}] for the FP8 {name} on {arch}, "
                            f"got {stages}")
        plan = dataclasses.replace(plan, backward=dataclasses.replace(
            plan.backward, **{name: dataclasses.replace(g, stages=stages)}))
    for key, value in wgrad_promotes.items():
        name = key.removesuffix("_promote")
        legal = _SPACE.values("promote", name)
        if value not in legal:
            raise PlanError(f"plan.{key}: must be one of {', '.join(legal)}, got {value!r}")
        g = plan.backward and getattr(plan.backward, name)
        if g is None or g.elem_bytes != 1:
            raise PlanError(f"plan.{key}: the promotion applies to FP8 weight gradients ({name}_dtype=fp8)")
        if g.mma_split == 2 and value not in FP8_SPLIT_PROMOTES:
            raise PlanError(f"plan.{key}: the 128 x 256 FP8 {name} promotes its two halves in turn (serial, or "
                            f"stagger: the warpgroups offset by one half), got {value!r}")
        plan = dataclasses.replace(plan, backward=dataclasses.replace(
            plan.backward, **{name: dataclasses.replace(g, promote=value)}))
    for name in ("wgrad1", "wgrad2"):   # an FP8 weight gradient (its dtype settled above) keeps one CTA per SM
        g = plan.backward and getattr(plan.backward, name)
        if g is not None and g.elem_bytes == 1 and g.ctas_per_sm != 1:
            raise PlanError(f"plan.{name}_ctas_per_sm: two CTAs per SM are built for BF16 weight gradients; this "
                            f"{name} is FP8 (its promotion needs more registers than half an SM's: "
                            f"{name}_dtype=bf16 for the BF16 one)")
    return plan


def _wgrad_dtypes(spec: Spec, arch: str, plan: Plan, wgrad_dtypes: Mapping[str, Any],
                  defaults: Iterable[str] = ()) -> Plan:
    for key, value in wgrad_dtypes.items():
        name = key.removesuffix("_dtype")
        if value not in WGRAD_DTYPES:
            raise PlanError(f"plan.{key}: must be one of {', '.join(WGRAD_DTYPES)}, got {value!r}")
        if value == "bf16":   # the derived choice
            continue
        if spec.dtype != "fp8":
            raise PlanError(f"plan.{key}: FP8 weight gradients are a choice of FP8 specs (dtype fp8), this one is "
                            f"{spec.dtype}")
        if plan.backward is None:
            raise PlanError(f"plan.{key}: this plan has no backward kernels")
        if value == "fp8":
            plan = dataclasses.replace(plan, backward=dataclasses.replace(
                plan.backward, **{name: fp8_wgrad(spec, _fp8_arch(arch), name, getattr(plan.backward, name),
                                                  plan.bm)}),
                notes=plan.notes + (() if key in defaults else (f"overrides: {key}=fp8",)))
    if plan.backward is not None and spec.dtype == "fp8":   # the FP8 note says which weight gradients are FP8
        w8 = [n for n in ("wgrad1", "wgrad2") if getattr(plan.backward, n).elem_bytes == 1]
        say = ("FP8 weight-gradient GEMMs (128 x 1 tiles along the rows)" if len(w8) == 2 else
               f"weight gradients: {w8[0]} FP8, the other BF16" if w8 else "BF16 weight-gradient GEMMs")
        plan = dataclasses.replace(plan, notes=tuple(n.replace("BF16 weight-gradient GEMMs", say)
                                                     for n in plan.notes))
    return plan


def fp8_only_keys(overrides: Mapping[str, Any]) -> list[str]:
    """The overrides only an FP8 spec takes: promotion modes, where the scales are read from, h's quantization and
    FP8 weight gradients (a BF16 spec refuses each, below; benches skip such variants for the BF16 twins)."""
    return [k for k, v in overrides.items()
            if k in ("promote", "scale_load", "gemm1_h_quant") or k.endswith(("_promote", "_scale_load"))
            or (k in WGRAD_DTYPE_KEYS and v == "fp8")]


def _solve_dtype_gemms(spec: Spec, arch: str = "sm_90a", **overrides: Any) -> Plan:
    promote_keys = [k for k in overrides if k == "promote" or k.endswith("_promote")]
    scale_keys = [k for k in overrides if k == "scale_load" or k.endswith("_scale_load")]
    if spec.dtype != "fp8":
        if promote_keys:
            raise PlanError(f"plan.{promote_keys[0]}: the promotion mode applies to FP8 specs (dtype fp8), this one "
                            f"is {spec.dtype}")
        if scale_keys:
            raise PlanError(f"plan.{scale_keys[0]}: where the FP8 scales are read from applies to FP8 specs (dtype "
                            f"fp8), this one is {spec.dtype}")
        if "gemm1_h_quant" in overrides:
            raise PlanError(f"plan.gemm1_h_quant: h's FP8 quantization applies to FP8 specs (dtype fp8), this one is "
                            f"{spec.dtype}")
        return _solve(spec, arch, **overrides)
    a = _fp8_arch(arch)
    for key in ("dgrad1_cluster", "dgrad2_cluster"):
        if key in overrides:
            raise PlanError(f"plan.{key}: the FP8 dgrads run cluster 1 (fp8_gemm); the pair multicast is BF16's")
    for key in ("consumer", "gemm1_consumer", "gemm2_consumer", "dgrad1_consumer", "dgrad2_consumer"):
        if overrides.get(key, "cooperative") != "cooperative":   # was taken for the BF16 tile, then not a tile
            raise PlanError(f"plan.{key}: the FP8 GEMMs run cooperative 128-row tiles (two warpgroups per tile: "
                            f"the promotion's second accumulator), got {overrides[key]!r}; pingpong is BF16's")
    a_load = overrides.get("gemm1_a_load")   # GEMM 1's A path (None: fp8_default_a_load; _fp8_gather_gemm1)
    if a_load is not None and a_load not in FP8_A_LOADS:
        raise PlanError(f"plan.gemm1_a_load: the FP8 GEMM 1 reads quant_rows_gather's e4m3 rows by TMA (tma) or "
                        f"gathers the per-token e4m3 rows itself (gather), got {a_load!r}")
    # dgrad1's z chunk applies to the FP8 dgrad1's tile (fp8_gemm's), not to the BF16 tile it replaces
    z_chunk = overrides.get("dgrad1_z_chunk")
    z_load = overrides.get("dgrad1_z_load")
    # tile N of the FP8 GEMMs: fp8_gemm's 128, or 256 for gemm2 / dgrad2 (fp8_widen); not the BF16 tile's
    fp8_bn = {k: overrides[k] for k in FP8_BN_KEYS if k in overrides}
    rest = {k: v for k, v in overrides.items()
            if k not in promote_keys and k not in scale_keys
            and k not in ("dgrad1_z_chunk", "dgrad1_z_load", "gemm1_h_quant", "gemm1_a_load") and k not in fp8_bn
            and k not in FP8_DGRAD_STAGE_KEYS}   # the FP8 dgrads' stages: on their FP8 tiles, below
    # the GEMMs that keep the default 256-column tile: those whose tile no override fixes
    wide = _fp8_wide_kept(overrides)
    if not rest:
        plan = _settle_epi_store(_candidates_any(spec, arch, fp8_wide=wide)[0], {})
    else:   # the FP8 GEMMs run cooperative 128-row tiles: the routing tile (plan.bm) follows
        plan = _solve(spec, arch, **{"consumer": "cooperative", **rest})
        plan = fp8_plan(spec, a, dataclasses.replace(
            plan, notes=tuple(n for n in plan.notes if n != "overrides: consumer=cooperative")), wide=wide)
    if z_chunk is not None and plan.backward is not None:
        d1 = plan.backward.dgrad1
        z = _int_override("dgrad1_z_chunk", z_chunk)
        legal = _SPACE.values("z_chunk", "dgrad1")
        if z not in legal or (d1.bn // 4) % z:
            raise PlanError(f"plan.dgrad1_z_chunk: must be one of {', '.join(map(str, legal))} dividing the "
                            f"{d1.bn // 4} z pairs a thread holds (FP8 dgrad1 bn {d1.bn}), got {z}")
        plan = dataclasses.replace(plan, backward=dataclasses.replace(
            plan.backward, dgrad1=dataclasses.replace(d1, z_chunk=z)))
    if z_load is not None and plan.backward is not None:   # against the FP8 dgrad1's tile too
        plan = dataclasses.replace(plan, backward=dataclasses.replace(
            plan.backward, dgrad1=_z_load_override(plan.backward.dgrad1, z_load)))
    promotes = _SPACE.values("promote", "gemm1")
    g1, g2 = plan.gemm1, plan.gemm2
    for which in (1, 2):   # W-tile multicast to M-tile pairs (the BF16 knob; fp8_gemm starts from cluster 1)
        if (found := _gemm_override(rest, which, "cluster")) is not None:
            c = _int_override(*found)
            if c not in CLUSTERS:
                raise PlanError(f"plan.{found[0]}: must be one of {', '.join(map(str, CLUSTERS))}, got {c}")
            g = dataclasses.replace(g1 if which == 1 else g2, cluster=c)
            g1, g2 = (g, g2) if which == 1 else (g1, g)
    for key, value in fp8_bn.items():
        name = key.removesuffix("_bn")
        which = FP8_GEMM_INDEX[name]
        if name.startswith("dgrad") and plan.backward is None:
            raise PlanError(f"plan.{key}: this plan has no backward kernels")
        g = {1: g1, 2: g2}.get(which) or getattr(plan.backward, name)
        bn = _int_override(key, value)
        if bn == g.bn:
            continue
        if bn not in FP8_BNS:
            raise PlanError(f"plan.{key}: FP8 tiles are {' or '.join(map(str, FP8_BNS))} columns wide, got {bn}")
        if (why := (fp8_tile_shape_problem(spec, which, bn) if bn == FP8_BN   # only dgrad1 plans another width
                    else fp8_wide_problem(spec, which, g))) is not None:
            raise PlanError(f"plan.{key}: {bn} columns {why}")
        g = fp8_widen(a, which, g, spec.ffn if which in (1, 3) else spec.hidden)   # gemm2, dgrad2: H columns
        if which == 1:
            g1 = g
        elif which == 2:
            g2 = g
        else:
            plan = dataclasses.replace(plan, backward=dataclasses.replace(plan.backward, **{name: g}))
    for which in (1, 2):   # where the scales are read from: before the stage overrides (the staged form's smem)
        if (key := next((k for k in (f"gemm{which}_scale_load", "scale_load") if k in overrides), None)):
            g = _scale_load_override(a, g1 if which == 1 else g2, key, overrides[key])
            g1, g2 = (g, g2) if which == 1 else (g1, g)
    if plan.backward is not None:
        for name in ("dgrad1", "dgrad2"):
            if (key := next((k for k in (f"{name}_scale_load", "scale_load") if k in overrides), None)):
                plan = dataclasses.replace(plan, backward=dataclasses.replace(plan.backward, **{
                    name: _scale_load_override(a, getattr(plan.backward, name), key, overrides[key])}))
    elif any(k.startswith("dgrad") for k in scale_keys):
        raise PlanError(f"plan.{next(k for k in scale_keys if k.startswith('dgrad'))}: this plan has no backward "
                        f"kernels")
    gemms = {"gemm1": g1, "gemm2": g2, "dgrad1": plan.backward.dgrad1, "dgrad2": plan.backward.dgrad2} \
        if plan.backward is not None else {"gemm1": g1, "gemm2": g2}
    for name in FP8_GEMM_INDEX:   # stage overrides, within what fits the FP8 tile (fp8_gemm takes the most that fit;
        # the dgrads' on their FP8 tiles, not the BF16 plan's)
        if (key := f"{name}_stages") not in overrides:
            continue
        if name not in gemms:
            raise PlanError(f"plan.{key}: this plan has no backward kernels")
        g, stages = gemms[name], _int_override(key, overrides[key])
        if not MIN_STAGES <= stages <= g.stages:
            raise PlanError(f"plan.{key}: must be in [{MIN_STAGES}, {g.stages}] for the FP8 "
                            f"{_FP8_TITLES.get(name, name)} on {a.name}, got {stages}")
        gemms[name] = dataclasses.replace(g, stages=stages)
    for name in gemms:
        key = next((k for k in (f"{name}_promote", "promote") if k in overrides), None)
        if key is not None:
            if overrides[key] not in promotes:
                raise PlanError(f"plan.{key}: must be one of {', '.join(promotes)}, got {overrides[key]!r}")
            mode = overrides[key]
            if gemms[name].mma_split > 1 and (key == "promote" or mode not in FP8_SPLIT_PROMOTES):
                if key != "promote":
                    raise PlanError(f"plan.{key}: {mode} needs 128-column FP8 tiles (the {gemms[name].bn}-column "
                                    f"tile promotes its halves in turn: serial, or stagger)")
                continue   # the shared key's modes are the 128-column tiles' (a 256-column one asks per GEMM)
            if mode == "stagger" and (why := stagger_problem(gemms[name])) is not None:
                if key != "promote":   # the shared key asks for it where it applies
                    raise PlanError(f"plan.{key}: stagger {why}")
                mode = "serial"
            gemms[name] = dataclasses.replace(gemms[name], promote=mode)
    if (mode := overrides.get("gemm1_h_quant")) is not None:   # after the tile and promotion overrides: it needs
        # the 256-column tile
        legal = _SPACE.values("h_quant", "gemm1")
        if mode not in legal:
            raise PlanError(f"plan.gemm1_h_quant: must be one of {', '.join(legal)}, got {mode!r}")
        g = dataclasses.replace(gemms["gemm1"], h_quant=mode)
        if (why := h_quant_problem(g)) is not None:
            raise PlanError(f"plan.gemm1_h_quant: {mode} {why}")
        gemms["gemm1"] = g
    else:
        gemms["gemm1"] = dataclasses.replace(gemms["gemm1"], h_quant=fp8_default_h_quant(spec, gemms["gemm1"]))
    backward = plan.backward and dataclasses.replace(plan.backward, dgrad1=gemms["dgrad1"], dgrad2=gemms["dgrad2"])
    g1 = gemms["gemm1"]
    if a_load == "gather" and (why := fp8_gather_problem(spec, g1)) is not None:
        raise PlanError(f"plan.gemm1_a_load: gather {why}")
    if (a_load or fp8_default_a_load(spec, g1)) == "gather":
        g1 = _fp8_gather_gemm1(a, g1)
    return _with_forward_gemms(spec, a, dataclasses.replace(plan, backward=backward), g1, gemms["gemm2"])


# How the FP8 GEMM 1 gets its A rows (plan gemm1.a_load): "tma" = quant_rows_gather writes the routed rows of x
# quantized per 1 x 128 into the padded row space and GEMM 1 loads TMA tiles of them; "gather" = x is quantized
# once per token (quant_rows, [T, H]: T rows instead of T (K + S)) and GEMM 1's producer warps gather the e4m3 rows
# with cp.async as the BF16 GEMM 1 does (a stage row is 128 bytes in both), each row's 1 x 128 scales read by
# token: all four warps with the output through epilogue buffers (the default form), or warps 2-3 beside warp 1's
# ring stores (gemm1_epi_store=ring; then the training GEMM 1 gathers too, with z through the ring). The same
# operands and products in the same order: the same bits. The default follows BF16's rule (GATHER_MIN_GROUP_ROWS):
# "gather" where the routed groups average >= 1024 rows (and hidden is a multiple of 128), else "tma"; the
# training GEMM 1 then stays on quant_rows_gather's TMA rows with z through the ring (split off, as BF16's).
# Measured on an H100, inference forward, same process (bench/NOTES.md v31, three calls): qwen3.5-397b-a17b-fp8
# 0.681-0.692 vs 0.703-0.754 ms (lower in every round), glm-5-fp8 1.480-1.495 vs 1.497-1.554, kimi-k2-fp8
# 1.727-1.739 vs 1.736-1.841; qwen3-30b-a3b-fp8 (256-row groups) 3.5% slower, so "tma" there. The ring form: as
# fast on qwen3.5, not on glm-5 / kimi-k2 (two gathering warps); its training step -1.2% on glm-5-fp8, even on
# qwen3.5 (one call each).
FP8_A_LOADS = ("tma", "gather")


def fp8_default_a_load(spec: Spec, g: GemmPlan) -> str:
    """The FP8 GEMM 1's default A path (FP8_A_LOADS): the gather where it can run (fp8_gather_problem) and the
    routed groups are large (BF16's rule, _small_groups), else TMA tiles of quant_rows_gather's rows."""
    return "gather" if fp8_gather_problem(spec, g) is None and not _small_groups(spec) else "tma"


def fp8_gather_problem(spec: Spec, g: GemmPlan) -> str | None:
    """Why FP8 GEMM 1 plan `g` cannot gather the per-token e4m3 rows itself (a_load "gather"), or None."""
    if spec.hidden % FP8_BK:
        return (f"reads whole 128-wide K blocks of each token's row (no zero fill past the row), so hidden must be a "
                f"multiple of {FP8_BK}, got {spec.hidden}")
    if g.cluster != 1:
        return f"runs cluster 1 (the W multicast pairs are the TMA path's), got cluster {g.cluster}"
    if g.stage_scale_bytes:
        return "reads the scales by token from global memory (scale_load global), not staged by a producer warp"
    return None


def _fp8_gather_gemm1(a: Arch, g: GemmPlan) -> GemmPlan:
    """FP8 GEMM 1 plan `g` gathering its A rows (a_load "gather"; z's path is _settle_z_store's), its output path
    re-derived (the epilogue buffers, four gathering warps; the ring only on request: _ring_by_default), as many
    stages as then fit (within a stage override's count)."""
    gg = _with_epi_store(dataclasses.replace(g, a_load="gather", z_store="direct"), parts=2)
    return dataclasses.replace(gg, stages=min(g.stages, _fp8_fill_stages(a, gg).stages))


# Where h's 1 x 128 quantization runs by default (plan gemm1.h_quant): in GEMM 1's epilogue where GEMM 1's K (hidden)
# is at most FP8_H_QUANT_EPILOGUE_MAX_K, else the quant_rows_used launch. The epilogue saves a pass over h (3 bytes
# an element: bf16 in, e4m3 out), a cost that scales with rows x ffn, while what it costs GEMM 1 grew with K in the
# measurement: H100, bench_backward 5 rounds, same process, inference forward ms kernel -> epilogue (bench/NOTES.md
# v37): qwen3-30b-a3b-fp8 (K 2048) 0.618 -> 0.588, qwen3.5-397b-a17b-fp8 (K 4096) 0.757 -> 0.737, glm-5-fp8
# (K 6144) 1.525 -> 1.542, kimi-k2-fp8 (K 7168) 1.786 -> 1.826. `mokgen tune` searches both (FP8_SEARCH_AXES).
FP8_H_QUANT_EPILOGUE_MAX_K = 4096


def fp8_default_h_quant(spec: Spec, g: GemmPlan) -> str:
    """FP8 GEMM 1 plan `g`'s default h_quant: "epilogue" where it applies (h_quant_problem) and hidden is at most
    FP8_H_QUANT_EPILOGUE_MAX_K, else "kernel"."""
    if spec.hidden > FP8_H_QUANT_EPILOGUE_MAX_K:
        return "kernel"
    return "epilogue" if h_quant_problem(dataclasses.replace(g, h_quant="epilogue")) is None else "kernel"


def h_quant_problem(g: GemmPlan) -> str | None:
    """Why FP8 GEMM 1 plan `g` cannot quantize h per 1 x 128 in its epilogue (h_quant "epilogue"), or None: a
    tile must hold whole scale blocks of its rows, which the 256-column tile (its two 128-column parts: 128 h
    columns) does, one block per row (the 128-column tile has 64 h columns, half a block)."""
    if g.h_quant == "kernel":
        return None
    if g.elem_bytes != 1 or g.mma_split != 2 or g.bn != 2 * FP8_BN:
        return (f"needs the FP8 256-column GEMM 1 tile (its 128 h columns are one 1 x 128 scale block per row), got "
                f"bn {g.bn}, mma_split {g.mma_split}")
    return None


def stage_scale_bytes(g: GemmPlan) -> int:
    """Shared memory per stage of FP8 GEMM `g`'s staged scales (scale_load "stage"): the K block's fp32 scales of
    the tile's rows and a 16-byte slot of its W-block scales (one per part or column half)."""
    return (g.tile_m + 4) * 4


def stage_scales_problem(g: GemmPlan) -> str | None:
    """Why forward / dgrad GEMM `g`'s stage_scale_bytes is not the staged-scale form's, or None (0: global loads).
    The form's scale warp copies a tile's rows of the scale tensor, so A must come in TMA tiles of contiguous rows."""
    if g.stage_scale_bytes and (g.elem_bytes != 1 or g.a_load != "tma"
                                or g.stage_scale_bytes != stage_scale_bytes(g)):
        return (f"staged scales (scale_load stage) are an FP8 GEMM's with TMA-loaded A, {stage_scale_bytes(g)} "
                f"bytes a stage")
    return None


def _scale_load_override(a: Arch, g: GemmPlan, key: str, mode: Any) -> GemmPlan:
    """FP8 GEMM `g` with its scales read as override `key` asks ("global" or "stage"), with as many stages as
    then fit (the staged form's scale ring takes shared memory)."""
    legal = _SPACE.values("scale_load", "gemm1")
    if mode not in legal:
        raise PlanError(f"plan.{key}: must be one of {', '.join(legal)}, got {mode!r}")
    g = dataclasses.replace(g, stage_scale_bytes=stage_scale_bytes(g) if mode == "stage" else 0)
    if (why := stage_scales_problem(g)) is not None:
        raise PlanError(f"plan.{key}: {why}, got a_load {g.a_load}")
    return _fp8_fill_stages(a, g)


# the promotions of a 256-column FP8 tile (two wgmma halves promoted in turn, forward, dgrad or weight gradient):
# the two warpgroups together ("serial", the forward / dgrad default) or one half apart ("stagger": opt-in there,
# ``gemm2_bn=256,gemm2_promote=stagger``; the weight gradients' default, FP8_WGRAD_SPLIT_PROMOTE)
FP8_SPLIT_PROMOTES = ("serial", "stagger")


def stagger_problem(g: GemmPlan) -> str | None:
    """Why FP8 GEMM `g` cannot offset its two warpgroups by a K block (promote "stagger"), or None. Warpgroup 1
    waits at each tile's start for warpgroup 0 to have promoted that tile's first block (one named barrier per
    tile); warpgroup 0 may then be at most `stages` ring stages ahead, so a tile needs at least that many K
    blocks, or warpgroup 0 could arrive for the next tile before warpgroup 1 has waited for this one."""
    if g.consumer != "cooperative":
        return f"needs cooperative tiles (two warpgroups per tile), got {g.consumer}"
    if g.k_tiles < g.stages:
        return f"needs at least as many K blocks per tile as stages ({g.k_tiles} < {g.stages})"
    return None


def _fp8_arch(arch: str) -> Arch:
    if arch != "sm_90a":
        raise PlanError(f"plan.arch: dtype fp8 (blockwise e4m3 with promotion, Hopper's recipe) is planned for sm_90a, "
                        f"got {arch!r}; Blackwell's block-scaled format is dtype mxfp8")
    return get_arch(arch)


def fp8_plan(spec: Spec, a: Arch, plan: Plan, wide: tuple[str, ...] | None = None) -> Plan:
    """The FP8 form of a cooperative BF16 plan: the forward GEMMs and the backward's dgrads by :func:`fp8_gemm`
    (the dgrads read the weights' K-major transposed e4m3 copies), GEMM 2 and dgrad2 where `wide` names them in
    256-column tiles (:func:`fp8_widen`, FP8_WIDE_DEFAULT), the wgrads BF16 (``wgrad*_dtype`` overrides: FP8), the
    chain schedule; the predicted time from the FP8 model (FP8_MAINLOOP_EFF and its terms). `wide` None: every
    GEMM of FP8_WIDE_DEFAULT."""
    wide = tuple(n for n, _ in FP8_WIDE_DEFAULT) if wide is None else wide

    def form(which: int, g: GemmPlan) -> GemmPlan:
        g = fp8_gemm(spec, a, which, g)
        name = {w: n for n, w in FP8_WIDE_DEFAULT}.get(which)
        if name not in wide or fp8_wide_problem(spec, which, g) is not None:
            return g
        return fp8_widen(a, which, g, spec.ffn if which in (1, 3) else spec.hidden)

    backward = plan.backward
    if backward is not None:
        backward = dataclasses.replace(backward, dgrad1=fp8_gemm(spec, a, 3, backward.dgrad1),
                                       dgrad2=form(4, backward.dgrad2))
    note = ("fp8: e4m3 forward and dgrad GEMMs, 128-wide K blocks promoted into fp32 (DeepSeek-V3's recipe); BF16 "
            "weight-gradient GEMMs; the forward's predicted time is the FP8 model's (fitted to the FP8 forward "
            "records)")
    g1 = form(1, plan.gemm1)
    return _with_forward_gemms(spec, a, dataclasses.replace(plan, schedule="chain", backward=backward,
                                                            notes=plan.notes + (note,)),
                               dataclasses.replace(g1, h_quant=fp8_default_h_quant(spec, g1)), form(2, plan.gemm2))


def _with_forward_gemms(spec: Spec, a: Arch, plan: Plan, g1: GemmPlan, g2: GemmPlan) -> Plan:
    """`plan` with forward GEMMs `g1`, `g2` (new tiles: the FP8 form, an FP8 tile override) and what follows from
    them: the MoK chunk (chunk_rows, from their N tiles), the automatic notes (a partial N tile, ...: those of
    plan's GEMMs replaced by those of the new ones) and the predicted time."""
    old_auto = set(_auto_notes(spec, a, plan.gemm2, *_costs(spec, a, plan.gemm1, plan.gemm2)[:2]))
    notes = (_auto_notes(spec, a, g2, *_costs(spec, a, g1, g2)[:2])
             + tuple(n for n in plan.notes if n not in old_auto))
    chunk = max(_chunk_rows(a, g1.n_tiles, plan.bm), _chunk_rows(a, g2.n_tiles, plan.bm))
    return _with_prediction(spec, a, dataclasses.replace(plan, gemm1=g1, gemm2=g2, notes=notes, chunk_rows=chunk))


# ---- FP8 (e4m3, blockwise scales) ----------------------------------------------------------------------------
FP8_BK = 128  # one scale block along K per stage (the promotion interval)
FP8_BN = 128  # acc + the promotion's per-block acc_k: 2 x 64 fp32 registers per consumer thread at 128 columns


# The FP8 GEMMs' default promotion (gemm1, gemm2, dgrad1, dgrad2): the forward GEMMs overlap each K block's
# promotion with the next block's wgmma (chains of 8 blocks); measured, same process (bench/NOTES.md v13):
# forward+backward kimi-k2 6.44 vs 6.59 ms, qwen3-30b-a3b 2.15 vs 2.52, gpt-oss-120b 7.41 vs 7.53; with the dgrads
# overlapping too kimi-k2 and gpt-oss-120b were slower (6.77 vs 6.58, 7.61 vs 7.33), so they stay serial.
FP8_PROMOTE = ("overlap", "overlap", "serial", "serial")


# FP8 GEMMs whose tile may be 256 columns wide (mma_split 2): GEMM 2 (routing weight), dgrad2 (store) and dgrad1
# (the dSwiGLU epilogue over 256 columns; where ffn is a multiple of 256) as two 128-column halves of one W tile;
# GEMM 1 as its two parts, 128 gate and 128 up columns, each its own wgmma half (where ffn is a multiple of 128).
# dgrad1's wide tile is opt-in (dgrad1_bn=256, searched by tune --train): on an H100 it moved forward+backward
# -4.6% to +1.8% between calls (bench/NOTES.md v26), not a default.
FP8_WIDE = {1: "gemm1", 2: "gemm2", 3: "dgrad1", 4: "dgrad2"}
FP8_GEMM_INDEX = {"gemm1": 1, "gemm2": 2, "dgrad1": 3, "dgrad2": 4}
FP8_BN_KEYS = tuple(f"{n}_bn" for n in FP8_GEMM_INDEX)
FP8_DGRAD_STAGE_KEYS = ("dgrad1_stages", "dgrad2_stages")
_FP8_TITLES = {"gemm1": "GEMM 1", "gemm2": "GEMM 2"}
FP8_BNS = (FP8_BN, 2 * FP8_BN)


# The FP8 GEMMs that take 256-column tiles (fp8_widen) by default, where the GEMM's tile is not asked for otherwise
# (_fp8_tile_asked) and it can (fp8_wide_problem: GEMM 1 needs ffn a multiple of 128). Measured on an H100, one
# process, bench_backward 3 rounds (bench/NOTES.md v25, v26):
# - GEMM 2 and dgrad2, both wide against both 128 columns, forward+backward: kimi-k2 6.150 vs 6.407 ms (and 6.165
#   vs 6.615 in 2 rounds), glm-5 5.344 vs 5.390, qwen3.5-397b-a17b 2.476 vs 2.501; on the H200 (v14) kimi-k2 6.835
#   vs 6.865, gpt-oss-120b 7.715 vs 7.875. The forward alone moves -5% to +2% either way.
# - GEMM 1 too (its 128-column form promotes with overlap, the wide one serial), forward / forward+backward against
#   GEMM 2 and dgrad2 wide alone: kimi-k2 1.797 / 5.901 vs 1.988 / 6.239 ms, glm-5 1.559 / 5.095 vs 1.638 / 5.269,
#   qwen3.5-397b-a17b 0.713 / 2.447 vs 0.791 / 2.474, deepseek-v4-pro 1.988 / 6.651 vs 2.217 / 6.741.
# Same bits (tests/test_gpu_fp8.py::test_scale_load_same_bits).
FP8_WIDE_DEFAULT = (("gemm1", 1), ("gemm2", 2), ("dgrad2", 4))


def _fp8_tile_asked(name: str, overrides: Mapping[str, Any]) -> bool:
    """Whether the overrides fix FP8 GEMM `name`'s tile form: its tile N or stages, a promotion other than serial
    (per GEMM, or the shared key) or a cluster (the 256-column form promotes its halves in turn, cluster 1)."""
    promote = overrides.get(f"{name}_promote", overrides.get("promote", "serial"))
    cluster = overrides.get(f"{name}_cluster", overrides.get("cluster", 1)) if name.startswith("gemm") else 1
    return (f"{name}_bn" in overrides or f"{name}_stages" in overrides or promote != "serial"
            or str(cluster) != "1")


def _fp8_wide_kept(overrides: Mapping[str, Any]) -> tuple[str, ...]:
    """The FP8 GEMMs of FP8_WIDE_DEFAULT that keep their default 256-column tile: those no override fixes."""
    return tuple(name for name, _ in FP8_WIDE_DEFAULT if not _fp8_tile_asked(name, overrides))


def fp8_tile_shape_problem(spec: Spec, which: int, bn: int) -> str | None:
    """Why `spec`'s shape keeps FP8 GEMM `which` (1, 2, 3 = dgrad1, 4 = dgrad2) off `bn`-column tiles (128 or
    256), or None: the one statement of the rule, for the solver and the config check (configs)."""
    if bn == FP8_BN:   # dgrad1's dSwiGLU epilogue needs whole tiles of ffn (else fp8_gemm plans 64 columns)
        return (f"need ffn a multiple of {FP8_BN} (the dSwiGLU epilogue), got {spec.ffn}"
                if which == 3 and spec.ffn % FP8_BN else None)
    if which not in FP8_WIDE:
        return "applies to gemm1, gemm2, dgrad1 and dgrad2 only"
    if which == 1 and spec.ffn % FP8_BN:
        return f"(128 gate + 128 up) need ffn a multiple of 128, got {spec.ffn}"
    if which == 3 and spec.ffn % (2 * FP8_BN):
        return f"need ffn a multiple of 256 (the dSwiGLU epilogue's tiles divide it), got {spec.ffn}"
    return None


def fp8_wide_problem(spec: Spec, which: int, g: GemmPlan) -> str | None:
    """Why FP8 GEMM `which` (1, 2, 3 = dgrad1, 4 = dgrad2) of `spec`, planned as `g`, cannot take 256-column
    tiles, or None."""
    if (why := fp8_tile_shape_problem(spec, which, 2 * FP8_BN)) is not None:
        return why
    if g.cluster != 1:
        return f"needs cluster 1, got {g.cluster}"
    return None


def fp8_widen(arch: Arch, which: int, g: GemmPlan, n: int) -> GemmPlan:
    """FP8 GEMM `g` with 256-column tiles: the wgmma runs per 128-column half (mma_split 2) into the per-block
    accumulator, each half promoted as soon as its wgmma retires, so the registers hold the 128 x 256 fp32 tile
    (128 per thread) plus one half (64), not two whole tiles. Per K block a CTA loads (128 + 256) x 128 bytes
    for 2 x 128 x 256 x 128 flops: a quarter fewer operand bytes per flop than 128 x 128 tiles (on the H100 the
    128-column FP8 GEMMs run near the L2's bandwidth: bench/NOTES.md v21). Promotion serial (the halves take
    turns; the two warpgroups fill each other's promotion gaps); stages: as many 48 KiB stages as fit. GEMM 1
    (which 1): its halves are its two parts, 128 gate and 128 up columns of W1, so a tile gives 128 outputs; its z
    ring (training) where the wider tile's stages take it, else z by direct stores."""
    # GEMM 1's tile N counts both parts: 128 gate + 128 up columns of its n = ffn outputs per tile
    per_tile = FP8_BN if which == 1 else 2 * FP8_BN
    wide = dataclasses.replace(g, bn=2 * FP8_BN, mma_split=2, promote="serial", n_tiles=-(-n // per_tile))
    wide = _fp8_fill_stages(arch, wide)
    parts = 2 if which == 1 else 1
    wide = _with_epi_store(wide, parts=parts) if g.epi_store == "ring" else wide
    if wide.z_store == "ring" and z_ring_problem(wide) is not None:   # GEMM 1 of a training plan: z beside it
        wide = dataclasses.replace(wide, z_store="direct")
    return wide


def fp8_gemm(spec: Spec, arch: Arch, which: int, g: GemmPlan) -> GemmPlan:
    """The FP8 form of GEMM `which`'s plan (1, 2: the forward GEMMs; 3, 4: dgrad1, dgrad2): K tile 128 (one scale block per stage), tile N 128 (GEMM 1:
    64 gate + 64 up columns, so a tile's W rows of each part lie in one 128-row scale block), cooperative
    consumers (the promotion holds a second accumulator), cluster 1 (solve's ``cluster`` override multicasts the
    forward GEMMs' W tiles to M-tile pairs, as in BF16), as many 1-byte stages as fit, A tiles by
    TMA (GEMM 1's from the rows that quant_rows_gather gathered and quantized; one TMA box per row, a_load
    "tma_rows", measured 718 TFLOP/s on kimi-k2 against GEMM 2's 945 with tiles: bench/NOTES.md v11)."""
    n, k = _gemm_shape(spec, which) if which <= 2 else backward_shape(spec, ("dgrad1", "dgrad2")[which - 3])[1:]
    # dgrad1's dSwiGLU epilogue needs whole tiles of ffn: 64 columns where 128 does not divide it (gpt-oss: 2880)
    bn = FP8_BN if which != 3 or spec.ffn % FP8_BN == 0 else FP8_BN // 2
    fp8 = dataclasses.replace(
        g, bn=bn, bk=FP8_BK, elem_bytes=1, consumer="cooperative", consumer_wgs=CONSUMER_WGS, cluster=1,
        promote=FP8_PROMOTE[which - 1], mma_split=1, stage_scale_bytes=0,
        a_load="tma", n_tiles=-(-n // bn), k_tiles=-(-k // FP8_BK),
        epi_n=g.epi_n if (bn // (2 if which == 1 else 1)) % g.epi_n == 0 else EPI_N,
        z_chunk=min(g.z_chunk, bn // 4))
    fp8 = _fp8_fill_stages(arch, fp8)
    return _with_z_load(fp8) if which == 3 else fp8


WGRAD_DTYPES = _SPACE.values("dtype", "wgrad1")


def fp8_wgrad(spec: Spec, arch: Arch, name: str, g: GemmPlan, bm: int) -> GemmPlan:
    """Weight-gradient GEMM `g` in FP8 (plan override ``wgrad*_dtype=fp8``): both operands e4m3 per 128 x 1 tile
    along the rows (the reduction), read K-major from the transposed copies that quant_cols_used /
    quant_cols_gather write; tiles 128 x 128 with 128-row K steps (one scale block per stage, so the routing tile
    must be a multiple of 128: the FP8 specs' cooperative tiles are), each stage also holding the K block's scales
    of the tile's 128 + 128 columns; promoted per element every K block (templates/sm90/_blocks.py.j2
    mainloop_fp8_wgrad); as many stages as fit beside the epilogue. The output path as for BF16 (the ring where
    the tile allows, else smem; the fp32 main_grad form has no bf16 output)."""
    if bm % FP8_BK:
        raise PlanError(f"plan.wgrad_dtype: FP8 weight gradients need 128-row K blocks inside a routing tile, got "
                        f"routing tile {bm}")
    w = dataclasses.replace(g, bn=FP8_BN, bk=FP8_BK, elem_bytes=1, stage_scale_bytes=(g.tile_m + FP8_BN) * 4,
                            n_tiles=-(-backward_shape(spec, name)[1] // FP8_BN), epi_n=g.epi_n if FP8_BN % g.epi_n == 0 else EPI_N,
                            promote=FP8_WGRAD_PROMOTE)
    return dataclasses.replace(w, stages=_stages_most(arch, w))


def fp8_wgrad_wide(spec: Spec, arch: Arch, name: str, g: GemmPlan) -> GemmPlan:
    """FP8 weight gradient `g` (fp8_wgrad's 128 x 128 tile) with 128 x 256 tiles (``wgrad*_dtype=fp8,
    wgrad*_bn=256``): the wgmma runs per 128-column half into the half-width per-block accumulator, each half
    promoted per element as soon as its wgmma retires (templates/sm90/_blocks.py.j2 mainloop_fp8_wgrad_split), so
    the registers hold the 128 x 256 fp32 tile (128 per thread) and one half (64). Per K block a CTA loads (128 +
    256) x 128 operand bytes and the K block's 128 + 256 column scales for 2 x 128 x 256 x 128 flops: a quarter
    fewer operand bytes per flop than 128 x 128, against the L2 load that bounds the FP8 GEMMs on the H100
    (bench/NOTES.md v21). Promotion FP8_WGRAD_SPLIT_PROMOTE (stagger: the two warpgroups one half apart, so one's
    wgmma runs while the other promotes); as many stages as fit; the output path as g's (the ring where the tile
    takes it)."""
    bn = 2 * FP8_BN
    w = dataclasses.replace(g, bn=bn, mma_split=2, promote=FP8_WGRAD_SPLIT_PROMOTE,
                            stage_scale_bytes=(g.tile_m + bn) * 4, n_tiles=-(-backward_shape(spec, name)[1] // bn))
    w = dataclasses.replace(w, stages=_stages_most(arch, w))
    return _with_epi_store(w) if g.epi_store == "ring" else w


def _fp8_fill_stages(arch: Arch, g: GemmPlan) -> GemmPlan:
    """FP8 GEMM `g` with as many 1-byte stages as fit the shared memory beside its epilogue buffers (none for a ring
    epilogue) and barriers (within [MIN_STAGES, MAX_STAGES])."""
    stage = (g.tile_m + g.bn) * g.bk + g.stage_scale_bytes
    most = (arch.smem_per_cta - (g.smem_bytes() - g.stages * stage)) // stage
    return dataclasses.replace(g, stages=max(MIN_STAGES, min(MAX_STAGES, most)))


def _solve(spec: Spec, arch: str = "sm_90a", **overrides: Any) -> Plan:
    """The best plan for `spec` on `arch`. Overrides force a candidate (for tune): gemm1_bn, gemm2_bn,
    gemm1_stages, gemm2_stages, raster_group / gemm1_raster_group / gemm2_raster_group, gemm1_a_load ("gather" | "tma" | "tma_rows"), schedule,
    cluster / gemm1_cluster / gemm2_cluster, consumer / gemm1_consumer / gemm2_consumer, w_hint / gemm1_w_hint /
    gemm2_w_hint and a_hint / gemm1_a_hint / gemm2_a_hint (L2 eviction priority of the TMA loads: see L2_HINTS)."""
    a = get_arch(arch)
    for key in overrides:
        if key not in OVERRIDES:
            raise PlanError(f"plan.{key}: unknown override; allowed: {', '.join(OVERRIDES)}")
    for which in (1, 2):
        key = f"gemm{which}_bn"
        if key in overrides and (problem := _gemm_problem(spec, a, which, overrides[key])):
            raise PlanError(f"plan.{key}: {problem}")
    schedule = overrides.get("schedule", "chain")
    if schedule not in SCHEDULES:
        raise PlanError(f"plan.schedule: must be one of {', '.join(SCHEDULES)}, got {schedule!r}")

    def fits(p: Plan) -> bool:
        if schedule == "chain":
            return True
        return fused_tiles_ok(spec, p.gemm1, p.gemm2) and p.gemm1.consumer == p.gemm2.consumer == "cooperative"

    # an FP8 spec's candidates keep the 128-column GEMM 2 where these overrides fix its tile (stages, cluster)
    wide = _fp8_wide_kept(overrides)
    best = next(
        (p for p in _candidates_any(spec, arch, fp8_wide=wide)
         if p.gemm1.bn == overrides.get("gemm1_bn", p.gemm1.bn) and p.gemm2.bn == overrides.get("gemm2_bn", p.gemm2.bn)
         and fits(p)), None)
    if best is None:
        raise PlanError(f"plan.schedule: no tile plan for 'fused' (gemm1.bn == gemm2.bn dividing hidden "
                        f"{spec.hidden}) among the candidates that match the overrides")
    if not overrides:
        return best
    gemms = {1: best.gemm1, 2: best.gemm2}
    if schedule == "fused":  # the fused kernel gathers its rows itself
        gemms[1] = dataclasses.replace(gemms[1], a_load="gather")
        # ... and rasters inside its overlap chunks (~2 waves of tiles): the chain's tall panels do not apply
        # (not measured on the fused kernel); a raster override below still does
        gemms = {w: dataclasses.replace(g, raster_group=_raster_group(a, _gemm_shape(spec, w)[1], g.bn))
                 for w, g in gemms.items()}
    for which in (1, 2):
        if (found := _gemm_override(overrides, which, "consumer")) is None:
            continue
        key, mode = found
        if mode not in CONSUMERS:
            raise PlanError(f"plan.{key}: must be one of {', '.join(CONSUMERS)}, got {mode!r}")
        if mode != "cooperative" and schedule == "fused":
            raise PlanError(f"plan.{key}: the fused schedule's tiles are cooperative (128 rows per task)")
        gemms[which] = _with_consumer(a, gemms[which], mode)  # a gemm*_stages override applies below
    gemms[1], gemms[2] = _routing_tile(gemms[1], gemms[2])
    for which, g in gemms.items():
        key = f"gemm{which}_stages"
        if key in overrides:
            stages, most = _int_override(key, overrides[key]), min(MAX_STAGES, _stages_fit(a, g.bn, g.consumer))
            if not MIN_STAGES <= stages <= most:
                raise PlanError(
                    f"plan.{key}: must be in [{MIN_STAGES}, {most}] for bn {g.bn} on {a.name}, got {stages}")
            gemms[which] = dataclasses.replace(g, stages=stages)
    if "gemm1_a_load" in overrides:
        mode = overrides["gemm1_a_load"]
        if mode not in A_LOADS:
            raise PlanError(f"plan.gemm1_a_load: must be one of {', '.join(A_LOADS)}, got {mode!r}")
        gemms[1] = dataclasses.replace(gemms[1], a_load=mode)
    for which in (1, 2):
        if (found := _gemm_override(overrides, which, "raster_group")) is None:
            continue
        key, r = found[0], _int_override(*found)
        if not 1 <= r <= RASTER_OVERRIDE_MAX:
            raise PlanError(f"plan.{key}: must be in [1, {RASTER_OVERRIDE_MAX}], got {r}")
        gemms[which] = dataclasses.replace(gemms[which], raster_group=r)
    for which in (1, 2):
        if (found := _gemm_override(overrides, which, "cluster")) is None:
            continue
        key, c = found[0], _int_override(*found)
        if c not in CLUSTERS:
            raise PlanError(f"plan.{key}: must be one of {', '.join(map(str, CLUSTERS))}, got {c}")
        if c > 1 and schedule == "fused":
            raise PlanError(f"plan.{key}: the fused schedule runs one CTA per task (cluster 1)")
        gemms[which] = dataclasses.replace(gemms[which], cluster=c)
    for which in (1, 2):
        for name in ("w_hint", "a_hint"):
            if (found := _gemm_override(overrides, which, name)) is None:
                continue
            key, hint = found
            if hint not in L2_HINTS:
                raise PlanError(f"plan.{key}: must be one of {', '.join(L2_HINTS)}, got {hint!r}")
            if hint != "normal" and schedule == "fused":
                raise PlanError(f"plan.{key}: the fused schedule's loads take no L2 hints")
            if name == "a_hint" and gemms[which].a_load != "tma":
                if key == name:  # the key for both GEMMs applies to those that TMA-load A
                    continue
                raise PlanError(f"plan.{key}: GEMM {which} reads A by {gemms[which].a_load!r}, not one TMA box per "
                                f"tile: no L2 hint to give")
            gemms[which] = dataclasses.replace(gemms[which], **{name: hint})
    for key, legal in (("epi_n", EPI_NS), ("epi_stages", EPI_STAGE_CHOICES)):
        if key not in overrides:
            continue
        v = _int_override(key, overrides[key])
        if v not in legal:
            raise PlanError(f"plan.{key}: must be one of {', '.join(map(str, legal))}, got {v}")
        if schedule == "fused":
            raise PlanError(f"plan.{key}: the fused kernel's epilogue staging is fixed (32 columns, 2 buffers)")
        for which, g in gemms.items():
            cols = g.bn // 2 if which == 1 else g.bn   # GEMM 1's tile holds bn/2 output columns (gate, up)
            if key == "epi_n" and cols % v:
                raise PlanError(f"plan.{key}: {v} does not divide GEMM {which}'s {cols} output columns per tile")
            g = dataclasses.replace(g, **{key: v})
            # more epilogue smem: fewer stages where the ring no longer fits
            while g.smem_bytes(g.bn) > a.smem_per_cta and g.stages > MIN_STAGES:
                g = dataclasses.replace(g, stages=g.stages - 1)
            if g.smem_bytes(g.bn) > a.smem_per_cta:
                raise PlanError(f"plan.{key}: {v} does not fit GEMM {which}'s shared memory with {MIN_STAGES} stages")
            gemms[which] = g
    forced = ", ".join(f"{k}={overrides[k]}" for k in sorted(overrides))
    plan = _make_plan(spec, a, gemms[1], gemms[2], (f"overrides: {forced}",), schedule=schedule)
    return _backward_overrides(spec, a, plan, overrides)


def _backward_overrides(spec: Spec, a: Arch, plan: Plan, overrides: Mapping[str, Any]) -> Plan:
    """The backward GEMMs' overrides on a solved plan, in this order (each later one on the result of the earlier):
    ``<kernel>_bn`` (rebuilds the GEMM's plan by the default rules for that tile N: stages, raster, dgrad1's z
    chunk = min(Z_CHUNK, bn / 4)), ``dgrad*_consumer`` (stages refit), ``wgrad*_epi_n`` / ``wgrad*_epi_stages``
    (stages refit to what fits beside the epilogue buffers), ``<kernel>_stages`` (within what fits),
    ``dgrad*_cluster``, ``dgrad1_z_chunk``, ``<kernel>_raster_group``."""
    bwd = {n: getattr(plan.backward, n) for n in BACKWARD_GEMMS}
    changed = False
    for name in BACKWARD_GEMMS:
        key = f"{name}_bn"
        if key in overrides:
            bn = overrides[key]
            if (why := _backward_bn_problem(spec, a, name, bn)) is not None:
                raise PlanError(f"plan.{key}: {why}")
            bwd[name], changed = _backward_gemm(spec, a, name, plan.bm, bn), True  # consumer: the routing tile's
    for name in ("dgrad1", "dgrad2"):
        key = f"{name}_consumer"
        if key in overrides:
            if overrides[key] not in CONSUMERS:
                raise PlanError(f"plan.{key}: must be one of {', '.join(CONSUMERS)}, got {overrides[key]!r}")
            g = bwd[name]
            if overrides[key] == "cooperative" and g.bm < BM:
                raise PlanError(f"plan.{key}: 128-row cooperative tiles would span two {g.bm}-row routing tiles")
            bwd[name], changed = _with_consumer(a, g, overrides[key]), True
            if name == "dgrad1":   # back to cooperative tiles: z through the ring again where it fits
                bwd[name] = _with_z_load(bwd[name])
    for name in ("wgrad1", "wgrad2"):   # CTAs per SM first: it bounds the shared memory and the tile
        key = f"{name}_ctas_per_sm"
        if key in overrides:
            bwd[name], changed = _ctas_per_sm_override(spec, a, plan.bm, name, bwd[name], overrides), True
    for name in ("wgrad1", "wgrad2"):   # epilogue staging next: it bounds the stages that fit
        for field in ("epi_n", "epi_stages"):
            key = f"{name}_{field}"
            if key not in overrides:
                continue
            v, legal = _int_override(key, overrides[key]), _SPACE.values(field, name)
            g = bwd[name]
            if v not in legal:
                raise PlanError(f"plan.{key}: must be one of {', '.join(map(str, legal))}, got {v}")
            if field == "epi_n" and g.bn % v:
                raise PlanError(f"plan.{key}: {v} does not divide {name}'s tile N {g.bn}")
            g = dataclasses.replace(g, **{field: v})
            g = dataclasses.replace(g, stages=min(g.stages, _stages_most(a, g)))
            if g.stages < MIN_STAGES:
                raise PlanError(f"plan.{key}: {v} does not fit {name}'s shared memory with {MIN_STAGES} stages")
            bwd[name], changed = g, True
    for name in BACKWARD_GEMMS:
        key = f"{name}_stages"
        if key in overrides:
            g = bwd[name]
            stages, most = _int_override(key, overrides[key]), _stages_most(a, g)
            if epi_ring_problem(g)[0] is None:   # the ring (no epilogue buffers) may still be asked for: the
                # output path is settled last, and _fit_epilogue checks the stages against the one taken
                most = max(most, _stages_most(a, dataclasses.replace(g, epi_store="ring")))
            if not MIN_STAGES <= stages <= most:
                raise PlanError(f"plan.{key}: must be in [{MIN_STAGES}, {most}] for {name} bn {g.bn} "
                                f"({g.consumer}) on {a.name}, got {stages}")
            bwd[name], changed = dataclasses.replace(g, stages=stages), True
    for name in ("dgrad1", "dgrad2"):
        key = f"{name}_cluster"
        if key in overrides:
            c, legal = _int_override(key, overrides[key]), _SPACE.values("cluster", name)
            g = bwd[name]
            if c not in legal:
                raise PlanError(f"plan.{key}: must be one of {', '.join(map(str, legal))}, got {c}")
            # a pair's W tile multicast: z and the output leave the stage ring (z_stage_problem; the output path is
            # settled afterwards, _settle_epi_store: epi_ring_problem)
            g = dataclasses.replace(g, cluster=c)
            bwd[name], changed = (_with_z_load(g) if g.z_load == "tma" else g), True
    if "dgrad1_z_chunk" in overrides:
        g = bwd["dgrad1"]
        zc = _int_override("dgrad1_z_chunk", overrides["dgrad1_z_chunk"])
        legal = _SPACE.values("z_chunk", "dgrad1")
        if zc not in legal or (g.bn // 4) % zc:
            raise PlanError(f"plan.dgrad1_z_chunk: must be one of {', '.join(map(str, legal))} dividing the "
                            f"{g.bn // 4} z pairs a thread holds (dgrad1 bn {g.bn}), got {zc}")
        bwd["dgrad1"], changed = dataclasses.replace(g, z_chunk=zc), True
    if "dgrad1_z_load" in overrides:
        bwd["dgrad1"], changed = _z_load_override(bwd["dgrad1"], overrides["dgrad1_z_load"]), True
    for name in BACKWARD_GEMMS:
        key = f"{name}_raster_group"
        if key in overrides:
            r, most = _int_override(key, overrides[key]), max(_SPACE.values("raster_group", name))
            if not 1 <= r <= most:
                raise PlanError(f"plan.{key}: must be in [1, {most}], got {r}")
            bwd[name], changed = dataclasses.replace(bwd[name], raster_group=r), True
    return dataclasses.replace(plan, backward=BackwardPlan(**bwd)) if changed else plan


def _ctas_per_sm_override(spec: Spec, a: Arch, bm: int, name: str, g: GemmPlan,
                          overrides: Mapping[str, Any]) -> GemmPlan:
    """Wgrad `name` with ``<name>_ctas_per_sm``: 2 CTAs per SM take tile N <= TWO_CTAS_MAX_BN (the accumulator of a
    128 x bn tile, bn / 2 registers per consumer thread, within REGS_TWO_CTAS' 112): without an explicit
    ``<name>_bn`` a wider default tile becomes TWO_CTAS_MAX_BN. The stages refit to the CTA's half of the SM's
    shared memory (the output path as the tile's default)."""
    key = f"{name}_ctas_per_sm"
    c, legal = _int_override(key, overrides[key]), _SPACE.values("ctas_per_sm", name)
    if c not in legal:
        raise PlanError(f"plan.{key}: must be one of {', '.join(map(str, legal))}, got {c}")
    if c == g.ctas_per_sm:
        return g
    if f"{name}_bn" in overrides and g.bn > TWO_CTAS_MAX_BN:
        raise PlanError(f"plan.{key}: two CTAs per SM need {name}_bn <= {TWO_CTAS_MAX_BN} (the accumulator of a "
                        f"128 x {g.bn} tile does not fit half the registers), got {name}_bn={g.bn}")
    if g.bn > TWO_CTAS_MAX_BN:
        if (why := _backward_bn_problem(spec, a, name, TWO_CTAS_MAX_BN)) is not None:
            raise PlanError(f"plan.{key}: two CTAs per SM need {name}_bn <= {TWO_CTAS_MAX_BN}, and {why}")
        g = _backward_gemm(spec, a, name, bm, TWO_CTAS_MAX_BN)
    g = dataclasses.replace(g, ctas_per_sm=c)
    if _stages_most(a, g) < MIN_STAGES:   # whole-tile epilogue buffers (small groups) leave too few stages
        g = dataclasses.replace(g, epi_n=EPI_N, epi_stages=EPI_BUFFERS)
    g = dataclasses.replace(g, stages=_stages_most(a, g))
    if g.stages < MIN_STAGES:
        raise PlanError(f"plan.{key}: {MIN_STAGES} stages of {name}'s 128 x {g.bn} tile do not fit half an SM's "
                        f"shared memory ({smem_budget(a, g)} B)")
    return g


def _z_load_override(g: GemmPlan, mode: Any) -> GemmPlan:
    legal = _SPACE.values("z_load", "dgrad1")
    if mode not in legal:
        raise PlanError(f"plan.dgrad1_z_load: must be one of {', '.join(legal)}, got {mode!r}")
    if mode == "tma" and (why := z_stage_problem(g)) is not None:
        raise PlanError(f"plan.dgrad1_z_load: tma {why}")
    return dataclasses.replace(g, z_load=mode)


# ---- explain -----------------------------------------------------------------------------------------------
def _explain_gemm(spec: Spec, arch: Arch, which: int, g: GemmPlan, c: _GemmCost) -> list[str]:
    if (own := _own_rules(arch.name)) is not None:
        return own.explain_gemm(spec, arch, which, g, c)
    if g.elem_bytes == 1:
        return _explain_fp8_gemm(spec, arch, which, g, c)
    n, k = _gemm_shape(spec, which)
    title = ("GEMM1  h = SwiGLU(x[rows] . w1ᵀ)", "GEMM2  ys = row_w * (h . w2ᵀ)")[which - 1]
    if which == 1:
        bn_rule = f"{g.bn // 2} gate + {g.bn // 2} up columns per tile; ffn {spec.ffn} % {g.bn // 2} = 0"
    elif n % g.bn:
        bn_rule = f"hidden {n} % {g.bn} = {n % g.bn}: the last N tile is partial (N efficiency {_pct(c.n_eff)})"
    else:
        bn_rule = f"hidden {n} % {g.bn} = 0"
    stage = _stage_bytes(g.bn, g.consumer)
    fit = _stages_bound(arch, g.bn, g.consumer, ring=g.epi_store == "ring")
    used = g.smem_bytes()
    r_fit = _raster_bound(arch, k, g.bn)
    waves = c.tiles / arch.sms
    return [
        f"{title}: N = {n}, K = {k}, A by {g.a_load}, consumers {g.consumer} ({g.tile_m}-row tiles)",
        *([f"  A: routed groups average {spec.routed_rows // spec.local_experts} rows "
           f"({'<' if _small_groups(spec) else '>='} "
           f"{GATHER_MIN_GROUP_ROWS}): default {_gemm1_a_load(spec)} (gather = cp.async in GEMM 1's producer, "
           f"tma = gather kernel + TMA)"] if which == 1 else []),
        f"  bn = {g.bn}: {bn_rule}",
        f"  smem per stage = {_rules().STAGE_BYTES} = {stage} B; {_epi_buffers_text(g)}; "
        f"barriers {BARRIER_BYTES} B",
        f"  stages <= {_rules().STAGES_FIT} = {float(fit):.2f} -> stages = {g.stages} "
        f"(range [{MIN_STAGES}, {MAX_STAGES}]; {used} of {arch.smem_per_cta} B smem)",
        f"  registers: accumulator {BM // CONSUMER_WGS}x{g.bn} / {WARPGROUP} threads = {_acc_regs(g.bn)} "
        f"+ {REG_OVERHEAD} <= {_consumer_regs(arch)} per consumer thread; "
        f"{(CONSUMER_WGS + 1) * WARPGROUP} threads per CTA",
        (f"  raster: one group's W = {_group_w_bytes(spec, which) / 2**20:.1f} MiB > L2/4 and routed groups of "
         f">= {GATHER_MIN_GROUP_ROWS} rows span several panels -> tall panels: raster_group = {g.raster_group}"
         if _tall_raster(spec, arch, which) else
         f"  raster: routed groups of {SMALL_GROUPS_PANEL_MIN_ROWS} to < {GATHER_MIN_GROUP_ROWS} rows -> GEMM 1's "
         f"taller panels (fewer DRAM re-reads of W1, measured): raster_group = {g.raster_group}"
         if _small_groups_panel(spec, arch, which) else
         f"  raster: {_rules().PANEL_BYTES} <= L2/2  =>  r <= {_rules().RASTER_FIT} = {float(r_fit):.2f} "
         f"-> raster_group = {g.raster_group}"),
        f"  tiles = {_m_tiles(spec, g.bm) * (g.bm // g.tile_m)} M x {g.n_tiles} N = {c.tiles}; waves = {c.tiles} / {arch.sms} = {waves:.2f} "
        f"-> {math.ceil(waves)} (wave efficiency {_pct(c.wave_eff)})",
    ]


def _explain_fp8_gemm(spec: Spec, arch: Arch, which: int, g: GemmPlan, c: _GemmCost) -> list[str]:
    """The FP8 form's lines: what fp8_gemm fixed and why, the stage ring in 1-byte elements."""
    n, k = _gemm_shape(spec, which)
    title = ("GEMM1  h = SwiGLU(x[rows] . w1ᵀ)", "GEMM2  ys = row_w * (h . w2ᵀ)")[which - 1]
    stage = (g.tile_m + g.bn) * g.bk * g.elem_bytes + g.stage_scale_bytes
    fixed = g.smem_bytes() - g.stages * stage
    waves = c.tiles / arch.sms
    gatherers = ("producer warps 2-3, beside warp 1 storing the output ring" if g.epi_store == "ring"
                 else "all four producer warps")
    return [
        f"{title}: N = {n}, K = {k}, FP8 e4m3 (A per 1x128, W per 128x128 scales, promoted every K block of 128)",
        "  A: " + ((f"x quantized once per token by quant_rows, its e4m3 rows gathered by this kernel with cp.async "
                    f"({gatherers}; scales read by token; a_load gather: the default where routed groups average >= "
                    f"{GATHER_MIN_GROUP_ROWS} rows, bench/NOTES.md v31)" if g.a_load == "gather" else
                    "x's rows gathered and quantized by quant_rows_gather, read by TMA tiles") + (
            "; h quantized per 1 x 128 in this epilogue (h_quant epilogue: no quant_rows_used launch)"
            if g.h_quant == "epilogue" else "") if which == 1 else
                   "h's used rows in e4m3 (quant_rows_used, or GEMM 1's epilogue with gemm1.h_quant epilogue), "
                   "read by TMA tiles"),
        (f"  bn = {g.bn} in two wgmma halves of {g.bn // 2} (mma_split 2; "
         + ("GEMM 1's two parts, 128 gate and 128 up columns; its default where ffn is a multiple of 128, "
            "FP8_WIDE_DEFAULT; gemm1_bn=128 for 128 columns" if which == 1 else
            "GEMM 2's default, FP8_WIDE_DEFAULT; gemm2_bn=128 for 128 columns")
         + f"): the accumulator ({_acc_regs(g.bn)} fp32 registers per consumer thread) plus one half-width "
         f"per-block one ({_acc_regs(g.bn // 2)}), each half promoted in turn; a quarter fewer operand bytes per "
         f"flop than 128 columns" if g.mma_split == 2 else
         f"  bn = {g.bn} (the accumulator plus the promotion's per-block one, 2 x {_acc_regs(g.bn)} fp32 "
         f"registers per consumer thread" + (f"; {g.bn // 2} gate + {g.bn // 2} up columns, each part's W rows in "
                                             f"one 128-row scale block)" if which == 1 else
                                             f"; {FP8_BNS[1]} with the override {('gemm1', 'gemm2')[which - 1]}_bn "
                                             f"(mma_split 2))")),
        "  smem per stage = BK*(BM + BN)*1 B" + (f" + {g.stage_scale_bytes} B of scales" if g.stage_scale_bytes
                                                 else "") + f" = {stage} B; {_epi_buffers_text(g)}; "
        f"barriers {BARRIER_BYTES} B -> stages = {g.stages} (the most that fit, range [{MIN_STAGES}, {MAX_STAGES}]; "
        f"{g.smem_bytes()} of {arch.smem_per_cta} B, {fixed} B besides the ring)",
        f"  promotion: {g.promote} (overlap: the next K block's wgmma issued before this block's scaling, in "
        f"chains of 8 blocks; default for the forward GEMMs' 128-column tiles, measured 2-15% faster training "
        f"steps; 256-column tiles in two halves (mma_split 2) have no registers for its second per-block "
        f"accumulator and promote serially; stagger: the two warpgroups one block apart, no gain measured: "
        f"bench/NOTES.md v13)",
        "  scales: " + (f"staged (scale_load stage: a producer warp copies each K block's {g.tile_m} A-row and W "
                         f"scales into a shared-memory ring, {g.stage_scale_bytes} B a stage)" if g.stage_scale_bytes
                         else "global loads by the consumer threads at each block's issue (scale_load global)")
        + "; the two forms measured within noise on an H100, same bits (bench/NOTES.md v25)",
        f"  raster_group = {g.raster_group}; tiles = {_m_tiles(spec, g.bm)} M x {g.n_tiles} N = {c.tiles}; waves = "
        f"{waves:.2f} -> {math.ceil(waves)} (wave efficiency {_pct(c.wave_eff)})",
        f"  cost below: the FP8 model (dense e4m3 {arch.peak_fp8_tflops:g} TFLOP/s x mainloop efficiency "
        f"{FP8_MAINLOOP_EFF[fp8_eff_key(which, g)]:.3f} for {fp8_eff_key(which, g)[1]}, + {FP8_WEIGHT_COEF:g} x the "
        f"e4m3 weights' bytes over HBM, + {FP8_TILE_MS * 1e6:g} ns per (group x N tile); fitted to the H200's FP8 "
        f"forward records: mokgen.costmodel.fit_fp8)",
    ]


def _describe_cost(c: _GemmCost) -> str:
    return (f"{c.ms:.4f} ms {c.bound:<7} (eff {_pct(c.eff)} = rows {_pct(c.row_eff)} x N {_pct(c.n_eff)} "
            f"x waves {_pct(c.wave_eff)} x mainloop {_pct(c.mainloop_eff)})")


def _describe_candidate(spec: Spec, arch: Arch, p: Plan) -> str:
    c1, c2, _ = _costs(spec, arch, p.gemm1, p.gemm2)
    return (f"  bn1={p.gemm1.bn:<3} bn2={p.gemm2.bn:<3} {p.gemm1.consumer:<11} {p.predicted_ms:.4f} ms {p.predicted_tflops:7.1f} TFLOP/s"
            f"  GEMM1 {c1.ms:.4f} ms eff {_pct(c1.eff)} ({c1.bound}), "
            f"GEMM2 {c2.ms:.4f} ms eff {_pct(c2.eff)} ({c2.bound})")


def _verdict(spec: Spec, arch: Arch, plan: Plan, ranked: list[Plan]) -> str:
    label = f"bn1={plan.gemm1.bn}/bn2={plan.gemm2.bn} {plan.gemm1.consumer}"
    if (ranked[0].gemm1, ranked[0].gemm2) != (plan.gemm1, plan.gemm2):
        best = ranked[0]
        return (f"chosen by overrides; the solver's best is bn1={best.gemm1.bn}/bn2={best.gemm2.bn} "
                f"at {best.predicted_ms:.4f} ms")
    if len(ranked) == 1:
        return f"{label} is the only valid candidate"
    other = ranked[1]
    o_label = f"bn1={other.gemm1.bn}/bn2={other.gemm2.bn} {other.gemm1.consumer}"
    if other.predicted_ms > plan.predicted_ms:
        gap = other.predicted_ms / plan.predicted_ms - 1
        return f"{label} wins: {plan.predicted_ms:.4f} ms, {_pct(gap)} ahead of the runner-up {o_label}"
    mine, theirs = (_rank_key(spec, arch, p)[2] for p in (plan, other))
    return (f"{label} ties {o_label} on predicted time (memory bound) and wins on compute time "
            f"{mine:.4f} vs {theirs:.4f} ms")


def explain(plan: Plan, top: int = 5) -> str:
    """A readable derivation of `plan`: inputs, every constraint with its numbers, and the ranking."""
    spec, arch = plan.spec, get_arch(plan.arch)
    c1, c2, glue_ms = _costs(spec, arch, plan.gemm1, plan.gemm2)
    q = spec.routed_rows // spec.local_experts
    n_min = min(plan.gemm1.n_tiles, plan.gemm2.n_tiles)
    ranked = candidates(spec, plan.arch)
    own = _own_rules(plan.arch)
    lines = [
        f"plan for {spec.name} on {arch.name}: {arch.sms} SMs, {arch.smem_per_cta} B smem per CTA, "
        f"{arch.peak_bf16_tflops:g} TFLOP/s bf16, {arch.hbm_tbps:g} TB/s HBM, L2 {arch.l2_bytes // 2**20} MiB",
        f"inputs: T={spec.tokens} H={spec.hidden} I={spec.ffn} experts={spec.experts} ep={spec.ep} "
        f"-> {spec.local_experts} local + {spec.shared_experts} shared = {spec.groups} groups, top-{spec.topk}, "
        f"{spec.activation}, {spec.dtype}",
        f"rows = T*(K+S) = {spec.rows}; random routing: {spec.local_experts} groups of ~{q} rows, each padded "
        f"by (BM-1)/2 on average"
        + (f", {spec.shared_experts} shared x {spec.tokens}" if spec.shared_experts else "")
        + f" -> {_m_tiles(spec, plan.bm)} M tiles of {plan.bm} (row efficiency {_pct(c1.row_eff)})",
        f"routing tile M = {plan.bm} (each group padded to a multiple of it); GEMM tiles: "
        + ", ".join(f"GEMM{w} {own.explain_tile(g) if own else _explain_tile(g)}"
                    for w, g in ((1, plan.gemm1), (2, plan.gemm2)))
        + (f", tile K = {plan.gemm1.bk}" + (" (FP8: one 128-wide scale block per stage)" if spec.dtype == "fp8"
                                             else "")),
        "",
        *_explain_gemm(spec, arch, 1, plan.gemm1, c1),
        "",
        *_explain_gemm(spec, arch, 2, plan.gemm2, c2),
        "",
        f"chunk (MoK overlap): (T_chunk/BM)*(N/BN) >= 2*C  =>  T_chunk >= {_rules().CHUNK_MIN}",
        f"  N/BN = min({plan.gemm1.n_tiles}, {plan.gemm2.n_tiles}) = {n_min}, C = {arch.sms}: "
        f"chunk_rows = {plan.bm} * ceil({2 * arch.sms}/{n_min}) = {plan.chunk_rows} "
        f"({plan.chunk_rows // plan.bm * n_min} tiles >= {2 * arch.sms})",
        f"schedule: {plan.schedule} ("
        + ("routing, GEMM 1, GEMM 2, combine as four persistent launches; the default: on the H200 it measured "
           "faster than the fused kernel on all six benchmark shapes, bench/NOTES.md v2)" if plan.schedule == "chain"
           else "routing, then one persistent kernel claiming G1/G2/combine tasks chunk by chunk)")
        + (own.explain_clusters(plan) if own else
           f"; W-tile clusters: GEMM 1 {plan.gemm1.cluster}, GEMM 2 {plan.gemm2.cluster}"),
        f"launch: programmatic dependent launch {plan.pdl} (plan pdl: "
        + {"off": "each kernel starts when the one before it has finished)",
           "exit": "each kernel is launched as the CTAs of the one before it exit, and waits for that grid before "
                   "touching memory)",
           "tail": "as exit, but after a persistent GEMM the next kernel is launched once each of its CTAs has "
                   "issued its last tile's loads)"}[plan.pdl],
        f"capacity: cap_rows = ceil_BM(T*K + S*T + G*(BM-1)) = ceil_BM({spec.routed_rows} + "
        f"{spec.shared_experts * spec.tokens} + {spec.groups * (plan.bm - 1)}) = {plan.cap_rows}; "
        f"max_m_tiles = {plan.max_m_tiles}",
        "",
        "cost: time = max(flops / (peak * eff), bytes / HBM) per GEMM, + routing/combine bytes / HBM",
        f"  GEMM1 {_describe_cost(c1)}",
        f"  GEMM2 {_describe_cost(c2)}",
        f"  routing + combine {glue_ms:.4f} ms",
        f"  predicted {plan.predicted_ms:.4f} ms = {plan.predicted_tflops:g} TFLOP/s "
        f"({spec.flops_forward / 1e9:.1f} GFLOP forward)",
        f"top candidates (of {len(ranked)}):",
        *(_describe_candidate(spec, arch, p) for p in ranked[:top]),
        _verdict(spec, arch, plan, ranked),
    ]
    if plan.backward is not None:
        lines += ["", *_explain_backward(plan)]
    if own:
        lines += ["", *own.explain_budgets(plan)]
    if plan.notes:
        lines += ["notes:", *(f"  - {n}" for n in plan.notes)]
    return "\n".join(lines)


def _explain_tile(g: GemmPlan) -> str:
    """How a GEMM's CTAs cover its tile: the warpgroups of sm_90a (an arch of its own rules: its explain_tile)."""
    return f"{g.tile_m} rows (" + ("cooperative: 2 consumer warpgroups x 64 rows" if g.consumer == "cooperative" else
                                  "pingpong: one warpgroup per tile, two tiles in flight") + ")"


_BACKWARD_WHAT = {"dgrad1": "dA' = dO rows . W2, dSwiGLU + router-gradient epilogue -> dz, s a",
                  "dgrad2": "dx rows = dz . W1", "wgrad1": "dW1[g] = dzᵀ . x rows", "wgrad2": "dW2[g] = dO rowsᵀ . (s a)"}


def _explain_backward(plan: Plan) -> list[str]:
    """The training kernels' choices (BackwardPlan): per GEMM its operands, tile, stages and output path."""
    spec, b = plan.spec, plan.backward
    own = _own_rules(plan.arch)
    lines = [f"backward (training, {b.streams} stream{'s' if b.streams > 1 else ''}"
             + ("; the weight gradients on the second, beside dgrad2 and the combine" if b.streams == 2 else "") + "):"]
    for name in BACKWARD_GEMMS:
        g = getattr(b, name)
        m, n, k = backward_shape(spec, name)
        shape = f"N = {n}, K = {k}" if k is not None else f"M = {m}, N = {n} per group, K = the group's rows"
        main_grad = "; with main_grad: an fp32 read-add-write from the accumulators" if name.startswith("wgrad") else ""
        if own:   # e.g. the tcgen05 kernels: stages, TMEM and smem in the budgets section
            form, tile = own.explain_backward_gemm(spec, name, g)
            lines += [f"  {name}  {_BACKWARD_WHAT[name]}: {shape}, {form}", tile + main_grad]
            continue
        if g.elem_bytes == 1 and name.startswith("wgrad"):
            form = (f"FP8 e4m3, both operands per 128 x 1 tile along the rows (transposed by quant_cols* / "
                    f"quant_both*), each K block promoted per element ({g.promote}"
                    + (", the tile's two 128-column halves in turn: mma_split 2" if g.mma_split == 2 else "") + ")")
        elif g.elem_bytes == 1:
            form = f"FP8 e4m3 (A per 1x128, W per 128x128), promotion {g.promote}"
        else:
            form = "BF16"
        out = ("ring (TMA-stored by the storer warp)" if g.epi_store == "ring"
               else f"smem ({g.epi_stages} x {g.epi_n} columns)")
        extra = ""
        if name == "dgrad1":
            extra = f"; z {g.z_load} (chunk {g.z_chunk})"
        if (name.startswith("wgrad") and g.elem_bytes == ELEM_BYTES and g.bn == WGRAD_SMALL_GROUPS_BN
                and _wgrad_small_groups(spec, get_arch(plan.arch))):
            extra = (f"; tile N {WGRAD_SMALL_GROUPS_BN}: routed groups of {WGRAD_TILE_EPI_MAX_ROWS + 1}-"
                     f"{WGRAD_SMEM_EPI_MAX_ROWS} rows (bench/NOTES.md v35)")
        if name == "wgrad1" and g.elem_bytes == 1:   # where x's 128 x 1 columns come from (plan bwd_x_cols)
            extra = ("; x's columns from the training forward's x quantizer (quant_both_gather), saved"
                     if b.x_cols == "forward" else "; x's columns quantized here (quant_cols_gather)")
        lines += [f"  {name}  {_BACKWARD_WHAT[name]}: {shape}, {form}",
                  f"    tile {g.tile_m} x {g.bn} ({g.consumer}), K step {g.bk}, stages {g.stages} "
                  f"({g.smem_bytes()} B smem{f', {g.ctas_per_sm} CTAs per SM' if g.ctas_per_sm > 1 else ''}), "
                  f"raster {g.raster_group}, output {out}{extra}{main_grad}"]
    return lines
