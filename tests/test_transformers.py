"""mokgen's transformers backend (mokgen.integrations.transformers) on a CPU.

The kernels are mokgen's reference kernels (``reference_compiler``: the runtime's launch sequence with the
step functions of mokgen.reference), swapped in with ``set_compiler``; everything else (registration, the
layout mapping, the spec, the masking mode, the casts, ``apply``) is the code the GPU runs.

* the layout mapping of every family against the module's own eager forward, both in float64;
* the spec derived from each config (and under expert parallelism), one spec per shape across families;
* the weights stay the model's parameters (no copy for the concat families; GPT-OSS relaid once, same
  Parameter objects, names and shapes; optimizer step and state-dict round trip);
* transformers' expert-parallel sentinel (id == num_experts, weight 0) through the masking mode, against
  transformers' own grouped_mm handling of it; negative ids still reported; masked=False reports the sentinel;
* int64 ids, fp32 weights, T varying without a recompile, unsupported modules, ``apply`` / ``unapply``;
* the model-level checks of tests/test_gpu_transformers.py (tests/hf_models.py), run here with the reference
  kernels: float32 model vs eager, bf16 vs grouped_mm (logits and every gradient), T = 1, a padded batch, the
  same bits on a rerun, generation with a KV cache.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import mokgen  # noqa: E402
import mokgen.integrations.transformers as mt  # noqa: E402
from mokgen import reference as ref  # noqa: E402
from mokgen.reference import rel_err  # noqa: E402

import hf_models as H  # noqa: E402

CONCAT = [f for f in H.FAMILIES if f != "gpt_oss"]
SMALL = dict(hidden=64, ffn=64, experts=8, topk=2, vocab=128)


@pytest.fixture(autouse=True)
def reference_kernels():
    """Every test here runs on the reference kernels, with the default options, and leaves them so."""
    old = mt.set_compiler(mt.reference_compiler())
    opts = mt.options()
    yield
    mt.configure(tokens=opts.tokens, masked=opts.masked, relayout=opts.relayout, overrides=opts.overrides or {},
                 dtype=opts.dtype)
    mt.set_compiler(old)


class CountingCompiler:
    def __init__(self):
        self.inner = mt.reference_compiler()
        self.specs = []

    def __call__(self, spec):
        self.specs.append(spec)
        return self.inner(spec)


def first_experts(model):
    return next(m for _n, m in mt.experts_modules(model))


def routing(T, E=8, K=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    w, idx = torch.softmax(logits, -1).topk(K, -1)
    return idx, (w / w.sum(-1, keepdim=True)).contiguous()


# ---- registration ----------------------------------------------------------------------------------------------


def test_registered_in_the_experts_interface():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    assert mt.registered() and mt.KEY == "mokgen"
    assert ALL_EXPERTS_FUNCTIONS["mokgen"] is mt.experts_forward
    assert ExpertsInterface().get_interface("mokgen", None) is mt.experts_forward
    m = H.build("qwen3_moe", experts_implementation="mokgen", **SMALL)
    assert m.config._experts_implementation == "mokgen"
    m.set_experts_implementation("grouped_mm")
    assert m.config._experts_implementation == "grouped_mm"
    m.set_experts_implementation("mokgen")
    assert m.config._experts_implementation == "mokgen"


# ---- the layout mapping, in float64 -----------------------------------------------------------------------------


def _deepseek_v4_experts():
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts

    cfg = DeepseekV4Config(hidden_size=64, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
                           swiglu_limit=0.05)   # a small limit, so that the clamps clamp
    cfg._experts_implementation = "eager"
    m = DeepseekV4Experts(cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return m


@pytest.mark.parametrize("family", list(H.FAMILIES) + ["deepseek_v4"])
def test_layout_mapping_against_eager_float64(family):
    """mokgen.reference.forward on the weights as mokgen_weights maps them (and the derived spec's activation,
    layout, bias, limit) equals the module's own eager forward, both in float64; so do the gradients
    (reference.backward_autograd vs autograd through the eager forward)."""
    if family == "deepseek_v4":
        mod = _deepseek_v4_experts().double()
    else:
        model = H.build(family, **SMALL).double()
        model.set_experts_implementation("eager")
        mod = first_experts(model)
        if family == "gpt_oss":   # clamp-sensitive values: make some gate / up pre-activations exceed 7
            with torch.no_grad():
                mod.gate_up_proj.mul_(60.0)
    spec = mt.derive_spec(mod, 2)
    T = 37
    x = torch.randn(T, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    idx, w = routing(T)
    w = w.double()
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = mod(xl, idx, wl)
    dy = torch.randn_like(want)
    want.backward(dy)
    w1, w2, b1, b2 = mt.mokgen_weights(mod, dtype=None)
    assert tuple(w1.shape) == (8, 128, 64) and tuple(w2.shape) == (8, 64, 64)
    got = ref.forward(x, idx, w, w1, w2, spec, b1, b2, dtype=torch.float64)
    assert rel_err(got, want) < 1e-12
    g = ref.backward(dy, x, idx, w, w1, w2, spec, b1, b2, dtype=torch.float64)
    assert rel_err(g.x, xl.grad) < 1e-12 and rel_err(g.topk_weight, wl.grad) < 1e-12
    # the weight gradients in mokgen's layout map back to the module's parameters' (autograd through the views)
    params = [mod.gate_up_proj, mod.down_proj] + ([mod.gate_up_proj_bias, mod.down_proj_bias] if spec.bias else [])
    views = [t for t in mt.mokgen_weights(mod, dtype=None) if t is not None]
    grads = torch.autograd.grad(ref.forward(x, idx, w, *views[:2], spec, *(views[2:] or [None, None]),
                                            dtype=torch.float64), params, dy)
    mod.zero_grad()
    mod(x, idx, w).backward(dy)
    for p, gp in zip(params, grads):
        assert rel_err(gp, p.grad) < 1e-12


# ---- the spec ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", H.FAMILIES)
def test_spec_from_config(family):
    m = H.build(family, **H.DIMS)
    specs = {mt.derive_spec(mod) for _n, mod in mt.experts_modules(m)}
    assert len(specs) == 1   # one spec for all layers of a model
    spec = specs.pop()
    assert (spec.hidden, spec.ffn, spec.experts, spec.ep, spec.local_experts, spec.topk) == (256, 128, 8, 1, 8, 2)
    assert spec.tokens == mt.DEFAULT_TOKENS and spec.shared_experts == 0
    if family == "gpt_oss":
        assert (spec.activation, spec.gate_up_layout, spec.bias, spec.swiglu_limit) == ("swiglu_oai", "interleaved",
                                                                                        True, 7.0)
        assert spec.name == "hf-h256-i128-e8-k2-oai"
    else:
        assert (spec.activation, spec.gate_up_layout, spec.bias, spec.swiglu_limit) == ("swiglu", "concat", False,
                                                                                        None)
        assert spec.name == "hf-h256-i128-e8-k2"


def test_one_spec_per_shape_across_families():
    """The six concat families with one expert shape share one spec, hence one compile / cache entry."""
    specs = {mt.derive_spec(first_experts(H.build(f, **SMALL))) for f in CONCAT}
    assert len(specs) == 1


def test_spec_tokens_is_configurable_and_not_a_cap():
    counting = CountingCompiler()
    mt.set_compiler(counting)
    mt.configure(tokens=64)
    m = H.build("qwen3_moe", dtype=torch.bfloat16, experts_implementation="mokgen", **SMALL)
    with torch.no_grad():
        m(H.tokens(128, 4, 40))    # T = 160 > tokens: runs (the workspace is sized per call)
    assert [s.tokens for s in counting.specs] == [64]


def test_spec_under_expert_parallelism():
    """transformers' EP shards the experts: the module holds num_experts local ones of the config's total;
    the spec is one rank's share (ep = total / local), so topk may exceed the local count."""
    m = H.build("qwen3_moe", **SMALL)
    mod = first_experts(m)
    with torch.no_grad():
        mod.gate_up_proj = torch.nn.Parameter(mod.gate_up_proj[2:4].clone())
        mod.down_proj = torch.nn.Parameter(mod.down_proj[2:4].clone())
    mod.num_experts = 2
    spec = mt.derive_spec(mod, 2)
    assert (spec.experts, spec.ep, spec.local_experts, spec.topk) == (8, 4, 2, 2)
    assert spec.name == "hf-h64-i64-e2x4-k2"
    mod.num_experts = 3
    with pytest.raises(mt.UnsupportedExperts, match="num_experts=3 but the weights hold 2"):
        mt.derive_spec(mod, 2)


