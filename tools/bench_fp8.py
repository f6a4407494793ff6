#!/usr/bin/env python
"""FP8 forward (and --backward) benchmark of the MoE layer: the peers mokgen's FP8 is measured against.

    python tools/bench_fp8.py [SPEC ...] [--tokens N] [--out bench/results/fp8-<gpu>.json] [--impls a,b]
                              [--backward] [--rounds R] [--settle-s S] [--dry-run]

Shapes: those of tools/bench_forward.py (same T). Implementations per shape (``mokgen/baselines.py``):
``torch_grouped_mm`` (bf16), ``torch_fp8_grouped_mm`` (rowwise-scaled ``torch._scaled_grouped_mm`` for both GEMMs,
quantization in plain torch, the WEIGHTS QUANTIZED INSIDE the timed call as in a training step),
``torch_fp8_grouped_mm_prequant`` (the same with pre-quantized weights: an inference figure),
``torch_fp8_grouped_mm_fast_accum`` (``use_fast_accum=True``, torchao's setting), ``torch_fp8_gemm_only`` (the two
scaled grouped GEMMs alone, pre-permuted and pre-quantized rows), ``torchao_fp8`` (torchao 0.18's
``_to_fp8_rowwise_then_scaled_grouped_mm`` for both GEMMs; an ``error`` record where it is unavailable),
``mokgen`` (bf16, ``mokgen.compile(spec)``), ``mokgen_fp8`` (``mokgen.compile`` of the spec with ``dtype: fp8``,
called like the bf16 layer with the bf16 master weights; an ``error`` record while the spec refuses it). Once
per run the ceilings ``dense_mm`` (bf16), ``dense_fp8_mm`` and ``dense_fp8_mm_fast_accum`` (``torch._scaled_mm``
rowwise, 8192^3).

Fields: bench_forward's plus ``dtype``, ``speedup_vs_bf16`` (mokgen bf16 ms / this ms; torch_grouped_mm's when
mokgen has no number), ``speedup_vs_torch_fp8`` (torch_fp8_grouped_mm ms / this ms), ``rel_err_vs_bf16``
(against mokgen bf16's output, else torch_grouped_mm's; ``bf16_ref`` names it) and ``rel_err`` (against the
float32 reference). ``--backward`` adds per shape forward+backward rows (``pass: "fwd+bwd"``, ``fb_ms``,
``grad_rel_err`` against torch_grouped_mm's bf16 gradients) for torch_grouped_mm, torch_fp8_grouped_mm
(FP8 dgrad + FP8 wgrad), torch_fp8_grouped_mm[wgrad=bf16] and, where they are in ``--impls``, torchao_fp8, mokgen
and mokgen_fp8 (``mokgen.moe_forward`` under autograd: the generated backward kernels), timed ``--rounds`` times
interleaved; there ``speedup_vs_bf16`` is mokgen BF16's fb_ms over the row's (torch_grouped_mm's without a mokgen
row: ``bf16_ref``) and ``speedup_vs_torch_fp8`` torch_fp8_grouped_mm's fb_ms over the row's, same process.

Timing as bench_forward (``triton.testing.do_bench`` medians). ``--dry-run``: CPU, tiny specs, the FP8 GEMMs
emulated (dequantize + matmul), nothing written by default. torchao: ``pip install --no-deps
.whl/torchao-0.18.0-*.whl`` on the device first (or ``--torchao-wheel PATH``: unpacked to a temp dir and put
on sys.path).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import statistics
import sys
import tempfile
import time
import traceback
import zipfile
from pathlib import Path
from typing import Any, Callable

_REPO = Path(__file__).resolve().parents[1]
for _p in (str(_REPO), str(_REPO / "tools")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

import bench_forward as BF  # noqa: E402
from mokgen import baselines as B  # noqa: E402

DEFAULT_SPECS = list(BF.DEFAULT_SPECS)
DEFAULT_OUT = f"{BF.RESULTS_DIR}/fp8-<gpu>.json"   # BF.default_out: the GPU's own file
DRY_RUN_SPECS = BF.DRY_RUN_SPECS
IMPLS = ["torch_grouped_mm", "mokgen", "torch_fp8_grouped_mm", "torch_fp8_grouped_mm_prequant",
         "torch_fp8_grouped_mm_fast_accum", "torch_fp8_gemm_only", "torchao_fp8", "mokgen_fp8",
         "dense_mm", "dense_fp8_mm", "dense_fp8_mm_fast_accum"]
DENSE = ("dense_mm", "dense_fp8_mm", "dense_fp8_mm_fast_accum")
BACKWARD_IMPLS = ["torch_grouped_mm", "torch_fp8_grouped_mm", "torch_fp8_grouped_mm[wgrad=bf16]", "torchao_fp8",
                  "mokgen", "mokgen_fp8"]
DTYPES = {"torch_grouped_mm": "bf16", "mokgen": "bf16", "dense_mm": "bf16"}
RECORD_FIELDS = BF.RECORD_FIELDS + ["dtype", "speedup_vs_bf16", "speedup_vs_torch_fp8", "rel_err_vs_bf16"]

_log = BF._log
_short_error = BF._short_error


def spec_as(spec, dtype: str) -> dict[str, Any]:
    """The spec as a mapping with ``dtype`` set: what ``mokgen.compile`` gets for the mokgen (``bf16``) and
    mokgen_fp8 (``fp8``) rows, whichever dtype the given spec has (an FP8 preset's BF16 row is its BF16 twin)."""
    d = dict(spec.to_dict())
    d["dtype"] = dtype
    return d


def use_torchao_wheel(path: str) -> str:
    """Unpack a torchao wheel to a temp dir and put it first on sys.path; returns the dir."""
    d = tempfile.mkdtemp(prefix="torchao-wheel-")
    with zipfile.ZipFile(path) as z:
        z.extractall(d)
    sys.path.insert(0, d)
    return d


def _dtype(impl: str) -> str:
    return DTYPES.get(impl, "fp8")


class _Runner:
    """Runs, checks and times implementations of one shape; results[impl] = dict(ms, err, det, error, out)."""

    def __init__(self, shape, flops, timer, ref, rounds):
        self.shape, self.flops, self.timer, self.ref, self.rounds = shape, flops, timer, ref, rounds
        self.results: dict[str, dict[str, Any]] = {}
        self.timed: dict[str, Callable[[], Any]] = {}

    def fail(self, impl, e):
        self.results[impl] = dict(ms=None, err=None, det=None, error=_short_error(e) if isinstance(e, BaseException)
                                  else str(e), out=None)
        _log(f"[{self.shape}] {impl}: FAILED {self.results[impl]['error']}")
        if isinstance(e, BaseException) and os.environ.get("MOKGEN_BENCH_TRACEBACK"):
            traceback.print_exception(e)

    def run(self, impl, fn, check=True, keep_out=True):
        t1 = time.perf_counter()
        try:
            out1 = fn()
            out2 = fn()
            det = BF.bitwise_equal(out1, out2)
            err = BF.rel_err(out1, self.ref) if check else None
            ms = self.timer(fn)
            self.results[impl] = dict(ms=ms, err=err, det=det, error=None, rounds=[ms],
                                      out=out1 if (check and keep_out) else None)
            del out2
            if self.rounds > 1:
                self.timed[impl] = fn
            _log(f"[{self.shape}] {impl}: {ms:.4f} ms  {self.flops / (ms * 1e-3) / 1e12:.1f} TFLOP/s  rel_err="
                 f"{'-' if err is None else f'{err:.2e}'}  det={det}  ({time.perf_counter() - t1:.1f}s)")
        except Exception as e:  # noqa: BLE001 - record and go on
            self.fail(impl, e)

    def more_rounds(self):
        BF.interleaved_rounds(self.timed, self.rounds,
                              lambda impl, fn: self.results[impl]["rounds"].append(self.timer(fn)),
                              lambda impl, msg: self.fail(impl, RuntimeError(msg)))
        for impl in self.timed:
            self.results[impl]["ms"] = statistics.median(self.results[impl]["rounds"])


def _finish(ctx, shape, dims, flops, res, order, timer) -> list[dict[str, Any]]:
    get = lambda i: res.get(i, {}).get("ms")  # noqa: E731
    base = get("torch_grouped_mm")
    bf16_ms = get("mokgen") or base
    fp8_ms = get("torch_fp8_grouped_mm")
    bf16_name = "mokgen" if res.get("mokgen", {}).get("out") is not None else "torch_grouped_mm"
    bf16_out = res.get(bf16_name, {}).get("out")
    recs = []
    for i in order:
        r = res[i]
        ms = r["ms"]
        rec = BF._record(ctx, shape, dims, i, ms, flops, base, r["err"], r["det"], r["error"])
        rec["dtype"] = _dtype(i)
        rec["speedup_vs_bf16"] = (bf16_ms / ms) if (ms and bf16_ms) else None
        rec["speedup_vs_torch_fp8"] = (fp8_ms / ms) if (ms and fp8_ms) else None
        rec["rel_err_vs_bf16"] = (BF.rel_err(r["out"], bf16_out) if (r.get("out") is not None and bf16_out is not None)
                                  else None)
        rec["bf16_ref"] = bf16_name if bf16_out is not None else None
        rec["timing"] = timer.method
        if len(r.get("rounds", ())) > 1:
            rec["round_ms"] = r["rounds"]
        for k in ("note", "plan"):
            if r.get(k):
                rec[k] = r[k]
        recs.append(rec)
    return recs


def bench_shape(spec, impls, ctx, timer, device, seed: int, rounds: int = 1,
                torchao: tuple[bool, str] = (False, "not probed")) -> list[dict[str, Any]]:
    shape, dims, flops = spec.name, BF.spec_dims(spec), BF.spec_flops(spec)
    emulate = device.type != "cuda"
    _log(f"[{shape}] T={dims['T']} H={dims['H']} I={dims['I']} K={dims['K']} S={dims['S']} "
         f"L={dims['local_experts']} rows={dims['rows']}{' (FP8 GEMMs emulated)' if emulate else ''}")
    inp = BF.make_inputs(spec, device, seed=seed)
    args = (inp["x"], inp["topk_idx"], inp["topk_weight"], inp["w1"], inp["w2"], spec)
    kw = dict(b1=inp["b1"], b2=inp["b2"])
    ref, _ = BF.reference_output(spec, inp, torch.float32)
    R = _Runner(shape, flops, timer, ref, rounds)
    ok_g, why_g = B.grouped_mm_available(device)

    if "torch_grouped_mm" in impls:
        if ok_g:
            R.run("torch_grouped_mm", lambda: B.torch_grouped_mm(*args, **kw))
        else:
            R.fail("torch_grouped_mm", why_g)
    for name, sp in (("mokgen", None), ("mokgen_fp8", "fp8")):
        if name not in impls:
            continue
        try:
            import mokgen

            moe = mokgen.compile(spec_as(spec, "bf16" if sp is None else sp))
            R.run(name, lambda m=moe: m(inp["x"], inp["topk_idx"], inp["topk_weight"], inp["w1"], inp["w2"],
                                        inp["b1"], inp["b2"]))
            if name in R.results and R.results[name]["error"] is None:
                R.results[name]["plan"] = BF.plan_source(moe, None)
            moe.check_errors()
        except Exception as e:  # noqa: BLE001
            R.fail(name, e)
            R.timed.pop(name, None)
        finally:
            moe = None
    if "torch_fp8_grouped_mm" in impls:
        R.run("torch_fp8_grouped_mm", lambda: B.torch_fp8_grouped_mm(*args, **kw, emulate=emulate))
    if "torch_fp8_grouped_mm_prequant" in impls:
        try:
            wq = B.quantize_weights_fp8(inp["w1"], inp["w2"])
            R.run("torch_fp8_grouped_mm_prequant",
                  lambda: B.torch_fp8_grouped_mm(*args, **kw, prequantized=wq, emulate=emulate))
        except Exception as e:  # noqa: BLE001
            R.fail("torch_fp8_grouped_mm_prequant", e)
    if "torch_fp8_grouped_mm_fast_accum" in impls:
        R.run("torch_fp8_grouped_mm_fast_accum",
              lambda: B.torch_fp8_grouped_mm(*args, **kw, use_fast_accum=True, emulate=emulate))
    if "torch_fp8_gemm_only" in impls:
        try:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed + 11)
            g_inp = B.prepare_fp8_gemm_only(inp["x"], inp["topk_idx"], inp["w1"], inp["w2"], spec, generator=gen)
            R.run("torch_fp8_gemm_only", lambda g=g_inp: B.torch_fp8_gemm_only(g, emulate=emulate), check=False)
            if "torch_fp8_gemm_only" in R.results:
                R.results["torch_fp8_gemm_only"]["note"] = (
                    f"{g_inp.a1.shape[0]} padded rows for {dims['rows']} (groups padded to {B.FP8_GROUP_ALIGN})")
        except Exception as e:  # noqa: BLE001
            R.fail("torch_fp8_gemm_only", e)
    if "torchao_fp8" in impls:
        if torchao[0]:
            R.run("torchao_fp8", lambda: B.torchao_fp8_grouped_mm(*args, **kw))
        else:
            R.fail("torchao_fp8", torchao[1])
    R.more_rounds()
    order = [i for i in IMPLS if i in R.results]
    return _finish(ctx, shape, dims, flops, R.results, order, timer)


