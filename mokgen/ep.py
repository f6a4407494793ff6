"""Expert parallelism across ranks (issue 22): the plan of the pull-dispatch / push-combine protocol and its
float64 reference, on the CPU. No kernel uses this yet; the multi-GPU kernels will be tested against it.

The protocol (MoK's, restated for mokgen's row layout): ``R = spec.ep`` ranks, each with ``T`` tokens of its own,
their *global* top-k ids (expert ``e`` lives on rank ``e // L``, ``L = spec.local_experts``) and the ``S`` shared
experts replicated on every rank.

* **Dispatch (pull).** Destination rank ``d`` reads, from every source rank ``s`` in the fixed order
  ``s = 0 .. R-1``, the rows of the slots ``(t, k)`` routed to its experts, in ``(t, k)`` order, into its receive
  buffer; inside the buffer rows are grouped by local expert (the single-GPU layer's padded row space: each
  group padded to the routing tile ``bm``), source rank by source rank within a group. The order depends only
  on the routing, never on arrival times: the kernels may signal per (source, chunk) in any order.
* **Experts.** Rank ``d`` runs its local experts on its receive buffer (mokgen's single-GPU GEMMs), the shared
  experts on its own tokens.
* **Combine (push).** Each received row's output (already scaled by its routing weight) is written back into
  the owner's slot buffer ``ys[s][t, k]``; the owner sums ``k = 0 .. K-1`` in order, then the shared experts,
  as the single-GPU combine does. Bitwise deterministic, independent of the rank count's interleaving.

Sizes (:class:`EPPlan`): the worst case a rank can receive is every slot of every rank routed to it,
``R * T * min(K, L)`` rows (a token's top-k ids are distinct, so at most ``min(K, L)`` of them land on one rank),
plus ``L * (bm - 1)`` padding rows: a receive buffer of that many rows never drops a token and needs no host
sync; the ring holds ``ring_chunks`` chunks of ``chunk_rows`` rows (the single-GPU plan's MoK chunk: at least two
SM waves of each GEMM's tiles) when the worst case is too large to keep whole, with back-pressure per chunk.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from . import reference as R

__all__ = ["EPPlan", "plan_ep", "DispatchLayout", "dispatch_layout", "forward_ep", "gather_problem"]

# the receive ring's budget per rank when the worst case is larger (bf16 rows of x and of the outputs)
RING_BYTES_MAX = 4 << 30


@dataclass(frozen=True)
class EPPlan:
    ranks: int
    tokens_per_rank: int
    local_experts: int
    bm: int
    chunk_rows: int           # MoK overlap granularity (>= 2 SM waves of each GEMM): the signalling unit
    worst_rows: int           # every slot of every rank routed to one rank: R * T * min(K, L)
    recv_rows: int            # worst_rows + per-group padding, rounded up to bm: never drops a token
    ring_chunks: int          # chunks the receive ring holds (all of recv_rows when it fits RING_BYTES_MAX)
    ring_rows: int            # ring_chunks * chunk_rows
    bytes_per_row: int        # a row of x (dispatch) plus a row of output (combine), bf16

    @property
    def whole(self) -> bool:
        """Does the ring hold the worst case whole (no back-pressure ever)?"""
        return self.ring_rows >= self.recv_rows

    def describe(self) -> list[str]:
        mib = self.ring_rows * self.bytes_per_row / 2**20
        return [f"EP {self.ranks} ranks x {self.tokens_per_rank} tokens, {self.local_experts} experts per rank",
                f"  worst case per rank: R*T*min(K, L) = {self.worst_rows} rows (+ padding -> {self.recv_rows})",
                f"  chunk = {self.chunk_rows} rows (>= 2 SM waves per GEMM); ring = {self.ring_chunks} chunks = "
                f"{self.ring_rows} rows ({mib:.0f} MiB), " + ("the whole worst case" if self.whole else
                                                             "back-pressure per chunk past that")]


def plan_ep(spec: Any, plan: Any, ring_bytes_max: int = RING_BYTES_MAX) -> EPPlan:
    """The EP sizes of ``spec`` (``spec.ep`` ranks of ``spec.tokens`` tokens) with its single-GPU ``plan`` (the
    routing tile ``plan.bm`` and the MoK chunk ``plan.chunk_rows``)."""
    c = R.layer_config(spec)
    ranks, T, L, K = c.ep, c.tokens, c.local_experts, c.topk
    if ranks < 1 or T < 0:
        raise ValueError(f"ep: need ranks >= 1 and tokens >= 0, got {ranks}, {T}")
    bm, chunk = int(plan.bm), int(plan.chunk_rows)
    worst = ranks * T * min(K, L)
    recv = -(-(worst + L * (bm - 1)) // bm) * bm
    row_bytes = 2 * c.hidden * 2
    fit = max(1, ring_bytes_max // (chunk * row_bytes))
    chunks = min(-(-recv // chunk), fit)
    return EPPlan(ranks, T, L, bm, chunk, worst, recv, chunks, chunks * chunk, row_bytes)


@dataclass(frozen=True)
class DispatchLayout:
    """Where every routed slot goes: for destination rank d, ``rows[d]`` lists (source rank, token, k, local
    expert) in the receive buffer's order; ``group_start[d]`` the first padded row of each local expert's group;
    ``recv_pos[s][t, k]`` the received row of slot (t, k) of source s on its destination (-1: none)."""

    rows: list[list[tuple[int, int, int, int]]]
    group_start: list[list[int]]
    recv_pos: list[torch.Tensor]


def dispatch_layout(topk_idx: Sequence[torch.Tensor], local_experts: int, bm: int) -> DispatchLayout:
    """The deterministic pull order for global ids ``topk_idx[s]`` ([T_s, K] per source rank s)."""
    ranks = len(topk_idx)
    L = local_experts
    for s, idx in enumerate(topk_idx):
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= ranks * L):
            raise ValueError(f"ep: rank {s}'s topk_idx has ids outside [0, {ranks * L})")
    rows: list[list[tuple[int, int, int, int]]] = []
    starts: list[list[int]] = []
    recv_pos = [torch.full(idx.shape, -1, dtype=torch.int64) for idx in topk_idx]
    for d in range(ranks):
        out: list[tuple[int, int, int, int]] = []
        gs = []
        for e in range(L):
            gs.append(len(out))
            for s, idx in enumerate(topk_idx):
                hit = (idx.long() == d * L + e).nonzero().tolist()    # (t, k) in row-major order
                for t, k in hit:
                    recv_pos[s][t, k] = len(out)
                    out.append((s, t, k, e))
            pad = -len(out) % bm
            out.extend([(-1, -1, -1, e)] * pad)
        rows.append(out)
        starts.append(gs + [len(out)])
    return DispatchLayout(rows, starts, recv_pos)


def forward_ep(x: Sequence[torch.Tensor], topk_idx: Sequence[torch.Tensor], topk_weight: Sequence[torch.Tensor],
               w1: Sequence[torch.Tensor], w2: Sequence[torch.Tensor], spec: Any, b1=None, b2=None, *,
               bm: int = 128, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    """The EP layer of ``len(x)`` ranks by the protocol above, in ``dtype``: per rank its y [T_r, H]. ``w1[r]`` /
    ``w2[r]`` (and ``b1[r]`` / ``b2[r]``) are rank r's groups: its L local experts then the S shared ones, as the
    single-GPU layer's weights. Its result equals :func:`mokgen.reference.forward` on the gathered problem
    (:func:`gather_problem`) up to the float64 rounding of the sums' order."""
    c = R.layer_config(spec)
    ranks, L, S, K = len(x), c.local_experts, c.shared_experts, c.topk
    lay = dispatch_layout(topk_idx, L, bm)
    ys = [torch.zeros(*idx.shape, xr.shape[1], dtype=dtype) for xr, idx in zip(x, topk_idx)]
    for d in range(ranks):
        W1, W2 = w1[d].to(dtype), w2[d].to(dtype)
        for e in range(L):
            r0, r1 = lay.group_start[d][e], lay.group_start[d][e + 1]
            real = [r for r in lay.rows[d][r0:r1] if r[0] >= 0]
            if not real:
                continue
            xg = torch.stack([x[s][t].to(dtype) for s, t, _, _ in real])      # the pull
            o = _expert(xg, W1[e], W2[e], None if b1 is None else b1[d][e], None if b2 is None else b2[d][e], c,
                        dtype)
            for (s, t, k, _), row in zip(real, o):                            # the push, scaled
                ys[s][t, k] = row * topk_weight[s][t, k].to(dtype)
    out = []
    for r in range(ranks):
        y = torch.zeros(x[r].shape[0], x[r].shape[1], dtype=dtype)
        for k in range(K):                                                    # the owner's fixed-order sum
            y = y + ys[r][:, k]
        for si in range(S):
            y = y + _expert(x[r].to(dtype), w1[r][L + si].to(dtype), w2[r][L + si].to(dtype),
                            None if b1 is None else b1[r][L + si], None if b2 is None else b2[r][L + si], c, dtype)
        out.append(y)
    return out


