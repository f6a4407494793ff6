"""The MXFP8 quantization kernels (spec dtype mxfp8, sm_100a) from torch: their CPU reference steps and launch
helpers, as :mod:`mokgen.fp8_ops` is for the blockwise FP8 ones.

* ``ref_quant_mx_*``: keyword step functions with the kernels' arguments (mokgen/kernels.py ``quant_mx_gather``,
  ``quant_mx_used``, ``quant_mx_w``, ``quant_mx_w_cols``), built on :func:`mokgen.fp8.quantize_mx` (OCP MX's
  floor rule) with the e8m0 codes written at :func:`mokgen.fp8.mx_sf_offset`, the SF-atom bytes the kernels
  write (templates/sm100/quant_mx.py.j2; tests/test_mxfp8.py emulates each template's arithmetic and offsets and
  finds quantize_mx / pack_mx_scales bit for bit, and tests/test_mx_runtime.py checks these steps against those
  emulations byte for byte). Bytes a kernel does not write (rows past the used ones) are left untouched here too.
  :func:`reference_quant_kernels` binds them (``kernels.bind``) under the entry's kernel names.
* ``ref_quant_mx_cols_gather`` / ``ref_quant_mx_cols_used``: the MXFP8 weight gradients' operands (plan
  ``wgrad*_dtype=mxfp8``): rows of the padded row space quantized in 32-row blocks down each column (the wgrad's K),
  q in the row layout, the codes packed as the [C, rows / 32] matrix's; rows of routing weight 0 (padding) as zero.
* :func:`quantize_gathered_rows`, :func:`quantize_used_rows`, :func:`quantize_w`, :func:`quantize_w_cols`:
  allocate the outputs (e4m3 bits as uint8, the packed codes as a flat uint8 buffer) and launch a kernel of
  ``fns`` (a loaded library's functions, or the reference's) through ``kernels.call``, on the current torch
  stream; :func:`quantize_gathered_cols` / :func:`quantize_used_cols` the weight gradients' column forms.

Imports torch, mokgen.fp8 and mokgen.kernels only (the runtime side: no compiler, no CuTe DSL).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from . import fp8
from .fp8_ops import _check
from .launch import on_device
from .kernels import bind, call

__all__ = ["ref_quant_mx_gather", "ref_quant_mx_used", "ref_quant_mx_w", "ref_quant_mx_w_cols",
           "reference_quant_kernels", "quantize_gathered_rows", "quantize_used_rows", "quantize_w",
           "quantize_w_cols", "quantize_gathered_cols", "quantize_used_cols", "ref_quant_mx_cols_gather",
           "ref_quant_mx_cols_used", "dequantize_cols", "scales_of_rows", "dequantize_rows", "dequantize_w", "dequantize_w_cols",
           "MX_FORWARD_QUANT", "MX_BACKWARD_QUANT", "MX_WGRAD_QUANT"]

MX = fp8.MX_BLOCK   # 32 elements of K per e8m0 code
# the entry's MXFP8 quantizer kernels (name -> argument table): mokgen/kernels.py MX_QUANT_KERNELS and
# MX_QUANT_BACKWARD
MX_FORWARD_QUANT = ("quant_mx_gather", "quant_mx_used", "quant_mx_w1", "quant_mx_w2")
MX_BACKWARD_QUANT = ("quant_mx_dz", "quant_mx_w2_cols", "quant_mx_w1_cols")
# ... and the MXFP8 weight gradients' (plan wgrad*_dtype=mxfp8; mokgen/kernels.py MX_QUANT_WGRAD)
MX_WGRAD_QUANT = ("quant_mx_cols_gather", "quant_mx_sa_cols", "quant_mx_dz_cols")


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def _row_offsets(rows: int, kblocks: int, device) -> torch.Tensor:
    r = torch.arange(rows, device=device).view(-1, 1)
    kb = torch.arange(kblocks, device=device).view(1, -1)
    return fp8.mx_sf_offset(r, kb, kblocks)


def _write_rows(x: torch.Tensor, q: torch.Tensor, sf: torch.Tensor) -> None:
    """q[:n], and the codes of rows [0, n) at their SF-atom bytes, of the rows x [n, K] (K % 32 == 0); where K / 32
    is not a multiple of 4 the rows' codes of the last atom's missing blocks are written as 127 (scale 1), as the
    kernels write them (the GEMMs read zeros for the data there)."""
    n, K = x.shape
    if n == 0:
        return
    qq, e = fp8.quantize_mx(x)
    q[:n] = _bits(qq)
    kb = K // MX
    whole = -(-kb // fp8.MX_SF_COLS) * fp8.MX_SF_COLS
    e = torch.cat([e, e.new_full((n, whole - kb), fp8.E8M0_BIAS)], dim=1)
    sf[_row_offsets(n, whole, sf.device)] = e


# --------------------------------------------------------------------------------------------------------------
# reference steps (the kernels' argument names; outputs written in place)


def ref_quant_mx_gather(x, row_src, meta, q, sf, *, bm: int) -> None:
    """quant_mx_gather: q[r] = quantize_mx(x[row_src[r]]) (padding rows hold token 0) for the used rows
    r < meta[0] * bm of the padded row space, their codes at mx_sf_offset(r, kb, K / 32) of sf."""
    n = min(int(meta[0]) * bm, row_src.shape[0], q.shape[0])
    _write_rows(x[row_src[:n].long().clamp(min=0)], q, sf)


def ref_quant_mx_used(x, meta, q, sf, *, bm: int) -> None:
    """quant_mx_used (h; quant_mx_dz: dz): the used rows x[:meta[0] * bm] quantized along K, codes packed."""
    n = min(int(meta[0]) * bm, x.shape[0])
    _write_rows(x[:n], q, sf)


def ref_quant_mx_w(w, q, sf, *, parts: int = 1, interleave: bool = False) -> None:
    """quant_mx_w1 (``parts=2``) / quant_mx_w2 (``parts=1``): w [G, N, K] quantized along K; with ``interleave``
    (W1 in the interleaved gate / up layout) the rows are written in concat order (gate n -> row n, up n -> row
    N/2 + n). The codes are packed per (group, part): the GEMM's scale view is one batch of N / parts rows each,
    in whole atoms (:func:`mokgen.fp8.pack_mx_scales`: rows and 32-blocks past the block's filled with 127)."""
    G, N, K = w.shape
    if interleave:
        w = torch.cat([w[:, 0::2], w[:, 1::2]], dim=1)
    qq, e = fp8.quantize_mx(w)
    q.copy_(_bits(qq))
    sf.copy_(fp8.pack_mx_scales(e.reshape(G * parts, N // parts, K // MX)).flatten())


def ref_quant_mx_w_cols(w, q, sf) -> None:
    """quant_mx_w1_cols / quant_mx_w2_cols: w [G, R, C] quantized in 32-blocks down its columns (quantize_mx of
    each group's w[g].mT), q in w's layout, the codes packed per group as the [C, R / 32] matrix's."""
    qq, e = fp8.quantize_mx(w.transpose(1, 2))          # [G, C, R], [G, C, R / 32]
    q.copy_(_bits(qq).transpose(1, 2))
    sf.copy_(fp8.pack_mx_scales(e).flatten())


def _write_cols(rows: torch.Tensor, keep: torch.Tensor, q: torch.Tensor, sf: torch.Tensor) -> None:
    """q[:n] and the codes of the used rows ``rows`` [n, C] (n % 32 == 0) of a row space of q.shape[0] rows,
    quantized in 32-row blocks down each column, rows where ``keep`` is False as zero; the codes at
    mx_sf_offset(c, rb, q.shape[0] / 32) (the [C, rows / 32] matrix's)."""
    n, C = rows.shape
    if n == 0:
        return
    x = torch.where(keep.view(-1, 1), rows.float(), torch.zeros((), dtype=torch.float32, device=rows.device))
    qq, e = fp8.quantize_mx(x.t())                                     # [C, n], [C, n / 32]
    q[:n] = _bits(qq).t()
    c = torch.arange(C, device=sf.device).view(-1, 1)
    rb = torch.arange(n // MX, device=sf.device).view(1, -1)
    sf[fp8.mx_sf_offset(c, rb, q.shape[0] // MX)] = e


def ref_quant_mx_cols_gather(x, row_src, row_w, meta, q, sf, *, bm: int) -> None:
    """quant_mx_cols_gather: the used rows r < meta[0] * bm of the row space, x[row_src[r]] (zero where row_w is 0:
    padding, or a slot routed with weight 0, whose dz / s a rows are zero), quantized in 32-row blocks down each column; q [rows, C] in the row layout; codes packed over the columns
    (the [C, rows / 32] matrix's). The other rows and their code bytes are not written."""
    n = min(int(meta[0]) * bm, row_src.shape[0], q.shape[0])
    _write_cols(x[row_src[:n].long().clamp(min=0)], row_w[:n] != 0, q, sf)


def ref_quant_mx_cols_used(x, row_w, meta, q, sf, *, bm: int) -> None:
    """quant_mx_sa_cols / quant_mx_dz_cols (table quant_mx_cols_used): the used rows x[:meta[0] * bm] (zero where
    row_w is 0) quantized in 32-row blocks down each column, as :func:`ref_quant_mx_cols_gather`."""
    n = min(int(meta[0]) * bm, x.shape[0], q.shape[0])
    _write_cols(x[:n], row_w[:n] != 0, q, sf)


def reference_quant_kernels(bm: int, gate_up_layout: str = "concat") -> dict[str, Callable[..., None]]:
    """{kernel name: positional step} of the entry's MXFP8 quantizers, in their argument tables' order (``bm``:
    the routing tile meta[0] counts; ``gate_up_layout``: W1's, which quant_mx_w1 reorders to concat)."""
    inter = gate_up_layout == "interleaved"
    return {
        "quant_mx_gather": bind("quant_mx_gather", lambda x, row_src, meta, q, sf:
                                ref_quant_mx_gather(x, row_src, meta, q, sf, bm=bm)),
        "quant_mx_used": bind("quant_mx_used", lambda x, meta, q, sf: ref_quant_mx_used(x, meta, q, sf, bm=bm)),
        "quant_mx_dz": bind("quant_mx_dz", lambda x, meta, q, sf: ref_quant_mx_used(x, meta, q, sf, bm=bm),
                            table="quant_mx_used"),
        "quant_mx_w1": bind("quant_mx_w1", lambda w, q, sf: ref_quant_mx_w(w, q, sf, parts=2, interleave=inter),
                            table="quant_mx_w"),
        "quant_mx_w2": bind("quant_mx_w2", lambda w, q, sf: ref_quant_mx_w(w, q, sf), table="quant_mx_w"),
        "quant_mx_w1_cols": bind("quant_mx_w1_cols", ref_quant_mx_w_cols, table="quant_mx_w_cols"),
        "quant_mx_w2_cols": bind("quant_mx_w2_cols", ref_quant_mx_w_cols, table="quant_mx_w_cols"),
        "quant_mx_cols_gather": bind("quant_mx_cols_gather", lambda x, row_src, row_w, meta, q, sf:
                                     ref_quant_mx_cols_gather(x, row_src, row_w, meta, q, sf, bm=bm)),
        **{k: bind(k, lambda x, row_w, meta, q, sf: ref_quant_mx_cols_used(x, row_w, meta, q, sf, bm=bm),
                   table="quant_mx_cols_used") for k in ("quant_mx_sa_cols", "quant_mx_dz_cols")},
    }


# --------------------------------------------------------------------------------------------------------------
# reading the packed operands (the reference GEMMs): values from the bytes, scales by address


def scales_of_rows(sf: torch.Tensor, rows: int, kblocks: int) -> torch.Tensor:
    """float32 scales [rows, kblocks] of rows [0, rows) read from a packed buffer at mx_sf_offset (by address)."""
    return fp8.mx_scale_values(sf[_row_offsets(rows, kblocks, sf.device)], torch.float32)


def dequantize_rows(q: torch.Tensor, sf: torch.Tensor, rows: int) -> torch.Tensor:
    """float32 values of rows [0, rows) of e4m3 bits q [R, K] with their packed codes sf (exact: e4m3 times a
    power of two)."""
    K = q.shape[1]
    s = scales_of_rows(sf, rows, K // MX)
    return q[:rows].view(fp8.E4M3).float() * s.repeat_interleave(MX, dim=1)


def dequantize_w(q: torch.Tensor, sf: torch.Tensor, parts: int) -> torch.Tensor:
    """float32 values of K-major weights q [G, parts * N, K] (bits) whose codes are packed per (group, part)."""
    G, PN, K = q.shape
    N = PN // parts
    e = fp8.unpack_mx_scales(sf.view(G * parts, -1), N, K // MX).reshape(G, PN, K // MX)
    return q.view(fp8.E4M3).float() * fp8.mx_scale_values(e, torch.float32).repeat_interleave(MX, dim=2)


def dequantize_w_cols(q: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """float32 values of the column form q [G, K, N] (bits, w's layout; 32-blocks along K = w's rows) whose codes
    are packed per group as an [N, K / 32] matrix's: returned in w's layout [G, K, N]."""
    G, K, N = q.shape
    e = fp8.unpack_mx_scales(sf.view(G, -1), N, K // MX)                   # [G, N, K / 32]
    s = fp8.mx_scale_values(e, torch.float32).repeat_interleave(MX, dim=2)  # [G, N, K]
    return q.view(fp8.E4M3).float() * s.transpose(1, 2)


def dequantize_cols(q: torch.Tensor, sf: torch.Tensor, rows: int) -> torch.Tensor:
    """float32 values of rows [0, rows) of the row-space column form q [R, C] (bits; 32-row blocks down each
    column) whose codes are packed as the [C, R / 32] matrix's (read by address: mx_sf_offset)."""
    R, C = q.shape
    c = torch.arange(C, device=sf.device).view(-1, 1)
    rb = torch.arange(rows // MX, device=sf.device).view(1, -1)
    s = fp8.mx_scale_values(sf[fp8.mx_sf_offset(c, rb, R // MX)], torch.float32)        # [C, rows / 32]
    return q[:rows].view(fp8.E4M3).float() * s.t().repeat_interleave(MX, dim=0)


# --------------------------------------------------------------------------------------------------------------
# launch helpers


def _launch(fns: Mapping[str, Callable[..., Any]], kernel: str, table: str, x: torch.Tensor, rows: int,
            along_rows: bool, **kw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate q [rows, C] and the packed codes of x's rows quantized along K = C (32 columns per code) or, with
    ``along_rows``, down its columns (32 rows per code), and launch ``kernel`` on the current torch stream."""
    C = x.shape[1]
    q = torch.empty((rows, C), dtype=torch.uint8, device=x.device)
    sf_bytes = fp8.mx_sf_bytes(C, rows // MX) if along_rows else fp8.mx_sf_bytes(rows, C // MX)
    sf = torch.empty((sf_bytes,), dtype=torch.uint8, device=x.device)
    if rows and C and x.shape[0]:
        with on_device(x.device):
            call(fns, kernel, table=table, x=x, **kw, q=q, sf=sf)
    return q, sf


def quantize_gathered_rows(fns: Mapping[str, Callable[..., Any]], x: torch.Tensor, row_src: torch.Tensor,
                           meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16 [T, K] (K % 32 == 0) -> (q uint8 [rows, K] e4m3 bits, sf uint8 packed codes) by ``quant_mx_gather``:
    q[r] is x[row_src[r]] quantized, for the used rows (meta[0] * BM, read on the device); the other rows and their
    code bytes stay uninitialized. GEMM 1's A (x) and dgrad1's A (dO)."""
    _check("mx_ops.quantize_gathered_rows", "x", x, 2, {1: MX})
    return _launch(fns, "quant_mx_gather", "quant_mx_gather", x, row_src.shape[0], False, row_src=row_src,
                   meta=meta)


def quantize_used_rows(fns: Mapping[str, Callable[..., Any]], x: torch.Tensor, meta: torch.Tensor,
                       kernel: str = "quant_mx_used") -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16 [rows, K] of the padded row space -> (q, sf) of its used rows by ``kernel`` (``quant_mx_used`` for
    h, GEMM 2's A; ``quant_mx_dz`` for dz, dgrad2's A; both the ``quant_mx_used`` table)."""
    _check("mx_ops.quantize_used_rows", "x", x, 2, {1: MX})
    return _launch(fns, kernel, "quant_mx_used", x, x.shape[0], False, meta=meta)


def quantize_w(fns: Mapping[str, Callable[..., Any]], w: torch.Tensor, kernel: str
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """w bf16 [G, N, K] -> (q uint8 [G, N, K], sf uint8 [G * parts * mx_sf_bytes(N / parts, K / 32)]) by ``kernel``
    (``quant_mx_w1``: W1, rows written in concat order, parts 2; ``quant_mx_w2``: W2, parts 1); the forward GEMMs'
    B, its codes packed per (group, part) in whole atoms."""
    parts = 2 if kernel == "quant_mx_w1" else 1
    _check("mx_ops.quantize_w", "w", w, 3, {1: parts * MX, 2: MX})
    G, N, K = w.shape
    q = torch.empty((G, N, K), dtype=torch.uint8, device=w.device)
    sf = torch.empty((G * parts * fp8.mx_sf_bytes(N // parts, K // MX),), dtype=torch.uint8, device=w.device)
    if G and N and K:
        with on_device(w.device):
            call(fns, kernel, table="quant_mx_w", w=w, q=q, sf=sf)
    return q, sf


def quantize_w_cols(fns: Mapping[str, Callable[..., Any]], w: torch.Tensor, kernel: str
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """w bf16 [G, R, C] -> (q uint8 [G, R, C] in w's layout, sf uint8 [G * mx_sf_bytes(C, R / 32)]) by ``kernel``
    (``quant_mx_w2_cols``: W2 for dgrad1; ``quant_mx_w1_cols``: W1 for dgrad2): 32-blocks down w's columns, the
    codes packed per group in whole atoms."""
    _check("mx_ops.quantize_w_cols", "w", w, 3, {1: MX, 2: 8})
    G, R, C = w.shape
    q = torch.empty((G, R, C), dtype=torch.uint8, device=w.device)
    sf = torch.empty((G * fp8.mx_sf_bytes(C, R // MX),), dtype=torch.uint8, device=w.device)
    if G and R and C:
        with on_device(w.device):
            call(fns, kernel, table="quant_mx_w_cols", w=w, q=q, sf=sf)
    return q, sf


def quantize_gathered_cols(fns: Mapping[str, Callable[..., Any]], x: torch.Tensor, row_src: torch.Tensor,
                           row_w: torch.Tensor, meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16 [T, C] (C % 128 == 0) -> (q uint8 [rows, C], sf uint8 [C * rows / 32]) by ``quant_mx_cols_gather``:
    the row space's used rows x[row_src[r]] (rows of weight row_w 0, the padding, zero) quantized in 32-row blocks
    down each column; the other rows and their code bytes uninitialized. wgrad1's B (x's rows) and wgrad2's A (dO's rows)."""
    _check("mx_ops.quantize_gathered_cols", "x", x, 2, {1: 4 * MX})
    return _launch(fns, "quant_mx_cols_gather", "quant_mx_cols_gather", x, row_src.shape[0], True, row_src=row_src,
                   row_w=row_w, meta=meta)


def quantize_used_cols(fns: Mapping[str, Callable[..., Any]], x: torch.Tensor, row_w: torch.Tensor,
                       meta: torch.Tensor, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16 [rows, C] of the padded row space -> (q, sf) of its used rows in 32-row blocks down each column by
    ``kernel`` (``quant_mx_sa_cols``: s a, wgrad2's B; ``quant_mx_dz_cols``: dz, wgrad1's A; table
    ``quant_mx_cols_used``); rows of weight row_w 0 (the padding) quantize as zero."""
    _check("mx_ops.quantize_used_cols", "x", x, 2, {1: 4 * MX})
    return _launch(fns, kernel, "quant_mx_cols_used", x, x.shape[0], True, row_w=row_w, meta=meta)