def bench_dense(n, impls, ctx, timer, device) -> list[dict[str, Any]]:
    gen = torch.Generator(device=device)
    gen.manual_seed(1)
    a = torch.randn(n, n, device=device, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, n, device=device, generator=gen).to(torch.bfloat16)
    emulate = device.type != "cuda"
    dims, flops = dict(M=n, N=n, K=n), 2 * n ** 3
    shape = f"dense-{n}"
    R = _Runner(shape, flops, timer, (a.float() @ b.float()), 1)
    if "dense_mm" in impls:
        R.run("dense_mm", lambda: B.dense_mm(a, b))
    try:
        d = B.prepare_dense_fp8(a, b)
        if "dense_fp8_mm" in impls:
            R.run("dense_fp8_mm", lambda: B.dense_fp8_mm(d, emulate=emulate))
        if "dense_fp8_mm_fast_accum" in impls:
            R.run("dense_fp8_mm_fast_accum", lambda: B.dense_fp8_mm(d, use_fast_accum=True, emulate=emulate))
    except Exception as e:  # noqa: BLE001
        R.fail("dense_fp8_mm", e)
    res = R.results
    recs = []
    base = res.get("dense_mm", {}).get("ms")
    for i in [x for x in DENSE if x in res]:
        r = res[i]
        rec = BF._record(ctx, shape, dims, i, r["ms"], flops, None, r["err"], r["det"], r["error"])
        rec["dtype"] = _dtype(i)
        rec["speedup_vs_bf16"] = (base / r["ms"]) if (base and r["ms"]) else None
        rec["speedup_vs_torch_fp8"] = None
        rec["rel_err_vs_bf16"] = None
        rec["timing"] = timer.method
        recs.append(rec)
    return recs


