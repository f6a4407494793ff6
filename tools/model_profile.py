#!/usr/bin/env python
"""Where bench_model's training step goes, per implementation, and what the model's own routing costs the experts:

    python tools/model_profile.py [--impls grouped_mm,mokgen] [--warm-steps 10] [--steps 3] [--json OUT] [--dry-run]
                                  [bench_model's model options: --hidden --layers --experts --topk ...]

The model, data and optimizer are bench_model's (tools/bench_model.py: a Qwen3-MoE-shaped causal LM, AdamW).
For each implementation: ``--warm-steps`` training steps, then ``--steps`` steps under torch.profiler, and per step
(mean over the recorded steps) the GPU wall time (first kernel start to last kernel end), the kernel time summed by
class (the experts' own kernels, attention, other GEMMs, the optimizer, everything else) and the idle time between
kernels; the largest kernels by time. The experts' kernel class: mokgen's generated kernels (CuTe DSL names) for
``mokgen``; for ``grouped_mm`` torch's grouped GEMM and the elementwise / index / sort kernels of transformers'
grouped_mm backend cannot be told apart from the rest of the model by name, so only the GEMMs are classed.

The routing the model's router produces (its first MoE layer, last profiled step): rows per expert (max / mean,
the coefficient of variation) against the uniform routing that ``bench_backward`` uses. Then the first MoE layer's
experts module alone, forward + backward (``triton.testing.do_bench``, a fixed random output gradient; gradients
for x and the expert weights, none for the captured routing weights, for both backends alike), on the
model's routing and on uniform random routing with the same T and top-k: what a skewed router costs each backend.

One JSON line per implementation (``--json``; ``-`` or omitted: none). ``--dry-run``: CPU, bench_model's tiny dims,
mokgen on its reference kernels, no profiler classes (keeps the script from rotting; tests/test_bench_model.py).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path
from typing import Any

_TOOLS = Path(__file__).resolve().parent
if str(_TOOLS) not in sys.path:
    sys.path.insert(0, str(_TOOLS))

import bench_model as BM  # noqa: E402  (puts the repository root on sys.path too)
import torch  # noqa: E402

BF = BM.BF
CLASSES = ("experts", "attention", "gemm", "optimizer", "other")


def kernel_class(name: str, impl: str) -> str:
    n = name.lower()
    if "kernel_cutlass" in n:      # the CuTe DSL kernels: only mokgen's generated ones run in this model
        return "experts"
    if impl == "grouped_mm" and "grouped" in n:
        return "experts"
    if "multi_tensor" in n or "adam" in n:
        return "optimizer"
    if "flash" in n or "fmha" in n or "attention" in n or "sdpa" in n:
        return "attention"
    if "gemm" in n or "nvjet" in n or "xmma" in n or "cublas" in n or "sm90_" in n:
        return "gemm"
    return "other"


def _annotation(e: Any) -> bool:
    """A profiler range on the GPU timeline that is not a kernel (e.g. ``Optimizer.step#AdamW.step``)."""
    return bool(getattr(e, "is_user_annotation", False)) or e.name.startswith(("Optimizer.", "ProfilerStep"))


def _capture_routing(model: torch.nn.Module) -> tuple[dict[str, Any], Any]:
    """A forward pre-hook on the first MoE layer's experts module keeping its last call's inputs."""
    experts = model.model.layers[0].mlp.experts
    box: dict[str, Any] = {}

    def hook(_mod, args, kwargs):
        vals = list(args) + [kwargs[k] for k in ("hidden_states", "top_k_index", "top_k_weights") if k in kwargs]
        box["inputs"] = tuple(v.detach() for v in vals[:3])

    return box, experts.register_forward_pre_hook(hook, with_kwargs=True)


def routing_stats(idx: torch.Tensor, experts: int) -> dict[str, float]:
    counts = torch.bincount(idx.reshape(-1).long().clamp(0, experts - 1), minlength=experts).float()
    mean = counts.mean()
    return dict(rows_max=float(counts.max()), rows_min=float(counts.min()), rows_mean=float(mean),
                max_over_mean=float(counts.max() / mean), cv=float(counts.std() / mean),
                experts_empty=int((counts == 0).sum()))


def _layer_fb_ms(experts: torch.nn.Module, hs: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                 device: torch.device) -> float:
    x = hs.clone().requires_grad_(True)
    g = torch.randn(hs.shape, generator=torch.Generator(device="cpu").manual_seed(7)).to(device, hs.dtype)

    def step():
        y = experts(x, idx, w)
        y.backward(g)
        x.grad = None
        for p in experts.parameters():
            p.grad = None

    if device.type != "cuda":
        step()
        return float("nan")
    import triton.testing

    return float(triton.testing.do_bench(step, warmup=10, rep=60))


def profile_impl(impl: str, a: argparse.Namespace, cfg: Any, data: list[torch.Tensor],
                 device: torch.device) -> dict[str, Any]:
    model = BM.build_model(cfg, device, a.seed, impl)
    if impl == "mokgen":
        import mokgen.integrations.transformers as mt

        mt.configure(tokens=a.batch * a.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0,
                            **({"fused": True} if device.type == "cuda" else {}))
    box, handle = _capture_routing(model)

    def train_step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    n_warm, n_prof = a.warm_steps, a.steps
    for i in range(n_warm):
        train_step(data[i % len(data)])
    rec: dict[str, Any] = dict(impl=impl)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for i in range(n_prof):
                train_step(data[(n_warm + i) % len(data)])
            torch.cuda.synchronize(device)
        evs = [e for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")
               and e.time_range.end > e.time_range.start and not _annotation(e)]
        evs.sort(key=lambda e: e.time_range.start)
        start, end = evs[0].time_range.start, evs[-1].time_range.end
        by_class = dict.fromkeys(CLASSES, 0.0)
        by_name: dict[str, float] = {}
        busy, last, prev, gaps = 0.0, start, "", []
        for e in evs:
            s, t = e.time_range.start, e.time_range.end
            d = t - s
            if s > last:
                gaps.append((s - last, (last - start) * 1e-3, prev[:40], e.name[:40]))
            prev = e.name if t >= last else prev
            by_class[kernel_class(e.name, impl)] += d
            key = e.name[:60]
            by_name[key] = by_name.get(key, 0.0) + d
            busy += max(0.0, t - max(s, last))   # union of kernel intervals (overlapping streams)
            last = max(last, t)
        ms = 1e-3 / n_prof
        rec.update(wall_ms=(end - start) * ms, busy_ms=busy * ms, idle_ms=(end - start - busy) * ms,
                   class_ms={k: v * ms for k, v in by_class.items()},
                   top_kernels=[(k, v * ms) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:15]],
                   # the largest idle gaps over the recorded steps: (us, ms from the first kernel, before, after)
                   largest_gaps=[(round(g, 1), round(at, 3), a_, b_) for g, at, a_, b_ in sorted(gaps)[::-1][:12]],
                   gaps_over_50us=dict(count=sum(1 for g in gaps if g[0] > 50) / n_prof,
                                       ms=sum(g[0] for g in gaps if g[0] > 50) * ms))
    handle.remove()
    hs, idx, w = box["inputs"]
    rec["routing"] = routing_stats(idx, a.experts)
    experts = model.model.layers[0].mlp.experts
    g = torch.Generator(device="cpu").manual_seed(11)
    uni = torch.stack([torch.randperm(a.experts, generator=g)[:a.topk] for _ in range(idx.shape[0])]).to(device)
    uni = uni.to(idx.dtype)
    rec["layer_fb_ms"] = dict(model_routing=_layer_fb_ms(experts, hs, idx, w, device),
                              uniform_routing=_layer_fb_ms(experts, hs, uni, w, device))
    rec["routing_uniform"] = routing_stats(uni, a.experts)
    model = opt = None   # dropped before the next implementation is built
    BF._free(device)
    return rec


