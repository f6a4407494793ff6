"""The kernels' argument table: one row per argument of every generated kernel's ``launch(...)``.

Everything that passes arguments to a kernel is derived from this table, so the three cannot drift apart:

* the templates' ``launch`` signatures and the fake tensors their ``compile()`` builds (emit renders the rows:
  name, dtype, shape as an expression over the kernel module's constants and symbolic sizes);
* the runtime's launches (:func:`call`: keyword tensors -> the positional order of the exported function);
* the reference's step functions (:func:`bind`: a keyword implementation -> a callable with the kernel's order).

Shapes are Python expressions evaluated in the kernel module's ``compile()``: upper-case names are the
module's constants (from the plan), lower-case names the symbolic sizes that :data:`SYMBOLS` declares (the
row and token counts vary per call; everything else is fixed by the plan). The stream is implicit (the TVM-FFI
environment stream): it is the last parameter of every ``launch`` but not an argument of the exported function.

This module imports nothing beyond the standard library (the runtime uses it on hosts without the compiler).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

__all__ = ["Arg", "ARGS", "SYMBOLS", "FP8_QUANT_KERNELS", "FP8_LAYER_KERNELS", "FP8_GATHER_KERNELS", "FP8_WGRAD_KERNELS", "fp8_a_gather", "fp8_layer_kernels", "MX_QUANT_KERNELS", "MX_QUANT_BACKWARD", "MX_QUANT_WGRAD", "MX_WGRAD_QUANT", "mx_wgrads", "mx_wgrad_quantizers", "names", "table_key", "call", "bind"]

# cute types of the table's dtypes (the templates render these names)
CUTE_TYPES = {"bf16": "cutlass.BFloat16", "fp32": "cutlass.Float32", "int32": "cutlass.Int32",
              "u8": "cutlass.Uint8"}  # u8: e4m3 bit patterns (torch: a float8_e4m3fn tensor's .view(torch.uint8))


@dataclass(frozen=True)
class Arg:
    name: str
    dtype: str                  # "bf16" | "fp32" | "int32" | "u8" tensors; "scalar" an Int32 argument
    shape: tuple[str, ...] = ()  # expressions (see the module docstring); () for a scalar
    doc: str = ""
    written: bool = False       # the kernel writes it (outputs, workspaces)
    align: int = 16             # bytes the kernel may assume the data pointer is aligned to

    @property
    def cute_type(self) -> str:
        return "cutlass.Int32" if self.dtype == "scalar" else "cute.Tensor"

    @property
    def fake(self) -> str:
        """The fake-tensor (or scalar) expression compile() passes for this argument."""
        if self.dtype == "scalar":
            return "cutlass.Int32(1)"
        shape = ", ".join(self.shape) + ("," if len(self.shape) == 1 else "")
        order = "" if len(self.shape) == 1 else f", stride_order=({', '.join(str(i) for i in reversed(range(len(self.shape))))})"
        return f"make_fake_compact_tensor({CUTE_TYPES[self.dtype]}, ({shape}){order}, assumed_align={self.align})"


def _t(name: str, dtype: str, *shape: str, doc: str = "", written: bool = False, align: int = 16) -> Arg:
    return Arg(name, dtype, tuple(shape), doc, written, align)


_NUM_CTAS = Arg("num_ctas", "scalar", (), "persistent CTAs to launch (the runtime passes the SM count)")
_TILE_GROUP = _t("tile_group", "int32", "tiles", doc="[max_m_tiles] expert group of each routing tile")
_META = _t("meta", "int32", "4", doc="[4] meta[0] = routing tiles in use (read on the device: no host sync)")
_BIAS = _t("bias", "fp32", "BIAS_ROWS", "BIAS_COLS", doc="[GROUPS, PARTS * N_OUT] fp32 biases ([1, 1] when the spec has none)")


def _grouped(w: Arg, row: Arg, out: Arg, *extra: Arg, a_doc: str) -> tuple[Arg, ...]:
    return (_t("a", "bf16", "a_rows", "K_DIM", doc=a_doc), w, _BIAS, row, _TILE_GROUP, _META, out, *extra, _NUM_CTAS)


def _grouped_fp8(row: Arg, out: Arg, *extra: Arg, a_doc: str) -> tuple[Arg, ...]:
    """An FP8 forward GEMM: e4m3 operands (their bytes) and their blockwise fp32 scales."""
    return (_t("a", "u8", "a_rows", "K_DIM", doc=a_doc + ", e4m3 bytes"),
            _t("w", "u8", "GROUPS", "PARTS * N_OUT", "K_DIM", doc="e4m3 weights (bytes), K-major, layout as _W_K"),
            _BIAS, row, _TILE_GROUP, _META,
            _t("sa", "fp32", "a_rows", "SCALE_K", doc="[a_rows, K / 128] scale of each 1 x 128 block of a"),
            _t("sb", "fp32", "GROUPS", "SB_ROWS", "SCALE_K", doc="[GROUPS, W rows / 128, K / 128] scale of each "
               "128 x 128 block of w"),
            out, *extra, _NUM_CTAS)


_W_MX = _t("w", "u8", "GROUPS", "PARTS * N_OUT", "K_DIM", doc="e4m3 weights (bytes), K-major; W1 in concat order "
           "(gate rows, then up rows: quant_mx_w1 writes it so)")
_W_MX_N = _t("w", "u8", "GROUPS", "K_DIM", "N_OUT", doc="e4m3 weights (bytes) read N-major, (N, K) = (columns, rows) "
             "of each group's [K, N] matrix, their 32-blocks along K (quant_mx_w*_cols)")


def _grouped_mx(row: Arg, out: Arg, *extra: Arg, a_doc: str, w: Arg = _W_MX) -> tuple[Arg, ...]:
    """An MXFP8 GEMM (sm_100a, block-scaled tcgen05 MMA): e4m3 operands (their bytes) and their e8m0 scales, one
    per 32 elements along K, packed in the SF-atom layout (mokgen.fp8.pack_mx_scales); `w` K-major (the forward)
    or N-major (the dgrads)."""
    return (_t("a", "u8", "a_rows", "K_DIM", doc=a_doc + ", e4m3 bytes"), w,
            _BIAS, row, _TILE_GROUP, _META,
            _t("sfa", "u8", "sfa_bytes", doc="e8m0 codes of a's 1 x 32 blocks, packed over a's rows (a_rows * K / 32 "
               "bytes)"),
            _t("sfw", "u8", "GROUPS * PARTS * -(-N_OUT // 128) * -(-K_DIM // 128) * 512", doc="e8m0 codes of w's "
               "32-blocks along K, packed per (group, part) over its N_OUT columns of the output: N_OUT SF rows each, "
               "in whole 512-byte atoms (128 rows x 4 blocks; the padding codes 127)"),
            out, *extra, _NUM_CTAS)


_W_K = _t("w", "bf16", "GROUPS", "PARTS * N_OUT", "K_DIM", doc="weights, K-major (layout from the strides above)")
_W_N = _t("w", "bf16", "GROUPS", "K_DIM", "N_OUT", doc="weights read transposed (N-major)")
_ROW_SRC = _t("row", "int32", "rows", doc="[rows] row_src: token of each padded row (padding: token 0)")
_ROW_W = _t("row", "fp32", "rows", doc="[rows] row_w: routing weight of each padded row (0: padding)")
_Z = _t("z", "bf16", "rows", "2 * N_OUT", doc="[rows, 2 N_OUT] pre-activation z in W1's row order")
_Z_OUT = _t("z", "bf16", "rows", "2 * N_OUT", written=True, doc=_Z.doc + " (written)")   # GEMM 1 training forms
_H_OUT = _t("out", "bf16", "rows", "N_OUT", written=True, doc="[rows, FFN] h")   # GEMM 1's output
_WGRAD = (
    _t("a", "bf16", "rows", "M_OUT", doc="[rows, M_OUT] rows of the left operand (grouped by expert)"),
    _t("b", "bf16", "rows", "N_OUT", doc="[rows, N_OUT] rows of the right operand"),
    _t("group_start", "int32", "GROUPS + 1", doc="[GROUPS + 1] first row of each group (multiples of GROUP_M)",
       align=4),
    _t("out", "bf16", "GROUPS", "M_OUT", "N_OUT", doc="[GROUPS, M_OUT, N_OUT] bf16 gradient",
       written=True),
    _NUM_CTAS,
)
# the FP8 weight-gradient GEMMs (dtype fp8, plan wgrad elem_bytes 1): both operands transposed and quantized per
# 128 x 1 tile along the rows (quant_cols*), K-major e4m3 bytes, with their scales [row blocks, columns]
_WGRAD_FP8_IN = (
    _t("a", "u8", "M_OUT", "rows", doc="[M_OUT, rows] e4m3 bits of the left operand's rows, transposed (rows "
       "contiguous: K-major)"),
    _t("sa", "fp32", "kblocks", "M_OUT", doc="[rows / 128, M_OUT] scale of each 128 x 1 tile of a (row block, column)"),
    _t("b", "u8", "N_OUT", "rows", doc="[N_OUT, rows] e4m3 bits of the right operand's rows, transposed"),
    _t("sb", "fp32", "kblocks", "N_OUT", doc="[rows / 128, N_OUT] scale of each 128 x 1 tile of b"),
    _t("group_start", "int32", "GROUPS + 1", doc="[GROUPS + 1] first row of each group (multiples of GROUP_M)",
       align=4),
)
_WGRAD_ACC = _WGRAD[:3] + (
    _t("out", "fp32", "GROUPS", "M_OUT", "N_OUT", doc="[GROUPS, M_OUT, N_OUT] fp32 main_grad, added into",
       written=True),
    _NUM_CTAS,
)

# the MXFP8 weight-gradient GEMMs (dtype mxfp8, sm_100a, plan wgrad*_dtype=mxfp8): both operands in their row
# layout (read MN-major), e4m3 bytes with one e8m0 code per 32 rows of a column, packed as the [columns, rows / 32]
# matrix's codes in the SF atoms (quant_mx_cols_*; mokgen.fp8.mx_sf_offset)
_WGRAD_MX_IN = (
    _t("a", "u8", "rows", "M_OUT", doc="[rows, M_OUT] e4m3 bits of the left operand's rows (32-row blocks quantized "
       "down each column)"),
    _t("sfa", "u8", "sfa_bytes", doc="e8m0 codes of a's (32 rows, column) blocks, packed as an [M_OUT, rows / 32] "
       "matrix's (M_OUT * rows / 32 bytes)"),
    _t("b", "u8", "rows", "N_OUT", doc="[rows, N_OUT] e4m3 bits of the right operand's rows"),
    _t("sfb", "u8", "sfb_bytes", doc="e8m0 codes of b's (32 rows, column) blocks, packed as an [N_OUT, rows / 32] "
       "matrix's"),
    _t("group_start", "int32", "GROUPS + 1", doc="[GROUPS + 1] first row of each group (multiples of GROUP_M)",
       align=4),
)
_WGRAD_FP8 = _WGRAD_FP8_IN + _WGRAD[3:]
_WGRAD_FP8_ACC = _WGRAD_FP8_IN + _WGRAD_ACC[3:]
_WGRAD_MX = _WGRAD_MX_IN + _WGRAD[3:]
_WGRAD_MX_ACC = _WGRAD_MX_IN + _WGRAD_ACC[3:]

# the column quantizers' outputs (the FP8 wgrads' operands): x transposed in e4m3 bits, its 128 x 1 tile scales
_QT = _t("qt", "u8", "cols", "rows", written=True, doc="[K, rows] e4m3 bits of x transposed (the used rows' columns)")
_ST = _t("st", "fp32", "rblocks", "cols", written=True, align=4,
         doc="[rows/128, K] power-of-two scale per 128x1 tile (128-row block, column)")
_Q_ROWS = _t("q", "u8", "rows", "cols", written=True, doc="[rows, K] e4m3 bits of the rows (1x128 tiles; the used rows)")
_S_ROWS = _t("s", "fp32", "rows", "cblocks", written=True, align=4,
             doc="[rows, K/128] power-of-two scale per 1x128 tile (the used rows)")

_HQ_OUT = _t("out", "bf16", "rows", "N_OUT", doc="[rows, FFN] bf16 h: not written with hq / hs")
# h's e4m3 rows and their 1 x 128 scales, written by GEMM 1's epilogue (the used rows; as quant_rows_used would)
_HQ = (_t("hq", "u8", "rows", "N_OUT", written=True, doc="[rows, FFN] e4m3 bits of h (1 x 128 tiles; the used rows)"),
       _t("hs", "fp32", "rows", "(N_OUT + 127) // 128", written=True, align=4,
          doc="[rows, FFN / 128] power-of-two scale per 1 x 128 tile of h (the used rows)"))

ARGS: dict[str, tuple[Arg, ...]] = {
    "routing": (
        _t("idx", "int32", "tokens", "TOPK", doc="[T, K] routed expert of each slot"),
        _t("weight", "fp32", "tokens", "TOPK", doc="[T, K] routing weights"),
        _t("row_src", "int32", "rows", written=True, doc="[rows] token of each padded row"),
        _t("row_w", "fp32", "rows", written=True, doc="[rows] routing weight of each padded row"),
        _t("tile_group", "int32", "tiles", written=True, doc="[max_m_tiles] expert group of each routing tile"),
        _t("meta", "int32", "4", written=True, doc="[4] meta[0] routing tiles used; meta[1] error flags"),
        _t("slot_pos", "int32", "tokens", "TOPK + SHARED", written=True, doc="[T, slots] padded row of each slot"),
    ),
    "routing_sync": (),  # filled below: routing + the fused schedule's sync workspace
    "gather": (
        _t("x", "bf16", "tokens", "HIDDEN", doc="[T, H] token rows"),
        _t("row_src", "int32", "rows", doc="[rows] token of each padded row"),
        _META,
        _t("xg", "bf16", "rows", "HIDDEN", written=True,
           doc="[rows, H] gathered rows (padding rows: token 0, weight 0)"),
    ),
    "combine": (
        _t("ys", "bf16", "rows", "HIDDEN", doc="[rows, H] per-slot rows"),
        _t("slot_pos", "int32", "tokens", "SLOTS", doc="[T, slots] padded row of each slot (-1: none)"),
        _t("y", "bf16", "tokens", "HIDDEN", written=True, doc="[T, H] sum over each token's slots, fixed order"),
    ),
    "gemm1": _grouped(_W_K, _ROW_SRC, _H_OUT,
                      a_doc="x [T, H] (rows gathered by row_src) or gathered rows xg [rows, H]"),
    "gemm1_train": _grouped(_W_K, _ROW_SRC, _H_OUT, _Z_OUT,
                            a_doc="x [T, H] (rows gathered by row_src) or gathered rows xg [rows, H]"),
    "gemm2": _grouped(_W_K, _ROW_W, _t("out", "bf16", "rows", "N_OUT", written=True, doc="[rows, H] weighted ys"),
                      a_doc="h [rows, FFN]"),
    "gemm1_fp8": _grouped_fp8(_ROW_SRC, _H_OUT, a_doc="x [T, H] (rows gathered by row_src)"),
    "gemm1_train_fp8": _grouped_fp8(_ROW_SRC, _H_OUT, _Z_OUT,
                                    a_doc="x [T, H] (rows gathered by row_src)"),
    # GEMM 1 with h's 1 x 128 quantization in its epilogue (plan gemm1.h_quant "epilogue": GEMM 2's A operand
    # written by GEMM 1, no quant_rows_used launch); the bf16 h is not written (the GPU kernel leaves `out` as it
    # is; the reference writes it)
    "gemm1_hq_fp8": _grouped_fp8(_ROW_SRC, _HQ_OUT, *_HQ, a_doc="x [T, H] (rows gathered by row_src)"),
    "gemm1_train_hq_fp8": _grouped_fp8(_ROW_SRC, _HQ_OUT, _Z_OUT, *_HQ, a_doc="x [T, H] (rows gathered by row_src)"),
    "gemm2_fp8": _grouped_fp8(_ROW_W, _t("out", "bf16", "rows", "N_OUT", written=True, doc="[rows, H] weighted ys"),
                              a_doc="h [rows, FFN]"),
    "dgrad1_fp8": _grouped_fp8(
        _ROW_W, _t("out", "bf16", "rows", "N_OUT", written=True, doc="[rows, FFN] s * a (for dW2)"),
        _Z,
        _t("dz", "bf16", "rows", "2 * N_OUT", written=True, doc="[rows, 2 FFN] dz in W1's row order"),
        _t("ds", "fp32", "rows", "N_TILES", written=True, doc="[rows, N_TILES] partial <dA', a> per N tile"),
        a_doc="dO rows gathered by token [rows, H] (quant_rows_gather)"),
    "dgrad2_fp8": _grouped_fp8(_ROW_W, _t("out", "bf16", "rows", "N_OUT", written=True, doc="[rows, H] dx per slot"),
                               a_doc="dz [rows, 2 FFN] (quant_rows_used)"),
    "gemm1_mx": _grouped_mx(_ROW_SRC, _H_OUT,
                            a_doc="gathered, quantized rows xq [rows, H] (quant_mx_gather)"),
    "gemm2_mx": _grouped_mx(_ROW_W, _t("out", "bf16", "rows", "N_OUT", written=True, doc="[rows, H] weighted ys"),
                            a_doc="quantized h [rows, FFN] (quant_mx_used)"),
    "gemm1_train_mx": _grouped_mx(_ROW_SRC, _H_OUT, _Z_OUT,
                                  a_doc="gathered, quantized rows xq [rows, H] (quant_mx_gather)"),
    "dgrad1_mx": _grouped_mx(
        _ROW_W, _t("out", "bf16", "rows", "N_OUT", written=True, doc="[rows, FFN] s * a (for dW2)"),
        _Z,
        _t("dz", "bf16", "rows", "2 * N_OUT", written=True, doc="[rows, 2 FFN] dz in W1's row order"),
        _t("ds", "fp32", "rows", "N_TILES", written=True, doc="[rows, N_TILES] partial <dA', a> per N tile"),
        a_doc="dO rows gathered by token and quantized along H [rows, H] (quant_mx_gather)", w=_W_MX_N),
    "dgrad2_mx": _grouped_mx(_ROW_W, _t("out", "bf16", "rows", "N_OUT", written=True, doc="[rows, H] dx per slot"),
                             a_doc="dz's used rows quantized along 2 FFN [rows, 2 FFN] (quant_mx_dz)", w=_W_MX_N),
    "dgrad1": _grouped(
        _W_N, _ROW_W, _t("out", "bf16", "rows", "N_OUT", written=True, doc="[rows, FFN] s * a (for dW2)"),
        _Z,
        _t("dz", "bf16", "rows", "2 * N_OUT", written=True, doc="[rows, 2 FFN] dz in W1's row order"),
        _t("ds", "fp32", "rows", "N_TILES", written=True, doc="[rows, N_TILES] partial <dA', a> per N tile"),
        a_doc="dO rows gathered by token [rows, H]"),
    "dgrad2": _grouped(_W_N, _ROW_W, _t("out", "bf16", "rows", "N_OUT", written=True, doc="[rows, H] dx per slot"),
                       a_doc="dz [rows, 2 FFN]"),
    "wgrad1": _WGRAD,
    "wgrad2": _WGRAD,
    "wgrad1_acc": _WGRAD_ACC,
    "wgrad2_acc": _WGRAD_ACC,
    **{f"wgrad{i}{sfx}_fp8": t for i in (1, 2) for sfx, t in (("", _WGRAD_FP8), ("_acc", _WGRAD_FP8_ACC))},
    **{f"wgrad{i}{sfx}_mx": t for i in (1, 2) for sfx, t in (("", _WGRAD_MX), ("_acc", _WGRAD_MX_ACC))},
    "fused": (
        _t("x", "bf16", "tokens", "HIDDEN", doc="[T, H] token rows"),
        _t("w1", "bf16", "GROUPS", "2 * FFN", "HIDDEN", doc="[GROUPS, 2 FFN, H] (gate/up layout from W1_N / W1_P)"),
        _t("b1", "fp32", "B1_ROWS", "B1_COLS", doc="[GROUPS, 2 FFN] fp32 (or [1, 1])"),
        _t("w2", "bf16", "GROUPS", "HIDDEN", "FFN", doc="[GROUPS, H, FFN]"),
        _t("b2", "fp32", "B2_ROWS", "B2_COLS", doc="[GROUPS, H] fp32 (or [1, 1])"),
        _t("row_src", "int32", "rows", doc="[rows] token of each padded row"),
        _t("row_w", "fp32", "rows", doc="[rows] routing weight of each padded row"),
        _TILE_GROUP,
        _META,
        _t("slot_pos", "int32", "tokens", "SLOTS", doc="[T, slots] padded row of each slot"),
        _t("h", "bf16", "rows", "FFN", written=True, doc="[rows, FFN] workspace"),
        _t("ys", "bf16", "rows", "HIDDEN", written=True, doc="[rows, H] workspace"),
        _t("y", "bf16", "tokens", "HIDDEN", written=True, doc="[T, H] output"),
        _t("sync", "int32", "nsync", written=True,
           doc="[SYNC_DONE1 + max_m_tiles] zeroed by the routing kernel (sync[2] sticky)"),
        _NUM_CTAS,
    ),
}
# the FP8 quantization kernels (dtype fp8, templates/sm90/quant_*.py.j2): every size is symbolic (one compiled
# kernel serves x, h and dO, or W1 and W2); BLOCK = 128, the blockwise recipe's tile (mokgen/fp8.py)
_QUANT_W = (
    _t("w", "bf16", "groups", "n", "k", doc="[G, N, K] bf16 weights (N, K multiples of 16; partial edge blocks as if zero-padded)"),
    _t("q", "u8", "groups", "n", "k", written=True, doc="[G, N, K] e4m3 bits"),
    _t("s", "fp32", "groups", "nblocks", "kblocks", written=True, align=4,
       doc="[G, N/128, K/128] power-of-two block scales"),
)
ARGS.update({
    "quant_rows": (
        _t("x", "bf16", "rows", "cols", doc="[rows, K] bf16 (K a multiple of 16; a partial last 1x128 tile as if zero-padded)"),
        _t("q", "u8", "rows", "cols", written=True, doc="[rows, K] e4m3 bits"),
        _t("s", "fp32", "rows", "cblocks", written=True, align=4,
           doc="[rows, ceil(K/128)] power-of-two scale per 1x128 tile"),
    ),
    "quant_rows_used": (
        _t("x", "bf16", "rows", "cols", doc="[rows, K] bf16 (K a multiple of 16): rows of the padded row space"),
        _META,
        _t("q", "u8", "rows", "cols", written=True, doc="[rows, K] e4m3 bits (the used rows, meta[0] * BM)"),
        _t("s", "fp32", "rows", "cblocks", written=True, align=4,
           doc="[rows, K/128] power-of-two scale per 1x128 tile (the used rows)"),
    ),
    "quant_rows_gather": (
        _t("x", "bf16", "tokens", "cols", doc="[T, K] bf16 token rows (K a multiple of 16)"),
        _t("row_src", "int32", "rows", doc="[rows] token of each padded row (padding: token 0, quantized as such)"),
        _META,
        _t("q", "u8", "rows", "cols", written=True, doc="[rows, K] e4m3 bits of the gathered rows (the used rows)"),
        _t("s", "fp32", "rows", "cblocks", written=True, align=4,
           doc="[rows, K/128] power-of-two scale per 1x128 tile (the used rows)"),
    ),
    "quant_w": _QUANT_W,
    "quant_wt": _QUANT_W + (
        _t("qt", "u8", "groups", "k", "n", written=True, doc="[G, K, N] e4m3 bits of w transposed (qt[g,k,n] = q[g,n,k])"),
        _t("st", "fp32", "groups", "kblocks", "nblocks", written=True, align=4,
           doc="[G, K/128, N/128] the block scales transposed"),
    ),
    "quant_cols": (
        _t("x", "bf16", "rows", "cols", doc="[rows, K] bf16 (rows a multiple of 128, K of 16)"),
        _QT, _ST,
    ),
    "quant_cols_used": (
        _t("x", "bf16", "rows", "cols", doc="[rows, K] bf16 rows of the padded row space (K a multiple of 16)"),
        _META, _QT, _ST,
    ),
    "quant_cols_gather": (
        _t("x", "bf16", "tokens", "cols", doc="[T, K] bf16 token rows (K a multiple of 16)"),
        _t("row_src", "int32", "rows", doc="[rows] token of each padded row (padding: token 0)"),
        _META, _QT, _ST,
    ),
    "quant_both_used": (
        _t("x", "bf16", "rows", "cols", doc="[rows, K] bf16 rows of the padded row space (K a multiple of 16)"),
        _META, _Q_ROWS, _S_ROWS, _QT, _ST,
    ),
    "quant_both_gather": (
        _t("x", "bf16", "tokens", "cols", doc="[T, K] bf16 token rows (K a multiple of 16)"),
        _t("row_src", "int32", "rows", doc="[rows] token of each padded row (padding: token 0)"),
        _META, _Q_ROWS, _S_ROWS, _QT, _ST,
    ),
})
# the MXFP8 quantization kernels (dtype mxfp8, sm_100a, templates/sm100/quant_mx.py.j2): e4m3 bits and e8m0 codes
# per 32 elements along K, the codes packed in the block-scaled MMA's SF atoms (mokgen.fp8.pack_mx_scales)
_MX_SF = _t("sf", "u8", "sf_bytes", written=True, doc="e8m0 codes, packed over the rows (rows * K / 32 bytes)")
ARGS.update({
    "quant_mx_gather": (
        _t("x", "bf16", "tokens", "K_DIM", doc="[T, H] bf16 token rows"),
        _t("row_src", "int32", "rows", doc="[rows] token of each padded row (padding: token 0, quantized as such)"),
        _META,
        _t("q", "u8", "rows", "K_DIM", written=True, doc="[rows, H] e4m3 bits of the gathered rows (the used rows)"),
        _MX_SF,
    ),
    "quant_mx_used": (
        _t("x", "bf16", "rows", "K_DIM", doc="[rows, K] bf16 rows of the padded row space (h)"),
        _META,
        _t("q", "u8", "rows", "K_DIM", written=True, doc="[rows, K] e4m3 bits (the used rows, meta[0] * BM)"),
        _MX_SF,
    ),
    "quant_mx_w": (
        _t("w", "bf16", "GROUPS", "N_ROWS", "K_DIM", doc="[G, N, K] bf16 weights (W1: the spec's gate / up layout)"),
        _t("q", "u8", "GROUPS", "N_ROWS", "K_DIM", written=True, doc="[G, N, K] e4m3 bits (W1: concat row order)"),
        _t("sf", "u8", "GROUPS * PARTS * -(-(N_ROWS // PARTS) // 128) * -(-K_DIM // 128) * 512", written=True,
           doc="e8m0 codes packed per group, and per gate / up block of W1, in whole atoms (the padding codes 127)"),
    ),
    # the backward's weight copies (dgrad1: W2 [G, H, I], dgrad2: W1 [G, 2I, H]): 32-blocks down the columns, the
    # layout kept (the dgrads read them MN-major as (N = C, K = R)); codes packed per group as a [C, R / 32] matrix's
    "quant_mx_w_cols": (
        _t("w", "bf16", "GROUPS", "R_ROWS", "C_COLS", doc="[G, R, C] bf16 weights (W2 [G, H, I] or W1 [G, 2I, H] in "
           "the spec's gate / up layout)"),
        _t("q", "u8", "GROUPS", "R_ROWS", "C_COLS", written=True, doc="[G, R, C] e4m3 bits, w's layout"),
        _t("sf", "u8", "GROUPS * -(-C_COLS // 128) * -(-R_ROWS // 128) * 512", written=True,
           doc="e8m0 codes of the (32 rows, column) blocks, packed per group over the C columns as SF rows (K = R), "
           "in whole atoms (the padding codes 127)"),
    ),
    # the MXFP8 weight gradients' operands (plan wgrad*_dtype=mxfp8): rows of the padded row space quantized in
    # 32-row blocks down each column (the wgrad's K), kept in their row layout, the codes packed as the [C, rows / 32]
    # matrix's; rows of routing weight 0 (padding; a weight-0 slot adds nothing to a weight gradient) quantize as
    # zero, rows past meta[0] * BM are not written
    "quant_mx_cols_gather": (
        _t("x", "bf16", "tokens", "C_COLS", doc="[T, C] bf16 token rows (x; dO)"),
        _t("row_src", "int32", "rows", doc="[rows] token of each padded row"),
        _t("row_w", "fp32", "rows", doc="[rows] routing weight of each padded row (0: padding, quantizes as zero)"),
        _META,
        _t("q", "u8", "rows", "C_COLS", written=True, doc="[rows, C] e4m3 bits of the gathered rows (the used rows)"),
        _t("sf", "u8", "sf_bytes", written=True, doc="e8m0 codes of the (32 rows, column) blocks of the used rows, "
           "packed as the [C, rows / 32] matrix's"),
    ),
    "quant_mx_cols_used": (
        _t("x", "bf16", "rows", "C_COLS", doc="[rows, C] bf16 rows of the padded row space (dz; s a)"),
        _t("row_w", "fp32", "rows", doc="[rows] routing weight of each padded row (0: padding, quantizes as zero)"),
        _META,
        _t("q", "u8", "rows", "C_COLS", written=True, doc="[rows, C] e4m3 bits (the used rows, meta[0] * BM)"),
        _t("sf", "u8", "sf_bytes", written=True, doc="e8m0 codes of the (32 rows, column) blocks of the used rows, "
           "packed as the [C, rows / 32] matrix's"),
    ),
})
# expert parallelism (issue 22, mokgen/ep_ops.py; templates/sm90/ep_*.py.j2): the kernels of one rank of the
# pull-dispatch / push-combine protocol. Peer buffers are passed as int64 base addresses ([RANKS] device tensors:
# what torch's symmetric memory hands out as buffer_ptrs_dev, or the simulation's own tensors' data_ptr()), rows
# contiguous. The destination's row space is the single-GPU layer's (groups 0..LOCAL-1 its routed experts, rows
# source rank by source rank in (t, k) order; groups LOCAL.. the shared experts over its own tokens).
CUTE_TYPES["i64"] = "cutlass.Int64"
_ROW_RANK = _t("row_rank", "int32", "rows", doc="[rows] source rank of each padded row (-1: padding)")
_ROW_SLOT = _t("row_slot", "int32", "rows", doc="[rows] slot t * TOPK + k of the row on its source (shared: t * TOPK)")
ARGS.update({
    "ep_routing": (
        _t("idx_ptrs", "i64", "RANKS", doc="[RANKS] base address of each source rank's topk_idx [T_s, TOPK] int32 "
           "(global ids)"),
        _t("w_ptrs", "i64", "RANKS", doc="[RANKS] base address of each source rank's topk_weight [T_s, TOPK] fp32"),
        _t("src_tokens", "int32", "RANKS", doc="[RANKS] tokens T_s of each source rank", align=4),
        Arg("rank", "scalar", (), "this (destination and owner) rank"),
        _t("row_rank", "int32", "rows", written=True, doc=_ROW_RANK.doc),
        _t("row_slot", "int32", "rows", written=True, doc=_ROW_SLOT.doc),
        _t("row_w", "fp32", "rows", written=True, doc="[rows] routing weight of each padded row (shared 1, padding 0)"),
        _t("tile_group", "int32", "tiles", written=True, doc="[max_m_tiles] group of each routing tile (-1 after)"),
        _t("meta", "int32", "4", written=True, doc="[4] meta[0] routing tiles used; meta[1] error flag; meta[2] "
           "routed rows (the pushed ones); meta[3] ids out of range"),
        _t("slot_pos", "int32", "tokens", "TOPK + SHARED", written=True,
           doc="[T, slots] row of each own slot in [slot rows | row space] (-1: id out of range)"),
    ),
    "ep_dispatch": (
        _t("x_ptrs", "i64", "RANKS", doc="[RANKS] base address of each source rank's x [T_s, HIDDEN] bf16"),
        _ROW_RANK, _ROW_SLOT, _META,
        _t("xg", "bf16", "rows", "HIDDEN", written=True, doc="[rows, H] pulled rows (padding rows: zeros)"),
    ),
    "ep_push": (
        _t("ys", "bf16", "rows", "HIDDEN", doc="[rows, H] this rank's GEMM 2 output (weighted rows)"),
        _ROW_RANK, _ROW_SLOT,
        _t("meta", "int32", "4", doc="[4] meta[2] = routed rows: rows [0, meta[2]) are pushed"),
        _t("slot_ptrs", "i64", "RANKS", doc="[RANKS] base address of each owner's slot rows [T_s * TOPK, HIDDEN] bf16 "
           "(written through)"),
    ),
})
ARGS["routing_sync"] = ARGS["routing"] + (
    _t("sync", "int32", "nsync", written=True, doc="[SYNC_DONE1 + max_m_tiles] the fused kernel's counters, zeroed"),
)

# the symbolic sizes each kernel's compile() declares: name -> divisibility (None: any)
_GROUPED_SYMS = {"a_rows": None, "rows": "GROUP_M", "tiles": None}
SYMBOLS: dict[str, dict[str, str | None]] = {
    "routing": {"tokens": None, "rows": "BM", "tiles": None},
    "routing_sync": {"tokens": None, "rows": "BM", "tiles": None, "nsync": None},
    "gather": {"tokens": None, "rows": "BM"},
    "combine": {"tokens": None, "rows": None},
    "fused": {"tokens": None, "rows": "BM", "tiles": None, "nsync": None},
    **{k: _GROUPED_SYMS for k in ("gemm1", "gemm1_train", "gemm2", "dgrad1", "dgrad2", "gemm1_fp8",
                                  "gemm1_train_fp8", "gemm1_hq_fp8", "gemm1_train_hq_fp8", "gemm2_fp8", "dgrad1_fp8",
                                  "dgrad2_fp8")},
    **{k: {**_GROUPED_SYMS, "sfa_bytes": None} for k in ("gemm1_mx", "gemm2_mx", "gemm1_train_mx", "dgrad1_mx",
                                                           "dgrad2_mx")},
    **{k: {"rows": "GROUP_M"} for k in ("wgrad1", "wgrad2", "wgrad1_acc", "wgrad2_acc")},
    **{f"wgrad{i}{sfx}_fp8": {"rows": "GROUP_M", "kblocks": None} for i in (1, 2) for sfx in ("", "_acc")},
    **{f"wgrad{i}{sfx}_mx": {"rows": "GROUP_M", "sfa_bytes": None, "sfb_bytes": None} for i in (1, 2)
       for sfx in ("", "_acc")},
    # the scale tensors' block counts (ceil(K / 128), ...) are symbols of their own: the kernels index them and
    # never read their extents (a symbolic size takes no arithmetic in compile())
    "quant_rows": {"rows": None, "cols": "16", "cblocks": None},
    "quant_rows_used": {"rows": None, "cols": "16", "cblocks": None},
    "quant_rows_gather": {"tokens": None, "rows": None, "cols": "16", "cblocks": None},
    "quant_w": {"groups": None, "n": "16", "k": "16", "nblocks": None, "kblocks": None},
    "quant_wt": {"groups": None, "n": "16", "k": "16", "nblocks": None, "kblocks": None},
    "quant_cols": {"rows": "BLOCK", "cols": "16", "rblocks": None},
    "quant_cols_used": {"rows": "BLOCK", "cols": "16", "rblocks": None},
    "quant_cols_gather": {"tokens": None, "rows": "BLOCK", "cols": "16", "rblocks": None},
    "quant_both_used": {"rows": "BLOCK", "cols": "16", "rblocks": None, "cblocks": None},
    "quant_both_gather": {"tokens": None, "rows": "BLOCK", "cols": "16", "rblocks": None, "cblocks": None},
    "quant_mx_gather": {"tokens": None, "rows": "BM", "sf_bytes": None},
    "quant_mx_used": {"rows": "BM", "sf_bytes": None},
    "quant_mx_w": {},
    "quant_mx_w_cols": {},
    "quant_mx_cols_gather": {"tokens": None, "rows": "BM", "sf_bytes": None},
    "quant_mx_cols_used": {"rows": "BM", "sf_bytes": None},
}
SYMBOLS.update({"ep_routing": {"tokens": None, "rows": "BM", "tiles": None}, "ep_dispatch": {"rows": "BM"},
                "ep_push": {"rows": "BM"}})
EP_KERNELS = ("ep_routing", "ep_dispatch", "ep_push")
FP8_QUANT_KERNELS = ("quant_rows", "quant_rows_used", "quant_rows_gather", "quant_w", "quant_wt", "quant_cols",
                     "quant_cols_used", "quant_cols_gather", "quant_both_used", "quant_both_gather")
# the FP8 quantizers an FP8 layer launches (mokgen/ops.py): x's gathered rows, h's used rows, the weights (and
# their transposed copies for the dgrads); with FP8 weight gradients also the column quantizers of s a and the x
# rows and the one-read row + column forms of dO and dz. quant_rows / quant_cols (whole tensors) are for tests.
FP8_LAYER_KERNELS = ("quant_rows_gather", "quant_rows_used", "quant_w", "quant_wt")
# ... and x's per-token rows where a GEMM 1 gathers them itself (plan a_load "gather": fp8_layer_kernels)
FP8_GATHER_KERNELS = ("quant_rows",)
FP8_WGRAD_KERNELS = ("quant_cols_used", "quant_cols_gather", "quant_both_used", "quant_both_gather")
# the MXFP8 (sm_100a) quantization kernels: kernel -> its ARGS table
MX_QUANT_KERNELS = {"quant_mx_gather": "quant_mx_gather", "quant_mx_used": "quant_mx_used", "quant_mx_w1": "quant_mx_w",
                    "quant_mx_w2": "quant_mx_w"}
# ... and the backward's (a training plan): dz's used rows along 2I (dgrad2's A; dO's gathered rows, dgrad1's A, are
# quant_mx_gather's: K = H as x's), W2 / W1 with their 32-blocks along H / 2I (the dgrads' B, MN-major)
MX_QUANT_BACKWARD = {"quant_mx_dz": "quant_mx_used", "quant_mx_w2_cols": "quant_mx_w_cols",
                     "quant_mx_w1_cols": "quant_mx_w_cols"}
# ... and the MXFP8 weight gradients' (plan wgrad*_dtype=mxfp8): 32-row blocks down the columns of the row space's
# operands: x's and dO's rows gathered (K = H: one kernel for both), s a (I columns) and dz (2I) from the row space
MX_QUANT_WGRAD = {"quant_mx_cols_gather": "quant_mx_cols_gather", "quant_mx_sa_cols": "quant_mx_cols_used",
                  "quant_mx_dz_cols": "quant_mx_cols_used"}
# the quantizers each MXFP8 weight gradient needs: wgrad1 = dz^T x rows, wgrad2 = dO rows^T (s a)
MX_WGRAD_QUANT = {"wgrad1": ("quant_mx_dz_cols", "quant_mx_cols_gather"),
                  "wgrad2": ("quant_mx_cols_gather", "quant_mx_sa_cols")}


def fp8_a_gather(plan: Any) -> tuple[str, ...]:
    """The GEMM 1 kernels of an FP8 plan ("gemm1": the inference one, "gemm1_train") that gather x's per-token e4m3
    rows themselves (plan a_load "gather": x quantized by ``quant_rows``) instead of reading quant_rows_gather's
    rows by TMA."""
    if getattr(getattr(plan, "spec", None), "dtype", "bf16") != "fp8":
        return ()
    g1, g1t = getattr(plan, "gemm1", None), getattr(plan, "train_gemm1", None)
    return tuple(n for n, g in (("gemm1", g1), ("gemm1_train", g1t if getattr(plan, "backward", None) else None))
                 if getattr(g, "a_load", "tma") == "gather")


def fp8_layer_kernels(plan: Any) -> tuple[str, ...]:
    """The FP8 quantizers every launch of an FP8 plan's layer may need (FP8_LAYER_KERNELS, and quant_rows where
    a GEMM 1 gathers: :func:`fp8_a_gather`)."""
    return FP8_LAYER_KERNELS + (FP8_GATHER_KERNELS if fp8_a_gather(plan) else ())


def uses_gather_kernel(plan: Any, training: bool = False) -> bool:
    """True when the plan's GEMM 1 (``training``: gemm1_train, :attr:`mokgen.plan.Plan.train_gemm1`) reads
    pre-gathered rows ``xg`` (a_load "tma") written by a ``gather`` kernel, instead of gathering rows of x itself
    (a_load "gather"). The FP8 / MXFP8 forwards gather x's rows in their quantizer."""
    g = getattr(plan, "train_gemm1" if training else "gemm1", None)
    dtype = getattr(getattr(plan, "spec", None), "dtype", "bf16")
    return getattr(g, "a_load", "gather") == "tma" and dtype not in ("fp8", "mxfp8")


