"""The config space (mokgen.space): the legal values of every plan knob and override key, its constraints, and
the enumeration the solver and tune share."""

from __future__ import annotations

import dataclasses

import pytest

from mokgen import plan as P
from mokgen import space as S
from mokgen.spec import list_presets, load_spec

PRESETS = [s.name for s in list_presets()]


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
    assert S.check_config(spec, "sm_90a", {key: bad})


@pytest.mark.parametrize("name", PRESETS)
def test_every_enumerated_candidate_satisfies_the_constraints(name):
    spec = load_spec(name)
    cfgs = list(S.enumerate_configs(spec, "sm_90a"))
    assert len(cfgs) >= 50
    assert len({tuple(sorted(c.items())) for c in cfgs}) == len(cfgs)
    a = P.get_arch("sm_90a")
    fused_bns = [bn for bn in P.BN_CHOICES if spec.hidden % bn == 0
                 and P._gemm_problem(spec, a, 1, bn) is None and P._gemm_problem(spec, a, 2, bn) is None]
    assert sorted(c["gemm1_bn"] for c in cfgs if c["schedule"] == "fused") == fused_bns
    for cfg in cfgs:
        assert S.check_config(spec, "sm_90a", cfg) == []
        p = P.solve(spec, "sm_90a", **cfg)
        assert S.check_plan(p) == [], (cfg, S.check_plan(p))
        for key, value in cfg.items():  # the override took effect
            if key == "cluster":
                assert p.gemm1.cluster == p.gemm2.cluster == value
            elif key != "schedule":
                kernel, _, field = key.partition("_")
                assert getattr(getattr(p, kernel), field) == value, (key, value)
            else:
                assert p.schedule == value
    # the default plans satisfy them too
    assert S.check_plan(P.solve(spec, "sm_90a")) == []


def test_check_plan_catches_what_breaks_the_constraints():
    spec = load_spec("kimi-k2")
    p = P.solve(spec, "sm_90a")
    too_deep = dataclasses.replace(p.gemm1, stages=7, bn=256)
    bad = dataclasses.replace(p, gemm1=too_deep)
    assert any("shared memory" in m for m in S.check_plan(bad))
    odd = dataclasses.replace(p, gemm1=dataclasses.replace(p.gemm1, a_load="scatter"))
    assert any("a_load" in m for m in S.check_plan(odd))
    hint = dataclasses.replace(p, gemm1=dataclasses.replace(p.gemm1, a_load="gather", a_hint="first"))
    assert any("a_hint" in m for m in S.check_plan(hint))
    g = load_spec("gpt-oss-120b")  # ffn 2880: bn 256 (128 gate columns) does not divide it
    assert any("ffn" in m for m in S.check_config(g, "sm_90a", {"gemm1_bn": 256}))
    assert S.check_config(spec, "sm_90a", {"schedule": "fused", "gemm1_consumer": "pingpong"})
    assert S.check_config(spec, "sm_90a", {"schedule": "fused", "gemm1_bn": 256, "gemm2_bn": 128})