def build_parser() -> argparse.ArgumentParser:
    ap = BM.build_parser()
    ap.prog, ap.description = "model_profile", __doc__.splitlines()[0]
    ap.add_argument("--warm-steps", type=int, default=10, help="training steps before the profiled ones")
    ap.add_argument("--json", default=None, help="JSON lines appended here (one per implementation)")
    ap.set_defaults(impls="grouped_mm,mokgen")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    full = dict(hidden=2048, layers=4, experts=128, topk=8, moe_intermediate=768, vocab=8192, batch=4, seq=1024,
                steps=3, warmup_steps=0)
    for k, v in (BM.DRY if a.dry_run else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    device = BF.pick_device(a.dry_run, "model_profile")
    impls = BF.parse_impls(a.impls, ["grouped_mm", "mokgen"], "model_profile")
    if device is None or impls is None:
        return 2
    if "mokgen" in impls:
        import mokgen.integrations.transformers as mt   # importing it registers the "mokgen" experts backend

        if device.type == "cpu":
            mt.set_compiler(mt.reference_compiler())
    cfg = BM.model_config(a)
    a_data = argparse.Namespace(**{**vars(a), "steps": a.warm_steps + a.steps})
    data = BM.batches(a_data, device)
    ctx = dict(gpu=BF.gpu_name(device), date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               versions=BF.collect_versions(), tokens=a.batch * a.seq,
               dims=dict(hidden=a.hidden, layers=a.layers, experts=a.experts, topk=a.topk,
                         moe_intermediate=a.moe_intermediate, vocab=a.vocab))
    recs = []
    for impl in impls:
        rec = {**ctx, **profile_impl(impl, a, cfg, data, device)}
        recs.append(rec)
        r, lf = rec["routing"], rec["layer_fb_ms"]
        print(f"{impl:11s} routing rows/expert max {r['rows_max']:.0f} mean {r['rows_mean']:.0f} "
              f"(max/mean {r['max_over_mean']:.2f}, cv {r['cv']:.2f}, empty {r['experts_empty']}); "
              f"layer-0 experts f+b: model routing {lf['model_routing']:.3f} ms, uniform {lf['uniform_routing']:.3f}")
        if "wall_ms" in rec:
            cls = "  ".join(f"{k} {v:.2f}" for k, v in rec["class_ms"].items())
            print(f"{'':11s} step wall {rec['wall_ms']:.2f} ms busy {rec['busy_ms']:.2f} idle {rec['idle_ms']:.2f}; {cls}")
            for name, ms in rec["top_kernels"][:10]:
                print(f"{'':13s}{ms:8.3f} ms  {name}")
            go = rec["gaps_over_50us"]
            print(f"{'':11s} gaps > 50 us per step: {go['count']:.1f}, {go['ms']:.2f} ms; largest (us, at ms, between):")
            for g in rec["largest_gaps"][:8]:
                print(f"{'':13s}{g}")
    if a.json and a.json != "-":
        with open(a.json, "a") as f:
            for rec in recs:
                f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
