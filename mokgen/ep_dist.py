"""Expert parallelism with one rank per process (issue 22): the transport seam, one rank's EP step, its autograd op.

The phases are :class:`mokgen.ep_ops.EPMoE`'s (the simulated ranks run every rank's phase in turn; here each
process runs its own rank's), over buffers that every rank can address:

* :class:`Transport` -- per rank, named buffers of one shape on every rank (collective allocation), the ``[R]``
  int64 tensor of their base addresses *in this process's address space* (what the EP kernels take), views of a
  peer's buffer, and a bounded barrier between the phases (a timeout raises :class:`EPBarrierTimeout` naming the
  phase and the ranks that did not arrive, instead of hanging).

  - :class:`SymmTransport` (CUDA): torch symmetric memory (``torch.distributed._symmetric_memory``: ``empty``,
    ``rendezvous``, the handle's ``buffer_ptrs`` + ``offset``, ``get_buffer``, ``barrier(channel, timeout_ms)``),
    NVLink multicast off (``MULTICAST_OFF`` set before the first rendezvous; ``cuMulticastCreate`` is never asked
    for). Written against torch's sources, not run on a GPU yet.
  - :class:`ShmTransport` (CPU, tests and debugging without GPUs): a gloo process group for the one-time setup,
    each buffer a file in ``/dev/shm`` that every rank maps (``torch.from_file(shared=True)``), so a peer's buffer
    has an address in every process (the reference kernels resolve it to the local mapping through
    :class:`~mokgen.ep_ops.PeerBuffers`' registry); the barrier is an epoch counter per rank in shared memory,
    polled with a deadline.
  - :class:`IpcTransport` (several processes on one CUDA device, where symmetric memory refuses them): CUDA IPC
    handles and the CPU transport's host barrier after a device synchronize. Written, not run yet.

* :class:`EPRank` -- one rank's forward (publish x, ids, weights, token count; barrier; routing, pull dispatch,
  experts, push; barrier; combine) and backward (publish dy and x again, zero the router-gradient buffer; barrier;
  dO and x pulled, backward GEMMs, dx pushed, router gradients scattered into the owners' buffers; barrier; dx
  combine). Buffers are sized for the worst case of ``tokens_max`` tokens per rank (``spec.tokens`` by default,
  :func:`mokgen.ep_ops.recv_capacity` of it): no routing drops a row, no host sync is needed for sizes.
  Every sequence of phases starts with a barrier after which peers write into a rank's buffers and ends with
  reads of its own buffers only, so several layers may share one transport.

* :func:`ep_moe_forward` -- the autograd op over :class:`EPRank` (used by ``mokgen.MoE(spec, group=...)``).

The results equal the single-GPU layer on the gathered problem bit for bit (the same kernels on the same rows in
the same order; each slot has one writer), whatever the order in which the ranks arrive.
"""
from __future__ import annotations

import abc
import os
import time
import uuid
import zlib
from typing import Any, Sequence

import torch
import torch.distributed as dist

from .ep_ops import EPMoE, EPSaved, PeerBuffers, recv_capacity
from .ops import MoEInputError

__all__ = ["MULTICAST_OFF", "EPBarrierTimeout", "EPPhaseMismatch", "Transport", "ShmTransport", "IpcTransport",
           "SymmTransport", "make_transport",
           "ep_buffers", "EPRank", "ep_moe_forward", "PHASES"]

# NVLink multicast (NVLS) stays off: NCCL, torch symmetric memory and NVSHMEM each have a switch
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

# the barriers of one step, in order; on CUDA the index is the symmetric-memory signal channel (its device-side
# timeout message names the channel)
PHASES = ("forward:publish", "forward:push", "backward:publish", "backward:push")


class EPBarrierTimeout(RuntimeError):
    """A phase barrier timed out: some rank did not arrive (it died, hangs, or skipped the phase)."""


class EPPhaseMismatch(RuntimeError):
    """Ranks met at a barrier from different phases (e.g. one rank skipped a backward and ran the next forward):
    the EP steps are collective, every rank must run the same sequence."""


_RING = 8   # phase codes kept per rank: a peer is at most one barrier ahead


