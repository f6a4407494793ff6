"""The config space (mokgen.space): the legal values of every plan knob and override key, its constraints, and
the enumeration the solver and tune share."""

from __future__ import annotations

import dataclasses

import pytest

from mokgen import plan as P
from mokgen import configs as C
from mokgen import space as S
from mokgen.spec import list_presets, load_spec

PRESETS = [s.name for s in list_presets() if s.dtype == "bf16"]  # the FP8 presets: tests/test_plan_fp8.py


def test_plan_takes_its_values_and_keys_from_the_space():
    sp = S.space("sm_90a")
    assert P.BN_CHOICES == sp.values("bn", "gemm1")
    assert P.CONSUMERS == sp.values("consumer", "gemm2")
    assert P.A_LOADS == sp.values("a_load", "gemm1")
    assert P.SCHEDULES == sp.values("schedule")
    assert P.CLUSTERS == sp.values("cluster", "gemm1")
    assert tuple(P.L2_HINTS) == sp.values("w_hint", "gemm1") == sp.values("a_hint", "gemm2")
    assert (P.MIN_STAGES, P.MAX_STAGES) == (sp.min_stages, sp.max_stages)
    assert P.RASTER_OVERRIDE_MAX == max(sp.values("raster_group", "gemm1"))
    assert P.OVERRIDES == S.override_keys("sm_90a")
    assert len(set(P.OVERRIDES)) == len(P.OVERRIDES)
    assert {"gemm1_bn", "consumer", "gemm2_consumer", "gemm1_a_load", "schedule", "dgrad1_consumer"} <= set(P.OVERRIDES)
    assert "bn" not in P.OVERRIDES and "a_load" not in P.OVERRIDES  # no shared key for those


@pytest.mark.parametrize("key", S.override_keys("sm_90a"))
def test_every_override_value_outside_the_space_is_refused(key):
    spec = load_spec("kimi-k2")
    bad = 999 if isinstance(S.legal_values(key)[0], int) else "nonsense"
    with pytest.raises(P.PlanError, match=key):
        P.solve(spec, "sm_90a", **{key: bad})
    assert C.check_config(spec, "sm_90a", {key: bad})


@pytest.mark.parametrize("name", PRESETS)
def test_every_enumerated_candidate_satisfies_the_constraints(name):
    spec = load_spec(name)
    cfgs = list(C.enumerate_configs(spec, "sm_90a"))
    assert len(cfgs) >= 50
    assert len({tuple(sorted(c.items())) for c in cfgs}) == len(cfgs)
    a = P.get_arch("sm_90a")
    fused_bns = [bn for bn in P.BN_CHOICES if spec.hidden % bn == 0
                 and P._gemm_problem(spec, a, 1, bn) is None and P._gemm_problem(spec, a, 2, bn) is None]
    assert sorted(c["gemm1_bn"] for c in cfgs if c["schedule"] == "fused") == fused_bns
    for cfg in cfgs:
        assert C.check_config(spec, "sm_90a", cfg) == []
        p = P.solve(spec, "sm_90a", **cfg)
        assert C.check_plan(p) == [], (cfg, C.check_plan(p))
        for key, value in cfg.items():  # the override took effect
            if key == "cluster":
                assert p.gemm1.cluster == p.gemm2.cluster == value
            elif key != "schedule":
                kernel, _, field = key.partition("_")
                assert getattr(getattr(p, kernel), field) == value, (key, value)
            else:
                assert p.schedule == value
    # the default plans satisfy them too
    assert C.check_plan(P.solve(spec, "sm_90a")) == []