def test_dtype_option():
    """configure(dtype=...): the experts' precision is the spec's dtype (its name says it, so BF16 and FP8 are
    two cache entries), a change drops the compiled kernels, a bad value is one line; mxfp8 is sm_100a's, for dims
    that are multiples of 64 as bf16's (the tiny model's 64 included)."""
    counting = CountingCompiler()
    mt.set_compiler(counting)
    m = H.build("qwen3_moe", dtype=torch.bfloat16, experts_implementation="mokgen", **SMALL)
    ids = H.tokens(128, 2, 8)
    with torch.no_grad():
        m(ids)
        mt.configure(dtype="fp8")
        m(ids)
        m(ids)
    assert [(s.name, s.dtype, s.archs) for s in counting.specs] == [
        ("hf-h64-i64-e8-k2", "bf16", ("sm_90a",)), ("hf-h64-i64-e8-k2-fp8", "fp8", ("sm_90a",))]
    assert mt.derive_spec(first_experts(H.build("gpt_oss", **SMALL))).name == "hf-h64-i64-e8-k2-oai-fp8"
    with pytest.raises(ValueError, match="dtype must be one of bf16, fp8, mxfp8, got 'fp16'"):
        mt.configure(dtype="fp16")
    assert mt.options().dtype == "fp8"
    big = mt.spec_for(mt.layout_of(first_experts(m)), 256, 128, 8, 2, dtype="mxfp8")
    assert (big.name, big.dtype, big.archs) == ("hf-h256-i128-e8-k2-mxfp8", "mxfp8", ("sm_100a",))
    mt.configure(dtype="mxfp8")   # multiples of 64 suffice, as for bf16 (partial 128-wide tiles: gpt-oss-120b's 2880)
    tiny = mt.derive_spec(first_experts(m))
    assert (tiny.name, tiny.dtype, tiny.archs, tiny.hidden, tiny.ffn) == (
        "hf-h64-i64-e8-k2-mxfp8", "mxfp8", ("sm_100a",), 64, 64)


