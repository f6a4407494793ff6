"""Runtime: load a built artifact, size the workspace, launch the kernels, expose them to torch.

Pieces (docs/contract.md, "Device workspace and kernels" and "runtime"):

* :func:`cap_rows` / :class:`Workspace`: the device buffers of one forward call (allocated per call).
* :func:`load_library`: ``libcute_dsl_runtime.so`` (RTLD_GLOBAL) then ``libmokgen.so`` through tvm-ffi.
* :class:`CompiledMoE`: validated calls ``routing -> gemm1 -> gemm2 -> combine`` on the current torch stream, no
  host sync on the hot path; routing errors are reported by ``check=True`` or :meth:`CompiledMoE.check_errors`.
* ``torch.ops.mokgen.moe_forward`` (inference) and ``torch.ops.mokgen.moe_forward_train`` (a custom op that
  also returns the per-call state the backward needs: z and the routing metadata) with its autograd formula,
  ``torch.ops.mokgen.moe_backward``: the generated backward kernels (:meth:`CompiledMoE.backward`), no host sync.
  Registered on first use (:func:`register_ops`), not at import.
* the driver (spec -> plan -> sources -> cache / build -> :class:`CompiledMoE`) is :mod:`mokgen.driver` and the
  ``nn.Module`` (:class:`mokgen.MoE`) is :mod:`mokgen.module`, both above this one: it imports neither them, nor
  the compiler (plan, emit, build), nor the CuTe DSL.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import importlib
import importlib.util
import itertools
import json
import os
import re
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from . import fp8_ops, kernels, launch, mx_ops, reference
from .arch import ARCHS
from .kernels import call
from .reference import LayerConfig, layer_config

__all__ = [
    "KERNELS",
    "MoEInputError",
    "RoutingError",
    "KernelTimeoutError",
    "ArchMismatchError",
    "LoadError",
    "cap_rows",
    "Workspace",
    "find_runtime_library",
    "load_library",
    "CompiledMoE",
    "Saved",
    "moe_forward",
    "register_ops",
    "dsl_runtime_hint",
    "kernels_of",
    "uses_gather_kernel",
    "gather_in_training",
]

KERNELS = ("routing", "gemm1", "gemm2", "combine")
FUSED_KERNELS = ("routing", "fused")
FUSED_SYNC_HEAD = 4        # int32 counters ahead of the per-M-tile ones (templates/sm90/fused.py.j2: SYNC_DONE1)
GATHER_KERNEL = "gather"   # plans whose GEMM 1 loads A by TMA (plan.gemm1.a_load == "tma"), and training
# the training kernels (chain schedule): GEMM 1 saving z, the backward's dgrad and wgrad GEMMs (the *_acc wgrads
# add into fp32 main_grad); the backward also runs gather (rows of dO and of x) and combine (dx over the slots)
TRAIN_KERNELS = ("gemm1_train", "dgrad1", "dgrad2", "wgrad1", "wgrad2", "wgrad1_acc", "wgrad2_acc")
RUNTIME_LIB_NAME = "libcute_dsl_runtime.so"
MODULE_LIB_NAME = "libmokgen.so"


class MoEInputError(ValueError):
    """An input of a mokgen call has the wrong shape, dtype, layout or device (raised before any launch)."""


class RoutingError(RuntimeError):
    """``topk_idx`` held expert ids outside ``[0, local_experts)``; the kernels dropped those slots."""


class KernelTimeoutError(RuntimeError):
    """A bounded dependency wait in the fused kernel expired (``sync[2]``); that call's output is wrong."""


class ArchMismatchError(RuntimeError):
    """The artifact was built for another GPU architecture than the device's."""


class LoadError(RuntimeError):
    """An artifact or the CuTe DSL runtime library could not be found or loaded."""


# --------------------------------------------------------------------------------------------------------------
# workspace


def cap_rows(tokens: int, topk: int, shared: int, groups: int, bm: int) -> int:
    """Worst-case padded rows: ``T*K + S*T + G*(BM-1)`` rounded up to BM (nothing is ever dropped)."""
    raw = tokens * topk + shared * tokens + groups * (bm - 1)
    return (raw + bm - 1) // bm * bm


uses_gather_kernel = kernels.uses_gather_kernel
gather_in_training = kernels.gather_in_training


def is_fused(plan: Any) -> bool:
    """True when the plan's schedule is "fused": routing, then one persistent kernel (GEMM 1, GEMM 2, combine)."""
    return getattr(plan, "schedule", "chain") == "fused"


def has_training(plan: Any) -> bool:
    """Does the plan's library hold the training kernels? (chain-schedule plans with a backward plan)"""
    return getattr(plan, "backward", None) is not None and not is_fused(plan)


def kernels_of(plan: Any) -> tuple[str, ...]:
    """The kernel names a plan's library exports (in launch order)."""
    if is_fused(plan):
        return FUSED_KERNELS
    fp8 = kernels.fp8_layer_kernels(plan) if is_fp8(plan) else ()
    if is_mxfp8(plan):   # x's rows gathered by quant_mx_gather; the training entry adds gather (bf16 rows for the
        if has_training(plan):   # BF16 weight gradients) and the backward's quantizers (and the MXFP8 wgrads')
            return ("routing",) + ((GATHER_KERNEL,) if gather_in_training(plan) else ()) \
                + ("gemm1", "gemm2", "combine") + MX_KERNELS + TRAIN_KERNELS + MX_TRAIN_KERNELS \
                + kernels.mx_wgrad_quantizers(plan)
        return KERNELS + MX_KERNELS
    if has_training(plan):
        return ("routing",) + ((GATHER_KERNEL,) if gather_in_training(plan) else ()) + ("gemm1", "gemm2", "combine") \
            + fp8 + TRAIN_KERNELS + (FP8_WGRAD_KERNELS if fp8_wgrads(plan) else ())
    if fp8:
        return KERNELS + fp8
    return ("routing", GATHER_KERNEL, "gemm1", "gemm2", "combine") if uses_gather_kernel(plan) else KERNELS


