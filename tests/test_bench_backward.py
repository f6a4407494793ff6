"""tools/bench_backward.py on the CPU: the dry run, and every code path of one shape with stand-ins for the
GPU-only implementations (mokgen's compiled layer and Liger's Triton function)."""

import json
import sys
from pathlib import Path

import pytest
import torch

TOOLS = Path(__file__).resolve().parents[1] / "tools"
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))

import bench_backward as BB  # noqa: E402
import bench_forward as BF  # noqa: E402

import mokgen  # noqa: E402
from mokgen import reference as ref  # noqa: E402


def _grouped_mm_ok() -> bool:
    return BB.B.grouped_mm_available("cpu")[0]


needs_grouped_mm = pytest.mark.skipif(not _grouped_mm_ok(), reason="torch._grouped_mm does not run on this CPU")


@needs_grouped_mm
def test_dry_run_writes_records(tmp_path):
    out = tmp_path / "backward.json"
    assert BB.main(["--dry-run", "--out", str(out), "--rounds", "2"]) == 0
    recs = json.loads(out.read_text())
    assert [r["shape"] for r in recs] == [s["name"] for s in BB.DRY_RUN_SPECS]
    for r in recs:
        assert r["impl"] == "torch_grouped_mm" and "error" not in r, r.get("error")
        for f in BB.RECORD_FIELDS:
            assert f in r, f
        assert r["fb_ms"] > 0 and r["median_ms"] > 0 and len(r["round_ms"]) == 2
        assert r["tflops"] == pytest.approx(3 * BF.spec_flops(BF.resolve_spec(
            next(s for s in BB.DRY_RUN_SPECS if s["name"] == r["shape"]))) / (r["fb_ms"] * 1e-3) / 1e12)
        assert r["speedup_vs_grouped_mm"] == pytest.approx(1.0)
        assert r["grad_rel_err"] < 1e-2 and r["bitwise_deterministic"] is True
        assert set(r["grad_rel_errs"]) == ({"x", "topk_weight", "w1", "w2", "b1", "b2"} if r["dims"]["bias"]
                                           else {"x", "topk_weight", "w1", "w2"})
        assert r["saved_bytes_method"] == "saved_tensors_hooks" and r["saved_bytes"] > 0
        assert r["grad_ref"].startswith("mokgen.reference.backward float64")


def test_dry_run_writes_nothing_by_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert BB.main(["--dry-run", "--impls", "mokgen,liger"]) == 0
    assert not (tmp_path / "bench").exists()


def test_liger_supported_presets():
    ok = {name: BB.liger_supported(mokgen.load_spec(name))[0] for name in BB.DEFAULT_SPECS}
    assert ok == {"kimi-k2": True, "deepseek-v4-pro": False, "glm-5": True, "qwen3.5-397b-a17b": True,
                  "qwen3-30b-a3b": True, "gpt-oss-120b": False}


def test_rel_err_matches_reference():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(7, 33, 5, generator=g).to(torch.bfloat16)
    b = torch.randn(7, 33, 5, generator=g, dtype=torch.float64)
    assert BB.rel_err(a, b) == pytest.approx(ref.rel_err(a, b), rel=1e-12)
    assert BB.rel_err(b[0, 0], b[0, 0]) == 0.0
    nan = a.clone()
    nan[3, 1, 2] = float("nan")
    assert BB.rel_err(nan, b) != BB.rel_err(nan, b)


def test_saved_bytes_autograd_counts_only_what_the_graph_adds():
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(32, 16, requires_grad=True)
    assert BB.saved_bytes_autograd(lambda: x @ w, [x, w]) == 0              # mm saves its inputs only
    assert BB.saved_bytes_autograd(lambda: x[:, :16] @ w[:16], [x, w]) == 0  # views of the inputs too
    # exp saves its output (a new [64, 32] fp32 tensor); mm saves it and w
    assert BB.saved_bytes_autograd(lambda: x.exp() @ w, [x, w]) == 64 * 32 * 4
    assert BB.saved_bytes_autograd(lambda: x @ w, []) == (64 * 32 + 32 * 16) * 4


# --------------------------------------------------------------------------------------------------------------
# one shape with stand-ins for mokgen and Liger (the code paths the dry run cannot reach on a CPU)


