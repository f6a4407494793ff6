"""The FP8 quantization kernels (quant_rows*, quant_w, quant_wt, quant_cols*) on a GPU (H200, sm_90a), built from
templates/sm90/quant_*.py.j2 with mokgen.build and loaded with mokgen.ops.load_library.

Per kernel: random bf16 inputs (no zeros) with an all-zero block, a block of huge values (near bf16's top), a
block of tiny ones (subnormal fp32 products: no flush to zero allowed) and a row / column spanning many binades;
outputs poisoned first (0xFF bytes, NaN scales); compared bit for bit with the CPU reference (mokgen.fp8 with
pow2=True, through mokgen.fp8_ops' reference steps); every element written; a second run gives the same bits;
a timing line (GB/s of reads + writes, CUDA events, median).

    PYTHONPATH=$PWD python -m pytest -q -s -m gpu tests/test_gpu_fp8_quant.py

``MOKGEN_GPU_QUANT_ROWS`` sets the row count of the timed activation case (default 32768);
``MOKGEN_FP8_QUANT_LIB=DIR`` loads a library built elsewhere (``python tests/test_gpu_fp8_quant.py build DIR`` on a
CPU host with the CuTe DSL) instead of building one here.
"""
from __future__ import annotations

import os

import pytest
import torch

from mokgen import fp8_ops, kernels

pytestmark = [pytest.mark.gpu, pytest.mark.fp8]
DEV = "cuda"
TIMED_ROWS = int(os.environ.get("MOKGEN_GPU_QUANT_ROWS", "32768"))


def build_library(out) -> None:
    """Emit and build the four quantization kernels for sm_90a into ``out`` (libmokgen.so)."""
    from mokgen import build
    from mokgen.emit import emit_fp8_quant
    from mokgen.plan import solve
    from mokgen.spec import load_spec

    spec = load_spec({"name": "fp8-quant-test", "hidden": 1024, "ffn": 512, "experts": 8, "topk": 2,
                      "tokens": 256, "dtype": "fp8"})
    build.build(emit_fp8_quant(solve(spec, "sm_90a")), "sm_90a", out, progress=False)


@pytest.fixture(scope="module")
def fns(tmp_path_factory):
    from mokgen.ops import load_library

    out = os.environ.get("MOKGEN_FP8_QUANT_LIB")
    if not out:
        out = tmp_path_factory.mktemp("fp8quant")
        build_library(out)
    return load_library(out, kernels.FP8_QUANT_KERNELS)


def special(x: torch.Tensor) -> torch.Tensor:
    """x with an all-zero 128x128 block (so every tiling sees zero blocks), huge values, tiny values and a
    many-binade block, in place on the trailing two dims."""
    x[..., 0:128, 128:256] = 0
    x[..., 128:256, 0:128] *= 1e36                     # |x| up to ~4e36 * 4.5 (bf16 max 3.4e38)
    x[..., 256:384, 0:128] *= 1e-38                    # subnormal fp32 inputs / products
    r = x.shape[-2] - 1
    x[..., r, :] *= torch.exp2(torch.linspace(-40, 40, x.shape[-1], device=x.device)).to(x.dtype)
    return x


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(*shape, generator=g, device=DEV).to(torch.bfloat16)
    x[x == 0] = 1.0                                    # no accidental zeros: only the planned zero block
    return special(x)


def poisoned(shape, dtype) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=DEV)
    return t.fill_(255) if dtype == torch.uint8 else t.fill_(float("nan"))


def run(fns, kernel: str, inputs: dict, outputs: dict) -> dict:
    out = {k: poisoned(*v) for k, v in outputs.items()}
    import tvm_ffi

    with tvm_ffi.use_torch_stream(torch.cuda.device(0)):
        kernels.call(fns, kernel, **inputs, **out)
    torch.cuda.synchronize()
    return out


def reference(kernel: str, inputs: dict, outputs: dict) -> dict:
    cpu_in = {k: v.cpu() for k, v in inputs.items()}
    out = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in outputs.items()}
    fp8_ops.reference_quant_kernels()[kernel](*[{**cpu_in, **out}[n] for n in kernels.names(kernel)])
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    return torch.equal(a.cpu(), b.cpu())


