"""Kernel-by-kernel check and timing of built mokgen artifacts on a GPU (the kernel author's tool).

    python tools/kernel_check.py BUILD_DIR:SPEC [BUILD_DIR:SPEC ...] [--tokens N] [--json OUT.json]
    python tools/kernel_check.py SPEC[@KEY=VALUE+KEY=VALUE...] ...     (the cache entry of that plan, built if missing)

For each built ``libmokgen.so`` (``mokgen compile`` output or a cache entry) and its spec: fresh random inputs,
poisoned workspaces, each kernel's output checked against its torch reference (``mokgen.reference.ref_*``):
routing bit-exact, GEMM 1 / GEMM 2 / combine by relative error, the end-to-end output against the float32
reference layer; determinism (two runs, and 66 vs all SMs, compared bit for bit); per-kernel timings (CUDA
events, medians). Prints a table; ``--json`` writes the numbers.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mokgen import reference as ref  # noqa: E402
from mokgen.ops import FUSED_SYNC_HEAD  # noqa: E402
from mokgen.plan import cap_rows, parse_overrides, solve  # noqa: E402
from mokgen.spec import load_spec  # noqa: E402


def load_lib(build_dir: Path):
    from mokgen.ops import FUSED_KERNELS, GATHER_KERNEL, KERNELS, load_library

    if (build_dir / "sources" / "fused.py").is_file():  # routing + one persistent kernel
        return load_library(build_dir, FUSED_KERNELS)
    if (build_dir / "sources" / f"{GATHER_KERNEL}.py").is_file():  # GEMM 1 loads A by TMA from gathered rows
        return load_library(build_dir, ("routing", GATHER_KERNEL, *KERNELS[1:]))
    return load_library(build_dir)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def median_ms(fn, reps: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        start[i].record()
        fn()
        end[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(start, end))
    return times[len(times) // 2]


class Setup:
    """One built library, its spec and fresh random inputs; ``ws()`` makes poisoned workspaces and the ``k_*``
    methods launch one kernel each on the current torch stream (inside ``tvm_ffi.use_torch_stream()``)."""

    def __init__(self, build_dir: Path, spec_name: str, tokens: int | None, routing: str = "random"):
        self.spec = spec = load_spec(spec_name)
        self.plan = solve(spec, "sm_90a")
        log(f"{spec_name}: loading {build_dir}")
        self.fn = load_lib(build_dir)
        log(f"{spec_name}: loaded")
        self.T = T = tokens or spec.tokens
        self.dev = dev = torch.device("cuda")
        self.inp = inp = ref.random_inputs(spec, tokens=T, device=dev, seed=int(time.time()) % 10000, routing=routing)
        # the routing tile the build was made for (64 when both GEMMs are ping-pong), from its routing source
        m = re.search(r"^BM = (\d+)", (build_dir / "sources" / "routing.py").read_text(), re.M)
        self.bm = int(m.group(1)) if m else self.plan.bm
        self.cap = cap_rows(spec, self.bm, T)
        self.b1 = inp.b1 if inp.b1 is not None else torch.zeros(1, 1, device=dev)
        self.b2 = inp.b2 if inp.b2 is not None else torch.zeros(1, 1, device=dev)
        self.sms = torch.cuda.get_device_properties(dev).multi_processor_count
        # GEMM 1 reads gathered rows (the gather kernel + TMA) unless its source gathers them itself; a cache entry
        # holds the backward's `gather` kernel either way, so its presence says nothing about GEMM 1's A path
        g1 = build_dir / "sources" / "gemm1.py"
        a_gather = g1.is_file() and re.search(r"^A_GATHER = True", g1.read_text(), re.M) is not None
        self.xg = (torch.empty((self.cap, spec.hidden), dtype=torch.bfloat16, device=dev)
                   if "gather" in self.fn and not a_gather and "fused" not in self.fn else None)
        self.fused = "fused" in self.fn
        src = build_dir / "sources" / "fused.py"
        self.profile = self.fused and "PROFILE = True" in src.read_text()
        # (name, launch(w, num_ctas)) in order
        if self.fused:
            self.steps = [("routing", lambda w, n=None: self.k_routing(w)), ("fused", self.k_fused)]
        else:
            self.steps = [("routing", lambda w, n=None: self.k_routing(w)), ("gemm1", self.k_gemm1),
                          ("gemm2", self.k_gemm2), ("combine", lambda w, n=None: self.k_combine(w))]

    def ws(self):
        cap, tiles, dev = self.cap, self.cap // self.bm, self.dev
        T, H, I, K, S = self.T, self.spec.hidden, self.spec.ffn, self.spec.topk, self.spec.shared_experts
        return dict(
            row_src=torch.full((cap,), -7, dtype=torch.int32, device=dev),
            row_w=torch.full((cap,), float("nan"), dtype=torch.float32, device=dev),
            tile_group=torch.full((tiles,), -7, dtype=torch.int32, device=dev),
            meta=torch.zeros(4, dtype=torch.int32, device=dev),
            slot_pos=torch.full((T, K + S), -7, dtype=torch.int32, device=dev),
            h=torch.full((cap, I), float("nan"), dtype=torch.bfloat16, device=dev),
            ys=torch.full((cap, H), float("nan"), dtype=torch.bfloat16, device=dev),
            y=torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=dev),
            sync=torch.full((FUSED_SYNC_HEAD + tiles + (16 * self.sms if self.profile else 0),), 12345, dtype=torch.int32,
                            device=dev).index_fill_(0, torch.tensor([2], device=dev), 0),
        )

    def k_routing(self, w):
        i = self.inp
        extra = (w["sync"],) if self.fused else ()
        self.fn["routing"](i.topk_idx, i.topk_weight, w["row_src"], w["row_w"], w["tile_group"], w["meta"], w["slot_pos"], *extra)

    def k_fused(self, w, num_ctas=None):
        i = self.inp
        self.fn["fused"](i.x, i.w1, self.b1, i.w2, self.b2, w["row_src"], w["row_w"], w["tile_group"], w["meta"],
                         w["slot_pos"], w["h"], w["ys"], w["y"], w["sync"], num_ctas or self.sms)

    def k_gemm1(self, w, num_ctas=None):
        a = self.inp.x
        if self.xg is not None:
            self.fn["gather"](self.inp.x, w["row_src"], w["meta"], self.xg)
            a = self.xg
        self.fn["gemm1"](a, self.inp.w1, self.b1, w["row_src"], w["tile_group"], w["meta"], w["h"], num_ctas or self.sms)

    def k_gemm2(self, w, num_ctas=None):
        self.fn["gemm2"](w["h"], self.inp.w2, self.b2, w["row_w"], w["tile_group"], w["meta"], w["ys"], num_ctas or self.sms)

    def k_combine(self, w):
        self.fn["combine"](w["ys"], w["slot_pos"], w["y"])

    def run(self, w, num_ctas=None):
        import tvm_ffi

        with tvm_ffi.use_torch_stream():
            for _, step in self.steps:
                step(w, num_ctas)


PROFILE_FIELDS = ("start_mod_s", "producer_dep_wait", "consumer_starve", "mainloop", "epilogue", "combine_wait",
                  "combine_work", "consumer_total", "g1_tiles", "g2_tiles", "combine_tasks", "producer_total")


def profile_summary(sync: torch.Tensor, grid: int) -> dict:
    """The fused kernel's PROFILE region (16 int32 per CTA) -> mean / max over CTAs (times in us)."""
    p = sync[-16 * grid:].view(grid, 16)[:, :len(PROFILE_FIELDS)].double().cpu()
    out = {}
    for i, name in enumerate(PROFILE_FIELDS):
        col = p[:, i]
        if name == "start_mod_s":
            out["start_skew_us"] = float(col.max() - col.min()) / 1e3
        elif name.endswith("tiles") or name.endswith("tasks"):
            out[name] = [int(col.min()), int(col.max()), int(col.sum())]
        else:
            out[name + "_us"] = [round(float(col.mean()) / 1e3, 1), round(float(col.max()) / 1e3, 1)]
    return out


