"""Expert parallelism's runtime path (issue 22): the pull-dispatch / push-combine forward of ``R`` ranks, run as
simulated ranks in one process (one device, or the CPU with the reference kernels).

Per rank ``d`` (the protocol of :mod:`mokgen.ep`), kernels in this order, with a barrier between the phases:

1. ``ep_routing``: the destination's padded row space (groups ``0 .. L-1`` its routed experts, rows source rank by
   source rank in (t, k) order: :func:`mokgen.ep.dispatch_layout`'s order; groups ``L ..`` the shared experts over
   its own tokens) and, as owner, ``slot_pos`` into its combine buffer. Reads every source's ``topk_idx`` /
   ``topk_weight`` through their base addresses. On the device, no host sync.
2. ``ep_dispatch`` (the pull): ``xg[r]`` = row ``row_slot[r] // K`` of source ``row_rank[r]``'s x (base addresses);
   then the single-GPU ``gemm1`` and ``gemm2`` on ``xg`` (their argument tables: the EP layer's per-rank spec,
   ``G = L + S`` groups), GEMM 2 writing into the row-space part of the combine buffer.
3. ``ep_push``: each routed output row into its owner's slot rows ``ys_s[t * K + k]`` (base addresses).
4. the single-GPU ``combine`` on the owner's combine buffer ``[T * K slot rows | row space]``: slots 0 .. K-1 then
   the shared experts, in that order, fp32 sums.

A training step (:meth:`EPMoE.forward_train`, :meth:`EPMoE.backward`) mirrors it: the dO rows are pulled like x,
dx rows pushed like y, each row's router gradient scattered into its owner's slot.

Every row is computed by the same GEMM code as the single-GPU layer on the gathered problem (same rows, same
order inside each expert's group) and summed in the same order, so the outputs equal that layer's bit for bit,
and no result depends on the order in which the ranks run a phase (each slot has exactly one writer).

**Peer buffers** (:class:`PeerBuffers`) are what the kernels take: a ``[R]`` int64 device tensor of base addresses.
Here they are the ranks' own tensors on one device. The phases are methods of :class:`EPMoE` for one rank
(``workspace``, ``phase_routing``, ``phase_experts``, ``phase_push``, ``phase_combine``, ``phase_bwd_*``): the
simulated ranks loop over them; :mod:`mokgen.ep_dist` runs its own rank's, one rank per process, over a transport's
buffers (torch symmetric memory's peer addresses on GPUs, shared-memory files on the CPU) with a bounded barrier
between the phases. The reference kernels (:func:`reference_ep_kernels`, the CPU tests) resolve an address through the tensors
a :class:`PeerBuffers` registered (an unknown address is an error).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Mapping, Sequence

import torch

from . import reference as R
from .kernels import EP_KERNELS, bind, call
from .ops import MoEInputError, RoutingError, group_layout, group_sums, load_library, uses_gather_kernel

__all__ = ["PeerBuffers", "EPMoE", "EPSaved", "recv_capacity", "reference_ep_kernels", "ref_ep_routing",
           "ref_ep_dispatch", "ref_ep_push", "EP_LAYER_KERNELS", "EP_TRAIN_KERNELS"]

# what one rank launches: the EP kernels and the single-GPU GEMMs and combine; a training step also the single-GPU
# training GEMM 1 (z saved) and the backward's GEMMs
EP_LAYER_KERNELS = EP_KERNELS + ("gemm1", "gemm2", "combine")
EP_TRAIN_KERNELS = ("gemm1_train", "dgrad1", "dgrad2", "wgrad1", "wgrad2")

_ADDRESSES: "weakref.WeakValueDictionary[tuple[str, int], torch.Tensor]" = weakref.WeakValueDictionary()


class PeerBuffers:
    """``R`` ranks' buffers of one kind as the EP kernels take them: ``ptrs``, a ``[R]`` int64 tensor of base
    addresses on ``device`` (rows contiguous). Built from tensors (the simulation: every rank's tensor on one
    device); the tensors are registered so that the reference kernels can resolve the addresses."""

    def __init__(self, tensors: Sequence[torch.Tensor], device: torch.device | str | None = None):
        self.tensors = list(tensors)
        for i, t in enumerate(self.tensors):
            if not t.is_contiguous():
                raise MoEInputError(f"ep: peer buffer {i} must be contiguous")
        dev = torch.device(device) if device is not None else self.tensors[0].device
        self.ptrs = torch.tensor([t.data_ptr() if t.numel() else 0 for t in self.tensors], dtype=torch.int64,
                                 device=dev)
        for t in self.tensors:
            if t.numel():
                _ADDRESSES[(t.device.type, t.data_ptr())] = t

    def __len__(self) -> int:
        return len(self.tensors)


def _resolve(ptrs: torch.Tensor, device: torch.device) -> list[torch.Tensor | None]:
    """The registered tensors at the addresses ``ptrs`` (None for address 0: an empty buffer)."""
    out: list[torch.Tensor | None] = []
    for a in ptrs.tolist():
        if a == 0:
            out.append(None)
            continue
        t = _ADDRESSES.get((device.type, a))
        if t is None:
            raise RuntimeError(f"ep reference kernels: no registered peer buffer at address {a:#x}")
        out.append(t)
    return out


def recv_capacity(tokens: Sequence[int], own_tokens: int, cfg: Any, bm: int) -> int:
    """Rows of a destination's row space that no routing can overflow: every source's slots routed here (at most
    ``min(K, L)`` per token: a token's ids are distinct), the shared experts' rows of its own tokens, a group's
    padding each; rounded up to ``bm``. (Several GPUs: the plan's worst case, :func:`mokgen.ep.plan_ep`, from
    ``spec.tokens``.)"""
    c = R.layer_config(cfg)
    raw = sum(tokens) * min(c.topk, c.local_experts) + c.shared_experts * own_tokens + c.groups * (bm - 1)
    return -(-raw // bm) * bm


# ---- reference kernels (CPU tests; the device kernels are templates/sm90/ep_*.py.j2) --------------------------

def ref_ep_routing(idx_ptrs, w_ptrs, src_tokens, rank, row_rank, row_slot, row_w, tile_group, meta, slot_pos, *,
                   ranks: int, local_experts: int, shared_experts: int, topk: int, bm: int) -> None:
    """As the ``ep_routing`` kernel (templates/sm90/ep_routing.py.j2): see the module docstring."""
    L, S, K = local_experts, shared_experts, topk
    dev = row_rank.device
    idxs, wts = _resolve(idx_ptrs, dev), _resolve(w_ptrs, dev)
    counts = src_tokens.tolist()
    first = rank * L
    srcs, slots, ws, es = [], [], [], []
    bad = 0
    for s in range(ranks):
        n = counts[s] * K
        if n == 0:
            continue
        flat = idxs[s].reshape(-1)[:n].long()
        bad += int(((flat < 0) | (flat >= ranks * L)).sum())
        local = flat - first
        hit = ((local >= 0) & (local < L)).nonzero().flatten()        # (t, k) order
        srcs.append(torch.full_like(hit, s))
        slots.append(hit)
        ws.append(wts[s].reshape(-1)[:n][hit].float())
        es.append(local[hit])
    e = torch.cat(es) if es else torch.zeros(0, dtype=torch.int64, device=dev)
    src = torch.cat(srcs) if srcs else e.clone()
    slot = torch.cat(slots) if slots else e.clone()
    w = torch.cat(ws) if ws else torch.zeros(0, device=dev)
    order = torch.argsort(e, stable=True)                            # by expert; sources, then (t, k), inside
    T = slot_pos.shape[0]
    cnt = torch.cat([torch.bincount(e, minlength=L)[:L], torch.full((S,), T, dtype=torch.int64, device=dev)])
    padded = (cnt + bm - 1) // bm * bm
    start = torch.cumsum(padded, 0) - padded
    used = int(padded.sum())
    if used > row_rank.numel() or used // bm > tile_group.numel():
        raise RuntimeError(f"ep workspace too small: {used} rows needed, {row_rank.numel()} allocated")
    row_rank[:used] = -1
    row_slot[:used] = 0
    row_w[:used] = 0
    es = e[order]
    first_of = torch.cumsum(cnt[:L], 0) - cnt[:L]
    dest = start[es] + torch.arange(es.numel(), device=dev) - first_of[es]
    row_rank[dest] = src[order].to(row_rank.dtype)
    row_slot[dest] = slot[order].to(row_slot.dtype)
    row_w[dest] = w[order].to(row_w.dtype)
    tile_group.fill_(-1)
    for g in range(L + S):
        tile_group[int(start[g]) // bm:(int(start[g]) + int(padded[g])) // bm] = g
    tok = torch.arange(T, device=dev)
    for j in range(S):
        d = start[L + j] + tok
        row_rank[d] = rank
        row_slot[d] = (tok * K).to(row_slot.dtype)
        row_w[d] = 1.0
        slot_pos[:, K + j] = (T * K + d).to(slot_pos.dtype)
    if T:
        own = idxs[rank].reshape(-1)[:T * K].long()
        ok = (own >= 0) & (own < ranks * L)
        slot_pos[:, :K] = torch.where(ok, torch.arange(T * K, device=dev), -1).reshape(T, K).to(slot_pos.dtype)
    meta[0] = used // bm
    if bad:
        meta[1] = 1
    meta[2] = int(start[L]) if S else used   # the routed groups end where the shared ones begin
    meta[3] = bad


def ref_ep_dispatch(x_ptrs, row_rank, row_slot, meta, xg, *, topk: int, bm: int) -> None:
    """As the ``ep_dispatch`` kernel: the used rows pulled from the sources' x, padding rows zeroed."""
    xs = _resolve(x_ptrs, xg.device)
    n = int(meta[0]) * bm
    rr, tok = row_rank[:n].long(), row_slot[:n].long() // topk
    xg[:n] = 0
    for s, x in enumerate(xs):
        sel = (rr == s).nonzero().flatten()
        if sel.numel():
            xg[sel] = x.reshape(-1, xg.shape[1])[tok[sel]]


def ref_ep_push(ys, row_rank, row_slot, meta, slot_ptrs) -> None:
    """As the ``ep_push`` kernel: rows [0, meta[2]) with a source rank written into that owner's slot rows."""
    dsts = _resolve(slot_ptrs, ys.device)
    n = int(meta[2])
    rr, slot = row_rank[:n].long(), row_slot[:n].long()
    for s, buf in enumerate(dsts):
        sel = (rr == s).nonzero().flatten()
        if sel.numel():
            buf.reshape(-1, ys.shape[1])[slot[sel]] = ys[sel]


def reference_ep_kernels(spec: Any, bm: int, gather: bool = False, training: bool = False
                         ) -> dict[str, Callable[..., None]]:
    """{kernel: callable} for :data:`EP_LAYER_KERNELS` (and :data:`EP_TRAIN_KERNELS` with ``training``) with the
    device kernels' argument lists (mokgen/kernels.py): the EP kernels' references and the single-GPU reference
    GEMMs and combine of the per-rank spec (``gather``: GEMM 1 reads gathered rows, as plans whose gemm1 loads A by
    TMA)."""
    c = R.layer_config(spec)
    fns = R.reference_kernels(spec, bm, gather=gather, training=training)
    kw = dict(topk=c.topk, bm=bm)
    fns.update(
        ep_routing=bind("ep_routing", lambda **a: ref_ep_routing(**a, ranks=c.ep, local_experts=c.local_experts,
                                                                 shared_experts=c.shared_experts, **kw)),
        ep_dispatch=bind("ep_dispatch", lambda **a: ref_ep_dispatch(**a, **kw)),
        ep_push=bind("ep_push", lambda **a: ref_ep_push(**a)),
    )
    return {k: fns[k] for k in EP_LAYER_KERNELS + (EP_TRAIN_KERNELS if training else ())}


# ---- the layer -------------------------------------------------------------------------------------------------

class EPMoE:
    """The expert-parallel MoE layer of ``spec`` (``spec.ep`` ranks, ``spec.local_experts`` experts each) on
    simulated ranks: every rank's inputs and weights are tensors of this process, on one device.

    ``EPMoE(spec, plan, entry_dir)`` loads the kernels of a built cache entry of ``spec`` (emit renders the EP
    kernels for ``ep > 1``); ``functions=`` injects them instead (:func:`reference_ep_kernels`), with
    ``allow_cpu=True`` for CPU tensors. The plan is the single-GPU plan of ``spec`` (its routing tile ``bm``, its
    GEMMs: ``G = L + S`` groups)."""

    def __init__(self, spec: Any, plan: Any, entry_dir: Any = None, *,
                 functions: Mapping[str, Callable[..., Any]] | None = None, allow_cpu: bool = False):
        self.spec, self.plan = spec, plan
        self.cfg = R.layer_config(spec)
        self.ranks = self.cfg.ep
        self.bm = int(plan.bm)
        if getattr(plan, "schedule", "chain") != "chain" or self.cfg.dtype != "bf16":
            raise ValueError("EPMoE: the EP layer runs bf16 chain-schedule plans (the single-GPU gemm1, gemm2 and "
                             "combine kernels)")
        backward = getattr(plan, "backward", None)
        if functions is None:
            if entry_dir is None:
                raise ValueError("EPMoE needs entry_dir (a built cache entry of an ep > 1 spec) or functions=")
            functions = load_library(entry_dir, EP_LAYER_KERNELS + (EP_TRAIN_KERNELS if backward is not None else ()))
        missing = [k for k in EP_LAYER_KERNELS if k not in functions]
        if missing:
            raise ValueError(f"EPMoE: functions lacks kernel(s) {missing}")
        self._fns = {k: functions[k] for k in EP_LAYER_KERNELS + EP_TRAIN_KERNELS if k in functions}
        # training: the training kernels given, and dgrad1's N tiles (its router partials per row: one column each)
        self.trainable = all(k in functions for k in EP_TRAIN_KERNELS)
        self.ds_tiles = backward.dgrad1.n_tiles if backward is not None else 1
        self.allow_cpu = allow_cpu
        self.gather = uses_gather_kernel(plan)
        self.last_meta: list[torch.Tensor] = []
        self._bad: torch.Tensor | None = None   # ids out of range counted since the last check_errors (device)

    def _check(self, x, topk_idx, topk_weight, w1, w2, b1, b2) -> None:
        c, n = self.cfg, self.ranks
        for name, v in (("x", x), ("topk_idx", topk_idx), ("topk_weight", topk_weight), ("w1", w1), ("w2", w2)) + \
                ((("b1", b1), ("b2", b2)) if c.bias else ()):
            if v is None or len(v) != n:
                raise MoEInputError(f"ep: {name} must hold one tensor per rank ({n})")
        if (b1 is not None or b2 is not None) != bool(c.bias):
            raise MoEInputError(f"ep: biases given {b1 is not None}, spec bias {c.bias}")
        dev = x[0].device
        for r in range(n):
            self.check_rank(r, dev, x[r], topk_idx[r], topk_weight[r], w1[r], w2[r],
                            None if b1 is None else b1[r], None if b2 is None else b2[r])

    def check_rank(self, r: int, dev: torch.device, x, topk_idx, topk_weight, w1, w2, b1, b2) -> None:
        """Rank r's inputs: shapes, dtypes, device, contiguity (the simulated and the multi-process forms)."""
        c = self.cfg
        if (b1 is not None or b2 is not None) != bool(c.bias):
            raise MoEInputError(f"ep: biases given {b1 is not None}, spec bias {c.bias}")
        if dev.type != "cuda" and not self.allow_cpu:
            raise MoEInputError(f"ep: tensors must be on a CUDA device, got {dev}")
        G, H, I, K = c.groups, c.hidden, c.ffn, c.topk
        T = x.shape[0] if x.dim() == 2 else -1
        want = {"x": (x, (T, H), torch.bfloat16), "topk_idx": (topk_idx, (T, K), torch.int32),
                "topk_weight": (topk_weight, (T, K), torch.float32),
                "w1": (w1, (G, 2 * I, H), torch.bfloat16), "w2": (w2, (G, H, I), torch.bfloat16)}
        if c.bias:
            want.update(b1=(b1, (G, 2 * I), torch.float32), b2=(b2, (G, H), torch.float32))
        for name, (t, shape, dt) in want.items():
            if tuple(t.shape) != shape or t.dtype != dt or t.device != dev or not t.is_contiguous():
                raise MoEInputError(f"ep: rank {r}'s {name} must be a contiguous {dt} tensor {list(shape)} on "
                                    f"{dev}, got {t.dtype} {list(t.shape)} on {t.device}")

    def __call__(self, x: Sequence[torch.Tensor], topk_idx: Sequence[torch.Tensor],
                 topk_weight: Sequence[torch.Tensor], w1: Sequence[torch.Tensor], w2: Sequence[torch.Tensor],
                 b1: Sequence[torch.Tensor] | None = None, b2: Sequence[torch.Tensor] | None = None, *,
                 order: Sequence[int] | None = None, num_ctas: int | None = None, check: bool = False
                 ) -> list[torch.Tensor]:
        """Every rank's y [T_r, H] bf16 for its tokens x[r] [T_r, H] and their *global* top-k ids (``[0, R * L)``)
        and weights; ``w1[r]`` / ``w2[r]`` (``b1[r]`` / ``b2[r]``) are rank r's L experts then the S shared ones.
        ``order``: the order in which the ranks run each phase (a permutation; it must not change the bits).
        ``check=True`` syncs and raises :class:`~mokgen.ops.RoutingError` on ids out of range (those slots add 0)."""
        return self._forward(x, topk_idx, topk_weight, w1, w2, b1, b2, order, num_ctas, check, training=False)[0]

    def forward_train(self, x: Sequence[torch.Tensor], topk_idx: Sequence[torch.Tensor],
                      topk_weight: Sequence[torch.Tensor], w1: Sequence[torch.Tensor], w2: Sequence[torch.Tensor],
                      b1: Sequence[torch.Tensor] | None = None, b2: Sequence[torch.Tensor] | None = None, *,
                      order: Sequence[int] | None = None, num_ctas: int | None = None, check: bool = False
                      ) -> tuple[list[torch.Tensor], "EPSaved"]:
        """(y per rank, saved): as :meth:`__call__`, with GEMM 1 also storing z; ``saved`` is what
        :meth:`backward` needs (each destination's routing workspace and z)."""
        self._need_training()
        return self._forward(x, topk_idx, topk_weight, w1, w2, b1, b2, order, num_ctas, check, training=True)

    def _need_training(self) -> None:
        if not self.trainable:
            raise RuntimeError(f"EPMoE: cannot train: the kernels lack {[k for k in EP_TRAIN_KERNELS if k not in self._fns]}"
                               " (a cache entry built with the training kernels, or reference_ep_kernels(training=True))")

    # ---- the phases of one rank (the simulated ranks loop over them; mokgen.ep_dist runs its own rank's) -------

    def workspace(self, cap: int, tokens: int, dev: torch.device, comb: torch.Tensor | None = None
                  ) -> dict[str, torch.Tensor]:
        """A destination's routing workspace for a row space of ``cap`` rows and, as owner of ``tokens`` tokens,
        its slot map and combine buffer ``comb [tokens * K + cap, H]`` (given: a view of a peer buffer)."""
        c, bm = self.cfg, self.bm
        K, H = c.topk, c.hidden
        e = dict(device=dev)
        if comb is None:
            comb = torch.empty((tokens * K + cap, H), dtype=torch.bfloat16, **e)
        elif tuple(comb.shape) != (tokens * K + cap, H) or comb.dtype != torch.bfloat16:
            raise MoEInputError(f"ep: combine buffer must be bf16 [{tokens * K + cap}, {H}], got {list(comb.shape)}")
        return dict(row_rank=torch.empty(cap, dtype=torch.int32, **e),
                    row_slot=torch.empty(cap, dtype=torch.int32, **e),
                    row_w=torch.empty(cap, dtype=torch.float32, **e),
                    tile_group=torch.empty(cap // bm, dtype=torch.int32, **e),
                    meta=torch.zeros(4, dtype=torch.int32, **e),
                    slot_pos=torch.empty((tokens, K + c.shared_experts), dtype=torch.int32, **e),
                    comb=comb, cap=cap, tokens=tokens)

    def phase_routing(self, d: int, w: dict, idx_ptrs: torch.Tensor, w_ptrs: torch.Tensor,
                      src_tokens: torch.Tensor) -> None:
        """Phase 1 of destination d: its row space and, as owner, its slot map (every source's ids and weights
        read through their base addresses)."""
        call(self._fns, "ep_routing", idx_ptrs=idx_ptrs, w_ptrs=w_ptrs, src_tokens=src_tokens, rank=d,
             row_rank=w["row_rank"], row_slot=w["row_slot"], row_w=w["row_w"], tile_group=w["tile_group"],
             meta=w["meta"], slot_pos=w["slot_pos"])

    def phase_experts(self, w: dict, x_ptrs: torch.Tensor, w1, w2, b1, b2, num_ctas: int, training: bool) -> None:
        """Phase 2 of a destination: the pull of its rows from the sources' x, GEMM 1 (``training``: z kept in
        ``w``) and GEMM 2 into the row-space part of its combine buffer (``w["ys"]``)."""
        f, c = self._fns, self.cfg
        H, I, K, cap = c.hidden, c.ffn, c.topk, w["cap"]
        dev = w["meta"].device
        dummy = torch.zeros((1, 1), dtype=torch.float32, device=dev)
        xg = torch.empty((cap, H), dtype=torch.bfloat16, device=dev)
        call(f, "ep_dispatch", x_ptrs=x_ptrs, row_rank=w["row_rank"], row_slot=w["row_slot"], meta=w["meta"], xg=xg)
        h = torch.empty((cap, I), dtype=torch.bfloat16, device=dev)
        ident = torch.arange(cap, dtype=torch.int32, device=dev)   # GEMM 1 "gathers" xg's own rows
        if training:
            w["z"] = torch.empty((cap, 2 * I), dtype=torch.bfloat16, device=dev)
            call(f, "gemm1_train", a=xg, w=w1, bias=b1 if b1 is not None else dummy, row=ident,
                 tile_group=w["tile_group"], meta=w["meta"], out=h, z=w["z"], num_ctas=num_ctas)
        else:
            call(f, "gemm1", a=xg, w=w1, bias=b1 if b1 is not None else dummy, row=ident,
                 tile_group=w["tile_group"], meta=w["meta"], out=h, num_ctas=num_ctas)
        w["ys"] = w["comb"][w["tokens"] * K:]
        call(f, "gemm2", a=h, w=w2, bias=b2 if b2 is not None else dummy, row=w["row_w"],
             tile_group=w["tile_group"], meta=w["meta"], out=w["ys"], num_ctas=num_ctas)

    def phase_push(self, w: dict, slot_ptrs: torch.Tensor) -> None:
        """Phase 3 of a destination: its routed output rows into their owners' slot rows (base addresses)."""
        call(self._fns, "ep_push", ys=w["ys"], row_rank=w["row_rank"], row_slot=w["row_slot"], meta=w["meta"],
             slot_ptrs=slot_ptrs)

    def phase_combine(self, w: dict, y: torch.Tensor) -> None:
        """Phase 4 of an owner: its fixed-order sum of slots then shared rows into y."""
        if w["tokens"]:
            call(self._fns, "combine", ys=w["comb"], slot_pos=w["slot_pos"], y=y)

    def check_meta(self, metas: Sequence[torch.Tensor], check: bool) -> None:
        """``check``: raise :class:`RoutingError` when a routing counted ids out of range (syncs). Otherwise the
        count (every destination's routing walks all ranks' ids, so one meta has it) is added to a device counter,
        without a sync, that :meth:`check_errors` reads."""
        self.last_meta = list(metas)
        if check:
            if any(int(m[1]) for m in self.last_meta):
                raise RoutingError(self._bad_message(int(self.last_meta[0][3])))
            return
        if self.last_meta:
            n = self.last_meta[0][3:4].to(torch.int64)   # a device op in stream order: no host sync
            self._bad = n if self._bad is None else self._bad + n

    def _bad_message(self, bad: int) -> str:
        return (f"mokgen ep: {bad} top-k id(s) outside [0, {self.ranks * self.cfg.local_experts}); those slots were "
                "dropped (contributed 0)")

    def check_errors(self) -> None:
        """Raise :class:`RoutingError` if a call since the last check (made without ``check=True``) saw top-k ids
        outside ``[0, R * L)`` (their slots were dropped); one host sync; clears the count."""
        bad, self._bad = self._bad, None
        if bad is not None and int(bad):
            raise RoutingError(self._bad_message(int(bad)))

    @staticmethod
    def saved_of(w: dict) -> dict[str, torch.Tensor]:
        """What a destination keeps of its forward workspace for the backward."""
        return {k: w[k] for k in ("row_rank", "row_slot", "row_w", "tile_group", "meta", "slot_pos", "z")}

    def _forward(self, x, topk_idx, topk_weight, w1, w2, b1, b2, order, num_ctas, check, training):
        self._check(x, topk_idx, topk_weight, w1, w2, b1, b2)
        c, n, bm = self.cfg, self.ranks, self.bm
        order = self._order(order)
        dev = x[0].device
        H = c.hidden
        T = [int(t.shape[0]) for t in x]
        num_ctas = self._num_ctas(dev, num_ctas)
        # the peer buffers (symmetric memory on several GPUs): x, the routing, the owners' combine buffers
        xs, idxs, wts = PeerBuffers(x, dev), PeerBuffers(topk_idx, dev), PeerBuffers(topk_weight, dev)
        src_tokens = torch.tensor(T, dtype=torch.int32, device=dev)
        caps = [recv_capacity(T, T[d], c, bm) for d in range(n)]
        ws = [self.workspace(caps[d], T[d], dev) for d in range(n)]
        slots = PeerBuffers([w["comb"] for w in ws], dev)
        for d in order:   # phase 1: routing (every source's ids and weights are readable: the callers' inputs)
            self.phase_routing(d, ws[d], idxs.ptrs, wts.ptrs, src_tokens)
        for d in order:   # phase 2: pull dispatch, the experts (GEMM 2 into the row-space part of the combine buffer)
            self.phase_experts(ws[d], xs.ptrs, w1[d], w2[d], None if b1 is None else b1[d],
                               None if b2 is None else b2[d], num_ctas, training)
        for d in order:   # phase 3: push the routed rows into their owners' slot rows
            self.phase_push(ws[d], slots.ptrs)
        y = [torch.empty((T[r], H), dtype=torch.bfloat16, device=dev) for r in range(n)]
        for r in order:   # phase 4: each owner's fixed-order sum
            self.phase_combine(ws[r], y[r])
        self.check_meta([w["meta"] for w in ws], check)
        saved = EPSaved([self.saved_of(w) for w in ws], caps, T) if training else None
        return y, saved

    def _order(self, order: Sequence[int] | None) -> list[int]:
        n = self.ranks
        order = list(range(n)) if order is None else list(order)
        if sorted(order) != list(range(n)):
            raise MoEInputError(f"ep: order must be a permutation of range({n}), got {order}")
        return order

    @staticmethod
    def _num_ctas(dev: torch.device, num_ctas: int | None) -> int:
        if num_ctas is None:
            num_ctas = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
        return num_ctas

    def backward(self, dy: Sequence[torch.Tensor], saved: "EPSaved", x: Sequence[torch.Tensor],
                 w1: Sequence[torch.Tensor], w2: Sequence[torch.Tensor], b1: Sequence[torch.Tensor] | None = None,
                 b2: Sequence[torch.Tensor] | None = None, *, order: Sequence[int] | None = None,
                 num_ctas: int | None = None) -> list[R.Grads]:
        """Every rank's gradients (a :class:`mokgen.reference.Grads`: dx, dtopk_weight, dw1, dw2, db1, db2) for the
        output gradients ``dy[r] [T_r, H]`` of one :meth:`forward_train` (``saved``), mirroring the forward:

        1. each destination pulls the dO rows of its row space from the owners' dy (``ep_dispatch`` on dy's base
           addresses: routed rows by (source, t), its shared experts' rows from its own dy);
        2. the single-GPU backward GEMMs on them: dgrad1 (dSwiGLU with the saved z; s a; the router partials per
           row and N tile), wgrad2 (dW2 of its L + S groups), dgrad2 (dx per row, into the row-space part of a
           combine buffer), then x's rows pulled again (``ep_dispatch``) for wgrad1 (dW1);
        3. ``ep_push`` of each routed dx row into its owner's slot rows, and each row's router gradient (its
           partials summed in N-tile order) into the owner's ``dtopk_weight[t, k]`` (a device scatter with one
           writer per slot);
        4. each owner's fixed-order sum of its dx slots and shared rows (the single-GPU ``combine``).

        The routed experts' weight gradients, dx and dtopk_weight are computed by the same kernels on the same rows
        in the same order as the single-GPU layer's backward on the gathered problem: the same bits. A shared
        expert's gradients on rank r cover rank r's tokens only (the replicas' gradients are to be summed across
        ranks, as data-parallel gradients are). Bias gradients: per destination group, as the single-GPU backward
        computes them."""
        self._need_training()
        c, n = self.cfg, self.ranks
        order = self._order(order)
        T, caps = saved.tokens, saved.caps
        if len(dy) != n or any(tuple(t.shape) != (T[r], c.hidden) or t.dtype != torch.bfloat16
                               for r, t in enumerate(dy)):
            raise MoEInputError(f"ep: dy must hold one bf16 [T_r, {c.hidden}] tensor per rank ({n})")
        dev = dy[0].device
        K, H = c.topk, c.hidden
        num_ctas = self._num_ctas(dev, num_ctas)
        dy = [t.contiguous() for t in dy]
        dys, xs = PeerBuffers(dy, dev), PeerBuffers(x, dev)
        dcomb = [torch.empty((T[r] * K + caps[r], H), dtype=torch.bfloat16, device=dev) for r in range(n)]
        dslots = PeerBuffers(dcomb, dev)
        # the owners' router gradients: T_r * K slots and one spare row that masked-out rows write into
        dtw_buf = [torch.zeros(T[r] * K + 1, dtype=torch.float32, device=dev) for r in range(n)]
        spare = [T[r] * K for r in range(n)]
        part: list[Any] = [None] * n
        for d in order:   # phases 1-2: the dO (and x) rows pulled, the backward GEMMs
            part[d] = self.phase_bwd_experts(saved.ranks[d], caps[d], T[d], dys.ptrs, xs.ptrs,
                                             dcomb[d][T[d] * K:], w1[d], w2[d], None if b2 is None else b2[d],
                                             b1 is not None, num_ctas)
        for d in order:   # phase 3: dx rows and router gradients to their owners
            self.phase_bwd_push(saved.ranks[d], part[d], dslots.ptrs, dtw_buf, spare)
        # phase 4: each owner's dx: its slots then its shared rows, in order
        return [self.phase_bwd_combine(saved.ranks[r], part[r], dcomb[r], dtw_buf[r], T[r]) for r in range(n)]

    def phase_bwd_experts(self, sv: dict, cap: int, tokens: int, dy_ptrs: torch.Tensor, x_ptrs: torch.Tensor,
                          dxs: torch.Tensor, w1, w2, b2, bias: bool, num_ctas: int) -> dict[str, Any]:
        """Backward phases 1-2 of destination with saved workspace ``sv``: dO rows pulled, dgrad1, wgrad2, dgrad2
        (dx rows into ``dxs``, the row-space part of its combine buffer), x rows pulled, wgrad1. Returns its
        weight (and bias) gradients, each row's router gradient and ``dxs``."""
        c, bm, f = self.cfg, self.bm, self._fns
        H, I, G = c.hidden, c.ffn, c.groups
        dev = dxs.device
        dummy = torch.zeros((1, 1), dtype=torch.float32, device=dev)
        out: dict[str, Any] = {"dxs": dxs, "cap": cap}
        dog = torch.empty((cap, H), dtype=torch.bfloat16, device=dev)
        call(f, "ep_dispatch", x_ptrs=dy_ptrs, row_rank=sv["row_rank"], row_slot=sv["row_slot"], meta=sv["meta"],
             xg=dog)
        dz = torch.empty((cap, 2 * I), dtype=torch.bfloat16, device=dev)
        sa = torch.empty((cap, I), dtype=torch.bfloat16, device=dev)
        ds = torch.empty((cap, self.ds_tiles), dtype=torch.float32, device=dev)
        call(f, "dgrad1", a=dog, w=w2, bias=dummy, row=sv["row_w"], tile_group=sv["tile_group"], meta=sv["meta"],
             out=sa, z=sv["z"], dz=dz, ds=ds, num_ctas=num_ctas)
        onehot, group_start = group_layout(sv["tile_group"], G, bm)
        if b2 is not None:
            out["b2"] = group_sums(onehot, sv["tile_group"], dog, bm, row_weight=sv["row_w"])
            grp = sv["tile_group"].long().repeat_interleave(bm).clamp(min=0)
            b2_term = torch.gather(dog.float() @ b2.t(), 1, grp.unsqueeze(1)).squeeze(1)
        dw2 = torch.empty_like(w2)
        call(f, "wgrad2", a=dog, b=sa, group_start=group_start, out=dw2, num_ctas=num_ctas)
        call(f, "dgrad2", a=dz, w=w1, bias=dummy, row=sv["row_w"], tile_group=sv["tile_group"], meta=sv["meta"],
             out=dxs, num_ctas=num_ctas)
        xg = dog   # the dO rows are read: the buffer takes x's rows for wgrad1
        call(f, "ep_dispatch", x_ptrs=x_ptrs, row_rank=sv["row_rank"], row_slot=sv["row_slot"], meta=sv["meta"],
             xg=xg)
        dw1 = torch.empty_like(w1)
        call(f, "wgrad1", a=dz, b=xg, group_start=group_start, out=dw1, num_ctas=num_ctas)
        if bias:
            out["b1"] = group_sums(onehot, sv["tile_group"], dz, bm)
        out["w1"], out["w2"] = dw1, dw2
        out["row_grad"] = ds.sum(1)   # each row's router gradient: its partials in N-tile order
        if b2 is not None:   # + <dO row, b2[g]> of the row's group (from the dO rows, before xg reuses them)
            out["row_grad"] = out["row_grad"] + b2_term
        return out

    def phase_bwd_push(self, sv: dict, part: dict, dslot_ptrs: torch.Tensor, dtw_bufs: Sequence[torch.Tensor],
                       spare: Sequence[int]) -> None:
        """Backward phase 3 of a destination: ``ep_push`` of its routed dx rows into the owners' slot rows, each
        row's router gradient scattered into its owner's ``dtw_bufs[r]`` (slot ``t * K + k``; rows of other owners
        write 0 into the owner's spare element ``spare[r]``: one writer per slot)."""
        call(self._fns, "ep_push", ys=part["dxs"], row_rank=sv["row_rank"], row_slot=sv["row_slot"],
             meta=sv["meta"], slot_ptrs=dslot_ptrs)
        routed = torch.arange(part["cap"], device=part["dxs"].device) < sv["meta"][2]   # shared rows after meta[2]
        for r, buf in enumerate(dtw_bufs):
            mine = routed & (sv["row_rank"] == r)
            idx = torch.where(mine, sv["row_slot"].long(), spare[r])
            buf.scatter_(0, idx, torch.where(mine, part["row_grad"], 0.0))

    def phase_bwd_combine(self, sv: dict, part: dict, dcomb: torch.Tensor, dtw_buf: torch.Tensor, tokens: int
                          ) -> R.Grads:
        """Backward phase 4 of an owner: dx (its slots then its shared rows, in order) and dtopk_weight; with the
        gradients of its experts (``part``, its own destination phases)."""
        K, dev = self.cfg.topk, dcomb.device
        dx = torch.empty((tokens, self.cfg.hidden), dtype=torch.bfloat16, device=dev)
        if tokens:
            call(self._fns, "combine", ys=dcomb, slot_pos=sv["slot_pos"], y=dx)
        pos = sv["slot_pos"][:, :K]
        dtw = torch.where(pos >= 0, dtw_buf[:tokens * K].view(tokens, K), 0.0)
        return R.Grads(dx, dtw, part["w1"], part["w2"], part.get("b1"), part.get("b2"))


class EPSaved:
    """What one :meth:`EPMoE.forward_train` keeps for its backward: per rank (as a destination) its routing
    workspace (row_rank, row_slot, row_w, tile_group, meta, and as an owner slot_pos) and GEMM 1's z; the
    receive capacities and token counts."""

    def __init__(self, ranks: list[dict[str, torch.Tensor]], caps: list[int], tokens: list[int]):
        self.ranks, self.caps, self.tokens = ranks, caps, tokens
