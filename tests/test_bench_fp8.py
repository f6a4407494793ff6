"""tools/bench_fp8.py on the CPU: the dry run (FP8 GEMMs emulated) and the mokgen rows with stand-ins."""

import json
import sys
from pathlib import Path

import pytest
import torch

TOOLS = Path(__file__).resolve().parents[1] / "tools"
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))

import bench_fp8 as BP  # noqa: E402
import bench_forward as BF  # noqa: E402

import mokgen  # noqa: E402
from mokgen import reference as ref  # noqa: E402

needs_grouped_mm = pytest.mark.skipif(not BP.B.grouped_mm_available("cpu")[0],
                                      reason="torch._grouped_mm does not run on this CPU")


@needs_grouped_mm
def test_dry_run_writes_records(tmp_path):
    out = tmp_path / "fp8.json"
    assert BP.main(["--dry-run", "--backward", "--out", str(out), "--rounds", "2"]) == 0
    recs = json.loads(out.read_text())
    for r in recs:
        for f in BP.RECORD_FIELDS:
            assert f in r, f
    by = {(r["shape"], r["impl"], r.get("pass", "fwd")): r for r in recs}
    for s in BP.DRY_RUN_SPECS:
        n = s["name"]
        for impl in ("torch_grouped_mm", "torch_fp8_grouped_mm", "torch_fp8_grouped_mm_prequant",
                     "torch_fp8_grouped_mm_fast_accum", "torch_fp8_gemm_only"):
            r = by[(n, impl, "fwd")]
            assert "error" not in r, (impl, r.get("error"))
            assert r["median_ms"] > 0 and len(r["round_ms"]) == 2
        fp8 = by[(n, "torch_fp8_grouped_mm", "fwd")]
        assert fp8["dtype"] == "fp8" and 0.01 < fp8["rel_err"] < 0.12 and 0.01 < fp8["rel_err_vs_bf16"] < 0.12
        assert fp8["speedup_vs_torch_fp8"] == pytest.approx(1.0) and fp8["bf16_ref"] == "torch_grouped_mm"
        assert fp8["bitwise_deterministic"] is True
        assert by[(n, "torch_grouped_mm", "fwd")]["dtype"] == "bf16"
        assert "error" in by[(n, "torchao_fp8", "fwd")] or by[(n, "torchao_fp8", "fwd")]["median_ms"] > 0
        for impl in ("torch_grouped_mm", "torch_fp8_grouped_mm", "torch_fp8_grouped_mm[wgrad=bf16]"):
            r = by[(n, impl, "fwd+bwd")]
            assert "error" not in r, r.get("error")
            assert r["fb_ms"] > 0 and r["grad_rel_err"] < (1e-9 if impl == "torch_grouped_mm" else 0.12)
    assert {r["impl"] for r in recs if r["shape"] == "dense-256"} == set(BP.DENSE)
    assert all("error" not in r for r in recs if r["shape"] == "dense-256")


def test_dry_run_writes_nothing_by_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert BP.main(["--dry-run", "--impls", "torch_fp8_gemm_only,dense_fp8_mm"]) == 0
    assert not (tmp_path / "bench").exists()


class FakeCompiled:
    class plan:
        schedule = "fake"
        notes = ()

    def __init__(self, spec):
        self.spec = spec

    def __call__(self, x, topk_idx, topk_weight, w1, w2, b1=None, b2=None):
        return ref.forward(x, topk_idx, topk_weight, w1, w2, self.spec, b1, b2, dtype=torch.float32,
                           out_dtype=torch.bfloat16)

    def check_errors(self):
        pass


@needs_grouped_mm
def test_mokgen_rows_with_stand_ins(monkeypatch):
    seen = []

    def fake_compile(spec, arch=None, force=False, overrides=None):
        s = mokgen.load_spec(spec) if isinstance(spec, dict) and spec.get("dtype") != "fp8" else spec
        seen.append(spec["dtype"] if isinstance(spec, dict) else spec.dtype)
        if isinstance(spec, dict) and spec["dtype"] == "fp8":
            s = mokgen.load_spec(spec)  # the spec accepts fp8 (hidden and ffn multiples of 128)
        return FakeCompiled(s)

    monkeypatch.setattr(mokgen, "compile", fake_compile)
    spec = BF.resolve_spec(BP.DRY_RUN_SPECS[0])
    device = torch.device("cpu")
    recs = BP.bench_shape(spec, ["torch_grouped_mm", "mokgen", "mokgen_fp8", "torch_fp8_grouped_mm"],
                          dict(gpu="cpu", date="now", versions={}), BF.Timer(device), device, seed=1)
    by = {r["impl"]: r for r in recs}
    assert seen == ["bf16", "fp8"]
    assert "error" not in by["mokgen"] and by["mokgen"]["speedup_vs_bf16"] == pytest.approx(1.0)
    assert "error" not in by["mokgen_fp8"] and by["mokgen_fp8"]["dtype"] == "fp8"
    fp8 = by["torch_fp8_grouped_mm"]
    assert fp8["bf16_ref"] == "mokgen"
    assert fp8["speedup_vs_bf16"] == pytest.approx(by["mokgen"]["median_ms"] / fp8["median_ms"])
    BP.print_table(recs, "stand-ins")
    # given the FP8 spec itself, the BF16 row still compiles the BF16 twin
    seen.clear()
    BP.bench_shape(mokgen.load_spec(BP.spec_as(spec, "fp8")), ["mokgen", "mokgen_fp8"],
                   dict(gpu="cpu", date="now", versions={}), BF.Timer(device), device, seed=1)
    assert seen == ["bf16", "fp8"]