@pytest.mark.parametrize("family", H.FAMILIES)
def test_model_fp8(family):
    print(family, H.check_fp8(family, "cpu"))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_model_mxfp8(family):
    """configure(dtype="mxfp8"): the same model-level check through the MXFP8 launch sequence (sm_100a's plan, its
    quantizers and block-scaled GEMMs as reference steps; never run on a Blackwell GPU)."""
    print(family, H.check_fp8(family, "cpu", dtype="mxfp8"))


# ---- the weights stay the model's ----------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_weights_stay_the_models_parameters(family):
    m = H.build(family, dtype=torch.bfloat16, **SMALL)
    names = {n: (tuple(p.shape), id(p)) for n, p in m.named_parameters()}
    sd_keys = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    m.set_experts_implementation("mokgen")
    ids = H.tokens(128, 2, 9)
    m(ids).logits.float().square().mean().backward()
    assert {n: (tuple(p.shape), id(p)) for n, p in m.named_parameters()} == names
    assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == sd_keys
    for _n, mod in mt.experts_modules(m):
        w1, w2, b1, b2 = mt.mokgen_weights(mod)
        if family == "gpt_oss":   # relaid once: the transposes are contiguous views of the same storage
            assert mod.gate_up_proj.stride() == (64 * 128, 1, 64)
            assert w1.data_ptr() == mod.gate_up_proj.data_ptr() and w1.is_contiguous()
            assert w2.data_ptr() == mod.down_proj.data_ptr() and w2.is_contiguous()
            assert mod.gate_up_proj.grad.shape == mod.gate_up_proj.shape
            assert b1.dtype == torch.float32   # bf16 biases: cast per call (E * (2I + H) elements)
        else:                     # no copy at all
            assert w1 is mod.gate_up_proj and w2 is mod.down_proj and b1 is None
        assert mod.gate_up_proj.grad is not None and mod.down_proj.grad is not None
    # an optimizer step, then the state dict into a fresh model (of the original layout) computes the same
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    opt.step()
    fresh = H.build(family, dtype=torch.bfloat16, seed=7, **SMALL)
    fresh.load_state_dict(m.state_dict())
    m.set_experts_implementation("eager")
    fresh.set_experts_implementation("eager")
    with torch.no_grad():
        assert torch.equal(m(ids).logits, fresh(ids).logits)


