"""Expert parallelism with one rank per process on GPUs (mokgen/ep_dist.py, issue 22): ``mokgen.MoE(spec,
group=...)`` with the compiled kernels over torch symmetric memory (SymmTransport: NVLink multicast off), one
process per GPU under an NCCL group, R = 2, 3, 4 where that many GPUs are visible: every rank's y, dx,
d topk_weight and its routed experts' dW1 / dW2 equal the single-GPU layer's training step on the gathered problem
(compiled with the EP plan's GEMM choices) bit for bit, and two steps give the same bits. The one-GPU variant runs
2 and 3 processes on cuda:0 with a gloo group, over symmetric memory (``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``;
it skips, naming the reason, where this torch refuses ranks on one device) and over CUDA IPC handles
(IpcTransport: a device synchronize and the host barrier between the phases). The fault test:
a rank that skips a phase makes the others' device barrier time out (the device prints the rank and channel, and
traps; the process must exit). Written for the GPU machines; not run on the CPU machines
(tests/test_ep_dist.py runs the same protocol there with the shared-memory transport)."""
from __future__ import annotations

import os
import socket
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from mokgen import ep
from mokgen import reference as R

from test_ep import _inputs
from test_gpu_ep import _spec, _train_layers

pytestmark = [pytest.mark.gpu, pytest.mark.ep_kernels, pytest.mark.training]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpu_worker(rank, world, port, spec, tokens, routing, seed, out_dir, one_gpu, fault, timeout_s):
    log = os.open(str(Path(out_dir) / f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)   # the device's printf (a barrier timeout's message) goes to the log
    os.dup2(log, 2)
    res: dict = {}
    try:
        import torch.distributed as dist

        import mokgen
        from mokgen import ep_dist

        os.environ.update(ep_dist.MULTICAST_OFF)
        dev = torch.device("cuda", 0 if one_gpu else rank)
        torch.cuda.set_device(dev)
        if one_gpu:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    timeout=timedelta(seconds=120))
        else:
            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    timeout=timedelta(seconds=120), device_id=dev)
        try:
            if one_gpu == "ipc":
                tp = ep_dist.IpcTransport(dist.group.WORLD, dev, timeout_s=timeout_s)
            else:
                tp = ep_dist.SymmTransport(dist.group.WORLD, dev, timeout_s=timeout_s,
                                           allow_overlapping_devices=bool(one_gpu))
        except Exception as e:   # noqa: BLE001 -- the one-GPU form may be refused by this torch
            res["unsupported"] = f"{type(e).__name__}: {e}"
            raise
        x, idx, wt, w1, w2, b1, b2 = _inputs(spec, tokens, seed=seed, routing=routing)
        c = R.layer_config(spec)
        g = torch.Generator().manual_seed(seed + 100)
        dy = [torch.randn(t, c.hidden, generator=g).bfloat16() for t in tokens]
        moe = mokgen.MoE(spec, device=dev, group=dist.group.WORLD, transport=tp)
        with torch.no_grad():
            moe.w1.copy_(w1[rank])
            moe.w2.copy_(w2[rank])
            if b1 is not None:
                moe.b1.copy_(b1[rank].float())
                moe.b2.copy_(b2[rank].float())
        if fault is not None and rank == fault[0]:
            real = tp.barrier
            tp.barrier = lambda phase: None if phase == fault[1] else real(phase)   # skips that phase's barrier
        runs = []
        for _ in range(2):
            moe.zero_grad(set_to_none=True)
            xr = x[rank].to(dev).requires_grad_(True)
            wr = wt[rank].float().to(dev).requires_grad_(True)
            t0 = time.monotonic()
            y = moe(xr, idx[rank].int().to(dev), wr)
            y.backward(dy[rank].to(dev))
            torch.cuda.synchronize(dev)
            res["seconds"] = time.monotonic() - t0
            runs.append({"y": y.detach().cpu(), "x": xr.grad.cpu(), "topk_weight": wr.grad.cpu(),
                         "w1": moe.w1.grad.cpu(), "w2": moe.w2.grad.cpu()})
        res["runs"] = runs
    except Exception as e:   # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {e}"
        res["trace"] = traceback.format_exc()
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")
    os._exit(0)   # a trapped CUDA context cannot be torn down