def test_fp8_spec_mapping():
    spec = BF.resolve_spec(BP.DRY_RUN_SPECS[1])
    d = BP.spec_as(spec, "fp8")
    assert d["dtype"] == "fp8" and d["hidden"] == spec.hidden and spec.dtype == "bf16"
    # an FP8 preset given to the bench: its BF16 row compiles the BF16 twin, not the FP8 spec again
    fp8 = BF.resolve_spec("kimi-k2-fp8")
    assert fp8.dtype == "fp8"
    b = BP.spec_as(fp8, "bf16")
    assert b["dtype"] == "bf16" and mokgen.load_spec(b).dtype == "bf16" and b["hidden"] == fp8.hidden


@needs_grouped_mm
def test_backward_rows_of_mokgen_on_reference_kernels(monkeypatch):
    """--backward's mokgen and mokgen_fp8 rows (here mokgen's launch sequence on the reference kernels): every
    gradient close to torch's bf16 ones, the FP8 ratios taken against the rows measured in the same call, interleaved
    rounds recorded."""
    from mokgen.integrations.common import reference_compiler

    make = reference_compiler()
    seen = []

    def ref_compile(spec, arch=None, force=False, overrides=None):
        s = mokgen.load_spec(spec) if isinstance(spec, dict) else spec
        seen.append(s.dtype)
        return make(s)

    monkeypatch.setattr(mokgen, "compile", ref_compile)
    spec = BF.resolve_spec(BP.DRY_RUN_SPECS[0])
    device = torch.device("cpu")
    impls = ["torch_grouped_mm", "torch_fp8_grouped_mm", "mokgen", "mokgen_fp8"]
    recs = BP.bench_backward_shape(spec, dict(gpu="cpu", date="now", versions={}), BF.Timer(device, 1.0, 2.0),
                                   device, seed=3, impls=impls, rounds=2)
    by = {r["impl"]: r for r in recs}
    assert seen == ["bf16", "fp8"] and list(by) == impls
    for impl in impls:
        r = by[impl]
        assert "error" not in r, (impl, r.get("error"))
        assert r["pass"] == "fwd+bwd" and r["fb_ms"] > 0 and len(r["round_ms"]) == 2
        assert r["fb_ms"] == pytest.approx(sorted(r["round_ms"])[0] / 2 + sorted(r["round_ms"])[1] / 2)
        assert r["bitwise_deterministic"] is True and r["bf16_ref"] == "mokgen"
    assert by["mokgen"]["dtype"] == "bf16" and by["mokgen_fp8"]["dtype"] == "fp8"
    assert by["mokgen"]["grad_rel_err"] < 2e-2          # bf16 kernels against torch's bf16 pipeline
    assert 1e-2 < by["mokgen_fp8"]["grad_rel_err"] < 0.15   # FP8 operands: a few percent, not more
    assert set(by["mokgen_fp8"]["grad_rel_errs"]) == {"x", "topk_weight", "w1", "w2"}
    fp8 = by["mokgen_fp8"]
    assert fp8["speedup_vs_bf16"] == pytest.approx(by["mokgen"]["fb_ms"] / fp8["fb_ms"])
    assert fp8["speedup_vs_torch_fp8"] == pytest.approx(by["torch_fp8_grouped_mm"]["fb_ms"] / fp8["fb_ms"])
    assert by["torch_grouped_mm"]["speedup_vs_bf16"] == pytest.approx(by["mokgen"]["fb_ms"]
                                                                       / by["torch_grouped_mm"]["fb_ms"])


def test_negative_settle_is_refused(capsys):
    assert BP.main(["--dry-run", "--settle-s", "-1", "--out", "-"]) == 2
    assert "--settle-s must be >= 0" in capsys.readouterr().err
