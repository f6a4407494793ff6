"""The FP8 forward's cost model (mokgen.plan FP8_MAINLOOP_EFF, FP8_WEIGHT_COEF, FP8_TILE_MS): fitted to the
H200's FP8 forward records committed under bench/results (mokgen.costmodel.fit_fp8); the plan's constants are
that fit, its predictions follow the measurements, and tune's model ranks FP8 plans by it."""

import dataclasses

import pytest

from mokgen import costmodel as C
from mokgen import plan as P
from mokgen.spec import load_spec


@pytest.fixture(scope="module")
def fitted():
    recs = C.fp8_records()
    return recs, C.fit_fp8(recs)


def test_records_cover_the_six_shapes(fitted):
    recs, _ = fitted
    names = {r.spec["name"] for r in recs}
    assert len(recs) >= 19 and len(names) == 6, names
    assert all(r.spec["dtype"] == "fp8" and r.ms > 0 for r in recs)
    kinds = {tuple(sorted(r.overrides)) for r in recs}   # each with the tiles it ran (costmodel.FP8_RECORD_BN)
    assert ("dgrad2_bn", "gemm1_bn", "gemm2_bn") in kinds
    assert ("dgrad2_bn", "gemm1_bn", "gemm1_promote", "gemm2_bn", "gemm2_promote") in kinds
    assert {r.overrides["gemm1_bn"] for r in recs} == {128}
    assert {r.overrides["gemm2_bn"] for r in recs} == {128, 256}


def test_plan_constants_are_the_fit(fitted):
    """Refit from the committed records: the plan's constants (rounded) are the fit's; the fit beats the
    priors and explains the records within a few percent."""
    _, f = fitted
    for key, eff in f["eff"].items():
        assert P.FP8_MAINLOOP_EFF[key] == pytest.approx(eff, abs=6e-4), key
    assert P.FP8_WEIGHT_COEF == pytest.approx(f["weights"], abs=6e-4)
    assert P.FP8_TILE_MS == pytest.approx(f["tiles"] * 1e-3, abs=6e-8)
    assert f["rms_rel_err"] < 0.03 < f["prior_rms_rel_err"]
    assert max(abs(i["fitted_ms"] / i["ms"] - 1) for i in f["inputs"]) < 0.06


def test_fit_reacts_to_its_inputs(fitted):
    """A fit is of its records: slowing every serial record by 20% lowers the serial efficiencies."""
    recs, f = fitted
    slow = [dataclasses.replace(r, ms=r.ms * 1.2) if r.overrides.get("gemm1_promote") == "serial" else r for r in recs]
    g = C.fit_fp8(slow)
    assert g["eff"][(1, "serial")] < f["eff"][(1, "serial")] - 0.02
    assert g["eff"][(1, "overlap")] == pytest.approx(f["eff"][(1, "overlap")], abs=0.03)


def test_plan_predictions_follow_the_measurements():
    """The FP8 plans' predicted forward times (what plan --explain prints) against the default-plan records of
    the six shapes (fp8-h200.json, device call 5), for the plan those runs had: GEMM 1, GEMM 2 and dgrad2 at 128
    columns (the 256-column defaults, plan.FP8_WIDE_DEFAULT, came later)."""
    want = {"kimi-k2": 1.808, "deepseek-v4-pro": 2.006, "glm-5": 1.542, "qwen3.5-397b-a17b": 0.698,
            "qwen3-30b-a3b": 0.530, "gpt-oss-120b": 1.548}
    for name, ms in want.items():
        spec = load_spec(name)
        spec = dataclasses.replace(spec, name=name + "-fp8", dtype="fp8",
                                   tokens=4096 if name in ("qwen3-30b-a3b", "gpt-oss-120b") else 2048)
        got = P.solve(spec, "sm_90a", gemm1_bn=128, gemm2_bn=128, dgrad2_bn=128).predicted_ms
        assert got == pytest.approx(ms, rel=0.06), (name, got, ms)


def test_tune_model_ranks_fp8_plans_by_the_fp8_model():
    spec = load_spec("kimi-k2-fp8")
    for ov in ({}, {"promote": "serial"}, {"gemm2_bn": 256}):
        p = P.solve(spec, "sm_90a", **ov)
        assert C.predict(C.PRIORS, C.features(spec, p), spec.tokens) == pytest.approx(p.predicted_ms, rel=0.01)
    fast, slow = (C.predict(C.PRIORS, C.features(spec, P.solve(spec, "sm_90a", **ov)), spec.tokens)
                  for ov in ({"gemm1_bn": 128, "gemm2_bn": 128}, {"promote": "serial", "gemm1_bn": 128,
                                                                  "gemm2_bn": 128}))
    assert fast < slow
    bf16 = C.fit(C.bench_records())
    assert "fp8" not in bf16.fitted_terms and bf16.theta["fp8"] == 1.0
