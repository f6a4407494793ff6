"""sm_100a's config space: the knobs the tcgen05 kernels (``templates/sm100/``, rendered by :mod:`mokgen.sm100.emit`)
and the plan's sm_100a rules (:mod:`mokgen.sm100.plan`) take, their legal values and the values tune searches;
``mokgen.space.SPACES["sm_100a"]``.

Only what sm_100a takes: its kernels have no consumer warpgroups (one CTA per 128-row UMMA tile: 4 epilogue warps,
1 MMA warp, 1 TMA warp), no FP8 promotion (the accumulators are fp32 in tensor memory; the FP8 format is dtype
mxfp8, block-scaled by the MMA), no L2 hints, no fused schedule, and their backward GEMMs take the default tiles
but for the dgrads' 2-CTA form. A key of sm_90a's table that is not here is refused by the plan (mokgen.sm100.plan:
a one-line PlanError naming sm_100a), not ignored. The single-valued knobs (``schedule``, ``consumer``,
``gemm1_a_load``) are the one form the kernels run: legal so that a plan's forward choices
(:func:`mokgen.tune.config_of`) solve on every arch, never searched.

The plan's rules bound the values further per spec (mokgen.sm100.plan: tile N dividing the SwiGLU outputs, stages
within the sm_100a shared memory, the 2-CTA form BF16 only, an MXFP8 spec's fixed tiles); the budgets are
mokgen.sm100.rules'. Light on purpose: no sympy, no torch, no import of the plan.
"""
from __future__ import annotations

from ..space_types import ArchSpace, Knob
from . import rules

__all__ = ["SM100", "SEARCH_AXES", "BACKWARD_SEARCH_AXES", "MXFP8_SEARCH_AXES"]

_FWD = ("gemm1", "gemm2")
_DGRAD = ("dgrad1", "dgrad2")
_WGRAD = ("wgrad1", "wgrad2")
_BN = (64, 128, 192, 256)          # the shared solver's tile N choices (mokgen.plan.BN_CHOICES): UMMA N <= 256
_MIN_STAGES, _MAX_STAGES = 3, 7    # the plan's stage range (mokgen.plan_types); the kernels' ring takes >= 2
_RASTER_MAX = 64

# The forward axes tune searches on sm_100a (BF16): the tile N of each GEMM and the 2-CTA form. The schedule,
# consumers and A path have one value each (nothing to search); the stages and raster panels are derived.
SEARCH_AXES = ("gemm1_bn", "gemm2_bn", "cluster")
# An MXFP8 spec's forward is fixed by its form (mokgen.sm100.plan: tile N 128 per part, K tile 128, as many stages as
# fit, 1-CTA tiles): tune's one candidate is the plan itself.
MXFP8_SEARCH_AXES: tuple[str, ...] = ()
# The backward axes tune --train searches, one at a time around the plan it starts from: the launch streams and (an
# mxfp8 spec) the weight gradients' format. The dgrads' 2-CTA form is not one: it sets 256-row routing tiles for the
# whole entry (forward included), so it is no per-kernel variant of a plan.
BACKWARD_SEARCH_AXES = ("bwd_streams", "wgrad1_dtype", "wgrad2_dtype")

SM100 = ArchSpace(
    arch=rules.ARCH,
    templates="templates/sm100",
    knobs=(
        Knob("bn", _FWD, _BN, search=_BN,
             doc="tile N, the UMMA N (GEMM 1: bn/2 gate + bn/2 up columns, two accumulators); 2 x 2 x 128 TMEM "
                 "columns at most (double-buffered accumulators); derived by the sm_90a cost model. An mxfp8 spec's "
                 "is fixed (GEMM 1 2 x 128, GEMM 2 128: one scale atom of W per part)"),
        Knob("stages", _FWD, tuple(range(_MIN_STAGES, _MAX_STAGES + 1)),
             doc="the TMA ring's stages (A box + W boxes per stage); refused past what fits the sm_100a shared memory "
                 "beside the epilogue buffers (mokgen.sm100.rules; the 2-CTA form's CTA holds half of each W box, so "
                 "more fit); derived. An mxfp8 spec's are fixed: as many as fit"),
        Knob("consumer", _FWD, ("cooperative",), shared=True,
             doc="one CTA per 128-row UMMA tile, its accumulators in tensor memory drained by 4 epilogue warps (no "
                 "consumer warpgroups: nothing to ping-pong); the one value"),
        Knob("a_load", ("gemm1",), ("tma",),
             doc="GEMM 1's A: the rows gathered by the gather kernel (mxfp8: quant_mx_gather), read by TMA tiles; "
                 "the one path"),
        Knob("raster_group", _FWD, tuple(range(1, _RASTER_MAX + 1)), shared=True, search=None,
             doc="routing tiles per raster panel of the tile order (Cluster Launch Control hands the tiles out in "
                 "that order); derived as on sm_90a: the L2 fit"),
        Knob("cluster", _FWD, (1, 2), shared=True, search=(1, 2),
             doc="1: one CTA per 128-row tile (tcgen05.mma cta_group::1); 2: the 2-CTA form, a CTA pair (cluster "
                 "of 2 along M) on a 256-row tile (cta_group::2, each CTA loads half of every W box), which makes "
                 "the routing tile 256 rows for every kernel of the entry; BF16 only, never run on a GPU"),
        Knob("cluster", _DGRAD, (1, 2), search=None,
             doc="dgrads: 2 is their 2-CTA form (a CTA pair on a 256-row tile, W read N-major, each CTA's epilogue "
                 "on its own 128 rows; routing tiles of 256 rows), its own opt-in (a forward cluster=2 does not "
                 "imply it); BF16 training plans only, never run on a GPU; derived: 1"),
        Knob("schedule", ("plan",), ("chain",),
             doc="one launch per kernel (routing, gather, GEMM 1, GEMM 2, combine); the tcgen05 kernels have no "
                 "fused form; the one value"),
        Knob("dtype", _WGRAD, ("bf16", "mxfp8"), search=("bf16", "mxfp8"),
             doc="the weight gradient's operands: bf16 rows as read, or (mxfp8 specs) e4m3 with an e8m0 scale per "
                 "32 rows of a column on the block-scaled MMA, 128 x 128 tiles (mokgen.sm100.plan."
                 "TCGEN05_WGRAD_DTYPES); never run on a GPU; derived: bf16"),
        Knob("streams", ("bwd",), (1, 2), search=(1, 2),
             doc="the backward's launch streams: 2 runs the weight gradients (and the x-row gather) on a second "
                 "stream beside dgrad2 and the combine (one more [rows, hidden] bf16 buffer); same kernels, same "
                 "bits"),
        Knob("epi_n", ("plan",), (32, 64), search=None,
             doc="columns per epilogue slice (TMEM -> registers -> smem -> TMA store) of the forward GEMMs and the "
                 "dgrads; BF16 only (an mxfp8 spec's are fixed); derived: 32"),
        Knob("epi_stages", ("plan",), (2, 4), search=None,
             doc="epilogue smem buffers of the forward GEMMs and the dgrads (more: fewer ring stages fit); BF16 "
                 "only; derived: 2"),
    ),
    bm=rules.UMMA_M,
    min_stages=_MIN_STAGES,
    max_stages=_MAX_STAGES,
    search_axes=SEARCH_AXES,
    backward_axes=BACKWARD_SEARCH_AXES,
    dtype_axes=(("mxfp8", MXFP8_SEARCH_AXES),),
)