# ---------------------------------------------------------------------------------------------------------
# --backward: forward + backward of the layer


def bench_backward_shape(spec, ctx, timer, device, seed: int, torchao=(False, "not probed"),
                         impls=None, rounds: int = 1) -> list[dict[str, Any]]:
    """Forward + backward rows of one shape: every implementation in ``impls`` (default :data:`BACKWARD_IMPLS`)
    under autograd on the same inputs and upstream gradient, timed ``rounds`` times interleaved (the median
    recorded); gradients against torch_grouped_mm's bf16 ones (``grad_rel_errs``); ``speedup_vs_bf16`` against
    mokgen BF16's fb_ms where that row ran (else torch_grouped_mm's), ``speedup_vs_torch_fp8`` against
    torch_fp8_grouped_mm's, both measured here."""
    shape, dims, flops = spec.name, BF.spec_dims(spec), 3 * BF.spec_flops(spec)
    emulate = device.type != "cuda"
    impls = list(BACKWARD_IMPLS if impls is None else impls)
    inp = BF.make_inputs(spec, device, seed=seed)
    names = ["x", "topk_weight", "w1", "w2"] + (["b1", "b2"] if dims["bias"] else [])
    leaves = {n: inp[n].detach().clone().requires_grad_(True) for n in names}
    gen = torch.Generator(device=device)
    gen.manual_seed(seed + 5)
    dy = torch.randn(inp["x"].shape, device=device, generator=gen).to(torch.bfloat16)
    compiled: dict[str, Any] = {}

    def mokgen_fn(impl):
        import mokgen

        if impl not in compiled:   # compiled (or loaded from the cache) once per shape, outside the timing
            compiled[impl] = mokgen.compile(spec_as(spec, "bf16" if impl == "mokgen" else "fp8"))
        moe = compiled[impl]
        return lambda a, **k: mokgen.moe_forward(*a[:5], k.get("b1"), k.get("b2"), moe=moe)

    fns = {
        "torch_grouped_mm": lambda a, **k: B.torch_grouped_mm(*a, **k),
        "torch_fp8_grouped_mm": lambda a, **k: B.torch_fp8_grouped_mm_train(*a, **k, wgrad="fp8", emulate=emulate),
        "torch_fp8_grouped_mm[wgrad=bf16]": lambda a, **k: B.torch_fp8_grouped_mm_train(*a, **k, wgrad="bf16",
                                                                                          emulate=emulate),
        "torchao_fp8": lambda a, **k: B.torchao_fp8_grouped_mm(*a, **k),
    }

    def step(fn):
        for t in leaves.values():
            t.grad = None
        a = (leaves["x"], inp["topk_idx"], leaves["topk_weight"], leaves["w1"], leaves["w2"], spec)
        y = fn(a, b1=leaves.get("b1"), b2=leaves.get("b2"))
        y.backward(dy)
        return [leaves[n].grad for n in names]

    res: dict[str, dict[str, Any]] = {}
    timed: dict[str, Callable[[], Any]] = {}
    base_grads = None
    for impl in impls:
        try:
            if impl == "torch_grouped_mm" and not B.grouped_mm_available(device)[0]:
                raise RuntimeError(B.grouped_mm_available(device)[1])
            if impl == "torchao_fp8" and not torchao[0]:
                raise RuntimeError(torchao[1])
            fn = mokgen_fn(impl) if impl.startswith("mokgen") else fns[impl]
            with torch.enable_grad():
                g1 = [t.clone() for t in step(fn)]
                det = BF.bitwise_equal(g1, step(fn))
                ms = timer(lambda fn=fn: step(fn))
            if impl in compiled:
                compiled[impl].check_errors()
            if impl == "torch_grouped_mm":
                base_grads = g1
            errs = {n: BF.rel_err(a, b) for n, a, b in zip(names, g1, base_grads)} if base_grads else None
            res[impl] = dict(ms=ms, rounds=[ms], det=det, errs=errs, error=None)
            timed[impl] = fn
            _log(f"[{shape}] fwd+bwd {impl}: {ms:.4f} ms  grad_rel_errs vs bf16 {errs}")
        except Exception as e:  # noqa: BLE001
            res[impl] = dict(ms=None, det=None, errs=None, error=_short_error(e))
            _log(f"[{shape}] fwd+bwd {impl}: FAILED {_short_error(e)}")
            if os.environ.get("MOKGEN_BENCH_TRACEBACK"):
                traceback.print_exc()
    def time_once(impl, fn):
        with torch.enable_grad():
            res[impl]["rounds"].append(timer(lambda: step(fn)))

    def void(impl, msg):
        res[impl] = dict(ms=None, det=None, errs=None, error=msg)

    BF.interleaved_rounds(timed, rounds, time_once, void)
    for impl in timed:
        res[impl]["ms"] = statistics.median(res[impl]["rounds"])
    base = res.get("torch_grouped_mm", {}).get("ms")
    bf16 = res.get("mokgen", {}).get("ms") or base
    fp8 = res.get("torch_fp8_grouped_mm", {}).get("ms")
    recs = []
    for impl in impls:
        r = res[impl]
        ms = r["ms"]
        rec = BF._record(ctx, shape, dims, impl, ms, flops, base, None, r["det"], r["error"])
        rec.update({"pass": "fwd+bwd", "fb_ms": ms, "dtype": _dtype(impl),
                    "speedup_vs_bf16": (bf16 / ms) if (ms and bf16) else None,
                    "bf16_ref": "mokgen" if res.get("mokgen", {}).get("ms") else "torch_grouped_mm",
                    "speedup_vs_torch_fp8": (fp8 / ms) if (ms and fp8) else None, "rel_err_vs_bf16": None,
                    "grad_rel_errs": r["errs"], "grad_rel_err": max(r["errs"].values()) if r["errs"] else None,
                    "timing": timer.method})
        if len(r.get("rounds") or ()) > 1:
            rec["round_ms"] = r["rounds"]
        if impl.startswith("torch_fp8"):
            rec["note"] = ("FP8 dgrad; " + ("FP8 wgrad (_scaled_grouped_mm 2Dx2D)" if "bf16" not in impl
                                            else "bf16 wgrad (torch._grouped_mm 2Dx2D)"))
        if impl in compiled:
            rec["plan"] = BF.plan_source(compiled[impl], None)
        recs.append(rec)
    return recs


