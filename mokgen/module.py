"""``mokgen.MoE``: one rank's MoE layer as a ``torch.nn.Module`` owning its expert weights.

Above both the runtime (:mod:`mokgen.ops`: kernels, torch ops, autograd) and the driver (:mod:`mokgen.driver`:
spec -> plan -> cache/build -> :class:`~mokgen.ops.CompiledMoE`), which it uses in that order: the kernels are
compiled or loaded through the driver on the first forward (the driver imports the compiler only when it must
build), unless ``compiled=`` hands them in. The runtime never imports this module or the driver.
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping

import torch

from .ops import CompiledMoE, moe_forward, register_ops
from .reference import layer_config

__all__ = ["MoE"]


def _as_spec(spec: Any) -> Any:
    if isinstance(spec, (str, os.PathLike, Mapping)):
        from .spec import load_spec

        return load_spec(spec)
    return spec


class MoE(torch.nn.Module):
    """One rank's MoE layer with its expert weights as Parameters.

    ``w1 [G, 2I, H]``, ``w2 [G, H, I]`` (``dtype``, bf16) and, when ``spec.bias``, ``b1 [G, 2I]``, ``b2 [G, H]``
    (fp32), initialized like :func:`mokgen.reference.random_inputs` (N(0, 1/fan_in); biases N(0, 0.01)) from the
    global torch RNG. The kernels are compiled (or loaded from the cache) on the first forward, unless
    ``compiled=`` is given. ``loss.backward()`` runs the generated backward kernels. With ``main_grad=True``,
    where ``w1.main_grad`` / ``w2.main_grad`` (fp32, the weights' shapes) exist, the weight gradients are added into
    them (Megatron-style fp32 accumulation) and ``w1.grad`` / ``w2.grad`` stay None.

    Expert parallelism (``group=``, a process group of ``spec.ep`` ranks, e.g. under ``torchrun``): the module is
    this rank's part of the layer, its L local experts then the S shared ones as Parameters (the same shapes).
    ``forward(x, topk_idx, topk_weight)`` takes this rank's tokens (at most ``spec.tokens``) with *global* top-k
    ids and returns their combined y; it is collective (every rank of the group calls it, and ``backward`` too).
    The EP buffers and barrier come from :func:`mokgen.ep_dist.make_transport` on the first forward (torch
    symmetric memory on CUDA, shared-memory files on the CPU) unless ``transport=`` is given; the kernels from the
    compiled entry (``mokgen.ep_ops.EPMoE``) unless ``ep_layer=`` is given (e.g. the CPU reference kernels).
    A shared expert's gradient covers this rank's tokens (sum the replicas' gradients as data-parallel ones).
    """

    def __init__(self, spec: Any, arch: str | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.bfloat16, *, compiled: CompiledMoE | None = None,
                 main_grad: bool = False, group: Any = None, ep_layer: Any = None, transport: Any = None,
                 ep_timeout_s: float = 30.0):
        super().__init__()
        if dtype != torch.bfloat16:
            raise ValueError(f"mokgen.MoE: only bfloat16 expert weights are supported, got {dtype}")
        register_ops()   # before any torch.compile tracing of this module
        self.spec = _as_spec(spec)
        self.cfg = layer_config(self.spec)
        self.arch = arch
        self._compiled = compiled
        self.main_grad = bool(main_grad)
        c = self.cfg
        self.group, self._ep_layer, self._transport, self._ep_step = group, ep_layer, transport, None
        self.ep_timeout_s = float(ep_timeout_s)
        self.ep_check = False   # EP: raise RoutingError on ids out of range (a host sync)
        if group is not None and main_grad:
            raise ValueError("mokgen.MoE: main_grad with expert parallelism (group=) is not supported")
        G, H, I = c.groups, c.hidden, c.ffn
        self.w1 = torch.nn.Parameter(torch.empty(G, 2 * I, H, device=device, dtype=dtype))
        self.w2 = torch.nn.Parameter(torch.empty(G, H, I, device=device, dtype=dtype))
        if c.bias:
            self.b1 = torch.nn.Parameter(torch.empty(G, 2 * I, device=device, dtype=torch.float32))
            self.b2 = torch.nn.Parameter(torch.empty(G, H, device=device, dtype=torch.float32))
        else:
            self.register_parameter("b1", None)
            self.register_parameter("b2", None)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        c = self.cfg
        if self.w1.device.type == "meta":
            return
        self.w1.normal_(0.0, 1.0 / math.sqrt(c.hidden))
        self.w2.normal_(0.0, 1.0 / math.sqrt(c.ffn))
        if self.b1 is not None:
            self.b1.normal_(0.0, 0.1)
            self.b2.normal_(0.0, 0.1)

    @property
    def compiled(self) -> CompiledMoE:
        """The kernels (compiled or loaded on first use; touch this before ``torch.compile`` tracing)."""
        if self._compiled is None:
            if torch.compiler.is_compiling():
                # dynamo is tracing (so it is imported): load outside the graph (a graph break; an error under
                # fullgraph=True). Not a decorator on _compile: that would import torch._dynamo (and sympy) with
                # this module, ~1 s on every process that only loads cached kernels.
                torch.compiler.disable(MoE._compile)(self)
            else:
                self._compile()
        return self._compiled

    def _compile(self) -> None:
        from .driver import compile as _driver_compile  # the compiler side, imported on first use

        self._compiled = _driver_compile(self.spec, self.arch)

    def ep_step(self, device: torch.device) -> Any:
        """This rank's :class:`mokgen.ep_dist.EPRank` (built on the first EP forward: collective)."""
        if self._ep_step is None:
            from . import ep_dist
            from .ep_ops import EPMoE

            layer = self._ep_layer
            if layer is None:
                comp = self.compiled
                layer = EPMoE(self.spec, comp.plan, comp.entry_dir)
            tp = self._transport or ep_dist.make_transport(self.group, device, self.ep_timeout_s)
            self._ep_step = ep_dist.EPRank(layer, tp)
        return self._ep_step

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            from .ep_dist import ep_moe_forward

            return ep_moe_forward(x, topk_idx, topk_weight, self.w1, self.w2, self.b1, self.b2,
                                  self.ep_step(x.device), check=self.ep_check)
        mg1 = getattr(self.w1, "main_grad", None) if self.main_grad else None
        mg2 = getattr(self.w2, "main_grad", None) if self.main_grad else None
        return moe_forward(x, topk_idx, topk_weight, self.w1, self.w2, self.b1, self.b2, moe=self.compiled,
                           w1_main_grad=mg1, w2_main_grad=mg2)

    def check_errors(self) -> None:
        """See :meth:`CompiledMoE.check_errors`; under expert parallelism (``group=``) :meth:`mokgen.ep_ops.EPMoE.
        check_errors` (ids outside ``[0, ep * local experts)`` seen since the last check; one host sync)."""
        if self.group is not None:
            if self._ep_step is not None:
                self._ep_step.layer.check_errors()
            return
        if self._compiled is not None:
            self._compiled.check_errors()

    def extra_repr(self) -> str:
        c = self.cfg
        return (f"name={getattr(self.spec, 'name', '?')}, H={c.hidden}, I={c.ffn}, groups={c.groups} "
                f"({c.local_experts} local + {c.shared_experts} shared), topk={c.topk}, bias={c.bias}"
                + (f", ep={c.ep} (rank's part)" if self.group is not None else ""))
