"""sm_100a's config space (mokgen/sm100/space.py, issue 20): only the knobs its tcgen05 kernels take, every key of
sm_90a's kernels refused by the plan in one line naming sm_100a (never accepted and ignored), and every candidate
``mokgen tune`` enumerates for sm_100a (forward and backward, BF16 presets and an MXFP8 spec) legal, passing
``check_plan`` and rendered by emit. CPU only: nothing is compiled."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from mokgen import configs as C
from mokgen import plan as P
from mokgen import space as S
from mokgen.emit import EmitError, emit
from mokgen.sm100 import space as sm100_space
from mokgen.spec import list_presets, load_spec

ARCH = "sm_100a"
ROOT = Path(__file__).resolve().parent.parent
MXFP8 = ROOT / "tools" / "specs" / "kimi-k2-mxfp8.yaml"   # generated/sm_100a/kimi-k2-mxfp8's spec
BF16_PRESETS = [s.name for s in list_presets() if s.dtype == "bf16"]
SM90_ONLY = [k for k in S.override_keys("sm_90a") if k not in S.override_keys(ARCH)]


def _spec(name: str):
    return load_spec(MXFP8) if name == "kimi-k2-mxfp8" else load_spec(name)


def test_the_sm100a_space_is_its_packages():
    sp = S.space(ARCH)
    assert sp is sm100_space.SM100 and sp.templates == "templates/sm100" and S.space("sm_90a") is S.SM90
    assert all(k.doc for k in sp.knobs)
    for knob in sp.knobs:   # a searched value is a legal one
        assert set(knob.search or ()) <= set(knob.values), knob.key
    # what its kernels do not take is not in it (ping-pong, FP8 promotion, L2 hints, the fused schedule, ...)
    for key in ("promote", "gemm1_promote", "w_hint", "a_hint", "dgrad1_z_chunk", "dgrad1_z_load", "gemm1_z_store",
                "epi_store", "dgrad1_consumer", "dgrad1_bn", "wgrad1_stages", "wgrad1_epi_n"):
        assert key in SM90_ONLY, key
    assert S.legal_values("consumer", ARCH) == ("cooperative",) and S.legal_values("schedule", ARCH) == ("chain",)
    assert S.legal_values("gemm1_a_load", ARCH) == ("tma",)
    assert S.legal_values("wgrad1_dtype", ARCH) == ("bf16", "mxfp8") and S.legal_values("wgrad1_dtype") == ("bf16", "fp8")
    assert S.legal_values("dgrad2_cluster", ARCH) == (1, 2)
    # the axes tune searches are knobs of the table with search values (MXFP8: the form fixes the forward)
    for axis in sp.forward_axes("bf16") + sp.backward_axes:
        assert S.axis_values(ARCH, axis), axis
    assert sp.forward_axes("mxfp8") == () and S.space("sm_90a").forward_axes("fp8") == S.FP8_SEARCH_AXES


@pytest.mark.parametrize("key", SM90_ONLY)
def test_sm90a_only_keys_are_refused_naming_sm100a(key):
    """A key of sm_90a's kernels that sm_100a's do not take: a one-line PlanError naming sm_100a and the keys it
    takes, for every value sm_90a would accept (the default included: nothing is accepted and ignored); the
    config check refuses it too."""
    for name in ("kimi-k2", "kimi-k2-mxfp8"):
        spec = _spec(name)
        for value in S.legal_values(key, "sm_90a"):
            with pytest.raises(P.PlanError) as e:
                P.solve(spec, ARCH, **{key: value})
            msg = str(e.value)
            assert msg.startswith(f"plan.{key}: ") and "\n" not in msg, msg
            assert f"allowed on {ARCH}: " in msg and "gemm1_bn" in msg and f"{ARCH} " in msg, msg
        assert C.check_config(spec, ARCH, {key: value}) == [f"{key}: not a knob of {ARCH}"]


@pytest.mark.parametrize("key", S.override_keys(ARCH))
def test_every_value_outside_the_sm100a_space_is_refused(key):
    """Every value of an sm_100a key outside its table, sm_90a's values included (ping-pong, fused, the gathered
    A path, FP8 weight gradients), is a one-line PlanError naming the key, and check_config refuses it."""
    spec = load_spec("kimi-k2")
    legal = S.legal_values(key, ARCH)
    bad = [999 if isinstance(legal[0], int) else "nonsense"]
    bad += [v for v in S.legal_values(key, "sm_90a") if v not in legal]
    for value in bad:
        with pytest.raises(P.PlanError) as e:
            P.solve(spec, ARCH, **{key: value})
        assert str(e.value).startswith(f"plan.{key}: ") and "\n" not in str(e.value), str(e.value)
        assert C.check_config(spec, ARCH, {key: value}) == [f"{key}: {value!r} not in the {ARCH} space"]
    # the messages name the legal values (same style as sm_90a's)
    if key in ("gemm1_bn", "epi_n"):
        assert f"must be one of {', '.join(map(str, legal))} on {ARCH}, got 999" in str(e.value)
    if key in ("gemm2_stages", "raster_group"):
        assert f"must be in [{legal[0]}, {legal[-1]}] on {ARCH}, got 999" in str(e.value)


def _candidates():
    for name in BF16_PRESETS + ["kimi-k2-mxfp8"]:
        yield name


@pytest.mark.parametrize("name", list(_candidates()))
def test_every_sm100a_candidate_is_legal_and_renders(name):
    """Every forward candidate tune enumerates for sm_100a and every backward variant of tune --train: legal
    (check_config), solved with the override in effect, passing check_plan, and rendered by emit as tune compiles
    it (a forward candidate: its forward kernels, routing, gather, the tcgen05 GEMMs, combine; a backward variant:
    every kernel of the training entry, the dgrads and weight gradients too)."""
    spec = _spec(name)
    mx = spec.dtype == "mxfp8"
    cfgs = list(C.enumerate_configs(spec, ARCH))
    assert len({tuple(sorted(c.items())) for c in cfgs}) == len(cfgs)
    if mx:   # the MXFP8 form fixes the forward: one candidate, the plan itself
        assert cfgs == [{}]
    else:
        assert len(cfgs) >= 12 and {c["cluster"] for c in cfgs} == {1, 2}
        assert {k for c in cfgs for k in c} == set(S.space(ARCH).search_axes)
        assert {c["gemm1_bn"] for c in cfgs} <= {bn for bn in S.legal_values("gemm1_bn", ARCH)
                                                  if spec.ffn % (bn // 2) == 0}
    base = P.solve(spec, ARCH)
    variants = list(C.enumerate_backward_configs(spec, ARCH))
    assert {"bwd_streams": 2} in variants
    assert ({"wgrad1_dtype": "mxfp8"} in variants) == mx and all(len(v) == 1 for v in variants)
    for cfg in cfgs + variants:
        assert C.check_config(spec, ARCH, cfg) == []
        p = P.solve(spec, ARCH, **cfg)
        assert C.check_plan(p) == [], (cfg, C.check_plan(p))
        for key, value in cfg.items():   # the override took effect
            if key == "cluster":
                assert p.gemm1.cluster == p.gemm2.cluster == value and (p.bm == 256) == (value == 2)
            elif key == "bwd_streams":
                assert p.backward.streams == value
            elif key.endswith("_dtype"):
                assert getattr(p.backward, key.removesuffix("_dtype")).elem_bytes == (1 if value == "mxfp8" else 2)
            else:
                kernel, _, field = key.partition("_")
                assert getattr(getattr(p, kernel), field) == value, (key, value)
        if cfg in variants:   # a backward variant leaves the forward as it was
            assert (p.gemm1, p.gemm2, p.bm) == (base.gemm1, base.gemm2, base.bm)
        files = emit(p if cfg in variants else dataclasses.replace(p, backward=None)).files
        assert ("dgrad1.py" in files and "wgrad2.py" in files) == (cfg in variants)
        assert files["gemm1.py"].startswith("# Generated by mokgen from templates/sm100/grouped_gemm.py.j2")


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "kimi-k2-mxfp8"])
def test_tune_selects_sm100a_candidates(name):
    """tune's selection on sm_100a: the enumerated candidates and the solver's defaults (config_of: an MXFP8 plan's
    forward without the tile keys its form fixes) all solve to forward plans of sm_100a that pass check_plan."""
    from mokgen import costmodel as CM
    from mokgen import tune as T

    spec = _spec(name)
    cands, n_space = T.select_candidates(spec, ARCH, [256, spec.tokens], CM.PRIORS, top=2)
    assert n_space == len(list(C.enumerate_configs(spec, ARCH))) and any(c.defaults for c in cands)
    for c in cands:
        assert C.check_config(spec, ARCH, c.cfg) == [], c.cfg
        full = P.solve(spec, ARCH, **c.cfg)
        assert c.plan == dataclasses.replace(full, backward=None) and C.check_plan(full) == []
    default = P.solve(spec, ARCH)
    again = P.solve(spec, ARCH, **T.config_of(default))
    assert (again.gemm1, again.gemm2, again.bm) == (default.gemm1, default.gemm2, default.bm)


def test_check_plan_catches_what_the_sm100a_kernels_do_not_run():
    """A plan forged with an sm_90a-only choice, or a 2-CTA GEMM on 128-row routing tiles, or an MXFP8 weight
    gradient of a BF16 spec: check_plan names the field (the sm_100a check, not sm_90a's); emit refuses the forward
    GEMMs' sm_90a-only choices too (it rendered them as if absent)."""
    spec = load_spec("kimi-k2")
    p = P.solve(spec, ARCH, bwd_streams=2)
    assert C.check_plan(p) == []
    g1, bw = p.gemm1, p.backward

    def bad(**fields):
        return C.check_plan(dataclasses.replace(p, **fields))

    assert any(m.startswith("gemm1.consumer 'pingpong' not in the sm_100a space")
               for m in bad(gemm1=dataclasses.replace(g1, consumer="pingpong")))
    assert any(m.startswith("schedule 'fused'") for m in bad(schedule="fused", gemm1=dataclasses.replace(
        g1, a_load="gather")))
    assert any(m.startswith("gemm1.a_load 'gather'") for m in bad(gemm1=dataclasses.replace(g1, a_load="gather")))
    for field, value in (("w_hint", "first"), ("a_hint", "last"), ("promote", "overlap"), ("epi_store", "ring")):
        assert any(m.startswith(f"gemm1.{field} {value!r}: an sm_90a kernel option")
                   for m in bad(gemm1=dataclasses.replace(g1, **{field: value}))), field
    for name, field, value in (("gemm1", "w_hint", "first"), ("gemm2", "consumer", "pingpong"),
                               ("gemm2", "promote", "stagger"), ("gemm1", "epi_store", "ring")):
        forged = dataclasses.replace(p, **{name: dataclasses.replace(getattr(p, name), **{field: value})})
        with pytest.raises(EmitError, match=rf"^plan\.{name}: the sm_100a GEMMs take one CTA per 128-row tile"):
            emit(forged)
    assert any("2-CTA form needs 256-row routing tiles" in m
               for m in bad(gemm2=dataclasses.replace(p.gemm2, cluster=2)))
    assert any(m.startswith("backward.dgrad1.z_load 'tma'") for m in bad(
        backward=dataclasses.replace(bw, dgrad1=dataclasses.replace(bw.dgrad1, z_load="tma"))))
    assert any("dtype mxfp8 specs" in m for m in bad(
        backward=dataclasses.replace(bw, wgrad1=dataclasses.replace(bw.wgrad1, elem_bytes=1, bk=128))))
    assert any(m.startswith("gemm1.bn 192: ffn 2048") for m in bad(gemm1=dataclasses.replace(g1, bn=192)))
    assert any(m.startswith("gemm1.stages: ") for m in bad(gemm1=dataclasses.replace(g1, stages=7)))   # smem
