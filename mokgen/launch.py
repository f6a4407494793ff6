"""The stream and device the generated kernels launch on (runtime layer, used by ops, fp8_ops and mx_ops).

Every exported kernel launches on the TVM-FFI *environment stream* of its tensors' device. tvm-ffi >= 0.1.15 sets
that stream itself for each call whose arguments include torch CUDA tensors: to torch's current stream of the
first such tensor's device (its ``TVMFFIPyCallContext``: the DLPack exchange API's ``current_work_stream`` where
torch has it, torch >= 2.10, else ``torch._C._cuda_getCurrentRawStream``), and restores it after the call. So a
launch needs no ``tvm_ffi.use_torch_stream`` context around it, which cost the host tens of microseconds per entry
(forward, backward, every quantizer call; bench/NOTES.md v36). Older tvm-ffi builds get that context as before.

What is kept: the kernels' device must be the current CUDA device (the DSL launches in the current context), so a
call on a tensor of another device than the current one switches to it (``torch.cuda.device``), as the context did.
"""
from __future__ import annotations

import contextlib
import re
from typing import Any

import torch

_NULL = contextlib.nullcontext()
_CALL_SETS_STREAM: bool | None = None
# False: every launch gets tvm_ffi.use_torch_stream as before v36, whatever the tvm-ffi version (tools/graph_vs_eager.py
# --old-path times that host path beside the current one)
PER_CALL_STREAM = True


def ffi_call_sets_stream() -> bool:
    """Whether the installed tvm-ffi sets the environment stream per call from torch's current stream (>= 0.1.15)."""
    global _CALL_SETS_STREAM
    if not PER_CALL_STREAM:
        return False
    if _CALL_SETS_STREAM is None:
        import tvm_ffi

        v = tuple(int(p) for p in re.findall(r"\d+", getattr(tvm_ffi, "__version__", "0"))[:3])
        _CALL_SETS_STREAM = v >= (0, 1, 15)
    return _CALL_SETS_STREAM


def on_device(device: torch.device) -> Any:
    """The context for launching kernels on ``device``'s current torch stream (a no-op off CUDA)."""
    if device.type != "cuda":
        return _NULL
    if ffi_call_sets_stream():
        if device.index is None or device.index == torch.cuda.current_device():
            return _NULL
        return torch.cuda.device(device)
    import tvm_ffi

    return tvm_ffi.use_torch_stream(torch.cuda.device(device))


def on_stream(stream: "torch.cuda.Stream") -> Any:
    """The context for launching kernels on ``stream`` (a torch CUDA stream; it becomes torch's current stream)."""
    if ffi_call_sets_stream():
        return torch.cuda.stream(stream)
    import tvm_ffi

    return tvm_ffi.use_torch_stream(torch.cuda.stream(stream))
