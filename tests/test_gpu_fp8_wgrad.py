"""The FP8 weight-gradient kernels on a GPU (H200, sm_90a), alone: templates/sm90/wgrad.py.j2's FP8 form and the
column quantizers, built for a small fp8 spec whose weight gradients are FP8 (128 x 128 tiles with wgrad1
overlapped and wgrad2 staggered, and 128 x 256 tiles promoted per half: VARIANTS),
fed operands the GPU's quant_cols_used wrote from random bf16 rows (no zeros), against
mokgen.reference.ref_wgrad_fp8 (the same per-128-row-block promotion, each block's e4m3 products summed exactly)
and against the float64 product of the dequantized operands.

Groups of 0, 128, 384 and 1152 rows (empty; fewer K blocks than stages; more: the staggered promotion's tiles),
M / N not multiples of 128 (partial tiles: 640 x 320 for dW1-like, 384 x 320 for dW2-like); outputs poisoned
(NaN / a sentinel) first: every element written, an empty group's bf16 gradient exactly zero and its fp32
main_grad untouched; bitwise run to run and at half vs all the SMs' CTAs (66 vs 132 on an H200). A timing line
per kernel (CUDA events, median): FP8 against the BF16 weight gradient of the same shape, same process.

    PYTHONPATH=$PWD python -m pytest -q -s tests/test_gpu_fp8_wgrad.py
"""
from __future__ import annotations

import os

import pytest
import torch

from mokgen import fp8_ops, kernels
from mokgen import reference as R

pytestmark = [pytest.mark.gpu, pytest.mark.fp8]
DEV = "cuda"
H, I, E = 384, 320, 4
GROUP_ROWS = (0, 128, 384, 1152)


# The kernel forms under test: "tile128" = 128 x 128 tiles, wgrad1 overlapping its promotion (chains of 4 blocks:
# the 9-block group runs 4 + 4 + 1, the 3-block one 2 + 1), wgrad2 staggering it (serial is the default of the
# layer suites); "wide" = 128 x 256 tiles in two wgmma halves promoted in turn, the warpgroups one half apart (the
# default: plan.fp8_wgrad_wide; the last N tile of dW1-like is half, of dW2-like a quarter, inside the tile's
# bounds); "wide_serial" the same halves with the warpgroups together
VARIANTS = {"tile128": dict(wgrad1_promote="overlap", wgrad2_bn=128, wgrad2_promote="stagger"),
            "wide": dict(wgrad1_bn=256, wgrad2_bn=256),
            "wide_serial": dict(wgrad1_bn=256, wgrad2_bn=256, wgrad1_promote="serial", wgrad2_promote="serial")}


def _plan(variant: str = "tile128"):
    from mokgen import plan as P
    from mokgen.spec import load_spec

    spec = load_spec({"name": "fp8-wgrad-test", "hidden": H, "ffn": I, "experts": E, "topk": 2, "tokens": 1024,
                      "dtype": "fp8"})
    return P.solve(spec, "sm_90a", wgrad1_dtype="fp8", wgrad2_dtype="fp8", **VARIANTS[variant])


KERNELS = ("wgrad1", "wgrad1_acc", "wgrad2", "wgrad2_acc", "quant_cols_used")
BF16_KERNELS = ("wgrad1", "wgrad2")


def build_library(out, fp8: bool = True, variant: str = "tile128") -> None:
    """Emit and build the kernels this test loads (fp8=False: the BF16 plan's weight gradients, for the timing)."""
    import dataclasses

    from mokgen import build
    from mokgen import plan as P
    from mokgen.emit import emit

    # the FP8 spec's weight gradients are FP8 by default: the BF16 twins are asked for
    pl = _plan(variant) if fp8 else P.solve(_plan().spec, "sm_90a", wgrad1_dtype="bf16", wgrad2_dtype="bf16")
    src = emit(pl)
    keep = {f"{k}.py" for k in (KERNELS if fp8 else BF16_KERNELS)}
    build.build(dataclasses.replace(src, files={n: t for n, t in src.files.items() if n in keep}), "sm_90a", out,
                progress=False)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def fns(request, tmp_path_factory):
    from mokgen.ops import load_library

    prebuilt = os.environ.get("MOKGEN_FP8_WGRAD_LIB") if request.param == "tile128" else None
    out = prebuilt or tmp_path_factory.mktemp(f"fp8wgrad-{request.param}")
    if not prebuilt:
        build_library(out, variant=request.param)
    return load_library(out, KERNELS)


def _call(fns, kernel, table=None, sync=True, **kw):
    import tvm_ffi

    with tvm_ffi.use_torch_stream(torch.cuda.device(0)):
        kernels.call(fns, kernel, table=table, **kw)
    if sync:
        torch.cuda.synchronize()


