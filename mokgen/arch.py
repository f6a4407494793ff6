"""The target architectures: one table every module reads (spec validation, plan, emit, build, cache, CLI).

Light on purpose (no sympy, no torch at import, no CuTe DSL): the runtime, the cache and the spec stage use it on
hosts that have no compiler. ``ARCHS`` maps an arch name to its :class:`Arch` (what the plan's cost model and the
spec's bounds need); :func:`resolve_arch` picks the target (``--arch``, ``$MOKGEN_ARCH``, the visible GPU).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["Arch", "ARCHS", "ARCH_NAMES", "ArchError", "arch_by_capability", "check_arch", "resolve_arch"]


@dataclass(frozen=True)
class Arch:
    name: str
    sms: int
    smem_per_cta: int  # bytes of shared memory one CTA can use
    regs_per_sm: int
    max_threads: int  # per CTA
    has_wgmma: bool
    has_tcgen05: bool
    peak_bf16_tflops: float  # dense bf16 tensor-core rate a well-tuned GEMM reaches
    hbm_tbps: float
    l2_bytes: int
    # the rest has defaults so that the positional fields above stay as they were
    capability: tuple[int, int] = (0, 0)  # CUDA compute capability of the GPUs this arch runs on
    device_bytes: int = 0  # memory of the largest GPU of this arch (bounds a spec's weights + workspace)
    ptx_features: tuple[str, ...] = ()  # what `mokgen compile`'s PTX report looks for
    templates: bool = False  # kernel templates exist (emit renders this arch)
    training: bool = False  # its backward kernels exist (plans carry a backward; entries can train)
    note: str = ""  # what `mokgen compile` says after building for this arch (what was verified where)
    peak_fp8_tflops: float = 0.0  # dense e4m3 tensor-core rate (0: the arch has no FP8 plan)


ARCHS: dict[str, Arch] = {
    # peak: the CuTe DSL dense GEMM measured on our H200; hbm: measured copy bandwidth; memory: H200 (141 GB).
    "sm_90a": Arch("sm_90a", 132, 232448 - 1024, 65536, 1024, True, False, 811.0, 4.27, 50 * 2**20,
                   capability=(9, 0), device_bytes=141 * 10**9,
                   ptx_features=("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier"), templates=True,
                   training=True,
                   # torch._scaled_mm 8192^3 e4m3, rowwise scales, measured on our H200 (fp8-h200.json, NOTES v14)
                   peak_fp8_tflops=1253.0),
    # B200 datasheet figures (180 GB), until we can measure one.
    "sm_100a": Arch("sm_100a", 148, 232448 - 1024, 65536, 1024, False, True, 2250.0, 8.0, 126 * 2**20,
                    capability=(10, 0), device_bytes=180 * 10**9,
                    ptx_features=("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier", "tcgen05",
                                  "clusterlaunchcontrol", "block_scale"), templates=True,
                    training=True,
                    note="sm_100a: the forward and the backward (tcgen05 GEMMs; routing, gather, combine) in BF16 and "
                         "in MXFP8 (dtype mxfp8: block-scaled tcgen05 forward GEMMs and dgrads, quantizers; BF16 "
                         "weight gradients), compiled here and never run on a Blackwell GPU: no correctness or speed "
                         "claim on hardware"),
}
ARCH_NAMES: tuple[str, ...] = tuple(ARCHS)


class ArchError(ValueError):
    """No usable target arch (unknown name, unsupported GPU, or nothing to go by)."""


def check_arch(arch: str) -> str:
    """``arch`` if it is one of :data:`ARCH_NAMES`, else :class:`ArchError` naming the choices."""
    if arch not in ARCHS:
        hint = ""
        if isinstance(arch, str) and arch and arch + "a" in ARCHS:
            hint = f" (the kernels need the arch-specific features: use {arch}a)"
        raise ArchError(f"unknown arch {arch!r}: expected one of {', '.join(ARCH_NAMES)}{hint}")
    return arch


def arch_by_capability(cap: tuple[int, int]) -> str | None:
    for a in ARCHS.values():
        if tuple(a.capability) == tuple(cap):
            return a.name
    return None


def resolve_arch(arch: str | None = None) -> str:
    """The target arch: ``arch`` if given, else ``$MOKGEN_ARCH``, else the visible GPU (compute capability
    9.0 -> sm_90a, 10.0 -> sm_100a), else :class:`ArchError` saying how to choose."""
    if arch:
        return check_arch(arch)
    env = os.environ.get("MOKGEN_ARCH", "").strip()
    if env:
        try:
            return check_arch(env)
        except ArchError as e:
            raise ArchError(f"$MOKGEN_ARCH: {e}") from None
    cap = None
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
            import torch
        if torch.cuda.is_available():
            cap = tuple(torch.cuda.get_device_capability())
    except Exception:
        cap = None
    if cap is not None:
        found = arch_by_capability(cap)
        if found is not None:
            return found
        raise ArchError(f"the visible GPU is sm_{cap[0]}{cap[1]}, which mokgen does not target "
                        f"({', '.join(ARCH_NAMES)}); pass --arch to cross-compile")
    raise ArchError(f"no target arch: pass --arch {ARCH_NAMES[0]} (or {', '.join(ARCH_NAMES[1:])}), set "
                    "MOKGEN_ARCH, or run where a Hopper/Blackwell GPU is visible")
