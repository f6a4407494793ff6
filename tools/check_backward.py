#!/usr/bin/env python
"""Check and time mokgen's training step (forward_train + backward) on a GPU, one spec at a time.

    python tools/check_backward.py SPEC[@k=v,...][:T] [...] [--json OUT] [--no-time] [--routing MODE]

For each item: compile (or load) the kernels, draw fresh random inputs, poison the outputs, run the training
forward (its y must equal the inference forward bit for bit) and the backward, compare every gradient with
``mokgen.reference.backward`` in float64 on the GPU, check NaN, check that two runs and a run on half the SMs give
the same bits, and (unless --no-time) time forward+backward with CUDA events (do_bench median) against torch's
grouped_mm pipeline under autograd in the same process. One JSON line per item; a table at the end.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import torch  # noqa: E402

import mokgen  # noqa: E402
from mokgen import baselines as B  # noqa: E402
from mokgen import reference as R  # noqa: E402
from mokgen.plan import parse_overrides  # noqa: E402
from mokgen.spec import load_spec  # noqa: E402

GRADS = ("x", "topk_weight", "w1", "w2", "b1", "b2")


def _item(text: str):
    name, _, tok = text.partition(":")
    name, _, ov = name.partition("@")
    return name, parse_overrides(ov) if ov else {}, int(tok) if tok else None


def _bench(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _profile(fn) -> list:
    """[(kernel name, ms)] of one call, in launch order (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if getattr(e, "device_type", None) is not None
           and str(e.device_type).endswith("CUDA") and (e.device_time_total or 0) > 0]
    evs.sort(key=lambda e: e.time_range.start)
    return [(e.name[:48], round(e.device_time_total / 1000, 4)) for e in evs]


