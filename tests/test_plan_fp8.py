"""The FP8 plans (spec dtype fp8, mokgen.plan.fp8_plan): what the FP8 GEMM form fixes, what stays BF16, the
overrides that apply and those refused, candidates and round trips. CPU only."""

import dataclasses
import re
from pathlib import Path

import pytest

from mokgen import configs
from mokgen import plan as P
from mokgen.emit import emit
from mokgen.plan import MIN_STAGES, Plan, PlanError, candidates, get_arch, solve
from mokgen.spec import list_presets, load_spec

ROOT = Path(__file__).resolve().parents[1]

FP8_PRESETS = [s.name for s in list_presets() if s.dtype == "fp8"]


def test_fp8_presets_exist():
    assert sorted(FP8_PRESETS) == ["gpt-oss-120b-fp8", "kimi-k2-fp8", "qwen3-30b-a3b-fp8"]


@pytest.mark.parametrize("name", FP8_PRESETS)
def test_fp8_plan_constraints(name):
    spec, a = load_spec(name), get_arch("sm_90a")
    plan = solve(spec)
    assert plan.schedule == "chain" and plan.bm == 128 and not configs.check_plan(plan)
    fwd = (plan.gemm1, plan.gemm2)
    bwd = (plan.backward.dgrad1, plan.backward.dgrad2)
    for g in fwd + bwd:
        # dgrad1's dSwiGLU tiles divide ffn: 64 columns where 128 does not (gpt-oss-120b's 2880); GEMM 2 and dgrad2
        # take 256-column tiles in two wgmma halves (plan.FP8_WIDE_DEFAULT), GEMM 1 too (its two parts) where 128
        # divides ffn
        wide = g is plan.gemm2 or g is plan.backward.dgrad2 or (g is plan.gemm1 and spec.ffn % 128 == 0)
        bn = 64 if g is plan.backward.dgrad1 and spec.ffn % 128 else (256 if wide else 128)
        # A by TMA tiles, but GEMM 1 gathers the per-token rows itself where the routed groups are large
        # (plan.fp8_default_a_load: kimi-k2; not qwen3-30b-a3b's small groups nor gpt-oss-120b's hidden 2880)
        a_load = "gather" if g is plan.gemm1 and name == "kimi-k2-fp8" else "tma"
        assert (g.bk, g.bn, g.elem_bytes, g.consumer, g.cluster, g.a_load) == (128, bn, 1, "cooperative", 1, a_load)
        assert g.mma_split == (2 if wide else 1)
        assert g.smem_bytes() <= a.smem_per_cta and g.stages >= MIN_STAGES
        # as many 1-byte stages as fit (capped)
        assert g.stages == 7 or Plan  # noqa: the cap
        assert (g.stages + 1) * (g.tile_m + g.bn) * g.bk + (g.smem_bytes() - g.stages * (g.tile_m + g.bn) * g.bk) \
            > a.smem_per_cta or g.stages == 7
        assert g.promote == ("overlap" if g is plan.gemm1 and not wide else "serial")   # FP8_PROMOTE, wide halves
    ceil = lambda k: -(-k // 128)   # noqa: E731  (a partial last K block where 128 does not divide K)
    assert (plan.gemm1.k_tiles, plan.gemm2.k_tiles) == (ceil(spec.hidden), ceil(spec.ffn))
    assert (plan.backward.dgrad1.k_tiles, plan.backward.dgrad2.k_tiles) == (ceil(spec.hidden), ceil(2 * spec.ffn))
    for g in (plan.backward.wgrad1, plan.backward.wgrad2):   # FP8 weight gradients by default (128 x 1 scales),
        # 128 x 256 tiles whose halves are promoted in turn, the warpgroups staggered (plan.fp8_wgrad_wide)
        assert (g.elem_bytes, g.bk, g.bn, g.mma_split, g.promote) == (1, 128, 256, 2, "stagger")
    narrow = solve(spec, wgrad1_bn=128, wgrad2_bn=128, wgrad2_promote="stagger").backward   # the 128 x 128 forms
    assert (narrow.wgrad1.bn, narrow.wgrad1.mma_split, narrow.wgrad1.promote) == (128, 1, "overlap")
    assert (narrow.wgrad2.bn, narrow.wgrad2.mma_split, narrow.wgrad2.promote) == (128, 1, "stagger")
    assert solve(spec, wgrad2_promote="overlap").backward.wgrad2.bn == 128   # overlap: the 128 x 128 tile's own
    kept = solve(spec, wgrad1_dtype="bf16", wgrad2_dtype="bf16").backward   # the BF16 ones on request
    assert all(g.elem_bytes == 2 and g.bk == 64 for g in (kept.wgrad1, kept.wgrad2))
    assert any("fp8" in n for n in plan.notes)


@pytest.mark.parametrize("name", FP8_PRESETS)
def test_fp8_candidates_and_round_trip(name):
    spec = load_spec(name)
    plan = solve(spec)
    cands = candidates(spec)
    assert cands[0].canonical_json() == plan.canonical_json()
    assert len({c.canonical_json() for c in cands}) == len(cands)
    assert all(c.gemm1.elem_bytes == c.gemm2.elem_bytes == 1 for c in cands)
    assert Plan.from_dict(plan.to_dict()) == plan
    assert solve(load_spec(name)).canonical_json() == plan.canonical_json()


def test_fp8_overrides():
    spec = load_spec("kimi-k2-fp8")
    p = solve(spec)   # default: GEMM 1's, GEMM 2's and dgrad2's 256-column tiles promote their halves in turn,
    # dgrad1 runs it serially; a promotion other than serial asks for the 128-column tile
    assert (p.gemm1.promote, p.gemm2.promote, p.backward.dgrad1.promote, p.backward.dgrad2.promote) == (
        "serial", "serial", "serial", "serial")
    assert (p.gemm1.bn, p.gemm2.bn, p.backward.dgrad2.bn) == (256, 256, 256)
    q = solve(spec, gemm2_promote="overlap")
    assert (q.gemm1.bn, q.gemm2.bn, q.gemm2.promote, q.backward.dgrad2.bn) == (256, 128, "overlap", 256)
    q = solve(spec, gemm1_promote="overlap")   # GEMM 1's 128-column form, the default before bench/NOTES.md v26
    assert (q.gemm1.bn, q.gemm1.mma_split, q.gemm1.promote, q.gemm2.bn) == (128, 1, "overlap", 256)
    assert q.canonical_json() == solve(spec, gemm1_bn=128).canonical_json()
    assert solve(spec, promote="serial").gemm1.promote == solve(spec, promote="serial").gemm2.promote == "serial"
    assert solve(spec, promote="overlap").backward.dgrad2.promote == "overlap"
    p = solve(spec, gemm2_promote="serial")
    assert (p.gemm1.promote, p.gemm2.promote) == ("serial", "serial")
    # gpt-oss-120b's ffn (2880) is no multiple of 128: its GEMM 1 keeps the 128-column tile (overlap)
    g = solve(load_spec("gpt-oss-120b-fp8")).gemm1
    assert (g.bn, g.mma_split, g.promote) == (128, 1, "overlap")
    with pytest.raises(PlanError, match=r"^plan\.gemm1_bn: 256 columns \(128 gate \+ 128 up\) need ffn a multiple "
                                        r"of 128, got 2880$"):
        solve(load_spec("gpt-oss-120b-fp8"), gemm1_bn=256)
    assert solve(spec, gemm2_stages=4).gemm2.stages == 4
    with pytest.raises(PlanError, match=r"^plan\.gemm2_stages: must be in \[3, 6\]"):
        solve(spec, gemm2_stages=7)
    with pytest.raises(PlanError, match=r"^plan\.promote: must be one of serial, stagger, overlap, got 'fast'$"):
        solve(spec, promote="fast")
    with pytest.raises(PlanError, match=r"^plan\.promote: the promotion mode applies to FP8 specs"):
        solve(load_spec("kimi-k2"), promote="overlap")
    # the BF16 ping-pong tile (64-row routing tiles) is no FP8 tile: refused, not planned into a broken plan
    for key in ("consumer", "gemm1_consumer", "gemm2_consumer", "dgrad1_consumer", "dgrad2_consumer"):
        with pytest.raises(PlanError, match=rf"^plan\.{key}: the FP8 GEMMs run cooperative 128-row tiles .* got "
                                            r"'pingpong'; pingpong is BF16's$"):
            solve(spec, **{key: "pingpong"})
    assert solve(spec, consumer="cooperative").canonical_json() == solve(spec).canonical_json()
    with pytest.raises(PlanError, match=r"^plan\.arch: dtype fp8 is not planned for sm_100a yet"):
        solve(spec, "sm_100a")
    assert configs.check_config(spec, "sm_90a", {"gemm1_bn": 192}) == [
        "gemm1_bn: FP8 tiles are 128 or 256 columns wide"]
    assert configs.check_config(spec, "sm_90a", {"schedule": "fused"}) == [
        "schedule: the FP8 forward runs the chain schedule"]
    # the FP8 dgrads' stages: on their FP8 tiles (the most that fit by default), not the BF16 plan's
    assert configs.check_config(spec, "sm_90a", {"dgrad1_stages": 3}) == []
    assert solve(spec, dgrad1_stages=5).backward.dgrad1.stages == 5
    assert solve(spec, dgrad2_stages=3).backward.dgrad2.stages == 3
    most = solve(spec).backward.dgrad1.stages
    msg = f"dgrad1_stages: must be in [3, {most}] for the FP8 dgrad1 on sm_90a, got {most + 1}"
    with pytest.raises(PlanError, match=rf"^plan\.{re.escape(msg)}$"):
        solve(spec, dgrad1_stages=most + 1)
    assert configs.check_config(spec, "sm_90a", {"dgrad1_bn": 256}) == []   # opt-in: plan.fp8_widen
    assert configs.check_config(load_spec("gpt-oss-120b-fp8"), "sm_90a", {"dgrad1_bn": 256}) == [
        "dgrad1_bn: 256 columns need ffn a multiple of 256 (the dSwiGLU epilogue's tiles divide it), got 2880"]
    # one rule, one sentence: the config check says what the solver raises (plan.fp8_tile_shape_problem)
    oss = load_spec("gpt-oss-120b-fp8")
    for cfg in ({"dgrad1_bn": 128}, {"dgrad1_bn": 256}, {"gemm1_bn": 256}):
        (msg,) = configs.check_config(oss, "sm_90a", cfg)
        with pytest.raises(PlanError) as err:
            solve(oss, **cfg)
        assert str(err.value) == f"plan.{msg}", (cfg, msg, str(err.value))
    assert configs.check_config(spec, "sm_90a", {"promote": "overlap", "wgrad1_bn": 128}) == []
    p = solve(spec, cluster=2)   # W-tile multicast to M-tile pairs: the forward GEMMs only
    assert (p.gemm1.cluster, p.gemm2.cluster, p.backward.dgrad1.cluster) == (2, 2, 1) and not configs.check_plan(p)
    assert solve(spec, gemm2_cluster=2).gemm1.cluster == 1
    assert configs.check_config(load_spec("kimi-k2"), "sm_90a", {"promote": "overlap"}) == [
        "promote: the promotion mode applies to FP8 specs"]
    # stagger: every FP8 GEMM whose tiles have at least as many K blocks as stages (qwen3-30b-a3b's GEMM 2: 6 = 6)
    p = solve(spec, promote="stagger")
    assert {p.gemm1.promote, p.gemm2.promote, p.backward.dgrad1.promote, p.backward.dgrad2.promote} == {"stagger"}
    assert configs.check_plan(p) == []
    short = solve(spec, gemm2_stages=3, promote="stagger")   # kimi-k2's GEMM 2: 16 K blocks
    assert short.gemm2.promote == "stagger"
    few = dataclasses.replace(short.gemm2, k_tiles=2)
    assert P.stagger_problem(few) == "needs at least as many K blocks per tile as stages (2 < 3)"
    assert any("gemm2.promote stagger needs" in m for m in configs.check_plan(dataclasses.replace(short, gemm2=few)))


def test_fp8_emit_stagger():
    files = emit(solve(load_spec("kimi-k2-fp8"), promote="stagger")).files
    for f in ("gemm1.py", "gemm2.py", "dgrad1.py", "dgrad2.py"):
        src = files[f]
        assert 'PROMOTE = "stagger"' in src and "STAGGER_BAR = 5" in src and "cwg = wg - 1" in src
        assert src.count("barrier_id=STAGGER_BAR") == 2 and "acc_k1" not in src
    serial = emit(solve(load_spec("kimi-k2-fp8"))).files["gemm2.py"]
    assert "STAGGER_BAR" not in serial


def test_fp8_emit():
    plan = solve(load_spec("kimi-k2-fp8"), promote="overlap")
    files = emit(plan).files
    g1, g2, d1, d2 = (files[f] for f in ("gemm1.py", "gemm2.py", "dgrad1.py", "dgrad2.py"))
    for src in (g1, g2, d1, d2):
        assert "FP8 = True" in src and "ELEM = cutlass.Float8E4M3FN" in src and "BK = 128" in src
        assert 'PROMOTE = "overlap"' in src and "acc_k1" in src
    assert "SB_N = 1" in g1 and "SB_P = 2048" in g1 and "SB_ROWS = 32" in g1   # W1 [2I, H]: gate rows, then up
    assert "SB_ROWS = 56" in g2 and "B_MN = False" in d1 and "EPILOGUE = \"dswiglu\"" in d1
    assert "N_OUT = 7168" in d2 and "K_DIM = 4096" in d2   # dgrad2 reads W1's transposed copy [G, H, 2I]
    assert "FP8 = True" in files["wgrad1.py"] and "FP8 = True" in files["wgrad2.py"]   # FP8 wgrads by default
    bf16 = emit(solve(load_spec("kimi-k2-fp8"), wgrad1_dtype="bf16")).files
    assert "FP8 = False" in bf16["wgrad1.py"] and "FP8 = True" in bf16["wgrad2.py"]


@pytest.mark.parametrize("name", FP8_PRESETS)
def test_fp8_tune_space(name):
    """What `mokgen tune` / `tune --train` enumerate for an FP8 spec: the promotion modes, the tiles' N, GEMM 1's A
    path, where h is quantized and the cluster forward; the dgrads' output
    path and stages, dgrad1's z path and z chunk and the BF16 wgrads' knobs backward; every config solves to a plan passing the constraints."""
    spec = load_spec(name)
    fwd = list(configs.enumerate_configs(spec))
    modes = ("serial", "stagger", "overlap")
    # 256-column tiles promote their halves in turn (serial, or staggered where the tile has as many K blocks as
    # stages) and take no cluster; GEMM 1's need ffn % 128 == 0
    ok = {w: P.stagger_problem(getattr(solve(spec), w)) is None for w in ("gemm1", "gemm2")}
    # GEMM 1's A path: its own gather of the per-token rows (hidden a multiple of 128, cluster 1) or TMA tiles
    loads = ("gather", "tma") if spec.hidden % 128 == 0 else ("tma",)
    # h's quantization in GEMM 1's epilogue: on its 256-column tile (one scale block per row)
    assert sorted(map(str, fwd)) == sorted(map(str, [
        {"gemm1_promote": p1, "gemm2_promote": p2, "gemm1_bn": b1, "gemm2_bn": bn, "gemm1_a_load": al,
         "gemm1_h_quant": hq, "cluster": c}
        for p1 in modes for p2 in modes for b1 in (128, 256) for bn in (128, 256) for al in loads
        for hq in ("kernel", "epilogue") for c in (1, 2)
        if (bn == 128 or (c == 1 and (p2 == "serial" or (p2 == "stagger" and ok["gemm2"]))))
        and (b1 == 128 or (c == 1 and spec.ffn % 128 == 0 and (p1 == "serial" or (p1 == "stagger" and ok["gemm1"]))))
        and (al == "tma" or c == 1) and (hq == "kernel" or b1 == 256)]))
    bwd = list(configs.enumerate_backward_configs(spec))
    assert bwd and all(next(iter(c)).startswith(("wgrad", "dgrad1_z_chunk", "dgrad1_z_load", "dgrad1_epi_store",
                                                 "dgrad2_epi_store", "dgrad1_promote", "dgrad2_promote",
                                                 "bwd_streams", "bwd_x_cols", "dgrad1_bn", "dgrad2_bn",
                                                 "dgrad1_raster_group", "dgrad2_raster_group", "dgrad1_stages",
                                                 "dgrad2_stages")) for c in bwd)
    assert {"dgrad1_stages": 4} in bwd   # on the FP8 tile (the BF16 plan's 256-column tile took none of these)
    assert {"dgrad1_promote", "dgrad2_promote"} <= {next(iter(c)) for c in bwd}
    assert {"bwd_x_cols": "forward"} in bwd   # x's FP8 columns from the forward's x quantizer (FP8 wgrad1)
    assert {"dgrad2_bn": 128} in bwd   # the default is 256 (plan.FP8_WIDE_DEFAULT)
    assert ({"dgrad1_bn": 256} in bwd) == (spec.ffn % 256 == 0)   # opt-in, where 256 divides ffn
    for cfg in fwd + bwd:
        p = solve(spec, **cfg)
        assert not configs.check_plan(p), (cfg, configs.check_plan(p))
        assert p.gemm1.elem_bytes == p.backward.dgrad1.elem_bytes == 1


@pytest.mark.parametrize("name", FP8_PRESETS)
def test_fp8_wide_tiles(name):
    """gemm2_bn / dgrad2_bn = 256 (mokgen.plan.fp8_widen, the default: plan.FP8_WIDE_DEFAULT): 128 x 256 tiles
    whose wgmma runs per 128-column half, serial promotion, as many 48 KiB stages as fit, N tiles recounted (a
    partial last one on gpt-oss-120b); gemm2_bn / dgrad2_bn = 128 give the 128-column form."""
    spec = load_spec(name)
    base = solve(spec, gemm2_bn=128, dgrad2_bn=128)
    p = solve(spec, gemm2_bn=256, dgrad2_bn=256)
    assert solve(spec) == p
    for g, b in ((p.gemm2, base.gemm2), (p.backward.dgrad2, base.backward.dgrad2)):
        assert (g.bn, g.mma_split, g.promote, g.stages) == (256, 2, "serial", 4)
        assert g.n_tiles == -(-spec.hidden // 256) and g.epi_store == "ring"
        assert (g.raster_group, g.bk, g.elem_bytes) == (b.raster_group, b.bk, b.elem_bytes)
    assert p.gemm1 == base.gemm1 and p.backward.dgrad1 == base.backward.dgrad1
    assert base.gemm2.mma_split == base.backward.dgrad2.mma_split == 1
    assert not configs.check_plan(p)
    # the shared promote key leaves the halves serial; a GEMM's own key is refused
    q = solve(spec, gemm2_bn=256, promote="overlap")
    assert (q.gemm1.promote, q.gemm2.promote) == ("overlap", "serial")
    files = emit(p).files
    for f in ("gemm2.py", "dgrad2.py"):
        src = files[f]
        assert "MMA_SPLIT = 2" in src and "BN = 256" in src and "mma_half" in src and "tCrB_h" in src
        assert "sb_rows[p] = cutlass.min((n * BN + p * (BN // 2)) * SB_N // 128, SB_ROWS - 1)" in src
    assert ("MMA_SPLIT" in files["gemm1.py"]) == (spec.ffn % 128 == 0)   # GEMM 1's own wide default
    assert "MMA_SPLIT" not in emit(base).files["gemm2.py"]


def test_fp8_wide_tiles_refused():
    spec = load_spec("kimi-k2-fp8")
    for kw, msg in (({"gemm2_bn": 192}, r"^plan\.gemm2_bn: FP8 tiles are 128 or 256 columns wide, got 192$"),
                    ({"dgrad1_bn": 192}, r"^plan\.dgrad1_bn: FP8 tiles are 128 or 256 columns wide, got 192$"),
                    ({"gemm1_bn": 256, "gemm1_promote": "overlap"},
                     r"^plan\.gemm1_promote: overlap needs 128-column FP8 tiles"),
                    ({"gemm1_bn": 256, "cluster": 2}, r"^plan\.gemm1_bn: 256 columns needs cluster 1, got 2$"),
                    ({"gemm2_bn": 256, "cluster": 2}, r"^plan\.gemm2_bn: 256 columns needs cluster 1, got 2$"),
                    ({"gemm2_bn": 256, "gemm2_promote": "overlap"},
                     r"^plan\.gemm2_promote: overlap needs 128-column FP8 tiles"),
                    ({"dgrad2_bn": 256, "dgrad2_promote": "overlap"},
                     r"^plan\.dgrad2_promote: overlap needs 128-column FP8 tiles \(the 256-column tile promotes its "
                     r"halves in turn: serial, or stagger\)$")):
        with pytest.raises(PlanError, match=msg):
            solve(spec, **kw)
    # the 256-column tiles' halves with the warpgroups one half apart (opt-in, per GEMM): mma_split 2, stagger
    st = solve(spec, dgrad2_bn=256, dgrad2_promote="stagger", gemm2_bn=256, gemm2_promote="stagger")
    assert (st.backward.dgrad2.mma_split, st.backward.dgrad2.promote) == (2, "stagger")
    assert (st.gemm2.mma_split, st.gemm2.promote) == (2, "stagger") and not configs.check_plan(st)
    assert st.gemm2 == dataclasses.replace(solve(spec).gemm2, promote="stagger")
    assert configs.check_config(spec, "sm_90a", {"gemm2_bn": 192}) == ["gemm2_bn: FP8 tiles are 128 or 256 "
                                                                        "columns wide"]
    assert configs.check_config(spec, "sm_90a", {"gemm2_bn": 256, "gemm2_promote": "overlap"}) == [
        "gemm2_bn: 256 columns promote their halves in turn (serial, or stagger), not overlap"]
    assert configs.check_config(spec, "sm_90a", {"gemm2_bn": 256, "cluster": 2}) == [
        "gemm2_bn: 256 columns need cluster 1, got 2"]
    narrow = solve(spec, gemm1_bn=128)
    assert any("mma_split" in m for m in configs.check_plan(dataclasses.replace(
        narrow, gemm1=dataclasses.replace(narrow.gemm1, mma_split=2))))


@pytest.mark.parametrize("name", FP8_PRESETS)
def test_fp8_wide_gemm1(name):
    """gemm1_bn=256 (the default where ffn is a multiple of 128: plan.FP8_WIDE_DEFAULT): GEMM 1's two parts, 128
    gate and 128 up columns, each its own wgmma half into the per-block accumulator, promoted in turn into the
    (128, 256) fp32 tile; 128 outputs per tile, z through the ring as the 128-column form (gemm1_bn=128), 48 KiB
    stages; ffn must be a multiple of 128 (gpt-oss-120b's 2880 is not: 128 columns, overlap)."""
    spec = load_spec(name)
    if spec.ffn % 128:
        with pytest.raises(PlanError, match=r"^plan\.gemm1_bn: 256 columns \(128 gate \+ 128 up\) need ffn a "
                                            r"multiple of 128, got 2880$"):
            solve(spec, gemm1_bn=256)
        assert configs.check_config(spec, "sm_90a", {"gemm1_bn": 256}) == [
            "gemm1_bn: 256 columns (128 gate + 128 up) need ffn a multiple of 128, got 2880"]
        return
    base, p = solve(spec, gemm1_bn=128), solve(spec, gemm1_bn=256)
    assert p == solve(spec) and (base.gemm1.bn, base.gemm1.promote) == (128, "overlap")
    g = p.gemm1
    assert (g.bn, g.mma_split, g.promote, g.stages, g.n_tiles) == (256, 2, "serial", 4, spec.ffn // 128)
    t, tb = p.train_gemm1, base.train_gemm1   # z through the ring in training (the inference GEMM 1 may gather)
    assert (t.z_store, t.epi_store) == (tb.z_store, tb.epi_store) == ("ring", "ring")
    assert g.epi_store == base.gemm1.epi_store == ("smem" if g.a_load == "gather" else "ring")
    assert p.gemm2 == base.gemm2 and p.backward.dgrad1 == base.backward.dgrad1 and not configs.check_plan(p)
    assert configs.check_config(spec, "sm_90a", {"gemm1_bn": 256}) == []
    files = emit(p).files
    for f in ("gemm1.py", "gemm1_train.py"):
        src = files[f]
        assert "MMA_SPLIT = 2" in src and "BN = 128 " in src and "PARTS = 2" in src
        assert "tCrB_h = [tiled_mma.make_fragment_B(thr_mma.partition_B(sB[p])) for p in range(PARTS)]" in src
        assert "mma_half" not in src and "sb_rows[p] = (n * BN * SB_N + p * SB_P) // 128" in src
    assert "MMA_SPLIT" not in emit(base).files["gemm1.py"]


@pytest.mark.parametrize("name,want", [("qwen3-30b-a3b-fp8", "epilogue"), ("tools/specs/qwen3.5-397b-a17b-fp8.yaml", "epilogue"),
                                       ("tools/specs/glm-5-fp8.yaml", "kernel"), ("kimi-k2-fp8", "kernel"),
                                       ("gpt-oss-120b-fp8", "kernel")])
def test_fp8_h_quant_default(name, want):
    """h's quantization runs in GEMM 1's epilogue by default where GEMM 1's K (hidden) is at most
    FP8_H_QUANT_EPILOGUE_MAX_K and its tile is the 256-column one (gpt-oss-120b's ffn 2880 gives 128 columns); the
    solver, the candidates and the training GEMM 1 agree, and a 128-column override falls back to the kernel."""
    spec = load_spec(str(ROOT / name) if name.startswith("tools/") else name)
    p = solve(spec)
    assert (p.gemm1.h_quant, p.train_gemm1.h_quant) == (want, want)
    assert candidates(spec)[0].gemm1.h_quant == want
    assert (want == "epilogue") == (spec.hidden <= P.FP8_H_QUANT_EPILOGUE_MAX_K and spec.ffn % 128 == 0)
    assert solve(spec, gemm1_bn=128).gemm1.h_quant == "kernel"
    assert solve(spec, gemm1_h_quant="kernel").gemm1.h_quant == "kernel"


def test_fp8_h_quant_override():
    """gemm1_h_quant=epilogue (kimi-k2's default is kernel: hidden 7168 > FP8_H_QUANT_EPILOGUE_MAX_K): GEMM 1's 256-column tile quantizes h per 1 x 128
    in its epilogue (one scale block per row of its 128 h columns); the 128-column tile, a BF16 spec and an
    unknown value are refused with the reason; the emitted GEMM 1 files take hq / hs (gemm1*_hq_fp8 tables) and
    the rest of the plan is unchanged."""
    spec = load_spec("kimi-k2-fp8")
    base, p = solve(spec), solve(spec, gemm1_h_quant="epilogue")
    assert base.gemm1.h_quant == "kernel" and (p.gemm1.h_quant, p.train_gemm1.h_quant) == ("epilogue", "epilogue")
    assert dataclasses.replace(p.gemm1, h_quant="kernel") == base.gemm1 and p.gemm2 == base.gemm2
    # the backward unchanged but for the training GEMM 1 (split off where the inference GEMM 1 gathers), which
    # quantizes h likewise
    assert dataclasses.replace(p.backward, gemm1_train=base.backward.gemm1_train) == base.backward
    assert not configs.check_plan(p)
    assert configs.check_config(spec, "sm_90a", {"gemm1_h_quant": "epilogue"}) == []
    for kw, msg in (({"gemm1_h_quant": "epilogue", "gemm1_bn": 128}, r"^plan\.gemm1_h_quant: epilogue needs the FP8 "
                                                                     r"256-column GEMM 1 tile"),
                    ({"gemm1_h_quant": "fused"}, r"^plan\.gemm1_h_quant: must be one of kernel, epilogue, got 'fused'$")):
        with pytest.raises(PlanError, match=msg):
            solve(spec, **kw)
    with pytest.raises(PlanError, match=r"^plan\.gemm1_h_quant: h's FP8 quantization applies to FP8 specs"):
        solve(load_spec("kimi-k2"), gemm1_h_quant="epilogue")
    with pytest.raises(PlanError, match=r"^plan\.gemm1_h_quant: epilogue needs the FP8 256-column GEMM 1 tile"):
        solve(load_spec("gpt-oss-120b-fp8"), gemm1_h_quant="epilogue")   # ffn 2880: 128-column GEMM 1
    assert configs.check_config(load_spec("kimi-k2"), "sm_90a", {"gemm1_h_quant": "epilogue"}) == [
        "gemm1_h_quant: h's FP8 quantization applies to FP8 specs"]
    bad = dataclasses.replace(base, gemm2=dataclasses.replace(base.gemm2, h_quant="epilogue"))
    assert any(m.startswith("gemm2.h_quant 'epilogue': GEMM 1's choice") for m in configs.check_plan(bad))
    files, plain = emit(p).files, emit(base).files
    for f in ("gemm1.py", "gemm1_train.py"):
        assert "mHQ: cute.Tensor" in files[f] and "pow2_scale(hm)" in files[f] and "mHQ" not in plain[f]
        assert "hq: cute.Tensor" in files[f] and "hs: cute.Tensor" in files[f]
    body = lambda src: [ln for ln in src.splitlines() if not ln.startswith("#")]   # noqa: E731 (header: the plan)
    assert body(files["gemm2.py"]) == body(plain["gemm2.py"])
