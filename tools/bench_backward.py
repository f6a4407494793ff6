#!/usr/bin/env python
"""Training benchmark of the MoE layer (forward + backward under autograd): mokgen against torch's grouped_mm
pipeline and Liger-Kernel's fused Triton MoE.

    python tools/bench_backward.py [SPEC ...] [--tokens N] [--rounds N] [--impls mokgen,torch_grouped_mm,liger]
                                   [--out bench/results/backward-<gpu>.json] [--liger-autotune] [--dry-run]

Shapes and inputs are those of ``tools/bench_forward.py`` (its helpers are imported, not copied): the ep=64
per-rank shares of kimi-k2, deepseek-v4-pro, glm-5, qwen3.5-397b-a17b and the one-GPU qwen3-30b-a3b and
gpt-oss-120b. The output gradient ``dy [T, H]`` is N(0, 1) bf16 (seeded). Leaves requiring grad: x,
topk_weight, w1, w2 (and b1, b2 with biases).

Implementations (each ``y = f(x, topk_idx, topk_weight, w1, w2, b1, b2)`` followed by ``y.backward(dy)``):

- ``mokgen``: ``mokgen.moe_forward(..., moe=mokgen.compile(spec))`` (backward: the generated kernels);
- ``torch_grouped_mm``: ``mokgen.baselines.torch_grouped_mm`` under autograd (``torch._grouped_mm`` has an
  autograd formula, ``GroupedMmBackward0``; the script checks the graph reaches w1 and says so if not);
- ``liger``: Liger-Kernel's ``liger_kernel.ops.fused_moe.LigerFusedMoEFunction.apply(x, w1[:L], w2[:L],
  topk_idx, topk_weight)`` (routed experts; weights in our [E, 2I, H] / [E, H, I] layouts, gate rows first) plus
  the shared experts as torch's dense SwiGLU MLP (``baselines._mlp``), as its user would write them. Liger
  computes ``silu(gate) * up`` only: no clamp, no gpt-oss activation, no biases, no interleaved layout, so
  deepseek-v4-pro and gpt-oss-120b get no liger record. ``LIGER_FUSED_MOE_AUTOTUNE=0`` (its default configs)
  unless ``--liger-autotune``; what ran is recorded as ``liger_autotune``. Install on the GPU machine:
  ``pip download liger-kernel==0.8.5 --no-deps -d .whl`` here, carry ``.whl`` (``tools/device_env.sh``
  installs it into /tmp/site).

Record fields (one per shape and implementation, APPENDED to ``--out``): those of the forward records (gpu,
date, versions, shape, dims, impl, ``median_ms`` = the training forward alone (autograd graph built),
``rel_err`` of y, ``bitwise_deterministic``) plus ``fb_ms`` (forward + backward, grads set to None before each
run), ``tflops`` = 3 * forward FLOPs / fb_ms (forward FLOPs = 2 * rows * 3 * H * I), ``fwd_tflops``,
``speedup_vs_grouped_mm`` / ``speedup_vs_liger`` (that implementation's fb_ms / this one's, same process),
``grad_rel_err`` (the worst of dx, dw1, dw2, d(topk_weight), db1, db2 against ``mokgen.reference.backward``,
computed once per shape on the device in float64, or float32 where float64 would not fit: ``grad_ref`` says
which) and ``grad_rel_errs`` (each), ``bitwise_deterministic`` (y and all gradients of two runs, bit for bit),
``saved_bytes`` (mokgen: ``saved.nbytes`` of ``moe.forward_train``; torch / liger: the unique storages the
autograd graph saves, not belonging to the inputs or parameters, through ``torch.autograd.graph.
saved_tensors_hooks``; ``saved_bytes_autograd`` is that measurement for every implementation), ``peak_mem_mb``
(``torch.cuda.max_memory_allocated`` over one forward+backward, minus what was allocated before it),
``liger_autotune``, ``dtype`` (the spec's). FP8: pass a preset and its FP8 twin (``kimi-k2 kimi-k2-fp8``,
``glm-5 tools/specs/glm-5-fp8.yaml``) and the FP8 mokgen rows get ``speedup_vs_bf16`` / ``fwd_speedup_vs_bf16``
(the BF16 mokgen row's fb_ms / median_ms over theirs, same process).

Timing: ``triton.testing.do_bench(fn, return_mode="median")`` through bench_forward's ``Timer``; ``--rounds N``
re-times every implementation N-1 more times, interleaved, and records the median of the rounds (``round_ms``,
``round_fwd_ms``). ``--dry-run`` runs on the CPU with bench_forward's tiny specs and only what runs there
(torch_grouped_mm where ``torch._grouped_mm`` runs on the CPU; mokgen and liger need CUDA); it writes nothing
unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import json
import datetime as _dt
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

_TOOLS = Path(__file__).resolve().parent
if str(_TOOLS) not in sys.path:
    sys.path.insert(0, str(_TOOLS))

import bench_forward as BF  # noqa: E402  (puts the repository root on sys.path too)
import torch  # noqa: E402

from mokgen import baselines as B  # noqa: E402
from mokgen import reference as ref  # noqa: E402
from mokgen import plan as P  # noqa: E402

DEFAULT_SPECS = list(BF.DEFAULT_SPECS)
DRY_RUN_SPECS = BF.DRY_RUN_SPECS
DEFAULT_OUT = f"{BF.RESULTS_DIR}/backward-<gpu>.json"   # BF.default_out: the GPU's own file
IMPLS = ["mokgen", "torch_grouped_mm", "liger"]
GRADS = ("x", "topk_weight", "w1", "w2", "b1", "b2")
RECORD_FIELDS = BF.RECORD_FIELDS + [
    "fb_ms", "fwd_tflops", "speedup_vs_liger", "grad_rel_err", "grad_rel_errs", "grad_ref", "saved_bytes",
    "saved_bytes_method", "saved_bytes_autograd", "peak_mem_mb", "liger_autotune", "timing", "dtype"]

_log = BF._log
_short_error = BF._short_error


# ---------------------------------------------------------------------------------------------------------
# Liger
# ---------------------------------------------------------------------------------------------------------


def liger_supported(spec) -> tuple[bool, str]:
    """Whether Liger's fused MoE computes this layer (it has silu(gate) * up on concat [gate; up] rows only)."""
    if spec.activation != "swiglu":
        return False, f"activation {spec.activation} (Liger computes silu(gate) * up only)"
    if getattr(spec, "swiglu_limit", None) is not None:
        return False, f"clamped SwiGLU (limit {spec.swiglu_limit}; Liger has no clamp)"
    if spec.gate_up_layout != "concat":
        return False, f"gate_up_layout {spec.gate_up_layout} (Liger reads gate rows [0, I), up rows [I, 2I))"
    if spec.bias:
        return False, "expert biases (Liger has none)"
    return True, ""


