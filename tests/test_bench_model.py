"""tools/bench_model.py on the CPU: the dry run (a tiny Qwen3-MoE-shaped model, mokgen's backend on its
reference kernels and transformers' grouped_mm, a few AdamW steps) and its records; tools/model_profile.py (the
same model taken apart): its dry run, routing statistics and kernel classes."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

TOOLS = Path(__file__).resolve().parents[1] / "tools"
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))

import bench_model as BM  # noqa: E402
import model_profile as MP  # noqa: E402

import mokgen.integrations.transformers as mt  # noqa: E402


@pytest.fixture(autouse=True)
def restore_backend():
    old, opts = mt.set_compiler(None), mt.options()
    mt.set_compiler(old)
    yield
    mt.set_compiler(old)
    mt.configure(tokens=opts.tokens, dtype=opts.dtype)


def test_dry_run_writes_records(tmp_path):
    out = tmp_path / "model.json"
    assert BM.main(["--dry-run", "--out", str(out), "--rounds", "2", "--steps", "5"]) == 0
    recs = json.loads(out.read_text())
    assert [r["impl"] for r in recs] == ["no_experts", "grouped_mm", "mokgen", "mokgen_fp8"]   # liger needs CUDA
    ref, recs = recs[0], recs[1:]
    assert ref["speedup_vs_grouped_mm"] is None and ref["experts_ms"] is None and "error" not in ref
    for r in recs:
        assert r["experts_ms"] == pytest.approx(r["median_ms"] - ref["median_ms"])
        assert r["experts_share"] == pytest.approx(r["experts_ms"] / r["median_ms"])
        assert "error" not in r, r.get("error")
        for f in BM.RECORD_FIELDS:
            assert f in r, f
        assert r["steps"] == 5 and len(r["losses"]) == 5 and len(r["step_ms"]) == 5 and len(r["round_ms"]) == 2
        assert all(math.isfinite(v) for v in r["losses"])
        assert r["tokens_per_s"] == pytest.approx(r["dims"]["tokens_per_step"] / (r["median_ms"] * 1e-3))
        assert r["versions"]["transformers"]
    gmm, mok, fp8 = recs
    assert gmm["speedup_vs_grouped_mm"] == pytest.approx(1.0)
    # FP8 experts: the same initial weights, a loss curve within FP8's error of BF16's, its ratio to mokgen BF16
    assert fp8["init_checksum"] == gmm["init_checksum"] and fp8["losses"] != mok["losses"]
    assert fp8["loss_max_rel_diff_vs_grouped_mm"] < 1e-1
    assert fp8["speedup_vs_mokgen"] == pytest.approx(mok["median_ms"] / fp8["median_ms"])
    assert mok["speedup_vs_mokgen"] is None and gmm["speedup_vs_mokgen"] is None
    assert mok["speedup_vs_grouped_mm"] == pytest.approx(gmm["median_ms"] / mok["median_ms"])
    assert mok["init_checksum"] == gmm["init_checksum"]        # the same initial weights
    assert mok["losses"][0] == pytest.approx(gmm["losses"][0], rel=1e-2)
    assert mok["loss_max_rel_diff_vs_grouped_mm"] < 5e-2


def test_dry_run_writes_nothing_by_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert BM.main(["--dry-run", "--steps", "2", "--impls", "mokgen"]) == 0
    assert not (tmp_path / "bench").exists()


def test_bad_arguments():
    assert BM.main(["--dry-run", "--impls", "nope"]) == 2
    assert BM.main(["--dry-run", "--steps", "0"]) == 2


def test_profile_dry_run_records(tmp_path):
    out = tmp_path / "prof.jsonl"
    assert MP.main(["--dry-run", "--warm-steps", "1", "--steps", "1", "--json", str(out)]) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["impl"] for r in recs] == ["grouped_mm", "mokgen"]
    for r in recs:
        st = r["routing"]
        # the dry run's model: 2 x 64 tokens, top-2 of 8 experts
        assert st["rows_mean"] == pytest.approx(2 * 64 * 2 / 8)
        assert st["rows_min"] <= st["rows_mean"] <= st["rows_max"]
        assert r["routing_uniform"]["rows_mean"] == pytest.approx(st["rows_mean"])
        assert set(r["layer_fb_ms"]) == {"model_routing", "uniform_routing"}
    # the same seed, data and router: both backends saw the same routing
    assert recs[0]["routing"] == recs[1]["routing"]


def test_profile_routing_stats_and_classes():
    idx = torch.tensor([[0, 1], [0, 2], [0, 1]])
    st = MP.routing_stats(idx, 4)
    assert (st["rows_max"], st["rows_min"], st["experts_empty"]) == (3.0, 0.0, 1)
    assert st["max_over_mean"] == pytest.approx(3 / 1.5)
    assert MP.kernel_class("kernel_cutlass_kernel_tensorptrbf16", "mokgen") == "experts"
    assert MP.kernel_class("void at::native::grouped_gemm_kernel", "grouped_mm") == "experts"
    assert MP.kernel_class("void at::native::grouped_gemm_kernel", "mokgen") == "gemm"
    assert MP.kernel_class("void multi_tensor_apply_kernel<FusedAdam>", "mokgen") == "optimizer"
    assert MP.kernel_class("flash_fwd_kernel", "grouped_mm") == "attention"
    assert MP.kernel_class("void at::native::vectorized_elementwise_kernel", "mokgen") == "other"


def test_dry_run_gradient_accumulation(tmp_path):
    """--accum 2: every optimizer step runs two micro-batches (their mean loss), tokens per step doubled; a step of
    one micro-batch (accum 1) is the plain step."""
    out = tmp_path / "model.json"
    assert BM.main(["--dry-run", "--out", str(out), "--steps", "3", "--accum", "2",
                    "--impls", "grouped_mm,mokgen"]) == 0
    recs = json.loads(out.read_text())
    assert [r["impl"] for r in recs] == ["grouped_mm", "mokgen"]
    for r in recs:
        assert "error" not in r, r.get("error")
        d = r["dims"]
        assert d["accum"] == 2 and d["tokens_per_step"] == 2 * d["batch"] * d["seq"]
        assert len(r["losses"]) == 3 and len(r["step_ms"]) == 3 and all(math.isfinite(v) for v in r["losses"])
        assert r["tokens_per_s"] == pytest.approx(d["tokens_per_step"] / (r["median_ms"] * 1e-3))
    # the first step's loss is the mean of its two micro-batches' losses at the initial weights
    a = BM.build_parser().parse_args(["--dry-run", "--steps", "3", "--accum", "2"])
    for k, v in BM.DRY.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    data = BM.batches(a, torch.device("cpu"))
    assert len(data) == 6
    model = BM.build_model(BM.model_config(a), torch.device("cpu"), a.seed, "grouped_mm")
    with torch.no_grad():
        want = sum(model(input_ids=ids, labels=ids).loss.item() for ids in data[:2]) / 2
    assert recs[0]["losses"][0] == pytest.approx(want, rel=1e-5)
    assert BM.main(["--dry-run", "--accum", "0", "--out", "-"]) == 2
