"""The GPU suites' checks can fail: on the CPU, with mokgen.reference's step functions standing in for the kernels
(the same launch sequence and arguments as on the GPU), each check of tests/test_gpu_backward.py and
tests/test_gpu_forward.py is run once on correct outputs (it passes) and once with one kernel's output perturbed or
left unwritten (it must fail, naming that output). The GPU suite runs the same perturbations on the real kernels
(``test_gpu_backward.py::test_checks_catch_a_perturbed_kernel``)."""

import pytest

import test_gpu_backward as gb
import test_gpu_forward as gf
from mokgen import ops
from mokgen import reference as ref
from mokgen.spec import load_spec

BM = 16


def tiny(bias: bool):
    d = dict(name="tiny", hidden=64, ffn=64, experts=6, topk=2, shared_experts=0 if bias else 1, ep=1, tokens=200,
             archs=["sm_90a"])
    if bias:
        d.update(activation="swiglu_oai", gate_up_layout="interleaved", bias=True)
    return load_spec(d)


@pytest.fixture(params=[False, True], ids=["swiglu", "oai-bias"])
def cpu_case(request, monkeypatch):
    monkeypatch.setattr(gb, "DEV", "cpu")
    spec = tiny(request.param)
    moe = ops.CompiledMoE(spec, BM, functions=ref.reference_kernels(spec, BM, training=True), allow_cpu=True)
    inp = ref.random_inputs(spec, tokens=200, seed=0)
    dy = gb.make_dy(200, spec.hidden, seed=100)
    args = (inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2, spec, inp.b1, inp.b2)
    g_ref = ref.Grads(*(None if t is None else t.float() for t in ref.backward(dy, *args)))
    return gb.Case(spec, moe, inp, dy, ref.forward(*args).float(), g_ref)


@pytest.mark.parametrize("kernel,out_arg,how,target", gb.PERTURBATIONS,
                         ids=[f"{p[0]}-{p[2]}" for p in gb.PERTURBATIONS])
def test_backward_checks_catch_a_perturbed_kernel(cpu_case, kernel, out_arg, how, target):
    gb.assert_checks_catch(cpu_case, kernel, out_arg, how, target)


def test_unwritten_output_reads_nan(cpu_case):
    """An output element no kernel writes stays NaN in train_call's poisoned out= buffers (the claim "every
    element written" holds by construction): a combine that skips the last token's row fails check_grads on dx."""
    spec, moe, inp, dy, _, g_ref = cpu_case
    orig = moe._fns["combine"]

    def combine_but_last(ys, slot_pos, y):
        keep = y[-1].clone()
        orig(ys, slot_pos, y)
        y[-1] = keep                      # the last row as it was before the call: NaN in a poisoned buffer

    moe._fns["combine"] = combine_but_last
    try:
        _, g = gb.train_call(moe, inp, dy)
    finally:
        moe._fns["combine"] = orig
    assert bool(g.x[-1].isnan().all()) and not bool(g.x[:-1].isnan().any())
    with pytest.raises(AssertionError, match="dx has NaN"):
        gb.check_grads(g, g_ref, inp, "tiny", skip=("topk_weight", "w1", "w2", "b1", "b2"))


def test_forward_check_close_fails_on_a_perturbed_output(cpu_case):
    spec, moe, inp, _, y_ref, _ = cpu_case
    y = moe(inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2, inp.b1, inp.b2)
    gf.check_close(y, y_ref, "tiny")
    with pytest.raises(AssertionError, match="relative error"):
        gf.check_close(y * 1.05, y_ref, "tiny/scaled")
    bad = y.clone()
    bad[3, 5] = float("nan")
    with pytest.raises(AssertionError, match="NaN in the output"):
        gf.check_close(bad, y_ref, "tiny/unwritten")


@pytest.fixture
def cpu_fp8_case(monkeypatch):
    """An FP8 spec on the reference kernels (its launch sequence and argument tables), with the GPU suite's own
    references: y against the quantization-aware one, the gradients against the BF16 one (gb.reference)."""
    from mokgen import plan as P
    from mokgen.spec import Spec

    monkeypatch.setattr(gb, "DEV", "cpu")
    spec = Spec(name="t8", hidden=256, ffn=256, experts=4, topk=2, tokens=64, dtype="fp8")
    pl = P.solve(spec, wgrad1_dtype="bf16", wgrad2_dtype="bf16")
    moe = ops.CompiledMoE(spec, pl, functions=ops.fp8_reference_kernels(spec, pl), allow_cpu=True)
    inp = ref.random_inputs(spec, tokens=64, seed=0)
    dy = gb.make_dy(64, spec.hidden, seed=100)
    return gb.Case(spec, moe, inp, dy, *gb.reference(spec, inp, dy))


@pytest.mark.parametrize("kernel,out_arg,how,target", [p for p in gb.PERTURBATIONS if p[3] == "y"],
                         ids=[f"{p[0]}-{p[2]}" for p in gb.PERTURBATIONS if p[3] == "y"])
def test_backward_checks_catch_a_perturbed_fp8_kernel(cpu_fp8_case, kernel, out_arg, how, target):
    """On an FP8 spec the suite's y check (against ref.forward_fp8) catches a perturbed GEMM 2 or combine and passes
    on the restored kernels, the gradients within gb.FP8_GRAD_TOL of the BF16 reference; FP8's GEMM 2 is perturbed
    through its own argument table (gemm2_fp8), so the scaled tensor is its output."""
    gb.assert_checks_catch(cpu_fp8_case, kernel, out_arg, how, target)


def test_fp8_y_check_is_tighter_than_the_bf16_reference(cpu_fp8_case):
    """The FP8 y reference is the quantization-aware one: the correct FP8 output is within gb.TOL of it but not of
    the BF16 reference (which is why the suite's BF16-only check failed every FP8 spec)."""
    spec, moe, inp, dy, y_ref, _ = cpu_fp8_case
    y, _ = gb.train_call(moe, inp, dy)
    gb.check_y(y, y_ref, "t8")
    y16 = ref.forward(inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2, spec).float()
    assert ref.rel_err(y, y16) > gb.TOL


@pytest.mark.parametrize("tokens", [1, 40])
def test_fp8_tokens_check_against_the_reference_kernels(cpu_fp8_case, monkeypatch, tokens):
    """test_tokens_not_a_tile_multiple on an FP8 spec checks the gradients against the same step on the reference
    kernels (within gb.TOL; the BF16 reference's FP8 bound skips the router gradient of fewer than 64 values): it
    passes on the reference kernels themselves and fails once the step's dw1 is 5% off."""
    gb.test_tokens_not_a_tile_multiple(cpu_fp8_case, tokens)
    real = gb.train_call

    def off(*a, **kw):
        y, g = real(*a, **kw)
        return y, g._replace(w1=g.w1 * 1.05)

    monkeypatch.setattr(gb, "train_call", off)
    with pytest.raises(AssertionError, match=r"reference kernels\): dw1 relative error"):
        gb.test_tokens_not_a_tile_multiple(cpu_fp8_case, tokens)