def check(build_dir: Path, spec_name: str, tokens: int | None, routing: str = "random", time_it: bool = True):
    import tvm_ffi

    st = Setup(build_dir, spec_name, tokens, routing)
    spec, inp, T, bm, sms = st.spec, st.inp, st.T, st.bm, st.sms
    H, I, K, S = spec.hidden, spec.ffn, spec.topk, spec.shared_experts
    b1, b2, ws = st.b1, st.b2, st.ws
    run = st.run

    out = {"spec": spec_name, "tokens": T, "routing": routing, "build": str(build_dir)}
    w = ws()
    # first run step by step, so a hang or fault names its kernel
    t0 = time.time()
    with tvm_ffi.use_torch_stream():
        for name, step in st.steps:
            log(f"{spec_name}: {name} launch")
            step(w, sms)
            torch.cuda.synchronize()
            log(f"{spec_name}: {name} done ({time.time() - t0:.2f} s)")
    if st.fused:
        out["sync"] = w["sync"][:4].tolist()
        out["timeout_flag"] = int(w["sync"][2])
    if st.profile:
        out["profile"] = profile_summary(w["sync"], sms)
    # routing vs its reference (exact)
    r = ws()
    ref.ref_routing(inp.topk_idx, inp.topk_weight, r["row_src"], r["row_w"], r["tile_group"], r["meta"], r["slot_pos"],
                    local_experts=spec.local_experts, shared_experts=S, bm=bm)
    used = int(r["meta"][0]) * bm
    out["routing_exact"] = bool(
        int(w["meta"][0]) == int(r["meta"][0])
        and torch.equal(w["row_src"][:used], r["row_src"][:used])
        and torch.equal(w["row_w"][:used], r["row_w"][:used])
        and torch.equal(w["tile_group"], r["tile_group"])
        and torch.equal(w["slot_pos"], r["slot_pos"])
    )
    out["meta"] = w["meta"].tolist()
    cfg = ref.layer_config(spec)
    # GEMM 1 on the kernel's own routing
    h_ref = torch.zeros_like(w["h"])
    ref.ref_gemm1(inp.x, inp.w1, b1, w["row_src"], w["tile_group"], w["meta"], h_ref, sms, cfg=cfg, bm=bm)
    out["gemm1_rel_err"] = ref.rel_err(w["h"][:used].float(), h_ref[:used].float())
    out["gemm1_nan"] = bool(torch.isnan(w["h"][:used].float()).any())
    ys_ref = torch.zeros_like(w["ys"])
    ref.ref_gemm2(w["h"], inp.w2, b2, w["row_w"], w["tile_group"], w["meta"], ys_ref, sms, cfg=cfg, bm=bm)
    out["gemm2_rel_err"] = ref.rel_err(w["ys"][:used].float(), ys_ref[:used].float())
    out["gemm2_nan"] = bool(torch.isnan(w["ys"][:used].float()).any())
    y_ref_c = torch.zeros_like(w["y"])
    ref.ref_combine(w["ys"], w["slot_pos"], y_ref_c)
    out["combine_rel_err"] = ref.rel_err(w["y"].float(), y_ref_c.float())
    y_ref = ref.forward(inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2, spec, inp.b1, inp.b2, dtype=torch.float32)
    out["y_rel_err"] = ref.rel_err(w["y"].float(), y_ref.float())
    out["y_nan"] = bool(torch.isnan(w["y"].float()).any())
    # determinism: again, and with half the CTAs
    w2_ = ws()
    run(w2_)
    w3 = ws()
    run(w3, num_ctas=max(1, sms // 2))
    torch.cuda.synchronize()
    out["bitwise_same_rerun"] = bool(torch.equal(w["y"].view(torch.int16), w2_["y"].view(torch.int16)))
    out["bitwise_same_half_sms"] = bool(torch.equal(w["y"].view(torch.int16), w3["y"].view(torch.int16)))
    if time_it:
        t = {}
        with tvm_ffi.use_torch_stream():
            for i, (name, step) in enumerate(st.steps):
                if i > 0 and st.fused:  # the fused kernel needs its counters zeroed by routing each time
                    t[name] = median_ms(lambda: run(w)) - t["routing"]
                else:
                    t[name] = median_ms(lambda: step(w, sms))
        t["total"] = median_ms(lambda: run(w))
        # the same four launches replayed from a CUDA graph: launch gaps and host work removed
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run(w)
            with torch.cuda.graph(graph, stream=side):
                run(w)
        torch.cuda.current_stream().wait_stream(side)
        y_eager = w["y"].clone()
        graph.replay()
        torch.cuda.synchronize()
        out["graph_same_bits"] = bool(torch.equal(y_eager.view(torch.int16), w["y"].view(torch.int16)))
        t["total_graph"] = median_ms(graph.replay)
        rows = T * (K + S)
        f1 = 2 * rows * 2 * I * H
        f2 = 2 * rows * I * H
        out["ms"] = t
        if not st.fused:
            out["tflops_gemm1"] = f1 / (t["gemm1"] * 1e-3) / 1e12
            out["tflops_gemm2"] = f2 / (t["gemm2"] * 1e-3) / 1e12
        else:
            out["timeout_flag_after_timing"] = int(w["sync"][2])
        out["tflops_total"] = (f1 + f2) / (t["total"] * 1e-3) / 1e12
        out["tflops_total_graph"] = (f1 + f2) / (t["total_graph"] * 1e-3) / 1e12
    return out


def cache_entry(item: str) -> Path:
    """The cache entry directory of "SPEC[@k=v+k=v]": found in the cache (built before, or unpacked from a
    pack), else built now where the compiler is (mokgen.driver.resolve)."""
    from mokgen import driver, emit

    name, _, ov = item.partition("@")
    sources = emit.emit(solve(load_spec(name), "sm_90a", **parse_overrides(ov)))
    return Path(driver.resolve(sources, "sm_90a").dir)


def resolve_item(item: str) -> tuple[Path, str]:
    """(build directory, spec) of "BUILD_DIR:SPEC" or of a cache entry "SPEC[@k=v+k=v]"."""
    if ":" in item:
        d, s = item.rsplit(":", 1)
        return Path(d), s
    return cache_entry(item), item.split("@", 1)[0]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("items", nargs="+", help="BUILD_DIR:SPEC or SPEC[@k=v+k=v]")
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--routing", default="random")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-time", action="store_true")
    a = ap.parse_args(argv)
    results = []
    for item in a.items:
        try:
            d, s = resolve_item(item)
            res = check(d, s, a.tokens, a.routing, time_it=not a.no_time)
            res["item"] = item
        except Exception as e:  # report and go on with the next build
            import traceback

            traceback.print_exc()
            res = {"spec": item.split(":")[-1].split("@")[0], "item": item, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(res), flush=True)
        results.append(res)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