def _spawn(world, tmp_path, spec, tokens, routing, seed, one_gpu=None, fault=None, timeout_s=20.0, limit_s=400):
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_gpu_worker, args=(world, _free_port(), spec, tokens, routing, seed, str(tmp_path),
                                                one_gpu, fault, timeout_s),
                             nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + limit_s
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"EP processes still running after {limit_s} s")
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def _check_against_gathered(spec, tokens, routing, seed, res):
    layer, single = _train_layers(spec)   # compiled in the parent (the children load the same cache entries)
    del layer
    c = R.layer_config(spec)
    L, n = c.local_experts, c.ep
    x, idx, wt, w1, w2, b1, b2 = _inputs(spec, tokens, seed=seed, routing=routing)
    g = torch.Generator().manual_seed(seed + 100)
    dy = [torch.randn(t, c.hidden, generator=g).bfloat16() for t in tokens]
    gx, gi, gw, W1, W2, B1, B2, cfg = ep.gather_problem(x, [i.int() for i in idx], [w.float() for w in wt], w1, w2,
                                                        spec, b1, b2)
    cu = lambda t: t.cuda().contiguous()   # noqa: E731
    gb = {} if B1 is None else dict(b1=cu(B1.float()), b2=cu(B2.float()))
    ys, sv = single.forward_train(cu(gx), cu(gi.int()), cu(gw.float()), cu(W1), cu(W2), **gb)
    gs = single.backward(cu(torch.cat(dy)), sv, cu(gx), cu(gw.float()), cu(W1), cu(W2), **gb)
    for r, o in enumerate(res):
        assert "error" not in o, (r, o.get("trace"))
        a, b = o["runs"]
        for k in a:
            assert torch.equal(a[k], b[k]), (r, k)                          # run to run
    first = [o["runs"][0] for o in res]
    assert torch.equal(torch.cat([f["y"] for f in first]), ys.cpu())
    assert torch.equal(torch.cat([f["x"] for f in first]), gs.x.cpu())
    if B1 is None:
        assert torch.equal(torch.cat([f["topk_weight"] for f in first]), gs.topk_weight.cpu())
    for d in range(n):
        assert torch.equal(first[d]["w1"][:L], gs.w1[d * L:(d + 1) * L].cpu()), d
        assert torch.equal(first[d]["w2"][:L], gs.w2[d * L:(d + 1) * L].cpu()), d


CASES = [(2, [64, 64], "random"), (2, [1, 0], "random"), (3, [40, 0, 17], "random"), (3, [64, 64, 64], "one_rank"),
         (4, [64, 1, 0, 33], "random"), (4, [64, 64, 64, 64], "one_rank")]


@pytest.mark.parametrize("ranks,tokens,routing", CASES)
def test_gpus_equal_the_gathered_layer(ranks, tokens, routing, tmp_path):
    if torch.cuda.device_count() < ranks:
        pytest.skip(f"needs {ranks} GPUs, {torch.cuda.device_count()} visible")
    spec = _spec(ranks)
    _train_layers(spec)   # compile before the children start
    res = _spawn(ranks, tmp_path, spec, tokens, routing, seed=ranks)
    _check_against_gathered(spec, tokens, routing, ranks, res)


@pytest.mark.parametrize("transport", ["symm", "ipc"])
def test_processes_sharing_one_gpu(transport, tmp_path):
    """Two and three ranks on cuda:0 with a gloo group: symmetric memory (TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1;
    skips naming the reason where this torch refuses it) or CUDA IPC handles (IpcTransport)."""
    for ranks, tokens in ((2, [64, 5]), (3, [0, 64, 1])):
        spec = _spec(ranks)
        _train_layers(spec)
        res = _spawn(ranks, tmp_path, spec, tokens, "random", seed=4, one_gpu=transport)
        refused = [o["unsupported"] for o in res if "unsupported" in o]
        if refused and transport == "symm":
            pytest.skip(f"torch symmetric memory refused ranks sharing one GPU: {refused[0]}")
        _check_against_gathered(spec, tokens, "random", 4, res)


def test_a_rank_that_skips_a_phase_times_out_the_others(tmp_path):
    ranks = 2 if torch.cuda.device_count() >= 2 else None
    if ranks is None:
        pytest.skip("needs 2 GPUs")
    spec = _spec(2)
    _train_layers(spec)
    t0 = time.monotonic()
    res = _spawn(2, tmp_path, spec, [64, 64], "random", seed=5, fault=(1, "forward:push"), timeout_s=3.0)
    assert time.monotonic() - t0 < 300
    assert "error" in res[0], res[0]
    log = (tmp_path / "rank0.log").read_text(errors="replace")
    assert "CUDASymmetricMemory::barrier" in log and "channel 1" in log, log[-2000:]
