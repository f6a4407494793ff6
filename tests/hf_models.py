"""Small transformers models of each MoE family mokgen's transformers backend supports, built from their config
classes (random init, no download), and the checks the CPU and GPU tests of the backend share.

Every family gets the same expert shape (``hidden`` x ``ffn``, ``experts``, top-``topk``), so the six
concat-SwiGLU families share one mokgen spec (one compile) and GPT-OSS has the other (swiglu_oai)."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch

from mokgen.reference import rel_err

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "qwen3_next", "qwen3_5_moe", "glm4_moe", "gpt_oss")


def tiny_config(family: str, *, hidden: int = 256, ffn: int = 128, experts: int = 8, topk: int = 2,
                layers: int = 2, vocab: int = 512, init_std: float = 0.05) -> Any:
    """The family's config class with small dims: ``layers`` decoder layers, all of them MoE layers (DeepSeek-V3
    and GLM-4-MoE: ``first_k_dense_replace=0``; Qwen3-Next / Qwen3.5-MoE: linear attention then full)."""
    import transformers as tf

    heads = max(2, hidden // 64)
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=max(1, heads // 2), max_position_embeddings=256, initializer_range=init_std,
                  num_experts_per_tok=topk, tie_word_embeddings=False)
    linear = dict(layer_types=(["linear_attention", "full_attention"] * layers)[:layers], linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4)
    if family == "mixtral":
        return tf.MixtralConfig(**common, intermediate_size=ffn, num_local_experts=experts)
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(**common, intermediate_size=2 * ffn, moe_intermediate_size=ffn, num_experts=experts,
                                 shared_expert_intermediate_size=ffn)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, intermediate_size=2 * ffn, moe_intermediate_size=ffn, num_experts=experts,
                                 head_dim=64)
    if family == "deepseek_v3":
        common["num_key_value_heads"] = heads
        return tf.DeepseekV3Config(**common, intermediate_size=2 * ffn, moe_intermediate_size=ffn,
                                   n_routed_experts=experts, n_shared_experts=1, n_group=1, topk_group=1,
                                   first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=64, qk_nope_head_dim=32,
                                   qk_rope_head_dim=32, v_head_dim=32)
    if family == "qwen3_next":
        return tf.Qwen3NextConfig(**common, **linear, intermediate_size=2 * ffn, moe_intermediate_size=ffn,
                                  num_experts=experts, shared_expert_intermediate_size=ffn, head_dim=64)
    if family == "qwen3_5_moe":
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

        return Qwen3_5MoeTextConfig(**common, **linear, moe_intermediate_size=ffn, num_experts=experts,
                                    shared_expert_intermediate_size=ffn, head_dim=64)
    if family == "glm4_moe":
        return tf.Glm4MoeConfig(**common, intermediate_size=2 * ffn, moe_intermediate_size=ffn,
                                n_routed_experts=experts, n_shared_experts=1, n_group=1, topk_group=1,
                                first_k_dense_replace=0, head_dim=64)
    if family == "gpt_oss":
        return tf.GptOssConfig(**common, intermediate_size=ffn, num_local_experts=experts, head_dim=64)
    raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")


def build(family: str, *, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0,
          experts_implementation: str = "eager", attn_implementation: str | None = None,
          **dims: Any) -> torch.nn.Module:
    """A causal LM of ``family`` (random init, seeded), every floating-point parameter rounded to bf16 precision
    (so fp32 and bf16 copies hold the same weights), biases random (GPT-OSS initializes them to 0)."""
    import transformers as tf

    cfg = tiny_config(family, **dims)
    torch.manual_seed(seed)
    kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = tf.AutoModelForCausalLM.from_config(cfg, experts_implementation=experts_implementation, **kw)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith("_bias") or name.endswith("router.bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            p.copy_(p.to(torch.bfloat16).float())
    return model.to(device=device, dtype=dtype).train()


def clone(model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    m = copy.deepcopy(model)
    return m.to(dtype) if dtype is not None else m


def tokens(vocab: int, batch: int, seq: int, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g).to(device)


def step(model: torch.nn.Module, ids: torch.Tensor, attention_mask: torch.Tensor | None = None
         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(logits fp32, {name: grad}) of one forward + backward of the LM loss (labels = ids, padding ignored); for
    a single position (no next token to predict) the loss is <logits, a fixed random probe> instead."""
    model.zero_grad(set_to_none=True)
    if ids.shape[1] > 1:
        labels = ids if attention_mask is None else ids.masked_fill(attention_mask == 0, -100)
        out = model(input_ids=ids, attention_mask=attention_mask, labels=labels)
        loss = out.loss
    else:
        out = model(input_ids=ids, attention_mask=attention_mask)
        g = torch.Generator().manual_seed(123)
        probe = torch.randn(out.logits.shape, generator=g).to(out.logits.device)
        loss = (out.logits.float() * probe).mean()
    loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().float(), grads


