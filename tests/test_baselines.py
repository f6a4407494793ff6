"""The torch baselines compute the contract's layer; the forward benchmark's CPU dry run keeps working."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from mokgen.spec import load_spec
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runnable without an installed mokgen
    sys.path.insert(0, str(REPO))

from mokgen import baselines as B  # noqa: E402
GROUPED_OK, GROUPED_WHY = B.grouped_mm_available("cpu")
needs_grouped = pytest.mark.skipif(not GROUPED_OK, reason=GROUPED_WHY or "torch._grouped_mm unavailable")

# (name, spec kwargs); local experts = experts // ep; topk may exceed the local experts (ids with replacement)
CASES = [
    ("swiglu-shared", dict(hidden=128, ffn=64, experts=8, ep=2, topk=6, tokens=48, shared_experts=1)),
    ("swiglu-limit-interleaved", dict(hidden=64, ffn=128, experts=6, ep=1, topk=2, tokens=40, shared_experts=2,
                                      swiglu_limit=0.5, gate_up_layout="interleaved")),
    ("oai-bias", dict(hidden=64, ffn=64, experts=8, ep=1, topk=4, tokens=33, shared_experts=0,
                      activation="swiglu_oai", swiglu_limit=7.0, gate_up_layout="interleaved", bias=True)),
    ("oai-bias-shared-concat", dict(hidden=64, ffn=64, experts=3, ep=1, topk=2, tokens=20, shared_experts=1,
                                    activation="swiglu_oai", swiglu_limit=None, bias=True)),
]


def make(spec, seed: int = 0, empty_expert: bool = False):
    g = torch.Generator().manual_seed(seed)
    T, H, I, K = spec.tokens, spec.hidden, spec.ffn, spec.topk
    L, G = spec.local_experts, spec.groups
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    hi = L - 1 if empty_expert else L  # expert L-1 gets no rows
    idx = torch.randint(0, hi, (T, K), generator=g).to(torch.int32)
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    # larger weight scale so the clamps of the limited activations are exercised
    w1 = (torch.randn(G, 2 * I, H, generator=g) * 2 * H ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(G, H, I, generator=g) * I ** -0.5).to(torch.bfloat16)
    b1 = torch.randn(G, 2 * I, generator=g) * 0.3 if spec.bias else None
    b2 = torch.randn(G, H, generator=g) * 0.3 if spec.bias else None
    return x, idx, w, w1, w2, b1, b2


def naive(x, idx, w, w1, w2, spec, b1=None, b2=None):
    """Token by token in float64, written from the contract's formula (independent of baselines.py)."""
    T, K = idx.shape
    L, S, I = spec.local_experts, spec.shared_experts, spec.ffn
    lim = spec.swiglu_limit
    if spec.activation == "swiglu_oai" and lim is None:
        lim = 7.0
    d = torch.float64
    y = torch.zeros(T, x.shape[1], dtype=d)

    def expert(t, e):
        h = w1[e].to(d) @ x[t].to(d)
        if b1 is not None:
            h = h + b1[e].to(d)
        if spec.gate_up_layout == "concat":
            gt, up = h[:I], h[I:]
        else:
            gt, up = h[0::2], h[1::2]
        if lim is not None:
            gt = torch.clamp(gt, max=lim)
            up = torch.clamp(up, -lim, lim)
        if spec.activation == "swiglu":
            a = gt / (1 + torch.exp(-gt)) * up
        else:
            a = gt / (1 + torch.exp(-1.702 * gt)) * (up + 1)
        o = w2[e].to(d) @ a
        if b2 is not None:
            o = o + b2[e].to(d)
        return o

    for t in range(T):
        for k in range(K):
            y[t] += float(w[t, k]) * expert(t, int(idx[t, k]))
        for s in range(S):
            y[t] += expert(t, L + s)
    return y


def relerr(a, b):
    a, b = a.to(torch.float64), b.to(torch.float64)
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("name,kw", CASES, ids=[c[0] for c in CASES])
def test_loop_reference_matches_naive(name, kw):
    spec = load_spec({"name": name, **kw})
    x, idx, w, w1, w2, b1, b2 = make(spec)
    ref = naive(x, idx, w, w1, w2, spec, b1, b2)
    got = B.loop_reference(x, idx, w, w1, w2, spec, b1, b2, dtype=torch.float64)
    assert relerr(got, ref) < 1e-12