# ---------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench_fp8", description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="*", metavar="SPEC", help=f"preset names or YAML paths (default: "
                    f"{' '.join(DEFAULT_SPECS)}; with --dry-run: tiny made-up specs)")
    ap.add_argument("--tokens", type=int, default=None, help="override T for every shape")
    ap.add_argument("--out", default=None, help=f"JSON list the records are appended to (default {DEFAULT_OUT}; "
                    f"with --dry-run: nothing); '-' writes nothing")
    ap.add_argument("--impls", default=None, help=f"comma-separated subset of {','.join(IMPLS)}")
    ap.add_argument("--no-mokgen", action="store_true", help="skip mokgen and mokgen_fp8")
    ap.add_argument("--no-dense", action="store_true", help="skip the dense ceilings")
    ap.add_argument("--dense-size", type=int, default=None, help="dense matmul size (default 8192; 256 dry-run)")
    ap.add_argument("--backward", action="store_true", help="also forward+backward rows (torch bf16, torch FP8 "
                    "with FP8 / bf16 wgrad, torchao, mokgen and mokgen_fp8 where in --impls)")
    ap.add_argument("--torchao-wheel", default=None, help="a torchao wheel to unpack and import (no pip install)")
    ap.add_argument("--warmup-ms", type=float, default=25.0)
    ap.add_argument("--rep-ms", type=float, default=100.0)
    ap.add_argument("--rounds", type=int, default=1, help="interleaved timing rounds, median recorded")
    ap.add_argument("--settle-s", type=float, default=0.0, help="run each implementation back to back this many "
                    "seconds before each timing (its own sustained clock regime; bench_backward's --settle-s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny specs, FP8 GEMMs emulated")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = BF.pick_device(args.dry_run, "bench_fp8")
    impls = BF.parse_impls(args.impls, IMPLS, "bench_fp8")
    if device is None or impls is None:
        return 2
    if args.no_mokgen:
        impls = [i for i in impls if i not in ("mokgen", "mokgen_fp8")]
    if args.no_dense:
        impls = [i for i in impls if i not in DENSE]
    if device.type == "cpu":
        for i in ("mokgen", "mokgen_fp8"):
            if i in impls:
                _log(f"dry-run: {i} skipped (needs a GPU)")
                impls.remove(i)
    if args.torchao_wheel:
        _log(f"torchao from {args.torchao_wheel}: {use_torchao_wheel(args.torchao_wheel)}")
    torchao = B.torchao_fp8_available(device) if ("torchao_fp8" in impls or args.backward) else (False, "")
    if "torchao_fp8" in impls and not torchao[0]:
        _log(f"torchao_fp8 unavailable: {torchao[1]}")
    srcs: list[Any] = list(args.specs) or (DRY_RUN_SPECS if args.dry_run else DEFAULT_SPECS)
    try:
        specs = [BF.resolve_spec(s, args.tokens) for s in srcs]
    except Exception as e:  # noqa: BLE001
        print(f"bench_fp8: {_short_error(e)}", file=sys.stderr)
        return 2
    if args.settle_s < 0:
        print("bench_fp8: --settle-s must be >= 0", file=sys.stderr)
        return 2
    timer = BF.Timer(device, args.warmup_ms, args.rep_ms, settle_s=args.settle_s)
    ctx = dict(gpu=BF.gpu_name(device), date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               versions=BF.collect_versions())
    try:
        import torchao as _tao  # type: ignore

        ctx["versions"]["torchao"] = getattr(_tao, "__version__", None)
    except Exception:  # noqa: BLE001
        ctx["versions"]["torchao"] = None
    ok_s, why_s = B.scaled_grouped_mm_available(device)
    _log(f"bench_fp8 on {ctx['gpu']}; {timer.method}; versions {ctx['versions']}; impls {impls}; "
         f"_scaled_grouped_mm: {'ok' if ok_s else why_s}")
    records: list[dict[str, Any]] = []
    shape_impls = [i for i in impls if i not in DENSE]
    t0 = time.perf_counter()
    with torch.no_grad():
        for k, spec in enumerate(specs):
            if shape_impls:
                records += bench_shape(spec, shape_impls, ctx, timer, device, args.seed + k, max(1, args.rounds),
                                       torchao=torchao)
                BF._free(device)
            if args.backward:
                records += bench_backward_shape(spec, ctx, timer, device, args.seed + k, torchao=torchao,
                                                rounds=max(1, args.rounds),
                                                impls=[i for i in BACKWARD_IMPLS
                                                       if i in impls or i.startswith("torch_")])
                BF._free(device)
        if any(i in impls for i in DENSE):
            n = args.dense_size or (256 if device.type == "cpu" else 8192)
            records += bench_dense(n, impls, ctx, timer, device)
            BF._free(device)
    _log(f"total {time.perf_counter() - t0:.1f}s")
    print_table(records, f"MoE FP8, {ctx['gpu']} ({timer.method})")
    out = args.out if args.out is not None else ("-" if args.dry_run else BF.default_out("fp8", device))
    if out != "-":
        BF.append_records(out, records)
        _log(f"appended {len(records)} records to {out}")
    return 0


def print_table(records, title) -> None:
    header = ["shape", "impl", "pass", "median_ms", "TFLOP/s", "vs bf16", "vs torch fp8", "rel_err", "vs bf16 out"]
    rows = []
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    for r in records:
        if r.get("error"):
            rows.append([r["shape"], r["impl"], r.get("pass", "fwd"), "ERROR", r["error"][:60], "", "", "", ""])
            continue
        rows.append([r["shape"], r["impl"], r.get("pass", "fwd"), f(r["median_ms"], ".4f"), f(r["tflops"], ".1f"),
                     f(r["speedup_vs_bf16"], ".2f"), f(r["speedup_vs_torch_fp8"], ".2f"),
                     f(r["rel_err"] if r["rel_err"] is not None else r.get("grad_rel_err"), ".2e"),
                     f(r["rel_err_vs_bf16"], ".2e")])
    BF.render_table(title, header, rows, width=140)


if __name__ == "__main__":
    sys.exit(main())
