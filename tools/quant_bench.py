"""The FP8 quantizers alone on the GPU: each kernel's time and its bandwidth against the bytes it must move.

    python tools/quant_bench.py [--specs kimi-k2-fp8 ...] [--rounds 5] [--reps 50] [--out bench/results/quant-h100.json]
                                [--wt-forms 256:3,512:2]

For each FP8 spec the layer's six quantizers run on its training-step sizes (rows = tokens x topk rounded up to
128, all used; gathered rows from random tokens): quant_rows_gather (x), quant_rows_used (h), quant_both_gather
(dO), quant_both_used (dz), quant_cols_used (s a), quant_cols_gather (x). Outputs are checked bit for bit against
the CPU reference (mokgen.fp8_ops) on the first run; timings are CUDA-event medians of ``--rounds`` batches of
``--reps`` back-to-back launches (outputs preallocated: GPU-bound). GB/s counts the bytes a kernel must move: the
rows read once (gathered rows: the tokens' rows once, as the floor), everything written once. Prints a table and
appends one JSON record per kernel. (Measured slower and removed, bench/NOTES.md v24: a persistent form of the
column quantizers prefetching the next block's rows, and 2-8 row tiles per lane group.)

The weights' quantizer too (``quant_wt`` on w1 [G, 2I, H] and on w2 [G, H, I]: the e4m3 copies and their K-major
transposed copies a training step's GEMMs read), which runs once per optimizer step (whenever the weights change),
not once per layer call: its rows (``kernel`` "quant_wt:w1" / "quant_wt:w2") and their sum, the cost an FP8 training
step adds per optimizer update (spread over the micro-batches of gradient accumulation). Its bits are checked on
the first group (the CPU reference over every group would take minutes).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mokgen import build, fp8_ops, kernels  # noqa: E402
from mokgen.emit import emit_fp8_quant  # noqa: E402
from mokgen.ops import load_library  # noqa: E402
from mokgen.plan import solve  # noqa: E402
from mokgen.spec import load_spec  # noqa: E402

# the layer's quantizers: each one's input in :func:`inputs` and its mokgen.fp8_ops launcher
KERNELS = {"quant_rows_gather": ("x", fp8_ops.quantize_gathered_rows), "quant_rows_used": ("h", fp8_ops.quantize_used_rows),
           "quant_both_gather": ("x", fp8_ops.quantize_gathered_both), "quant_both_used": ("dz", fp8_ops.quantize_used_both),
           "quant_cols_used": ("sa", fp8_ops.quantize_used_cols), "quant_cols_gather": ("x", fp8_ops.quantize_gathered_cols)}


# the weights' quantizer, once per optimizer step: its input in :func:`inputs`
WEIGHT_KERNELS = {"quant_wt:w1": "w1", "quant_wt:w2": "w2"}


def build_lib(plan, out: Path) -> None:
    build.build(emit_fp8_quant(plan, tuple(KERNELS) + ("quant_wt",)), plan.arch, out, progress=False)


def inputs(spec, dev: str, seed: int = 0) -> dict:
    g = torch.Generator(device=dev).manual_seed(seed)
    t, h, i = spec.tokens, spec.hidden, spec.ffn
    rows = -(-t * spec.topk // 128) * 128
    bm = 128

    def rnd(*shape):
        x = torch.randn(*shape, generator=g, device=dev).to(torch.bfloat16)
        x[x == 0] = 1.0
        return x

    groups = spec.local_experts + spec.shared_experts
    return {"rows": rows, "bm": bm, "x": rnd(t, h), "h": rnd(rows, i), "dz": rnd(rows, 2 * i), "sa": rnd(rows, i),
            "w1": rnd(groups, 2 * i, h) * 0.02, "w2": rnd(groups, h, i) * 0.02,
            "row_src": torch.randint(0, t, (rows,), generator=g, device=dev, dtype=torch.int32),
            "meta": torch.tensor([rows // bm, 0, 0, 0], dtype=torch.int32, device=dev)}


def launch(fns, name: str, d: dict):
    src, fn = KERNELS[name]
    return fn(fns, d[src], *((d["row_src"],) if name.endswith("gather") else ()), d["meta"])


def floor_bytes(name: str, d: dict) -> int:
    x = d[KERNELS[name][0]]
    rows, k = d["rows"], x.shape[1]
    one = rows * k + rows * (-(-k // 128)) * 4          # e4m3 bytes + one scale per 128 (either form)
    return x.numel() * 2 + (2 * one if name.startswith("quant_both") else one)


def weight_floor_bytes(w: torch.Tensor) -> int:
    """quant_wt's bytes: w read once; q, its transposed copy and both scale tables written once."""
    g, n, k = w.shape
    return w.numel() * 2 + 2 * (w.numel() + g * (-(-n // 128)) * (-(-k // 128)) * 4)


def kwargs_of(name: str, d: dict, outs) -> dict:
    """The kernel's named arguments (kernels.call) with ``outs`` (what :func:`launch` returned) as its outputs."""
    kw = {"x": d[KERNELS[name][0]], **({"row_src": d["row_src"]} if name.endswith("gather") else {}), "meta": d["meta"]}
    names = {"quant_rows": ("q", "s"), "quant_cols": ("qt", "st"), "quant_both": ("q", "s", "qt", "st")}
    kw.update(zip(names[name.rsplit("_", 1)[0]], outs))
    return kw


def timed(fns, name: str, kw: dict, reps: int) -> float:
    """ms per launch: CUDA events around ``reps`` back-to-back launches (outputs preallocated: GPU-bound)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    kernels.call(fns, name, **kw)
    a.record()
    for _ in range(reps):
        kernels.call(fns, name, **kw)
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def weight_rows(spec, fns, ref_fns, d: dict, a, form: str) -> list[dict]:
    """quant_wt on w1 and w2 (``fns``' form, labelled ``form`` in the kernel name): bits on group 0 against the
    reference, CUDA-event medians; prints a row each and their sum (the weights' quantization per optimizer step)."""
    recs, per_update = [], 0.0
    for name, src in WEIGHT_KERNELS.items():
        w = d[src]
        got = fp8_ops.quantize_w(fns, w[:1].contiguous(), transpose=True)
        want = fp8_ops.quantize_w(ref_fns, w[:1].cpu(), transpose=True)
        same = all(torch.equal(x.cpu().view(torch.uint8), y.view(torch.uint8)) for x, y in zip(got, want))
        q, s_, qt, st = fp8_ops.quantize_w(fns, w, transpose=True)
        kw = dict(w=w, q=q, s=s_, qt=qt, st=st)
        m = statistics.median(timed(fns, "quant_wt", kw, max(1, a.reps // 10)) for _ in range(a.rounds))
        per_update += m
        fb = weight_floor_bytes(w)
        label = name.replace("quant_wt", "quant_wt" + form)
        recs.append({"spec": spec.name, "kernel": label, "median_ms": round(m, 5), "floor_bytes": fb,
                     "gbps": round(fb / m / 1e6, 1), "same_bits_as_reference": same, "shape": list(w.shape),
                     "per": "optimizer step"})
        print(f"{spec.name:24s} {label:18s} {m:8.4f} ms {recs[-1]['gbps']:8.1f} GB/s  "
              f"bits (group 0) {'= reference' if same else 'DIFFER from the reference'}", flush=True)
    print(f"{spec.name:24s} weights' quantization per optimizer step{form}: {per_update:.4f} ms", flush=True)
    return recs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--specs", nargs="+", default=["kimi-k2-fp8", "tools/specs/qwen3.5-397b-a17b-fp8.yaml"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=None)
    ap.add_argument("--run", default=None)
    ap.add_argument("--wt-forms", default="", help="other CTA forms of quant_wt to time beside the default, "
                    "THREADS:CTAS_PER_SM[,...] (emit.QUANT_W_FORM; CTAS_PER_SM 0: no launch bound)")
    a = ap.parse_args(argv)
    import tvm_ffi

    dev = "cuda"
    props = torch.cuda.get_device_properties(0)
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec_name in a.specs:
            spec = load_spec(spec_name)
            plan = solve(spec, "sm_90a")
            out = Path(tmp) / spec.name
            build_lib(plan, out)
            fns = load_library(out, tuple(KERNELS) + ("quant_wt",))
            ref_fns = fp8_ops.reference_quant_kernels(128)
            d = inputs(spec, dev)
            d_cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in d.items()
                     if k not in WEIGHT_KERNELS.values()}   # the weights: checked on group 0 only
            with tvm_ffi.use_torch_stream(torch.cuda.device(0)):
                for name in KERNELS:
                    got = [t.clone() for t in launch(fns, name, d)]
                    want = launch(ref_fns, name, d_cpu)
                    same = all(torch.equal(x.cpu().view(torch.uint8), y.view(torch.uint8))
                               for x, y in zip(got, want))
                    kw = kwargs_of(name, d, got)
                    m = statistics.median(timed(fns, name, kw, a.reps) for _ in range(a.rounds))
                    fb = floor_bytes(name, d)
                    rec = {"spec": spec.name, "kernel": name, "median_ms": round(m, 5), "floor_bytes": fb,
                           "gbps": round(fb / m / 1e6, 1), "same_bits_as_reference": same, "rows": d["rows"]}
                    records.append(rec)
                    print(f"{spec.name:24s} {name:18s} {m:8.4f} ms {rec['gbps']:8.1f} GB/s  "
                          f"bits {'= reference' if same else 'DIFFER from the reference'}", flush=True)
                records += weight_rows(spec, fns, ref_fns, d, a, "")
                for form in filter(None, a.wt_forms.split(",")):   # other CTA forms of quant_wt
                    threads, ctas = (int(v) for v in form.split(":"))
                    fdir = Path(tmp) / f"{spec.name}-wt-{threads}-{ctas}"
                    build.build(emit_fp8_quant(plan, ("quant_wt",), params=dict(threads=threads, ctas_per_sm=ctas)),
                                plan.arch, fdir, progress=False)
                    records += weight_rows(spec, load_library(fdir, ("quant_wt",)), ref_fns, d, a,
                                           f"[{threads}:{ctas}]")
    if a.out:
        p = Path(a.out)
        old = json.loads(p.read_text()) if p.exists() else []
        meta = {"gpu": props.name, "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "versions": {"torch": torch.__version__}, "run": a.run}
        p.write_text(json.dumps(old + [{**meta, **r} for r in records], indent=1) + "\n")
    return 0 if all(r["same_bits_as_reference"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
