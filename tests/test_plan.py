import dataclasses
import json
import math

import pytest

from mokgen.plan import (
    ARCHS, BN_CHOICES, GATHER_MIN_GROUP_ROWS, MAINLOOP_EFF, SMALL_GROUPS_GEMM1_RASTER, GemmPlan, Plan, PlanError,
    cap_rows, candidates, explain, get_arch, solve,
)
from mokgen.spec import KNOWN_ARCHS, list_presets, load_spec

PRESETS = [s.name for s in list_presets() if s.dtype == "bf16"]  # the FP8 presets: tests/test_plan_fp8.py
CASES = [(name, arch) for name in PRESETS for arch in ARCHS]


def _smem(g: GemmPlan) -> int:
    return g.stages * (g.tile_m * g.bk + g.bn * g.bk) * 2 + g.epi_m * g.epi_n * 2 * 2 + 1024


def test_archs():
    assert tuple(ARCHS) == KNOWN_ARCHS
    h200 = get_arch("sm_90a")
    assert (h200.sms, h200.smem_per_cta, h200.peak_bf16_tflops, h200.hbm_tbps) == (132, 232448 - 1024, 811.0, 4.27)
    assert h200.has_wgmma and not h200.has_tcgen05
    b200 = get_arch("sm_100a")
    assert (b200.sms, b200.peak_bf16_tflops, b200.hbm_tbps) == (148, 2250.0, 8.0) and b200.has_tcgen05
    with pytest.raises(PlanError, match=r"^plan\.arch: unknown arch 'sm_80'; known archs: sm_90a, sm_100a$"):
        get_arch("sm_80")


