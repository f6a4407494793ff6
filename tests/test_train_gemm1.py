"""The training GEMM 1 split off from the inference one (plan ``backward.gemm1_train``, NOTES v17), and FP8
training plans' FP8 weight gradients by default. CPU: the plan rules, the launch sequences, and a training step
on the reference kernels with the split plan equal, bit for bit, to the step of the unsplit plan (the gather
kernel + TMA rows read the rows the fused gather reads)."""
from __future__ import annotations

import pytest
import torch

from mokgen import ops, plan as P
from mokgen import reference as ref
from mokgen.spec import load_spec


def big_groups(**kw):
    """Few experts with >= 1024 routed rows each: GEMM 1 gathers its own rows (the a_load rule), as on kimi-k2."""
    d = dict(name="two-big-experts", hidden=256, ffn=256, experts=2, topk=1, tokens=2048, ep=1, shared_experts=0,
             activation="swiglu", gate_up_layout="concat", bias=False)
    d.update(kw)
    return load_spec(d)


@pytest.mark.parametrize("name", ["kimi-k2", "glm-5", "deepseek-v4-pro"])
def test_gather_presets_train_on_tma_rows_with_the_z_ring(name):
    plan = P.solve(load_spec(name), "sm_90a")
    assert plan.gemm1.a_load == "gather" and plan.gemm1.z_store == "direct"     # inference: unchanged
    g = plan.train_gemm1
    assert plan.backward.gemm1_train is g
    assert (g.a_load, g.z_store, g.epi_store) == ("tma", "ring", "ring") and P.z_ring_problem(g) is None
    # the very kernel measured as the override gemm1_a_load=tma,gemm1_z_store=ring (NOTES v17)
    assert g == P.solve(load_spec(name), "sm_90a", gemm1_a_load="tma", gemm1_z_store="ring").gemm1
    assert any("training GEMM 1" in n for n in plan.notes)
    assert P.Plan.from_dict(plan.to_dict()) == plan


def test_overrides_keep_the_old_path():
    spec = load_spec("kimi-k2")
    direct = P.solve(spec, "sm_90a", gemm1_z_store="direct")
    assert direct.backward.gemm1_train is None and direct.train_gemm1 == direct.gemm1
    assert direct.gemm1.z_store == "direct" and "gemm1_train" not in direct.backward.to_dict()
    given = P.solve(spec, "sm_90a", gemm1_a_load="gather")      # an explicit A path holds for training too
    assert given.train_gemm1.a_load == "gather" and given.train_gemm1.z_store == "direct"
    with pytest.raises(P.PlanError, match="gemm1_z_store: ring needs the output through the ring"):
        P.solve(spec, "sm_90a", gemm1_a_load="gather", gemm1_z_store="ring")
    with pytest.raises(P.PlanError, match="gemm1_z_store: must be one of"):
        P.solve(spec, "sm_90a", gemm1_z_store="smem")


def test_shapes_without_a_ring_tile_are_unchanged():
    for name in ("qwen3-30b-a3b", "gpt-oss-120b"):    # ping-pong tiles / a 192-wide tile: no z stage fits
        plan = P.solve(load_spec(name), "sm_90a")
        assert plan.backward.gemm1_train is None and plan.gemm1.z_store == "direct"
    # FP8 training: GEMM 1 already reads TMA tiles (quant_rows_gather's rows): one GEMM 1 plan with z through the
    # ring, no split; "direct" keeps the old path
    fp8 = P.solve(load_spec("kimi-k2-fp8"), "sm_90a", gemm1_a_load="tma")   # (its default gathers: below)
    assert fp8.backward.gemm1_train is None and fp8.gemm1.z_store == "ring" and fp8.gemm1.a_load == "tma"
    assert P.solve(load_spec("kimi-k2-fp8"), "sm_90a", gemm1_z_store="direct").gemm1.z_store == "direct"
    with pytest.raises(P.PlanError, match=r"^plan\.gemm1_a_load: the FP8 GEMM 1 reads .* got 'tma_rows'$"):
        P.solve(load_spec("kimi-k2-fp8"), "sm_90a", gemm1_a_load="tma_rows")   # refused, not silently ignored
    # FP8 gather, the default on kimi-k2-fp8's large groups: the inference GEMM 1 gathers the per-token rows (four
    # warps, epilogue buffers) and the training GEMM 1 is split off on TMA rows with z through the ring, as BF16's
    dflt = P.solve(load_spec("kimi-k2-fp8"), "sm_90a")
    assert (dflt.gemm1.a_load, dflt.gemm1.epi_store) == ("gather", "smem") and dflt.train_gemm1 == fp8.gemm1
    # asked for, the gather holds for training too: with the ring (warps 2-3 gather beside the storer) z goes
    # through it (one plan); with epilogue buffers the training GEMM 1 stores z from the consumers
    ring = P.solve(load_spec("kimi-k2-fp8"), "sm_90a", gemm1_a_load="gather", gemm1_epi_store="ring")
    assert (ring.gemm1.a_load, ring.gemm1.epi_store, ring.gemm1.z_store) == ("gather", "ring", "ring")
    assert ring.backward.gemm1_train is None
    smem = P.solve(load_spec("kimi-k2-fp8"), "sm_90a", gemm1_a_load="gather")
    assert (smem.train_gemm1.a_load, smem.train_gemm1.epi_store, smem.train_gemm1.z_store) == ("gather", "smem",
                                                                                               "direct")
    assert P.solve(load_spec("kimi-k2-fp8"), "sm_90a", gemm1_a_load="tma").gemm1.a_load == "tma"
    fused = P.solve(load_spec("kimi-k2"), "sm_90a", schedule="fused")
    assert fused.backward is None or fused.backward.gemm1_train is None