def _operands(fns, n_cols: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    rows = sum(GROUP_ROWS)
    x = torch.randn(rows, n_cols, generator=g, device=DEV).to(torch.bfloat16)
    x[x == 0] = 1.0
    meta = torch.tensor([rows // 128, 0, 0, 0], dtype=torch.int32, device=DEV)
    qt, st = fp8_ops.quantize_used_cols(fns, x, meta)
    torch.cuda.synchronize()
    return x, qt, st


def _group_start():
    gs = [0]
    for r in GROUP_ROWS:
        gs.append(gs[-1] + r)
    return torch.tensor(gs, dtype=torch.int32, device=DEV)


@pytest.mark.parametrize("name,m_out,n_out", [("wgrad1", 2 * I, H), ("wgrad2", H, I)])
def test_fp8_wgrad_kernel(fns, name, m_out, n_out, ctas):
    xa, a, sa = _operands(fns, m_out, 1)
    xb, b, sb = _operands(fns, n_out, 2)
    gs = _group_start()
    want = torch.empty(len(GROUP_ROWS), m_out, n_out, dtype=torch.bfloat16, device=DEV)
    R.ref_wgrad_fp8(a, sa, b, sb, gs, want, 0)
    runs = []
    for num_ctas in (ctas.full, ctas.full, ctas.half):
        out = torch.full((len(GROUP_ROWS), m_out, n_out), float("nan"), dtype=torch.bfloat16, device=DEV)
        _call(fns, name, table=name + "_fp8", a=a, sa=sa, b=b, sb=sb, group_start=gs, out=out, num_ctas=num_ctas)
        runs.append(out)
    out = runs[0]
    assert not bool(out.isnan().any()), f"{name}: an element was not written"
    assert bool((out[0] == 0).all()), f"{name}: the empty group's gradient is not zero"
    assert all(torch.equal(out.view(torch.int16), r.view(torch.int16)) for r in runs[1:]), \
        f"{name}: bits differ run to run or between {ctas.full} and {ctas.half} CTAs"
    err = R.rel_err(out.float(), want.double())
    # the float64 product of the dequantized operands, per group
    from mokgen import fp8

    f64 = torch.zeros(out.shape, dtype=torch.float64, device=DEV)
    qa, qb = a.view(fp8.E4M3).double(), b.view(fp8.E4M3).double()
    for gi in range(len(GROUP_ROWS)):
        r0, r1 = int(gs[gi]), int(gs[gi + 1])
        if r1 > r0:
            da = qa[:, r0:r1] * sa[r0 // 128:r1 // 128].double().T.repeat_interleave(128, dim=1)
            db = qb[:, r0:r1] * sb[r0 // 128:r1 // 128].double().T.repeat_interleave(128, dim=1)
            f64[gi] = da @ db.T
    err64 = R.rel_err(out.float(), f64)
    e16 = R.rel_err(out.float(), torch.stack([xa[int(gs[i]):int(gs[i + 1])].double().T
                                              @ xb[int(gs[i]):int(gs[i + 1])].double()
                                              for i in range(len(GROUP_ROWS))]))
    print(f"\n{name} FP8 [{m_out} x {n_out}]: rel err {err:.2e} vs the reference kernel, {err64:.2e} vs float64 on "
          f"the dequantized operands, {e16:.2e} vs the bf16 operands' float64 product")
    assert err < 5e-3 and err64 < 5e-3, (err, err64)
    # the fp32 main_grad form: added into, an empty group untouched
    base = torch.full((len(GROUP_ROWS), m_out, n_out), 0.5, dtype=torch.float32, device=DEV)
    acc = base.clone()
    _call(fns, name + "_acc", table=name + "_acc_fp8", a=a, sa=sa, b=b, sb=sb, group_start=gs, out=acc,
          num_ctas=ctas.full)
    assert bool((acc[0] == 0.5).all()), f"{name}_acc: the empty group's main_grad changed"
    assert R.rel_err(acc - base, out.double()) < 5e-3


def test_fp8_wgrad_timing(fns, tmp_path, ctas):
    """FP8 against BF16 weight gradients of the test's shapes (small: a sanity line, not a benchmark; the bench is
    tools/bench_backward.py with --variants wgrad1_dtype=fp8,wgrad2_dtype=fp8)."""
    from mokgen.ops import load_library

    build_library(tmp_path, fp8=False)
    bf = load_library(tmp_path, BF16_KERNELS)
    gs = _group_start()
    rows = sum(GROUP_ROWS)
    for name, m_out, n_out in (("wgrad1", 2 * I, H), ("wgrad2", H, I)):
        _, a, sa = _operands(fns, m_out, 3)
        _, b, sb = _operands(fns, n_out, 4)
        a16 = torch.randn(rows, m_out, device=DEV).to(torch.bfloat16)
        b16 = torch.randn(rows, n_out, device=DEV).to(torch.bfloat16)
        out = torch.empty(len(GROUP_ROWS), m_out, n_out, dtype=torch.bfloat16, device=DEV)
        ms = {}
        for label, f, kw in (("fp8", fns, dict(table=name + "_fp8", a=a, sa=sa, b=b, sb=sb)),
                             ("bf16", bf, dict(a=a16, b=b16))):
            for _ in range(3):
                _call(f, name, group_start=gs, out=out, num_ctas=ctas.full, **kw)
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(20)]
            for s, e in ev:   # launches queued back to back: the events time the kernel, not the host
                s.record()
                _call(f, name, group_start=gs, out=out, num_ctas=ctas.full, sync=False, **kw)
                e.record()
            torch.cuda.synchronize()
            ms[label] = sorted(s.elapsed_time(e) for s, e in ev)[10]
        print(f"{name} [{m_out} x {n_out}, {rows} rows]: FP8 {ms['fp8'] * 1e3:.1f} us, BF16 {ms['bf16'] * 1e3:.1f} us")
        assert ms["fp8"] > 0 and ms["bf16"] > 0


if __name__ == "__main__":  # python tests/test_gpu_fp8_wgrad.py build DIR  (a CPU host with the CuTe DSL)
    import sys

    if sys.argv[1:2] != ["build"] or len(sys.argv) != 3:
        sys.exit("usage: python tests/test_gpu_fp8_wgrad.py build DIR")
    build_library(sys.argv[2])