def test_relayout_off_copies_per_call_with_a_warning():
    mt.configure(relayout=False)
    m = H.build("gpt_oss", dtype=torch.bfloat16, experts_implementation="mokgen", **SMALL)
    mt._WARNED.discard("layout-copy:GptOssExperts")
    with pytest.warns(UserWarning, match="copied on every call"):
        with torch.no_grad():
            y1 = m(H.tokens(128, 2, 9)).logits
    assert not first_experts(m).gate_up_proj.transpose(1, 2).is_contiguous()
    mt.configure(relayout=True)
    mt.prepare(m)
    assert first_experts(m).gate_up_proj.transpose(1, 2).is_contiguous()
    with torch.no_grad():
        assert torch.equal(m(H.tokens(128, 2, 9)).logits, y1)


# ---- expert parallelism: the sentinel ---------------------------------------------------------------------------


def _sentinel_inputs(mod, T=41, seed=0):
    idx, w = routing(T, seed=seed)
    g = torch.Generator().manual_seed(seed + 5)
    masked = torch.rand(idx.shape, generator=g) < 0.5
    idx = idx.masked_fill(masked, mod.num_experts)          # EpRouterParallel: id num_local_experts, weight 0
    w = w.masked_fill(masked, 0.0)
    x = torch.randn(T, 64, generator=g).to(torch.bfloat16)
    return x, idx, w, masked


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_expert_parallel_sentinel_gives_zero(family):
    """Slots with id == num_experts and weight 0 (another rank's expert) add nothing: tests/hf_models.py
    check_sentinel (against transformers' grouped_mm, which skips them)."""
    H.check_sentinel(family, "cpu", small={k: SMALL[k] for k in ("hidden", "ffn", "experts", "topk")})


def test_negative_ids_and_masked_false_are_still_errors():
    m = H.build("qwen3_moe", dtype=torch.bfloat16, **SMALL)
    mod = first_experts(m)
    x, idx, w, _ = _sentinel_inputs(mod)
    bad = idx.clone()
    bad[4, 1] = -1
    with torch.no_grad():
        mt.experts_forward(mod, x, bad, w)
    with pytest.raises(mokgen.RoutingError):
        mt.check_errors()
    mt.configure(masked=False)
    with torch.no_grad():
        mt.experts_forward(mod, x, idx, w)
    with pytest.raises(mokgen.RoutingError, match=r"outside \[0, 8\)"):
        mt.check_errors()
    mt.configure(masked=True)
    with torch.no_grad():
        mt.experts_forward(mod, x, idx, w)
    mt.check_errors()


# ---- inputs and calls -------------------------------------------------------------------------------------------