def grad_errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    """{name: rel_err} for every parameter gradient of ``want`` (a missing one in ``got`` is an error)."""
    missing = sorted(set(want) - set(got))
    assert not missing, f"no gradient for {missing}"
    return {n: rel_err(got[n], want[n]) for n in want}


def worst(errs: dict[str, float]) -> tuple[str, float]:
    n = max(errs, key=lambda k: errs[k])
    return n, errs[n]


def capture_experts(model: torch.nn.Module) -> tuple[list[torch.Tensor], Callable[[], None]]:
    """Record every experts module's output (forward hooks); returns (list, remove)."""
    from mokgen.integrations.transformers import experts_modules

    outs: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _i, o: outs.append(o.detach().float()))
             for _n, m in experts_modules(model)]

    def remove() -> None:
        for h in hooks:
            h.remove()

    return outs, remove


class RoutingReplay:
    """Make two runs choose the same experts: ``record()`` stores the expert ids of every router's top-k,
    ``replay(stored)`` makes those top-k calls return the stored ids (their values gathered from the router's
    own scores, so the routing weights and the router's gradients stay consistent with the choice). Then two
    backends (or precisions) differ by arithmetic only, not by a router flipping a near tie (a bf16 rounding
    in layer 1 moves layer 2's router; on the tiny test models that alone moves the logits by several percent).

    It wraps ``torch.topk`` while active; only calls on ``[T, experts]`` scores with ``k == topk`` (the routers'
    expert choice) are touched, in call order."""

    def __init__(self, experts: int, topk: int):
        self.experts, self.topk = experts, topk
        self.mode = "off"
        self.stored: list[torch.Tensor] = []
        self.pos = 0
        self._orig = None

    def _topk(self, input, k, dim=-1, largest=True, sorted=True, *, out=None):
        hit = (out is None and isinstance(input, torch.Tensor) and input.dim() == 2 and k == self.topk
               and input.shape[-1] == self.experts and dim in (-1, 1) and largest)
        if not hit or self.mode == "off":
            return self._orig(input, k, dim=dim, largest=largest, sorted=sorted, **({} if out is None else {"out": out}))
        if self.mode == "record":
            res = self._orig(input, k, dim=dim, largest=largest, sorted=sorted)
            self.stored.append(res.indices.detach().clone())
            return res
        idx = self.stored[self.pos].to(input.device)
        self.pos += 1
        assert idx.shape == (input.shape[0], k), "replayed routing of another shape"
        return torch.return_types.topk((input.gather(-1, idx), idx))

    def __enter__(self) -> "RoutingReplay":
        self._orig = torch.topk
        torch.topk = self._topk
        return self

    def __exit__(self, *exc) -> None:
        torch.topk = self._orig

    def record(self) -> "RoutingReplay":
        self.mode, self.stored, self.pos = "record", [], 0
        return self

    def replay(self, stored: list[torch.Tensor]) -> "RoutingReplay":
        self.mode, self.stored, self.pos = "replay", stored, 0
        return self


# --------------------------------------------------------------------------------------------------------------
# the model-level checks (tests/test_transformers.py runs them on the CPU with mokgen's reference kernels,
# tests/test_gpu_transformers.py on the GPU with the compiled ones)

TOL = 1e-2
DIMS = dict(hidden=256, ffn=128, experts=8, topk=2)


def bf16_agrees(err_mok_gmm: float, floor: float) -> bool:
    """The bf16 criterion: mokgen and grouped_mm (both bf16) within 1e-2 of each other, or within twice bf16's
    noise floor for that quantity (``floor``: the largest distance of a transformers bf16 backend's result from
    the float32 one; two independent bf16 results of one float32 value lie ~sqrt(2) floors apart). With the
    reference kernels (tests/test_transformers.py), 1e-2 alone is below that floor for many gradients outside
    the experts: attention projections and norms, linear attention's A_log, GPT-OSS's 4-element sinks, where
    grouped_mm itself is 1-8% from float32."""
    return err_mok_gmm <= max(TOL, 2.0 * floor)