def load_liger(autotune: bool) -> tuple[Any, bool]:
    """(LigerFusedMoEFunction, autotune actually on). The env var must be set before liger_kernel is imported
    (its kernels module reads it at import time); what the module read is what is returned."""
    os.environ["LIGER_FUSED_MOE_AUTOTUNE"] = "1" if autotune else "0"
    from liger_kernel.ops import fused_moe_kernels as LK
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

    return LigerFusedMoEFunction, not bool(LK._AUTOTUNE_DISABLED)


def liger_layer(fn: Any, spec) -> Callable[..., torch.Tensor]:
    """The layer through Liger: ``fn.apply(x, gate_up_proj [L, 2I, H], down_proj [L, H, I], top_k_index [T, K]
    int32, top_k_weights [T, K])`` for the routed experts, torch's dense MLP for each shared expert (the last S
    groups, weight 1) added to its output."""
    L = B._local_experts(spec)
    S = int(spec.shared_experts)

    def f(x, topk_idx, topk_weight, w1, w2, b1=None, b2=None):
        if b1 is not None or b2 is not None:
            raise ValueError("Liger's fused MoE has no expert biases")
        y = fn.apply(x, w1[:L], w2[:L], topk_idx, topk_weight)
        for s in range(S):
            y = y + B._mlp(x, w1[L + s], w2[L + s], None, None, spec)
        return y

    return f


# ---------------------------------------------------------------------------------------------------------
# measurements
# ---------------------------------------------------------------------------------------------------------


rel_err = ref.rel_err  # ||a - b|| / ||b|| in float64, a slab at a time (mokgen.reference)


def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    try:
        st = t.untyped_storage()
        return st.data_ptr(), st.nbytes()
    except Exception:  # noqa: BLE001 - tensors without a storage (fake, nested, ...) are not counted
        return None