class _Saved:
    nbytes = 12345


class FakeCompiled:
    """Stands in for mokgen.compile(spec): the reference math in float32, the API of the real object."""

    class plan:
        schedule = "fake"

    def __init__(self, spec):
        self.spec = spec
        self.checked = 0

    def forward_train(self, x, topk_idx, topk_weight, w1, w2, b1=None, b2=None):
        assert not torch.is_grad_enabled()
        y = ref.forward(x, topk_idx, topk_weight, w1, w2, self.spec, b1, b2, dtype=torch.float32,
                        out_dtype=torch.bfloat16)
        return y, _Saved()

    def check_errors(self):
        self.checked += 1


def fake_moe_forward(x, topk_idx, topk_weight, w1, w2, b1=None, b2=None, *, moe):
    return ref.forward(x, topk_idx, topk_weight, w1, w2, moe.spec, b1, b2, dtype=torch.float32,
                       out_dtype=torch.bfloat16)


class FakeLiger:
    """Liger's signature: apply(x, gate_up_proj [E, 2I, H], down_proj [E, H, I], top_k_index, top_k_weights),
    routed experts only, silu(gate) * up on concat rows; output in x's dtype."""

    calls = 0

    @staticmethod
    def apply(x, gate_up_proj, down_proj, top_k_index, top_k_weights):
        FakeLiger.calls += 1
        E, I2, H = gate_up_proj.shape
        cfg = ref.LayerConfig(hidden=H, ffn=I2 // 2, experts=E, topk=top_k_index.shape[1], ep=1,
                              tokens=x.shape[0], shared_experts=0)
        return ref.forward(x, top_k_index, top_k_weights, gate_up_proj, down_proj, cfg, dtype=torch.float32,
                           out_dtype=x.dtype)


@needs_grouped_mm
@pytest.mark.parametrize("which", [0, 1])
def test_bench_shape_all_impls_with_stand_ins(monkeypatch, which):
    compiled = []

    def fake_compile(spec, arch=None, force=False, overrides=None):
        compiled.append(overrides)
        m = FakeCompiled(spec)
        return m

    monkeypatch.setattr(mokgen, "compile", fake_compile)
    monkeypatch.setattr(mokgen, "moe_forward", fake_moe_forward, raising=False)
    spec = BF.resolve_spec(BB.DRY_RUN_SPECS[which])
    device = torch.device("cpu")
    timer = BF.Timer(device)
    ctx = dict(gpu="cpu", date="now", versions={})
    FakeLiger.calls = 0
    recs = BB.bench_shape(spec, list(BB.IMPLS), ctx, timer, device, seed=3, rounds=2,
                          variants=[{"schedule": "fused"}], liger=(FakeLiger, False))
    by = {r["impl"]: r for r in recs}
    liger_ok = BB.liger_supported(spec)[0]
    want = ["mokgen", "torch_grouped_mm"] + (["liger"] if liger_ok else []) + ["mokgen[schedule=fused]"]
    assert [r["impl"] for r in recs] == want
    assert compiled == [None, {"schedule": "fused"}]
    for r in recs:
        assert "error" not in r, (r["impl"], r.get("error"))
        assert r["grad_rel_err"] < 1e-2, r["impl"]
        assert r["rel_err"] < 1e-2 and r["bitwise_deterministic"] is True
        assert len(r["round_ms"]) == 2 and len(r["round_fwd_ms"]) == 2
        assert r["speedup_vs_grouped_mm"] == pytest.approx(by["torch_grouped_mm"]["fb_ms"] / r["fb_ms"])
        if liger_ok:
            assert r["speedup_vs_liger"] == pytest.approx(by["liger"]["fb_ms"] / r["fb_ms"])
            assert r["liger_autotune"] is False
        else:
            assert r["speedup_vs_liger"] is None
    assert by["mokgen"]["saved_bytes"] == 12345 and by["mokgen"]["saved_bytes_method"] == "saved.nbytes"
    assert by["mokgen"]["saved_bytes_autograd"] > 0
    if liger_ok:
        assert FakeLiger.calls > 0
        # the shared experts are added by the adapter: its gradient of the shared groups is not zero
        assert spec.shared_experts == 0 or by["liger"]["grad_rel_errs"]["w1"] < 1e-2
    else:
        assert FakeLiger.calls == 0