def _grad_names(grads: dict[str, torch.Tensor], which: str) -> list[str]:
    """``which="all"``: every parameter; ``"experts"``: the experts modules' own (gate_up_proj, down_proj, their
    biases). At T = 1 only those are compared: the other gradients of a single token are ill-conditioned (the
    router's is a difference of two nearly equal slot gradients, a single key's attention gradient is 0)."""
    if which == "all":
        return list(grads)
    return [n for n in grads if ".experts." in n]


def check_vs_fp32_eager(family: str, device: str, *, batch: int = 2, seq: int = 24, seed: int = 0,
                        grads: str = "all") -> dict:
    """A float32 model (bf16-representable weights) with experts_implementation="mokgen" (mokgen computes the
    experts in bf16) against the same model's eager experts in float32, same routing (:class:`RoutingReplay`):
    logits and every experts module's output within 1e-2, gradients (``grads``: :func:`_grad_names`) within
    2e-2 and finite."""
    ref = build(family, seed=seed, device=device, **DIMS)
    ids = tokens(ref.config.vocab_size, batch, seq, seed=seed, device=device)
    mok = clone(ref)
    mok.set_experts_implementation("mokgen")
    with RoutingReplay(DIMS["experts"], DIMS["topk"]) as rr:
        outs_r, rm_r = capture_experts(ref)
        rr.record()
        l_ref, g_ref = step(ref, ids)
        rm_r()
        outs_m, rm_m = capture_experts(mok)
        rr.replay(rr.stored)
        l_mok, g_mok = step(mok, ids)
        rm_m()
    assert len(outs_m) == len(outs_r) > 0
    res = {"logits": rel_err(l_mok, l_ref),
           "experts_out": max(rel_err(a, b) for a, b in zip(outs_m, outs_r))}
    errs = grad_errors(g_mok, g_ref)
    names = _grad_names(errs, grads)
    res["worst_grad"] = worst({n: errs[n] for n in names})
    assert res["logits"] <= TOL and res["experts_out"] <= TOL, res
    assert res["worst_grad"][1] <= 2 * TOL, res
    for n, g in g_mok.items():
        assert torch.isfinite(g).all(), n
    return res


def check_vs_grouped_mm(family: str, device: str, *, batch: int = 2, seq: int = 24, seed: int = 0,
                        attention_mask: torch.Tensor | None = None, ids: torch.Tensor | None = None,
                        grads: str = "all") -> dict:
    """bf16 mokgen against bf16 grouped_mm (same model, same routing): logits and the gradients (``grads``) by
    :func:`bf16_agrees`, the noise floor measured in the same run (grouped_mm and eager bf16 against the float32
    eager result of the same weights and routing)."""
    ref = build(family, seed=seed, device=device, **DIMS)
    if ids is None:
        ids = tokens(ref.config.vocab_size, batch, seq, seed=seed, device=device)
    bf = clone(ref, torch.bfloat16)
    valid = None if attention_mask is None else attention_mask.bool()
    runs = {}
    with RoutingReplay(DIMS["experts"], DIMS["topk"]) as rr:
        rr.record()
        l_ref, g_ref = step(ref, ids, attention_mask)
        stored = rr.stored
        for impl in ("grouped_mm", "eager", "mokgen"):
            bf.set_experts_implementation(impl)
            rr.replay(stored)
            runs[impl] = step(bf, ids, attention_mask)
    if valid is not None:   # padded positions' logits are not compared (nothing attends to them)
        l_ref = l_ref[valid]
        runs = {k: (lg[valid], g) for k, (lg, g) in runs.items()}
    (l_gmm, g_gmm), (l_eag, g_eag), (l_mok, g_mok) = runs["grouped_mm"], runs["eager"], runs["mokgen"]
    floor = max(rel_err(l_gmm, l_ref), rel_err(l_eag, l_ref))
    res = {"logits": (rel_err(l_mok, l_gmm), floor, rel_err(l_mok, l_ref))}
    assert bf16_agrees(res["logits"][0], floor), f"logits (mokgen vs grouped_mm, floor, mokgen vs fp32): {res}"
    e_mg, e_mf = grad_errors(g_mok, g_gmm), grad_errors(g_mok, g_ref)
    e_floor = {n: max(a, b) for (n, a), b in zip(grad_errors(g_gmm, g_ref).items(), grad_errors(g_eag, g_ref).values())}
    names = _grad_names(e_mg, grads)
    bad = {n: (e_mg[n], e_floor[n], e_mf[n]) for n in names if not bf16_agrees(e_mg[n], e_floor[n])}
    res["worst_grad_vs_gmm"] = worst({n: e_mg[n] for n in names})
    res["grads_compared"] = len(names)
    assert not bad, f"gradients (mokgen vs grouped_mm, bf16 floor, mokgen vs fp32): {bad}"
    for n, g in g_mok.items():
        assert torch.isfinite(g).all(), n
    return res


