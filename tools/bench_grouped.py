#!/usr/bin/env python
"""Benchmark of mokgen's grouped-experts op (``mokgen.integrations.grouped``) against ``torch._grouped_mm`` on the
same rows sorted by expert, forward and forward + backward under autograd.

    python tools/bench_grouped.py [SPEC ...] [--tokens N] [--rounds N] [--no-probs] [--impls ...]
                                  [--out bench/results/grouped-<gpu>.json] [--dry-run]

Shapes: each spec's per-rank layer seen as a framework's experts call: ``N = tokens * topk`` rows sorted by
expert, ``E`` = the local experts, counts from a balanced random top-k routing (``bench_forward.make_inputs``),
the spec's activation, layout and biases; shared experts are left out (frameworks run them apart). Inputs:
x [N, H] N(0, 1) bf16, per-row probs in (0, 1) (``--no-probs``: none), dy [N, H] N(0, 1) bf16.

Implementations (leaves: x, probs, the weights, the biases):

- ``mokgen``: ``grouped_experts(x, counts, w1 [E, 2I, H], w2 [E, H, I], probs)`` (counts on the device);
- ``mokgen_fp8``: the same call on the op's FP8 kernels (Hopper's blockwise e4m3: the spec's ``dtype: fp8`` twin,
  passed as ``moe=``; what ``configure(dtype="fp8")`` selects), with ``speedup_vs_bf16`` = mokgen's f+b time over
  this one's;
- ``torch_grouped_mm``: ``h = torch._grouped_mm(x, w1^T, offs)`` (+ b1), the activation, ``torch._grouped_mm(a,
  w2^T, offs)`` (+ b2), times probs: the two-GEMM pipeline on the same rows and weights (offs = int32 cumsum);
- ``mokgen_torchtitan`` and ``torchtitan_grouped_mm`` (concat SwiGLU without biases only): torchtitan's
  GroupedExperts call, ``x, num_tokens_per_expert`` with w1 / w3 / w2 as three parameters and no probs:
  mokgen's adapter (``mokgen.integrations.torchtitan.experts_forward``, which copies cat(w1, w3) per call)
  against torchtitan's own three ``torch._grouped_mm`` calls (the same code as its GroupedExperts.forward).

``speedup`` is the baseline's time over this one's, same process: mokgen vs torch_grouped_mm, mokgen_torchtitan
vs torchtitan_grouped_mm. Records (APPENDED to ``--out``, one per shape and implementation) carry gpu, date,
versions, shape, dims (N, E, H, I, activation, ...), impl, baseline, ``fwd_ms`` and ``fb_ms`` (medians,
``bench_forward.Timer``), ``tflops`` (3 x forward FLOPs = 2 N 3 H I each, over fb_ms), ``speedup``,
``rel_err`` (y) and ``grad_rel_errs`` / ``grad_rel_err`` (each leaf's gradient, the worst) against
``mokgen.reference`` in float64 (float32 where float64 would not fit) on the device, ``bitwise_deterministic`` (y
and every gradient of two runs), ``peak_mem_mb`` over one forward + backward. ``--dry-run``: the CPU, a tiny
shape, mokgen on its reference kernels (``grouped.set_compiler(reference_compiler())``); nothing is written
unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
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

import bench_backward as BB  # noqa: E402  (puts the repository root on sys.path too)
import bench_forward as BF  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mokgen import baselines as B  # noqa: E402
from mokgen import reference as ref  # noqa: E402

DEFAULT_SPECS = ["qwen3-30b-a3b", "gpt-oss-120b", "kimi-k2", "glm-5"]
DRY_RUN_SPECS: list[dict[str, Any]] = [
    dict(name="tiny", hidden=128, ffn=64, experts=8, topk=2, tokens=64, activation="swiglu", bias=False),
    dict(name="tiny-oai", hidden=64, ffn=64, experts=4, topk=2, tokens=48, activation="swiglu_oai",
         gate_up_layout="interleaved", bias=True),
]
DEFAULT_OUT = f"{BF.RESULTS_DIR}/grouped-<gpu>.json"   # BF.default_out: the GPU's own file
IMPLS = ["mokgen", "mokgen_fp8", "torch_grouped_mm", "mokgen_torchtitan", "torchtitan_grouped_mm"]
BASELINE = {"mokgen": "torch_grouped_mm", "mokgen_fp8": "torch_grouped_mm",
            "mokgen_torchtitan": "torchtitan_grouped_mm"}
_log = BF._log
_short_error = BF._short_error


def grouped_case(spec, device: torch.device, seed: int, probs: bool) -> dict[str, Any]:
    """Sorted rows, counts and weights of one spec's per-rank experts (no shared experts)."""
    inp = BF.make_inputs(spec, device, seed=seed)
    L = B._local_experts(spec)
    flat = inp["topk_idx"].reshape(-1).long()
    counts = torch.zeros(L, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    N = flat.numel()
    gen = torch.Generator(device=device)
    gen.manual_seed(seed + 7)
    x = torch.randn(N, spec.hidden, device=device, generator=gen).to(torch.bfloat16)
    dy = torch.randn(N, spec.hidden, device=device, generator=gen).to(torch.bfloat16)
    p = (torch.rand(N, device=device, generator=gen) * 0.9 + 0.05) if probs else None
    return dict(x=x, counts=counts, probs=p, w1=inp["w1"][:L].contiguous(), w2=inp["w2"][:L].contiguous(),
                b1=None if inp["b1"] is None else inp["b1"][:L].contiguous(),
                b2=None if inp["b2"] is None else inp["b2"][:L].contiguous(), dy=dy, N=N, E=L)


def torch_grouped(x, counts, w1, w2, probs, b1, b2, spec) -> torch.Tensor:
    """The two-GEMM pipeline on sorted rows: grouped_mm, bias, activation, grouped_mm, bias, probs."""
    offs = torch.cumsum(counts, 0).to(torch.int32)
    h = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
    if b1 is not None or b2 is not None:
        sorted_e = torch.searchsorted(offs.long(), torch.arange(x.shape[0], device=x.device), right=True)
    if b1 is not None:
        h = h.float() + b1.index_select(0, sorted_e)
    g, u = B.split_gate_up(h, spec.gate_up_layout)
    a = B.activation(g, u, spec).to(x.dtype)
    o = torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs)
    if b2 is not None:
        o = o.float() + b2.index_select(0, sorted_e)
    if probs is not None:
        o = o * probs[:, None]
    return o.to(x.dtype)


