"""The FP8 quantization kernels from torch: their CPU reference steps and launch helpers.

* ``ref_quant_*``: keyword step functions with the kernels' arguments (mokgen/kernels.py ``quant_rows``,
  ``quant_w``, ``quant_wt``, ``quant_cols``), built on mokgen.fp8's quantizers with ``pow2=True``: the kernels
  match them bit for bit. :func:`reference_quant_kernels` binds them (``kernels.bind``): a stand-in for a loaded
  library's functions, on any device.
* :func:`quantize_rows`, :func:`quantize_w`, :func:`quantize_cols`: allocate the outputs and launch a kernel of
  ``fns`` (a loaded library's functions, or the reference's) through ``kernels.call``, on the current torch
  stream. e4m3 values travel as uint8 tensors of bit patterns; ``as_e4m3`` views them as float8_e4m3fn.

Imports torch, mokgen.fp8 and mokgen.kernels only (the runtime side: no compiler, no CuTe DSL).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from . import fp8
from .kernels import bind, call
from .launch import on_device

__all__ = ["alloc_rows", "ref_quant_rows", "ref_quant_rows_used", "ref_quant_rows_gather", "ref_quant_w", "ref_quant_wt", "ref_quant_cols",
           "ref_quant_cols_used", "ref_quant_cols_gather", "reference_quant_kernels", "quantize_rows",
           "quantize_used_rows", "quantize_gathered_rows", "quantize_w", "quantize_cols", "quantize_used_cols",
           "quantize_gathered_cols", "quantize_used_both", "quantize_gathered_both", "ref_quant_both_used",
           "ref_quant_both_gather", "as_e4m3"]

BLOCK = fp8.BLOCK
VEC = 16   # the quantizers' vector: K (and W's N) must be multiples of it; 1x128 / 128x128 edge tiles may be partial


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def as_e4m3(q: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor of e4m3 bit patterns viewed as float8_e4m3fn (no copy)."""
    return q.view(fp8.E4M3)


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


# --------------------------------------------------------------------------------------------------------------
# reference steps (the kernels' argument names; outputs written in place)


def ref_quant_rows(x, q, s) -> None:
    """q, s = mokgen.fp8.quantize_1x128(x, pow2=True) (q as e4m3 bits)."""
    qq, ss = fp8.quantize_1x128(x, pow2=True)
    q.copy_(_bits(qq))
    s.copy_(ss)


def ref_quant_w(w, q, s) -> None:
    """q, s = mokgen.fp8.quantize_128x128(w, pow2=True) per group (w [G, N, K])."""
    qq, ss = fp8.quantize_128x128(w, pow2=True)
    q.copy_(_bits(qq))
    s.copy_(ss)


def ref_quant_wt(w, q, s, qt, st) -> None:
    """As :func:`ref_quant_w`, and the transposed copy qt = q.mT, st = s.mT."""
    ref_quant_w(w, q, s)
    qt.copy_(q.mT)
    st.copy_(s.mT)


def ref_quant_cols(x, qt, st) -> None:
    """qt, st = mokgen.fp8.quantize_128x1(x, pow2=True) with q transposed (qt [K, rows], st [rows / 128, K])."""
    qq, ss = fp8.quantize_128x1(x, pow2=True)
    qt.copy_(_bits(qq).T)
    st.copy_(ss)