@pytest.mark.parametrize("name,arch", CASES)
def test_constraints(name, arch):
    spec, a = load_spec(name), get_arch(arch)
    plan = solve(spec, arch)
    g1, g2 = plan.gemm1, plan.gemm2
    assert plan.arch == arch and plan.spec == spec
    assert plan.bm == g1.bm == g2.bm == max(g1.tile_m, g2.tile_m)
    # ping-pong only where the cooperative plan is compute bound and many small groups pad a lot
    assert (g1.consumer == "pingpong") == (name == "qwen3-30b-a3b" and arch == "sm_90a") == (plan.bm == 64)
    for g in (g1, g2):
        assert g.bk == 64 and g.bn in BN_CHOICES and g.consumer_wgs == 2
        assert 3 <= g.stages <= 7
        assert _smem(g) <= a.smem_per_cta
        assert g.stages == 7 or _smem(GemmPlan(**{**g.to_dict(), "stages": g.stages + 1})) > a.smem_per_cta
    # tall panels (fewer DRAM re-reads of W) exactly where one group's W overflows L2/4 and groups are large, and
    # for sm_90a's GEMM 1 where groups are small but span two 128-row tiles
    rows = spec.routed_rows / spec.local_experts
    for which, g in ((1, g1), (2, g2)):
        n, k = (2 * spec.ffn, spec.hidden) if which == 1 else (spec.hidden, spec.ffn)
        tall = rows >= GATHER_MIN_GROUP_ROWS and 2 * n * k > a.l2_bytes // 4
        small = which == 1 and arch == "sm_90a" and 256 <= rows < GATHER_MIN_GROUP_ROWS
        want = {1: 32, 2: 16}[which] if tall else (SMALL_GROUPS_GEMM1_RASTER if small else min(8, g.raster_group))
        assert g.raster_group == want and g.raster_group >= 1
    # GEMM 1 gathers in its producer unless the routed groups are small (gpt-oss-120b 128, qwen3-30b-a3b 256 rows)
    small = spec.routed_rows / spec.local_experts < GATHER_MIN_GROUP_ROWS
    assert small == (name in ("gpt-oss-120b", "qwen3-30b-a3b"))
    # sm_100a: its tcgen05 GEMM 1 reads the gathered rows by TMA tiles; both archs plan the backward
    assert (g1.a_load, g2.a_load) == ("tma" if small or arch == "sm_100a" else "gather", "tma")
    assert plan.backward is not None
    for mode in ("tma", "gather", "tma_rows"):
        assert solve(spec, "sm_90a", gemm1_a_load=mode).gemm1.a_load == mode
    assert solve(spec, "sm_90a", schedule="fused").gemm1.a_load == "gather"  # the fused kernel gathers itself
    assert spec.ffn % (g1.bn // 2) == 0
    assert g1.n_tiles * g1.bn == 2 * spec.ffn and g1.k_tiles * 64 == spec.hidden
    assert g2.n_tiles == math.ceil(spec.hidden / g2.bn) and g2.k_tiles * 64 == spec.ffn
    worst = spec.tokens * (spec.topk + spec.shared_experts) + spec.groups * (plan.bm - 1)
    assert plan.cap_rows >= worst and plan.cap_rows % plan.bm == 0 and plan.cap_rows - worst < plan.bm
    assert plan.max_m_tiles * plan.bm == plan.cap_rows
    assert plan.chunk_rows % plan.bm == 0
    for g in (g1, g2):
        assert plan.chunk_rows // plan.bm * g.n_tiles >= 2 * a.sms  # MoK: >= 2 waves per chunk
    smaller = plan.chunk_rows // plan.bm - 1
    assert smaller * min(g1.n_tiles, g2.n_tiles) < 2 * a.sms  # and the smallest such chunk
    assert plan.waves1 > 0 and plan.waves2 > 0
    assert 0 < plan.predicted_ms and 0 < plan.predicted_tflops <= a.peak_bf16_tflops
    assert plan.predicted_tflops == pytest.approx(spec.flops_forward / plan.predicted_ms / 1e9, rel=1e-3)


@pytest.mark.parametrize("name,arch", CASES)
def test_deterministic_and_round_trip(name, arch):
    spec = load_spec(name)
    plan = solve(spec, arch)
    assert solve(load_spec(name), arch).canonical_json() == plan.canonical_json()
    again = Plan.from_dict(plan.to_dict())
    assert again == plan and again.canonical_json() == plan.canonical_json()
    assert candidates(spec, arch)[0].canonical_json() == plan.canonical_json()


def test_gpt_oss_tiles_divide_2880():
    plan = solve(load_spec("gpt-oss-120b"))
    assert (plan.gemm1.bn, plan.gemm2.bn) == (192, 192)
    assert 2880 % (plan.gemm1.bn // 2) == 0 and 2880 % plan.gemm2.bn == 0
    assert plan.gemm1.stages == plan.gemm2.stages == 5
    for p in candidates(load_spec("gpt-oss-120b")):
        assert 2880 % (p.gemm1.bn // 2) == 0  # bn 256 (128 outputs) never offered


def test_kimi_plan():
    plan = solve(load_spec("kimi-k2"))
    assert (plan.gemm1.bn, plan.gemm2.bn, plan.gemm1.stages, plan.gemm2.stages) == (256, 256, 4, 4)
    assert plan.chunk_rows == 128 * math.ceil(2 * 132 / 16)


def test_cap_rows_formula():
    spec = load_spec("kimi-k2")
    assert cap_rows(spec, 128, 2048) == math.ceil((2048 * 8 + 2048 + 7 * 127) / 128) * 128
    assert cap_rows(spec, 128, 1) == math.ceil((8 + 1 + 7 * 127) / 128) * 128


def test_candidates_ranked():
    spec = load_spec("deepseek-v3")
    ranked = candidates(spec)
    assert [p.predicted_ms for p in ranked] == sorted(p.predicted_ms for p in ranked)
    assert len({(p.gemm1.bn, p.gemm2.bn, p.gemm1.consumer) for p in ranked}) == len(ranked)
    assert max(MAINLOOP_EFF) == 256


def test_overrides():
    spec = load_spec("kimi-k2")
    plan = solve(spec, gemm1_bn=128, gemm2_bn=192, gemm1_stages=3, raster_group=4)
    assert (plan.gemm1.bn, plan.gemm2.bn, plan.gemm1.stages, plan.gemm2.stages) == (128, 192, 3, 5)
    assert plan.gemm1.raster_group == plan.gemm2.raster_group == 4
    assert plan.gemm1.n_tiles == 32 and plan.gemm2.n_tiles == 38
    assert any("overrides: gemm1_bn=128" in n for n in plan.notes)
    assert any("partial N tile" in n for n in plan.notes)
    assert plan.predicted_ms > solve(spec).predicted_ms
    assert Plan.from_dict(plan.to_dict()) == plan
    assert "chosen by overrides" in explain(plan)


@pytest.mark.parametrize("overrides,path,fragment", [
    ({"gemm1_bn": 256}, "plan.gemm1_bn", "ffn 2880 % 128 = 64"),
    ({"gemm1_bn": 96}, "plan.gemm1_bn", "one of 64, 128, 192, 256"),
    ({"gemm2_bn": 128.0}, "plan.gemm2_bn", "one of 64, 128, 192, 256"),
    ({"gemm2_bn": True}, "plan.gemm2_bn", "one of 64, 128, 192, 256"),
    ({"gemm1_stages": 6}, "plan.gemm1_stages", "[3, 5] for bn 192"),
    ({"gemm2_stages": 2}, "plan.gemm2_stages", "[3, 5]"),
    ({"gemm2_stages": "4"}, "plan.gemm2_stages", "must be an integer"),
    ({"raster_group": 0}, "plan.raster_group", "[1, 64]"),
    ({"bn": 128}, "plan.bn", "unknown override"),
])
def test_bad_overrides(overrides, path, fragment):
    with pytest.raises(PlanError) as info:
        solve(load_spec("gpt-oss-120b"), **overrides)
    message = str(info.value)
    assert message.startswith(path + ":") and fragment in message and "\n" not in message


def test_bad_plan_dict():
    d = solve(load_spec("glm-5")).to_dict()
    del d["chunk_rows"]
    with pytest.raises(PlanError, match=r"^plan: expected the keys"):
        Plan.from_dict(d)


@pytest.mark.parametrize("name,arch", [("kimi-k2", "sm_90a"), ("gpt-oss-120b", "sm_90a"), ("qwen3-30b-a3b", "sm_100a")])
def test_explain(name, arch):
    plan = solve(load_spec(name), arch)
    text = explain(plan)
    acc = "tensor memory" if arch == "sm_100a" else "registers"   # where each arch's accumulators live
    for word in ("waves", "smem", "chunk", "stages", "cap_rows", "raster", acc, "top candidates"):
        assert word in text
    if arch == "sm_100a":   # the tcgen05 kernels' form, not the sm_90a warpgroup rules
        for hopper in ("consumer warpgroups", "cp.async", "registers: accumulator", "(cooperative)", "z direct"):
            assert hopper not in text, hopper
        assert "tcgen05.mma cta_group::1" in text and "Cluster Launch Control" in text
    assert "chunk_rows = 128 * ceil(" in text and str(plan.chunk_rows) in text
    assert f"bn1={plan.gemm1.bn}/bn2={plan.gemm2.bn}" in text


def test_explain_gpt_oss_tie_break():
    text = explain(solve(load_spec("gpt-oss-120b")))
    assert "memory bound" in text and "wins on compute time" in text


def test_schedule_override():
    spec = load_spec("kimi-k2")
    assert solve(spec).schedule == "chain"
    p = solve(spec, schedule="fused")
    assert p.schedule == "fused" and p.gemm1.bn == p.gemm2.bn and spec.hidden % p.gemm2.bn == 0
    # the fused kernel rasters inside its overlap chunks: the chain's tall panels (kimi-k2: 32 / 16) do not apply
    assert (solve(spec).gemm1.raster_group, p.gemm1.raster_group, p.gemm2.raster_group) == (32, 8, 8)
    assert Plan.from_dict(json.loads(p.canonical_json())) == p
    with pytest.raises(PlanError, match="plan.schedule: must be one of"):
        solve(spec, schedule="megakernel")
    with pytest.raises(PlanError, match="'fused' needs"):
        dataclasses.replace(solve(spec, gemm1_bn=128, gemm2_bn=256), schedule="fused")


def test_consumer_override():
    spec = load_spec("kimi-k2")
    base = solve(spec)
    assert base.gemm1.consumer == base.gemm2.consumer == "cooperative" and base.gemm1.tile_m == 128
    p = solve(spec, consumer="pingpong")
    for g, b in ((p.gemm1, base.gemm1), (p.gemm2, base.gemm2)):
        assert g.consumer == "pingpong" and g.tile_m == 64 and g.bn == b.bn
        assert g.stages >= b.stages  # 64-row stages are smaller: at least as many fit
    assert p.bm == p.gemm1.bm == p.gemm2.bm == 64  # both ping-pong: groups padded to 64 rows
    assert p.cap_rows == cap_rows(spec, 64, spec.tokens) and p.max_m_tiles == p.cap_rows // 64
    assert Plan.from_dict(json.loads(p.canonical_json())) == p
    assert "consumers pingpong (64-row tiles)" in explain(p)
    one = solve(spec, gemm2_consumer="pingpong", gemm2_stages=3)
    assert (one.gemm1.consumer, one.gemm2.consumer, one.gemm2.stages) == ("cooperative", "pingpong", 3)
    assert one.bm == 128  # GEMM 1's cooperative tiles keep the 128-row routing tile
    # many small experts: 64-row padding wastes fewer rows, and the cost model sees it
    oss = load_spec("gpt-oss-120b")
    assert solve(oss, consumer="pingpong").predicted_ms < solve(oss).predicted_ms
    with pytest.raises(PlanError, match=r"^plan.consumer: must be one of cooperative, pingpong"):
        solve(spec, consumer="stream-k")
    with pytest.raises(PlanError, match=r"^plan.gemm1_consumer: the fused schedule"):
        solve(spec, schedule="fused", gemm1_consumer="pingpong")
    with pytest.raises(PlanError, match=r"^plan.consumer: the fused schedule"):
        dataclasses.replace(p, schedule="fused")


def test_parse_overrides():
    from mokgen.plan import parse_overrides

    assert parse_overrides("consumer=pingpong+cluster=2") == {"consumer": "pingpong", "cluster": 2}
    assert parse_overrides(" schedule=fused , gemm2_stages=3 ") == {"schedule": "fused", "gemm2_stages": 3}
    assert parse_overrides("") == {}
    with pytest.raises(PlanError, match=r"^plan: expected KEY=VALUE, got 'cluster'"):
        parse_overrides("cluster")


def test_l2_hint_and_raster_overrides():
    spec = load_spec("kimi-k2")
    base = solve(spec)
    assert base.gemm1.w_hint == base.gemm2.a_hint == "normal"
    p = solve(spec, w_hint="first", gemm2_a_hint="last", gemm1_raster_group=32)
    assert (p.gemm1.w_hint, p.gemm2.w_hint, p.gemm1.a_hint, p.gemm2.a_hint) == ("first", "first", "normal", "last")
    assert (p.gemm1.raster_group, p.gemm2.raster_group) == (32, base.gemm2.raster_group)
    assert Plan.from_dict(json.loads(p.canonical_json())) == p
    # "a_hint" names both GEMMs but applies only where TMA loads A (GEMM 2; GEMM 1 with a_load "tma")
    both = solve(spec, a_hint="first")
    assert (both.gemm1.a_hint, both.gemm2.a_hint) == ("normal", "first")
    assert solve(spec, gemm1_a_load="tma", a_hint="first").gemm1.a_hint == "first"
    with pytest.raises(PlanError, match=r"^plan.gemm1_a_hint: GEMM 1 reads A by 'gather'"):
        solve(spec, gemm1_a_hint="first")
    with pytest.raises(PlanError, match=r"^plan.w_hint: must be one of normal, first, last"):
        solve(spec, w_hint="persist")
    with pytest.raises(PlanError, match=r"^plan.w_hint: the fused schedule"):
        solve(spec, schedule="fused", w_hint="first")
    with pytest.raises(PlanError, match=r"^plan.gemm2_raster_group: must be in \[1, 64\]"):
        solve(spec, gemm2_raster_group=65)
    # a plan written before the hint fields existed still loads (they default to "normal")
    d = base.to_dict()
    for g in ("gemm1", "gemm2"):
        del d[g]["w_hint"], d[g]["a_hint"]
    assert Plan.from_dict(d) == base


def test_wgrad_output_path_by_group_rows():
    """The BF16 weight gradients of BF16 specs buffer their whole tile's output in shared memory (WGRAD_TILE_EPI,
    epi_store "smem", as many stages as then fit) where the routed groups average more than
    WGRAD_TILE_EPI_MAX_ROWS and at most WGRAD_SMEM_EPI_MAX_ROWS rows, and store through the stage ring otherwise;
    FP8 specs and explicit overrides are not touched by the rule. In the same class the tile N is
    WGRAD_SMALL_GROUPS_BN (128) instead of the widest that divides."""
    import mokgen.plan as P

    seen = set()
    for preset in list_presets():
        spec = load_spec(preset.name)
        plan = P.solve(spec, "sm_90a")
        rows = spec.routed_rows / spec.local_experts
        widest = {n: next(b for b in P.BWD_BN_CHOICES if P.backward_shape(spec, n)[1] % b == 0
                          and P._gemm_problem(spec, P.get_arch("sm_90a"), 2, b) is None)
                  for n in ("wgrad1", "wgrad2")}
        for name, g in (("wgrad1", plan.backward.wgrad1), ("wgrad2", plan.backward.wgrad2)):
            if spec.dtype == "bf16" and P.WGRAD_TILE_EPI_MAX_ROWS < rows <= P.WGRAD_SMEM_EPI_MAX_ROWS:
                assert (g.epi_store, g.epi_n, g.epi_stages) == ("smem", 64, 4), preset.name
                assert g.stages == P._stages_most(P.get_arch("sm_90a"), g), preset.name
                assert g.bn == P.WGRAD_SMALL_GROUPS_BN, preset.name
                seen.add("smem")
            else:
                assert g.epi_store == "ring", preset.name
                if spec.dtype == "bf16":
                    assert g.bn == widest[name], preset.name
                seen.add("ring")
    assert seen == {"smem", "ring"}   # both sides of the rule are exercised by the presets
    q30 = load_spec("qwen3-30b-a3b")
    # the tile rule's default is exactly the plan measured as the override (bench/NOTES.md v34, v35), and the
    # widest tile asked for gives back the plan before the rule (256 columns, 3 stages beside the buffers)
    default = P.solve(q30, "sm_90a").backward
    assert default == P.solve(q30, "sm_90a", wgrad1_bn=128, wgrad2_bn=128).backward
    wide = P.solve(q30, "sm_90a", wgrad1_bn=256, wgrad2_bn=256).backward
    assert (wide.wgrad1.bn, wide.wgrad1.stages, wide.wgrad1.epi_store) == (256, 3, "smem")
    assert (default.wgrad1.bn, default.wgrad1.stages) == (128, 5)
    ring = P.solve(q30, "sm_90a", wgrad1_epi_store="ring").backward
    assert (ring.wgrad1.epi_store, ring.wgrad2.epi_store) == ("ring", "smem")
    # the ring asked for on a rule shape is the ring of the shapes whose default it is (its own staging and
    # stages, bench/NOTES.md v21), not the ring squeezed beside the whole-tile buffers; a ring epilogue has no
    # epilogue buffers (v40), so its stages are the most that fit the stage ring alone: 7 of 128 x 128
    old = P.solve(q30, "sm_90a", wgrad1_epi_store="ring", wgrad1_epi_n=32,
                  wgrad1_epi_stages=2, wgrad1_stages=7).backward.wgrad1
    assert ring.wgrad1 == old and (old.bn, old.epi_n, old.epi_stages, old.stages) == (128, 32, 2, 7)
    old = P.solve(q30, "sm_90a", wgrad1_bn=256, wgrad1_epi_store="ring").backward.wgrad1
    assert (old.bn, old.epi_n, old.epi_stages, old.stages) == (256, 32, 2, 4)   # the ring before both rules
    assert P.solve(q30, "sm_90a", epi_store="ring").backward.wgrad2.stages == 7
    # a stage count is checked against the output path the GEMM ends on: 7 fit the ring, not the buffers (one line)
    assert P.solve(q30, "sm_90a", wgrad1_epi_store="ring", wgrad1_stages=7).backward.wgrad1.stages == 7
    with pytest.raises(P.PlanError, match=r"^plan\.wgrad1_stages: 7 stages of wgrad1's 128 x 128 tile and its "
                                          r"epilogue buffers \(4 x 64 columns\) do not fit .* \(at most 5\)$"):
        P.solve(q30, "sm_90a", wgrad1_stages=7)
    # fitted to the ring, stored through the buffers after all (a cluster pair: no ring): the stages that fit them
    k2 = P.solve(load_spec("kimi-k2"), "sm_90a", dgrad2_cluster=2).backward.dgrad2
    assert k2.epi_store == "smem" and k2.smem_bytes() <= P.get_arch("sm_90a").smem_per_cta
    mine = P.solve(q30, "sm_90a", wgrad1_epi_store="ring", wgrad1_stages=3,
                   wgrad1_epi_n=64).backward.wgrad1   # the ones named keep their values
    assert (mine.epi_store, mine.stages, mine.epi_n, mine.epi_stages) == ("ring", 3, 64, 2)
    kept = P.solve(q30, "sm_90a", wgrad1_epi_n=32, wgrad2_epi_stages=2).backward
    assert (kept.wgrad1.epi_store, kept.wgrad1.epi_n, kept.wgrad2.epi_stages) == ("smem", 32, 2)   # overrides kept


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "kimi-k2"])
def test_dgrad_cluster_override(name):
    """``dgrad1_cluster=2`` / ``dgrad2_cluster=2`` (opt-in): the dgrad's pair of M tiles takes one W tile by TMA
    multicast; z and the output leave the stage ring (the template's cluster form asserts both), the other GEMMs
    are untouched; a bad value, dgrad1's z by TMA beside it and an FP8 spec are one-line errors."""
    from mokgen import configs
    from mokgen.emit import emit

    spec = load_spec(name)
    base = solve(spec, "sm_90a")
    for key in ("dgrad1", "dgrad2"):
        p = solve(spec, "sm_90a", **{f"{key}_cluster": 2})
        g, other = getattr(p.backward, key), ("dgrad2" if key == "dgrad1" else "dgrad1")
        assert (g.cluster, g.z_load, g.epi_store) == (2, "direct", "smem")
        assert getattr(p.backward, other) == getattr(base.backward, other)
        assert (p.gemm1, p.gemm2) == (base.gemm1, base.gemm2) and not configs.check_plan(p)
        assert "CLUSTER = 2 " in emit(p).files[f"{key}.py"]
        assert "CLUSTER = 1 " in emit(p).files[f"{other}.py"]
    with pytest.raises(PlanError, match=r"^plan\.dgrad1_cluster: must be one of 1, 2, got 4$"):
        solve(spec, "sm_90a", dgrad1_cluster=4)
    with pytest.raises(PlanError, match=r"^plan\.dgrad1_z_load: tma needs cooperative 128-row tiles without clusters"):
        solve(spec, "sm_90a", dgrad1_cluster=2, dgrad1_z_load="tma")
    with pytest.raises(PlanError, match=r"^plan\.dgrad2_cluster: the FP8 dgrads run cluster 1"):
        solve(load_spec("kimi-k2-fp8"), "sm_90a", dgrad2_cluster=2)


def test_scale_load_override():
    """``scale_load=stage`` (FP8, opt-in): the four FP8 grouped GEMMs stage each K block's scales in shared memory
    (stage_scale_bytes: the tile's rows + a 16-byte W-scale slot, fp32), the stages re-counted against it; per-GEMM
    keys touch their GEMM only; the plan passes check_plan and the emitted GEMMs carry the scale warp; BF16 specs,
    bad values and an inference plan's dgrad key are one-line errors."""
    from mokgen import configs
    from mokgen.emit import emit
    from mokgen.plan import stage_scale_bytes

    spec = load_spec("kimi-k2-fp8")
    base = solve(spec, "sm_90a")
    gemms = lambda p: {"gemm1": p.gemm1, "gemm2": p.gemm2, "dgrad1": p.backward.dgrad1, "dgrad2": p.backward.dgrad2}
    assert all(g.stage_scale_bytes == 0 for g in gemms(base).values())
    p = solve(spec, "sm_90a", scale_load="stage")
    assert not configs.check_plan(p)
    src = emit(p)
    for name, g in gemms(p).items():
        assert g.stage_scale_bytes == stage_scale_bytes(g) == (g.tile_m + 4) * 4, name
        assert g.smem_bytes() <= 232448 and g.stages <= gemms(base)[name].stages
        text = src.files[f"{name}_train.py" if name == "gemm1" else f"{name}.py"]
        assert "STAGE_SCALES = True" in text and "cp_async_mbarrier_arrive_noinc(sfull + sslot)" in text, name
    assert "STAGE_SCALES = False" in emit(base).files["gemm2.py"]
    one = solve(spec, "sm_90a", dgrad1_scale_load="stage")
    assert {n for n, g in gemms(one).items() if g.stage_scale_bytes} == {"dgrad1"}
    wide = solve(spec, "sm_90a", scale_load="stage", gemm2_bn=256)
    assert wide.gemm2.mma_split == 2 and wide.gemm2.stage_scale_bytes and not configs.check_plan(wide)
    assert solve(spec, "sm_90a", scale_load="global") == base
    bad = dataclasses.replace(p, gemm2=dataclasses.replace(p.gemm2, stage_scale_bytes=512))
    assert configs.check_plan(bad) == ["gemm2.stage_scale_bytes 512: staged scales (scale_load stage) are an FP8 "
                                       "GEMM's with TMA-loaded A, 528 bytes a stage"]
    bf16 = solve(load_spec("kimi-k2"), "sm_90a")
    assert any("stage_scale_bytes" in m for m in configs.check_plan(
        dataclasses.replace(bf16, gemm2=dataclasses.replace(bf16.gemm2, stage_scale_bytes=528))))
    with pytest.raises(PlanError, match=r"^plan\.scale_load: must be one of global, stage, got 'smem'$"):
        solve(spec, "sm_90a", scale_load="smem")
    with pytest.raises(PlanError, match=r"^plan\.gemm2_scale_load: where the FP8 scales are read from applies to "
                                        r"FP8 specs \(dtype fp8\), this one is bf16$"):
        solve(load_spec("kimi-k2"), "sm_90a", gemm2_scale_load="stage")
