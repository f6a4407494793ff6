"""Stand-ins for the experts modules of torchtitan and Megatron-core, written from their documented contracts
(not copied): the parameter names, shapes and call signatures mokgen's adapters read, and the function each
module computes, in plain torch, in the parameters' dtype (float64 in the tests: an exact reference).

Used by tests/test_torchtitan.py and tests/test_megatron.py where the real package is not importable:
megatron-core 0.19.2 requires Python >= 3.12 (this project's machines run 3.11); torchtitan 0.3.0 installs but
imports ``triton`` (undeclared; not present beside the CPU wheel of torch). Where the real module imports, the
tests run against it too.

torchtitan 0.3.0, ``torchtitan/models/common/moe.py``:

* ``GroupedExperts(GroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E))``, parameters ``w1_EFD [E, F, D]``
  (gate), ``w2_EDF [E, D, F]`` (down), ``w3_EFD [E, F, D]`` (up);
* ``forward(x_RD [R, D], num_tokens_per_expert_E [E]) -> [R, D]``: rows sorted by expert,
  ``silu(x W1[e]^T) * (x W3[e]^T)`` then ``W2[e]^T``; no routing scores (torchtitan's dispatcher applies them
  in ``combine``).

Megatron-core 0.19.2, ``megatron/core/transformer/moe/experts.py`` and ``transformer/mlp.py``:

* ``TEGroupedMLP(num_local_experts, config, submodules, pg_collection)``: ``linear_fc1`` / ``linear_fc2`` are TE
  GroupedLinear modules with one parameter per expert, ``weight{i} [out, in]`` (fc1 ``[2F, H]`` with GLU, fc2
  ``[H, F]``), ``bias{i}`` with ``add_bias_linear``; fc1 adds its bias, fc2 returns its biases apart
  (``skip_bias_add``);
* ``SequentialMLP``: ``local_experts[i]`` are MLPs with ``linear_fc1.weight [2F, H]``, ``linear_fc2.weight
  [H, F]`` (and biases);
* ``forward(permuted_local_hidden_states [N, H], tokens_per_expert [E], permuted_probs [N]) -> (output, None)``:
  counts read on the host; with ``moe_apply_probs_on_input`` (top-1) x is scaled by the probs first and the
  probs become 1; fc1; GLU ``act(first half, clamped above) * (second half, clamped, + glu_linear_offset)``
  (``moe_mlp_glu_interleave_size`` s: blocks of s gate and s up features alternate); activation times the prob,
  cast back to the activation's dtype; fc2; plus fc2's bias times the prob.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F


# --------------------------------------------------------------------------------------------------------------
# torchtitan


class GroupedExperts(torch.nn.Module):
    """torchtitan 0.3.0's ``GroupedExperts`` contract (names, shapes, call), computed by a loop over experts."""

    @dataclass(kw_only=True)
    class Config:
        dim: int
        hidden_dim: int
        num_experts: int

    def __init__(self, config: "GroupedExperts.Config", dtype: torch.dtype = torch.float32):
        super().__init__()
        E, F_, D = config.num_experts, config.hidden_dim, config.dim
        self.num_experts = E
        self.w1_EFD = torch.nn.Parameter(torch.empty(E, F_, D, dtype=dtype))
        self.w2_EDF = torch.nn.Parameter(torch.empty(E, D, F_, dtype=dtype))
        self.w3_EFD = torch.nn.Parameter(torch.empty(E, F_, D, dtype=dtype))

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        outs, start = [], 0
        for e, n in enumerate(num_tokens_per_expert_E.tolist()):
            xe = x_RD[start:start + n]
            h = F.silu(xe @ self.w1_EFD[e].t()) * (xe @ self.w3_EFD[e].t())
            outs.append(h @ self.w2_EDF[e].t())
            start += n
        return torch.cat(outs).type_as(x_RD) if outs else x_RD.new_zeros(x_RD.shape)


# --------------------------------------------------------------------------------------------------------------
# Megatron-core


def quick_gelu(y: torch.Tensor) -> torch.Tensor:
    """Megatron's sigmoid approximation of GELU: ``y * sigmoid(1.702 y)``."""
    return y * torch.sigmoid(1.702 * y)


@dataclass
class TransformerConfig:
    """The TransformerConfig fields Megatron's experts read (defaults as Megatron's)."""

    hidden_size: int
    moe_ffn_hidden_size: int
    num_moe_experts: int
    moe_router_topk: int = 2
    gated_linear_unit: bool = True
    activation_func: Callable[[torch.Tensor], torch.Tensor] = F.silu
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: float | None = None
    add_bias_linear: bool = False
    moe_apply_probs_on_input: bool = False
    moe_mlp_glu_interleave_size: int | None = None
    fp8: str | None = None
    fp4: str | None = None
    use_te_activation_func: bool = False
    bias_activation_fusion: bool = False
    params_dtype: torch.dtype = torch.float32