# FP8 (configure(dtype="fp8")): e4m3 keeps 3 mantissa bits (a relative rounding of up to 2^-4 per operand
# element); on the tiny test models (two layers, K = 256 / 128) the reference kernels put the logits 1.5-8.4% and
# the experts' weight gradients 7-11% from the float32 model (all eight families, CPU, measured when this check
# was written). A wrong weight layout or a dropped scale is O(1).
FP8_TOL = dict(logits=0.15, experts=0.2)


def check_fp8(family: str, device: str, *, batch: int = 2, seq: int = 24, seed: int = 0, dtype: str = "fp8") -> dict:
    """The bf16 model with experts_implementation="mokgen" and ``configure(dtype=dtype)`` ("fp8", or "mxfp8": the
    e4m3 recipe with e8m0 scales per 32, sm_100a's; on the CPU its launch sequence) against the float32
    model on the same routing (:class:`RoutingReplay`): logits and the experts' weight gradients within
    :data:`FP8_TOL`, every gradient finite, and further from float32 than mokgen BF16 (the FP8 kernels ran, not
    the BF16 ones); the same bits on a rerun. Restores the backend's dtype."""
    from mokgen.integrations import transformers as mt

    ref = build(family, seed=seed, device=device, attn_implementation="eager", **DIMS)
    bf = clone(ref, torch.bfloat16)
    bf.set_experts_implementation("mokgen")
    ids = tokens(ref.config.vocab_size, batch, seq, seed=seed, device=device)
    old = mt.options().dtype
    runs = {}
    try:
        with RoutingReplay(DIMS["experts"], DIMS["topk"]) as rr:
            rr.record()
            l_ref, g_ref = step(ref, ids)
            stored = rr.stored
            for name, dt in (("bf16", "bf16"), ("fp8", dtype), ("fp8 again", dtype)):
                mt.configure(dtype=dt)
                rr.replay(stored)
                runs[name] = step(bf, ids)
    finally:
        mt.configure(dtype=old)
    (l16, g16), (l8, g8), (l8b, g8b) = runs["bf16"], runs["fp8"], runs["fp8 again"]
    experts = [n for n in g_ref if ".experts." in n]
    e8, e16 = grad_errors(g8, g_ref), grad_errors(g16, g_ref)
    res = {"logits": (rel_err(l8, l_ref), rel_err(l16, l_ref)), "experts": worst({n: e8[n] for n in experts}),
           "experts_bf16": worst({n: e16[n] for n in experts})}
    assert res["logits"][0] <= FP8_TOL["logits"], f"FP8 logits vs float32 (fp8, bf16): {res}"
    assert res["experts"][1] <= FP8_TOL["experts"], f"FP8 experts' gradients vs float32: {res}"
    assert res["logits"][0] > res["logits"][1] and res["experts"][1] > res["experts_bf16"][1], \
        f"FP8 as close to float32 as BF16: were the FP8 kernels run? {res}"
    for n, g in g8.items():
        assert torch.isfinite(g).all(), n
    assert torch.equal(bits(l8), bits(l8b)), "FP8 logits differ on a rerun"
    diff = [n for n in g8 if not torch.equal(bits(g8[n]), bits(g8b[n]))]
    assert not diff, f"FP8 gradients differ on a rerun: {diff}"
    return res


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def check_rerun_bits(family: str, device: str, *, batch: int = 2, seq: int = 24, seed: int = 0) -> None:
    """Two forward + backward steps of the bf16 model with mokgen: the same bits (logits, every gradient, every
    experts module's output). Needs deterministic torch kernels around mokgen: eager attention here, and
    ``torch.use_deterministic_algorithms(True)`` (+ ``CUBLAS_WORKSPACE_CONFIG``) set by the caller."""
    ref = build(family, seed=seed, device=device, attn_implementation="eager", **DIMS)
    bf = clone(ref, torch.bfloat16)
    bf.set_experts_implementation("mokgen")
    ids = tokens(ref.config.vocab_size, batch, seq, seed=seed, device=device)
    runs = []
    for _ in range(2):
        outs, rm = capture_experts(bf)
        logits, grads = step(bf, ids)
        rm()
        runs.append((logits, grads, outs))
    (l1, g1, o1), (l2, g2, o2) = runs
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(o1, o2)), "experts outputs differ on a rerun"
    diff = [n for n in g1 if not torch.equal(bits(g1[n]), bits(g2[n]))]
    assert not diff, f"gradients differ on a rerun: {diff}"
    assert torch.equal(bits(l1), bits(l2)), "logits differ on a rerun"