def saved_bytes_autograd(forward: Callable[[], Any], exclude: list[torch.Tensor | None]) -> int:
    """Bytes the autograd graph of ``forward()`` keeps for the backward: the unique storages of the tensors it
    saves (``saved_tensors_hooks``), minus the storages of ``exclude`` (the caller's inputs and parameters,
    which the caller keeps anyway; views of them share their storage and are excluded too)."""
    excl = {k[0] for k in (_storage_key(t) for t in exclude if t is not None) if k is not None}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        k = _storage_key(t)
        if k is not None and k[1] > 0 and k[0] not in excl:
            seen[k[0]] = max(seen.get(k[0], 0), k[1])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = forward()
    total = sum(seen.values())
    del y
    return int(total)


def pick_ref_dtype(spec, device: torch.device, want: str) -> torch.dtype:
    """float64 unless asked otherwise or unless the float64 reference's gradients and temporaries would take
    more than half the free device memory (then float32)."""
    if want != "auto":
        return getattr(torch, want)
    if device.type != "cuda":
        return torch.float64
    d = BF.spec_dims(spec)
    G, H, I, T = d["groups"], d["H"], d["I"], d["T"]
    need = 8 * (3 * G * H * I + 6 * H * I + 6 * T * H + 4 * d["rows"] * I) * 1.3
    free, _ = torch.cuda.mem_get_info(device)
    return torch.float64 if need < 0.5 * free else torch.float32


def reference_grads(spec, inp: dict[str, Any], dy: torch.Tensor, dtype: torch.dtype):
    """(y_ref, Grads) from ``mokgen.reference`` in ``dtype`` on inp's device; kept as float32 copies (half the
    memory of float64; rounding them costs 6e-8 relative)."""
    args = (inp["x"], inp["topk_idx"], inp["topk_weight"], inp["w1"], inp["w2"], spec, inp["b1"], inp["b2"])
    y = ref.forward(*args, dtype=dtype).to(torch.float32)
    g = ref.backward(dy, *args, dtype=dtype)
    return y, ref.Grads(*(None if t is None else t.to(torch.float32) for t in g))


# ---------------------------------------------------------------------------------------------------------
# one shape
# ---------------------------------------------------------------------------------------------------------


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def add_fp8_ratios(records: list[dict[str, Any]]) -> None:
    """FP8 against BF16 measured in this run: every FP8 mokgen row (``dtype`` fp8, default plan or a variant) whose
    shape (``dims``) also ran in BF16 here gets ``speedup_vs_bf16`` (the BF16 mokgen row's fb_ms / its fb_ms) and
    ``fwd_speedup_vs_bf16`` (the same for the forward alone): pass a preset and its FP8 twin in one call."""
    bf16 = {json.dumps(r["dims"], sort_keys=True): r for r in records
            if r.get("dtype") == "bf16" and r["impl"] == "mokgen" and r.get("fb_ms")}
    for r in records:
        b = bf16.get(json.dumps(r["dims"], sort_keys=True))
        if r.get("dtype") == "fp8" and r["impl"].startswith("mokgen") and b is not None and r.get("fb_ms"):
            r["speedup_vs_bf16"] = b["fb_ms"] / r["fb_ms"]
            if r.get("median_ms") and b.get("median_ms"):
                r["fwd_speedup_vs_bf16"] = b["median_ms"] / r["median_ms"]


def _record(ctx, shape, dims, impl, res: dict[str, Any], flops: int, base_ms, liger_ms, extra) -> dict[str, Any]:
    ms, fwd = res.get("fb_ms"), res.get("fwd_ms")
    rec = dict(gpu=ctx["gpu"], date=ctx["date"], versions=ctx["versions"], shape=shape, dims=dims, impl=impl,
               median_ms=fwd, tflops=(3 * flops / (ms * 1e-3) / 1e12) if ms else None,
               speedup_vs_grouped_mm=(base_ms / ms) if (ms and base_ms) else None,
               rel_err=res.get("rel_err"), bitwise_deterministic=res.get("det"),
               fb_ms=ms, fwd_tflops=(flops / (fwd * 1e-3) / 1e12) if fwd else None,
               speedup_vs_liger=(liger_ms / ms) if (ms and liger_ms) else None,
               grad_rel_err=res.get("grad_rel_err"), grad_rel_errs=res.get("grad_rel_errs"),
               grad_ref=extra.get("grad_ref"), saved_bytes=res.get("saved_bytes"),
               saved_bytes_method=res.get("saved_bytes_method"), saved_bytes_autograd=res.get("saved_bytes_autograd"),
               peak_mem_mb=res.get("peak_mem_mb"), liger_autotune=extra.get("liger_autotune"),
               timing=extra.get("timing"))
    if len(res.get("rounds", ())) > 1:
        rec["round_ms"] = res["rounds"]
        rec["round_fwd_ms"] = res["fwd_rounds"]
    if res.get("plan"):
        rec["plan"] = res["plan"]
    if res.get("error") is not None:
        rec["error"] = res["error"]
    if res.get("grad_nonfinite"):
        rec["grad_nonfinite"] = res["grad_nonfinite"]
    return rec


