"""Expert parallelism with one rank per process (mokgen/ep_dist.py, issue 22) on the CPU: R = 2, 3, 4 processes
(torch.multiprocessing spawn, a gloo group on a free port), each running ``mokgen.MoE(spec, group=...)`` on the
CPU reference kernels over the shared-memory transport (/dev/shm files every rank maps; an epoch-counter barrier
with a deadline). Every rank's y and gradients (dx, d topk_weight, its experts' dW1 / dW2, db1 / db2) equal the
simulated ranks of mokgen.ep_ops.EPMoE and the single-GPU layer's training step on the gathered problem bit for bit
(skewed routing onto one rank's experts, ranks with zero tokens, T = 1, shared experts, biases), whatever the
ranks' arrival order (injected delays); ids out of range raise RoutingError on every rank; a rank that skips a
phase makes the others raise EPBarrierTimeout naming it and the phase within the timeout, no hang."""
from __future__ import annotations

import os
import re
import socket
import time
import traceback
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mokgen import ep, ep_dist, ep_ops
from mokgen import reference as R
from mokgen.ops import CompiledMoE

from test_ep import _inputs, _spec

BM = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ep_layer(spec):
    return ep_ops.EPMoE(spec, SimpleNamespace(bm=BM, gemm1=SimpleNamespace(a_load="gather")),
                        functions=ep_ops.reference_ep_kernels(spec, BM, training=True), allow_cpu=True)


def _problem(job):
    spec = _spec(**job["kw"])
    inp = _inputs(spec, job["tokens"], seed=job["seed"], routing=job.get("routing", "random"))
    x, idx, wt, w1, w2, b1, b2 = inp
    idx = [i.int().contiguous() for i in idx]
    if job.get("bad_ids"):
        idx = [i.clone() for i in idx]
        for r, t, k, v in job["bad_ids"]:
            idx[r][t, k] = v
    wt = [w.float().contiguous() for w in wt]
    b1 = None if b1 is None else [t.float().contiguous() for t in b1]
    b2 = None if b2 is None else [t.float().contiguous() for t in b2]
    g = torch.Generator().manual_seed(job["seed"] + 100)
    dy = [torch.randn(t, spec.hidden, generator=g).bfloat16() for t in job["tokens"]]
    return spec, x, idx, wt, w1, w2, b1, b2, dy


def _run_job(rank, job, timeout_s):
    import mokgen

    spec, x, idx, wt, w1, w2, b1, b2, dy = _problem(job)
    if job.get("transport") == "symm":   # SymmTransport's own code over a CPU stand-in of torch symmetric memory
        import fake_symm_mem

        tp = ep_dist.SymmTransport(dist.group.WORLD, "cpu", timeout_s=timeout_s, symm_mem=fake_symm_mem)
    else:
        tp = ep_dist.ShmTransport(dist.group.WORLD, timeout_s=timeout_s)
    moe = mokgen.MoE(spec, device="cpu", group=dist.group.WORLD, ep_layer=_ep_layer(spec), transport=tp)
    with torch.no_grad():
        moe.w1.copy_(w1[rank])
        moe.w2.copy_(w2[rank])
        if b1 is not None:
            moe.b1.copy_(b1[rank])
            moe.b2.copy_(b2[rank])
    out = {}
    fault = job.get("fault")
    if fault is not None and rank == fault[0]:   # this rank skips the barrier of phase fault[1] and leaves
        real = tp.barrier

        def barrier(phase):
            if phase == fault[1]:
                raise _Skip(phase)
            real(phase)
        tp.barrier = barrier
    if job.get("check"):
        moe.ep_check = True
    delay = job.get("delay")
    t0 = time.monotonic()
    try:
        if delay:
            time.sleep(delay[rank])
        xr = x[rank].clone().requires_grad_(job.get("train", False))
        wr = wt[rank].clone().requires_grad_(job.get("train", False))
        y = moe(xr, idx[rank], wr)
        out["y"] = y.detach().clone()
        if job.get("train") and job.get("no_backward") != rank:
            if delay:
                time.sleep(delay[-1 - rank])
            y.backward(dy[rank])
            out.update(x=xr.grad, topk_weight=wr.grad, w1=moe.w1.grad, w2=moe.w2.grad)
            if b1 is not None:
                out.update(b1=moe.b1.grad, b2=moe.b2.grad)
        if job.get("again"):   # a second forward (no grad)
            with torch.no_grad():
                moe(x[rank], idx[rank], wt[rank])
        if job.get("check_errors"):   # the count the calls kept on the device, read once
            moe.check_errors()
    except _Skip as e:
        out["skipped"] = str(e)
    except Exception as e:   # noqa: BLE001 -- reported to the parent
        out["error"] = f"{type(e).__name__}: {e}"
        out["error_type"] = type(e).__name__
    out["seconds"] = time.monotonic() - t0
    if "skipped" not in out:
        tp.close()
    return out