def _expert(xg, w1e, w2e, b1e, b2e, cfg, dtype):
    z = xg @ w1e.t()
    if b1e is not None:
        z = z + b1e.to(dtype)
    gate, up = R._split_gate_up(z, cfg.gate_up_layout)
    o = R._activation(gate, up, cfg) @ w2e.t()
    if b2e is not None:
        o = o + b2e.to(dtype)
    return o


def gather_problem(x, topk_idx, topk_weight, w1, w2, spec, b1=None, b2=None):
    """The single-GPU problem the EP layer computes: every rank's tokens concatenated, all ``R * L`` experts with
    the global ids, then the shared experts (rank 0's copy): ``(x, topk_idx, topk_weight, w1, w2, b1, b2, cfg)``
    for :func:`mokgen.reference.forward`."""
    c = R.layer_config(spec)
    L, S = c.local_experts, c.shared_experts
    ranks = len(x)
    cat = lambda ts: torch.cat(list(ts), 0)   # noqa: E731
    W1 = torch.cat([w[:L] for w in w1] + [w1[0][L:L + S]], 0)
    W2 = torch.cat([w[:L] for w in w2] + [w2[0][L:L + S]], 0)
    B1 = None if b1 is None else torch.cat([b[:L] for b in b1] + [b1[0][L:L + S]], 0)
    B2 = None if b2 is None else torch.cat([b[:L] for b in b2] + [b2[0][L:L + S]], 0)
    g = R.LayerConfig(**{**c.__dict__, "ep": 1, "experts": ranks * L, "tokens": sum(t.shape[0] for t in x)})
    return cat(x), cat(topk_idx), cat(topk_weight), W1, W2, B1, B2, g


def check_gathered(y_ep: Sequence[torch.Tensor], y_single: torch.Tensor) -> float:
    """The largest relative difference between the ranks' outputs, concatenated, and the single-GPU result."""
    y = torch.cat(list(y_ep), 0)
    return R.rel_err(y, y_single) if y.numel() else 0.0 if y_single.numel() == 0 else math.inf