def bench_shape(spec, impls: list[str], ctx: dict[str, Any], timer: "BF.Timer", device: torch.device, seed: int,
                variants: list[dict[str, Any]] | None = None, rounds: int = 1, ref_dtype: str = "auto",
                liger: tuple[Any, bool] | str | None = None) -> list[dict[str, Any]]:
    """Records of one shape. ``liger``: (LigerFusedMoEFunction-like, autotune) or an error string (import
    failed) or None (not requested). The timer settles each callable first when built with ``settle_s``."""
    shape = spec.name
    dims = BF.spec_dims(spec)
    flops = BF.spec_flops(spec)
    _log(f"[{shape}] T={dims['T']} H={dims['H']} I={dims['I']} K={dims['K']} S={dims['S']} "
         f"L={dims['local_experts']} rows={dims['rows']} {dims['activation']}/{dims['gate_up_layout']}"
         f"{' bias' if dims['bias'] else ''}")
    inp = BF.make_inputs(spec, device, seed=seed)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed + 1000)
    dy = torch.randn(dims["T"], dims["H"], device=device, generator=gen, dtype=torch.float32).to(torch.bfloat16)

    rdt = pick_ref_dtype(spec, device, ref_dtype)
    t0 = time.perf_counter()
    y_ref, g_ref = reference_grads(spec, inp, dy, rdt)
    if device.type == "cuda":
        torch.cuda.synchronize()
    ref_s = time.perf_counter() - t0
    extra = dict(grad_ref=f"mokgen.reference.backward {str(rdt).replace('torch.', '')} on {device.type}",
                 liger_autotune=liger[1] if isinstance(liger, tuple) else None,
                 timing=timer.method)
    _log(f"[{shape}] reference ({extra['grad_ref']}) {ref_s:.1f}s")

    # the leaves: the input tensors themselves (make_inputs' tensors are leaves without grad)
    x = inp["x"].requires_grad_(True)
    tw = inp["topk_weight"].requires_grad_(True)
    w1 = inp["w1"].requires_grad_(True)
    w2 = inp["w2"].requires_grad_(True)
    b1 = inp["b1"].requires_grad_(True) if inp["b1"] is not None else None
    b2 = inp["b2"].requires_grad_(True) if inp["b2"] is not None else None
    idx = inp["topk_idx"]
    leaves = dict(x=x, topk_weight=tw, w1=w1, w2=w2, b1=b1, b2=b2)
    exclude = [x, idx, tw, w1, w2, b1, b2, dy]

    def clear_grads() -> None:
        for t in leaves.values():
            if t is not None:
                t.grad = None

    def grads() -> list[torch.Tensor | None]:
        return [None if t is None else t.grad for t in leaves.values()]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    results: dict[str, dict[str, Any]] = {}
    timed: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {}

    def run(impl: str, fwd: Callable[[], torch.Tensor], saved_nbytes: Callable[[], int] | None = None) -> None:
        """Check and time ``fwd`` (a closure over the leaves) forward and forward+backward."""
        t1 = time.perf_counter()

        def step() -> None:
            clear_grads()
            fwd().backward(dy)

        res: dict[str, Any] = dict(error=None)
        results[impl] = res
        try:
            clear_grads()
            y1 = fwd()
            if y1.grad_fn is None:
                raise RuntimeError(f"{impl}: the output has no autograd graph (no backward through it)")
            y1.backward(dy)
            g1 = grads()
            missing = [n for n, t, g in zip(GRADS, leaves.values(), g1) if t is not None and g is None]
            if missing:
                raise RuntimeError(f"{impl}: no gradient reached {missing}")
            clear_grads()
            y2 = fwd()
            y2.backward(dy)
            g2 = grads()
            sync()
            res["det"] = BF.bitwise_equal([y1.detach()] + [g for g in g1 if g is not None],
                                          [y2.detach()] + [g for g in g2 if g is not None])
            res["rel_err"] = rel_err(y1.detach(), y_ref)
            errs: dict[str, float | None] = {}
            for name, g, r in zip(GRADS, g1, g_ref):
                if r is None:
                    continue
                e = rel_err(g, r)
                errs[name] = e if math.isfinite(e) else None
            res["grad_rel_errs"] = errs
            bad = [n for n, e in errs.items() if e is None]
            res["grad_nonfinite"] = bad
            res["grad_rel_err"] = None if bad else max(errs.values())
            del y1, y2, g1, g2
            clear_grads()
            res["saved_bytes_autograd"] = saved_bytes_autograd(fwd, exclude)
            if saved_nbytes is not None:
                res["saved_bytes"], res["saved_bytes_method"] = int(saved_nbytes()), "saved.nbytes"
            else:
                res["saved_bytes"], res["saved_bytes_method"] = res["saved_bytes_autograd"], "saved_tensors_hooks"
            if device.type == "cuda":
                clear_grads()
                BF._free(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
                step()
                torch.cuda.synchronize()
                res["peak_mem_mb"] = (torch.cuda.max_memory_allocated(device) - base) / 2 ** 20
            clear_grads()
            res["fwd_ms"] = timer(fwd)
            res["fb_ms"] = timer(step)
            clear_grads()
            res["rounds"], res["fwd_rounds"] = [res["fb_ms"]], [res["fwd_ms"]]
            timed[impl] = (fwd, step)
            _log(f"[{shape}] {impl}: fwd {res['fwd_ms']:.4f} ms  f+b {res['fb_ms']:.4f} ms  "
                 f"{3 * flops / (res['fb_ms'] * 1e-3) / 1e12:.1f} TFLOP/s  grad_rel_err="
                 f"{'NaN/inf in ' + ','.join(bad) if bad else format(res['grad_rel_err'], '.2e')}  "
                 f"det={res['det']}  saved={res['saved_bytes'] / 2 ** 20:.1f} MiB  "
                 f"({time.perf_counter() - t1:.1f}s)")
        except Exception as e:  # noqa: BLE001 - record and go on with the other implementations
            results[impl] = dict(error=_short_error(e))
            _log(f"[{shape}] {impl}: FAILED {_short_error(e)}")
            if os.environ.get("MOKGEN_BENCH_TRACEBACK"):
                traceback.print_exc()
        finally:
            clear_grads()

    def detached():
        return [None if t is None else t.detach() for t in (x, idx, tw, w1, w2, b1, b2)]

    if "torch_grouped_mm" in impls:
        run("torch_grouped_mm", lambda: B.torch_grouped_mm(x, idx, tw, w1, w2, spec, b1=b1, b2=b2))
    mokgen_runs = [("mokgen", None)] if "mokgen" in impls else []
    for v in variants or []:
        fp8_only = P.fp8_only_keys(v)
        if fp8_only and getattr(spec, "dtype", "bf16") != "fp8":   # FP8 knobs: a variant of the FP8 twins only
            _log(f"[{shape}] {BF.variant_name(v)}: skipped ({', '.join(fp8_only)} apply to dtype fp8 specs)")
            continue
        mokgen_runs.append((BF.variant_name(v), v))
    keep = []
    for name, ov in mokgen_runs:
        moe = None
        try:
            import mokgen

            t1 = time.perf_counter()
            moe = mokgen.compile(spec, overrides=ov)
            _log(f"[{shape}] {name}: mokgen.compile {time.perf_counter() - t1:.1f}s (schedule "
                 f"{getattr(moe.plan, 'schedule', '?')})")

            def saved_nbytes(m=moe) -> int:
                with torch.no_grad():
                    xd, _, twd, w1d, w2d, b1d, b2d = detached()
                    y, saved = m.forward_train(xd, idx, twd, w1d, w2d, b1d, b2d)
                    n = int(saved.nbytes)
                del y, saved
                return n

            run(name, lambda m=moe: mokgen.moe_forward(x, idx, tw, w1, w2, b1, b2, moe=m), saved_nbytes)
            if name in results:
                results[name]["plan"] = BF.plan_source(moe, ov)
            moe.check_errors()
            if name in timed:
                keep.append((name, moe))
        except Exception as e:  # noqa: BLE001
            if name not in results or results[name].get("error") is None:
                results[name] = dict(error=_short_error(e))
            timed.pop(name, None)
            _log(f"[{shape}] {name}: FAILED {_short_error(e)}")
            if os.environ.get("MOKGEN_BENCH_TRACEBACK"):
                traceback.print_exc()
        finally:
            moe = None
    if "liger" in impls:
        ok, why = liger_supported(spec)
        if not ok:
            _log(f"[{shape}] liger: no record ({why})")
        elif isinstance(liger, str) or liger is None:
            results["liger"] = dict(error=liger or "liger_kernel not loaded")
            _log(f"[{shape}] liger: FAILED {results['liger']['error']}")
        else:
            f = liger_layer(liger[0], spec)
            run("liger", lambda: f(x, idx, tw, w1, w2, b1, b2))

    # rounds 2..: every implementation timed again, interleaved (clock drift under the power cap spreads over
    # all of them); each one's times are the medians of its rounds
    def time_once(impl, fns):
        fwd, step = fns
        try:
            results[impl]["fwd_rounds"].append(timer(fwd))
            results[impl]["rounds"].append(timer(step))
        finally:
            clear_grads()

    def void(impl, msg):
        results[impl] = dict(error=msg)

    BF.interleaved_rounds(timed, rounds, time_once, void,
                          lambda r: _log(f"[{shape}] round {r + 1}: "
                                         + "  ".join(f"{i} {results[i]['rounds'][-1]:.4f}" for i in timed)))
    for impl in timed:
        results[impl]["fb_ms"] = _median(results[impl]["rounds"])
        results[impl]["fwd_ms"] = _median(results[impl]["fwd_rounds"])
    for name, moe in keep:  # an error flagged during the later rounds voids that layer's numbers
        try:
            moe.check_errors()
        except Exception as e:  # noqa: BLE001
            results[name] = dict(error=_short_error(e))
    del keep

    base = results.get("torch_grouped_mm", {}).get("fb_ms")
    liger_ms = results.get("liger", {}).get("fb_ms")
    order = [i for i in IMPLS if i in results] + sorted(i for i in results if i not in IMPLS)
    recs = [_record(ctx, shape, dims, i, results[i], flops, base, liger_ms, extra) for i in order]
    for r in recs:
        r["dtype"] = getattr(spec, "dtype", "bf16")
    for t in leaves.values():
        if t is not None:
            t.requires_grad_(False)
    del inp, y_ref, g_ref, leaves, timed
    return recs


# ---------------------------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------------------------


def print_table(records: list[dict[str, Any]], title: str) -> None:
    header = ["shape", "impl", "fwd ms", "f+b ms", "TFLOP/s", "vs grouped_mm", "vs liger", "grad err", "det",
              "saved MiB", "peak MiB"]

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    rows = []
    for r in records:
        if r.get("error"):
            rows.append([r["shape"], r["impl"], "ERROR", r["error"][:60]] + [""] * (len(header) - 4))
            continue
        err = f(r["grad_rel_err"], ".2e") if not r.get("grad_nonfinite") else "NaN:" + ",".join(r["grad_nonfinite"])
        rows.append([r["shape"], r["impl"], f(r["median_ms"], ".4f"), f(r["fb_ms"], ".4f"),
                     f(r["tflops"], ".1f") if (r["tflops"] or 0) >= 10 else f(r["tflops"], ".3g"),
                     "-" if r["speedup_vs_grouped_mm"] is None else f"{r['speedup_vs_grouped_mm']:.2f}x",
                     "-" if r["speedup_vs_liger"] is None else f"{r['speedup_vs_liger']:.2f}x", err,
                     "-" if r["bitwise_deterministic"] is None else ("yes" if r["bitwise_deterministic"] else "NO"),
                     "-" if r["saved_bytes"] is None else f"{r['saved_bytes'] / 2 ** 20:.1f}",
                     f(r["peak_mem_mb"], ".0f")])
    BF.render_table(title, header, rows, width=150)


# ---------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench_backward", description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="*", metavar="SPEC", help=f"preset names or YAML paths (default: "
                    f"{' '.join(DEFAULT_SPECS)}; with --dry-run: tiny made-up specs)")
    ap.add_argument("--tokens", type=int, default=None, help="override T (tokens per rank) for every shape")
    ap.add_argument("--out", default=None, help=f"JSON list file the records are appended to (default "
                    f"{DEFAULT_OUT}; with --dry-run: nothing); '-' writes nothing")
    ap.add_argument("--impls", default=None, help=f"comma-separated subset of {','.join(IMPLS)}")
    ap.add_argument("--no-mokgen", action="store_true", help="baselines only")
    ap.add_argument("--liger-autotune", action="store_true", help="let Liger's Triton autotune run "
                    "(LIGER_FUSED_MOE_AUTOTUNE=1: minutes per shape on the first call); default: its pinned configs")
    ap.add_argument("--ref-dtype", default="auto", choices=["auto", "float64", "float32"],
                    help="dtype of the gradient reference (auto: float64 where it fits in half the free memory)")
    ap.add_argument("--warmup-ms", type=float, default=25.0)
    ap.add_argument("--rep-ms", type=float, default=100.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1, help="time every implementation this many times, "
                    "interleaved, and record the medians of the rounds (default 1)")
    ap.add_argument("--settle-s", type=float, default=0.0, help="run each implementation back to back this many "
                    "seconds before each timing (its own sustained clock regime, not its predecessor's; default 0)")
    ap.add_argument("--variants", default=None, help="extra mokgen plans, as bench_forward's --variants "
                    "(recorded as impl 'mokgen[k=v,...]')")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny specs, CPU-capable implementations only")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = BF.pick_device(args.dry_run, "bench_backward")
    impls = BF.parse_impls(args.impls, IMPLS, "bench_backward")
    if device is None or impls is None:
        return 2
    out = args.out if args.out is not None else ("-" if args.dry_run else BF.default_out("backward", device))
    if args.no_mokgen:
        impls = [i for i in impls if i != "mokgen"]
    if device.type == "cpu":
        for i in ("mokgen", "liger"):
            if i in impls:
                _log(f"dry-run: {i} skipped (needs CUDA)")
                impls.remove(i)
        ok, why = B.grouped_mm_available(device)
        if not ok and "torch_grouped_mm" in impls:
            _log(f"dry-run: torch_grouped_mm skipped ({why})")
            impls.remove("torch_grouped_mm")

    srcs: list[Any] = list(args.specs) or (DRY_RUN_SPECS if args.dry_run else DEFAULT_SPECS)
    try:
        specs = [BF.resolve_spec(s, args.tokens) for s in srcs]
    except Exception as e:  # noqa: BLE001 - one clear line
        print(f"bench_backward: {_short_error(e)}", file=sys.stderr)
        return 2

    if args.settle_s < 0:
        print("bench_backward: --settle-s must be >= 0", file=sys.stderr)
        return 2
    timer = BF.Timer(device, args.warmup_ms, args.rep_ms, settle_s=args.settle_s)
    versions = BF.collect_versions()
    liger: tuple[Any, bool] | str | None = None
    if "liger" in impls:
        try:
            liger = load_liger(args.liger_autotune)
            from importlib.metadata import version

            try:
                versions["liger-kernel"] = version("liger-kernel")
            except Exception:  # noqa: BLE001
                versions["liger-kernel"] = None
        except Exception as e:  # noqa: BLE001 - every supported shape gets an error record
            liger = f"import liger_kernel: {_short_error(e)}"
            _log(f"liger: {liger}")
    ctx = dict(gpu=BF.gpu_name(device), date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               versions=versions)
    _log(f"bench_backward on {ctx['gpu']}; {timer.method}; versions {ctx['versions']}; impls {impls}"
         f"{'; liger autotune ' + str(liger[1]) if isinstance(liger, tuple) else ''}")
    records: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for i, spec in enumerate(specs):
        records += bench_shape(spec, impls, ctx, timer, device, args.seed + i,
                               variants=[] if device.type == "cpu" else BF.parse_variants(args.variants),
                               rounds=max(1, args.rounds), ref_dtype=args.ref_dtype, liger=liger)
        BF._free(device)
    _log(f"total {time.perf_counter() - t_start:.1f}s")
    add_fp8_ratios(records)
    print_table(records, f"MoE forward+backward, {ctx['gpu']} ({timer.method})")
    if out != "-":
        BF.append_records(out, records)
        _log(f"appended {len(records)} records to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