class _Skip(Exception):
    pass


def _worker(rank, world, port, jobs, out_dir, timeout_s):
    torch.set_num_threads(1)
    res = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        for name, job in jobs.items():
            res[name] = _run_job(rank, job, timeout_s)
            if "skipped" in res[name] or "error" in res[name] and job.get("fault"):
                break   # after a fault the group is out of step: no further jobs
    except Exception:   # noqa: BLE001
        res["__crash__"] = traceback.format_exc()
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")
    if not any("skipped" in v or "error" in v for v in res.values() if isinstance(v, dict)):
        dist.destroy_process_group()
    os._exit(0)   # no teardown that could wait on a peer that left


def _spawn(world, jobs, tmp_path, timeout_s=20.0, limit_s=180.0):
    ctx = mp.start_processes(_worker, args=(world, _free_port(), jobs, str(tmp_path), timeout_s), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + limit_s
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"EP processes still running after {limit_s} s")
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for r, rr in enumerate(res):
        assert "__crash__" not in rr, rr["__crash__"]
    return res


def _simulated(job):
    """The simulated ranks' training step (EPMoE, one process) and the gathered single-GPU layer's."""
    spec, x, idx, wt, w1, w2, b1, b2, dy = _problem(job)
    b = {} if b1 is None else dict(b1=b1, b2=b2)
    sim = _ep_layer(spec)
    ys, saved = sim.forward_train(x, idx, wt, w1, w2, **b)
    grads = sim.backward(dy, saved, x, w1, w2, **b)
    gx, gi, gw, W1, W2, B1, B2, cfg = ep.gather_problem(x, idx, wt, w1, w2, spec, b1, b2)
    single = CompiledMoE(cfg, BM, functions=R.reference_kernels(cfg, BM, training=True), allow_cpu=True)
    bb = {} if B1 is None else dict(b1=B1.contiguous(), b2=B2.contiguous())
    y1, sv = single.forward_train(gx.contiguous(), gi.contiguous(), gw.contiguous(), W1.contiguous(),
                                  W2.contiguous(), **bb)
    g1 = single.backward(torch.cat(dy), sv, gx.contiguous(), gw.contiguous(), W1.contiguous(), W2.contiguous(),
                         **bb)
    return spec, ys, grads, y1, g1


def _check_job(name, job, res):
    spec, ys, grads, y1, g1 = _simulated(job)
    c = R.layer_config(spec)
    L, n = c.local_experts, c.ep
    got = [r[name] for r in res]
    for r, o in enumerate(got):
        assert "error" not in o, (name, r, o["error"])
        assert torch.equal(o["y"], ys[r]), (name, r)
    assert torch.equal(torch.cat([o["y"] for o in got]), y1), name          # the gathered single-GPU layer
    if not job.get("train"):
        return
    for r, o in enumerate(got):
        for k in ("x", "topk_weight", "w1", "w2") + (("b1", "b2") if c.bias else ()):
            assert torch.equal(o[k], getattr(grads[r], k)), (name, r, k)      # the simulated ranks: every bit
    assert torch.equal(torch.cat([o["x"] for o in got]), g1.x), name
    if not c.bias:
        assert torch.equal(torch.cat([o["topk_weight"] for o in got]), g1.topk_weight), name
    for d, o in enumerate(got):
        assert torch.equal(o["w1"][:L], g1.w1[d * L:(d + 1) * L]), (name, d)
        assert torch.equal(o["w2"][:L], g1.w2[d * L:(d + 1) * L]), (name, d)
    assert n == len(got)