@needs_grouped_mm
def test_bench_shape_records_failures(monkeypatch):
    def broken_compile(spec, arch=None, force=False, overrides=None):
        raise RuntimeError("no kernels here\nsecond line")

    monkeypatch.setattr(mokgen, "compile", broken_compile)
    spec = BF.resolve_spec(BB.DRY_RUN_SPECS[0])
    device = torch.device("cpu")
    recs = BB.bench_shape(spec, list(BB.IMPLS), dict(gpu="cpu", date="now", versions={}), BF.Timer(device),
                          device, seed=0, liger="import liger_kernel: ModuleNotFoundError: No module named 'triton'")
    by = {r["impl"]: r for r in recs}
    assert by["mokgen"]["error"] == "RuntimeError: no kernels here" and by["mokgen"]["fb_ms"] is None
    assert by["liger"]["error"].startswith("import liger_kernel")
    assert "error" not in by["torch_grouped_mm"] and by["torch_grouped_mm"]["speedup_vs_liger"] is None
    BB.print_table(recs, "failures")


def test_liger_layer_adds_shared_experts_and_rejects_biases():
    spec = BF.resolve_spec(BB.DRY_RUN_SPECS[0])            # 4 local experts + 1 shared
    inp = ref.random_inputs(spec, tokens=16, seed=1)
    f = BB.liger_layer(FakeLiger, spec)
    y = f(inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2)
    y_ref = ref.forward(inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2, spec)
    assert ref.rel_err(y, y_ref) < 1e-2
    with pytest.raises(ValueError, match="biases"):
        f(inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2, torch.zeros(1), None)


def test_fp8_rows_get_their_ratio_to_bf16():
    d1, d2 = {"T": 8, "H": 256}, {"T": 8, "H": 512}
    recs = [dict(impl="mokgen", dtype="bf16", dims=d1, fb_ms=9.0, median_ms=3.0),
            dict(impl="torch_grouped_mm", dtype="fp8", dims=d1, fb_ms=20.0, median_ms=6.0),
            dict(impl="mokgen", dtype="fp8", dims=dict(d1), fb_ms=6.0, median_ms=2.0),
            dict(impl="mokgen[gemm2_bn=256]", dtype="fp8", dims=d1, fb_ms=4.5, median_ms=None),
            dict(impl="mokgen", dtype="fp8", dims=d2, fb_ms=5.0, median_ms=1.0)]   # no BF16 twin in the run
    BB.add_fp8_ratios(recs)
    assert recs[2]["speedup_vs_bf16"] == pytest.approx(1.5) and recs[2]["fwd_speedup_vs_bf16"] == pytest.approx(1.5)
    assert recs[3]["speedup_vs_bf16"] == pytest.approx(2.0) and "fwd_speedup_vs_bf16" not in recs[3]
    assert all("speedup_vs_bf16" not in r for r in (recs[0], recs[1], recs[4]))


def test_interleaved_rounds_voids_a_failing_implementation():
    """The benchmarks' shared rounds 2..N: every implementation timed once per round, in turn; one that raises in a
    round is voided with the round named and timed no more, the others go on; the log hook sees every round."""
    calls, voided, logged = [], {}, []
    n = {"bad": 0}

    def time_once(impl, fn):
        calls.append(impl)
        fn()

    def bad():
        n["bad"] += 1
        if n["bad"] == 2:
            raise RuntimeError("kernel timeout\nmore")

    timed = {"a": lambda: None, "bad": bad, "c": lambda: None}
    BF.interleaved_rounds(timed, 4, time_once, voided.__setitem__, logged.append)
    assert calls == ["a", "bad", "c", "a", "bad", "c", "a", "c"]
    assert voided == {"bad": "round 3: RuntimeError: kernel timeout"} and list(timed) == ["a", "c"]
    assert logged == [1, 2, 3]
    BF.interleaved_rounds(timed, 1, time_once, voided.__setitem__)   # one round: nothing more to time
    assert len(calls) == 8