def _moe(spec, plan):
    fns = ref.reference_kernels(spec, plan.bm, gather=ops.uses_gather_kernel(plan), training=True,
                                gather_train=ops.uses_gather_kernel(plan, training=True))
    return ops.CompiledMoE(spec, plan, functions=fns, allow_cpu=True, arch="sm_90a")


def test_split_step_equals_the_unsplit_step_bit_for_bit():
    spec = big_groups(hidden=512, ffn=512)
    # cooperative tiles (this small shape's plan picks ping-pong ones, which take no z stage)
    split = P.solve(spec, "sm_90a", consumer="cooperative")
    old = P.solve(spec, "sm_90a", consumer="cooperative", gemm1_z_store="direct")
    assert split.gemm1.a_load == "gather" and split.train_gemm1.a_load == "tma"
    assert old.train_gemm1.a_load == "gather"
    a, b = _moe(spec, split), _moe(spec, old)
    assert a.launch_sequence(training=False) == b.launch_sequence(training=False) == (
        "routing", "gemm1", "gemm2", "combine")
    assert a.launch_sequence()[:3] == ("routing", "gather", "gemm1_train")
    assert b.launch_sequence()[:2] == ("routing", "gemm1_train")
    _assert_same_step(spec, a, b, seed=3)


def _assert_same_step(spec, a, b, seed: int) -> None:
    """A training step (skewed routing drawn with `seed`) and an inference call of CompiledMoE `a` and `b`: y, the
    used rows of z and every gradient have the same bits."""
    inp = ref.random_inputs(spec, seed=seed, routing="skewed")
    x, idx, w, w1, w2 = inp.x, inp.topk_idx, inp.topk_weight, inp.w1, inp.w2
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 4)).to(torch.bfloat16)
    ya, sa = a.forward_train(x, idx, w, w1, w2)
    yb, sb = b.forward_train(x, idx, w, w1, w2)
    used = int(sa.meta[0]) * a.bm          # z past the used rows is never written (workspace memory)
    assert torch.equal(sa.meta, sb.meta) and used > 0
    assert torch.equal(ya, yb) and torch.equal(sa.z[:used], sb.z[:used])
    ga, gb = a.backward(dy, sa, x, w, w1, w2), b.backward(dy, sb, x, w, w1, w2)
    for name in ga._fields:
        u, v = getattr(ga, name), getattr(gb, name)
        assert (u is None) == (v is None), name
        if u is not None:
            assert torch.equal(u, v), name
    assert torch.equal(a(x, idx, w, w1, w2), b(x, idx, w, w1, w2))   # inference


def test_bf16_ring_gather_step_equals_the_split_step_bit_for_bit():
    """``gemm1_a_load=gather,gemm1_epi_store=ring`` (BF16, opt-in): GEMM 1 gathers its rows with warps 2-3 beside
    the ring's storer warp, so the training GEMM 1 gathers too and stores z through the ring (one GEMM 1 plan, no
    gather kernel in the training forward); the default keeps the four-warp gather with epilogue buffers. The
    training step and the inference forward have the same bits as the default (split) plan's."""
    spec = big_groups(hidden=512, ffn=512)
    split = P.solve(spec, "sm_90a", consumer="cooperative")
    ring = P.solve(spec, "sm_90a", consumer="cooperative", gemm1_a_load="gather", gemm1_epi_store="ring")
    assert P.solve(spec, "sm_90a", consumer="cooperative", gemm1_a_load="gather").gemm1.epi_store == "smem"
    assert (ring.gemm1.a_load, ring.gemm1.epi_store, ring.gemm1.z_store) == ("gather", "ring", "ring")
    assert ring.backward.gemm1_train is None and ring.train_gemm1 is ring.gemm1
    a, b = _moe(spec, split), _moe(spec, ring)
    assert b.launch_sequence()[:2] == ("routing", "gemm1_train")   # no gather kernel in the training forward
    _assert_same_step(spec, a, b, seed=4)


def test_fp8_training_plans_default_to_fp8_weight_gradients():
    spec = load_spec("kimi-k2-fp8")
    plan = P.solve(spec, "sm_90a")
    assert plan.backward.wgrad1.elem_bytes == plan.backward.wgrad2.elem_bytes == 1
    assert ops.fp8_wgrads(plan)
    assert not any(n.startswith("overrides: wgrad") for n in plan.notes)
    bf = P.solve(spec, "sm_90a", wgrad1_dtype="bf16", wgrad2_dtype="bf16")
    assert bf.backward.wgrad1.elem_bytes == bf.backward.wgrad2.elem_bytes == 2 and not ops.fp8_wgrads(bf)
    # a BF16 tile N asked for keeps that weight gradient BF16; the other stays FP8
    one = P.solve(spec, "sm_90a", wgrad2_bn=256)
    assert (one.backward.wgrad1.elem_bytes, one.backward.wgrad2.elem_bytes) == (1, 2)
    assert P.solve(load_spec("kimi-k2"), "sm_90a").backward.wgrad1.elem_bytes == 2   # BF16 specs: BF16
