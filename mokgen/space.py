"""The config space: per arch and per kernel, every plan choice (knob), its legal values and the values tune
searches. One table per arch serves every reader, so there is no second list of choices: sm_90a's here
(:data:`SM90`), sm_100a's in its package (:mod:`mokgen.sm100.space`, the tcgen05 kernels' knobs); :data:`SPACES`
maps an arch to its table.

* ``mokgen.plan`` takes its legal values from here (tile N, stages, consumer modes, A-load paths, clusters,
  L2 hints, schedules, raster range) and its override keys (:func:`override_keys`);
* ``mokgen plan --set KEY=VALUE`` / ``solve(**overrides)`` are validated against the same values (an sm_100a plan:
  against sm_100a's table, by :mod:`mokgen.sm100.plan`; an sm_90a-only key is refused there, not ignored);
* :mod:`mokgen.configs` holds the constraints a combination must satisfy (shared memory, registers,
  divisibility, what each template supports) and enumerates the override dicts the solver ranks and
  ``mokgen tune`` compiles and times, over the axes each arch's table names (:attr:`ArchSpace.search_axes`,
  :attr:`ArchSpace.backward_axes`, per dtype :meth:`ArchSpace.forward_axes`).

Light on purpose: no sympy, no torch, and no import of the plan (which imports this table).
"""

from __future__ import annotations

from typing import Any

from .space_types import ArchSpace, Knob  # the table's types (re-exported: space.Knob, space.ArchSpace)
from .sm100.space import SM100  # sm_100a's table: its package's

__all__ = ["Knob", "ArchSpace", "SPACES", "space", "override_keys", "legal_values", "SEARCH_AXES",
           "BACKWARD_SEARCH_AXES", "FP8_SEARCH_AXES", "axis_values", "backward_kernel"]


_FWD = ("gemm1", "gemm2")
_BWD = ("dgrad1", "dgrad2", "wgrad1", "wgrad2")  # the backward GEMMs (mokgen.plan.BACKWARD_GEMMS)
_WGRAD = ("wgrad1", "wgrad2")
_BN = (64, 128, 192, 256)
_MIN_STAGES, _MAX_STAGES = 3, 7
_RASTER_MAX = 64

# sm_90a's axes tune searches by default (the knobs with a `search` tuple), in the order the candidates vary.
SEARCH_AXES = ("schedule", "gemm1_bn", "gemm2_bn", "gemm1_consumer", "gemm2_consumer", "gemm1_a_load", "cluster")

# The forward axes `mokgen tune` searches for an FP8 spec (the FP8 form fixes the consumers and schedule:
# mokgen.plan.fp8_gemm): each forward GEMM's promotion (measured to differ per GEMM and shape: bench/NOTES.md v13),
# each forward GEMM's tile N (128, or 256 in two wgmma halves: bench/NOTES.md v14, v26), GEMM 1's A path (TMA tiles
# of quant_rows_gather's rows, or its own gather of the per-token rows: v31), where h is quantized (a launch after
# GEMM 1 or its epilogue: v37) and the W-tile cluster. The dgrads' promotion is tune --train's (BACKWARD_SEARCH_AXES).
FP8_SEARCH_AXES = ("gemm1_promote", "gemm2_promote", "gemm1_bn", "gemm2_bn", "gemm1_a_load", "gemm1_h_quant",
                   "cluster")