JOBS = {
    2: {"random": dict(kw=dict(ep=2, experts=4), tokens=[16, 16], seed=1, train=True),
        "t1": dict(kw=dict(ep=2, experts=4), tokens=[1, 1], seed=2, train=True),
        "zero": dict(kw=dict(ep=2, experts=4, shared_experts=1), tokens=[1, 0], seed=3, train=True),
        "infer": dict(kw=dict(ep=2, experts=4), tokens=[9, 16], seed=4)},
    3: {"random": dict(kw=dict(ep=3, experts=6, shared_experts=1), tokens=[5, 16, 9], seed=5, train=True,
                       delay=[0.0, 0.15, 0.3]),
        "skewed": dict(kw=dict(ep=3, experts=6), tokens=[0, 12, 0], seed=6, routing="one_rank", train=True),
        "late": dict(kw=dict(ep=3, experts=6, shared_experts=1), tokens=[5, 16, 9], seed=5, train=True,
                     delay=[0.3, 0.15, 0.0]),
        "symm": dict(kw=dict(ep=3, experts=6, shared_experts=1), tokens=[5, 16, 9], seed=5, train=True,
                     transport="symm")},
    4: {"mixed": dict(kw=dict(shared_experts=1), tokens=[16, 0, 7, 1], seed=7, train=True),
        "skewed": dict(kw=dict(shared_experts=2), tokens=[16, 16, 16, 16], seed=8, routing="one_rank", train=True),
        "bias": dict(kw=dict(shared_experts=1, bias=True, activation="swiglu_oai", gate_up_layout="interleaved"),
                     tokens=[9, 16, 3, 5], seed=9, train=True)},
}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_processes_equal_the_gathered_single_gpu_layer(world, tmp_path):
    jobs = JOBS[world]
    res = _spawn(world, jobs, tmp_path)
    for name, job in jobs.items():
        _check_job(name, job, res)
    if world == 3:   # other arrival orders (delays reversed), the symmetric-memory transport: the same bits
        for r in range(3):
            for k in ("y", "x", "topk_weight", "w1", "w2"):
                assert torch.equal(res[r]["random"][k], res[r]["late"][k]), (r, k)
                assert torch.equal(res[r]["random"][k], res[r]["symm"][k]), (r, k)
    assert not list(Path("/dev/shm").glob("mokgen-ep-*")) if Path("/dev/shm").is_dir() else True


def test_ids_out_of_range_raise_on_every_rank(tmp_path):
    bad = [(0, 2, 1, 4), (1, 0, 0, -1)]   # R * L = 4: no rank has it; -1
    jobs = {"bad": dict(kw=dict(ep=2, experts=4, shared_experts=1), tokens=[6, 5], seed=7, bad_ids=bad,
                        check=True),
            # without ep_check: no sync in the calls; MoE.check_errors reports the two calls' ids on every rank
            "counted": dict(kw=dict(ep=2, experts=4, shared_experts=1), tokens=[6, 5], seed=7, bad_ids=bad,
                            again=True, check_errors=True),
            "after": dict(kw=dict(ep=2, experts=4), tokens=[3, 4], seed=8)}   # the group goes on
    res = _spawn(2, jobs, tmp_path)
    for r in range(2):
        assert res[r]["bad"]["error_type"] == "RoutingError" and "2 top-k id" in res[r]["bad"]["error"], res[r]
        assert res[r]["counted"]["error_type"] == "RoutingError" and "4 top-k id" in res[r]["counted"]["error"], \
            res[r]
    _check_job("after", jobs["after"], res)


@pytest.mark.parametrize("transport,phase", [("shm", "forward:push"), ("shm", "backward:publish"),
                                             ("symm", "forward:push")])
def test_a_rank_that_skips_a_phase_is_named_within_the_timeout(transport, phase, tmp_path):
    """The others raise within the timeout: EPBarrierTimeout naming the rank and the phase (ShmTransport); with
    SymmTransport (over the CPU stand-in) the barrier's message naming the rank and the phase's channel, which on
    a GPU the device prints before it traps."""
    timeout = 2.0
    jobs = {"fault": dict(kw=dict(ep=3, experts=6), tokens=[8, 8, 8], seed=3, train=True, fault=(2, phase),
                          transport=transport)}
    t0 = time.monotonic()
    res = _spawn(3, jobs, tmp_path, timeout_s=timeout, limit_s=90)
    assert time.monotonic() - t0 < 60
    assert res[2]["fault"]["skipped"] == phase
    for r in (0, 1):
        o = res[r]["fault"]
        if transport == "symm":
            ch = ep_dist.PHASES.index(phase)
            assert f"rank {r} failed to receive signal from rank 2 on channel {ch}" in o.get("error", ""), o
            assert o["seconds"] < timeout + 10, o["seconds"]
            continue
        assert o.get("error_type") == "EPBarrierTimeout", o
        msg = o["error"]
        assert f"'{phase}'" in msg and "rank(s) [2] did not arrive" in msg and f"rank {r} timed out" in msg, msg
        assert "\n" not in msg
        assert o["seconds"] < timeout + 10, o["seconds"]