def gather_in_training(plan: Any) -> bool:
    """Does the training step of a chain plan launch the ``gather`` kernel? BF16: yes (the backward's bf16 rows of dO
    and x for the BF16 weight gradients, and gemm1_train's rows where it reads TMA tiles). FP8 / MXFP8: only for
    a BF16 weight gradient or db2 (the bias gradient sums the bf16 dO rows); with both weight gradients in FP8 and
    no bias, the quantizers gather every row the step needs (quant_*_gather)."""
    spec = getattr(plan, "spec", None)
    if getattr(spec, "dtype", "bf16") == "mxfp8":   # likewise with both weight gradients in MXFP8
        return len(mx_wgrads(plan)) < 2 or bool(getattr(spec, "bias", False))
    if getattr(spec, "dtype", "bf16") != "fp8":
        return True
    return len(fp8_wgrads(plan)) < 2 or bool(getattr(spec, "bias", False))


def fp8_wgrads(plan: Any) -> tuple[str, ...]:
    """The weight gradients a plan runs in FP8 (their GemmPlan's e4m3 operands: plan ``wgrad*_dtype=fp8``)."""
    backward = getattr(plan, "backward", None)
    if backward is None or getattr(getattr(plan, "spec", None), "dtype", "bf16") != "fp8":
        return ()
    return tuple(n for n in ("wgrad1", "wgrad2") if getattr(getattr(backward, n), "elem_bytes", 2) == 1)


