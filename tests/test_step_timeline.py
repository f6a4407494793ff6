"""tools/step_timeline.py's phase labels: the runtime's launch sequence names a recorded step's generated kernels,
and each GEMM's sustained TFLOP/s and each backward GEMM's ratio to its forward twin follow from the spec."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from mokgen import ops, plan as P
from mokgen import reference as ref
from mokgen.spec import load_spec

REPO = Path(__file__).resolve().parents[1]


def _tool():
    name = "mokgen_tools_step_timeline"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "tools" / "step_timeline.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _moe(spec, **overrides):
    plan = P.solve(spec, "sm_90a", **overrides)
    fns = ref.reference_kernels(spec, plan.bm, gather=ops.uses_gather_kernel(plan), training=True,
                                gather_train=ops.uses_gather_kernel(plan, training=True))
    return ops.CompiledMoE(spec, plan, functions=fns, allow_cpu=True, arch="sm_90a")


def test_launch_sequence_follows_the_plan():
    qwen = _moe(load_spec("qwen3-30b-a3b"))     # small groups: a gather kernel before GEMM 1
    kimi = _moe(load_spec("kimi-k2"))           # GEMM 1 gathers its rows itself
    assert qwen.launch_sequence(training=False) == ("routing", "gather", "gemm1", "gemm2", "combine")
    assert kimi.launch_sequence(training=False) == ("routing", "gemm1", "gemm2", "combine")
    # training: gemm1_train reads the gather kernel's rows by TMA (its z through the stage ring: NOTES v17)
    assert kimi.launch_sequence() == ("routing", "gather", "gemm1_train", "gemm2", "combine", "gather_dO", "dgrad1",
                                      "wgrad2", "dgrad2", "combine_dx", "gather_x", "wgrad1")
    old = _moe(load_spec("kimi-k2"), gemm1_z_store="direct")   # the training GEMM 1 as the inference one
    assert old.launch_sequence() == ("routing", "gemm1_train", "gemm2", "combine", "gather_dO", "dgrad1", "wgrad2",
                                     "dgrad2", "combine_dx", "gather_x", "wgrad1")


def test_labels_a_recorded_step():
    """The dbrx-like baseline step recorded on the H200 (2026-12-04): GEMM 2 at ~695 TFLOP/s, the backward twins
    below 1 (the issue-19 gap)."""
    t = _tool()
    recs = [json.loads(line) for line in (REPO / "bench/results/step-timeline-h200.jsonl").read_text().splitlines()]
    rec = next(r for r in recs if r["spec"] == "tools/specs/dbrx-like.yaml" and r["impl"] == "mokgen"
               and "device call 1" in r.get("run", ""))
    spec = load_spec(REPO / "tools/specs/dbrx-like.yaml")
    unit = 2.0 * spec.tokens * (spec.topk + spec.shared_experts) * spec.hidden * spec.ffn
    moe = _moe(spec, gemm1_z_store="direct")   # the plan that step ran (before the training GEMM 1 split)
    phases, twins = t.label_phases(rec["kernels_ms"], moe.launch_sequence(), unit)
    names = [p for p, _, _ in phases]
    assert names == list(moe.launch_sequence())
    rate = {p: tf for p, _, tf in phases if tf is not None}
    assert set(rate) == {"gemm1_train", "gemm2", "dgrad1", "wgrad2", "dgrad2", "wgrad1"}
    assert rate["gemm2"] == pytest.approx(unit / (dict((p, ms) for p, ms, _ in phases)["gemm2"] * 1e-3) / 1e12, rel=1e-3)
    assert 650 < rate["gemm2"] < 750
    assert set(twins) == {"dgrad1", "wgrad2", "wgrad1"} and all(0.5 < v < 0.97 for v in twins.values()), twins


def test_mismatched_sequence_is_not_labelled():
    t = _tool()
    assert t.label_phases([("kernel_cutlass_a", 1.0, 1)], ("routing", "gemm1"), 1e12) == ([], {})