class Transport(abc.ABC):
    """Named buffers, the same shape on every rank of ``group``, addressable by every rank; a bounded barrier.

    ``alloc`` is collective (every rank, same names, shapes and order). ``ptrs(name)``: the ``[R]`` int64 tensor
    of every rank's buffer base address as this process sees it, on ``device``; ``local(name)``: this rank's
    buffer; ``peer(name, r)``: rank r's buffer as a tensor of this process."""

    rank: int
    world: int
    device: torch.device
    timeout_s: float

    def __init__(self) -> None:
        self._shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._peers: dict[str, list[torch.Tensor]] = {}
        self._ptrs: dict[str, PeerBuffers] = {}
        self.failed: str | None = None

    def alloc(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> None:
        shape = tuple(int(s) for s in shape)
        if name in self._shapes:
            if self._shapes[name] != (shape, dtype):
                raise ValueError(f"ep transport: buffer {name!r} exists as {self._shapes[name]}, asked {shape} {dtype}")
            return
        self._shapes[name] = (shape, dtype)
        peers = self._map(name, shape, dtype)
        self._peers[name] = peers
        self._ptrs[name] = PeerBuffers(peers, self.device)

    @abc.abstractmethod
    def _map(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
        """Allocate this rank's buffer (collective) and return every rank's, as tensors of this process."""

    def has(self, name: str) -> bool:
        return name in self._shapes

    def local(self, name: str) -> torch.Tensor:
        return self._peers[name][self.rank]

    def peer(self, name: str, r: int) -> torch.Tensor:
        return self._peers[name][r]

    def ptrs(self, name: str) -> torch.Tensor:
        return self._ptrs[name].ptrs

    @abc.abstractmethod
    def barrier(self, phase: str) -> None:
        """Every rank's writes before it are visible to every rank after it; bounded (see the subclasses)."""

    def _check_usable(self) -> None:
        if self.failed:
            raise EPBarrierTimeout(f"mokgen ep: transport unusable after an earlier failure: {self.failed}")

    def close(self) -> None:
        self._peers.clear()
        self._ptrs.clear()
        self._shapes.clear()


def _group_info(group: Any) -> tuple[int, int]:
    if not dist.is_initialized():
        raise RuntimeError("mokgen ep: torch.distributed is not initialized (init_process_group first)")
    return dist.get_rank(group), dist.get_world_size(group)


class ShmTransport(Transport):
    """The CPU transport: shared-memory files mapped by every rank of a (gloo) process group ``group``.

    Setup (``alloc``) uses the group's collectives; the phase barrier does not: each rank writes the phase's code
    for its next epoch, then bumps its epoch counter (shared int64s), and polls every peer's until they reach it or
    ``timeout_s`` passes (then :class:`EPBarrierTimeout` names the phase, the late ranks and the last barrier each
    of them reached); a peer at the same epoch from another phase raises :class:`EPPhaseMismatch` at once. Stores
    and loads are plain CPU memory accesses; x86-64's ordering (TSO) makes a rank's buffer writes visible before its
    counter's, which is what the barrier relies on (not for weakly ordered CPUs)."""

    def __init__(self, group: Any = None, timeout_s: float = 30.0, directory: str = "/dev/shm"):
        super().__init__()
        self.group = group
        self.rank, self.world = _group_info(group)
        self.device = torch.device("cpu")
        self.timeout_s = float(timeout_s)
        self.dir = directory if os.path.isdir(directory) else "/tmp"
        sid = [uuid.uuid4().hex[:12] if self.rank == 0 else None]
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(sid, src=src, group=group)
        self.session = sid[0]
        self._epoch = 0
        self._names = {i + 1: p for i, p in enumerate(PHASES)}   # phase code -> name
        self.alloc("_epoch", (1 + _RING,), torch.int64)   # [epoch, the phase code of epoch e at 1 + e % _RING]

    def _path(self, name: str, r: int) -> str:
        return os.path.join(self.dir, f"mokgen-ep-{self.session}-{name}-{r}")

    def _map(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
        numel = 1
        for s in shape:
            numel *= s
        n = max(numel, 1)
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        own = self._path(name, self.rank)
        with open(own, "wb") as f:
            f.truncate(nbytes)   # zero-filled
        try:
            dist.barrier(group=self.group)   # every rank's file exists
            peers = [torch.from_file(self._path(name, r), shared=True, size=n, dtype=dtype)[:numel].view(shape)
                     for r in range(self.world)]
            dist.barrier(group=self.group)   # every rank mapped every file
        finally:
            os.unlink(own)                    # the mappings stay; nothing is left in /dev/shm
        return peers

    def _code(self, phase: str) -> int:
        code = PHASES.index(phase) + 1 if phase in PHASES else (zlib.crc32(phase.encode()) | 1 << 32)
        self._names[code] = phase
        return code

    def _where(self, sig: torch.Tensor) -> str:
        e = int(sig[0])
        if e == 0:
            return "#0 (none yet)"
        code = int(sig[1 + e % _RING])
        return f"#{e} '{self._names.get(code, f'unknown phase {code:#x}')}'"

    def barrier(self, phase: str) -> None:
        self._check_usable()
        self._epoch += 1
        e, code = self._epoch, self._code(phase)
        sigs = self._peers["_epoch"]
        sigs[self.rank][1 + e % _RING] = code   # the phase first, then the epoch that publishes it
        sigs[self.rank][0] = e
        deadline = time.monotonic() + self.timeout_s
        pause = 1e-5
        while True:
            late, other = [], []
            for r in range(self.world):
                if int(sigs[r][0]) < e:
                    late.append(r)
                elif int(sigs[r][1 + e % _RING]) != code:
                    other.append(r)
            if other:
                names = ", ".join(f"rank {r} at '{self._names.get(int(sigs[r][1 + e % _RING]), '?')}'"
                                  for r in other)
                self.failed = (f"rank {self.rank} at barrier #{e} '{phase}' met {names}: every rank must run the "
                               "same sequence of EP forwards and backwards")
                raise EPPhaseMismatch("mokgen ep: " + self.failed)
            if not late:
                return
            if time.monotonic() > deadline:
                where = ", ".join(f"rank {r} at {self._where(sigs[r])}" for r in late)
                self.failed = (f"rank {self.rank} timed out after {self.timeout_s:g} s at barrier #{e} '{phase}': "
                               f"rank(s) {late} did not arrive (last barrier reached: {where})")
                raise EPBarrierTimeout("mokgen ep: " + self.failed)
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)


class IpcTransport(ShmTransport):
    """Several processes on one CUDA device (a correctness harness where symmetric memory refuses ranks that share
    a GPU): each buffer a CUDA tensor exported with a CUDA IPC handle (torch.multiprocessing's tensor reduction,
    ``cudaIpcGetMemHandle`` / ``cudaIpcOpenMemHandle``), the handles exchanged over the (gloo) group; the barrier
    is a device synchronize then :class:`ShmTransport`'s bounded host barrier (the epoch counters stay in
    /dev/shm). A host sync per phase: not a fast path. Written for the GPU machines, not run yet."""

    def __init__(self, group: Any = None, device: torch.device | str | None = None, timeout_s: float = 30.0,
                 directory: str = "/dev/shm"):
        cuda = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        if cuda.type != "cuda":
            raise ValueError(f"IpcTransport needs a CUDA device, got {cuda}")
        self._owned: list[torch.Tensor] = []
        super().__init__(group, timeout_s, directory)   # the epoch counters: host shared memory
        self.device = cuda

    def _map(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
        if name == "_epoch":
            return super()._map(name, shape, dtype)
        from torch.multiprocessing.reductions import reduce_tensor

        numel = 1
        for s in shape:
            numel *= s
        t = torch.zeros(max(numel, 1), dtype=dtype, device=self.device)
        self._owned.append(t)   # exported: kept alive as long as the transport
        rebuild, args = reduce_tensor(t)
        handles: list[Any] = [None] * self.world
        dist.all_gather_object(handles, args, group=self.group)
        peers = [t if r == self.rank else rebuild(*handles[r]) for r in range(self.world)]
        dist.barrier(group=self.group)   # every rank opened every handle
        return [p[:numel].view(shape) for p in peers]

    def barrier(self, phase: str) -> None:
        torch.cuda.synchronize(self.device)   # this rank's writes are done before its epoch is published
        super().barrier(phase)

    def close(self) -> None:
        super().close()
        self._owned.clear()


class SymmTransport(Transport):
    """The CUDA transport: torch symmetric memory over ``group`` (NCCL; several ranks on one GPU need
    ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``, set by ``allow_overlapping_devices=True``).

    Every buffer is ``symm_mem.empty`` + ``symm_mem.rendezvous`` (collective); its peers' base addresses are the
    handle's ``buffer_ptrs`` plus its ``offset`` (the tensor's place in the symmetric block), copied once into a
    ``[R]`` int64 device tensor; ``peer(name, r)`` is ``handle.get_buffer(r, ...)``. The barrier is the handle's
    ``barrier(channel, timeout_ms)`` on the current stream (channel = the phase's index in :data:`PHASES`): release
    / acquire at system scope, no host sync; on timeout the device prints ``[FATAL] CUDASymmetricMemory::barrier:
    rank a failed to receive signal from rank b on channel c`` and traps, and the next synchronizing call raises
    (the CUDA context is lost: the process must exit). :meth:`describe_failure` maps the channel back to the
    phase name."""

    def __init__(self, group: Any = None, device: torch.device | str | None = None, timeout_s: float = 30.0,
                 allow_overlapping_devices: bool = False, symm_mem: Any = None):
        super().__init__()
        for k, v in MULTICAST_OFF.items():   # before the first rendezvous of this process
            os.environ[k] = v
        if allow_overlapping_devices:
            os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
        stand_in = symm_mem is not None
        if not stand_in:
            import torch.distributed._symmetric_memory as symm_mem
        elif device is None:
            raise ValueError("SymmTransport: a symm_mem stand-in needs device=")
        self._symm = symm_mem   # (tests pass a CPU stand-in with the same API: tests/test_ep_dist.py)
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world = _group_info(group)
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        if self.device.type != "cuda" and not stand_in:
            raise ValueError(f"SymmTransport needs a CUDA device, got {self.device}")
        self.timeout_s = float(timeout_s)
        self._handles: dict[str, Any] = {}
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:   # needed by older torch, harmless (or a no-op) on newer
            try:
                enable(self.group.group_name)
            except Exception:   # noqa: BLE001 -- deprecated forms may refuse a second call
                pass
        self.alloc("_signal", (1,), torch.int32)   # the handle whose signal pads the barrier uses

    def _map(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
        numel = 1
        for s in shape:
            numel *= s
        t = self._symm.empty(max(numel, 1), dtype=dtype, device=self.device)
        h = self._symm.rendezvous(t, self.group)
        # multicast_ptr: the handle's NVLink multicast address, 0 when none was set up (has_multicast_support is
        # torch's static query of a device, (device type, index) -> bool, not the handle's state)
        if int(getattr(h, "multicast_ptr", 0) or 0):
            raise RuntimeError("mokgen ep: symmetric memory set up NVLink multicast; it must stay off "
                               "(TORCH_SYMM_MEM_DISABLE_MULTICAST=1 before the first rendezvous)")
        self._handles[name] = h
        n = max(numel, 1)
        # this tensor's place in its symmetric block: the handle's offset (torch's mempool may place it inside a
        # block); get_buffer views start at the block's base or at the offset, depending on the version: check
        off = int(getattr(h, "offset", 0))
        base = h.get_buffer(self.rank, (n,), dtype, 0).data_ptr()
        if base == t.data_ptr():
            extra = 0
        elif base + off == t.data_ptr() and off % t.element_size() == 0:
            extra = off // t.element_size()
        else:
            raise RuntimeError(f"mokgen ep: symmetric buffer {name!r}: get_buffer({self.rank}) at {base:#x}, offset "
                               f"{off}, the tensor at {t.data_ptr():#x}")
        if t.data_ptr() not in (int(h.buffer_ptrs[self.rank]), int(h.buffer_ptrs[self.rank]) + off):
            raise RuntimeError(f"mokgen ep: symmetric buffer {name!r}: buffer_ptrs[{self.rank}] + offset != the "
                               "tensor's address")
        peers = [h.get_buffer(r, (n,), dtype, extra)[:numel].view(shape) for r in range(self.world)]
        peers[self.rank] = t[:numel].view(shape)
        return peers

    def barrier(self, phase: str) -> None:
        self._check_usable()
        ch = PHASES.index(phase) if phase in PHASES else len(PHASES)
        self._handles["_signal"].barrier(channel=ch, timeout_ms=int(self.timeout_s * 1000))

    @staticmethod
    def describe_failure(exc: BaseException) -> str:
        """One line for a CUDA error after a barrier timeout (the device's message, printed above it, names the
        ranks and the channel: channel i is PHASES[i])."""
        chans = ", ".join(f"{i}: {p}" for i, p in enumerate(PHASES))
        return (f"mokgen ep: a CUDA error after the EP phases ({exc}); if the device printed "
                f"'CUDASymmetricMemory::barrier ... failed ... from rank b on channel c', rank b did not arrive at "
                f"that phase (channels {chans})")


def make_transport(group: Any, device: torch.device, timeout_s: float = 30.0) -> Transport:
    """The transport for tensors on ``device``: symmetric memory on CUDA, shared-memory files on the CPU."""
    if device.type == "cuda":
        return SymmTransport(group, device, timeout_s)
    return ShmTransport(group, timeout_s)


def ep_buffers(layer: EPMoE, tokens_max: int) -> tuple[int, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """(receive capacity, {buffer: (shape, dtype)}) of one rank for at most ``tokens_max`` tokens per rank: what the
    phases read or write on peers. ``comb`` is the owner's [slot rows | row space] combine buffer (the forward's y
    rows and the backward's dx rows), ``dtw`` the owner's router gradients (T * K slots and a spare element)."""
    c, bm = layer.cfg, layer.bm
    R, K, H = c.ep, c.topk, c.hidden
    cap = recv_capacity([tokens_max] * R, tokens_max, c, bm)
    return cap, {"x": ((tokens_max, H), torch.bfloat16), "dy": ((tokens_max, H), torch.bfloat16),
                 "idx": ((tokens_max, K), torch.int32), "wt": ((tokens_max, K), torch.float32),
                 "ntok": ((1,), torch.int32), "comb": ((tokens_max * K + cap, H), torch.bfloat16),
                 "dtw": ((tokens_max * K + 1,), torch.float32)}


class EPRank:
    """This process's rank of the EP layer ``layer`` (an :class:`~mokgen.ep_ops.EPMoE`: the kernels and the phase
    code) over ``transport`` (its group's size must be ``spec.ep``). ``tokens_max``: the most tokens a rank
    passes (default ``spec.tokens``); the buffers are sized for it."""

    def __init__(self, layer: EPMoE, transport: Transport, tokens_max: int | None = None):
        c = layer.cfg
        if transport.world != c.ep:
            raise ValueError(f"mokgen ep: the group has {transport.world} ranks, the spec's ep is {c.ep}")
        self.layer, self.tp = layer, transport
        self.rank, self.ranks = transport.rank, transport.world
        self.tokens_max = int(c.tokens if tokens_max is None else tokens_max)
        self.cap, bufs = ep_buffers(layer, self.tokens_max)
        for name, (shape, dt) in bufs.items():
            transport.alloc(name, shape, dt)
        self.last_meta: torch.Tensor | None = None

    def _tokens(self, x: torch.Tensor) -> int:
        T = int(x.shape[0]) if x.dim() == 2 else -1
        if T > self.tokens_max:
            raise MoEInputError(f"ep: rank {self.rank} has {T} tokens, more than the {self.tokens_max} its EP "
                                "buffers hold (spec.tokens, or tokens_max=)")
        return T

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, w1: torch.Tensor,
                w2: torch.Tensor, b1: torch.Tensor | None = None, b2: torch.Tensor | None = None, *,
                training: bool = False, check: bool = False, num_ctas: int | None = None
                ) -> tuple[torch.Tensor, EPSaved | None]:
        """(y [T, H], saved for :meth:`backward` when ``training``) of this rank's tokens ``x [T, H]`` with their
        global top-k ids and weights; ``w1`` / ``w2`` (``b1`` / ``b2``): its L experts then the S shared ones.
        Collective: every rank of the group calls it."""
        L, tp, me = self.layer, self.tp, self.rank
        if training:
            L._need_training()
        dev = x.device
        if dev != tp.device:
            raise MoEInputError(f"ep: rank {me}'s tensors are on {dev}, its transport's buffers on {tp.device}")
        L.check_rank(me, dev, x, topk_idx, topk_weight, w1, w2, b1, b2)
        T = self._tokens(x)
        K, H = L.cfg.topk, L.cfg.hidden
        num_ctas = L._num_ctas(dev, num_ctas)
        # publish: this rank's tokens, routing and token count, readable by every peer after the barrier
        tp.local("x")[:T].copy_(x)
        tp.local("idx")[:T].copy_(topk_idx)
        tp.local("wt")[:T].copy_(topk_weight)
        tp.local("ntok").fill_(T)
        tp.barrier("forward:publish")
        src_tokens = torch.cat([tp.peer("ntok", r) for r in range(self.ranks)])
        w = L.workspace(self.cap, T, dev, comb=tp.local("comb")[:T * K + self.cap])
        L.phase_routing(me, w, tp.ptrs("idx"), tp.ptrs("wt"), src_tokens)
        L.phase_experts(w, tp.ptrs("x"), w1, w2, b1, b2, num_ctas, training)
        L.phase_push(w, tp.ptrs("comb"))
        tp.barrier("forward:push")
        y = torch.empty((T, H), dtype=torch.bfloat16, device=dev)
        L.phase_combine(w, y)
        self.last_meta = w["meta"]
        L.check_meta([w["meta"]], check)
        return y, (EPSaved([L.saved_of(w)], [self.cap], [T]) if training else None)

    def backward(self, dy: torch.Tensor, saved: EPSaved, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                 b1: torch.Tensor | None = None, b2: torch.Tensor | None = None, *, num_ctas: int | None = None):
        """This rank's :class:`mokgen.reference.Grads` (dx, dtopk_weight, its experts' dW1 / dW2, db1 / db2) for
        ``dy [T, H]`` of one training :meth:`forward` (``saved``) with the same ``x`` and weights. Collective."""
        L, tp, me = self.layer, self.tp, self.rank
        L._need_training()
        T, sv, cap = saved.tokens[0], saved.ranks[0], saved.caps[0]
        c = L.cfg
        K, H = c.topk, c.hidden
        if tuple(dy.shape) != (T, H) or dy.dtype != torch.bfloat16 or dy.device != tp.device:
            raise MoEInputError(f"ep: rank {me}'s dy must be bf16 [{T}, {H}] on {tp.device}, got {dy.dtype} "
                                f"{list(dy.shape)} on {dy.device}")
        num_ctas = L._num_ctas(dy.device, num_ctas)
        # publish: dy and x again (another layer's forward may have used the buffers), a zeroed router gradient
        tp.local("dy")[:T].copy_(dy)
        tp.local("x")[:T].copy_(x)
        tp.local("dtw").zero_()
        tp.barrier("backward:publish")
        comb = tp.local("comb")[:T * K + cap]
        part = L.phase_bwd_experts(sv, cap, T, tp.ptrs("dy"), tp.ptrs("x"), comb[T * K:], w1, w2, b2,
                                   b1 is not None, num_ctas)
        spare = [self.tokens_max * K] * self.ranks
        L.phase_bwd_push(sv, part, tp.ptrs("comb"), [tp.peer("dtw", r) for r in range(self.ranks)], spare)
        tp.barrier("backward:push")
        return L.phase_bwd_combine(sv, part, comb, tp.local("dtw"), T)


class _EPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_idx, topk_weight, w1, w2, b1, b2, step, check, num_ctas):   # noqa: D401
        y, saved = step.forward(x, topk_idx, topk_weight, w1, w2, b1, b2, training=True, check=check,
                                num_ctas=num_ctas)
        ctx.step, ctx.ep_saved, ctx.num_ctas = step, saved, num_ctas
        ctx.save_for_backward(x, w1, w2, b1, b2)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w1, w2, b1, b2 = ctx.saved_tensors
        g = ctx.step.backward(dy.to(torch.bfloat16).contiguous(), ctx.ep_saved, x, w1, w2, b1, b2,
                              num_ctas=ctx.num_ctas)
        ctx.ep_saved = None
        return g.x, None, g.topk_weight, g.w1, g.w2, g.b1, g.b2, None, None, None


def ep_moe_forward(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, w1: torch.Tensor,
                   w2: torch.Tensor, b1: torch.Tensor | None, b2: torch.Tensor | None, step: EPRank, *,
                   check: bool = False, num_ctas: int | None = None) -> torch.Tensor:
    """y [T, H] of this rank's EP layer; differentiable in x, topk_weight, w1, w2 (b1, b2) when grad is enabled
    and any of them requires it (then the layer's training kernels run and ``backward`` is collective: every rank
    must run it). Otherwise the inference kernels."""
    need = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (x, topk_weight, w1, w2, b1, b2))
    if need:
        return _EPFunction.apply(x, topk_idx, topk_weight, w1, w2, b1, b2, step, check, num_ctas)
    with torch.no_grad():
        return step.forward(x, topk_idx, topk_weight, w1, w2, b1, b2, training=False, check=check,
                            num_ctas=num_ctas)[0]