def ref_quant_cols_used(x, meta, qt, st, *, bm: int) -> None:
    """:func:`ref_quant_cols` of the used rows ``x[:meta[0] * bm]`` into the first columns of qt and rows of st
    (the rest untouched). The used rows end on a 128-row block boundary (bm a multiple of 128)."""
    n = min(int(meta[0]) * bm, x.shape[0])
    if n:
        ref_quant_cols(x[:n], qt[:, :n], st[:n // BLOCK])


def ref_quant_cols_gather(x, row_src, meta, qt, st, *, bm: int) -> None:
    """:func:`ref_quant_cols` of the gathered rows x[row_src[r]] (token 0 for padding rows) of the used rows."""
    n = min(int(meta[0]) * bm, row_src.shape[0])
    if n:
        ref_quant_cols(x[row_src[:n].long().clamp(min=0)], qt[:, :n], st[:n // BLOCK])


def ref_quant_rows_used(x, meta, q, s, *, bm: int) -> None:
    """:func:`ref_quant_rows` on the used rows ``x[:meta[0] * bm]`` (the rest of q, s untouched)."""
    n = min(int(meta[0]) * bm, x.shape[0])
    ref_quant_rows(x[:n], q[:n], s[:n])


def ref_quant_rows_gather(x, row_src, meta, q, s, *, bm: int) -> None:
    """:func:`ref_quant_rows` of x[row_src[r]] (token 0 for padding rows) into rows r of the used rows."""
    n = min(int(meta[0]) * bm, row_src.shape[0])
    ref_quant_rows(x[row_src[:n].long().clamp(min=0)], q[:n], s[:n])


def ref_quant_both_used(x, meta, q, s, qt, st, *, bm: int) -> None:
    """:func:`ref_quant_rows_used` and :func:`ref_quant_cols_used` of the same rows (one kernel, one read)."""
    ref_quant_rows_used(x, meta, q, s, bm=bm)
    ref_quant_cols_used(x, meta, qt, st, bm=bm)


def ref_quant_both_gather(x, row_src, meta, q, s, qt, st, *, bm: int) -> None:
    """:func:`ref_quant_rows_gather` and :func:`ref_quant_cols_gather` of the same gathered rows."""
    ref_quant_rows_gather(x, row_src, meta, q, s, bm=bm)
    ref_quant_cols_gather(x, row_src, meta, qt, st, bm=bm)


def reference_quant_kernels(bm: int = 128) -> dict[str, Callable[..., None]]:
    """{kernel name: positional step} of the FP8 quantization kernels, in the argument table's order (``bm``: the
    routing tile that ``quant_rows_used``'s meta[0] counts)."""
    return {"quant_rows": bind("quant_rows", ref_quant_rows),
            "quant_rows_gather": bind("quant_rows_gather", lambda x, row_src, meta, q, s:
                                      ref_quant_rows_gather(x, row_src, meta, q, s, bm=bm)),
            "quant_rows_used": bind("quant_rows_used", lambda x, meta, q, s: ref_quant_rows_used(x, meta, q, s, bm=bm)), "quant_w": bind("quant_w", ref_quant_w),
            "quant_wt": bind("quant_wt", ref_quant_wt), "quant_cols": bind("quant_cols", ref_quant_cols),
            "quant_cols_used": bind("quant_cols_used", lambda x, meta, qt, st: ref_quant_cols_used(x, meta, qt, st,
                                                                                                  bm=bm)),
            "quant_cols_gather": bind("quant_cols_gather", lambda x, row_src, meta, qt, st:
                                      ref_quant_cols_gather(x, row_src, meta, qt, st, bm=bm)),
            "quant_both_used": bind("quant_both_used", lambda x, meta, q, s, qt, st:
                                    ref_quant_both_used(x, meta, q, s, qt, st, bm=bm)),
            "quant_both_gather": bind("quant_both_gather", lambda x, row_src, meta, q, s, qt, st:
                                      ref_quant_both_gather(x, row_src, meta, q, s, qt, st, bm=bm))}


# --------------------------------------------------------------------------------------------------------------
# launch helpers


def _check(fn: str, name: str, t: torch.Tensor, dims: int, mult: Mapping[int, int]) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16 or t.dim() != dims:
        raise TypeError(f"{fn}: {name} must be a {dims}-D bfloat16 tensor, got "
                        f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    for d, m in mult.items():
        if t.shape[d] % m:
            raise ValueError(f"{fn}: {name}.shape[{d}] must be a multiple of {m}, got {t.shape[d]}")
    if not t.is_contiguous():
        raise ValueError(f"{fn}: {name} must be contiguous")
    if t.data_ptr() % 16:
        raise ValueError(f"{fn}: {name} must be 16-byte aligned")


def _rows_launch(fns: Mapping[str, Callable[..., Any]], kernel: str, x: torch.Tensor, rows: int,
                 **kw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate q uint8 [rows, K] and s fp32 [rows, K / 128] for a row-quantizing kernel of x [.., K] and launch
    it (nothing to launch for an empty x)."""
    K = x.shape[1]
    q, s = _row_buffers(rows, K, x.device)
    if rows and K and x.shape[0]:
        with on_device(x.device):
            call(fns, kernel, x=x, **kw, q=q, s=s)
    return q, s


def _row_buffers(rows: int, K: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """q uint8 [rows, K] and s fp32 [rows, K / 128]: what a row quantization fills."""
    return (torch.empty((rows, K), dtype=torch.uint8, device=device),
            torch.empty((rows, _blocks(K)), dtype=torch.float32, device=device))


def alloc_rows(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{"hq": q, "hs": s}``, the row quantization buffers of x [rows, K], for a kernel that quantizes in its
    epilogue (GEMM 1's h: plan gemm1.h_quant "epilogue")."""
    hq, hs = _row_buffers(*x.shape, x.device)
    return dict(hq=hq, hs=hs)


def quantize_rows(fns: Mapping[str, Callable[..., Any]], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16 [rows, K] (K % 128 == 0) -> (q uint8 [rows, K] e4m3 bits, s fp32 [rows, K / 128]) by ``quant_rows``."""
    _check("quantize_rows", "x", x, 2, {1: VEC})
    return _rows_launch(fns, "quant_rows", x, x.shape[0])


def quantize_used_rows(fns: Mapping[str, Callable[..., Any]], x: torch.Tensor, meta: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`quantize_rows` for rows of the padded row space, by ``quant_rows_used``: only the used rows,
    ``meta[0] * BM`` (read on the device), are read and written; the others of q and s stay uninitialized."""
    _check("quantize_used_rows", "x", x, 2, {1: VEC})
    return _rows_launch(fns, "quant_rows_used", x, x.shape[0], meta=meta)


def quantize_gathered_rows(fns: Mapping[str, Callable[..., Any]], x: torch.Tensor, row_src: torch.Tensor,
                           meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16 [T, K] -> (q uint8 [rows, K], s fp32 [rows, K / 128]) with q[r] the quantized x[row_src[r]] for the
    used rows of the padded row space (meta[0] * BM, read on the device; padding rows quantize token 0), by
    ``quant_rows_gather``: GEMM 1's A operand. The other rows stay uninitialized."""
    _check("quantize_gathered_rows", "x", x, 2, {1: VEC})
    return _rows_launch(fns, "quant_rows_gather", x, row_src.shape[0], row_src=row_src, meta=meta)


def quantize_w(fns: Mapping[str, Callable[..., Any]], w: torch.Tensor, transpose: bool = False):
    """w bf16 [G, N, K] (N, K % 16 == 0) -> (q uint8 [G, N, K], s fp32 [G, ceil(N/128), ceil(K/128)]) by ``quant_w``; with
    ``transpose=True`` by ``quant_wt``, and also (qt uint8 [G, K, N], st fp32 [G, K/128, N/128])."""
    _check("quantize_w", "w", w, 3, {1: VEC, 2: VEC})
    G, N, K = w.shape
    dev = w.device
    q = torch.empty((G, N, K), dtype=torch.uint8, device=dev)
    s = torch.empty((G, _blocks(N), _blocks(K)), dtype=torch.float32, device=dev)
    if transpose:
        qt = torch.empty((G, K, N), dtype=torch.uint8, device=dev)
        st = torch.empty((G, _blocks(K), _blocks(N)), dtype=torch.float32, device=dev)
    if G and N and K:
        with on_device(w.device):
            if transpose:
                call(fns, "quant_wt", w=w, q=q, s=s, qt=qt, st=st)
            else:
                call(fns, "quant_w", w=w, q=q, s=s)
    return (q, s, qt, st) if transpose else (q, s)


def _cols_launch(fns: Mapping[str, Callable[..., Any]], kernel: str, x: torch.Tensor, rows: int,
                 **kw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate qt uint8 [K, rows] and st fp32 [rows / 128, K] for a column-quantizing kernel of x [.., K] and
    launch it (nothing to launch when empty)."""
    K = x.shape[1]
    qt = torch.empty((K, rows), dtype=torch.uint8, device=x.device)
    st = torch.empty((rows // BLOCK, K), dtype=torch.float32, device=x.device)
    if rows and K and x.shape[0]:
        with on_device(x.device):
            call(fns, kernel, x=x, **kw, qt=qt, st=st)
    return qt, st


def quantize_cols(fns: Mapping[str, Callable[..., Any]], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16 [rows, K] (rows % 128 == 0, K % 16 == 0) -> (qt uint8 [K, rows], st fp32 [rows / 128, K]) by
    ``quant_cols``: the 128x1 tiles of a wgrad operand, q transposed (K-major for the FP8 wgrad)."""
    _check("quantize_cols", "x", x, 2, {0: BLOCK, 1: VEC})
    return _cols_launch(fns, "quant_cols", x, x.shape[0])


def quantize_used_cols(fns: Mapping[str, Callable[..., Any]], x: torch.Tensor, meta: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`quantize_cols` for rows of the padded row space (a multiple of 128), by ``quant_cols_used``: only
    the used rows' blocks, ``meta[0] * BM`` rows (read on the device), are read and written (dz, s a)."""
    _check("quantize_used_cols", "x", x, 2, {0: BLOCK, 1: VEC})
    return _cols_launch(fns, "quant_cols_used", x, x.shape[0], meta=meta)


def quantize_gathered_cols(fns: Mapping[str, Callable[..., Any]], x: torch.Tensor, row_src: torch.Tensor,
                           meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16 [T, K] -> (qt uint8 [K, rows], st fp32 [rows / 128, K]) of the gathered rows x[row_src[r]] (padding
    rows: token 0) of the used rows of the padded row space (rows = len(row_src), a multiple of 128), by
    ``quant_cols_gather``: the x and dO operands of the FP8 weight gradients, no bf16 copy of the rows."""
    _check("quantize_gathered_cols", "x", x, 2, {1: VEC})
    if row_src.shape[0] % BLOCK:
        raise ValueError(f"quantize_gathered_cols: row_src must have a multiple of {BLOCK} rows, got {row_src.shape[0]}")
    return _cols_launch(fns, "quant_cols_gather", x, row_src.shape[0], row_src=row_src, meta=meta)


def _both_launch(fns: Mapping[str, Callable[..., Any]], kernel: str, x: torch.Tensor, rows: int,
                 **kw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    K = x.shape[1]
    dev = x.device
    q = torch.empty((rows, K), dtype=torch.uint8, device=dev)
    s = torch.empty((rows, _blocks(K)), dtype=torch.float32, device=dev)
    qt = torch.empty((K, rows), dtype=torch.uint8, device=dev)
    st = torch.empty((rows // BLOCK, K), dtype=torch.float32, device=dev)
    if rows and K and x.shape[0]:
        with on_device(x.device):
            call(fns, kernel, x=x, **kw, q=q, s=s, qt=qt, st=st)
    return q, s, qt, st


def quantize_used_both(fns: Mapping[str, Callable[..., Any]], x: torch.Tensor, meta: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, s, qt, st): :func:`quantize_used_rows` and :func:`quantize_used_cols` of x's used rows from one read,
    by ``quant_both_used`` (dz: dgrad2's 1x128 rows and the FP8 wgrad1's 128x1 columns)."""
    _check("quantize_used_both", "x", x, 2, {0: BLOCK, 1: VEC})
    return _both_launch(fns, "quant_both_used", x, x.shape[0], meta=meta)


def quantize_gathered_both(fns: Mapping[str, Callable[..., Any]], x: torch.Tensor, row_src: torch.Tensor,
                           meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, s, qt, st): :func:`quantize_gathered_rows` and :func:`quantize_gathered_cols` of the gathered rows from
    one read, by ``quant_both_gather`` (dO: dgrad1's 1x128 rows and the FP8 wgrad2's 128x1 columns)."""
    _check("quantize_gathered_both", "x", x, 2, {1: VEC})
    if row_src.shape[0] % BLOCK:
        raise ValueError(f"quantize_gathered_both: row_src must have a multiple of {BLOCK} rows, got "
                         f"{row_src.shape[0]}")
    return _both_launch(fns, "quant_both_gather", x, row_src.shape[0], row_src=row_src, meta=meta)
