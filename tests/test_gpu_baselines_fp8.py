"""The FP8 baselines on the GPU: torch._scaled_grouped_mm's calling convention as mokgen/baselines.py uses it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from mokgen import baselines as B  # noqa: E402
from mokgen.spec import load_spec  # noqa: E402

pytestmark = pytest.mark.gpu

SPEC = dict(name="fp8-small", hidden=256, ffn=128, experts=8, ep=1, topk=2, tokens=200, shared_experts=1,
            dtype="bf16", archs=["sm_90a"])


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _inputs(spec, seed=0, bias=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T, H, I, K, L, G = spec.tokens, spec.hidden, spec.ffn, spec.topk, spec.local_experts, spec.groups
    x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    idx = torch.randint(0, L, (T, K), device="cuda", generator=g).to(torch.int32)
    w = torch.softmax(torch.randn(T, K, device="cuda", generator=g), -1)
    w1 = (torch.randn(G, 2 * I, H, device="cuda", generator=g) * H ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(G, H, I, device="cuda", generator=g) * I ** -0.5).to(torch.bfloat16)
    b1 = torch.randn(G, 2 * I, device="cuda", generator=g) * 0.1 if bias else None
    b2 = torch.randn(G, H, device="cuda", generator=g) * 0.1 if bias else None
    return x, idx, w, w1, w2, b1, b2


@pytest.fixture(scope="module")
def sgmm_ok():
    ok, why = B.scaled_grouped_mm_available("cuda")
    if not ok:
        pytest.skip(why)


def test_scaled_grouped_mm_matches_float64_of_the_dequantized_operands(sgmm_ok):
    g = torch.Generator(device="cuda").manual_seed(1)
    a, sa = B.quantize_rowwise(torch.randn(96, 128, device="cuda", generator=g))
    wq, sw = B.quantize_rowwise(torch.randn(3, 64, 128, device="cuda", generator=g))
    for offs in ([32, 32, 96], [16, 48, 96]):  # an empty group; groups of 16-multiples
        o = torch.tensor(offs, dtype=torch.int32, device="cuda")
        for fast in (False, True):
            out = torch._scaled_grouped_mm(a, wq.transpose(-2, -1), sa, sw, offs=o, out_dtype=torch.bfloat16,
                                           use_fast_accum=fast)
            want = B.scaled_grouped_mm_emulated(a, wq.transpose(-2, -1), sa, sw, o, out_dtype=None,
                                                compute_dtype=torch.float64)
            assert out.dtype == torch.bfloat16 and out.shape == (96, 64)
            assert rel(out, want) <= 1e-2, (offs, fast)


def test_scaled_grouped_mm_unaligned_groups_report(sgmm_ok):
    """Group sizes that are not multiples of 16 (what align=1 passes): reported, not required."""
    g = torch.Generator(device="cuda").manual_seed(2)
    a, sa = B.quantize_rowwise(torch.randn(96, 128, device="cuda", generator=g))
    wq, sw = B.quantize_rowwise(torch.randn(3, 64, 128, device="cuda", generator=g))
    o = torch.tensor([5, 40, 96], dtype=torch.int32, device="cuda")
    try:
        out = torch._scaled_grouped_mm(a, wq.transpose(-2, -1), sa, sw, offs=o, out_dtype=torch.bfloat16)
        e = rel(out, B.scaled_grouped_mm_emulated(a, wq.transpose(-2, -1), sa, sw, o, out_dtype=None,
                                                  compute_dtype=torch.float64))
        print(f"unaligned groups [5, 40, 96]: rel err {e:.2e}")
    except Exception as ex:  # noqa: BLE001
        print(f"unaligned groups [5, 40, 96]: {type(ex).__name__}: {ex}")


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_pipeline_on_gpu(sgmm_ok, bias):
    spec = load_spec(dict(SPEC, bias=bias))
    x, idx, w, w1, w2, b1, b2 = _inputs(spec, bias=bias)
    y = B.torch_fp8_grouped_mm(x, idx, w, w1, w2, spec, b1, b2)
    # the same quantized operands through the emulated (float64) GEMM
    def sgmm64(a, b_t, sa, sb, offs, use_fast_accum=False, emulate=False):
        return B.scaled_grouped_mm_emulated(a, b_t, sa, sb, offs, compute_dtype=torch.float64)

    real = B._sgmm
    B._sgmm = sgmm64
    try:
        y64 = B.torch_fp8_grouped_mm(x, idx, w, w1, w2, spec, b1, b2)
    finally:
        B._sgmm = real
    assert rel(y, y64) <= 1e-2
    yb = B.torch_grouped_mm(x, idx, w, w1, w2, spec, b1, b2)
    e = rel(y, yb)
    print(f"fp8 pipeline vs bf16 torch_grouped_mm: rel err {e:.3e}")
    assert e < 0.12
    assert torch.equal(y, B.torch_fp8_grouped_mm(x, idx, w, w1, w2, spec, b1, b2))  # deterministic
    # no host sync
    torch.cuda.set_sync_debug_mode("error")
    try:
        B.torch_fp8_grouped_mm(x, idx, w, w1, w2, spec, b1, b2)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_fp8_gemm_only_dense_and_training_on_gpu(sgmm_ok):
    spec = load_spec(SPEC)
    x, idx, w, w1, w2, _, _ = _inputs(spec, seed=3)
    inp = B.prepare_fp8_gemm_only(x, idx, w1, w2, spec)
    h, o = B.torch_fp8_gemm_only(inp)
    he, oe = B.torch_fp8_gemm_only(inp, emulate=True)
    assert rel(h, he) < 1e-2 and rel(o, oe) < 1e-2
    a = torch.randn(256, 512, device="cuda").to(torch.bfloat16)
    b = torch.randn(512, 384, device="cuda").to(torch.bfloat16)
    d = B.prepare_dense_fp8(a, b)
    for fast in (False, True):
        assert rel(B.dense_fp8_mm(d, use_fast_accum=fast), B.dense_fp8_mm(d, emulate=True)) < 1e-2
    # training form: forward equal to the pipeline, gradients at FP8 level against bf16's
    for wgrad in ("fp8", "bf16"):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, w1, w2)]
        y = B.torch_fp8_grouped_mm_train(leaves[0], idx, leaves[1], leaves[2], leaves[3], spec, wgrad=wgrad)
        dy = torch.randn_like(y)
        y.backward(dy)
        ref = [t.detach().clone().requires_grad_(True) for t in (x, w, w1, w2)]
        B.torch_grouped_mm(ref[0], idx, ref[1], ref[2], ref[3], spec).backward(dy)
        errs = [rel(p.grad, q.grad) for p, q in zip(leaves, ref)]
        print(f"wgrad={wgrad}: grad rel errs vs bf16 (x, w, w1, w2) {errs}")
        assert max(errs) < 0.15


def test_torchao_fp8_on_gpu_report():
    ok, why = B.torchao_fp8_available("cuda")
    if not ok:
        pytest.skip(why)
    spec = load_spec(SPEC)
    x, idx, w, w1, w2, _, _ = _inputs(spec, seed=4)
    y = B.torchao_fp8_grouped_mm(x, idx, w, w1, w2, spec)
    e = rel(y, B.torch_grouped_mm(x, idx, w, w1, w2, spec))
    print(f"torchao fp8 vs bf16: rel err {e:.3e}")
    assert e < 0.12