def test_check_plan_catches_what_breaks_the_constraints():
    spec = load_spec("kimi-k2")
    p = P.solve(spec, "sm_90a")
    too_deep = dataclasses.replace(p.gemm1, stages=7, bn=256)
    bad = dataclasses.replace(p, gemm1=too_deep)
    assert any("shared memory" in m for m in C.check_plan(bad))
    odd = dataclasses.replace(p, gemm1=dataclasses.replace(p.gemm1, a_load="scatter"))
    assert any("a_load" in m for m in C.check_plan(odd))
    hint = dataclasses.replace(p, gemm1=dataclasses.replace(p.gemm1, a_load="gather", a_hint="first"))
    assert any("a_hint" in m for m in C.check_plan(hint))
    g = load_spec("gpt-oss-120b")  # ffn 2880: bn 256 (128 gate columns) does not divide it
    assert any("ffn" in m for m in C.check_config(g, "sm_90a", {"gemm1_bn": 256}))
    assert C.check_config(spec, "sm_90a", {"schedule": "fused", "gemm1_consumer": "pingpong"})
    assert C.check_config(spec, "sm_90a", {"schedule": "fused", "gemm1_bn": 256, "gemm2_bn": 128})


# ---- the backward GEMMs' knobs (mokgen tune --train) ------------------------------------------------------------
@pytest.mark.parametrize("name", PRESETS)
def test_every_backward_variant_satisfies_the_constraints(name):
    spec = load_spec(name)
    base = P.solve(spec, "sm_90a")
    cfgs = list(C.enumerate_backward_configs(spec, "sm_90a"))
    assert len(cfgs) >= 10 and all(len(c) == 1 and set(c) <= set(S.BACKWARD_SEARCH_AXES) for c in cfgs)
    a = P.get_arch("sm_90a")
    plans = set()
    for cfg in cfgs:
        assert C.check_config(spec, "sm_90a", cfg) == []
        p = P.solve(spec, "sm_90a", **cfg)
        assert C.check_plan(p) == [], (cfg, C.check_plan(p))
        assert (p.gemm1, p.gemm2, p.bm) == (base.gemm1, base.gemm2, base.bm)  # the forward is untouched
        (key, value), = cfg.items()
        kernel, _, field = key.partition("_")
        if kernel == "bwd":   # the whole backward's knob: the GEMMs' tiles are the default's
            assert getattr(p.backward, field) == value
            assert all(getattr(p.backward, n) == getattr(base.backward, n) for n in P.BACKWARD_GEMMS)
            plans.add(p.backward)
            continue
        g = getattr(p.backward, kernel)
        assert getattr(g, field) == value
        assert g.smem_bytes() <= a.smem_per_cta and P.MIN_STAGES <= g.stages
        d1 = p.backward.dgrad1
        assert spec.ffn % d1.bn == 0 and (d1.bn // 4) % d1.z_chunk == 0
        if key == "dgrad1_bn":  # a new tile N resets the z chunk to the rule's
            assert d1.z_chunk == min(P.Z_CHUNK, value // 4)
        if key.endswith("_bn"):  # and takes as many stages as fit
            assert g.stages == P._stages_most(a, g) and dataclasses.replace(g, stages=g.stages + 1).smem_bytes() > \
                a.smem_per_cta or g.stages == P.MAX_STAGES
        plans.add(p.backward)
    assert len(plans) == len(cfgs) and base.backward not in plans
    # every variant emits (the templates render it; emit derives nothing of its own: the plan's fields appear)
    if name == "gpt-oss-120b":
        from mokgen import emit

        for cfg in cfgs:
            src = emit.emit(P.solve(spec, "sm_90a", **cfg)).files
            (key, value), = cfg.items()
            kernel, _, field = key.partition("_")
            if kernel == "bwd":   # a launch choice: every kernel renders as the default's (but the plan header)
                def body(files):
                    return {n: [ln for ln in t.splitlines() if not ln.startswith("# plan: ")] for n, t in files.items()}
                assert body(src) == body(emit.emit(base).files)
                continue
            text = src[f"{kernel}.py"]
            want = {"bn": f"BN = {value}", "stages": f"STAGES = {value}", "raster_group": f"RASTER = {value}",
                    "z_chunk": f"Z_CHUNK = {value}", "consumer": "PINGPONG = True" if value == "pingpong" else
                    "PINGPONG = False", "epi_n": f"EPI_N = {value}", "epi_stages": f"EPI_STAGES = {value}",
                    "epi_store": f"EPI_RING = {value == 'ring'}", "ctas_per_sm": f"CTAS_PER_SM = {value}",
                    "z_load": "Z_PIPE = True" if value == "pipe" else f"Z_TMA = {value == 'tma'}"}[field]
            assert want in text, (cfg, want)


def test_backward_overrides_are_validated_with_one_line_errors():
    spec = load_spec("gpt-oss-120b")  # ffn = hidden = 2880: 256 divides neither
    a = P.get_arch("sm_90a")
    cases = {
        "dgrad1_bn": (256, "2880 % 256"),
        "dgrad1_stages": (7, "must be in [3, "),
        "wgrad1_stages": (2, "must be in [3, "),
        "wgrad2_raster_group": (0, "must be in [1, 64]"),
        "dgrad1_z_chunk": (32, "dividing the 16 z pairs"),  # with dgrad1 bn 64: 16 pairs, 32 does not divide
        "wgrad1_bn": (100, "tile N must be one of"),
        "bwd_streams": (3, "must be one of 1, 2"),
    }
    for key, (value, msg) in cases.items():
        with pytest.raises(P.PlanError) as e:
            P.solve(spec, "sm_90a", **({key: value} if key != "dgrad1_z_chunk" else {"dgrad1_bn": 64, key: value}))
        text = str(e.value)
        assert text.startswith(f"plan.{key}: ") and msg in text and "\n" not in text, text
    assert any(m.startswith("dgrad1_bn:") for m in C.check_config(spec, "sm_90a", {"dgrad1_bn": 256}))
    assert any(m.startswith("dgrad1_z_chunk:") for m in C.check_config(spec, "sm_90a", {"dgrad1_bn": 64,
                                                                                      "dgrad1_z_chunk": 32}))
    assert any(m.startswith("wgrad1_stages:") for m in C.check_config(spec, "sm_90a", {"wgrad1_bn": 256,
                                                                                     "wgrad1_stages": 5}))
    # dgrad2 and the wgrads may end on a partial N tile (2880 = 11 x 256 + 64); dgrad1 bn + z chunk together
    p = P.solve(spec, "sm_90a", dgrad2_bn=256, wgrad1_bn=256, dgrad1_bn=64, dgrad1_z_chunk=8)
    assert (p.backward.dgrad2.bn, p.backward.dgrad2.n_tiles, p.backward.wgrad1.bn) == (256, 12, 256)
    assert (p.backward.dgrad1.bn, p.backward.dgrad1.z_chunk, p.backward.dgrad1.n_tiles) == (64, 8, 45)
    assert C.check_plan(p) == []
    # check_plan catches a backward plan the templates cannot run
    deep = dataclasses.replace(p.backward, wgrad2=dataclasses.replace(p.backward.wgrad2, bn=256, stages=7))
    assert any("backward.wgrad2" in m and "shared memory" in m for m in C.check_plan(dataclasses.replace(p, backward=deep)))
    odd = dataclasses.replace(p.backward, dgrad1=dataclasses.replace(p.backward.dgrad1, bn=256, n_tiles=12))
    assert any("ffn" in m for m in C.check_plan(dataclasses.replace(p, backward=odd)))
    assert P._stages_most(a, p.backward.dgrad1) == P.MAX_STAGES
    # the shipped presets' default plans do not change with the new knobs (defaults = today's choices)
    for name in PRESETS:
        sp = load_spec(name)
        solved = P.solve(sp, "sm_90a")   # the training GEMM 1 is settled after the backward plan (_settle_z_store)
        assert dataclasses.replace(solved.backward, gemm1_train=None) == P.backward_plan(sp, a, solved.bm)