def mx_wgrads(plan: Any) -> tuple[str, ...]:
    """The weight gradients a plan runs in MXFP8 (dtype mxfp8 on sm_100a, plan ``wgrad*_dtype=mxfp8``: their
    GemmPlan's e4m3 operands)."""
    backward = getattr(plan, "backward", None)
    if backward is None or getattr(getattr(plan, "spec", None), "dtype", "bf16") != "mxfp8":
        return ()
    return tuple(n for n in ("wgrad1", "wgrad2") if getattr(getattr(backward, n), "elem_bytes", 2) == 1)


def mx_wgrad_quantizers(plan: Any) -> tuple[str, ...]:
    """The column quantizers an MXFP8 plan's MXFP8 weight gradients launch (none with BF16 weight gradients)."""
    w = mx_wgrads(plan)
    return tuple(k for k in MX_QUANT_WGRAD if any(k in MX_WGRAD_QUANT[n] for n in w))


def names(kernel: str) -> tuple[str, ...]:
    """The exported function's positional parameters, in order."""
    return tuple(a.name for a in ARGS[kernel])


def table_key(kernel: str, fused_routing: bool = False) -> str:
    """ARGS key of a kernel as loaded (the fused schedule's routing takes the sync workspace too)."""
    return "routing_sync" if kernel == "routing" and fused_routing else kernel