@pytest.mark.parametrize("name,kw", CASES, ids=[c[0] for c in CASES])
def test_torch_loop_matches(name, kw):
    spec = load_spec({"name": name, **kw})
    x, idx, w, w1, w2, b1, b2 = make(spec)
    ref = naive(x, idx, w, w1, w2, spec, b1, b2)
    y = B.torch_loop(x, idx, w, w1, w2, spec, b1, b2)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert relerr(y, ref) < 2e-2


@needs_grouped
@pytest.mark.parametrize("name,kw", CASES, ids=[c[0] for c in CASES])
def test_torch_grouped_mm_matches(name, kw):
    spec = load_spec({"name": name, **kw})
    x, idx, w, w1, w2, b1, b2 = make(spec)
    ref = naive(x, idx, w, w1, w2, spec, b1, b2)
    y = B.torch_grouped_mm(x, idx, w, w1, w2, spec, b1, b2)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert relerr(y, ref) < 2e-2
    # same bf16 GEMMs and activation as the loop: close to it too
    assert relerr(y, B.torch_loop(x, idx, w, w1, w2, spec, b1, b2).float()) < 1e-2


@needs_grouped
def test_torch_grouped_mm_empty_expert():
    spec = load_spec(dict(hidden=64, ffn=64, experts=4, ep=1, topk=2, tokens=24, shared_experts=1))
    x, idx, w, w1, w2, b1, b2 = make(spec, empty_expert=True)
    assert not (idx == spec.local_experts - 1).any()
    y = B.torch_grouped_mm(x, idx, w, w1, w2, spec)
    assert relerr(y, naive(x, idx, w, w1, w2, spec)) < 2e-2


def test_reference_module_agrees():
    """mokgen.reference and these baselines' per-token loop agree."""
    from mokgen.reference import forward

    for name, kw in CASES:
        spec = load_spec({"name": name, **kw})
        x, idx, w, w1, w2, b1, b2 = make(spec)
        ref = forward(x, idx, w, w1, w2, spec, b1=b1, b2=b2, dtype=torch.float64)
        if isinstance(ref, (tuple, list)):
            ref = ref[0]
        assert relerr(B.loop_reference(x, idx, w, w1, w2, spec, b1, b2), ref) < 1e-10, name


def test_route_is_stable_and_offsets():
    idx = torch.tensor([[2, 0], [0, 2], [1, 0]], dtype=torch.int32)
    perm, sorted_e, offs = B.route(idx, 4)
    assert perm.tolist() == [1, 2, 5, 4, 0, 3]
    assert sorted_e.tolist() == [0, 0, 0, 1, 2, 2]
    assert offs.dtype == torch.int32 and offs.tolist() == [3, 4, 6, 6]


