"""tools/model_profile.py on the CPU: the dry run (bench_model's tiny model, both backends) and its routing
statistics; the kernel classes it sums the GPU profile into."""

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

TOOLS = Path(__file__).resolve().parents[1] / "tools"
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))

import model_profile as MP  # noqa: E402

import mokgen.integrations.transformers as mt  # noqa: E402


@pytest.fixture(autouse=True)
def restore_backend():
    old, opts = mt.set_compiler(None), mt.options()
    mt.set_compiler(old)
    yield
    mt.set_compiler(old)
    mt.configure(tokens=opts.tokens)


def test_dry_run_records(tmp_path):
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


def test_routing_stats_and_classes():
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