def call(fns: Mapping[str, Callable[..., Any]], kernel: str, *, table: str | None = None, **kw: Any) -> Any:
    """Launch ``fns[kernel]`` with keyword arguments named as in :data:`ARGS` (all of them, no others)."""
    rows = ARGS[table or kernel]
    if len(kw) != len(rows):
        want = {a.name for a in rows}
        raise TypeError(f"{kernel}: arguments {sorted(set(kw) - want)} unknown, {sorted(want - set(kw))} missing")
    try:
        return fns[kernel](*[kw[a.name] for a in rows])
    except KeyError as e:
        if e.args and isinstance(e.args[0], str) and e.args[0] in {a.name for a in rows} and e.args[0] not in kw:
            raise TypeError(f"{kernel}: argument {e.args[0]!r} missing") from None
        raise


def bind(kernel: str, impl: Callable[..., None], table: str | None = None) -> Callable[..., None]:
    """A positional callable in ``kernel``'s order over a keyword implementation (the reference's steps)."""
    order = names(table or kernel)

    def step(*args: Any) -> None:
        if len(args) != len(order):
            raise TypeError(f"{kernel}: expected {len(order)} arguments ({', '.join(order)}), got {len(args)}")
        impl(**dict(zip(order, args)))

    step.__name__ = f"ref_{kernel}"
    step.__qualname__ = step.__name__
    return step
