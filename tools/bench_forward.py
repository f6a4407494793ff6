#!/usr/bin/env python
"""Forward benchmark of the MoE layer: mokgen against the torch baselines of ``mokgen/baselines.py``.

    python tools/bench_forward.py [SPEC ...] [--tokens N] [--out bench/results/forward-<gpu>.json] [--no-mokgen]

Default shapes: the ep=64 per-rank share of kimi-k2, deepseek-v4-pro, glm-5, qwen3.5-397b-a17b (2048 tokens,
local expert ids sampled with replacement, plus the shared expert) and the one-GPU qwen3-30b-a3b and
gpt-oss-120b (4096 tokens). ``--tokens`` overrides T for every shape. Implementations per shape: ``mokgen``
(``mokgen.compile(spec)``), ``torch_grouped_mm``, ``torch_gemm_only``, ``dense_layer_mm`` (the layer's FLOPs as
two dense ``torch.mm`` calls over all rows: what dense cuBLAS GEMMs take for the same work), ``torch_loop``;
once per run ``dense_mm`` (bf16 8192^3). For each: median_ms, tflops (``2 * rows * 3 * H * I / time``), speedup over
``torch_grouped_mm``, rel_err (Frobenius, against ``mokgen.reference.forward`` in float32, computed once per
shape), bitwise determinism (two runs compared bit for bit). Records are APPENDED to the JSON list in ``--out``.

Timing: ``triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")`` (CUDA-event medians without
triton; wall-clock medians on CPU). ``--dry-run`` runs on the CPU with tiny made-up specs (or the given ones)
and the CPU-capable baselines, to keep this script from rotting.

An implementation that fails (e.g. ``mokgen.compile``) gets a record with null metrics and an extra ``error``
string; the others go on. ``versions.mokgen`` is the git sha (``-dirty`` with local changes), or
``$MOKGEN_GIT_SHA`` where the tree has no git history (the device machines' copies).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import torch  # noqa: E402

from mokgen import baselines as B  # noqa: E402
from mokgen.tunedb import gpu_tag  # noqa: E402

DEFAULT_SPECS = ["kimi-k2", "deepseek-v4-pro", "glm-5", "qwen3.5-397b-a17b", "qwen3-30b-a3b", "gpt-oss-120b"]
# records go to bench/results/<kind>-<gpu tag>.json (default_out): an H100 run's rows in forward-h100.json, not
# among the H200's (the cost model fits forward-h200.json and fp8-h200.json)
RESULTS_DIR = "bench/results"
DEFAULT_OUT = f"{RESULTS_DIR}/forward-<gpu>.json"
IMPLS = ["mokgen", "torch_grouped_mm", "torch_gemm_only", "dense_layer_mm", "torch_loop", "dense_mm"]
RECORD_FIELDS = ["gpu", "date", "versions", "shape", "dims", "impl", "median_ms", "tflops",
                 "speedup_vs_grouped_mm", "rel_err", "bitwise_deterministic"]

# tiny made-up specs for --dry-run without SPEC arguments (CPU-sized, multiples of 64)
DRY_RUN_SPECS: list[dict[str, Any]] = [
    dict(name="tiny-shared", hidden=256, ffn=128, experts=8, topk=6, ep=2, tokens=128, dtype="bf16",
         shared_experts=1, activation="swiglu", swiglu_limit=None, gate_up_layout="concat", bias=False,
         archs=["sm_90a"]),
    dict(name="tiny-oai", hidden=128, ffn=128, experts=8, topk=2, ep=1, tokens=128, dtype="bf16",
         shared_experts=0, activation="swiglu_oai", swiglu_limit=7.0, gate_up_layout="interleaved", bias=True,
         archs=["sm_90a"]),
]


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------
# specs
# ---------------------------------------------------------------------------------------------------------


def resolve_spec(src: Any, tokens: int | None = None):
    """A Spec from a preset name, YAML path or mapping (``mokgen.spec.load_spec``). ``tokens`` overrides T."""
    from mokgen.spec import load_spec

    spec = load_spec(src)
    if tokens is not None and tokens != spec.tokens:
        spec = _with_tokens(spec, tokens)
    return spec


def _with_tokens(spec, tokens: int):
    import dataclasses

    if dataclasses.is_dataclass(spec):
        try:
            return dataclasses.replace(spec, tokens=tokens)
        except Exception:  # noqa: BLE001 - fall through to from_dict
            pass
    d = spec.to_dict()
    d["tokens"] = tokens
    return type(spec).from_dict(d)


def spec_dims(spec) -> dict[str, Any]:
    L = B._local_experts(spec)
    S = int(spec.shared_experts)
    T, K = int(spec.tokens), int(spec.topk)
    return dict(T=T, H=int(spec.hidden), I=int(spec.ffn), K=K, S=S, local_experts=L, groups=L + S,
                experts=int(spec.experts), ep=int(spec.ep), rows=T * (K + S), activation=spec.activation,
                swiglu_limit=getattr(spec, "swiglu_limit", None), gate_up_layout=spec.gate_up_layout,
                bias=bool(spec.bias))


def spec_flops(spec) -> int:
    d = spec_dims(spec)
    return 2 * d["rows"] * 3 * d["H"] * d["I"]


# ---------------------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------------------


def make_inputs(spec, device: torch.device, seed: int = 0) -> dict[str, Any]:
    """Fresh random inputs (never zeros): routing balanced in expectation; ids sampled with replacement when
    topk exceeds the local experts, else K distinct experts per token."""
    d = spec_dims(spec)
    T, H, I, K, L, G = d["T"], d["H"], d["I"], d["K"], d["local_experts"], d["groups"]
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device=device, generator=gen, dtype=torch.float32).mul_(scale)

    x = randn(T, H).to(torch.bfloat16)
    if K > L:
        idx = torch.randint(0, L, (T, K), device=device, generator=gen)
    else:
        idx = torch.rand(T, L, device=device, generator=gen).argsort(dim=1)[:, :K]
    topk_idx = idx.to(torch.int32).contiguous()
    topk_weight = torch.softmax(randn(T, K), dim=-1).contiguous()
    w1 = torch.empty(G, 2 * I, H, device=device, dtype=torch.bfloat16)
    w2 = torch.empty(G, H, I, device=device, dtype=torch.bfloat16)
    for g in range(G):  # group by group: no fp32 copy of all weights at once
        w1[g].copy_(randn(2 * I, H, scale=H ** -0.5))
        w2[g].copy_(randn(H, I, scale=I ** -0.5))
    b1 = randn(G, 2 * I, scale=0.1) if d["bias"] else None
    b2 = randn(G, H, scale=0.1) if d["bias"] else None
    return dict(x=x, topk_idx=topk_idx, topk_weight=topk_weight, w1=w1, w2=w2, b1=b1, b2=b2)


def reference_output(spec, inp: dict[str, Any], dtype: torch.dtype) -> tuple[torch.Tensor, str]:
    """``mokgen.reference.forward`` in ``dtype``; ``baselines.loop_reference`` when that is not importable."""
    args = (inp["x"], inp["topk_idx"], inp["topk_weight"], inp["w1"], inp["w2"], spec)
    try:
        from mokgen.reference import forward  # type: ignore
    except ImportError:
        forward = None
    if forward is not None:
        out = forward(*args, b1=inp["b1"], b2=inp["b2"], dtype=dtype)
        if isinstance(out, (tuple, list)):
            out = out[0]
        return out, "mokgen.reference.forward"
    return B.loop_reference(*args, b1=inp["b1"], b2=inp["b2"], dtype=dtype), "baselines.loop_reference"


# ---------------------------------------------------------------------------------------------------------
# timing and checks
# ---------------------------------------------------------------------------------------------------------


class Timer:
    """Median of a callable: triton's do_bench on CUDA, CUDA events without triton, perf_counter on CPU.

    ``settle_s`` > 0: before each timing (but fixed-rep ones), run the callable back to back for that many seconds,
    so every implementation is timed in the clock regime its own sustained load sets (this H200 throttles at its
    power cap), not in the one the previously timed implementation left behind."""

    def __init__(self, device: torch.device, warmup_ms: float = 25, rep_ms: float = 100, settle_s: float = 0.0):
        self.device = device
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms
        self.settle_s = float(settle_s)
        self.do_bench = None
        if device.type == "cuda":
            try:
                from triton.testing import do_bench

                self.do_bench = do_bench
            except ImportError:
                pass

    @property
    def method(self) -> str:
        if self.device.type != "cuda":
            base = "perf_counter median"
        else:
            base = "triton do_bench median" if self.do_bench else "cuda events median"
        return base + (f", settled {self.settle_s:g} s before each timing" if self.settle_s > 0 else "")

    def settle(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` back to back for ``settle_s`` seconds (and wait for the GPU to finish it)."""
        end = time.perf_counter() + self.settle_s
        while time.perf_counter() < end:
            fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, fn: Callable[[], Any], reps: int | None = None, warmup: int | None = None) -> float:
        """Median milliseconds. ``reps``/``warmup`` force fixed counts (for slow, syncing baselines; no settling)."""
        if reps is None and self.settle_s > 0:
            self.settle(fn)
        if self.device.type != "cuda":
            for _ in range(1 if warmup is None else warmup):
                fn()
            ts = []
            for _ in range(3 if reps is None else reps):
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(ts)
        if reps is None and self.do_bench is not None:
            return float(self.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median"))
        return self._events(fn, reps, warmup)

    def _events(self, fn, reps, warmup) -> float:
        torch.cuda.synchronize()
        if reps is None:  # size the run like do_bench: ~warmup_ms + rep_ms
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            fn()
            s.record()
            for _ in range(3):
                fn()
            e.record()
            torch.cuda.synchronize()
            est = max(s.elapsed_time(e) / 3, 1e-3)
            warmup = max(1, int(self.warmup_ms / est))
            reps = max(5, int(self.rep_ms / est))
        for _ in range(1 if warmup is None else warmup):
            fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            ts.append(s.elapsed_time(e))
        return statistics.median(ts)


def _flatten(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flatten(o)]
    return []


def bitwise_equal(a, b) -> bool:
    ta, tb = _flatten(a), _flatten(b)
    if len(ta) != len(tb):
        return False
    for x, y in zip(ta, tb):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        xb = x.contiguous().view(torch.uint8) if x.element_size() > 0 else x
        yb = y.contiguous().view(torch.uint8) if y.element_size() > 0 else y
        if not torch.equal(xb, yb):
            return False
    return True


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    y = y.to(torch.float64) if y.device.type == "cpu" else y.float()
    r = ref.to(y.dtype)
    den = torch.linalg.vector_norm(r).item()
    num = torch.linalg.vector_norm(y - r).item()
    return num / den if den > 0 else num


# ---------------------------------------------------------------------------------------------------------
# versions
# ---------------------------------------------------------------------------------------------------------


def collect_versions() -> dict[str, Any]:
    v: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        v["triton"] = triton.__version__
    except ImportError:
        v["triton"] = None
    from importlib.metadata import PackageNotFoundError, version

    v["nvidia-cutlass-dsl"] = None
    for dist in ("nvidia-cutlass-dsl", "nvidia_cutlass_dsl"):
        try:
            v["nvidia-cutlass-dsl"] = version(dist)
            break
        except PackageNotFoundError:
            continue
    sha = os.environ.get("MOKGEN_GIT_SHA")  # for machines whose copy of the tree has no git history
    if not sha:
        try:
            sha = subprocess.run(["git", "-C", str(_REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                 text=True, timeout=10).stdout.strip() or None
            if sha:
                dirty = subprocess.run(["git", "-C", str(_REPO), "status", "--porcelain", "--untracked-files=no"],
                                       capture_output=True, text=True, timeout=10).stdout.strip()
                if dirty:
                    sha += "-dirty"
        except Exception:  # noqa: BLE001 - no git on the machine
            sha = None
    v["mokgen"] = sha
    return v


def gpu_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def default_out(kind: str, device: torch.device) -> str:
    """The records file of `kind` (forward, backward, fp8, ...) for the GPU `device` is: bench/results/
    <kind>-<gpu_tag>.json, so a run on an H100 never lands among an H200's records."""
    return f"{RESULTS_DIR}/{kind}-{gpu_tag(gpu_name(device))}.json"


# ---------------------------------------------------------------------------------------------------------
# the benchmark
# ---------------------------------------------------------------------------------------------------------


def _record(ctx, shape, dims, impl, ms, flops, base_ms, err, det, error=None) -> dict[str, Any]:
    rec = dict(gpu=ctx["gpu"], date=ctx["date"], versions=ctx["versions"], shape=shape, dims=dims, impl=impl,
               median_ms=ms, tflops=(flops / (ms * 1e-3) / 1e12) if ms else None,
               speedup_vs_grouped_mm=(base_ms / ms) if (ms and base_ms) else None, rel_err=err,
               bitwise_deterministic=det)
    if error is not None:
        rec["error"] = error
    return rec


def plan_source(moe: Any, overrides: Any) -> str:
    """Which plan a mokgen record timed: "overrides" (a --variants entry), the tuning record's notes where
    `mokgen.compile` took a tuned plan (see `mokgen tune`), else "default" (the solver's plan)."""
    if overrides:
        return "overrides"
    notes = getattr(getattr(moe, "plan", None), "notes", ()) or ()
    tuned = [n for n in notes if str(n).startswith("tuned")]
    return "; ".join(tuned) if tuned else "default"


def _short_error(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]


def interleaved_rounds(timed: dict[str, Any], rounds: int, time_once: Callable[[str, Any], None],
                       fail: Callable[[str, str], None], log: Callable[[int], None] | None = None) -> None:
    """Rounds 2..``rounds`` of a timing: each round times every implementation left in ``timed`` once, in turn
    (``time_once(impl, fn)`` appends its times), so that drift of the clock over the run (the power cap,
    temperature) spreads over all of them. One that raises is voided (``fail(impl, "round N: ...")``) and leaves
    ``timed``; ``log(round)`` after each round. The benchmarks record each one's median over its rounds."""
    for r in range(1, rounds):
        for impl, fn in list(timed.items()):
            try:
                time_once(impl, fn)
            except Exception as e:  # noqa: BLE001 - a failure in a later round voids that implementation
                fail(impl, f"round {r + 1}: {_short_error(e)}")
                del timed[impl]
        if log is not None:
            log(r)


def parse_variants(text: str | None) -> list[dict[str, Any]]:
    """``"schedule=fused;gemm1_a_load=tma,schedule=chain"`` -> [{"schedule": "fused"}, ...]: ';' separates
    variants, ',' the overrides of one variant."""
    from mokgen.plan import parse_overrides

    return [parse_overrides(v) for v in (text or "").split(";") if v.strip()]


def variant_name(ov: dict[str, Any]) -> str:
    return "mokgen[" + ",".join(f"{k}={v}" for k, v in sorted(ov.items())) + "]"


def bench_shape(spec, impls: list[str], ctx: dict[str, Any], timer: Timer, device, loop_reps: int,
                seed: int, variants: list[dict[str, Any]] | None = None, rounds: int = 1) -> list[dict[str, Any]]:
    shape = spec.name
    dims = spec_dims(spec)
    flops = spec_flops(spec)
    _log(f"[{shape}] T={dims['T']} H={dims['H']} I={dims['I']} K={dims['K']} S={dims['S']} "
         f"L={dims['local_experts']} rows={dims['rows']} {dims['activation']}/{dims['gate_up_layout']}"
         f"{' bias' if dims['bias'] else ''}")
    inp = make_inputs(spec, device, seed=seed)
    args = (inp["x"], inp["topk_idx"], inp["topk_weight"], inp["w1"], inp["w2"], spec)
    kw = dict(b1=inp["b1"], b2=inp["b2"])
    t0 = time.perf_counter()
    ref_dtype = torch.float32
    ref, ref_name = reference_output(spec, inp, ref_dtype)
    _log(f"[{shape}] reference ({ref_name}, {ref_dtype}) {time.perf_counter() - t0:.1f}s")

    results: dict[str, dict[str, Any]] = {}
    timed: dict[str, Callable[[], Any]] = {}  # re-timed in rounds 2.. (everything but torch_loop)

    def run(impl: str, fn: Callable[[], Any], check: bool, reps: int | None = None, warmup: int | None = None):
        t1 = time.perf_counter()
        try:
            out1 = fn()
            out2 = fn()
            det = bitwise_equal(out1, out2)
            err = rel_err(out1, ref) if check else None
            del out1, out2
            ms = timer(fn, reps=reps, warmup=warmup)
            results[impl] = dict(ms=ms, err=err, det=det, error=None, rounds=[ms])
            if rounds > 1 and reps is None:
                timed[impl] = fn
            _log(f"[{shape}] {impl}: {ms:.4f} ms  {flops / (ms * 1e-3) / 1e12:.1f} TFLOP/s  rel_err="
                 f"{'-' if err is None else f'{err:.2e}'}  det={det}  ({time.perf_counter() - t1:.1f}s)")
        except Exception as e:  # noqa: BLE001 - record and go on with the other implementations
            results[impl] = dict(ms=None, err=None, det=None, error=_short_error(e))
            _log(f"[{shape}] {impl}: FAILED {_short_error(e)}")
            if os.environ.get("MOKGEN_BENCH_TRACEBACK"):
                traceback.print_exc()

    if "torch_grouped_mm" in impls:
        run("torch_grouped_mm", lambda: B.torch_grouped_mm(*args, **kw), check=True)
    mokgen_runs = [("mokgen", None)] if "mokgen" in impls else []
    mokgen_runs += [(variant_name(v), v) for v in (variants or [])]
    keep = []  # the compiled layers re-timed in later rounds
    for name, ov in mokgen_runs:
        try:
            import mokgen

            t1 = time.perf_counter()
            moe = mokgen.compile(spec, overrides=ov)
            _log(f"[{shape}] {name}: mokgen.compile {time.perf_counter() - t1:.1f}s (schedule "
                 f"{getattr(moe.plan, 'schedule', '?')})")
            run(name, lambda m=moe: m(inp["x"], inp["topk_idx"], inp["topk_weight"], inp["w1"], inp["w2"],
                                      inp["b1"], inp["b2"]), check=True)
            if name in results:
                results[name]["plan"] = plan_source(moe, ov)
            moe.check_errors()
            if name in timed:
                keep.append((name, moe))
        except Exception as e:  # noqa: BLE001
            if name not in results or results[name].get("error") is None:
                results[name] = dict(ms=None, err=None, det=None, error=_short_error(e))
            _log(f"[{shape}] {name}: FAILED {_short_error(e)}")
            if os.environ.get("MOKGEN_BENCH_TRACEBACK"):
                traceback.print_exc()
        finally:
            moe = None
    if "torch_gemm_only" in impls:
        try:
            g_inp = B.prepare_gemm_only(inp["x"], inp["topk_idx"], inp["w1"], inp["w2"], spec)
            run("torch_gemm_only", lambda g=g_inp: B.torch_gemm_only(g), check=False)
            del g_inp
        except Exception as e:  # noqa: BLE001
            results["torch_gemm_only"] = dict(ms=None, err=None, det=None, error=_short_error(e))
    if "dense_layer_mm" in impls:
        try:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed + 7)
            d_inp = B.prepare_dense_layer(inp["x"], inp["w1"], inp["w2"], dims["rows"], generator=gen)
            run("dense_layer_mm", lambda d=d_inp: B.dense_layer_mm(d), check=False)
            del d_inp
        except Exception as e:  # noqa: BLE001
            results["dense_layer_mm"] = dict(ms=None, err=None, det=None, error=_short_error(e))
    if "torch_loop" in impls:
        run("torch_loop", lambda: B.torch_loop(*args, **kw), check=True, reps=loop_reps, warmup=1)
    # rounds 2..: every implementation timed again, interleaved; each one's median is the median of its rounds
    def void(impl, msg):
        results[impl] = dict(ms=None, err=None, det=None, error=msg)

    interleaved_rounds(timed, rounds, lambda impl, fn: results[impl]["rounds"].append(timer(fn)), void,
                       lambda r: _log(f"[{shape}] round {r + 1}: "
                                      + "  ".join(f"{i} {results[i]['rounds'][-1]:.4f}" for i in timed)))
    for impl in timed:
        results[impl]["ms"] = statistics.median(results[impl]["rounds"])
    for name, moe in keep:  # a kernel timeout flagged during the later rounds voids that layer's numbers
        try:
            moe.check_errors()
        except Exception as e:  # noqa: BLE001
            results[name] = dict(ms=None, err=None, det=None, error=_short_error(e))
    del keep

    base = results.get("torch_grouped_mm", {}).get("ms")
    order = [i for i in IMPLS if i in results] + sorted(i for i in results if i not in IMPLS)
    recs = [_record(ctx, shape, dims, i, results[i]["ms"], flops, base, results[i]["err"], results[i]["det"],
                    results[i]["error"]) for i in order]
    for rec, i in zip(recs, order):
        rec["timing"] = timer.method if i != "torch_loop" else (
            "cuda events median" if device.type == "cuda" else "perf_counter median") + ", fixed reps"
        if len(results[i].get("rounds", ())) > 1:
            rec["round_ms"] = results[i]["rounds"]
        if results[i].get("plan"):
            rec["plan"] = results[i]["plan"]
    del inp, ref, args, kw
    return recs


def bench_dense(n: int, ctx, timer: Timer, device) -> dict[str, Any]:
    gen = torch.Generator(device=device)
    gen.manual_seed(1)
    a = torch.randn(n, n, device=device, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, n, device=device, generator=gen).to(torch.bfloat16)
    dims = dict(M=n, N=n, K=n)
    try:
        out1, out2 = B.dense_mm(a, b), B.dense_mm(a, b)
        det = bitwise_equal(out1, out2)
        del out1, out2
        ms = timer(lambda: B.dense_mm(a, b))
        rec = _record(ctx, f"dense-{n}", dims, "dense_mm", ms, 2 * n ** 3, None, None, det)
        rec["timing"] = timer.method
        _log(f"[dense-{n}] dense_mm: {ms:.4f} ms  {rec['tflops']:.1f} TFLOP/s  det={det}")
    except Exception as e:  # noqa: BLE001
        rec = _record(ctx, f"dense-{n}", dims, "dense_mm", None, 2 * n ** 3, None, None, None, _short_error(e))
    del a, b
    return rec


def _free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def print_table(records: list[dict[str, Any]], title: str) -> None:
    header = ["shape", "impl", "median_ms", "TFLOP/s", "vs grouped_mm", "rel_err", "det"]
    rows = []
    for r in records:
        if r.get("error"):
            rows.append([r["shape"], r["impl"], "ERROR", r["error"][:48], "", "", ""])
            continue
        rows.append([r["shape"], r["impl"], f"{r['median_ms']:.4f}",
                     f"{r['tflops']:.1f}" if r["tflops"] >= 10 else f"{r['tflops']:.3g}",
                     "-" if r["speedup_vs_grouped_mm"] is None else f"{r['speedup_vs_grouped_mm']:.2f}x",
                     "-" if r["rel_err"] is None else f"{r['rel_err']:.2e}",
                     "-" if r["bitwise_deterministic"] is None else ("yes" if r["bitwise_deterministic"] else "NO")])
    render_table(title, header, rows, width=120)


def render_table(title: str, header: list[str], rows: list[list[str]], width: int) -> None:
    """A table with rich (at least ``width`` columns) or, without rich, as padded plain text. The first two
    columns are left-aligned (shape, impl), the rest right-aligned."""
    try:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table

        t = Table(title=title)
        for i, h in enumerate(header):
            t.add_column(h, justify="left" if i < 2 else "right")
        for row in rows:
            t.add_row(*(escape(c) for c in row))  # impl names like "mokgen[schedule=fused]" are not markup
        Console(width=max(width, Console().width)).print(t)
    except ImportError:
        widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
        print(title)
        print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
        for row in rows:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


def append_records(path: str | os.PathLike, records: list[dict[str, Any]]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    old: list[Any] = []
    if p.exists() and p.stat().st_size > 0:
        old = json.loads(p.read_text())
        if not isinstance(old, list):
            raise ValueError(f"{p}: expected a JSON list of records")
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(old + records, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, p)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench_forward", description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="*", metavar="SPEC", help=f"preset names or YAML paths (default: "
                    f"{' '.join(DEFAULT_SPECS)}; with --dry-run: tiny made-up specs)")
    ap.add_argument("--tokens", type=int, default=None, help="override T (tokens per rank) for every shape")
    ap.add_argument("--out", default=None, help=f"JSON list file the records are appended to "
                    f"(default {DEFAULT_OUT}; with --dry-run: nothing, so CPU test records never land among "
                    f"the H200's); '-' writes nothing")
    ap.add_argument("--no-mokgen", action="store_true", help="baselines only")
    ap.add_argument("--impls", default=None, help=f"comma-separated subset of {','.join(IMPLS)}")
    ap.add_argument("--no-dense", action="store_true", help="skip the dense_mm ceiling")
    ap.add_argument("--dense-size", type=int, default=None, help="dense matmul size (default 8192; 256 dry-run)")
    ap.add_argument("--loop-reps", type=int, default=3, help="timed reps of torch_loop (default 3)")
    ap.add_argument("--warmup-ms", type=float, default=25.0)
    ap.add_argument("--rep-ms", type=float, default=100.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny specs, CPU-capable baselines only")
    ap.add_argument("--rounds", type=int, default=1, help="time every implementation (but torch_loop) this many "
                    "times, interleaved, and record the median of the rounds (default 1)")
    ap.add_argument("--settle-s", type=float, default=0.0, help="run each implementation back to back this many "
                    "seconds before each of its timings (its own sustained regime; recorded as the records' timing)")
    ap.add_argument("--variants", default=None, help="extra mokgen plans to time, recorded as impl "
                    "'mokgen[k=v,...]': ';'-separated variants of ','-separated plan overrides, e.g. "
                    "'schedule=chain;schedule=fused'")
    return ap


def pick_device(dry_run: bool, tool: str) -> torch.device | None:
    """The benchmarks' device: the CPU for --dry-run, else the GPU; None (after saying why) without one."""
    if dry_run:
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    print(f"{tool}: no CUDA device (use --dry-run for the CPU smoke mode)", file=sys.stderr)
    return None


def parse_impls(text: str | None, known: Sequence[str], tool: str) -> list[str] | None:
    """--impls: a comma-separated subset of ``known`` (all when None); None (after saying why) on unknown names."""
    impls = list(known) if text is None else [s.strip() for s in text.split(",") if s.strip()]
    bad = [i for i in impls if i not in known]
    if bad:
        print(f"{tool}: --impls: unknown {bad}, choose from {tuple(known)}", file=sys.stderr)
        return None
    return impls


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = pick_device(args.dry_run, "bench_forward")
    impls = parse_impls(args.impls, IMPLS, "bench_forward")
    if device is None or impls is None:
        return 2
    if args.no_mokgen:
        impls = [i for i in impls if i != "mokgen"]
    if args.no_dense:
        impls = [i for i in impls if i != "dense_mm"]
    if device.type == "cpu":
        if "mokgen" in impls:
            _log("dry-run: mokgen skipped (needs a GPU)")
            impls.remove("mokgen")
        ok, why = B.grouped_mm_available(device)
        if not ok:
            for i in ("torch_grouped_mm", "torch_gemm_only"):
                if i in impls:
                    _log(f"dry-run: {i} skipped ({why})")
                    impls.remove(i)

    srcs: list[Any] = list(args.specs) or (DRY_RUN_SPECS if args.dry_run else DEFAULT_SPECS)
    try:
        specs = [resolve_spec(s, args.tokens) for s in srcs]
    except Exception as e:  # noqa: BLE001 - one clear line
        print(f"bench_forward: {_short_error(e)}", file=sys.stderr)
        return 2

    if args.settle_s < 0:
        print("bench_forward: --settle-s must be >= 0", file=sys.stderr)
        return 2
    timer = Timer(device, args.warmup_ms, args.rep_ms, settle_s=args.settle_s)
    ctx = dict(gpu=gpu_name(device), date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               versions=collect_versions())
    _log(f"bench_forward on {ctx['gpu']}; {timer.method}; versions {ctx['versions']}; impls {impls}")
    records: list[dict[str, Any]] = []
    shape_impls = [i for i in impls if i != "dense_mm"]
    t_start = time.perf_counter()
    with torch.no_grad():
        if shape_impls:
            for i, spec in enumerate(specs):
                records += bench_shape(spec, shape_impls, ctx, timer, device, args.loop_reps, args.seed + i,
                                       variants=[] if device.type == "cpu" else parse_variants(args.variants),
                                       rounds=max(1, args.rounds))
                _free(device)
        if "dense_mm" in impls:
            n = args.dense_size or (256 if device.type == "cpu" else 8192)
            records.append(bench_dense(n, ctx, timer, device))
            _free(device)
    _log(f"total {time.perf_counter() - t_start:.1f}s")
    print_table(records, f"MoE forward, {ctx['gpu']} ({timer.method})")
    out = args.out if args.out is not None else ("-" if args.dry_run else default_out("forward", device))
    if out != "-":
        append_records(out, records)
        _log(f"appended {len(records)} records to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