# The backward axes `mokgen tune --train` searches, one at a time around the plan it starts from (each backward
# GEMM is its own launch: a knob of one kernel changes that kernel's time only, so the per-kernel winners are
# composed afterwards and the composition is timed too).
BACKWARD_SEARCH_AXES = ("dgrad1_bn", "dgrad1_consumer", "dgrad1_z_load", "dgrad1_z_chunk", "dgrad1_stages",
                        "dgrad1_epi_store", "dgrad1_raster_group", "dgrad2_bn", "dgrad2_consumer", "dgrad2_stages",
                        "dgrad2_epi_store", "dgrad2_raster_group",
                        "wgrad1_bn", "wgrad1_stages", "wgrad1_raster_group", "wgrad1_epi_n", "wgrad1_epi_stages",
                        "wgrad1_epi_store", "wgrad2_bn", "wgrad2_stages", "wgrad2_raster_group", "wgrad2_epi_n",
                        "wgrad2_epi_stages", "wgrad2_epi_store", "dgrad1_promote", "dgrad2_promote", "bwd_streams", "bwd_x_cols",
                        "wgrad1_dtype", "wgrad2_dtype", "wgrad1_promote", "wgrad2_promote",
                        "wgrad1_ctas_per_sm", "wgrad2_ctas_per_sm")


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
        Knob("cluster", ("dgrad1", "dgrad2"), (1, 2), search=None,
             doc="dgrads: CTAs per cluster along M (2: the pair's two M tiles take one W tile, multicast; needs the "
                 "epilogue through smem and, for dgrad1, z by global loads); derived: 1 (on an H100 the pair made dgrad1 "
                 "10-13% slower and left dgrad2 even: bench/NOTES.md v24)"),
        Knob("w_hint", _FWD, ("normal", "first", "last"), shared=True, search=None,
             doc="L2 eviction priority of the W-tile TMA loads"),
        Knob("a_hint", _FWD, ("normal", "first", "last"), shared=True, search=None,
             doc="L2 eviction priority of TMA-loaded A tiles"),
        Knob("promote", _FWD + ("dgrad1", "dgrad2"), ("serial", "stagger", "overlap"), shared=True,
             search=("serial", "stagger", "overlap"),
             doc="FP8 specs: each K block's wgmma waited before its promotion (serial), the same with the two "
                 "warpgroups one block apart so one promotes while the other's wgmma runs (stagger), or the next "
                 "block's issued first (overlap: two per-block accumulators)"),
        Knob("scale_load", _FWD + ("dgrad1", "dgrad2"), ("global", "stage"), shared=True,
             search=("global", "stage"),
             doc="FP8 specs: each K block's A-row and W-block scales read from global memory by the consumer "
                 "threads at the promotion (global), or copied a ring of stages ahead by a producer warp into "
                 "shared memory (stage: the promotion never waits on a global load)"),
        Knob("schedule", ("plan",), ("chain", "fused"), search=("chain", "fused"),
             doc="four launches, or routing + one persistent kernel"),
        Knob("consumer", ("dgrad1", "dgrad2"), ("cooperative", "pingpong"), search=("cooperative", "pingpong"),
             doc="backward dgrad GEMMs' consumer mode (derived from the routing tile)"),
        Knob("z_chunk", ("dgrad1",), (4, 8, 16, 32), search=(8, 16, 32),
             doc="dgrad1's dSwiGLU epilogue: z pairs per thread whose loads are issued together (registers)"),
        Knob("epi_store", _FWD + _BWD, ("ring", "smem"), shared=True, search=("ring", "smem"),
             doc="the bf16 output: through the stage ring, TMA-stored by a storer warp, or through the epi_stages "
                 "buffers by the first consumer warp; derived: ring where the tile allows (TMA-loaded A, "
                 "cooperative, no cluster)"),
        Knob("promote", _WGRAD, ("serial", "stagger", "overlap"), search=("serial", "stagger", "overlap"),
             doc="FP8 weight gradients: each K block's wgmma waited before its promotion (serial), the two "
                 "warpgroups one block apart on tiles of at least STAGES blocks (stagger), or the next block's "
                 "wgmma queued before a block's promotion (overlap: two per-block accumulators, chains of 4 "
                 "blocks); derived: serial"),
        Knob("dtype", _WGRAD, ("bf16", "fp8"), search=("bf16", "fp8"),
             doc="FP8 specs: the weight gradient's operands, bf16 rows as read, or e4m3 per 128 x 1 tile along the "
                 "rows (quantized transposed by quant_cols*, promoted per element every 128 rows); derived: bf16"),
        Knob("streams", ("bwd",), (1, 2), search=(1, 2),
             doc="the backward's launch streams: 2 runs the weight gradients (and the x-row gather) on a second "
                 "stream beside dgrad2 and the combine, filling each kernel's last wave (one more [rows, hidden] "
                 "bf16 buffer); same kernels, same bits"),
        Knob("x_cols", ("bwd",), ("backward", "forward"), search=("backward", "forward"),
             doc="FP8 weight gradient wgrad1: x's 128 x 1 column form quantized in the backward from a second "
                 "gathered read (quant_cols_gather, backward) or in the training forward by the x quantizer that "
                 "writes GEMM 1's 1 x 128 rows (quant_both_gather, one read for both; the column form is saved for "
                 "the backward: rows x hidden bytes more); same bits; derived: backward"),
        Knob("z_load", ("dgrad1",), ("tma", "direct", "pipe"), search=("tma", "direct"),
             doc="dgrad1's z: through the stage ring by TMA (dz stored from there), or global loads by the consumer "
                 "threads in chunks of z_chunk pairs (direct: a chunk's loads, then its math and stores; pipe: the "
                 "next chunk's loads issued before a chunk's math, two register sets: same bits, no gain measured "
                 "on qwen3-30b-a3b / gpt-oss-120b, bench/NOTES.md v28, so not searched); derived: tma where a W "
                 "stage holds a whole z stage (cooperative 128-row tiles), else direct"),
        Knob("z_store", ("gemm1",), ("ring", "direct"), search=("ring", "direct"),
             doc="GEMM 1 of a training step: z through the stage ring beside the output (TMA-stored by the storer "
                 "warp; needs epi_store ring) or 4-byte global stores by the consumer threads"),
        Knob("h_quant", ("gemm1",), ("kernel", "epilogue"), search=("kernel", "epilogue"),
             doc="FP8 specs: h's 1 x 128 e4m3 quantization for GEMM 2 by the quant_rows_used launch (kernel) or in "
                 "GEMM 1's epilogue (epilogue: the 256-column GEMM 1 tile holds one scale block per row, 8-byte "
                 "stores); derived: epilogue where it applies and hidden <= 4096 (plan.FP8_H_QUANT_EPILOGUE_MAX_K: "
                 "measured faster at K 2048 / 4096, slower at 6144 / 7168 on an H100, bench/NOTES.md v37), else "
                 "kernel"),
        Knob("bn", _BWD, _BN, search=_BN,
             doc="backward GEMMs' tile N; derived: the widest dividing N that fits (dgrad1: must divide ffn, and "
                 "its z chunk follows as min(16, bn/4))"),
        Knob("stages", _BWD, tuple(range(_MIN_STAGES, _MAX_STAGES + 1)), search=(4, 5, 6),
             doc="backward GEMMs' pipeline stages; derived: as many as fit the shared memory (capped)"),
        Knob("raster_group", _WGRAD, tuple(range(1, _RASTER_MAX + 1)), search=(2, 4, 16),
             doc="wgrad: output M tiles per raster panel (derived: 8)"),
        Knob("raster_group", ("dgrad1", "dgrad2"), tuple(range(1, _RASTER_MAX + 1)), search=(1, 4, 16),
             doc="dgrads: routing tiles per raster panel (derived as the forward GEMMs': the A panel fits the L2, "
                 "so 1-2 where K is very long, e.g. dgrad2 with a 64k-wide dz)"),
        Knob("pdl", ("plan",), ("off", "exit", "tail"), search=None,
             doc="programmatic dependent launch of every kernel of the layer (not the EP kernels): each waits for "
                 "the grid before it (griddepcontrol.wait) before its first global memory access, and is launched "
                 "once that grid's CTAs have all exited (exit) or, after a persistent GEMM, once each of its CTAs "
                 "has issued its last tile's loads (tail: its CTAs take the SMs as the GEMM's leave, their launch "
                 "and prologue under its last tiles); same kernels otherwise, same bits; derived: off"),
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
        Knob("ctas_per_sm", _WGRAD, (1, 2), search=(1, 2),
             doc="BF16 wgrad: persistent CTAs per SM; 2 = two CTAs of half the shared memory and registers each "
                 "(tile N <= 128, set to 128 unless given), so one CTA's epilogue overlaps the other's wgmma; "
                 "derived: 1"),
    ),
    min_stages=_MIN_STAGES,
    max_stages=_MAX_STAGES,
    search_axes=SEARCH_AXES,
    backward_axes=BACKWARD_SEARCH_AXES,
    dtype_axes=(("fp8", FP8_SEARCH_AXES),),
)

# Every arch's table: sm_90a's above, sm_100a's in its package (mokgen/sm100/space.py: the tcgen05 kernels' knobs).
# Adding an arch: its package's space.py, and its row here.
SPACES: dict[str, ArchSpace] = {SM90.arch: SM90, SM100.arch: SM100}


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


def axis_values(arch: str, axis: str) -> tuple[Any, ...]:
    sp_ = space(arch)
    if axis == "schedule":
        return sp_.knob("schedule").search or ()
    if axis == "cluster":
        return sp_.knob("cluster", "gemm1").search or ()
    if axis == "promote":
        return sp_.knob("promote", "gemm1").search or ()
    kernel, _, key = axis.partition("_")
    return sp_.knob(key, kernel).search or ()


def backward_kernel(key: str) -> str:
    """The backward GEMM an override key belongs to (``"wgrad1_raster_group"`` -> ``"wgrad1"``)."""
    return key.partition("_")[0]
