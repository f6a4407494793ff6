#!/usr/bin/env python
"""Expert-parallel benchmark (issue 22): mokgen's EP layer against all-to-all baselines, per GPU, same run.

    torchrun --nproc-per-node N tools/bench_ep.py [--spec kimi-k2] [--tokens T] [--iters 20] [--warmup 5]
                                                   [--out bench/results/ep-<gpu>.json]
    python tools/bench_ep.py --dry-run [--ranks 2] [--out FILE]     # CPU, gloo, reference kernels, tiny spec

The spec's ``ep`` becomes the world size N (its ``experts`` must divide by N: L = experts / N local experts per
rank, the S shared experts replicated); every rank has ``tokens`` tokens (``--tokens``, else the spec's), random
distinct global top-k ids (uniform) and softmax weights, seeded by rank; the shared experts' weights are the same
on every rank. Implementations, each ``y = f(x, topk_idx, topk_weight)`` on this rank's tokens:

- ``mokgen_ep``: ``mokgen.MoE(spec, group=WORLD)`` (mokgen/ep_dist.py): pull dispatch, the single-GPU GEMMs on the
  received rows, push combine, over torch symmetric memory (NVLink multicast off), barriers between the phases;
- ``a2a_mokgen`` (**the baseline**): per slot (t, k) one row of x sent to the rank owning expert ``idx[t, k]``
  with NCCL ``all_to_all_single`` (split sizes exchanged first: a host sync, as such pipelines have), mokgen's
  single-GPU layer (``mokgen.moe_forward`` on a spec of the L local experts, top-1, the routing weight as the
  row's weight) on the received rows, ``all_to_all_single`` back, the owner's fixed-order sum over k; the shared
  experts as torch dense MLPs on the rank's own tokens (``mokgen.baselines._shared``). Differentiable through
  ``torch.distributed.nn.functional.all_to_all_single``;
- ``a2a_grouped_mm``: the same with torch's ``_grouped_mm`` experts (``mokgen.baselines.torch_grouped_mm``).

Modes: ``fwd`` (no autograd) and ``fwd_bwd`` (x, topk_weight, w1, w2 require grad; ``y.backward(dy)``, grads set
to None before each run). Timing: a group barrier, then CUDA events around one call (the CPU: perf_counter), the
median over ``--iters`` after ``--warmup``, then the largest median over the ranks (the step is as slow as its
slowest rank). Records (rank 0 APPENDS them to ``--out``; default ``bench/results/ep-<gpu>.json``, e.g.
``ep-h200.json``): gpu, date, versions, shape, dims (per rank), ep, tokens_per_rank, impl, mode, median_ms,
tokens_per_s_per_gpu = T / median, tflops_per_gpu = forward FLOPs (2 * T * (K + S) * 3 * H * I; x3 for fwd_bwd) /
median, speedup_vs_baseline (a2a_mokgen's median / this one's, same mode, same run), speedup_vs_grouped_mm,
rel_err (y against mokgen_ep's y, worst rank), bitwise_deterministic (mokgen_ep: two runs' y equal on every
rank), error (an implementation that failed). Nothing is measured until it runs on a multi-GPU host.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import socket
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

_TOOLS = Path(__file__).resolve().parent
if str(_TOOLS) not in sys.path:
    sys.path.insert(0, str(_TOOLS))

import bench_forward as BF  # noqa: E402  (puts the repository root on sys.path too)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.nn import functional as DF  # noqa: E402

from mokgen import baselines as B  # noqa: E402
from mokgen import ep_dist, ep_ops  # noqa: E402
from mokgen import reference as R  # noqa: E402

IMPLS = ("mokgen_ep", "a2a_mokgen", "a2a_grouped_mm")
MODES = ("fwd", "fwd_bwd")
DEFAULT_SPEC = "kimi-k2"
DRY_RUN_SPEC = dict(name="tiny-ep", hidden=128, ffn=64, experts=8, topk=2, ep=2, tokens=24, dtype="bf16",
                    shared_experts=1, activation="swiglu", gate_up_layout="concat", bias=False)
DRY_BM = 8
# torch 2.13 marks torch.distributed.nn.functional's collectives deprecated (in favour of the functional
# collectives); they are still the documented differentiable all_to_all_single of torch 2.11
warnings.filterwarnings("ignore", message=".*torch.distributed.nn.functional.all_to_all_single is deprecated.*")


def _log(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, flush=True)


def ep_spec(src: Any, world: int, tokens: int | None):
    """The spec with ``ep`` = the world size (and ``tokens`` per rank)."""
    from mokgen.spec import Spec

    spec = BF.resolve_spec(src, tokens)
    if spec.experts % world:
        raise SystemExit(f"bench_ep: {spec.experts} experts do not divide over {world} ranks")
    d = spec.to_dict()
    d.update(ep=world, name=f"{spec.name}-ep{world}")
    return Spec.from_dict(d) if hasattr(Spec, "from_dict") else Spec(**d)


def local_spec(spec, world: int):
    """The baselines' single-GPU layer: the L local experts, top-1 rows, no shared experts, planned for the
    worst case of received rows (every slot of every rank: R * T * min(K, L))."""
    from mokgen.spec import Spec

    L = spec.experts // world
    d = spec.to_dict()
    d.update(name=f"{spec.name}-local", experts=L, topk=1, ep=1, shared_experts=0,
             tokens=max(1, world * spec.tokens * min(spec.topk, L)))
    return Spec.from_dict(d) if hasattr(Spec, "from_dict") else Spec(**d)


def make_inputs(spec, rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    c = R.layer_config(spec)
    T, H, I, K, L, S, E = c.tokens, c.hidden, c.ffn, c.topk, c.local_experts, c.shared_experts, c.ep * c.local_experts
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(T, H, generator=g).bfloat16()
    idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices.int() if T else torch.zeros(0, K, dtype=torch.int32)
    wt = torch.softmax(torch.randn(T, K, generator=g), -1)
    gs = torch.Generator().manual_seed(7)   # the shared experts: the same on every rank
    w1 = torch.cat([torch.randn(L, 2 * I, H, generator=g), torch.randn(S, 2 * I, H, generator=gs)]) / H ** 0.5
    w2 = torch.cat([torch.randn(L, H, I, generator=g), torch.randn(S, H, I, generator=gs)]) / I ** 0.5
    out = dict(x=x, idx=idx.contiguous(), wt=wt.contiguous(), w1=w1.bfloat16(), w2=w2.bfloat16(),
               dy=torch.randn(T, H, generator=g).bfloat16())
    if c.bias:
        out.update(b1=torch.randn(L + S, 2 * I, generator=g) * 0.1, b2=torch.randn(L + S, H, generator=g) * 0.1)
    return {k: v.to(device) for k, v in out.items()}


# ---- the all-to-all baselines -----------------------------------------------------------------------------------

def a2a_layer(x, idx, wt, w1, w2, b1, b2, *, spec, world: int, group, experts: Callable) -> torch.Tensor:
    """Dispatch one row per slot with all_to_all_single, ``experts(rows, local ids, weights)`` (weighted rows),
    all_to_all_single back, the owner's sum over k in order, plus the shared experts (dense MLPs)."""
    T, K = idx.shape
    H = x.shape[1]
    L = spec.experts // world
    flat = idx.reshape(-1).long()
    dest = torch.div(flat, L, rounding_mode="floor")
    order = torch.argsort(dest, stable=True)
    send = torch.bincount(dest, minlength=world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    sc, rc = send.tolist(), recv.tolist()   # the baseline's host sync
    tok = torch.div(order, K, rounding_mode="floor")
    xs = x.index_select(0, tok)
    xr = DF.all_to_all_single(x.new_empty(sum(rc), H), xs, rc, sc, group=group)
    lid = torch.empty(sum(rc), dtype=torch.int64, device=x.device)
    dist.all_to_all_single(lid, (flat % L).index_select(0, order).contiguous(), rc, sc, group=group)
    ws = wt.reshape(-1).index_select(0, order)
    wr = DF.all_to_all_single(ws.new_empty(sum(rc)), ws, rc, sc, group=group)
    yr = experts(xr, lid.int().view(-1, 1).contiguous(), wr.view(-1, 1).contiguous(), w1[:L], w2[:L],
                 None if b1 is None else b1[:L], None if b2 is None else b2[:L])
    ys = DF.all_to_all_single(yr.new_empty(T * K, H), yr.contiguous(), sc, rc, group=group)
    slots = ys.new_zeros(T * K, H).index_copy(0, order, ys)
    y32 = slots.view(T, K, H).float().sum(1)
    B._shared(x, w1, w2, b1, b2, spec, L, y32)
    return y32.to(x.dtype)


# ---- timing -----------------------------------------------------------------------------------------------------

def time_call(fn: Callable[[], Any], iters: int, warmup: int, device: torch.device, group) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize(device)
            ts.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
    t = torch.tensor([statistics.median(ts)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _all(flag: bool, device, group) -> bool:
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


def _max(v: float, device, group) -> float:
    t = torch.tensor([v], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def gpu_slug(name: str) -> str:
    for tok in name.replace("-", " ").split():
        if any(ch.isdigit() for ch in tok) and any(ch.isalpha() for ch in tok):
            return tok.lower()
    return "cpu" if name == "cpu" else "gpu"


# ---- one rank -----------------------------------------------------------------------------------------------------

def build(spec, world: int, rank: int, device: torch.device, dry_run: bool, group):
    """(the EP module's kernels: an EPMoE, the local single-GPU layer for a2a_mokgen)."""
    from mokgen.ops import CompiledMoE

    lspec = local_spec(spec, world)
    if dry_run:
        layer = ep_ops.EPMoE(spec, SimpleNamespace(bm=DRY_BM, gemm1=SimpleNamespace(a_load="gather")),
                             functions=ep_ops.reference_ep_kernels(spec, DRY_BM, training=True), allow_cpu=True)
        lc = R.layer_config(lspec)
        local = CompiledMoE(lc, DRY_BM, functions=R.reference_kernels(lc, DRY_BM, training=True), allow_cpu=True)
        return layer, local
    import mokgen

    for turn in (0, 1):   # rank 0 compiles (or loads) first, the others load its cache entries
        if (rank == 0) == (turn == 0):
            comp, local = mokgen.compile(spec), mokgen.compile(lspec)
        dist.barrier(group=group)
    return ep_ops.EPMoE(spec, comp.plan, comp.entry_dir), local


def run_rank(rank: int, world: int, device: torch.device, args, group) -> list[dict[str, Any]]:
    import mokgen
    from mokgen.ops import moe_forward

    spec = ep_spec(args.spec if not args.dry_run else DRY_RUN_SPEC, world, args.tokens)
    lspec = local_spec(spec, world)
    layer, local = build(spec, world, rank, device, args.dry_run, group)
    inp = make_inputs(spec, rank, device)
    moe = mokgen.MoE(spec, device=device, group=group, ep_layer=layer)
    with torch.no_grad():
        moe.w1.copy_(inp["w1"])
        moe.w2.copy_(inp["w2"])
        if moe.b1 is not None:
            moe.b1.copy_(inp["b1"])
            moe.b2.copy_(inp["b2"])
    b1, b2 = moe.b1, moe.b2

    def mokgen_experts(xr, lid, wr, w1, w2, b1_, b2_):
        return moe_forward(xr, lid, wr, w1, w2, b1_, b2_, moe=local)

    def grouped_experts(xr, lid, wr, w1, w2, b1_, b2_):
        return B.torch_grouped_mm(xr, lid, wr, w1, w2, lspec, b1_, b2_)

    impls: dict[str, Callable] = {
        "mokgen_ep": lambda x, i, w: moe(x, i, w),
        "a2a_mokgen": lambda x, i, w: a2a_layer(x, i, w, moe.w1, moe.w2, b1, b2, spec=spec, world=world,
                                                group=group, experts=mokgen_experts),
        "a2a_grouped_mm": lambda x, i, w: a2a_layer(x, i, w, moe.w1, moe.w2, b1, b2, spec=spec, world=world,
                                                    group=group, experts=grouped_experts),
    }
    x, idx, wt, dy = inp["x"], inp["idx"], inp["wt"], inp["dy"]
    ctx = dict(gpu=BF.gpu_name(device), date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               versions=BF.collect_versions())
    dims = BF.spec_dims(spec)
    flops = BF.spec_flops(spec)
    results: dict[tuple[str, str], dict[str, Any]] = {}
    with torch.no_grad():
        y_ref = impls["mokgen_ep"](x, idx, wt)
        det = _all(torch.equal(y_ref, impls["mokgen_ep"](x, idx, wt)), device, group)
    for impl in IMPLS:
        err, error = None, None
        try:
            with torch.no_grad():
                y = impls[impl](x, idx, wt)
            e = R.rel_err(y.double().cpu(), y_ref.double().cpu()) if y.numel() else 0.0
            err = _max(e, device, group)
        except Exception as ex:   # noqa: BLE001 -- recorded, the others go on
            error = BF._short_error(ex)
        failed = not _all(error is None, device, group)
        for mode in MODES:
            ms = None
            if not failed:
                try:
                    if mode == "fwd":
                        def fn(impl=impl):
                            with torch.no_grad():
                                impls[impl](x, idx, wt)
                    else:
                        xl = x.clone().requires_grad_(True)
                        wl = wt.clone().requires_grad_(True)

                        def fn(impl=impl, xl=xl, wl=wl):
                            moe.zero_grad(set_to_none=True)
                            xl.grad = wl.grad = None
                            impls[impl](xl, idx, wl).backward(dy)
                    ms = time_call(fn, args.iters, args.warmup, device, group)
                except Exception as ex:   # noqa: BLE001
                    error = BF._short_error(ex)
                    _log(rank, traceback.format_exc())
            results[(impl, mode)] = dict(median_ms=ms, rel_err=err, error=error)
            _log(rank, f"  {impl:15s} {mode:8s} " + (f"{ms:9.3f} ms" if ms else f"failed: {error}"))
    records = []
    T = spec.tokens
    for (impl, mode), r in results.items():
        ms = r["median_ms"]
        base = results[("a2a_mokgen", mode)]["median_ms"]
        gmm = results[("a2a_grouped_mm", mode)]["median_ms"]
        f = flops * (3 if mode == "fwd_bwd" else 1)
        rec = dict(gpu=ctx["gpu"], date=ctx["date"], versions=ctx["versions"], shape=spec.name, dims=dims, ep=world,
                   tokens_per_rank=T, impl=impl, mode=mode, median_ms=ms,
                   tokens_per_s_per_gpu=(T / (ms * 1e-3)) if ms else None,
                   tflops_per_gpu=(f / (ms * 1e-3) / 1e12) if ms else None,
                   speedup_vs_baseline=(base / ms) if (ms and base) else None,
                   speedup_vs_grouped_mm=(gmm / ms) if (ms and gmm) else None,
                   rel_err=r["rel_err"], bitwise_deterministic=det if impl == "mokgen_ep" else None,
                   multicast_off={k: os.environ.get(k) for k in ep_dist.MULTICAST_OFF}, dry_run=bool(args.dry_run))
        if r["error"]:
            rec["error"] = r["error"]
        records.append(rec)
    return records


def print_table(records: list[dict[str, Any]]) -> None:
    if not records:
        return
    r0 = records[0]
    print(f"\nEP={r0['ep']}  {r0['shape']}  T={r0['tokens_per_rank']} per rank  on {r0['gpu']}")
    print(f"{'impl':16s}{'mode':9s}{'ms':>10s}{'tok/s/GPU':>13s}{'TFLOP/s':>10s}{'vs base':>9s}{'vs gmm':>8s}"
          f"{'rel_err':>10s}")
    for r in records:
        fmt = lambda v, s: (s % v) if isinstance(v, (int, float)) and v is not None and math.isfinite(v) else "-"  # noqa: E731
        print(f"{r['impl']:16s}{r['mode']:9s}{fmt(r['median_ms'], '%10.3f')}{fmt(r['tokens_per_s_per_gpu'], '%13.0f')}"
              f"{fmt(r['tflops_per_gpu'], '%10.3f')}{fmt(r['speedup_vs_baseline'], '%9.2f')}"
              f"{fmt(r['speedup_vs_grouped_mm'], '%8.2f')}{fmt(r['rel_err'], '%10.2e')}"
              + (f"  {r['error']}" if r.get("error") else ""))


def _main_rank(rank: int, world: int, args, init: dict[str, Any]) -> None:
    os.environ.update(ep_dist.MULTICAST_OFF)   # before NCCL / symmetric memory start
    if args.dry_run:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world, **init)
    else:
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device, **init)
    group = dist.group.WORLD
    try:
        records = run_rank(rank, world, device, args, group)
        if rank == 0:
            print_table(records)
            out = args.out or (None if args.dry_run else f"bench/results/ep-{gpu_slug(records[0]['gpu'])}.json")
            if out:
                BF.append_records(out, records)
                print(f"appended {len(records)} records to {out}")
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int, args) -> None:
    _main_rank(rank, world, args, dict(init_method=f"tcp://127.0.0.1:{port}"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--spec", default=DEFAULT_SPEC, help="preset name or YAML (its ep becomes the world size)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank (default: the spec's)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default=None, help="JSON list to append to (default bench/results/ep-<gpu>.json; "
                   "--dry-run: none)")
    p.add_argument("--dry-run", action="store_true", help="CPU processes, gloo, the reference kernels, a tiny spec")
    p.add_argument("--ranks", type=int, default=2, help="--dry-run without torchrun: processes to spawn")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.dry_run:
        args.iters, args.warmup = min(args.iters, 2), min(args.warmup, 1)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:   # under torchrun
        _main_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, dict(init_method="env://"))
        return 0
    if not args.dry_run:
        print("bench_ep: run under torchrun --nproc-per-node N (or --dry-run on the CPU)", file=sys.stderr)
        return 2
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_spawned, args=(args.ranks, port, args), nprocs=args.ranks, join=True, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
