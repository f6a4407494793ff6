"""MXFP8 (dtype mxfp8, sm_100a; issue 20) where hidden / ffn are multiples of 64 but not of 128: gpt-oss-120b's
2880 = 22 x 128 + 64. The block-scaled GEMMs keep their 128-wide K tile and 128-row scale atoms of W; the last K
tile and the last N tile are partial: the e4m3 data past K (past N) is read as zeros by TMA, the scale tensors are
padded to whole atoms (128 rows x 4 blocks of 32) whose extra codes the quantizers write as 127 (scale 1, finite:
0xFF would be NaN and 0 x NaN is NaN), and the columns past N are not stored (GEMM 1's and dgrad1's SwiGLU
epilogues skip those slices' bias, z and dz).

Checked here on the CPU: the rendered quantizers' arithmetic, offsets and padding writes (emulated from their
constants and formulas) equal mokgen.fp8.quantize_mx / pack_mx_scales byte for byte, every byte of the padded
buffers written; the block-scaled MMA emulated over whole 128 K tiles and 128-row N tiles, fed exactly those
bytes with zeros past K and N, equals the float64 product of the dequantized operands (and a padding code left
0xFF would make it NaN); the plan and the emitted gpt-oss-120b-mxfp8 kernels; a small layer of the same structure
trained on the CPU reference kernels. The gpt-oss-120b MXFP8 kernels compile for sm_100a in
tests/test_mxfp8_shapes.py (test_preset_compiles_for_sm100a). Nothing here runs on a GPU."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from mokgen import fp8, mx_ops
from mokgen import reference as R
from mokgen.plan import PlanError, solve
from mokgen.spec import load_spec
from test_mxfp8 import _operand, _template_expr, boundary_rows, kernel_e8m0

MX = {"dtype": "mxfp8", "archs": ["sm_100a"]}
# gpt-oss's structure at a CPU size: hidden 320 = 2 x 128 + 64 and ffn 192 = 128 + 64 (GEMM 1: K 320, N 192 per
# part; GEMM 2: K 192, N 320; dgrad1: K 320, N 192; dgrad2: K 384 (whole), N 320), interleaved W1, biases
TINY = {"name": "mx-partial-tiny", "hidden": 320, "ffn": 192, "experts": 8, "topk": 4, "ep": 2, "tokens": 64,
        "activation": "swiglu_oai", "bias": True, "gate_up_layout": "interleaved", **MX}


def _plan(**changes):
    return solve(load_spec({**TINY, **changes}), "sm_100a")


SPEC_FILE = Path(__file__).resolve().parent.parent / "tools" / "specs" / "gpt-oss-120b-mxfp8.yaml"


def _gpt_oss_mx():
    return load_spec(SPEC_FILE)


def test_spec_file_is_the_preset_in_mxfp8():
    """tools/specs/gpt-oss-120b-mxfp8.yaml (its sources are golden: generated/sm_100a/gpt-oss-120b-mxfp8/) is the
    gpt-oss-120b preset with dtype mxfp8 on sm_100a, hidden = ffn = 2880 (not multiples of 128)."""
    spec = _gpt_oss_mx()
    assert spec.to_dict() == {**load_spec("gpt-oss-120b").to_dict(), "name": "gpt-oss-120b-mxfp8", "dtype": "mxfp8",
                              "archs": ["sm_100a"]}
    assert spec.hidden == spec.ffn == 2880


def _consts(text: str) -> dict:
    """The rendered kernel's module constants (the lines after KERNEL_NAME up to its first function), evaluated."""
    i = text.index("KERNEL_NAME = ")
    ns: dict = {}
    exec(text[i:text.index("\n@cute.jit", i)], ns)
    return ns


def _nan_scales(sf: torch.Tensor) -> torch.Tensor:
    """2**(code - 127) as the MMA reads e8m0, 0xFF as NaN."""
    s = torch.exp2(sf.to(torch.float64) - 127)
    return torch.where(sf == 255, torch.full_like(s, float("nan")), s)