def torchtitan_grouped(x, counts, w1g, w3u, w2d) -> torch.Tensor:
    """torchtitan 0.3.0's GroupedExperts.forward: silu(x W1^T) * (x W3^T), then W2^T, three grouped_mm calls."""
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    h = F.silu(torch._grouped_mm(x.bfloat16(), w1g.bfloat16().transpose(-2, -1), offs=offs))
    h = h * torch._grouped_mm(x.bfloat16(), w3u.bfloat16().transpose(-2, -1), offs=offs)
    return torch._grouped_mm(h, w2d.bfloat16().transpose(-2, -1), offs=offs).type_as(x)


class _TitanExperts(torch.nn.Module):
    """torchtitan 0.3.0's GroupedExperts parameters (w1_EFD gate, w2_EDF down, w3_EFD up) around given tensors."""

    def __init__(self, gate, down, up):
        super().__init__()
        self.w1_EFD, self.w2_EDF, self.w3_EFD = gate, down, up


def bench_shape(spec, impls: list[str], ctx: dict[str, Any], timer: "BF.Timer", device: torch.device, seed: int,
                probs: bool, rounds: int, ref_dtype: str) -> list[dict[str, Any]]:
    from mokgen.integrations import grouped as G
    from mokgen.integrations import torchtitan as mtt

    c = grouped_case(spec, device, seed, probs)
    N, E, H, I = c["N"], c["E"], spec.hidden, spec.ffn

    def op_spec(dtype: str | None = None):   # the op's spec for these rows (dtype None: configure's)
        return G.grouped_spec(H, I, E, activation=spec.activation, swiglu_limit=spec.swiglu_limit,
                              gate_up_layout=spec.gate_up_layout, bias=spec.bias, tokens=min(N, 1 << 20), dtype=dtype)

    gspec = op_spec()
    dims = dict(N=N, E=E, H=H, I=I, activation=spec.activation, swiglu_limit=spec.swiglu_limit,
                gate_up_layout=spec.gate_up_layout, bias=bool(spec.bias), probs=probs,
                counts_min=int(c["counts"].min()), counts_max=int(c["counts"].max()))
    flops = 2 * N * 3 * H * I
    _log(f"[{spec.name}] N={N} E={E} H={H} I={I} {spec.activation}/{spec.gate_up_layout}"
         f"{' bias' if spec.bias else ''}{' probs' if probs else ''} counts {dims['counts_min']}..{dims['counts_max']}")
    titan_ok = spec.activation == "swiglu" and spec.swiglu_limit is None and spec.gate_up_layout == "concat" \
        and not spec.bias
    idx = G.expert_ids(c["counts"], N, device)
    ones = torch.ones(N, 1, device=device)

    def reference(with_probs: bool):
        tw = c["probs"].reshape(N, 1) if (with_probs and c["probs"] is not None) else ones
        inp = dict(x=c["x"], topk_idx=idx, topk_weight=tw, w1=c["w1"], w2=c["w2"], b1=c["b1"], b2=c["b2"])
        rdt = BB.pick_ref_dtype(gspec, device, ref_dtype)
        y, g = BB.reference_grads(gspec, inp, c["dy"], rdt)
        return y, g, f"mokgen.reference {str(rdt).replace('torch.', '')} on {device.type}"

    results: dict[str, dict[str, Any]] = {}
    timed: dict[str, tuple[Callable, Callable]] = {}

    def run(impl: str, leaves: dict[str, torch.Tensor | None], fwd: Callable[[], torch.Tensor], refs) -> None:
        live = {n: t for n, t in leaves.items() if t is not None}

        def clear():
            for t in live.values():
                t.grad = None

        def step():
            clear()
            fwd().backward(c["dy"])

        res: dict[str, Any] = dict(error=None)
        results[impl] = res
        try:
            y_ref, g_ref, how = refs
            outs = []
            for _ in range(2):
                clear()
                y = fwd()
                y.backward(c["dy"])
                outs.append([y.detach()] + [live[n].grad for n in live])
            if device.type == "cuda":
                torch.cuda.synchronize()
            res["det"] = BF.bitwise_equal(outs[0], outs[1])
            res["rel_err"] = ref.rel_err(outs[0][0].float(), y_ref)
            errs = {}
            for n, gr in zip(live, outs[0][1:]):
                r = g_ref[n] if isinstance(g_ref, dict) else getattr(g_ref, n)
                e = ref.rel_err(gr.float(), r.reshape(gr.shape).float())
                errs[n] = e if math.isfinite(e) else None
            res["grad_rel_errs"], res["ref"] = errs, how
            res["grad_rel_err"] = None if any(v is None for v in errs.values()) else max(errs.values())
            del outs
            if device.type == "cuda":
                clear()
                BF._free(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
                step()
                torch.cuda.synchronize()
                res["peak_mem_mb"] = (torch.cuda.max_memory_allocated(device) - base) / 2 ** 20
            clear()
            res["fwd_rounds"], res["rounds"] = [timer(fwd)], [timer(step)]
            timed[impl] = (fwd, step)
            _log(f"[{spec.name}] {impl}: fwd {res['fwd_rounds'][0]:.4f} ms  f+b {res['rounds'][0]:.4f} ms  "
                 f"rel_err {res['rel_err']:.2e}  grad {res['grad_rel_err']}  det={res['det']}")
        except Exception as e:  # noqa: BLE001 - record and go on
            results[impl] = dict(error=_short_error(e))
            _log(f"[{spec.name}] {impl}: FAILED {_short_error(e)}")
            if os.environ.get("MOKGEN_BENCH_TRACEBACK"):
                traceback.print_exc()
        finally:
            clear()

    def leaves_of(with_probs: bool) -> dict[str, torch.Tensor | None]:
        return dict(x=c["x"].requires_grad_(True),
                    topk_weight=c["probs"].requires_grad_(True) if (with_probs and c["probs"] is not None) else None,
                    w1=c["w1"].requires_grad_(True), w2=c["w2"].requires_grad_(True),
                    b1=None if c["b1"] is None else c["b1"].requires_grad_(True),
                    b2=None if c["b2"] is None else c["b2"].requires_grad_(True))

    if {"mokgen", "mokgen_fp8", "torch_grouped_mm"} & set(impls):
        refs = reference(True)
        lv = leaves_of(True)
        p = lv["topk_weight"]
        if "torch_grouped_mm" in impls:
            def tgm(lv=lv, p=p):
                return torch_grouped(lv["x"], c["counts"], lv["w1"], lv["w2"], p, lv["b1"], lv["b2"], spec)

            run("torch_grouped_mm", lv, tgm, refs)
        if "mokgen" in impls:
            def mok(lv=lv, p=p):
                return G.grouped_experts(lv["x"], c["counts"], lv["w1"], lv["w2"], p, lv["b1"], lv["b2"],
                                         activation=spec.activation, swiglu_limit=spec.swiglu_limit,
                                         gate_up_layout=spec.gate_up_layout)

            run("mokgen", lv, mok, refs)
        if "mokgen_fp8" in impls:
            fp8 = None
            try:   # the FP8 twin of the op's spec, passed as moe= (configure(dtype=) would drop the BF16 kernels)
                fp8 = G.compiled_for(op_spec("fp8"))
            except Exception as e:  # noqa: BLE001 - e.g. a width FP8 does not take: recorded, the others go on
                results["mokgen_fp8"] = dict(error=_short_error(e))
                _log(f"[{spec.name}] mokgen_fp8: FAILED {_short_error(e)}")
            if fp8 is not None:
                def mok8(lv=lv, p=p, fp8=fp8):
                    return G.grouped_experts(lv["x"], c["counts"], lv["w1"], lv["w2"], p, lv["b1"], lv["b2"],
                                             activation=spec.activation, swiglu_limit=spec.swiglu_limit,
                                             gate_up_layout=spec.gate_up_layout, moe=fp8)

                run("mokgen_fp8", lv, mok8, refs)
        del refs
    titan = [i for i in ("torchtitan_grouped_mm", "mokgen_torchtitan") if i in impls]
    if titan and not titan_ok:
        _log(f"[{spec.name}] torchtitan: no record (its GroupedExperts computes bias-free concat SwiGLU only)")
    elif titan:
        y_ref, g_ref, how = reference(False)
        gate = c["w1"][:, :I].detach().clone().requires_grad_(True)
        up = c["w1"][:, I:].detach().clone().requires_grad_(True)
        down = c["w2"].detach().clone().requires_grad_(True)
        g_t = {"x": g_ref.x, "w1_EFD": g_ref.w1[:, :I], "w3_EFD": g_ref.w1[:, I:], "w2_EDF": g_ref.w2}
        lv = dict(x=c["x"].requires_grad_(True), w1_EFD=gate, w3_EFD=up, w2_EDF=down)
        module = _TitanExperts(gate, down, up)
        refs = (y_ref, g_t, how)
        if "torchtitan_grouped_mm" in impls:
            run("torchtitan_grouped_mm", lv, lambda lv=lv: torchtitan_grouped(lv["x"], c["counts"], gate, up, down),
                refs)
        if "mokgen_torchtitan" in impls:
            run("mokgen_torchtitan", lv, lambda lv=lv: mtt.experts_forward(module, lv["x"], c["counts"]), refs)
        del refs, g_t, y_ref, g_ref

    for r in range(1, rounds):   # later rounds, interleaved
        for impl, (fwd, step) in list(timed.items()):
            results[impl]["fwd_rounds"].append(timer(fwd))
            results[impl]["rounds"].append(timer(step))
    recs = []
    for impl in [i for i in IMPLS if i in results]:
        res = results[impl]
        fb = BB._median(res["rounds"]) if res.get("rounds") else None
        fwd = BB._median(res["fwd_rounds"]) if res.get("fwd_rounds") else None
        res["fb_ms"], res["fwd_ms"] = fb, fwd
    for impl in [i for i in IMPLS if i in results]:
        res = results[impl]
        base = BASELINE.get(impl)
        base_ms = results.get(base, {}).get("fb_ms") if base else None
        base_fwd = results.get(base, {}).get("fwd_ms") if base else None
        rec = dict(gpu=ctx["gpu"], date=ctx["date"], versions=ctx["versions"], shape=spec.name, dims=dims, impl=impl,
                   baseline=base, fwd_ms=res.get("fwd_ms"), fb_ms=res.get("fb_ms"),
                   tflops=(3 * flops / (res["fb_ms"] * 1e-3) / 1e12) if res.get("fb_ms") else None,
                   speedup=(base_ms / res["fb_ms"]) if (base_ms and res.get("fb_ms")) else None,
                   fwd_speedup=(base_fwd / res["fwd_ms"]) if (base_fwd and res.get("fwd_ms")) else None,
                   rel_err=res.get("rel_err"), grad_rel_err=res.get("grad_rel_err"),
                   grad_rel_errs=res.get("grad_rel_errs"), ref=res.get("ref"),
                   bitwise_deterministic=res.get("det"), peak_mem_mb=res.get("peak_mem_mb"), timing=timer.method)
        if impl == "mokgen_fp8":
            bf = results.get("mokgen", {}).get("fb_ms")
            rec["speedup_vs_bf16"] = (bf / res["fb_ms"]) if (bf and res.get("fb_ms")) else None
        if len(res.get("rounds") or ()) > 1:
            rec["round_ms"], rec["round_fwd_ms"] = res["rounds"], res["fwd_rounds"]
        if res.get("error"):
            rec["error"] = res["error"]
        recs.append(rec)
    for t in (c["x"], c["probs"], c["w1"], c["w2"], c["b1"], c["b2"]):
        if t is not None:
            t.requires_grad_(False)
            t.grad = None
    return recs


def print_table(records: list[dict[str, Any]], title: str) -> None:
    header = ["shape", "impl", "N", "E", "fwd ms", "f+b ms", "TFLOP/s", "speedup", "vs", "y err", "grad err", "det",
              "peak MiB"]

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    rows = []
    for r in records:
        d = r["dims"]
        if r.get("error"):
            rows.append([r["shape"], r["impl"], str(d["N"]), str(d["E"]), "ERROR", r["error"][:60]] + [""] * 7)
            continue
        rows.append([r["shape"], r["impl"], str(d["N"]), str(d["E"]), f(r["fwd_ms"], ".4f"), f(r["fb_ms"], ".4f"),
                     f(r["tflops"], ".1f"), "-" if r["speedup"] is None else f"{r['speedup']:.2f}x",
                     r["baseline"] or "-", f(r["rel_err"], ".2e"), f(r["grad_rel_err"], ".2e"),
                     "-" if r["bitwise_deterministic"] is None else ("yes" if r["bitwise_deterministic"] else "NO"),
                     f(r["peak_mem_mb"], ".0f")])
    BF.render_table(title, header, rows, width=160)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench_grouped", description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="*", metavar="SPEC", help=f"preset names or YAML paths (default: "
                    f"{' '.join(DEFAULT_SPECS)}; --dry-run: tiny made-up shapes)")
    ap.add_argument("--tokens", type=int, default=None, help="override T (rows N = T * topk)")
    ap.add_argument("--out", default=None, help=f"JSON list the records are appended to (default {DEFAULT_OUT}; "
                    "--dry-run: nothing); '-' writes nothing")
    ap.add_argument("--impls", default=None, help=f"comma-separated subset of {','.join(IMPLS)}")
    ap.add_argument("--no-probs", action="store_true", help="no per-row probs for mokgen / torch_grouped_mm")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--ref-dtype", default="auto", choices=["auto", "float64", "float32"])
    ap.add_argument("--warmup-ms", type=float, default=25.0)
    ap.add_argument("--rep-ms", type=float, default=100.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, mokgen on its reference kernels")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = BF.pick_device(args.dry_run, "bench_grouped")
    impls = BF.parse_impls(args.impls, IMPLS, "bench_grouped")
    if device is None or impls is None:
        return 2
    if args.dry_run:
        from mokgen.integrations import grouped as G

        G.set_compiler(G.reference_compiler())
    out = args.out if args.out is not None else ("-" if args.dry_run else BF.default_out("grouped", device))
    ok, why = B.grouped_mm_available(device)
    if not ok:
        for i in ("torch_grouped_mm", "torchtitan_grouped_mm"):
            if i in impls:
                _log(f"{i} skipped ({why})")
                impls.remove(i)
    srcs: list[Any] = list(args.specs) or (DRY_RUN_SPECS if args.dry_run else DEFAULT_SPECS)
    try:
        specs = [BF.resolve_spec(s, args.tokens) for s in srcs]
    except Exception as e:  # noqa: BLE001
        print(f"bench_grouped: {_short_error(e)}", file=sys.stderr)
        return 2
    timer = BF.Timer(device, args.warmup_ms, args.rep_ms)
    ctx = dict(gpu=BF.gpu_name(device), date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               versions=BF.collect_versions())
    _log(f"bench_grouped on {ctx['gpu']}; {timer.method}; versions {ctx['versions']}; impls {impls}")
    records: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for i, spec in enumerate(specs):
        records += bench_shape(spec, impls, ctx, timer, device, args.seed + i, not args.no_probs,
                               max(1, args.rounds), args.ref_dtype)
        BF._free(device)
    _log(f"total {time.perf_counter() - t0:.1f}s")
    print_table(records, f"grouped experts (sorted rows) forward+backward, {ctx['gpu']} ({timer.method})")
    if out != "-":
        BF.append_records(out, records)
        _log(f"appended {len(records)} records to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