def group_layout(tile_group: torch.Tensor, groups: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(onehot [groups, tiles] bool: routing tile m belongs to group g (unused tiles are -1: no group), group_start
    [groups + 1] int32: the first row of each group in the padded row space, the weight gradients' K ranges),
    from the routing kernel's tile_group, on its device (no host sync)."""
    g_ids = torch.arange(groups, dtype=torch.int32, device=tile_group.device)
    onehot = tile_group.unsqueeze(0) == g_ids.unsqueeze(1)
    group_start = torch.zeros((groups + 1,), dtype=torch.int32, device=tile_group.device)
    torch.cumsum(onehot.sum(1, dtype=torch.int32) * bm, 0, out=group_start[1:])
    return onehot, group_start


def group_sums(onehot: torch.Tensor, tile_group: torch.Tensor, rows: torch.Tensor, bm: int,
               row_weight: torch.Tensor | None = None) -> torch.Tensor:
    """[groups, N] fp32: per group, the sum over its rows of ``rows`` [tiles * bm, N] (each times ``row_weight``
    [tiles * bm] where given) in a fixed order: within each routing tile, then over the group's tiles (the bias
    gradients: db1 from dz, db2 from the dO rows weighted by s). Unused tiles add nothing."""
    tiles = tile_group.shape[0]
    view = rows.view(tiles, bm, rows.shape[1])
    if row_weight is None:
        part = torch.sum(view, dim=1, dtype=torch.float32)
    else:
        part = torch.bmm(row_weight.view(tiles, 1, bm), view.float()).squeeze(1)
    return onehot.float() @ torch.where((tile_group >= 0).unsqueeze(1), part, 0.0)


def fp8_h_quant(plan: Any) -> bool:
    """Whether an FP8 plan's GEMM 1 quantizes h per 1 x 128 in its epilogue (plan ``gemm1.h_quant``; the
    training GEMM 1 must agree: one GEMM 1 plan for both on FP8)."""
    mode = getattr(getattr(plan, "gemm1", None), "h_quant", "kernel")
    if getattr(getattr(plan, "train_gemm1", None), "h_quant", mode) != mode:
        raise ValueError("plan: the inference and training GEMM 1 disagree on h_quant")
    return mode == "epilogue"


def fp8_reference_kernels(spec: Any, plan: Any, training: bool = True) -> dict[str, Callable[..., None]]:
    """The reference kernels (:func:`mokgen.reference.reference_kernels`) of FP8 plan `plan`: its bm, weight-gradient
    dtypes, where h is quantized and which GEMM 1 gathers its rows, all read off the plan (a stand-in for the
    plan's built library, e.g. to run it on the CPU)."""
    return reference.reference_kernels(spec, plan.bm, training=training, fp8_wgrads=fp8_wgrads(plan),
                                       fp8_h_quant=fp8_h_quant(plan), fp8_a_gather=kernels.fp8_a_gather(plan))


def slot_group_weights(slot_pos: torch.Tensor, tile_group: torch.Tensor, row_w: torch.Tensor, bm: int,
                       groups: int) -> torch.Tensor:
    """[T, groups] fp32: per token, the weight of each of its slots (``row_w`` of the slot's row: the routing
    weight, 1 for a shared expert) in the group the slot's row belongs to, 0 elsewhere; dropped slots
    (``slot_pos`` -1) add nothing. One scatter per slot column j = 0..K+S-1, each adding one value per token, so
    no two additions meet in one launch and the sums' order is fixed (two slots of one token in one group add in
    j order). With it db2 = Wᵀ · dO in fp32, over the T tokens instead of their K+S gathered rows."""
    T, J = slot_pos.shape
    pos = slot_pos.long()
    ok = pos >= 0
    posc = pos.clamp(min=0)
    grp = tile_group.long()[posc // bm].clamp(min=0)
    w = torch.where(ok, row_w[posc], 0.0)
    out = torch.zeros((T, groups), dtype=torch.float32, device=slot_pos.device)
    for j in range(J):
        out.scatter_add_(1, grp[:, j:j + 1], w[:, j:j + 1])
    return out


def _bm_of(plan: Any) -> int:
    bm = plan if isinstance(plan, int) else getattr(plan, "bm", None)
    if not isinstance(bm, int) or bm <= 0:
        raise TypeError(f"plan must have a positive int .bm (the M tile of the permuted row space), got {bm!r}")
    return bm


@dataclass(eq=False)
class Workspace:
    """Device buffers of one forward call of T tokens (docs/contract.md, "Device workspace").

    Allocated per call (:meth:`allocate`) from torch's caching allocator on the current stream and dropped when
    the call returns: the allocator is stream-ordered, so a buffer is handed out again only to work that runs
    after the call's kernels on that stream. Calls on different streams, layers sharing one
    :class:`CompiledMoE` and CUDA-graph captures (which allocate from the graph's pool) never share one.

    Initial contents: ``meta`` 0 and, fused schedule, ``sync`` 0 (``meta[1]`` and ``sync[2]`` are error flags the
    kernels only ever set; the routing kernel zeroes the rest of ``sync``); everything else uninitialized. The
    routing kernel writes ``meta[0]``, all of ``tile_group`` and ``slot_pos`` and ``row_src`` / ``row_w`` of the
    used rows before any kernel reads them, and the GEMMs, gather and combine read only used rows.
    """

    tokens: int
    bm: int
    cap_rows: int
    max_m_tiles: int
    row_src: torch.Tensor     # [cap_rows] int32
    row_w: torch.Tensor       # [cap_rows] fp32
    tile_group: torch.Tensor  # [max_m_tiles] int32
    meta: torch.Tensor        # [4] int32, zeroed
    slot_pos: torch.Tensor    # [T, K+S] int32
    h: torch.Tensor           # [cap_rows, I] bf16
    ys: torch.Tensor          # [cap_rows, H] bf16
    xg: torch.Tensor | None = None  # [cap_rows, H] bf16 gathered rows of x (only with a gather kernel)
    sync: torch.Tensor | None = None  # [4 + max_m_tiles] int32 task / dependency counters (fused schedule only),
    #                                   zeroed; sync[2] is the wait-timeout flag

    ZEROED = ("meta", "sync")   # the only buffers whose initial contents the kernels rely on

    @staticmethod
    def layout(spec_or_cfg: Any, plan: Any, tokens: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """{name: (shape, dtype)} of every buffer for ``tokens`` rows (bm from the plan; ``plan`` may be a bare
        int bm). ``xg`` only when the plan uses a gather kernel, ``sync`` only with the fused schedule."""
        c = layer_config(spec_or_cfg)
        bm = _bm_of(plan)
        cap = cap_rows(tokens, c.topk, c.shared_experts, c.groups, bm)
        extra = {"xg": ((cap, c.hidden), torch.bfloat16)} if uses_gather_kernel(plan) else {}
        if is_fused(plan):
            extra["sync"] = ((FUSED_SYNC_HEAD + cap // bm,), torch.int32)
        return {**extra,
            "row_src": ((cap,), torch.int32),
            "row_w": ((cap,), torch.float32),
            "tile_group": ((cap // bm,), torch.int32),
            "meta": ((4,), torch.int32),
            "slot_pos": ((tokens, c.topk + c.shared_experts), torch.int32),
            "h": ((cap, c.ffn), torch.bfloat16),
            "ys": ((cap, c.hidden), torch.bfloat16),
        }

    @classmethod
    def allocate(cls, spec_or_cfg: Any, plan: Any, tokens: int, device: torch.device | str) -> "Workspace":
        """Fresh buffers on ``device`` (its current stream): :attr:`ZEROED` ones zero-filled (one small fill
        kernel each), the others ``torch.empty``. Inside a CUDA-graph capture they come from the graph's pool
        and the fills are part of the graph (every replay starts from zeroed flags)."""
        lay = cls.layout(spec_or_cfg, plan, tokens)
        bufs = {name: (torch.zeros if name in cls.ZEROED else torch.empty)(shape, dtype=dtype, device=device)
                for name, (shape, dtype) in lay.items()}
        bm = _bm_of(plan)
        cap = lay["row_src"][0][0]
        return cls(tokens=tokens, bm=bm, cap_rows=cap, max_m_tiles=cap // bm, **bufs)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.row_src, self.row_w, self.tile_group, self.meta,
                                                          self.slot_pos, self.h, self.ys, self.xg, self.sync)
                   if t is not None)


@dataclass(eq=False)
class Saved:
    """What one training forward keeps for its backward (allocated per call from torch's caching allocator, so
    calls on any streams, layers sharing one CompiledMoE and CUDA-graph captures never share it): the
    pre-activation ``z [cap_rows, 2I]`` bf16 in W1's row order and the call's routing metadata. The caller's x,
    topk_weight and weights are saved by reference, not copied."""

    z: torch.Tensor
    row_src: torch.Tensor
    row_w: torch.Tensor
    tile_group: torch.Tensor
    meta: torch.Tensor
    slot_pos: torch.Tensor
    # FP8 wgrad1 with plan bwd_x_cols "forward": the gathered x rows' 128 x 1 column form, quantized by the training
    # forward's x quantizer (quant_both_gather) beside GEMM 1's rows: e4m3 bytes [H, cap] and scales [cap / 128, H]
    xt: torch.Tensor | None = None
    xts: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.z, self.row_src, self.row_w, self.tile_group, self.meta, self.slot_pos) + (
            (self.xt, self.xts) if self.xt is not None else ())

    def op_tensors(self) -> tuple[torch.Tensor, ...]:
        """The custom ops' fixed form (torch.ops.mokgen.moe_forward_train's outputs after y): xt / xts as empty
        tensors where this forward did not make them."""
        base = self.tensors()[:6]
        if self.xt is not None:
            return base + (self.xt, self.xts)
        return base + (self.z.new_empty((0,), dtype=torch.uint8), self.z.new_empty((0,), dtype=torch.float32))

    @classmethod
    def from_op(cls, z, row_src, row_w, tile_group, meta, slot_pos, xt, xts) -> "Saved":
        """The inverse of :meth:`op_tensors`."""
        cols = xt.numel() > 0
        return cls(z, row_src, row_w, tile_group, meta, slot_pos, xt if cols else None, xts if cols else None)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


# --------------------------------------------------------------------------------------------------------------
# loading artifacts

_LOAD_LOCK = threading.Lock()
_RUNTIME_HANDLES: dict[str, ctypes.CDLL] = {}
_MODULES: dict[str, Any] = {}
_DSL_RUNTIME: list[str] = []   # the DSL's runtime library steps 2-3 of find_runtime_library found (dsl_runtime_hint)


def _file_id(path: str) -> dict[str, Any] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return {"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def dsl_runtime_hint() -> dict[str, Any] | None:
    """``{path, size, mtime_ns}`` of the runtime library found in the CuTe DSL install in this process (None if
    none was): the warm-start index keeps it so that a later process finds it without importing the DSL."""
    return _file_id(_DSL_RUNTIME[0]) if _DSL_RUNTIME else None


def find_runtime_library(entry_dir: str | os.PathLike | None = None, *,
                         dsl_hint: Mapping[str, Any] | None = None) -> str:
    """Path of ``libcute_dsl_runtime.so``, searched in this order:

    1. ``$MOKGEN_RUNTIME_LIB`` (an explicit override);
    2. ``dsl_hint``: the CuTe DSL install's runtime library as :func:`dsl_runtime_hint` named it in an earlier
       process (the warm-start index keeps it), while that file still has its size and mtime: the DSL is not
       imported (nor need it be importable);
    3. the CuTe DSL install (``cutlass.cute.runtime.find_runtime_libraries``; importing the DSL takes ~0.5 s);
    4. the copy a packed cache ships: ``<entry_dir>/../../runtime/libcute_dsl_runtime.so``.
    """
    env = os.environ.get("MOKGEN_RUNTIME_LIB")
    if env:
        if not Path(env).is_file():
            raise LoadError(f"MOKGEN_RUNTIME_LIB={env} is not a file")
        return env
    if dsl_hint and isinstance(dsl_hint.get("path"), str) and _file_id(dsl_hint["path"]) == dict(dsl_hint):
        _DSL_RUNTIME[:] = [dsl_hint["path"]]
        return dsl_hint["path"]
    dsl_note = "the CuTe DSL is not installed"
    try:
        dsl = importlib.util.find_spec("cutlass") is not None
    except (ImportError, ValueError):   # as mokgen.cache._compiler_available: not importable is not installed
        dsl = False
    if dsl:
        try:
            from cutlass.cute.runtime import find_runtime_libraries

            for p in find_runtime_libraries(enable_tvm_ffi=True):
                if os.path.basename(p) == RUNTIME_LIB_NAME and os.path.isfile(p):
                    _DSL_RUNTIME[:] = [p]
                    return p
            dsl_note = "the CuTe DSL install has no " + RUNTIME_LIB_NAME
        except Exception as exc:  # a broken DSL install must not hide a packed runtime
            dsl_note = f"the CuTe DSL failed to import ({type(exc).__name__}: {exc})"
    if entry_dir is not None:
        packed = Path(entry_dir).resolve().parent.parent / "runtime" / RUNTIME_LIB_NAME
        if packed.is_file():
            return str(packed)
    raise LoadError(
        f"{RUNTIME_LIB_NAME} not found ({dsl_note}; no packed copy at <cache>/runtime/): install "
        f"'mokgen[compiler]', unpack a cache that ships its runtime, or set MOKGEN_RUNTIME_LIB=/path/to/"
        f"{RUNTIME_LIB_NAME}")


def _load_runtime(entry_dir: str | os.PathLike | None, dsl_hint: Mapping[str, Any] | None = None) -> None:
    if _RUNTIME_HANDLES:  # one runtime per process; the first one loaded serves every module
        return
    path = find_runtime_library(entry_dir, dsl_hint=dsl_hint)
    try:
        _RUNTIME_HANDLES[path] = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        raise LoadError(f"could not load {path}: {exc}") from exc


def load_library(entry_dir: str | os.PathLike, kernels: tuple[str, ...] = KERNELS, *,
                 runtime_hint: Mapping[str, Any] | None = None) -> dict[str, Callable[..., Any]]:
    """Load ``<entry_dir>/libmokgen.so`` and return ``{kernel name: tvm-ffi function}`` for ``kernels``.

    Loads ``libcute_dsl_runtime.so`` with RTLD_GLOBAL first (see :func:`find_runtime_library`, which takes
    ``runtime_hint`` as its ``dsl_hint``). A library is loaded once per process and kept alive.
    """
    entry = Path(entry_dir)
    lib = entry / MODULE_LIB_NAME
    if not lib.is_file():
        raise LoadError(f"{lib} not found: {entry} is not a built mokgen cache entry "
                        f"(expected {MODULE_LIB_NAME} and meta.json)")
    with _LOAD_LOCK:
        _load_runtime(entry, runtime_hint)
        key = str(lib.resolve())
        mod = _MODULES.get(key)
        if mod is None:
            import tvm_ffi

            try:
                mod = tvm_ffi.load_module(key)
            except Exception as exc:
                raise LoadError(f"tvm_ffi could not load {lib}: {exc}") from exc
            _MODULES[key] = mod
    missing = [n for n in kernels if not mod.implements_function(n)]
    if missing:
        raise LoadError(f"{lib} does not export kernel(s) {missing}; expected {list(kernels)}")
    return {n: mod[n] for n in kernels}


def _read_entry_meta(entry_dir: Path | None) -> dict:
    if entry_dir is None:
        return {}
    p = Path(entry_dir) / "meta.json"
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return {}


# --------------------------------------------------------------------------------------------------------------
# architecture

_ARCH_RE = re.compile(r"^sm_(\d+)([af]?)$")
_DEVICE_ARCH: dict[int, str] = {}


def _device_arch(device: torch.device) -> str | None:
    """``sm_XY`` of a CUDA device (cached), None for other devices. Tests monkeypatch this."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    arch = _DEVICE_ARCH.get(index)
    if arch is None:
        major, minor = torch.cuda.get_device_capability(index)
        arch = _DEVICE_ARCH[index] = f"sm_{major}{minor}"
    return arch


def _arch_number(arch: str) -> str:
    m = _ARCH_RE.match(arch)
    if not m:
        raise ValueError(f"arch must look like 'sm_90a' or 'sm_100a', got {arch!r}")
    return m.group(1)


# --------------------------------------------------------------------------------------------------------------
# the compiled layer

_REGISTRY: dict[int, "CompiledMoE"] = {}
_IDS = itertools.count(1)


def _lookup(moe_id: int) -> "CompiledMoE":
    try:
        return _REGISTRY[moe_id]
    except KeyError:
        raise RuntimeError(f"mokgen: no CompiledMoE with registry id {moe_id} (was it closed?)") from None


_DT = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.int32: "int32", torch.int64: "int64"}


def _fmt(t: torch.Tensor) -> str:
    return f"[{', '.join(map(str, t.shape))}] {_DT.get(t.dtype, str(t.dtype).replace('torch.', ''))}"


@dataclass(eq=False)
class _DeviceState:
    """What a :class:`CompiledMoE` keeps per device across calls (never a call's buffers)."""

    errs: torch.Tensor    # [2, 2] int32: errs[0, 1] routing error, errs[1, 1] fused-kernel timeout (sticky until
    #                       check_errors); column 0 takes the writes of clean calls
    one: torch.Tensor     # [] int32 1, the value _record_errors writes
    dummy: torch.Tensor   # [1, 1] fp32, passed as b1 / b2 when the spec has no bias (never read by the kernels)


# ---- FP8 operands (spec dtype "fp8"): e4m3 with power-of-two blockwise scales, by the quant_* kernels -------
# what an FP8 layer launches besides its GEMMs: kernels.fp8_layer_kernels (mokgen/fp8_ops.py)
# ... and the column quantizers of FP8 weight gradients (plan wgrad*_dtype "fp8"): s a (used rows), x (gathered
# rows), transposed e4m3 with 128 x 1 scales; dz and dO along both dims from one read (quant_both_*: the rows for
# the dgrads, the columns for the weight gradients)
FP8_WGRAD_KERNELS = kernels.FP8_WGRAD_KERNELS


fp8_wgrads = kernels.fp8_wgrads


def is_fp8(plan: Any) -> bool:
    """Does the plan's spec run the FP8 forward (dtype "fp8")?"""
    return getattr(getattr(plan, "spec", None), "dtype", "bf16") == "fp8"


# ---- MXFP8 operands (spec dtype "mxfp8", sm_100a): e4m3 with e8m0 codes per 32 along K, packed in SF atoms, by
# the quant_mx_* kernels (mokgen/mx_ops.py); the forward's and the backward's (the weights' column forms, dz)
MX_KERNELS = mx_ops.MX_FORWARD_QUANT
MX_TRAIN_KERNELS = mx_ops.MX_BACKWARD_QUANT


def is_mxfp8(plan: Any) -> bool:
    """Does the plan's spec run MXFP8 (dtype "mxfp8")?"""
    return getattr(getattr(plan, "spec", None), "dtype", "bf16") == "mxfp8"


def _weight_key(w: torch.Tensor) -> tuple:
    """What a quantized copy of weight ``w`` was made from: its version counter (bumped by every in-place update),
    storage, shape and dtype. A copy whose key differs from the weight's now is stale."""
    return (w._version, w.data_ptr(), tuple(w.shape), w.dtype)


def _capturing(t: torch.Tensor) -> bool:
    """Is a CUDA graph being captured on the current stream of ``t``'s device (never for CPU tensors)?"""
    return t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class _MxWeights:
    """The MXFP8 copies of the BF16 master weights, per (weight tensor, quantizer kernel): ``quant_mx_w1`` /
    ``quant_mx_w2`` (the forward GEMMs' K-major form) and ``quant_mx_w1_cols`` / ``quant_mx_w2_cols`` (the
    dgrads' column form), re-made when the tensor's version counter, storage or shape changes, as
    :class:`_Fp8Weights`; keyed weakly by the tensor object; nothing cached inside a CUDA-graph capture."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[int, str], tuple] = {}   # (id(w), kernel) -> (weakref to w, key, (q, sf))

    def get(self, fns: Mapping[str, Callable[..., Any]], w: torch.Tensor, kernel: str) -> tuple:
        import weakref

        make = mx_ops.quantize_w_cols if kernel.endswith("_cols") else mx_ops.quantize_w
        if _capturing(w):
            return make(fns, w, kernel)
        key = _weight_key(w)
        hit = self._by_key.get((id(w), kernel))
        if hit is not None and hit[0]() is w and hit[1] == key:
            return hit[2]
        made = make(fns, w.detach(), kernel)
        by_key = self._by_key

        def drop(ref, k=(id(w), kernel)):
            if k in by_key and by_key[k][0] is ref:
                del by_key[k]

        by_key[(id(w), kernel)] = (weakref.ref(w, drop), key, made)
        return made


class _Fp8Weights:
    """The e4m3 copies of the BF16 master weights one CompiledMoE has been called with, per weight tensor:
    re-quantized when the tensor's version counter (bumped by every in-place update, ``optimizer.step()``
    included), storage or shape changes, so a copy is never stale. Keyed by the tensor object (weakly: a dropped
    weight drops its copy); another tensor object with the same storage gets its own copy.
    Inside a CUDA-graph capture nothing is cached across calls: the quantization is captured and reruns on every
    replay. Within one captured training step the backward takes the copies its own forward made (``step``: the
    forward's saved z, which identifies the call), as an eager step takes them from the cache, instead of capturing
    the quantization a second time (it cost a replay of qwen3-30b-a3b-fp8's step 1.3 ms of 4.8 on an H100:
    bench/NOTES.md v35). Those are held only from the captured forward to its backward, and dropped at the first
    call outside a capture."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple] = {}   # id(w) -> (weakref to w, key, (q, s) or (q, s, qt, st))
        # (z.data_ptr(), id(w)) -> (weakref to w, key, (q, s, qt, st)): a captured training forward's copies
        self._captured: dict[tuple[int, int], tuple] = {}

    def get(self, fns: Mapping[str, Callable[..., Any]], w: torch.Tensor, transpose: bool = False,
            step: torch.Tensor | None = None, backward: bool = False) -> tuple:
        """``(q, s)`` of w, or with ``transpose`` ``(q, s, qt, st)`` (also the K-major copy of w transposed, which
        the FP8 dgrad GEMMs read), from the cache when w has not changed since they were made. ``step`` (a
        training call's saved z) ties a captured forward's copies (``transpose``, ``backward`` False: kept) to
        that call's captured backward (``backward`` True: taken)."""
        import weakref

        if _capturing(w):
            return self._in_capture(fns, w, transpose, step, backward)
        self._captured.clear()
        key = _weight_key(w)
        hit = self._by_id.get(id(w))
        if hit is not None and hit[0]() is w and hit[1] == key and (len(hit[2]) == 4 or not transpose):
            return hit[2] if transpose else hit[2][:2]
        made = fp8_ops.quantize_w(fns, w.detach(), transpose=transpose)
        by_id = self._by_id

        def drop(ref, i=id(w)):
            if i in by_id and by_id[i][0] is ref:
                del by_id[i]

        by_id[id(w)] = (weakref.ref(w, drop), key, made)
        return made

    def _in_capture(self, fns: Mapping[str, Callable[..., Any]], w: torch.Tensor, transpose: bool,
                    step: torch.Tensor | None, backward: bool) -> tuple:
        import weakref

        if step is None:
            return fp8_ops.quantize_w(fns, w, transpose=transpose)
        k, key = (step.data_ptr(), id(w)), _weight_key(w)
        if backward:
            hit = self._captured.pop(k, None)
            if hit is not None and hit[0]() is w and hit[1] == key:
                return hit[2] if transpose else hit[2][:2]
            return fp8_ops.quantize_w(fns, w, transpose=transpose)
        made = fp8_ops.quantize_w(fns, w, transpose=transpose)
        if transpose:   # a training forward: its backward reads the transposed copies
            self._captured[k] = (weakref.ref(w), key, made)
        return made


class CompiledMoE:
    """One rank's MoE layer bound to a built artifact.

    ``CompiledMoE(spec, plan, entry_dir, arch=None)`` loads ``entry_dir/libmokgen.so``. ``functions=`` injects
    kernels instead (a mapping with the :data:`KERNELS`, e.g. ``reference.reference_kernels(spec, bm)``); with
    ``allow_cpu=True`` CPU tensors are accepted (tests). ``arch`` defaults to the entry's ``meta.json``.
    ``runtime_hint``: see :func:`find_runtime_library` (``dsl_hint``).

    Every call owns its buffers: the forward's :class:`Workspace` and the training forward's :class:`Saved` are
    allocated per call from torch's caching allocator on the current stream, so one object serves any number of
    layers of its spec on any number of streams, and CUDA graphs captured from it (their buffers come from the
    graph's pool). What outlives a call is per device: the sticky error flags :meth:`check_errors` reads and a
    dummy bias, created by the first call on that device, which must run outside CUDA-graph capture.
    """

    def __init__(self, spec: Any, plan: Any, entry_dir: str | os.PathLike | None = None, *,
                 arch: str | None = None, functions: Mapping[str, Callable[..., Any]] | None = None,
                 allow_cpu: bool = False, runtime_hint: Mapping[str, Any] | None = None):
        self.spec = spec
        self.plan = plan
        self.cfg: LayerConfig = layer_config(spec)
        self.name = str(getattr(spec, "name", None) or (spec.get("name") if isinstance(spec, Mapping) else None)
                        or "moe")
        self.bm = _bm_of(plan)
        self.mx = self.cfg.dtype == "mxfp8"
        if self.mx != is_mxfp8(plan):   # the launches follow the spec's dtype, the kernel set the plan's
            raise ValueError(f"mokgen {self.name}: the spec's dtype is {self.cfg.dtype!r} but the plan's is "
                             f"{getattr(getattr(plan, 'spec', None), 'dtype', None)!r}: an MXFP8 layer needs the "
                             "plan of its mxfp8 spec (its kernel set), and an mxfp8 plan an mxfp8 spec")
        self.entry_dir = Path(entry_dir) if entry_dir is not None else None
        meta = _read_entry_meta(self.entry_dir)
        self.arch = arch or meta.get("arch")
        if self.arch is not None:
            _arch_number(self.arch)
        self.kernels = kernels_of(plan)
        self.gather = uses_gather_kernel(plan)
        self.gather_train = uses_gather_kernel(plan, training=True)
        self.fused = is_fused(plan)
        if functions is None:
            if self.entry_dir is None:
                raise ValueError("CompiledMoE needs entry_dir (a built cache entry) or functions=")
            functions = load_library(self.entry_dir, self.kernels, runtime_hint=runtime_hint)
        missing = [n for n in self.kernels if n not in functions]
        if missing:
            raise ValueError(f"functions lacks kernel(s) {missing}")
        # training needs the training kernels (a built entry of a chain plan has them; injected functions may)
        self.fp8_wgrads = fp8_wgrads(plan)
        self.mx_wgrads = kernels.mx_wgrads(plan)   # plan wgrad*_dtype=mxfp8
        train = TRAIN_KERNELS + ((GATHER_KERNEL,) if gather_in_training(plan) else ()) \
            + (MX_TRAIN_KERNELS + kernels.mx_wgrad_quantizers(plan) if self.mx else ()) \
            + (FP8_WGRAD_KERNELS if self.fp8_wgrads else ())
        self.trainable = not self.fused and all(n in functions for n in train)
        self._fns = {n: functions[n] for n in self.kernels + (train if self.trainable else ())}
        backward = getattr(plan, "backward", None)
        # dgrad1's router-gradient partials: one column per N tile of its plan (reference kernels: one)
        self.ds_tiles = backward.dgrad1.n_tiles if backward is not None else 1
        # the backward's launch streams (plan.backward.streams): 2 = the weight gradients on a side stream
        self._bwd_streams = getattr(backward, "streams", 1) if backward is not None else 1
        self._side_streams: dict[torch.device, Any] = {}
        self.allow_cpu = allow_cpu
        self._sm_count: dict[tuple[str, int], int] = {}
        self._states: dict[torch.device, _DeviceState] = {}   # per device: sticky error flags, dummy bias
        self._warned_int64 = False
        self.masked = False   # masking mode (masked_view): ids >= local_experts are masked slots, not errors
        self._masked_view: "CompiledMoE | None" = None
        self.fp8 = self.cfg.dtype == "fp8"
        # FP8: GEMM 1 writes h's e4m3 rows and scales itself (plan gemm1.h_quant "epilogue", inference and training
        # GEMM 1 alike)
        self.fp8_h_quant = self.fp8 and fp8_h_quant(plan)
        # FP8: the GEMM 1 kernels ("gemm1", "gemm1_train") that gather x's per-token e4m3 rows themselves (plan
        # a_load "gather"; x quantized once per token by quant_rows); the others read quant_rows_gather's rows
        self.fp8_a_gather = kernels.fp8_a_gather(plan) if self.fp8 else ()
        # FP8 wgrad1's x columns made by the training forward's x quantizer (plan bwd_x_cols "forward") and saved
        self.x_cols_fwd = "wgrad1" in self.fp8_wgrads and getattr(backward, "x_cols", "backward") == "forward"
        self._fp8_weights = _Fp8Weights()
        self._mx_weights = _MxWeights()
        self._registry_id = next(_IDS)
        _REGISTRY[self._registry_id] = self

    def __repr__(self) -> str:
        return f"CompiledMoE({self.name!r}, arch={self.arch!r}, bm={self.bm}, entry={str(self.entry_dir)!r})"

    @property
    def registry_id(self) -> int:
        """The id the ``torch.ops.mokgen.*`` ops take to find this object (registers the ops on first use:
        :func:`register_ops`)."""
        register_ops()
        return self._registry_id

    def close(self) -> None:
        """Drop the per-device state and the registry entry (the custom op can no longer reach this object)."""
        self._states.clear()
        _REGISTRY.pop(self._registry_id, None)
        if self._masked_view is not None:
            self._masked_view.close()

    def masked_view(self) -> "CompiledMoE":
        """The same kernels in **masking mode** (one view per object, with its own registry id).

        Masking mode is for callers whose routing marks slots that this rank must not compute (transformers'
        expert-parallel convention: a slot routed to another rank's expert arrives with id ``local_experts`` and
        weight 0): every ``topk_idx`` value ``>= local_experts`` is a *masked* slot. The routing kernel drops it
        like any out-of-range id (no rows, no GEMM work; it contributes exactly 0 to y and gets zero gradient,
        its ``topk_weight`` included), and it is not reported: ``check_errors`` and ``check=True`` report only
        negative ids. Objects not in masking mode keep reporting every id outside ``[0, local_experts)``.
        Cost: one small reduction over ``topk_idx`` per call (the negative-id flag), no host sync. The view
        shares the kernels, the per-device state (sticky error flags) and the compiled artifact."""
        if self.masked:
            return self
        v = self._masked_view
        if v is None:
            v = copy.copy(self)   # shallow: _fns, _states, _sm_count are shared with this object
            v.masked = True
            v._masked_view = None
            v._registry_id = next(_IDS)
            _REGISTRY[v._registry_id] = v
            self._masked_view = v
        return v

    # ---- per-device state and errors --------------------------------------------------------------------------

    def _state(self, device: torch.device) -> "_DeviceState":
        """The tensors of ``device`` that outlive a call (:class:`_DeviceState`), created on its first call. A
        CUDA-graph capture must not create them (the graph would re-zero the flags on every replay)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        st = self._states.get(device)
        if st is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"mokgen {self.name}: call the layer once on {device} outside CUDA-graph capture first (that "
                    "call creates the device's error flags, which captured calls report to; the buffers of a "
                    "call are allocated per call, from the graph's pool while capturing)")
            st = self._states[device] = _DeviceState(
                errs=torch.zeros((2, 2), dtype=torch.int32, device=device),
                one=torch.ones((), dtype=torch.int32, device=device),
                dummy=torch.zeros((1, 1), dtype=torch.float32, device=device))
        return st

    @staticmethod
    def _record_errors(st: "_DeviceState", flag: torch.Tensor, sync: torch.Tensor | None = None) -> None:
        """Fold one call's error flags (``flag``: [1] int32 0 or 1, the routing error, see :meth:`_routing_flag`;
        fused ``sync[2]``) into the device's sticky flags, stream-ordered after the call's kernels, without a
        host sync: ``errs[0, flag[0]] = 1`` (and ``errs[1, sync[2]] = 1``). Only the constant 1 is ever written,
        and only at the indexed element, so calls on concurrent streams never lose each other's flags (a
        read-modify-write such as ``max`` could)."""
        st.errs[0].index_put_((flag,), st.one)
        if sync is not None:
            st.errs[1].index_put_((sync[2:3],), st.one)

    def _routing_flag(self, meta: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
        """[1] int32, 1 when this call's routing was in error: ``meta[1]`` (the routing kernel saw an id outside
        ``[0, local_experts)``), or in masking mode a negative id (ids >= local_experts are masked slots, which
        the kernel drops but which are no error). No host sync."""
        if not self.masked:
            return meta[1:2]
        return (topk_idx < 0).any().to(torch.int32).reshape(1)

    def check_errors(self) -> None:
        """Raise :class:`KernelTimeoutError` if a fused-kernel wait of any call since the last check timed out,
        else :class:`RoutingError` if any call since the last check saw an out-of-range ``topk_idx``.

        Each call's kernels set the flags in its own buffers (``meta[1]``, ``sync[2]``); the call then folds them
        into its device's sticky flags (forward and training calls, every stream, graph replays), which stay set
        until this method reads and clears them (one host sync per device). Calls made with ``check=True``
        report their own errors and are not counted here.
        """
        routing = timed_out = False
        for dev, st in list(self._states.items()):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)   # the calls may have run on any stream of that device
            r, t = (bool(v) for v in st.errs[:, 1].tolist())
            if r or t:
                st.errs.zero_()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)   # cleared before any later call can set it again
            routing |= r
            timed_out |= t
        if timed_out:
            also = " Routing errors were also flagged." if routing else ""
            raise KernelTimeoutError(self._timeout_msg() + f" (a call since the last check).{also}")
        if routing:
            raise RoutingError(
                f"mokgen {self.name}: since the last check, call(s) saw topk_idx values outside "
                f"[0, {self.cfg.local_experts}) (or, in masking mode, negative values); those slots were dropped "
                "(contributed 0). Call with check=True to find the call and the bad indices.")

    def _count_bad(self, topk_idx: torch.Tensor) -> str:
        E = self.cfg.local_experts
        if self.masked:
            bad = topk_idx < 0
            n = int(bad.sum())
            if n == 0:
                return "0 bad indices found in topk_idx"
            t, k = (int(v) for v in bad.nonzero()[0])
            return (f"{n} negative topk_idx value(s) (masking mode: ids >= {E} are masked slots, negative ids are "
                    f"errors), e.g. topk_idx[{t}, {k}] = {int(topk_idx[t, k])}")
        bad = (topk_idx < 0) | (topk_idx >= E)
        n = int(bad.sum())
        if n == 0:
            return "0 bad indices found in topk_idx (flag set by the kernel)"
        t, k = (int(v) for v in bad.nonzero()[0])
        return f"{n} topk_idx value(s) outside [0, {E}), e.g. topk_idx[{t}, {k}] = {int(topk_idx[t, k])}"

    # ---- validation -------------------------------------------------------------------------------------------

    def _err(self, msg: str) -> MoEInputError:
        return MoEInputError(f"mokgen {self.name}: {msg}")

    def validate(self, x, topk_idx, topk_weight, w1, w2, b1=None, b2=None, out=None) -> torch.Tensor:
        """Check every input against the spec; return ``topk_idx`` as int32 (int64 is converted, with a
        one-time warning). Raises :class:`MoEInputError` / :class:`ArchMismatchError`; never syncs."""
        c = self.cfg
        H, I, G, K = c.hidden, c.ffn, c.groups, c.topk
        named = {"x": x, "topk_idx": topk_idx, "topk_weight": topk_weight, "w1": w1, "w2": w2}
        if c.bias:
            for n, b in (("b1", b1), ("b2", b2)):
                if b is None:
                    raise self._err(f"the spec has bias=true: {n} is required")
            named.update(b1=b1, b2=b2)
        else:
            for n, b in (("b1", b1), ("b2", b2)):
                if b is not None:
                    raise self._err(f"the spec has bias=false: {n} must be None")
        if out is not None:
            named["out"] = out
        for n, t in named.items():
            if not isinstance(t, torch.Tensor):
                raise self._err(f"{n} must be a torch.Tensor, got {type(t).__name__}")
        if x.dim() != 2:
            raise self._err(f"x must be [T, H={H}] bfloat16, got {_fmt(x)}")
        T = x.shape[0]
        want = {"x": ((T, H), (torch.bfloat16,)),
                "topk_idx": ((T, K), (torch.int32, torch.int64)),
                "topk_weight": ((T, K), (torch.float32,)),
                "w1": ((G, 2 * I, H), (torch.bfloat16,)),
                "w2": ((G, H, I), (torch.bfloat16,)),
                "b1": ((G, 2 * I), (torch.float32,)),
                "b2": ((G, H), (torch.float32,)),
                "out": ((T, H), (torch.bfloat16,))}
        dims = {"x": "T, H", "topk_idx": "T, K", "topk_weight": "T, K", "w1": "G, 2I, H", "w2": "G, H, I",
                "b1": "G, 2I", "b2": "G, H", "out": "T, H"}
        for n, t in named.items():
            shape, dtypes = want[n]
            if tuple(t.shape) != shape or t.dtype not in dtypes:
                exp = f"[{', '.join(map(str, shape))}] {' or '.join(_DT[d] for d in dtypes)}"
                raise self._err(f"{n} must be {exp} ([{dims[n]}] with T={T}, H={H}, I={I}, G={G}, K={K}), "
                                f"got {_fmt(t)}")
        for n, t in named.items():
            if not t.is_contiguous():
                raise self._err(f"{n} must be contiguous (call .contiguous()), got strides {tuple(t.stride())}")
        dev = x.device
        for n, t in named.items():
            if t.device != dev:
                raise self._err(f"all inputs must be on one device: x is on {dev}, {n} on {t.device}")
        if dev.type != "cuda" and not self.allow_cpu:
            raise self._err(f"inputs must be CUDA tensors, got {dev}")
        dev_arch = _device_arch(dev)
        if dev_arch is not None and self.arch is not None and _arch_number(self.arch) != _arch_number(dev_arch):
            raise ArchMismatchError(
                f"mokgen {self.name}: the kernels were built for {self.arch} but {dev} is {dev_arch}; compile for "
                f"this GPU: mokgen.compile(spec, arch='{dev_arch}a') (or set MOKGEN_ARCH={dev_arch}a)")
        if topk_idx.dtype == torch.int64:
            if not self._warned_int64:
                self._warned_int64 = True
                warnings.warn(f"mokgen {self.name}: topk_idx is int64; converting to int32 on every call "
                              "(one extra copy). Pass int32 to avoid it.", stacklevel=3)
            topk_idx = topk_idx.to(torch.int32)
        return topk_idx

    # ---- launch -----------------------------------------------------------------------------------------------

    def default_num_ctas(self, device: torch.device) -> int:
        """The SM count of a CUDA device (1 on a CPU)."""
        if device.type != "cuda":
            return 1
        key = (device.type, device.index if device.index is not None else torch.cuda.current_device())
        n = self._sm_count.get(key)
        if n is None:
            n = self._sm_count[key] = torch.cuda.get_device_properties(key[1]).multi_processor_count
        return n

    def _side_stream(self, device: torch.device, on: bool):
        """The backward's second stream (plan.backward.streams 2), entered after the current stream's work so
        far (a fork: CUDA-graph capturable); a no-op off CUDA or with one stream. Join with _join_side_stream."""
        if not on or device.type != "cuda":
            return contextlib.nullcontext()
        key = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        side = self._side_streams.get(key)
        if side is None:
            side = self._side_streams[key] = torch.cuda.Stream(key)
        side.wait_stream(torch.cuda.current_stream(key))
        return launch.on_stream(side)

    def _join_side_stream(self, device: torch.device) -> None:
        """The current stream waits for the side stream's work (every tensor it used was allocated on the current
        stream before the fork, so the allocator's stream order holds once joined)."""
        if device.type == "cuda":
            key = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
            torch.cuda.current_stream(key).wait_stream(self._side_streams[key])

    def __call__(self, x, topk_idx, topk_weight, w1, w2, b1=None, b2=None, *, out: torch.Tensor | None = None,
                 num_ctas: int | None = None, check: bool = False) -> torch.Tensor:
        """y [T, H] bf16 (written into ``out`` when given, and returned).

        Runs on the current torch stream of x's device: ``routing``, (``gather``,) ``gemm1``, ``gemm2``,
        ``combine``. No host
        sync unless ``check=True``, which syncs and raises :class:`RoutingError` (naming the bad indices) if
        this call's topk_idx had out-of-range ids. ``num_ctas`` (default: the SM count) must not change the bits.
        """
        topk_idx = self.validate(x, topk_idx, topk_weight, w1, w2, b1, b2, out)
        if num_ctas is None:
            num_ctas = self.default_num_ctas(x.device)
        elif not isinstance(num_ctas, int) or isinstance(num_ctas, bool) or num_ctas < 1:
            raise self._err(f"num_ctas must be a positive int, got {num_ctas!r}")
        T = x.shape[0]
        if check and x.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"mokgen {self.name}: check=True syncs the host; not allowed in CUDA-graph "
                               "capture (use check_errors() after replay)")
        y = out if out is not None else torch.empty((T, self.cfg.hidden), dtype=torch.bfloat16, device=x.device)
        if T == 0:
            return y
        st = self._state(x.device)
        ws = Workspace.allocate(self.cfg, self.plan, T, x.device)   # this call's buffers (current stream)
        b1_ = b1 if b1 is not None else st.dummy
        b2_ = b2 if b2 is not None else st.dummy
        f = self._fns
        with launch.on_device(x.device):
            if self.fused:
                call(f, "routing", table="routing_sync", idx=topk_idx, weight=topk_weight, row_src=ws.row_src,
                     row_w=ws.row_w, tile_group=ws.tile_group, meta=ws.meta, slot_pos=ws.slot_pos, sync=ws.sync)
                call(f, "fused", x=x, w1=w1, b1=b1_, w2=w2, b2=b2_, row_src=ws.row_src, row_w=ws.row_w,
                     tile_group=ws.tile_group, meta=ws.meta, slot_pos=ws.slot_pos, h=ws.h, ys=ws.ys, y=y,
                     sync=ws.sync, num_ctas=num_ctas)
                return self._after_call(st, ws, topk_idx, check, y)
            call(f, "routing", idx=topk_idx, weight=topk_weight, row_src=ws.row_src, row_w=ws.row_w,
                 tile_group=ws.tile_group, meta=ws.meta, slot_pos=ws.slot_pos)
            a = x
            if self.gather:
                call(f, GATHER_KERNEL, x=x, row_src=ws.row_src, meta=ws.meta, xg=ws.xg)
                a = ws.xg
            if self.fp8:
                self._fp8_gemms(a, w1, w2, b1_, b2_, ws.row_src, ws.row_w, ws.tile_group, ws.meta, ws.h, ws.ys,
                                num_ctas)
            elif self.mx:
                self._mx_gemms(a, w1, w2, b1_, b2_, ws.row_src, ws.row_w, ws.tile_group, ws.meta, ws.h, ws.ys,
                               num_ctas)
            else:
                call(f, "gemm1", a=a, w=w1, bias=b1_, row=ws.row_src, tile_group=ws.tile_group, meta=ws.meta,
                     out=ws.h, num_ctas=num_ctas)
                call(f, "gemm2", a=ws.h, w=w2, bias=b2_, row=ws.row_w, tile_group=ws.tile_group, meta=ws.meta,
                     out=ws.ys, num_ctas=num_ctas)
            call(f, "combine", ys=ws.ys, slot_pos=ws.slot_pos, y=y)
        return self._after_call(st, ws, topk_idx, check, y)

    def _fp8_gemms(self, x, w1, w2, b1, b2, row_src, row_w, tile_group, meta, h, ys, num_ctas, z=None
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The FP8 forward GEMMs: x's rows gathered and quantized per 1 x 128 into the padded row space (or, where
        GEMM 1 gathers, plan gemm1.a_load "gather", x's token rows quantized once), the
        weights' e4m3 copies (:class:`_Fp8Weights`), GEMM 1 -> h (bf16; with ``z``, the training form saving z),
        h quantized per 1 x 128, GEMM 2 -> ys. In training with plan bwd_x_cols "forward" the x quantizer also
        writes the rows' 128 x 1 column form for the FP8 wgrad1 (one read for both), returned as (xt, xts)."""
        f = self._fns
        cols = None
        if z is not None and self.x_cols_fwd:
            xq, xs, xt, xts = fp8_ops.quantize_gathered_both(f, x, row_src, meta)
            cols = (xt, xts)
        elif self._fp8_gathers_x(training=z is not None):   # x's T rows, not its T (K + S) routed ones
            xq, xs = fp8_ops.quantize_rows(f, x)
        else:
            xq, xs = fp8_ops.quantize_gathered_rows(f, x, row_src, meta)
        t = self.trainable   # the backward's dgrads read the transposed copies: made with the forward's
        w1q, w1s = self._fp8_weights.get(f, w1, transpose=t, step=z)[:2]
        w2q, w2s = self._fp8_weights.get(f, w2, transpose=t, step=z)[:2]
        # h's 1 x 128 quantization for GEMM 2: in GEMM 1's epilogue (plan gemm1.h_quant "epilogue": its tables
        # gemm1*_hq_fp8 take the e4m3 rows and scales, and the bf16 h is not written), else by quant_rows_used
        hq_kw = fp8_ops.alloc_rows(h) if self.fp8_h_quant else {}
        sfx = "_hq_fp8" if self.fp8_h_quant else "_fp8"
        if z is None:
            call(f, "gemm1", table="gemm1" + sfx, a=xq, w=w1q, bias=b1, row=row_src, tile_group=tile_group,
                 meta=meta, sa=xs, sb=w1s, out=h, **hq_kw, num_ctas=num_ctas)
        else:
            call(f, "gemm1_train", table="gemm1_train" + sfx, a=xq, w=w1q, bias=b1, row=row_src,
                 tile_group=tile_group, meta=meta, sa=xs, sb=w1s, out=h, z=z, **hq_kw, num_ctas=num_ctas)
        hq, hs = (hq_kw["hq"], hq_kw["hs"]) if hq_kw else fp8_ops.quantize_used_rows(f, h, meta)
        call(f, "gemm2", table="gemm2_fp8", a=hq, w=w2q, bias=b2, row=row_w, tile_group=tile_group, meta=meta,
             sa=hs, sb=w2s, out=ys, num_ctas=num_ctas)
        return cols

    def _fp8_gathers_x(self, training: bool) -> bool:
        """Does this call's GEMM 1 (the training one, or the inference one) gather x's per-token e4m3 rows itself?"""
        return ("gemm1_train" if training else "gemm1") in self.fp8_a_gather

    def _mx_gemms(self, x, w1, w2, b1, b2, row_src, row_w, tile_group, meta, h, ys, num_ctas, z=None) -> None:
        """The MXFP8 forward GEMMs: x's rows gathered and quantized along H into the padded row space
        (quant_mx_gather), the weights' MXFP8 copies (quant_mx_w1 / quant_mx_w2, :class:`_MxWeights`), GEMM 1 -> h
        (bf16; with ``z``, the training form saving z), h's used rows quantized along I (quant_mx_used), GEMM 2 ->
        ys."""
        f = self._fns
        xq, xsf = mx_ops.quantize_gathered_rows(f, x, row_src, meta)
        w1q, w1sf = self._mx_weights.get(f, w1, "quant_mx_w1")
        w2q, w2sf = self._mx_weights.get(f, w2, "quant_mx_w2")
        if z is None:
            call(f, "gemm1", table="gemm1_mx", a=xq, w=w1q, bias=b1, row=row_src, tile_group=tile_group, meta=meta,
                 sfa=xsf, sfw=w1sf, out=h, num_ctas=num_ctas)
        else:
            call(f, "gemm1_train", table="gemm1_train_mx", a=xq, w=w1q, bias=b1, row=row_src,
                 tile_group=tile_group, meta=meta, sfa=xsf, sfw=w1sf, out=h, z=z, num_ctas=num_ctas)
        hq, hsf = mx_ops.quantize_used_rows(f, h, meta)
        call(f, "gemm2", table="gemm2_mx", a=hq, w=w2q, bias=b2, row=row_w, tile_group=tile_group, meta=meta,
             sfa=hsf, sfw=w2sf, out=ys, num_ctas=num_ctas)

    def _after_call(self, st: "_DeviceState", ws: Workspace, topk_idx: torch.Tensor, check: bool,
                    y: torch.Tensor) -> torch.Tensor:
        flag = self._routing_flag(ws.meta, topk_idx)
        if not check:   # no sync: the flags go to the device's sticky ones (check_errors)
            self._record_errors(st, flag, ws.sync)
            return y
        if int(flag[0]):   # syncs with this call's kernels (the current stream)
            raise RoutingError(f"mokgen {self.name}: {self._count_bad(topk_idx)}; those slots were dropped "
                               "(contributed 0)")
        if ws.sync is not None and int(ws.sync[2]):
            raise KernelTimeoutError(self._timeout_msg())
        return y

    # ---- training ---------------------------------------------------------------------------------------------

    def _num_ctas(self, device: torch.device, num_ctas: int | None) -> int:
        if num_ctas is None:
            return self.default_num_ctas(device)
        if not isinstance(num_ctas, int) or isinstance(num_ctas, bool) or num_ctas < 1:
            raise self._err(f"num_ctas must be a positive int, got {num_ctas!r}")
        return num_ctas

    def launch_sequence(self, training: bool = True) -> tuple[str, ...]:
        """The generated kernels one call launches, in stream order, as profilers see them: a training step
        (:meth:`forward_train` then :meth:`backward`, the bf16-gradient path) or an inference call. The names are
        the phases (``gather_dO``, ``combine_dx``, ``gather_x`` are the backward's launches of the gather and
        combine kernels); the small torch reductions between them are not listed."""
        if self.fused:
            return ("routing", "fused")
        if self.fp8:   # the weights' quant_w launches only when they changed (not in a steady step); h's rows
            # quantized by quant_rows_used unless GEMM 1 does it in its epilogue (plan gemm1.h_quant)
            q_x = "quant_both_gather_x" if (training and self.x_cols_fwd) else (
                "quant_rows" if self._fp8_gathers_x(training) else "quant_rows_gather")
            fwd = ("routing", q_x, "gemm1_train" if training else "gemm1") + (
                () if self.fp8_h_quant else ("quant_rows_used",)) + ("gemm2", "combine")
        elif self.mx:   # likewise quant_mx_w1 / quant_mx_w2 (and the backward's quant_mx_w*_cols)
            fwd = ("routing", "quant_mx_gather", "gemm1_train" if training else "gemm1", "quant_mx_used", "gemm2",
                   "combine")
        else:
            gather = self.gather_train if training else self.gather
            fwd = ("routing",) + (("gather",) if gather else ()) + ("gemm1_train" if training else "gemm1", "gemm2",
                                                                     "combine")
        if not training:
            return fwd
        # FP8 / MXFP8: dO's rows quantized before dgrad1 and dz's used rows after it (FP8) or before dgrad2 (MXFP8).
        # An FP8 weight gradient's operands are quantized along the rows (128 x 1, transposed): dO and dz with
        # their 1x128 row form from one read (quant_both_*), s a and the x rows right before it; a BF16 one reads
        # the gathered bf16 dO / x rows
        # An MXFP8 weight gradient's operands (plan wgrad*_dtype=mxfp8) are quantized in 32-row blocks down the
        # columns right before it: dO's rows gathered and s a for wgrad2, dz and x's rows gathered for wgrad1
        w8 = self.fp8_wgrads
        wm = self.mx_wgrads
        if self.fp8:
            q_dO = ("quant_both_gather_dO",) if "wgrad2" in w8 else ("quant_rows_gather",)
            q_dz, q_dz2 = ("quant_both_used_dz",) if "wgrad1" in w8 else ("quant_rows_used",), ()
        else:
            q_dO = ("quant_mx_gather",) if self.mx else ()
            q_dz, q_dz2 = (), ("quant_mx_dz",) if self.mx else ()
        gather_dO = () if ("wgrad2" in w8 or "wgrad2" in wm) else ("gather_dO",)   # db2 reads dO itself
        head = gather_dO + q_dO + ("dgrad1",) + q_dz
        dgrad2 = q_dz2 + ("dgrad2", "combine_dx")
        wgrad2 = (("quant_cols_used_sa",) if "wgrad2" in w8 else ("quant_mx_cols_gather_dO", "quant_mx_sa_cols")
                  if "wgrad2" in wm else ()) + ("wgrad2",)
        wgrad1 = ((() if self.x_cols_fwd else ("quant_cols_gather_x",)) if "wgrad1" in w8
                  else ("quant_mx_dz_cols", "quant_mx_cols_gather_x") if "wgrad1" in wm else ("gather_x",)) + ("wgrad1",)
        if self._bwd_streams == 2:   # host order: the side stream's weight gradients are launched first
            return fwd + head + wgrad2 + wgrad1 + dgrad2
        return fwd + head + wgrad2 + dgrad2 + wgrad1

    def _need_training(self) -> None:
        if not self.trainable:
            if self.fused:
                why = "its plan uses the fused schedule (training runs the chain: compile with overrides={'schedule': 'chain'})"
            elif (a := ARCHS.get(self.arch or getattr(self.plan, "arch", None))) is not None and not a.training:
                why = f"no backward kernels exist for {a.name} yet (its plans are the inference forward only)"
            else:
                why = "its cache entry was built without the training kernels (rebuild: mokgen.compile(spec, force=True))"
            raise RuntimeError(f"mokgen {self.name}: cannot train with these kernels: {why}")

    def new_saved(self, tokens: int, device: torch.device) -> Saved:
        """Fresh per-call buffers of a training forward for ``tokens`` tokens (``meta`` zeroed: its error flag is
        only ever set by the routing kernel; everything else is written before it is read)."""
        c = self.cfg
        cap = cap_rows(tokens, c.topk, c.shared_experts, c.groups, self.bm)
        e = dict(device=device)
        return Saved(z=torch.empty((cap, 2 * c.ffn), dtype=torch.bfloat16, **e),
                     row_src=torch.empty((cap,), dtype=torch.int32, **e),
                     row_w=torch.empty((cap,), dtype=torch.float32, **e),
                     tile_group=torch.empty((cap // self.bm,), dtype=torch.int32, **e),
                     meta=torch.zeros((4,), dtype=torch.int32, **e),
                     slot_pos=torch.empty((tokens, c.topk + c.shared_experts), dtype=torch.int32, **e))

    def forward_train(self, x, topk_idx, topk_weight, w1, w2, b1=None, b2=None, *, out: torch.Tensor | None = None,
                      num_ctas: int | None = None) -> tuple[torch.Tensor, Saved]:
        """(y, saved): the forward of a training step. Same kernels as :meth:`__call__` except GEMM 1, which also
        stores the pre-activation z; every buffer belongs to this call (nothing is shared with other calls).
        ``out`` ([T, H] bf16, contiguous): y is written into it by the combine kernel and returned.
        Routing errors set a sticky flag that :meth:`check_errors` reports."""
        self._need_training()
        topk_idx = self.validate(x, topk_idx, topk_weight, w1, w2, b1, b2, out)
        num_ctas = self._num_ctas(x.device, num_ctas)
        c, T, dev = self.cfg, x.shape[0], x.device
        sv = self.new_saved(T, dev)
        if T == 0:
            return (out if out is not None else torch.empty((T, c.hidden), dtype=torch.bfloat16, device=dev)), sv
        st = self._state(dev)
        f = self._fns
        # Host order: each kernel is launched as early as its inputs allow and host-side work (allocations, the
        # error-flag fold) comes after the long kernels are queued, so the GPU does not wait for the host between
        # the short routing kernel and GEMM 1 (bench/NOTES.md v7, tools/step_timeline.py).
        with launch.on_device(dev):
            call(f, "routing", idx=topk_idx, weight=topk_weight, row_src=sv.row_src, row_w=sv.row_w,
                 tile_group=sv.tile_group, meta=sv.meta, slot_pos=sv.slot_pos)
            cap = sv.z.shape[0]
            a = x
            if self.gather_train:
                a = torch.empty((cap, c.hidden), dtype=torch.bfloat16, device=dev)
                call(f, GATHER_KERNEL, x=x, row_src=sv.row_src, meta=sv.meta, xg=a)
            h = torch.empty((cap, c.ffn), dtype=torch.bfloat16, device=dev)
            dummy = st.dummy
            b1_, b2_ = (b1 if b1 is not None else dummy), (b2 if b2 is not None else dummy)
            ys = torch.empty((cap, c.hidden), dtype=torch.bfloat16, device=dev)
            if self.fp8:
                cols = self._fp8_gemms(a, w1, w2, b1_, b2_, sv.row_src, sv.row_w, sv.tile_group, sv.meta, h, ys,
                                       num_ctas, z=sv.z)
                if cols is not None:
                    sv.xt, sv.xts = cols
            elif self.mx:
                self._mx_gemms(a, w1, w2, b1_, b2_, sv.row_src, sv.row_w, sv.tile_group, sv.meta, h, ys, num_ctas,
                               z=sv.z)
            else:
                call(f, "gemm1_train", a=a, w=w1, bias=b1_, row=sv.row_src, tile_group=sv.tile_group, meta=sv.meta,
                     out=h, z=sv.z, num_ctas=num_ctas)
                call(f, "gemm2", a=h, w=w2, bias=b2_, row=sv.row_w, tile_group=sv.tile_group, meta=sv.meta, out=ys,
                     num_ctas=num_ctas)
            y = out if out is not None else torch.empty((T, c.hidden), dtype=torch.bfloat16, device=dev)
            call(f, "combine", ys=ys, slot_pos=sv.slot_pos, y=y)
            self._record_errors(st, self._routing_flag(sv.meta, topk_idx))
        return y, sv

    def backward(self, dy, saved: Saved, x, topk_weight, w1, w2, b1=None, b2=None, *,
                 w1_main_grad: torch.Tensor | None = None, w2_main_grad: torch.Tensor | None = None,
                 out: reference.Grads | None = None, num_ctas: int | None = None) -> reference.Grads:
        """Gradients of one :meth:`forward_train` call (``saved``) for the output gradient ``dy [T, H]``.

        Kernels, in stream order: gather dO rows; dgrad1 (dA' = dO . W2, dSwiGLU epilogue: dz, s a and the
        router-gradient partials); wgrad2 (dW2 per group, K = its rows); dgrad2 (dz . W1 per slot); combine (dx
        over each token's slots in a fixed order); gather x rows; wgrad1 (dW1). No float atomics, no host sync:
        bitwise deterministic and independent of ``num_ctas``. With ``plan.backward.streams == 2`` the weight
        gradients (wgrad2, the x-row gather, wgrad1) go to a second stream after dgrad1 and run beside dgrad2 and
        the combine (dgrad2 then writes a buffer of its own); the current stream waits for them before this
        returns, so callers see one stream either way, and the bits are the same. With ``w1_main_grad`` / ``w2_main_grad`` (fp32,
        the weights' shapes) the weight gradients are added into them and returned as None.

        ``out`` (a :class:`mokgen.reference.Grads` whose fields are tensors or None): caller-owned buffers, each
        shaped and typed like its input, for the gradients to be written into (dx, dw1, dw2 by the kernels; the
        router and bias gradients, which torch reductions compute, are copied in); None fields are allocated.
        With a main_grad buffer the matching ``out.w1`` / ``out.w2`` must be None.
        """
        self._need_training()
        c = self.cfg
        T, H, I, G, K = x.shape[0], c.hidden, c.ffn, c.groups, c.topk
        if not isinstance(dy, torch.Tensor) or tuple(dy.shape) != (T, H) or dy.dtype != torch.bfloat16:
            raise self._err(f"dy must be [T={T}, H={H}] bfloat16, got "
                            f"{_fmt(dy) if isinstance(dy, torch.Tensor) else type(dy).__name__}")
        dy = dy.contiguous()
        for n, mg, w in (("w1_main_grad", w1_main_grad, w1), ("w2_main_grad", w2_main_grad, w2)):
            if mg is not None and (mg.shape != w.shape or mg.dtype != torch.float32 or not mg.is_contiguous()
                                   or mg.device != w.device):
                raise self._err(f"{n} must be a contiguous float32 tensor shaped like the weight "
                                f"[{', '.join(map(str, w.shape))}] on {w.device}, got {_fmt(mg)}")
        num_ctas = self._num_ctas(x.device, num_ctas)
        dev = x.device
        out = self._grad_buffers(out, x, topk_weight, w1, w2, b1, b2, w1_main_grad, w2_main_grad)
        if T == 0:   # nothing routed: zero gradients (the main_grad accumulators are left as they are)
            def z(name, like):
                o = getattr(out, name)
                return o.zero_() if o is not None else torch.zeros_like(like)
            return reference.Grads(z("x", x), z("topk_weight", topk_weight),
                                   z("w1", w1) if w1_main_grad is None else None,
                                   z("w2", w2) if w2_main_grad is None else None, None if b1 is None else z("b1", b1),
                                   None if b2 is None else z("b2", b2))
        cap = saved.z.shape[0]
        dummy = self._state(dev).dummy
        db2 = db1 = None
        f = self._fns
        sv = saved
        # Host order: the first kernels go out before the host builds what only later kernels need, and the
        # small torch reductions (router and bias gradients) are queued before the last two kernels, so the host
        # is ahead of the GPU at the end of the step (bench/NOTES.md v7). Stream order keeps every dependency.
        w8 = self.fp8_wgrads
        wm = self.mx_wgrads   # MXFP8 weight gradients (plan wgrad*_dtype=mxfp8)
        with launch.on_device(dev):
            buf = torch.empty((cap, H), dtype=torch.bfloat16, device=dev)   # dO rows, then dx per slot, then x rows
            if "wgrad2" not in w8 and "wgrad2" not in wm:   # the bf16 dO rows: BF16 wgrad2's operand
                call(f, GATHER_KERNEL, x=dy, row_src=sv.row_src, meta=sv.meta, xg=buf)
            dz = torch.empty((cap, 2 * I), dtype=torch.bfloat16, device=dev)
            sa = torch.empty((cap, I), dtype=torch.bfloat16, device=dev)
            ds = torch.empty((cap, self.ds_tiles), dtype=torch.float32, device=dev)
            if self.fp8:   # dO's rows gathered and quantized (and its columns, for an FP8 wgrad2); W2's K-major
                # transposed e4m3 copy
                if "wgrad2" in w8:
                    dq, dsc, dOt, dOs = fp8_ops.quantize_gathered_both(f, dy, sv.row_src, sv.meta)
                else:
                    dq, dsc = fp8_ops.quantize_gathered_rows(f, dy, sv.row_src, sv.meta)
                w2t, w2ts = self._fp8_weights.get(f, w2, transpose=True, step=sv.z, backward=True)[2:]
                call(f, "dgrad1", table="dgrad1_fp8", a=dq, w=w2t, bias=dummy, row=sv.row_w, tile_group=sv.tile_group,
                     meta=sv.meta, sa=dsc, sb=w2ts, out=sa, z=sv.z, dz=dz, ds=ds, num_ctas=num_ctas)
            elif self.mx:   # dO's rows gathered and quantized along H; W2's column form (32-blocks along H)
                dq, dsf = mx_ops.quantize_gathered_rows(f, dy, sv.row_src, sv.meta)
                w2c, w2csf = self._mx_weights.get(f, w2, "quant_mx_w2_cols")
                call(f, "dgrad1", table="dgrad1_mx", a=dq, w=w2c, bias=dummy, row=sv.row_w, tile_group=sv.tile_group,
                     meta=sv.meta, sfa=dsf, sfw=w2csf, out=sa, z=sv.z, dz=dz, ds=ds, num_ctas=num_ctas)
            else:
                call(f, "dgrad1", a=buf, w=w2, bias=dummy, row=sv.row_w, tile_group=sv.tile_group, meta=sv.meta,
                     out=sa, z=sv.z, dz=dz, ds=ds, num_ctas=num_ctas)
            if self.fp8:   # dz's used rows quantized for dgrad2 (and its columns, for an FP8 wgrad1): before the
                # weight gradients, which a second stream may run
                if "wgrad1" in w8:
                    dzq, dzs, dzt, dzts = fp8_ops.quantize_used_both(f, dz, sv.meta)
                else:
                    dzq, dzs = fp8_ops.quantize_used_rows(f, dz, sv.meta)
            onehot, group_start = group_layout(sv.tile_group, G, self.bm)
            dyf = None
            if b2 is not None:   # db2[g] = sum of s * dO over the group's rows = (per token, its slots' weights in
                # g) . dO: one fp32 GEMM over the T tokens (bench/NOTES.md v26: the gathered rows' per-tile sums
                # cost 0.5 ms of gpt-oss-120b's step)
                dyf = dy.float()
                db2 = slot_group_weights(sv.slot_pos, sv.tile_group, sv.row_w, self.bm, G).t() @ dyf
            dw2 = dw1 = None
            if w2_main_grad is None:
                dw2 = out.w2 if out.w2 is not None else torch.empty_like(w2)
            if w1_main_grad is None:
                dw1 = out.w1 if out.w1 is not None else torch.empty_like(w1)
            dx = out.x if out.x is not None else torch.empty((T, H), dtype=torch.bfloat16, device=dev)
            two = self._bwd_streams == 2
            # streams 2: dgrad2 writes a buffer of its own, so the side stream may reuse buf (dO rows, then x rows)
            dxs = torch.empty((cap, H), dtype=torch.bfloat16, device=dev) if two else buf

            def x_rows_and_wgrad1() -> None:   # buf: the x rows, once wgrad2 has read the dO rows from it
                kernel = "wgrad1" if dw1 is not None else "wgrad1_acc"
                o = dw1 if dw1 is not None else w1_main_grad
                if "wgrad1" in w8:   # the x rows' columns in e4m3 (128 x 1 tiles), transposed (made by the forward
                    # with plan bwd_x_cols "forward"); dz's made above
                    xt, xs = ((sv.xt, sv.xts) if sv.xt is not None
                              else fp8_ops.quantize_gathered_cols(f, x, sv.row_src, sv.meta))
                    call(f, kernel, table=kernel + "_fp8", a=dzt, sa=dzts, b=xt, sb=xs, group_start=group_start,
                         out=o, num_ctas=num_ctas)
                    return
                if "wgrad1" in wm:   # dz and the x rows (gathered: no bf16 copy) in 32-row blocks down the columns
                    dzc, dzcsf = mx_ops.quantize_used_cols(f, dz, sv.row_w, sv.meta, "quant_mx_dz_cols")
                    xc, xcsf = mx_ops.quantize_gathered_cols(f, x, sv.row_src, sv.row_w, sv.meta)
                    call(f, kernel, table=kernel + "_mx", a=dzc, sfa=dzcsf, b=xc, sfb=xcsf, group_start=group_start,
                         out=o, num_ctas=num_ctas)
                    return
                call(f, GATHER_KERNEL, x=x, row_src=sv.row_src, meta=sv.meta, xg=buf)
                call(f, kernel, a=dz, b=buf, group_start=group_start, out=o, num_ctas=num_ctas)

            with self._side_stream(dev, two):   # the weight gradients (all of them on the side stream with two)
                kernel = "wgrad2" if dw2 is not None else "wgrad2_acc"
                o = dw2 if dw2 is not None else w2_main_grad
                if "wgrad2" in w8:   # s a's columns in e4m3 (128 x 1 tiles), transposed; dO's made before dgrad1
                    sat, sas = fp8_ops.quantize_used_cols(f, sa, sv.meta)
                    call(f, kernel, table=kernel + "_fp8", a=dOt, sa=dOs, b=sat, sb=sas, group_start=group_start,
                         out=o, num_ctas=num_ctas)
                elif "wgrad2" in wm:   # dO's rows (gathered) and s a in 32-row blocks down the columns
                    dOc, dOcsf = mx_ops.quantize_gathered_cols(f, dy, sv.row_src, sv.row_w, sv.meta)
                    sac, sacsf = mx_ops.quantize_used_cols(f, sa, sv.row_w, sv.meta, "quant_mx_sa_cols")
                    call(f, kernel, table=kernel + "_mx", a=dOc, sfa=dOcsf, b=sac, sfb=sacsf, group_start=group_start,
                         out=o, num_ctas=num_ctas)
                else:
                    call(f, kernel, a=buf, b=sa, group_start=group_start, out=o, num_ctas=num_ctas)
                if two:
                    x_rows_and_wgrad1()
            if self.fp8:   # W1's K-major transposed e4m3 copy (dz's rows quantized above)
                w1t, w1ts = self._fp8_weights.get(f, w1, transpose=True, step=sv.z, backward=True)[2:]
                call(f, "dgrad2", table="dgrad2_fp8", a=dzq, w=w1t, bias=dummy, row=sv.row_w, tile_group=sv.tile_group,
                     meta=sv.meta, sa=dzs, sb=w1ts, out=dxs, num_ctas=num_ctas)
            elif self.mx:   # dz's used rows quantized along 2I; W1's column form (32-blocks along 2I)
                dzq, dzsf = mx_ops.quantize_used_rows(f, dz, sv.meta, kernel="quant_mx_dz")
                w1c, w1csf = self._mx_weights.get(f, w1, "quant_mx_w1_cols")
                call(f, "dgrad2", table="dgrad2_mx", a=dzq, w=w1c, bias=dummy, row=sv.row_w, tile_group=sv.tile_group,
                     meta=sv.meta, sfa=dzsf, sfw=w1csf, out=dxs, num_ctas=num_ctas)
            else:
                call(f, "dgrad2", a=dz, w=w1, bias=dummy, row=sv.row_w, tile_group=sv.tile_group, meta=sv.meta,
                     out=dxs, num_ctas=num_ctas)
            call(f, "combine", ys=dxs, slot_pos=sv.slot_pos, y=dx)
            # router-weight gradient: <dA', a> summed over dgrad1's N tiles (fixed order), + <dO_t, b2[e]>
            pos = sv.slot_pos[:, :K].long()
            valid = pos >= 0
            posc = pos.clamp(min=0)
            dtw = ds.sum(1)[posc]
            if b2 is not None:
                grp = sv.tile_group.long()[posc // self.bm].clamp(min=0)
                dtw = dtw + torch.gather(dyf @ b2.t(), 1, grp)
            dtw = torch.where(valid, dtw, 0.0).to(topk_weight.dtype)
            if b1 is not None:   # db1[g] = sum of dz over the group's rows
                db1 = group_sums(onehot, sv.tile_group, dz, self.bm)
            if two:
                self._join_side_stream(dev)
            else:
                x_rows_and_wgrad1()
        dtw, db1, db2 = (t if o is None or t is None else o.copy_(t)
                         for t, o in ((dtw, out.topk_weight), (db1, out.b1), (db2, out.b2)))
        return reference.Grads(dx, dtw, dw1, dw2, db1, db2)

    def _grad_buffers(self, out, x, topk_weight, w1, w2, b1, b2, w1_main_grad, w2_main_grad) -> reference.Grads:
        """``backward``'s ``out``, checked field by field against its input (None: allocate)."""
        if out is None:
            return reference.Grads(None, None, None, None, None, None)
        if not isinstance(out, reference.Grads):
            raise self._err(f"out must be a mokgen.reference.Grads (fields tensors or None), got "
                            f"{type(out).__name__}")
        like = dict(x=x, topk_weight=topk_weight, w1=w1, w2=w2, b1=b1, b2=b2)
        for name, o in zip(reference.Grads._fields, out):
            if o is None:
                continue
            ref_t = like[name]
            if ref_t is None:
                raise self._err(f"out.{name} must be None: there is no {name} (the spec has no bias)")
            if (name, True) in (("w1", w1_main_grad is not None), ("w2", w2_main_grad is not None)):
                raise self._err(f"out.{name} must be None when {name}_main_grad is given (the gradient is added "
                                "into the main_grad buffer)")
            if (not isinstance(o, torch.Tensor) or o.shape != ref_t.shape or o.dtype != ref_t.dtype
                    or o.device != ref_t.device or not o.is_contiguous()):
                got = _fmt(o) if isinstance(o, torch.Tensor) else type(o).__name__
                raise self._err(f"out.{name} must be a contiguous tensor like {name} ({_fmt(ref_t)} on "
                                f"{ref_t.device}), got {got}" + (f" on {o.device}" if isinstance(o, torch.Tensor) else ""))
        return out

    def _timeout_msg(self) -> str:
        return (f"mokgen {self.name}: a dependency wait of the fused kernel timed out (a bug, or the GPU was "
                "shared with a kernel that kept its SMs for seconds); that call's output is wrong")


# --------------------------------------------------------------------------------------------------------------
# torch.library ops and autograd

_FWD_SCHEMA = ("(Tensor x, Tensor topk_idx, Tensor topk_weight, Tensor w1, Tensor w2, Tensor? b1, Tensor? b2, "
               "int moe_id) -> Tensor")
# the training forward returns y and the per-call state its backward needs (Saved's tensors, in that order); the
# main_grad tensors ride along (unused by the forward) so that the backward can add into them
_TRAIN_SCHEMA = ("(Tensor x, Tensor topk_idx, Tensor topk_weight, Tensor w1, Tensor w2, Tensor? b1, Tensor? b2, "
                 "Tensor? w1_main_grad, Tensor? w2_main_grad, int moe_id) "
                 "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
_BWD_SCHEMA = ("(Tensor dy, Tensor x, Tensor topk_weight, Tensor w1, Tensor w2, Tensor? b1, Tensor? b2, "
               "Tensor z, Tensor row_src, Tensor row_w, Tensor tile_group, Tensor meta, Tensor slot_pos, "
               "Tensor xt, Tensor xts, "
               "Tensor(a!)? w1_main_grad, Tensor(b!)? w2_main_grad, int moe_id) "
               "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


def _moe_forward_op(x, topk_idx, topk_weight, w1, w2, b1, b2, moe_id):
    return _lookup(moe_id)(x, topk_idx, topk_weight, w1, w2, b1, b2)


def _moe_forward_fake(x, topk_idx, topk_weight, w1, w2, b1, b2, moe_id):
    torch._check(x.dim() == 2, lambda: f"mokgen: x must be [T, H], got {x.dim()} dims")
    torch._check(topk_idx.dim() == 2 and topk_idx.shape[0] == x.shape[0], lambda: "mokgen: topk_idx must be [T, K]")
    return x.new_empty((x.shape[0], x.shape[1]), dtype=torch.bfloat16)


def _moe_forward_train_op(x, topk_idx, topk_weight, w1, w2, b1, b2, w1_main_grad, w2_main_grad, moe_id):
    y, saved = _lookup(moe_id).forward_train(x, topk_idx, topk_weight, w1, w2, b1, b2)
    return (y, *saved.op_tensors())


def _moe_forward_train_fake(x, topk_idx, topk_weight, w1, w2, b1, b2, w1_main_grad, w2_main_grad, moe_id):
    moe = _lookup(moe_id)
    c = moe.cfg
    T = x.shape[0]
    cap = (T * (c.topk + c.shared_experts) + c.groups * (moe.bm - 1) + moe.bm - 1) // moe.bm * moe.bm
    e = x.new_empty
    cols = moe.x_cols_fwd and T > 0   # Saved.xt / xts (empty where the forward does not make them)
    return (e((T, c.hidden), dtype=torch.bfloat16), e((cap, 2 * c.ffn), dtype=torch.bfloat16),
            e((cap,), dtype=torch.int32), e((cap,), dtype=torch.float32), e((cap // moe.bm,), dtype=torch.int32),
            e((4,), dtype=torch.int32), e((T, c.topk + c.shared_experts), dtype=torch.int32),
            e((c.hidden, cap) if cols else (0,), dtype=torch.uint8),
            e((cap // 128, c.hidden) if cols else (0,), dtype=torch.float32))


def _moe_backward_op(dy, x, topk_weight, w1, w2, b1, b2, z, row_src, row_w, tile_group, meta, slot_pos, xt, xts,
                     w1_main_grad, w2_main_grad, moe_id):
    g = _lookup(moe_id).backward(dy, Saved.from_op(z, row_src, row_w, tile_group, meta, slot_pos, xt, xts), x,
                                 topk_weight, w1, w2, b1, b2, w1_main_grad=w1_main_grad, w2_main_grad=w2_main_grad)
    empty = x.new_empty((0,), dtype=torch.float32)
    return (g.x, g.topk_weight, g.w1 if g.w1 is not None else empty.clone(),
            g.w2 if g.w2 is not None else empty.clone(), g.b1 if g.b1 is not None else empty.clone(),
            g.b2 if g.b2 is not None else empty.clone())


def _moe_backward_fake(dy, x, topk_weight, w1, w2, b1, b2, z, row_src, row_w, tile_group, meta, slot_pos, xt, xts,
                       w1_main_grad, w2_main_grad, moe_id):
    def like(t, absent):
        return x.new_empty((0,), dtype=torch.float32) if absent else torch.empty_like(t)

    return (torch.empty_like(x), torch.empty_like(topk_weight), like(w1, w1_main_grad is not None),
            like(w2, w2_main_grad is not None), like(b1, b1 is None), like(b2, b2 is None))


def _setup_context(ctx, inputs, output):
    x, topk_idx, topk_weight, w1, w2, b1, b2, w1_main_grad, w2_main_grad, moe_id = inputs
    ctx.mark_non_differentiable(*output[1:])
    ctx.save_for_backward(x, topk_weight, w1, w2, b1, b2, *output[1:], w1_main_grad, w2_main_grad)
    ctx.moe_id = moe_id
    ctx.has_b1, ctx.has_b2 = b1 is not None, b2 is not None
    ctx.main_grad = (w1_main_grad is not None, w2_main_grad is not None)


def _backward(ctx, dy, *_unused):
    x, topk_weight, w1, w2, b1, b2, z, row_src, row_w, tile_group, meta, slot_pos, xt, xts, mg1, mg2 = ctx.saved_tensors
    dx, dtw, dw1, dw2, db1, db2 = torch.ops.mokgen.moe_backward(
        dy.contiguous(), x, topk_weight, w1, w2, b1, b2, z, row_src, row_w, tile_group, meta, slot_pos, xt, xts, mg1,
        mg2, ctx.moe_id)
    return (dx, None, dtw, None if ctx.main_grad[0] else dw1, None if ctx.main_grad[1] else dw2,
            db1 if ctx.has_b1 else None, db2 if ctx.has_b2 else None, None, None, None)


class _EagerTrain(torch.autograd.Function):
    """The training op's eager form: the same kernels and saved tensors as ``mokgen::moe_forward_train`` and
    ``mokgen::moe_backward``, without torch.library's per-call custom-op machinery (schema default filling, alias
    checks, the autograd wrapper and the in-place view wrapper): with the stream contexts the launches no longer
    take, that cost the GPU machine's host 0.17-0.53 ms per training step, up to a fifth of a small FP8 layer's step
    (bench/NOTES.md v36). :func:`moe_forward` takes it outside
    torch.compile; while compiling, dynamo sees the custom ops (fake impls) instead. Everything the backward needs
    is saved with ``save_for_backward`` (saved-tensor hooks, version checks and checkpointing see it as they see
    the op's outputs)."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weight, w1, w2, b1, b2, w1_main_grad, w2_main_grad, moe):
        y, saved = moe.forward_train(x, topk_idx, topk_weight, w1, w2, b1, b2)
        ctx.save_for_backward(x, topk_weight, w1, w2, b1, b2, *saved.op_tensors(), w1_main_grad, w2_main_grad)
        ctx.moe = moe
        ctx.main_grad = (w1_main_grad is not None, w2_main_grad is not None)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, topk_weight, w1, w2, b1, b2, *sv, mg1, mg2 = ctx.saved_tensors
        g = ctx.moe.backward(dy.contiguous(), Saved.from_op(*sv), x, topk_weight, w1, w2, b1, b2,
                             w1_main_grad=mg1, w2_main_grad=mg2)
        return (g.x, None, g.topk_weight, None if ctx.main_grad[0] else g.w1, None if ctx.main_grad[1] else g.w2,
                g.b1, g.b2, None, None, None)


def _eager(*tensors) -> bool:
    """Whether :func:`moe_forward` may call the kernels directly (outside torch.compile, on plain tensors or
    parameters): fake, functional or other subclass tensors (tracing without dynamo, tensor subclasses) go
    through the custom ops, which know how to meet them."""
    if torch.compiler.is_compiling():
        return False
    return all(t is None or type(t) in _PLAIN for t in tensors)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _inference_backward(ctx, dy):
    raise RuntimeError("mokgen: torch.ops.mokgen.moe_forward is the inference op; call mokgen.moe_forward "
                       "(or mokgen.MoE), which runs the training op when gradients are needed")



# moe_forward outside torch.compile calls the kernels directly (the inference call, _EagerTrain) instead of through
# torch.ops.mokgen: the same kernels and bits, less host time. False: always the custom ops (tools/graph_vs_eager.py
# --op-path times both in one process).
EAGER_CALLS = True

_OPS_LOCK = threading.Lock()
_OPS: list[Any] = []   # the registered custom ops (empty until register_ops)
_OPS_READY = False     # a plain bool: what dynamo sees (and guards on) when it traces register_ops


def register_ops() -> None:
    """Register ``torch.ops.mokgen.moe_forward`` / ``moe_forward_train`` / ``moe_backward`` (fake impls, autograd)
    once per process. Called on first use (``CompiledMoE.registry_id``, which every caller of the ops passes;
    :func:`moe_forward`; ``MoE()``), not at import: torch's custom-op registration costs ~10 ms, a fifth of a
    warm start's budget, and a process that only loads kernels may never call through torch.ops."""
    if _OPS_READY:
        return
    if torch.compiler.is_compiling():   # dynamo is tracing (so imported): register outside the graph
        torch.compiler.disable(_register_ops)()
    else:
        _register_ops()


def _register_ops() -> None:
    global _OPS_READY
    with _OPS_LOCK:
        if _OPS_READY:
            return
        lib = torch.library
        fwd = lib.custom_op("mokgen::moe_forward", mutates_args=(), schema=_FWD_SCHEMA)(_moe_forward_op)
        fwd.register_fake(_moe_forward_fake)
        train = lib.custom_op("mokgen::moe_forward_train", mutates_args=(), schema=_TRAIN_SCHEMA)(_moe_forward_train_op)
        train.register_fake(_moe_forward_train_fake)
        bwd = lib.custom_op("mokgen::moe_backward", mutates_args=("w1_main_grad", "w2_main_grad"),
                            schema=_BWD_SCHEMA)(_moe_backward_op)
        bwd.register_fake(_moe_backward_fake)
        lib.register_autograd("mokgen::moe_forward_train", _backward, setup_context=_setup_context)
        lib.register_autograd("mokgen::moe_forward", _inference_backward,
                              setup_context=lambda ctx, inputs, output: None)
        _OPS[:] = [fwd, train, bwd]
        _OPS_READY = True


def moe_forward(x, topk_idx, topk_weight, w1, w2, b1=None, b2=None, *, moe: CompiledMoE,
                w1_main_grad: torch.Tensor | None = None, w2_main_grad: torch.Tensor | None = None,
                masked: bool = False) -> torch.Tensor:
    """Differentiable y = MoE(x) (torch.compile-able: fake impls registered). When autograd needs gradients, the
    training op runs (GEMM 1 also saves z; per-call routing metadata) and ``loss.backward()`` runs the generated
    backward kernels; otherwise the inference kernels. ``w1_main_grad`` / ``w2_main_grad`` (fp32, the weights'
    shapes): the weight gradients are added into them (Megatron-style) and w1 / w2 get no ``.grad``.
    ``masked=True``: masking mode (:meth:`CompiledMoE.masked_view`): ids >= local experts are masked slots
    (output 0, zero gradient, not reported as routing errors; negative ids still are)."""
    register_ops()
    if not isinstance(moe, CompiledMoE) and hasattr(moe, "select"):  # a tuned piecewise plan: pick by T (host)
        moe = moe.select(x.shape[0])
    if masked:
        moe = moe.masked_view()
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, topk_weight, w1, w2, b1, b2))
    eager = EAGER_CALLS and _eager(x, topk_idx, topk_weight, w1, w2, b1, b2, w1_main_grad, w2_main_grad)
    if not needs_grad:
        if eager:
            return moe(x, topk_idx, topk_weight, w1, w2, b1, b2)
        return torch.ops.mokgen.moe_forward(x, topk_idx, topk_weight, w1, w2, b1, b2, moe.registry_id)
    if eager:
        return _EagerTrain.apply(x, topk_idx, topk_weight, w1, w2, b1, b2, w1_main_grad, w2_main_grad, moe)
    return torch.ops.mokgen.moe_forward_train(x, topk_idx, topk_weight, w1, w2, b1, b2, w1_main_grad,
                                              w2_main_grad, moe.registry_id)[0]