# ---- the quantizers ---------------------------------------------------------------------------------------------


def emulate_row_quantizer(text: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The row quantizers (quant_mx_gather / _used / _dz) on rows x [R, K] (R % 128 == 0) as the rendered kernel
    runs them: K_TILES tiles of LANES lanes per row, each lane PER_LANE elements; a lane pair's 32-element block gets
    its code (kernel_e8m0), a lane pair past K_VECS (the partial last tile) code 127 and no data; the code bytes at
    the kernel's `off = ...` over its K_BLOCKS (padded to whole atoms)."""
    c_ = _consts(text)
    R_, K = x.shape
    assert c_["K_DIM"] == K and R_ % 128 == 0
    if K % 128:   # the kernel's padding lanes: code 127
        assert "    if col >= K_VECS:\n        pad = 1\n" in text and "    if pad != 0:\n        c = 127\n" in text
    k_tiles = c_.get("K_TILES", K // c_["TILE"])                       # the grid's tiles (K_DIM // TILE if whole)
    kb_all = k_tiles * c_["LANES"] // c_["PAIR"]                         # the lane pairs' blocks, whole atoms
    assert f"ROWS_PER_CTA, {'K_TILES' if 'K_TILES' in c_ else 'K_DIM // TILE'}, 1)," in text   # the launch grid
    assert kb_all == c_["K_BLOCKS"] == -(-K // 128) * 4
    xf = x.float().view(R_, K // 32, 32)
    code, inv = kernel_e8m0(xf.abs().amax(-1))
    q = fp8.to_e4m3(xf * inv.unsqueeze(-1)).view(R_, K).view(torch.uint8)
    code = torch.cat([code, torch.full((R_, kb_all - K // 32), 127, dtype=code.dtype)], dim=1)
    sf = torch.full((fp8.mx_sf_bytes(R_, K // 32),), 255, dtype=torch.uint8)   # 255: never written
    off = eval(_template_expr(text, "off = "), {"row": torch.arange(R_).view(-1, 1),
                                                 "kb": torch.arange(kb_all).view(1, -1), **c_})
    sf[off] = code.to(torch.uint8)
    return q, sf


@pytest.mark.parametrize("name,K", [("quant_mx_gather", 320), ("quant_mx_used", 192), ("quant_mx_dz", 384)])
def test_row_quantizers_pad_the_last_atom(name, K):
    """quant_mx_gather (K = hidden 320), quant_mx_used (K = ffn 192): the partial last tile's lanes write the
    atom's two missing blocks as 127; with quant_mx_dz (K = 2 ffn = 384, whole atoms) nothing is padded. The
    e4m3 bytes and every code byte equal quantize_mx / pack_mx_scales (fill 127), and the runtime's reference
    quantizer (mokgen.mx_ops) writes the same bytes."""
    from mokgen.sm100.emit import render_quant_mx

    text = render_quant_mx(_plan(), name)
    pad = K % 128 != 0
    assert ("K_VECS = K_DIM // PER_LANE" in text and "if col >= K_VECS:" in text) == pad
    x = boundary_rows(K)
    x = torch.cat([x, torch.randn(-x.shape[0] % 128 + 128, K).to(torch.bfloat16)])
    q, sf = emulate_row_quantizer(text, x)
    qr, er = fp8.quantize_mx(x)
    assert torch.equal(q, qr.view(torch.uint8))
    assert torch.equal(sf, fp8.pack_mx_scales(er))            # every byte written, the padding as 127
    assert {0, 127}.issubset(set(er.flatten().tolist()))
    q2 = torch.zeros_like(q)
    sf2 = torch.full_like(sf, 255)
    mx_ops.ref_quant_mx_used(x, torch.tensor([x.shape[0] // 128, 0, 0, 0], dtype=torch.int32), q2, sf2, bm=128)
    assert torch.equal(q2, q) and torch.equal(sf2, sf)


def emulate_w_quantizer(text: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quant_mx_w1 / quant_mx_w2 with blocks of N_PART rows that are not whole atoms (n_pad): each padded row runs
    the rendered row map (its lines, on Python ints) to (blk, r, out, src); rows r < N_PART quantize w's row src
    into output row out; codes at the rendered `off = ...` (block blk's codes after SF_BLOCK bytes each), 127 for
    padding rows (r >= N_PART) and lanes past K."""
    c_ = _consts(text)
    G, N, K = w.shape
    assert "    if r >= N_PART:\n        pad = 1\n" in text and "    if pad != 0:\n        c = 127\n" in text
    body = text[text.index("    n_rows = GROUPS * PARTS * N_PAD"):text.index("    # lanes past K_DIM")]
    lines = "\n".join(line[4:] for line in body.splitlines())
    flat = w.reshape(G * N, K)
    xf = flat.float().view(G * N, K // 32, 32)
    code, inv = kernel_e8m0(xf.abs().amax(-1))
    qall = fp8.to_e4m3(xf * inv.unsqueeze(-1)).view(G * N, K).view(torch.uint8)
    kb_all = c_["K_BLOCKS"]
    parts = c_["PARTS"]
    q = torch.zeros(G * N, K, dtype=torch.uint8)
    sf = torch.full((G * parts * fp8.mx_sf_bytes(N // parts, K // 32),), 255, dtype=torch.uint8)
    mn = type("C", (), {"min": staticmethod(min)})
    assert "launch(grid=((GROUPS * PARTS * N_PAD + ROWS_PER_CTA - 1) // ROWS_PER_CTA, K_TILES, 1)" in text
    for row in range(c_["GROUPS"] * parts * c_["N_PAD"]):
        ns = {**c_, "row": row, "cutlass": mn}
        exec(lines, ns)
        assert row < ns["n_rows"]   # the kernel's `if row < n_rows:`
        blk, r, out, src = ns["blk"], ns["r"], ns["out"], ns["src"]
        codes = torch.full((kb_all,), 127, dtype=torch.int32)
        if r < c_["N_PART"]:
            q[out] = qall[src]
            codes[:K // 32] = code[src]
        kb = torch.arange(kb_all)
        off = eval(_template_expr(text, "off = "), {**c_, "blk": blk, "r": r, "kb": kb})
        sf[off] = codes.to(torch.uint8)
    return q.view(G, N, K), sf


@pytest.mark.parametrize("name", ["quant_mx_w1", "quant_mx_w2"])
def test_weight_quantizers_pad_each_block(name):
    """quant_mx_w1 (W1 [G, 2I, H], interleaved, written in concat order: blocks of I = 192 rows, K = H = 320) and
    quant_mx_w2 (W2 [G, H, I]: blocks of H = 320 rows, K = I = 192): each (group, part) block's codes fill whole
    atoms, its padding rows and the last atom's missing blocks 127; equal to quantize_mx of the concat-order rows
    packed per block by pack_mx_scales, byte for byte, and to the runtime's reference quantizer."""
    from mokgen.sm100.emit import render_quant_mx

    plan = _plan()
    G, H, I = plan.spec.groups, 320, 192
    text = render_quant_mx(plan, name)
    assert "N_PAD = " in text and "if r >= N_PART:" in text and "if col >= K_VECS:" in text
    N, K, parts = (2 * I, H, 2) if name == "quant_mx_w1" else (H, I, 1)
    w = torch.stack([_operand(N, K, 30 + g) for g in range(G)])
    q, sf = emulate_w_quantizer(text, w)
    concat = torch.cat([w[:, 0::2], w[:, 1::2]], dim=1) if parts == 2 else w
    qr, er = fp8.quantize_mx(concat)
    assert torch.equal(q, qr.view(torch.uint8))
    assert torch.equal(sf, fp8.pack_mx_scales(er.reshape(G * parts, N // parts, K // 32)).flatten())
    q2, sf2 = torch.zeros_like(q), torch.full_like(sf, 255)
    mx_ops.ref_quant_mx_w(w, q2, sf2, parts=parts, interleave=parts == 2)
    assert torch.equal(q2, q) and torch.equal(sf2, sf)


def emulate_cols_quantizer_padded(text: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The column form (quant_mx_w*_cols) with partial atoms: its grid over GROUPS x K_BLOCKS (padded) blocks and
    C_PAD columns; a block past R_BLOCKS or a column past C_COLS writes code 127 at the rendered `off_pad = ...`,
    the others their code at `off = ...` and their e4m3 bytes in w's layout."""
    c_ = _consts(text)
    G, R_, C = w.shape
    assert (c_["R_ROWS"], c_["C_COLS"]) == (R_, C)
    assert " ".join(_template_expr(text, "off_pad = ").split()) == " ".join(_template_expr(text, "off = ").split())
    assert "mSF[off_pad] = cutlass.Uint8(127)" in text
    wf = w.float().view(G, R_ // 32, 32, C)
    code, inv = kernel_e8m0(wf.abs().amax(2))                                 # [G, R / 32, C]
    q = fp8.to_e4m3(wf * inv.unsqueeze(2)).view(G, R_, C).view(torch.uint8)
    # the grid: GROUPS * K_BLOCKS blocks of 32 rows, C_PAD_VECS vectors of VEC columns (threads past them return)
    assert "launch(grid=((C_PAD_VECS + THREADS - 1) // THREADS, GROUPS * K_BLOCKS, 1)" in text
    assert "    if cv < C_PAD_VECS and pad != 0:\n" in text
    KB, CP, RB = c_["K_BLOCKS"], c_["C_PAD_VECS"] * c_["VEC"], c_["R_BLOCKS"]
    codes = torch.full((G, KB, CP), 127, dtype=torch.int32)
    codes[:, :RB, :C] = code
    sf = torch.full((G * fp8.mx_sf_bytes(C, R_ // 32),), 255, dtype=torch.uint8)
    off = eval(_template_expr(text, "off = "), {**c_, "g": torch.arange(G).view(-1, 1, 1),
                                                 "kb": torch.arange(KB).view(1, -1, 1),
                                                 "row": torch.arange(CP).view(1, 1, -1)})
    sf[off] = codes.to(torch.uint8)
    return q, sf


@pytest.mark.parametrize("name", ["quant_mx_w2_cols", "quant_mx_w1_cols"])
def test_cols_quantizers_pad_the_atoms(name):
    """quant_mx_w2_cols (W2 [G, H, I]: K = H = 320, 10 blocks of 32 in 3 atoms; C = I = 192 scale rows in 2 atoms)
    and quant_mx_w1_cols (W1 [G, 2I, H]: K = 384 whole, C = H = 320): equal to quantize_mx of each W[g].mT packed by
    pack_mx_scales (fill 127), every byte written, and to the runtime's reference quantizer."""
    from mokgen.sm100.emit import render_quant_mx

    plan = _plan()
    G, H, I = plan.spec.groups, 320, 192
    text = render_quant_mx(plan, name)
    R_, C = (H, I) if name == "quant_mx_w2_cols" else (2 * I, H)
    w = torch.stack([_operand(R_, C, 40 + g) for g in range(G)])
    q, sf = emulate_cols_quantizer_padded(text, w)
    qr, er = fp8.quantize_mx(w.transpose(1, 2))
    assert torch.equal(q, qr.view(torch.uint8).transpose(1, 2))
    assert torch.equal(sf, fp8.pack_mx_scales(er).flatten())
    q2, sf2 = torch.zeros_like(q), torch.full_like(sf, 255)
    mx_ops.ref_quant_mx_w_cols(w, q2, sf2)
    assert torch.equal(q2, q) and torch.equal(sf2, sf)


# ---- the block-scaled MMA over whole tiles ------------------------------------------------------------------------


def whole_tile_gemm(qa: torch.Tensor, sfa: torch.Tensor, qb: torch.Tensor, sfb: torch.Tensor, K: int
                    ) -> torch.Tensor:
    """A [M, K] x B [N, K]^T as the sm_100a kernel computes it, float64: 128-row M and N tiles, 128-wide K tiles
    (whole: K rounded up), the e4m3 data past K and the W rows past N zero (TMA out of bounds), every 32-element
    block of the padded K scaled by both operands' codes at mx_sf_offset of the padded buffers (0xFF: NaN).
    Returns [M, N padded to 128] (the store clips the columns past N)."""
    M, N = qa.shape[0], qb.shape[0]
    KP, NP = -(-K // 128) * 128, -(-N // 128) * 128
    a = torch.zeros(M, KP, dtype=torch.float64)
    a[:, :K] = qa.view(fp8.E4M3).to(torch.float64)
    b = torch.zeros(NP, KP, dtype=torch.float64)
    b[:N, :K] = qb.view(fp8.E4M3).to(torch.float64)
    out = torch.zeros(M, NP, dtype=torch.float64)
    m, n = torch.arange(M), torch.arange(NP)
    for kb in range(KP // 32):
        sa = _nan_scales(sfa[fp8.mx_sf_offset(m, kb, KP // 32)])
        sb = _nan_scales(sfb[fp8.mx_sf_offset(n, kb, KP // 32)])
        out += (a[:, kb * 32:kb * 32 + 32] @ b[:, kb * 32:kb * 32 + 32].T) * sa.view(-1, 1) * sb.view(1, -1)
    return out


@pytest.mark.parametrize("which", ["gemm1", "gemm2", "dgrad1", "dgrad2"])
def test_block_scaled_gemm_over_partial_tiles(which):
    """Each MXFP8 GEMM of the small layer fed exactly the bytes its quantizers write (A: the row quantizer's; B:
    quant_mx_w1's gate / up block, quant_mx_w2's, or the column forms read (N, K)), run over whole 128 x 128 K / N
    tiles with zeros past K and N and the padding codes read: the columns < N equal the float64 product of the
    dequantized operands, those past N are zero (stored nowhere); a padding code left 0xFF (never written) would
    turn the product into NaN, so the padding writes are what makes it exact."""
    from mokgen.sm100.emit import render_quant_mx

    plan = _plan()
    G, H, I = plan.spec.groups, 320, 192
    K, N = {"gemm1": (H, I), "gemm2": (I, H), "dgrad1": (H, I), "dgrad2": (2 * I, H)}[which]
    a_kernel = {"gemm1": "quant_mx_gather", "gemm2": "quant_mx_used", "dgrad1": "quant_mx_gather",
                "dgrad2": "quant_mx_dz"}[which]
    a = _operand(130, K, 7)
    qa, sfa = emulate_row_quantizer(render_quant_mx(plan, a_kernel),
                                    torch.cat([a, torch.zeros(126, K, dtype=torch.bfloat16)]))
    g = 1
    if which in ("gemm1", "gemm2"):
        NW = 2 * N if which == "gemm1" else N
        w = torch.stack([_operand(NW, K, 50 + e) for e in range(G)])         # [G, N (W1: 2I interleaved), K]
        qw, sfw = emulate_w_quantizer(render_quant_mx(plan, "quant_mx_w1" if which == "gemm1" else "quant_mx_w2"), w)
        parts = 2 if which == "gemm1" else 1
        p = 1 if which == "gemm1" else 0                                      # GEMM 1: the up part
        block = fp8.mx_sf_bytes(N, K // 32)
        b_bytes, b_sf = qw[g, p * N:(p + 1) * N], sfw[(g * parts + p) * block:]
        b_vals = (w[g, 1::2] if which == "gemm1" else w[g])                  # [N, K]
    else:
        w = torch.stack([_operand(K, N, 60 + e) for e in range(G)])          # [G, K, N]: W2 / W1 as the dgrads read
        qw, sfw = emulate_cols_quantizer_padded(render_quant_mx(plan, f"quant_mx_w{2 if which == 'dgrad1' else 1}_cols"),
                                                w)
        b_bytes, b_sf = qw[g].T.contiguous(), sfw[g * fp8.mx_sf_bytes(N, K // 32):]
        b_vals = w[g].T
    got = whole_tile_gemm(qa[:130], sfa, b_bytes, b_sf, K)
    qa_r, ea_r = fp8.quantize_mx(a)
    qb_r, eb_r = fp8.quantize_mx(b_vals.contiguous())
    want = fp8.gemm_mx_f64(qa_r, ea_r, qb_r, eb_r)
    assert torch.allclose(got[:, :N], want, rtol=1e-12, atol=0)
    assert not got[:, N:].any()
    exact = a.double() @ b_vals.double().T
    assert (got[:, :N] - exact).norm() / exact.norm() < 0.08
    # the padding codes are read: as 0xFF (what an unwritten byte may hold) they poison the product
    if K % 128:
        bad = sfa.clone()
        kb = torch.arange(K // 32, -(-K // 128) * 4)
        bad[fp8.mx_sf_offset(torch.arange(130).view(-1, 1), kb.view(1, -1), kb[-1].item() + 1)] = 255
        assert whole_tile_gemm(qa[:130], bad, b_bytes, b_sf, K)[:, :N].isnan().all()
    if N % 128:
        bad = b_sf.clone()
        rows = torch.arange(N, -(-N // 128) * 128).view(-1, 1)
        kb = torch.arange(-(-K // 128) * 4).view(1, -1)
        bad[fp8.mx_sf_offset(rows, kb, kb.shape[1])] = 255
        assert whole_tile_gemm(qa[:130], sfa, b_bytes, bad, K)[:, N:].isnan().all()


# ---- spec, plan, emit -------------------------------------------------------------------------------------------


def test_gpt_oss_120b_mxfp8_plan():
    """gpt-oss-120b in MXFP8: hidden = ffn = 2880 taken; every block-scaled GEMM 23 K tiles and 23 N tiles of 128
    (the last of each partial: 64), its budgets checked (check_plan empty), the plan's note says how the partial
    tiles are read; MXFP8 weight gradients (opt-in) refused in one line, the BF16 ones the default."""
    from mokgen import configs
    from mokgen.sm100 import rules

    plan = solve(_gpt_oss_mx(), "sm_100a")
    bw = plan.backward
    for name, g in (("gemm1", plan.gemm1), ("gemm2", plan.gemm2), ("dgrad1", bw.dgrad1)):
        assert (g.bk, g.elem_bytes, g.k_tiles, g.n_tiles) == (128, 1, 23, 23), name
    assert (bw.dgrad2.k_tiles, bw.dgrad2.n_tiles) == (45, 23)
    assert configs.check_plan(plan) == []
    limit = 232448
    assert all(t.problems(limit) == [] for t in rules.kernel_tiles(plan).values())
    assert any("hidden 2880 = 22 x 128 + 64, ffn 2880 = 22 x 128 + 64: the last K / N tile partial" in n
               for n in plan.notes)
    assert (bw.wgrad1.elem_bytes, bw.wgrad2.elem_bytes) == (2, 2)
    for key in ("wgrad1_dtype", "wgrad2_dtype"):
        with pytest.raises(PlanError) as e:
            solve(_gpt_oss_mx(), "sm_100a", **{key: "mxfp8"})
        text = str(e.value)
        assert "\n" not in text and text.startswith(f"plan.{key}: MXFP8 weight gradients need hidden and ffn "
                                                    f"multiples of 128") and "got hidden 2880, ffn 2880" in text
    # whole multiples of 128: no note, and the opt-in stays open
    assert not any("partial" in n for n in solve(load_spec({**TINY, "hidden": 256, "ffn": 128}), "sm_100a").notes)


def test_gpt_oss_120b_mxfp8_emit():
    """The emitted gpt-oss-120b-mxfp8 training entry: the GEMMs' ceil K / N tile counts, GEMM 1's and dgrad1's
    epilogues guarding the slices past N (bias, z, dz), the quantizers padding their atoms; GEMM 2 and dgrad2 (the
    plain epilogues) clip by the TMA store as the BF16 kernels do."""
    from mokgen.emit import emit

    f = emit(solve(_gpt_oss_mx(), "sm_100a")).files
    for k, k_tiles in (("gemm1", 23), ("gemm1_train", 23), ("gemm2", 23), ("dgrad1", 23), ("dgrad2", 45)):
        text = f[f"{k}.py"]
        assert "N_TILES = 23 " in text and re.search(rf"^K_TILES = {k_tiles}\b", text, re.M), k
        assert ("the last K tile is partial" in text) == (k_tiles == 23), k
        guards = text.count("if col0 < N_OUT:")
        assert guards == {"gemm1": 1, "gemm1_train": 2, "dgrad1": 2}.get(k, 0), (k, guards)
    assert "z_zero" not in f["dgrad1.py"] and "zgu.fill(0.0)" in f["dgrad1.py"]
    for k in ("quant_mx_gather", "quant_mx_used", "quant_mx_w1", "quant_mx_w2"):
        assert "K_BLOCKS = (K_DIM // SF_VEC + 3) // 4 * 4" in f[f"{k}.py"], k
    assert "K_BLOCKS = K_DIM // SF_VEC\n" in f["quant_mx_dz.py"]   # K = 2 ffn = 5760: whole atoms
    for k in ("quant_mx_w1", "quant_mx_w2"):
        assert "N_PAD = " in f[f"{k}.py"], k
    for k in ("quant_mx_w1_cols", "quant_mx_w2_cols"):
        assert "C_PAD = " in f[f"{k}.py"] and "off_pad = " in f[f"{k}.py"], k
    kimi = emit(solve(load_spec(Path(__file__).resolve().parent.parent / "tools" / "specs" / "kimi-k2-mxfp8.yaml"),
                      "sm_100a")).files
    assert not any("if col0 < N_OUT:" in t or "N_PAD = " in t or "C_PAD = " in t or "K_VECS" in t
                   for k, t in kimi.items() if k.startswith(("gemm", "dgrad", "quant_mx")))


def test_training_step_on_reference_kernels():
    """The small layer of gpt-oss's structure (K and N partial in every GEMM but dgrad2's K) run forward and
    backward on the CPU reference kernels (the MXFP8 runtime path: the quantizers' bytes in padded buffers, the
    GEMMs on the dequantized packed operands) against the float64 references on the dequantized operands and the
    BF16 reference (MXFP8's resolution)."""
    from mokgen.ops import CompiledMoE

    spec = load_spec(TINY)
    pl = solve(spec, "sm_100a")
    moe = CompiledMoE(spec, pl, functions=R.reference_kernels(spec, pl.bm, training=True), allow_cpu=True,
                      arch="sm_100a")
    inp = R.random_inputs(spec, tokens=spec.tokens, seed=3)
    a = (inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2, inp.b1, inp.b2)
    y = moe(*a)
    assert R.rel_err(y.float(), R.forward_mx(*a[:5], spec, b1=a[5], b2=a[6])) < 1e-2
    assert 0.02 < R.rel_err(y.float(), R.forward(*a[:5], spec, b1=a[5], b2=a[6])) < 0.15
    y2, saved = moe.forward_train(*a)
    assert torch.equal(y, y2)
    dy = torch.randn(spec.tokens, spec.hidden, generator=torch.Generator().manual_seed(4)).bfloat16()
    g = moe.backward(dy, saved, inp.x, inp.topk_weight, inp.w1, inp.w2, inp.b1, inp.b2)
    rm = R.backward_mx(dy, *a[:5], spec, b1=a[5], b2=a[6])
    r16 = R.backward(dy, *a[:5], spec, b1=a[5], b2=a[6])
    for name in ("x", "topk_weight", "w1", "w2", "b1", "b2"):
        got = getattr(g, name).float()
        assert bool(torch.isfinite(got).all()), name
        assert R.rel_err(got, getattr(rm, name)) < 1e-2, name
        if name not in ("b1", "b2"):
            assert 0.02 < R.rel_err(got, getattr(r16, name)) < 0.15, name