def test_int64_ids_and_bf16_weights_need_no_warning():
    m = H.build("qwen3_moe", dtype=torch.bfloat16, **SMALL)
    mod = first_experts(m)
    idx, w = routing(13)
    assert idx.dtype == torch.int64
    x = torch.randn(13, 64).to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            y = mt.experts_forward(mod, x, idx, w.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.shape == (13, 64)
    with torch.no_grad():
        y32 = mt.experts_forward(mod, x, idx.to(torch.int32), w.to(torch.bfloat16))
    assert torch.equal(y, y32)


def test_fp32_weights_are_cast_per_call_with_a_warning():
    m = H.build("qwen3_moe", **SMALL)   # float32
    mod = first_experts(m)
    idx, w = routing(13)
    x = torch.randn(13, 64)
    mt._WARNED.discard("cast:torch.float32")
    with pytest.warns(UserWarning, match="cast to torch.bfloat16 on every call"):
        xl = x.clone().requires_grad_()
        y = mt.experts_forward(mod, xl, idx, w)
    assert y.dtype == torch.float32
    y.sum().backward()
    assert mod.gate_up_proj.grad.dtype == torch.float32 and xl.grad.dtype == torch.float32
    m.set_experts_implementation("eager")
    with torch.no_grad():
        assert rel_err(y.detach(), mod(x, idx, w)) < 1e-2


def test_tokens_vary_without_a_recompile():
    counting = CountingCompiler()
    mt.set_compiler(counting)
    m = H.build("qwen3_moe", dtype=torch.bfloat16, experts_implementation="mokgen", **SMALL)
    mod = first_experts(m)
    for B, L in ((2, 24), (1, 1), (3, 17)):
        m(H.tokens(128, B, L)).logits.float().mean().backward()
    with torch.no_grad():
        y = mt.experts_forward(mod, torch.zeros(0, 64, dtype=torch.bfloat16), torch.zeros(0, 2, dtype=torch.int64),
                               torch.zeros(0, 2))
    assert y.shape == (0, 64)
    assert len(counting.specs) == 1   # both layers, every T: one spec, compiled once


def test_hidden_states_of_more_dims():
    m = H.build("qwen3_moe", dtype=torch.bfloat16, **SMALL)
    mod = first_experts(m)
    idx, w = routing(12)
    x = torch.randn(12, 64).to(torch.bfloat16)
    with torch.no_grad():
        flat = mt.experts_forward(mod, x, idx, w)
        shaped = mt.experts_forward(mod, x.view(3, 4, 64), idx.view(3, 4, 2), w.view(3, 4, 2))
    assert shaped.shape == (3, 4, 64) and torch.equal(shaped.reshape(12, 64), flat)


# ---- unsupported modules ----------------------------------------------------------------------------------------


def test_unsupported_modules_say_why():
    import transformers as tf

    m = H.build("qwen3_moe", **SMALL)
    mod = copy.deepcopy(first_experts(m))
    mod.act_fn = torch.nn.GELU()
    with pytest.raises(mt.UnsupportedExperts, match="SwiGLU"):
        mt.layout_of(mod)
    mod = copy.deepcopy(first_experts(m))
    mod.has_gate = False
    with pytest.raises(mt.UnsupportedExperts, match="has_gate=False"):
        mt.layout_of(mod)
    mod = copy.deepcopy(first_experts(m))
    mod.is_concatenated = False
    with pytest.raises(mt.UnsupportedExperts, match="inconsistent"):
        mt.layout_of(mod)

    class OtherGate(type(first_experts(m))):
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return torch.relu(gate) * up

    odd = OtherGate(m.config)
    with pytest.raises(mt.UnsupportedExperts, match="OtherGate._apply_gate"):
        mt.layout_of(odd)
    cfg = tf.Qwen3MoeConfig(hidden_size=96, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                            head_dim=48)
    bad = tf.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(mt.UnsupportedExperts, match=r"spec.hidden: must be a positive multiple of 64, got 96"):
        mt.derive_spec(first_experts(bad))


# ---- apply / unapply (versions without the experts interface) ------------------------------------------------


def test_apply_and_unapply():
    counting = CountingCompiler()
    mt.set_compiler(counting)
    m = H.build("gpt_oss", dtype=torch.bfloat16, experts_implementation="eager", **SMALL)
    ids = H.tokens(128, 2, 11)
    with torch.no_grad():
        eager = m(ids).logits
    names = mt.apply(m)
    assert names == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    with torch.no_grad():
        patched = m(ids).logits
    assert len(counting.specs) == 1
    m2 = copy.deepcopy(m)
    assert mt.unapply(m2) == names
    m2.set_experts_implementation("mokgen")   # the interface path gives the same bits
    with torch.no_grad():
        assert torch.equal(m2(ids).logits, patched)
    assert mt.unapply(m) == names
    with torch.no_grad():
        assert torch.equal(m(ids).logits, eager)   # eager again (the relaid storage computes the same)


def test_apply_refuses_models_without_fused_experts():
    class OldStyle(torch.nn.Module):   # transformers < 5: a ModuleList of per-expert MLPs
        def __init__(self):
            super().__init__()
            self.experts = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])

    with pytest.raises(ValueError, match="ModuleList of per-expert MLPs"):
        mt.apply(OldStyle())
    with pytest.raises(ValueError, match="no fused experts module"):
        mt.apply(torch.nn.Linear(2, 2))


