"""A CPU stand-in for ``torch.distributed._symmetric_memory`` (tests only), so that mokgen.ep_dist.SymmTransport's
own logic runs on the CPU through the API it uses on GPUs, with that API's semantics as torch's sources define
them (torch/csrc/distributed/c10d/symm_mem: SymmetricMemory.cpp, CUDASymmetricMemory.cu):

* ``empty(n, dtype=, device=)`` places the tensor ``OFFSET`` bytes into a larger block (as the mempool path of
  ``empty`` can), so a transport that ignored the handle's ``offset`` would address the wrong bytes;
* ``rendezvous(t, group)`` (collective) maps every rank's block: ``buffer_ptrs`` are the blocks' bases, ``offset``
  the tensor's byte offset in its block, ``get_buffer(rank, sizes, dtype, storage_offset)`` counts
  ``storage_offset`` elements from the base of rank's block and checks the size;
* ``barrier(channel, timeout_ms)``: per peer, put a signal into the peer's pad at [channel, me] (waiting until the
  slot is free) and wait for the peer's at [channel, peer] in its own pad, then clear it; on a timeout it raises
  with the message the device prints before trapping.

Blocks and signal pads are /dev/shm files, unlinked once every rank has mapped them.
"""
from __future__ import annotations

import itertools
import os
import time
import uuid

import torch
import torch.distributed as dist

OFFSET = 256           # bytes: where empty() puts the tensor inside its block
CHANNELS = 16
_blocks: dict[int, tuple[str, torch.Tensor, int]] = {}   # tensor data_ptr -> (path, block bytes, nbytes)
_count = itertools.count()
_dir = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


def _shared(path: str, nbytes: int, create: bool) -> torch.Tensor:
    if create:
        with open(path, "wb") as f:
            f.truncate(nbytes)
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def empty(*size, dtype=None, device=None) -> torch.Tensor:
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        size = tuple(size[0])
    n = 1
    for s in size:
        n *= s
    dtype = dtype or torch.get_default_dtype()
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    path = os.path.join(_dir, f"fake-symm-{os.getpid()}-{uuid.uuid4().hex[:8]}-{next(_count)}")
    block = _shared(path, OFFSET + nbytes + 64, create=True)
    t = block[OFFSET:OFFSET + nbytes].view(dtype).view(size)
    _blocks[t.data_ptr()] = (path, block, nbytes)
    return t


class _Handle:
    def __init__(self, t: torch.Tensor, group):
        path, block, nbytes = _blocks[t.data_ptr()]
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        pad_path = path + "-pad"
        self._own_pad = _shared(pad_path, CHANNELS * self.world_size * 4, create=True)
        paths: list = [None] * self.world_size
        dist.all_gather_object(paths, path, group=group)
        self._blocks = [block if r == self.rank else _shared(p, OFFSET + nbytes + 64, create=False)
                        for r, p in enumerate(paths)]
        self._pads = [_shared(p + "-pad", CHANNELS * self.world_size * 4, create=False).view(torch.int32)
                      .view(CHANNELS, self.world_size) for p in paths]
        dist.barrier(group=group)
        os.unlink(path)
        os.unlink(pad_path)
        self.buffer_size = OFFSET + nbytes
        self.offset = OFFSET

    @property
    def buffer_ptrs(self) -> list[int]:
        return [b.data_ptr() for b in self._blocks]

    @staticmethod
    def has_multicast_support(device_type, device_index) -> bool:   # torch's: a device query, not the handle's state
        return False

    multicast_ptr = 0   # no NVLink multicast set up (the handle attribute SymmTransport checks)

    def get_buffer(self, rank, sizes, dtype, storage_offset=0) -> torch.Tensor:
        el = torch.empty((), dtype=dtype).element_size()
        n = 1
        for s in sizes:
            n *= s
        start = storage_offset * el
        if start + n * el > self.buffer_size:
            raise RuntimeError("SymmetricMemory::get_buffer: the requested size exceeds the allocated size")
        return self._blocks[rank][start:start + n * el].view(dtype).view(tuple(sizes))

    def barrier(self, channel: int = 0, timeout_ms: int = 0) -> None:
        deadline = time.monotonic() + timeout_ms / 1e3
        me = self.rank
        for peer in range(self.world_size):
            if peer == me:
                continue
            slot = self._pads[peer][channel]
            while int(slot[me]) != 0:          # the previous signal not yet consumed
                if timeout_ms and time.monotonic() > deadline:
                    raise RuntimeError(f"[FATAL] CUDASymmetricMemory::barrier: rank {me} failed to send signal "
                                       f"to rank {peer} on channel {channel}")
                time.sleep(1e-4)
            slot[me] = 1
        for peer in range(self.world_size):
            if peer == me:
                continue
            mine = self._pads[me][channel]
            while int(mine[peer]) != 1:
                if timeout_ms and time.monotonic() > deadline:
                    raise RuntimeError(f"[FATAL] CUDASymmetricMemory::barrier: rank {me} failed to receive signal "
                                       f"from rank {peer} on channel {channel}")
                time.sleep(1e-4)
            mine[peer] = 0


def rendezvous(tensor: torch.Tensor, group) -> _Handle:
    return _Handle(tensor, group)