def median_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(b) for a, b in ev)[reps // 2]


def check(fns, kernel, inputs, outputs):
    got = run(fns, kernel, inputs, outputs)
    want = reference(kernel, inputs, outputs)
    for name in outputs:
        g, w = got[name], want[name]
        if g.dtype == torch.uint8:
            assert not bool((g == 255).any()), f"{kernel}.{name}: 0xFF bytes (e4m3 NaN: the poison, not written)"
        else:
            assert not bool(g.isnan().any()), f"{kernel}.{name}: NaN (an element not written?)"
        if not same_bits(g, w):
            bad = (g.cpu() != w).nonzero()
            raise AssertionError(f"{kernel}.{name}: {bad.shape[0]} elements differ from the reference, first at "
                                 f"{bad[0].tolist()}: {g.cpu()[tuple(bad[0])]!r} vs {w[tuple(bad[0])]!r}")
    again = run(fns, kernel, inputs, outputs)
    assert all(same_bits(got[n], again[n]) for n in outputs), f"{kernel}: a second run gave other bits"
    return got


def timed(fns, kernel, inputs, outputs, what):
    out = {k: torch.empty(shape, dtype=dtype, device=DEV) for k, (shape, dtype) in outputs.items()}
    import tvm_ffi

    def go():
        with tvm_ffi.use_torch_stream(torch.cuda.device(0)):
            kernels.call(fns, kernel, **inputs, **out)

    ms = median_ms(go)
    nbytes = sum(t.numel() * t.element_size() for t in (*inputs.values(), *out.values()))
    print(f"\n{kernel} {what}: {ms * 1e3:.1f} us, {nbytes / ms / 1e6:.0f} GB/s (reads + writes)")


@pytest.mark.parametrize("rows,K", [(1000, 1024), (4096 + 37, 7168), (384, 128), (300, 2880)])
def test_quant_rows(fns, rows, K):
    x = randn(rows, K, seed=rows)
    out = {"q": ((rows, K), torch.uint8), "s": ((rows, -(-K // 128)), torch.float32)}   # a partial last tile
    got = check(fns, "quant_rows", {"x": x}, out)
    q, s = fp8_ops.quantize_rows(fns, x)   # the helper: the same bits
    assert same_bits(q, got["q"]) and same_bits(s, got["s"])
    if K == 7168:
        big = torch.randn(TIMED_ROWS, K, device=DEV).to(torch.bfloat16)
        timed(fns, "quant_rows", {"x": big}, {"q": ((TIMED_ROWS, K), torch.uint8),
                                              "s": ((TIMED_ROWS, K // 128), torch.float32)}, f"[{TIMED_ROWS}, {K}]")


@pytest.mark.parametrize("G,N,K", [(3, 512, 1024), (2, 7168 // 2, 512), (2, 2880, 5760 - 64)])
@pytest.mark.parametrize("kernel", ["quant_w", "quant_wt"])
def test_quant_w(fns, kernel, G, N, K):
    w = randn(G, N, K, seed=G * N + K)
    nb, kb = -(-N // 128), -(-K // 128)   # partial edge blocks where 128 does not divide N / K
    out = {"q": ((G, N, K), torch.uint8), "s": ((G, nb, kb), torch.float32)}
    if kernel == "quant_wt":
        out.update(qt=((G, K, N), torch.uint8), st=((G, kb, nb), torch.float32))
    got = check(fns, kernel, {"w": w}, out)
    if kernel == "quant_wt":
        assert torch.equal(got["qt"], got["q"].mT) and same_bits(got["st"], got["s"].mT.contiguous())
        res = fp8_ops.quantize_w(fns, w, transpose=True)
        assert all(same_bits(a, got[n]) for a, n in zip(res, ("q", "s", "qt", "st")))
    if (G, N) == (2, 7168 // 2):
        Gb, Nb, Kb = 8, 4096, 7168
        big = torch.randn(Gb, Nb, Kb, device=DEV).to(torch.bfloat16)
        bout = {"q": ((Gb, Nb, Kb), torch.uint8), "s": ((Gb, Nb // 128, Kb // 128), torch.float32)}
        if kernel == "quant_wt":
            bout.update(qt=((Gb, Kb, Nb), torch.uint8), st=((Gb, Kb // 128, Nb // 128), torch.float32))
        timed(fns, kernel, {"w": big}, bout, f"[{Gb}, {Nb}, {Kb}]")


@pytest.mark.parametrize("rows,K", [(1024, 512), (4096, 7168)])
def test_quant_cols(fns, rows, K):
    x = randn(rows, K, seed=rows + K)
    out = {"qt": ((K, rows), torch.uint8), "st": ((rows // 128, K), torch.float32)}
    got = check(fns, "quant_cols", {"x": x}, out)
    qt, st = fp8_ops.quantize_cols(fns, x)
    assert same_bits(qt, got["qt"]) and same_bits(st, got["st"])
    if K == 7168:
        big = torch.randn(TIMED_ROWS, K, device=DEV).to(torch.bfloat16)
        timed(fns, "quant_cols", {"x": big}, {"qt": ((K, TIMED_ROWS), torch.uint8),
                                              "st": ((TIMED_ROWS // 128, K), torch.float32)}, f"[{TIMED_ROWS}, {K}]")


@pytest.mark.parametrize("rows,K,used_tiles", [(1024, 512, 5), (2048, 2880, 16), (512, 7168, 0)])
@pytest.mark.parametrize("form", ["quant_cols_used", "quant_cols_gather", "quant_both_used", "quant_both_gather"])
def test_quant_cols_forms(fns, form, rows, K, used_tiles):
    """The FP8 weight gradients' column quantizers (and the one-read forms that also write the 1x128 rows): only
    the used rows' blocks (meta[0] 128-row tiles) are written, bit for bit the reference's (the gathered form:
    rows x[row_src[r]], padding rows token 0, a row_src of garbage past the used rows never read); a partial last
    128-column block (K 2880); nothing written with no used rows."""
    meta = torch.tensor([used_tiles, 0, 0, 0], dtype=torch.int32, device=DEV)
    n = used_tiles * 128
    if form.endswith("_used"):
        x = randn(rows, K, seed=rows + K)
        inputs = {"x": x, "meta": meta}
    else:
        T = 777
        x = randn(T, K, seed=T + K)
        row_src = torch.randint(0, T, (rows,), dtype=torch.int32, device=DEV)
        if n:
            row_src[n - 40:n] = 0                                # padding rows: token 0
        row_src[n:] = 1 << 30                                    # garbage past the used rows: never read
        inputs = {"x": x, "row_src": row_src, "meta": meta}
    out = {"qt": ((K, rows), torch.uint8), "st": ((rows // 128, K), torch.float32)}
    if form.startswith("quant_both"):
        out.update(q=((rows, K), torch.uint8), s=((rows, -(-K // 128)), torch.float32))
    got = run(fns, form, inputs, out)
    want = reference(form, inputs, out)
    assert same_bits(got["qt"][:, :n], want["qt"][:, :n]) and same_bits(got["st"][:used_tiles], want["st"][:used_tiles])
    assert bool((got["qt"][:, n:] == 255).all()) and bool(got["st"][used_tiles:].isnan().all())   # untouched
    if "q" in out:
        assert same_bits(got["q"][:n], want["q"][:n]) and same_bits(got["s"][:n], want["s"][:n])
        assert bool((got["q"][n:] == 255).all()) and bool(got["s"][n:].isnan().all())
    again = run(fns, form, inputs, out)
    assert same_bits(again["qt"][:, :n], got["qt"][:, :n]) and same_bits(again["st"][:used_tiles], got["st"][:used_tiles])
    if K == 7168 and form == "quant_cols_used":
        big = torch.randn(TIMED_ROWS, K, device=DEV).to(torch.bfloat16)
        m = torch.tensor([TIMED_ROWS // 128, 0, 0, 0], dtype=torch.int32, device=DEV)
        timed(fns, form, {"x": big, "meta": m}, {"qt": ((K, TIMED_ROWS), torch.uint8),
                                                  "st": ((TIMED_ROWS // 128, K), torch.float32)}, f"[{TIMED_ROWS}, {K}]")


if __name__ == "__main__":  # python tests/test_gpu_fp8_quant.py build DIR
    import sys

    if sys.argv[1:2] != ["build"] or len(sys.argv) != 3:
        sys.exit("usage: python tests/test_gpu_fp8_quant.py build DIR")
    build_library(sys.argv[2])