# ---- the model-level checks of the GPU test, on the reference kernels -------------------------------------------


@pytest.mark.parametrize("family", H.FAMILIES)
def test_model_vs_float32_eager(family):
    H.check_vs_fp32_eager(family, "cpu")


@pytest.mark.parametrize("family", H.FAMILIES)
def test_model_vs_grouped_mm_bf16(family):
    H.check_vs_grouped_mm(family, "cpu")


@pytest.mark.parametrize("family", H.FAMILIES)
def test_model_single_token_and_padded_batch(family):
    H.check_vs_fp32_eager(family, "cpu", batch=1, seq=1, grads="experts")
    H.check_vs_grouped_mm(family, "cpu", batch=1, seq=1, grads="experts")
    ids, mask = H.padded_batch(512, "cpu")
    H.check_vs_grouped_mm(family, "cpu", ids=ids, attention_mask=mask)


@pytest.mark.parametrize("family", H.FAMILIES)
def test_model_rerun_bits_and_generation(family):
    H.check_rerun_bits(family, "cpu")
    H.check_generate(family, "cpu")


def test_prebuild_specs_match_the_derived_ones():
    """tools/specs/hf-*.yaml (for tools/prebuild.py) are the specs the backend derives for the GPU test's models
    and tools/bench_model.py's: the same cache keys."""
    import argparse
    import sys
    from pathlib import Path

    tools = Path(__file__).resolve().parents[1] / "tools"
    sys.path.insert(0, str(tools))
    import bench_model as BM

    specs = tools / "specs"
    for family, name in (("qwen3_moe", "hf-h256-i128-e8-k2"), ("gpt_oss", "hf-h256-i128-e8-k2-oai")):
        derived = mt.derive_spec(first_experts(H.build(family, **H.DIMS)))
        assert derived == mokgen.load_spec(specs / f"{name}.yaml")
    a = argparse.Namespace(hidden=2048, layers=1, experts=128, topk=8, moe_intermediate=768, vocab=256, seq=1024)
    with torch.device("meta"):
        import transformers as tf

        m = tf.AutoModelForCausalLM.from_config(BM.model_config(a))
    assert mt.derive_spec(first_experts(m)) == mokgen.load_spec(specs / "hf-h2048-i768-e128-k8.yaml")


def test_from_pretrained_and_save_pretrained(tmp_path):
    """``from_pretrained(..., experts_implementation="mokgen")`` loads a checkpoint into the mokgen backend, and
    a model whose GPT-OSS experts were relaid saves a checkpoint that loads back to the same outputs (transformers
    saves ``.contiguous()`` tensors: the checkpoint keeps the model's own layout and names)."""
    import transformers as tf

    m = H.build("gpt_oss", dtype=torch.bfloat16, experts_implementation="mokgen", **SMALL)
    ids = H.tokens(128, 2, 9)
    with torch.no_grad():
        y = m(ids).logits   # relays out the experts' storage
    assert first_experts(m).gate_up_proj.transpose(1, 2).is_contiguous()
    m.save_pretrained(tmp_path / "ckpt")
    back = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16,
                                                   experts_implementation="mokgen")
    assert back.config._experts_implementation == "mokgen"
    assert tuple(first_experts(back).gate_up_proj.shape) == (8, 64, 128)
    sd, sd_back = m.state_dict(), back.state_dict()
    assert sd.keys() == sd_back.keys() and all(torch.equal(sd[k], sd_back[k]) for k in sd)
    # (the whole models' logits differ slightly: from_pretrained sets up other things than from_config; the
    # experts compute the same bits)
    x = torch.randn(13, 64).to(torch.bfloat16)
    idx, w = routing(13)
    with torch.no_grad():
        assert torch.equal(mt.experts_forward(first_experts(back), x, idx, w),
                           mt.experts_forward(first_experts(m), x, idx, w))
    assert y.shape == (2, 9, 128)