def _glu(h: torch.Tensor, cfg: TransformerConfig) -> torch.Tensor:
    s = cfg.moe_mlp_glu_interleave_size
    if s is not None:   # [.., (gate s, up s) blocks] -> [.., gates | ups]
        n = h.shape[-1]
        h = h.reshape(-1, n // (2 * s), 2, s).transpose(1, 2).reshape(h.shape)
    gate, lin = torch.chunk(h, 2, dim=-1)
    if cfg.activation_func_clamp_value is not None:
        v = cfg.activation_func_clamp_value
        gate = gate.clamp(max=v)
        lin = lin.clamp(min=-v, max=v)
    return cfg.activation_func(gate) * (lin + cfg.glu_linear_offset)


class GroupedLinear(torch.nn.Module):
    """TE GroupedLinear's parameter layout (``weight{i} [out, in]``, ``bias{i} [out]``) and call
    ``(x, m_splits) -> (y, biases or None)``."""

    def __init__(self, num_gemms: int, in_features: int, out_features: int, *, bias: bool, skip_bias_add: bool,
                 dtype: torch.dtype):
        super().__init__()
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias, self.skip_bias_add = bias, skip_bias_add
        self.single_grouped_weight = False
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(torch.empty(out_features, in_features,
                                                                                 dtype=dtype)))
            if bias:
                self.register_parameter(f"bias{i}", torch.nn.Parameter(torch.empty(out_features, dtype=dtype)))

    def forward(self, x: torch.Tensor, m_splits: list[int]) -> tuple[torch.Tensor, Any]:
        outs = []
        for i, xi in enumerate(torch.split(x, m_splits)):
            y = xi @ getattr(self, f"weight{i}").t()
            if self.use_bias and not self.skip_bias_add:
                y = y + getattr(self, f"bias{i}")
            outs.append(y)
        y = torch.cat(outs) if outs else x.new_zeros((0, self.out_features))
        if self.use_bias and self.skip_bias_add:
            return y, [getattr(self, f"bias{i}") for i in range(self.num_gemms)]
        return y, None


class TEGroupedMLP(torch.nn.Module):
    """Megatron-core 0.19.2's ``TEGroupedMLP`` contract (unfused path)."""

    def __init__(self, num_local_experts: int, config: TransformerConfig):
        super().__init__()
        self.config, self.num_local_experts = config, num_local_experts
        ffn = config.moe_ffn_hidden_size * (2 if config.gated_linear_unit else 1)
        dt = config.params_dtype
        self.linear_fc1 = GroupedLinear(num_local_experts, config.hidden_size, ffn, bias=config.add_bias_linear,
                                        skip_bias_add=False, dtype=dt)
        self.linear_fc2 = GroupedLinear(num_local_experts, config.moe_ffn_hidden_size, config.hidden_size,
                                        bias=config.add_bias_linear, skip_bias_add=True, dtype=dt)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor, output_buffer=None, grad_input_buffer=None):
        assert output_buffer is None and grad_input_buffer is None
        cfg = self.config
        counts = tokens_per_expert.tolist()
        x = permuted_local_hidden_states
        probs = permuted_probs.unsqueeze(-1)
        if cfg.moe_apply_probs_on_input:
            assert cfg.moe_router_topk == 1
            x = (probs * x).to(x.dtype)
            probs = torch.ones_like(probs)
        h, _ = self.linear_fc1(x, counts)
        a = _glu(h, cfg) if cfg.gated_linear_unit else cfg.activation_func(h)
        a = (a * probs).to(a.dtype)
        out, biases = self.linear_fc2(a, counts)
        if biases is not None:
            parts = [t + b * p for t, b, p in zip(torch.split(out, counts), biases, torch.split(probs, counts))]
            out = torch.cat(parts).to(out.dtype)
        return out, None


class Linear(torch.nn.Module):
    """Megatron's Column/RowParallelLinear at TP 1: ``weight [out, in]``, ``bias [out]``; returns ``(y, bias)``
    with the bias apart when ``skip_bias_add``."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, skip_bias_add: bool, dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.skip_bias_add = skip_bias_add

    def forward(self, x):
        y = x @ self.weight.t()
        if self.bias is not None and not self.skip_bias_add:
            return y + self.bias, None
        return y, self.bias


class MLP(torch.nn.Module):
    """Megatron's expert MLP: ``forward(hidden_states, per_token_scale) -> (y, None)`` (fc2's bias, scaled by the
    per-token scale, added to the output)."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        F_ = config.moe_ffn_hidden_size
        dt = config.params_dtype
        self.linear_fc1 = Linear(config.hidden_size, 2 * F_ if config.gated_linear_unit else F_,
                                 bias=config.add_bias_linear, skip_bias_add=False, dtype=dt)
        self.linear_fc2 = Linear(F_, config.hidden_size, bias=config.add_bias_linear, skip_bias_add=True, dtype=dt)

    def forward(self, hidden_states, per_token_scale=None):
        cfg = self.config
        h, _ = self.linear_fc1(hidden_states)
        a = _glu(h, cfg) if cfg.gated_linear_unit else cfg.activation_func(h)
        if per_token_scale is not None:
            a = (a * per_token_scale.unsqueeze(-1)).to(a.dtype)
        out, bias = self.linear_fc2(a)
        if per_token_scale is not None and bias is not None:
            out = out + bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)
            bias = None
        return out, bias


class SequentialMLP(torch.nn.Module):
    """Megatron-core 0.19.2's ``SequentialMLP`` contract."""

    def __init__(self, num_local_experts: int, config: TransformerConfig):
        super().__init__()
        self.config, self.num_local_experts = config, num_local_experts
        self.local_experts = torch.nn.ModuleList(MLP(config) for _ in range(num_local_experts))

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        cfg = self.config
        x, probs = permuted_local_hidden_states, permuted_probs
        if cfg.moe_apply_probs_on_input:
            assert cfg.moe_router_topk == 1
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = torch.ones_like(probs)
        if self.num_local_experts == 1:
            return self.local_experts[0](x, probs)
        counts = tokens_per_expert.tolist()
        outs = [e(t, p)[0] for e, t, p in zip(self.local_experts, torch.split(x, counts), torch.split(probs, counts))]
        return torch.cat(outs), None