def padded_batch(vocab: int, device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two sequences of 24 and 13 tokens, left-padded to 24 (pad id 0), and their attention mask."""
    ids = tokens(vocab, 2, 24, seed=seed, device=device)
    mask = torch.ones_like(ids)
    mask[1, :11] = 0
    return ids.masked_fill(mask == 0, 0), mask


def check_generate(family: str, device: str, *, seed: int = 0, new_tokens: int = 6) -> dict:
    """Greedy generation with a KV cache (decode steps: T = batch) through the mokgen backend. Float32 model
    (mokgen's experts in bf16): the per-step scores equal the logits of one uncached forward over the generated
    sequence within 1e-2; bf16 model: it runs, every score finite."""
    ref = build(family, seed=seed, device=device, **DIMS).eval()
    ids = tokens(ref.config.vocab_size, 2, 8, seed=seed, device=device)
    res = {}
    for dtype in (torch.float32, torch.bfloat16):
        m = clone(ref, dtype)
        m.set_experts_implementation("mokgen")
        with torch.no_grad():
            out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, use_cache=True, return_dict_in_generate=True, output_logits=True,
                             pad_token_id=0)
            seq = out.sequences
            assert seq.shape == (2, 8 + new_tokens)
            assert out.past_key_values is not None
            steps = torch.stack([s.float() for s in out.logits], dim=1)     # [B, new, V]
            assert torch.isfinite(steps).all()
            if dtype == torch.float32:
                full = m(seq).logits.float()[:, 7:7 + new_tokens]
                res["scores_vs_full"] = rel_err(steps, full)
                assert res["scores_vs_full"] <= TOL, res
    return res


def check_sentinel(family: str, device: str, *, T: int = 41, seed: int = 0, small: dict | None = None) -> None:
    """transformers' expert-parallel sentinel at the experts level: about half the slots get id num_experts and
    weight 0 (``EpRouterParallel``). mokgen's output, dx, d(weights) and d(gate_up_proj) equal transformers'
    grouped_mm on the same inputs (which skips those slots) within 2e-2, the masked slots' weight gradients
    are exactly 0, a token whose slots are all masked gets exactly 0, and no routing error is reported."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    import mokgen.integrations.transformers as mt

    dims = small or DIMS
    m = build(family, dtype=torch.bfloat16, device=device, **dims)
    mod = next(mm for _n, mm in mt.experts_modules(m))
    mt.prepare(m)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, dims["experts"], generator=g)
    w, idx = torch.softmax(logits, -1).topk(dims["topk"], -1)
    w = w / w.sum(-1, keepdim=True)
    masked = torch.rand(idx.shape, generator=g) < 0.5
    idx = idx.masked_fill(masked, mod.num_experts).to(device)
    w = w.masked_fill(masked, 0.0).to(device)
    masked = masked.to(device)
    x = torch.randn(T, dims["hidden"], generator=g).to(device=device, dtype=torch.bfloat16)
    outs = {}
    for name, fn in (("mokgen", mt.experts_forward), ("grouped_mm", grouped_mm_experts_forward)):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        mod.zero_grad()
        y = fn(mod, xl, idx, wl)
        y.float().square().sum().backward()
        outs[name] = (y.float(), xl.grad.float(), wl.grad.float(), mod.gate_up_proj.grad.float())
    for what, a, b in zip(("y", "dx", "dw", "dgate_up"), outs["mokgen"], outs["grouped_mm"]):
        assert rel_err(a, b) < 2e-2, what
    assert torch.count_nonzero(outs["mokgen"][2][masked]) == 0
    mt.check_errors()
    idx_all = idx.clone()
    idx_all[0] = mod.num_experts
    with torch.no_grad():
        assert torch.count_nonzero(mt.experts_forward(mod, x, idx_all, w)[0]) == 0
    mt.check_errors()