def test_a_rank_that_skips_a_backward_is_caught_at_once(tmp_path):
    """Rank 1 runs no backward and goes on to the next forward: its 'forward:publish' meets the others'
    'backward:publish' at the same barrier; every rank raises EPPhaseMismatch at once (no timeout, no silent mix)."""
    timeout = 30.0
    jobs = {"mix": dict(kw=dict(ep=3, experts=6), tokens=[8, 8, 8], seed=4, train=True, no_backward=1, again=True)}
    res = _spawn(3, jobs, tmp_path, timeout_s=timeout, limit_s=90)
    for r in range(3):
        o = res[r]["mix"]
        assert o.get("error_type") == "EPPhaseMismatch", o
        assert o["seconds"] < timeout / 2, o["seconds"]
    assert "rank 1 at 'forward:publish'" in res[0]["mix"]["error"], res[0]["mix"]["error"]
    assert "rank 1 at 'forward:publish'" in res[2]["mix"]["error"], res[2]["mix"]["error"]
    assert re.search(r"rank 1 at barrier #3 'forward:publish' met rank [02] at 'backward:publish'",
                     res[1]["mix"]["error"]), res[1]["mix"]["error"]   # whichever peer it saw first


def test_transport_rejects_a_group_of_another_size():
    spec = _spec(ep=2, experts=4)
    layer = _ep_layer(spec)
    tp = SimpleNamespace(world=3, rank=0)
    with pytest.raises(ValueError, match="3 ranks, the spec's ep is 2"):
        ep_dist.EPRank(layer, tp)


def test_symm_transport_refuses_a_multicast_handle():
    """A rendezvous handle with an NVLink multicast address (torch's ``multicast_ptr``, 0 when none) is refused: the
    transport needs multicast off. ``has_multicast_support`` is torch's static device query (it took the handle's
    place here until a GPU run showed it raising TypeError: tests/test_gpu_ep_dist.py's one-GPU symmetric case)."""
    def transport(mc_ptr):
        buf = torch.zeros(4, dtype=torch.int32)
        handle = SimpleNamespace(multicast_ptr=mc_ptr, offset=0, has_multicast_support=fake_symm_mem_static,
                                 buffer_ptrs=[buf.data_ptr()], get_buffer=lambda rank, sizes, dtype, off: buf)
        symm = SimpleNamespace(empty=lambda n, dtype, device: buf, rendezvous=lambda t, group: handle)
        tp = object.__new__(ep_dist.SymmTransport)
        tp._symm, tp.group, tp.rank, tp.world, tp.device, tp._handles = symm, None, 0, 1, torch.device("cpu"), {}
        return tp

    with pytest.raises(RuntimeError, match="symmetric memory set up NVLink multicast; it must stay off"):
        transport(0x7f0000000000)._map("x", (4,), torch.int32)
    assert len(transport(0)._map("x", (4,), torch.int32)) == 1


def fake_symm_mem_static(device_type, device_index):   # torch's signature: (device type, index) -> bool
    return True


def test_buffers_hold_the_worst_case():
    """The buffers of ep_buffers: every rank's slots routed to one rank fit the row space; sizes from T_max."""
    spec = _spec(ep=3, experts=6, topk=4, shared_experts=1)
    layer = _ep_layer(spec)
    cap, bufs = ep_dist.ep_buffers(layer, 16)
    c = R.layer_config(spec)
    assert cap == ep_ops.recv_capacity([16] * 3, 16, c, BM)
    idx = [torch.tensor([[0, 1, 2, 3]] * 16, dtype=torch.int32)] * 3
    lay = ep.dispatch_layout(idx, 2, BM)
    assert len(lay.rows[0]) + 16 <= cap
    assert bufs["comb"][0] == (16 * 4 + cap, c.hidden) and bufs["dtw"][0] == (16 * 4 + 1,)


def test_bench_ep_dry_run(tmp_path):
    """tools/bench_ep.py --dry-run: 2 CPU processes, gloo, the reference kernels; its records are complete, the
    baselines' y agree with the EP layer's within bf16 rounding, the EP layer is bitwise repeatable."""
    import json
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "ep.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, str(repo / "tools" / "bench_ep.py"), "--dry-run", "--ranks", "2", "--out",
                        str(out)], capture_output=True, text=True, timeout=240, env=env, cwd=repo)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = json.loads(out.read_text())
    assert {(r["impl"], r["mode"]) for r in recs} == {(i, m) for i in ("mokgen_ep", "a2a_mokgen", "a2a_grouped_mm")
                                                      for m in ("fwd", "fwd_bwd")}
    for r in recs:
        assert "error" not in r, r
        assert r["ep"] == 2 and r["gpu"] == "cpu" and r["dry_run"] and r["median_ms"] > 0
        assert r["tokens_per_s_per_gpu"] > 0 and r["tflops_per_gpu"] > 0 and r["rel_err"] < 2e-2
        assert r["multicast_off"] == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                      "NVSHMEM_DISABLE_NVLS": "1"}
        if r["impl"] == "a2a_mokgen":
            assert r["speedup_vs_baseline"] == 1.0
        if r["impl"] == "mokgen_ep":
            assert r["bitwise_deterministic"] is True and r["rel_err"] == 0.0
    assert "mokgen_ep" in p.stdout and "speedup" not in p.stderr