def check(name: str, overrides: dict, tokens: int | None, routing: str, timing: bool) -> dict:
    spec = load_spec(name)
    T = tokens or spec.tokens
    t0 = time.time()
    moe = mokgen.compile(spec, overrides=overrides or None)
    rec = dict(item=f"{name}{'@' + ','.join(f'{k}={v}' for k, v in overrides.items()) if overrides else ''}",
               tokens=T, routing=routing, compile_s=round(time.time() - t0, 1))
    inp = R.random_inputs(spec, T, device="cuda", seed=1234, routing=routing)
    x, idx, tw, w1, w2, b1, b2 = inp
    dy = torch.randn(T, spec.hidden, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()

    y, saved = moe.forward_train(x, idx, tw, w1, w2, b1, b2)
    y_inf = moe(x, idx, tw, w1, w2, b1, b2)
    rec["y_train_equals_inference"] = bool(torch.equal(y, y_inf))
    rec["saved_bytes"] = saved.nbytes

    def run(num_ctas=None):
        # poison: fill the caching allocator's free blocks with NaN, so an output element the kernels
        # never write shows up as NaN (the backward's outputs and buffers come from those blocks)
        free = torch.cuda.mem_get_info()[0]
        junk = torch.full((min(free // 2, 24 << 30) // 4,), float("nan"), device="cuda")
        del junk
        return moe.backward(dy, saved, x, tw, w1, w2, b1, b2, num_ctas=num_ctas)

    g = run()
    torch.cuda.synchronize()
    ref = R.backward(dy, x, idx, tw, w1, w2, spec, b1, b2, dtype=torch.float64)
    for n in GRADS:
        a, b = getattr(g, n), getattr(ref, n)
        if b is None:
            continue
        rec[f"err_{n}"] = R.rel_err(a, b)
        rec[f"nan_{n}"] = bool(torch.isnan(a).any())
    g2 = run()
    g3 = run(num_ctas=max(1, moe.default_num_ctas(x.device) // 2))
    same = all(torch.equal(getattr(g, n), getattr(g2, n)) for n in GRADS if getattr(g, n) is not None)
    half = all(torch.equal(getattr(g, n), getattr(g3, n)) for n in GRADS if getattr(g, n) is not None)
    rec["bitwise_rerun"], rec["bitwise_half_sms"] = same, half
    errs = [v for k, v in rec.items() if k.startswith("err_")]
    rec["grad_rel_err"] = max(errs) if errs else None

    if timing:
        flops = 3 * 2 * T * (spec.topk + spec.shared_experts) * 3 * spec.hidden * spec.ffn

        def ours():
            yy, sv = moe.forward_train(x, idx, tw, w1, w2, b1, b2)
            moe.backward(dy, sv, x, tw, w1, w2, b1, b2)

        def ours_fwd():
            moe.forward_train(x, idx, tw, w1, w2, b1, b2)

        ms = _bench(ours)
        rec["fb_ms"], rec["tflops"] = ms, flops / ms / 1e9
        rec["kernels_ms"] = _profile(ours)
        # the same step through autograd (mokgen.moe_forward, y.backward): what a training loop runs
        al = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (x, tw, w1, w2, b1, b2)]

        def ours_autograd():
            for t in al:
                if t is not None:
                    t.grad = None
            mokgen.moe_forward(al[0], idx, al[1], al[2], al[3], al[4], al[5], moe=moe).backward(dy)

        rec["fb_autograd_ms"] = _bench(ours_autograd)
        rec["kernels_autograd_ms"] = _profile(ours_autograd)
        rec["fwd_train_ms"] = _bench(ours_fwd)
        rec["fwd_ms"] = _bench(lambda: moe(x, idx, tw, w1, w2, b1, b2))
        leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (x, tw, w1, w2, b1, b2)]

        def torch_fb():
            for t in leaves:
                if t is not None:
                    t.grad = None
            out = B.torch_grouped_mm(leaves[0], idx, leaves[1], leaves[2], leaves[3], spec, leaves[4], leaves[5])
            out.backward(dy)

        try:
            tms = _bench(torch_fb)
            rec["torch_fb_ms"], rec["speedup_vs_grouped_mm"] = tms, tms / ms
        except Exception as exc:  # noqa: BLE001
            rec["torch_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("items", nargs="+")
    ap.add_argument("--json")
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--routing", default="random")
    args = ap.parse_args(argv)
    recs = []
    for text in args.items:
        name, ov, tok = _item(text)
        try:
            rec = check(name, ov, tok, args.routing, not args.no_time)
        except Exception as exc:  # noqa: BLE001
            rec = dict(item=text, error=f"{type(exc).__name__}: {exc}"[:2000])
            traceback.print_exc()
        recs.append(rec)
        print(json.dumps(rec), flush=True)
        if args.json:
            with open(args.json, "a") as fh:
                fh.write(json.dumps(rec) + "\n")
    print(f"{'item':28} {'T':>6} {'err':>9} {'det':>5} {'fb ms':>8} {'TFLOP/s':>8} {'torch ms':>8} {'x':>5}")
    for r in recs:
        for key in ("kernels_ms", "kernels_autograd_ms"):
            if r.get(key):
                print(r["item"], key, r.get("fb_autograd_ms"), " | ".join(f"{n[:22]} {ms:.3f}" for n, ms in r[key] if ms >= 0.01))
    for r in recs:
        if "error" in r:
            print(f"{r['item']:28} ERROR {r['error'][:150]}")
            continue
        e = r.get("grad_rel_err")
        print(f"{r['item']:28} {r['tokens']:>6} {e if e is None else f'{e:.2e}':>9} "
              f"{str(r['bitwise_rerun'] and r['bitwise_half_sms'])[:5]:>5} {r.get('fb_ms', float('nan')):8.3f} "
              f"{r.get('tflops', float('nan')):8.1f} {r.get('torch_fb_ms', float('nan')):8.3f} "
              f"{r.get('speedup_vs_grouped_mm', float('nan')):5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
