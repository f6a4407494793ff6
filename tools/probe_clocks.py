"""Is the chain penalty the clock? (kernel author's tool, GPU.) For each BUILD_DIR:SPEC, runs each kernel and the
whole four-launch chain back to back for ``--seconds`` each, with ``nvidia-smi`` sampling SM clock, power and
throttle reasons every 50 ms, and reports per phase: median ms (CUDA events), mean SM MHz, mean W, the throttle
reasons seen. Also times each phase once more with an L2 flush (a 256 MB write) before every call.

    python tools/probe_clocks.py ITEM [...] [--seconds 1.5] [--json OUT]

ITEM is a built library, ``BUILD_DIR:SPEC`` or a cache entry ``SPEC[@k=v+k=v]`` as for tools/kernel_check.py
(phases gemm1, gemm2, chain; a build whose GEMM 1 reads TMA-fed rows also gets ``gemm1_nogather``: GEMM 1 alone
on rows gathered once), ``torch:dense:N`` (``torch.mm`` on bf16 N x N x N) or ``torch:layer:SPEC`` (the spec's
two GEMMs as dense ``torch.mm`` over all its rows; phases gemm1, gemm2, chain). Each phase also reports
TFLOP/s, so kernels can be compared at the clock they got.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_check import Setup, log, resolve_item  # noqa: E402


class Sampler:
    def __init__(self):
        self.p = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active",
             "--format=csv,noheader,nounits", "-lms", "50"], stdout=subprocess.PIPE, text=True, bufsize=1)
        self.rows: list[tuple[float, float, float, float, str]] = []
        import threading

        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self):
        for line in self.p.stdout:
            parts = [x.strip() for x in line.split(",")]
            try:
                self.rows.append((time.time(), float(parts[1]), float(parts[2]), float(parts[3]), parts[4]))
            except (ValueError, IndexError):
                pass

    def window(self, t0, t1):
        r = [x for x in self.rows if t0 <= x[0] <= t1]
        if not r:
            return {}
        return {"sm_mhz": sum(x[1] for x in r) / len(r), "min_mhz": min(x[1] for x in r),
                "watts": sum(x[2] for x in r) / len(r), "temp_c": max(x[3] for x in r),
                "throttle": sorted({x[4] for x in r}), "samples": len(r)}

    def stop(self):
        self.p.terminate()


def sustained(fn, seconds):
    ts = []
    t_end = time.time() + seconds
    while time.time() < t_end:
        evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(10)]
        for a, b in evs:
            a.record()
            fn()
            b.record()
        torch.cuda.synchronize()
        ts += [a.elapsed_time(b) for a, b in evs]
    ts.sort()
    return ts[len(ts) // 2], len(ts)


def flushed(fn, reps=20):
    junk = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    ts = []
    for _ in range(reps):
        junk.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def _torch_item(kind: str, arg: str):
    """(spec name, {phase: (fn, flops)}) for a torch:... item."""
    gen = torch.Generator(device="cuda")
    gen.manual_seed(3)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)

    if kind == "dense":
        n = int(arg)
        a, b = rnd(n, n), rnd(n, n)
        return f"dense-{n}", {"mm": (lambda: torch.mm(a, b), 2 * n ** 3)}
    if kind == "layer":  # the bench's dense_layer_mm, each GEMM alone and both
        from mokgen import baselines as B
        from mokgen.spec import load_spec

        spec = load_spec(arg)
        rows, H, I = spec.rows, spec.hidden, spec.ffn
        d = B.prepare_dense_layer(rnd(spec.tokens, H), rnd(1, 2 * I, H), rnd(1, H, I), rows, generator=gen)
        f1, f2 = 2 * rows * 2 * I * H, 2 * rows * I * H
        return spec.name, {"gemm1": (lambda: torch.mm(d.x, d.w1t), f1), "gemm2": (lambda: torch.mm(d.h, d.w2t), f2),
                           "chain": (lambda: B.dense_layer_mm(d), f1 + f2)}
    raise SystemExit(f"probe_clocks: unknown item torch:{kind}:{arg} (torch:dense:N or torch:layer:SPEC)")


def _phase(res, name, fn, flops, seconds, sampler):
    time.sleep(0.5)  # let the clock recover between phases
    t0 = time.time()
    med, n = sustained(fn, seconds)
    t1 = time.time()
    res["phases"][name] = {"sustained_ms": med, "calls": n, **sampler.window(t0 + 0.2, t1),
                           "flushed_ms": flushed(fn)}
    if flops:
        res["phases"][name]["sustained_tflops"] = flops / (med * 1e-3) / 1e12
    log(f"{res['spec']} {res['build']} {name}: {json.dumps(res['phases'][name])}")


def main(argv=None):
    import tvm_ffi

    ap = argparse.ArgumentParser()
    ap.add_argument("items", nargs="+")
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    sampler = Sampler()
    time.sleep(0.3)
    results = []
    for item in a.items:
        if item.startswith("torch:"):
            _, kind, arg = item.split(":", 2)
            name, phases = _torch_item(kind, arg)
            res = {"build": item, "spec": name, "phases": {}}
            for ph, (fn, flops) in phases.items():
                fn()
                _phase(res, ph, fn, flops, a.seconds, sampler)
            print(json.dumps(res), flush=True)
            results.append(res)
            continue
        d, s = resolve_item(item)
        st = Setup(d, s, None)
        w = st.ws()
        st.run(w)
        torch.cuda.synchronize()
        res = {"build": str(d), "spec": s, "item": item, "phases": {}}
        spec = st.spec
        rows = st.T * (spec.topk + spec.shared_experts)
        f1, f2 = 2 * rows * 2 * spec.ffn * spec.hidden, 2 * rows * spec.ffn * spec.hidden
        phases = {} if st.fused else {"gemm1": (lambda: st.k_gemm1(w), f1), "gemm2": (lambda: st.k_gemm2(w), f2)}
        if st.xg is not None:  # TMA-fed GEMM 1: also time it without the gather kernel (rows gathered once above)
            phases["gemm1_nogather"] = (lambda: st.fn["gemm1"](st.xg, st.inp.w1, st.b1, w["row_src"], w["tile_group"],
                                                                w["meta"], w["h"], st.sms), f1)
        phases["chain"] = (lambda: [step(w) for _, step in st.steps], f1 + f2)
        with tvm_ffi.use_torch_stream():
            for name, (fn, flops) in phases.items():
                _phase(res, name, fn, flops, a.seconds, sampler)
        print(json.dumps(res), flush=True)
        results.append(res)
    sampler.stop()
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