@needs_grouped
def test_gemm_only_groups():
    spec = load_spec(dict(hidden=64, ffn=64, experts=3, ep=1, topk=2, tokens=16, shared_experts=1))
    x, idx, w, w1, w2, _, _ = make(spec)
    inp = B.prepare_gemm_only(x, idx, w1, w2, spec)
    M = spec.rows
    assert inp.xg.shape == (M, spec.hidden) and inp.hg.shape == (M, spec.ffn)
    assert inp.offs.tolist()[-1] == M and len(inp.offs) == spec.groups
    h, o = B.torch_gemm_only(inp)
    start = 0
    for gi, end in enumerate(inp.offs.tolist()):
        torch.testing.assert_close(h[start:end].float(), F.linear(inp.xg[start:end], w1[gi]).float(),
                                   rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(o[start:end].float(), F.linear(inp.hg[start:end], w2[gi]).float(),
                                   rtol=2e-2, atol=2e-2)
        start = end
    # the shared group holds every token
    torch.testing.assert_close(inp.xg[M - spec.tokens:], x)


def test_dense_layer_mm_same_flops():
    spec = load_spec(dict(hidden=64, ffn=128, experts=3, ep=1, topk=2, tokens=16, shared_experts=1))
    x, idx, w, w1, w2, _, _ = make(spec)
    rows = spec.rows  # 48: x repeated three times
    inp = B.prepare_dense_layer(x, w1, w2, rows)
    assert inp.x.shape == (rows, spec.hidden) and inp.h.shape == (rows, spec.ffn)
    torch.testing.assert_close(inp.x[spec.tokens:2 * spec.tokens], x)
    h, o = B.dense_layer_mm(inp)
    assert h.shape == (rows, 2 * spec.ffn) and o.shape == (rows, spec.hidden)
    torch.testing.assert_close(h.float(), F.linear(inp.x, w1[0]).float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(o.float(), F.linear(inp.h, w2[0]).float(), rtol=2e-2, atol=2e-2)
    # 2 * rows * 2I * H + 2 * rows * I * H = the layer's 2 * rows * 3 * H * I
    assert 2 * rows * (h.shape[1] * spec.hidden + spec.ffn * o.shape[1]) == 2 * rows * 3 * spec.hidden * spec.ffn


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_mm_no_host_sync_gpu():
    spec = load_spec(dict(hidden=256, ffn=128, experts=8, ep=2, topk=6, tokens=256, shared_experts=1))
    x, idx, w, w1, w2, b1, b2 = (t.cuda() if t is not None else None for t in make(spec))
    ref = naive(x.cpu(), idx.cpu(), w.cpu(), w1.cpu(), w2.cpu(), spec)
    B.torch_grouped_mm(x, idx, w, w1, w2, spec)  # warm up (lazy init may sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = B.torch_grouped_mm(x, idx, w, w1, w2, spec)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert relerr(y.cpu(), ref) < 2e-2


# ---------------------------------------------------------------------------------------------------------
# the benchmark script's CPU dry run
# ---------------------------------------------------------------------------------------------------------


def _load_tool(name: str):
    """tools/<name>.py as module `name` (registered in sys.modules, as the tools import each other)."""
    mod_spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(mod_spec)
    sys.modules[name] = mod
    mod_spec.loader.exec_module(mod)
    return mod


def _load_bench():
    return _load_tool("bench_forward")


def test_bench_dry_run(tmp_path, capsys):
    bench = _load_bench()
    out = tmp_path / "res" / "forward.json"
    assert bench.main(["--dry-run", "--out", str(out), "--rep-ms", "1", "--loop-reps", "1"]) == 0
    recs = json.loads(out.read_text())
    assert isinstance(recs, list) and recs
    for r in recs:
        extra = set(r) - set(bench.RECORD_FIELDS)
        assert set(bench.RECORD_FIELDS) <= set(r) and extra <= {"error", "timing"}, r
        assert r["timing"].startswith("perf_counter median"), r
    assert not [r for r in recs if r.get("error")], [r["error"] for r in recs if r.get("error")]
    impls = {(r["shape"], r["impl"]) for r in recs}
    shapes = [s["name"] for s in bench.DRY_RUN_SPECS]
    expect = ["torch_loop", "dense_layer_mm"] + (["torch_grouped_mm", "torch_gemm_only"] if GROUPED_OK else [])
    for s in shapes:
        for i in expect:
            assert (s, i) in impls
    assert any(r["impl"] == "dense_mm" for r in recs)
    for r in recs:
        assert r["gpu"] == "cpu" and r["versions"]["torch"] == torch.__version__
        assert r["median_ms"] > 0 and r["tflops"] > 0
        if r["impl"] in ("torch_loop", "torch_grouped_mm"):
            assert r["rel_err"] < 2e-2
            assert r["bitwise_deterministic"] is True  # on the CPU
        if r["impl"] == "torch_loop" and GROUPED_OK:
            assert r["speedup_vs_grouped_mm"] > 0
    # appending keeps earlier records
    assert bench.main(["--dry-run", "--out", str(out), "--rep-ms", "1", "--loop-reps", "1", "--no-dense",
                       "--impls", "torch_loop"]) == 0
    recs2 = json.loads(out.read_text())
    assert recs2[: len(recs)] == recs and len(recs2) == len(recs) + len(shapes)
    assert "torch_loop" in capsys.readouterr().out


def _load_merge_records():
    return _load_tool("merge_records")


def test_records_go_to_the_gpus_own_file():
    """The benchmarks' default record file is named after the GPU the run is on (bench_forward.default_out), so an
    H100 run's rows never land among the H200's, which the cost model fits; and every committed per-GPU record
    file holds only rows of its own GPU."""
    bench = _load_bench()
    cases = {"NVIDIA H200": "h200", "NVIDIA H100 80GB HBM3": "h100", "NVIDIA A100-SXM4-80GB": "a100",
             "NVIDIA B200": "b200", "NVIDIA GH200 480GB": "gh200", "Tesla V100-SXM2-16GB": "v100",
             "NVIDIA GeForce RTX 4090": "nvidia-geforce-rtx-4090", "cpu": "cpu"}
    for name, tag in cases.items():
        assert bench.gpu_tag(name) == tag, name
    assert bench.default_out("backward", torch.device("cpu")) == "bench/results/backward-cpu.json"
    assert bench.gpu_tag("NVIDIA H100 80GB HBM3") != bench.gpu_tag("NVIDIA H200")
    mr = _load_merge_records()
    checked = 0
    for path in sorted((REPO / "bench" / "results").glob("*-h[0-9]*.json*")):
        assert mr.dest_tag(path) is not None, path.name
        rows, _ = mr.load(path)
        wrong = sorted(set(mr.foreign_rows(path, rows)))
        assert not wrong, f"{path.name} holds rows of {wrong}"
        checked += any(isinstance(r, dict) and isinstance(r.get("gpu"), str) for r in rows)
    assert checked >= 10


def test_merge_records_refuses_another_gpus_rows(tmp_path, capsys):
    """tools/merge_records.py appends a device call's records to the GPU's own file only: H100 rows into an
    ``-h200`` file are refused (exit 1, the file untouched), into ``-h100`` they are appended with the run label, and
    a file named after no GPU takes any."""
    mr = _load_merge_records()
    src = tmp_path / "call.json"
    src.write_text(json.dumps([{"gpu": "NVIDIA H100 80GB HBM3", "impl": "mokgen", "median_ms": 1.0}]))
    h200 = tmp_path / "fp8-h200.json"
    h200.write_text(json.dumps([{"gpu": "NVIDIA H200", "impl": "mokgen", "median_ms": 0.9}], indent=1) + "\n")
    before = h200.read_text()
    assert mr.main([str(src), str(h200), "--run", "call 1"]) == 1
    assert h200.read_text() == before
    assert "merge them into fp8-h100.json" in capsys.readouterr().err
    h100 = tmp_path / "fp8-h100.json"
    assert mr.main([str(src), str(h100), "--run", "call 1", "--commit", "abc1234"]) == 0
    rows = json.loads(h100.read_text())
    assert rows == [{"gpu": "NVIDIA H100 80GB HBM3", "impl": "mokgen", "median_ms": 1.0, "run": "call 1",
                     "versions": {"mokgen": "abc1234"}}]
    vm = tmp_path / "warm-start-vm.json"
    assert mr.main([str(src), str(vm), "--run", "call 1"]) == 0
    assert mr.dest_tag(vm) is None and mr.dest_tag(h200) == "h200"


def test_bench_dry_run_yaml_spec(tmp_path):
    """A spec given as a YAML path, with --tokens overriding T."""
    bench = _load_bench()
    import yaml

    d = dict(bench.DRY_RUN_SPECS[0], name="tiny-yaml")
    p = tmp_path / "tiny-yaml.yaml"
    p.write_text(yaml.safe_dump(d))
    out = tmp_path / "r.json"
    assert bench.main(["--dry-run", str(p), "--tokens", "64", "--out", str(out), "--no-dense", "--rep-ms", "1",
                       "--loop-reps", "1"]) == 0
    recs = json.loads(out.read_text())
    assert {r["shape"] for r in recs} == {"tiny-yaml"}
    assert all(r["dims"]["T"] == 64 and r["dims"]["rows"] == 64 * 7 for r in recs)


def test_timer_settles_before_timing_and_says_so(capsys):
    """--settle-s runs each callable back to back before its timing (not before fixed-rep ones) and the records'
    timing says so; a negative value is refused."""
    bench = _load_bench()
    calls = []
    t = bench.Timer(torch.device("cpu"), settle_s=0.05)
    assert t(lambda: calls.append(1)) >= 0 and len(calls) > 3 + 1  # settled (many calls), then 1 warmup + 3 reps
    assert t.method == "perf_counter median, settled 0.05 s before each timing"
    calls.clear()
    t(lambda: calls.append(1), reps=2, warmup=0)
    assert len(calls) == 2
    assert bench.Timer(torch.device("cpu")).method == "perf_counter median"
    assert bench.main(["--dry-run", "--settle-s", "-1", "--out", "-"]) == 2
    assert "--settle-s must be >= 0" in capsys.readouterr().err


def test_bench_bad_impl_is_one_line_error(capsys):
    bench = _load_bench()
    assert bench.main(["--dry-run", "--impls", "nope", "--out", "-"]) == 2
    assert "unknown" in capsys.readouterr().err
