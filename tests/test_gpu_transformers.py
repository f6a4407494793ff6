"""mokgen's transformers backend on a GPU (H200, sm_90a), with the compiled kernels (``mokgen.compile`` of the
derived specs: one for the six concat-SwiGLU families, one for GPT-OSS; built once into the cache).

Per family (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, Qwen3-Next, Qwen3.5-MoE, GLM-4-MoE, GPT-OSS: a 2-layer
model from its config class, small dims, random init, no download; tests/hf_models.py):

* ``experts_implementation="mokgen"`` on the float32 model (mokgen computes the experts in bf16) against the
  model's eager experts in float32, same weights and routing: logits and every experts module's output within
  1e-2, every gradient within 2e-2;
* bf16 model, mokgen against ``grouped_mm`` (and eager bf16), same routing: logits and every parameter's
  gradient within 1e-2 of grouped_mm, or within twice bf16's noise floor for that quantity measured in the same
  run (``hf_models.bf16_agrees``: grouped_mm itself is 1-8% from float32 on some gradients outside the experts);
* T = 1 (logits, experts' own gradients) and a left-padded batch (logits at real positions, every gradient);
* the same bits on a rerun (logits, every gradient, every experts output; eager attention, deterministic torch
  kernels);
* greedy generation with a KV cache;
* transformers' expert-parallel sentinel (id num_experts, weight 0) against grouped_mm at the experts level.

"Same routing": the routers' top-k choice is recorded in the reference run and replayed
(``hf_models.RoutingReplay``), so a near tie flipped by one bf16 rounding in layer 1 does not move layer 2's
expert choice (that alone moves the logits of these tiny models by several percent, for any two backends).

Run from the repository root, in its own process (it sets ``CUBLAS_WORKSPACE_CONFIG`` before CUDA starts):

    PYTHONPATH=$PWD python -m pytest -q -m gpu tests/test_gpu_transformers.py

``MOKGEN_HF_FAMILIES`` (comma-separated) picks families.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # deterministic cuBLAS for the rerun check

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("transformers")

import mokgen.integrations.transformers as mt  # noqa: E402

import hf_models as H  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.training]
DEV = "cuda"
FAMILIES = [f.strip() for f in os.environ.get("MOKGEN_HF_FAMILIES", ",".join(H.FAMILIES)).split(",") if f.strip()]


@pytest.fixture(scope="module", autouse=True)
def float32_is_float32():
    """The float32 references in true float32 (no TF32 in matmuls or cuDNN convolutions: Qwen3-Next's conv1d)."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    mt.set_compiler(None)   # mokgen.compile: the real kernels
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.mark.parametrize("family", FAMILIES)
def test_vs_float32_eager(family):
    print(family, H.check_vs_fp32_eager(family, DEV))


@pytest.mark.parametrize("family", FAMILIES)
def test_vs_grouped_mm_bf16(family):
    print(family, H.check_vs_grouped_mm(family, DEV))


@pytest.mark.parametrize("family", FAMILIES)
def test_single_token(family):
    print(family, H.check_vs_fp32_eager(family, DEV, batch=1, seq=1, grads="experts"),
          H.check_vs_grouped_mm(family, DEV, batch=1, seq=1, grads="experts"))


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_batch(family):
    ids, mask = H.padded_batch(512, DEV)
    print(family, H.check_vs_grouped_mm(family, DEV, ids=ids, attention_mask=mask))


@pytest.mark.parametrize("family", FAMILIES)
def test_rerun_same_bits(family):
    old = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        H.check_rerun_bits(family, DEV)
    finally:
        torch.use_deterministic_algorithms(old[0], warn_only=old[1])


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_with_kv_cache(family):
    print(family, H.check_generate(family, DEV))


@pytest.mark.parametrize("family", [f for f in ("qwen3_moe", "gpt_oss") if f in FAMILIES])
def test_expert_parallel_sentinel(family):
    H.check_sentinel(family, DEV)


def test_one_compile_per_expert_shape():
    """Every family above went through at most two specs (concat SwiGLU, GPT-OSS), each compiled once."""
    H.check_sentinel(FAMILIES[0], DEV)
    names = sorted(s.name for s in mt._COMPILED)
    assert set(names) <= {"hf-h256-i128-e8-k2", "hf-h256-i128-e8-k2-oai", "hf-h256-i128-e8-k2-fp8",
                          "hf-h256-i128-e8-k2-oai-fp8"}, names
    for moe in mt._COMPILED.values():
        assert moe.arch is not None and moe.entry_dir is not None   # a real cache entry, not the reference


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_experts(family):
    """configure(dtype="fp8"): the model trains through mokgen's FP8 kernels (hf_models.check_fp8: logits and the
    experts' gradients within FP8's tolerance of float32, further than BF16, the same bits on a rerun)."""
    old = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        print(family, H.check_fp8(family, DEV))
    finally:
        torch.use_deterministic_algorithms(old[0], warn_only=old[1])
