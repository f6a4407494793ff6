"""The plan's sm_100a rules (mokgen/sm100/plan.py and rules.py, issue 20): every preset planned for sm_100a (BF16, and
MXFP8 where the spec admits it) keeps every GEMM kernel within the 512 TMEM columns and the CTA's shared memory with
tiles that divide their problem; overrides that break a budget are refused by ``solve`` in one line naming the knob
and the budget; the plan's accounting is the one mokgen/sm100/emit.py renders and asserts (the numbers the emitted
sources declare). CPU only, fast: nothing is compiled."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from mokgen import configs
from mokgen.sm100 import rules as R
from mokgen.arch import ARCHS
from mokgen.emit import EmitError, emit
from mokgen.sm100.emit import grouped_params, wgrad_params
from mokgen.plan import PlanError, explain, solve
from mokgen.sm100.plan import MX_BK, check_budgets
from mokgen.spec import list_presets, load_spec

ARCH = "sm_100a"
ROOT = Path(__file__).resolve().parent.parent
LIMIT = ARCHS[ARCH].smem_per_cta
PRESETS = [s.name for s in list_presets()]


def _spec(name: str, dtype: str):
    """Preset `name` in `dtype` ("bf16": the FP8 presets' BF16 form; "mxfp8": for sm_100a only)."""
    d = load_spec(name).to_dict()
    if dtype == "bf16":
        return load_spec({**d, "dtype": "bf16"})
    return load_spec({**d, "name": f"{d['name']}-mxfp8", "dtype": "mxfp8", "archs": [ARCH]})


def _one_line_plan_error(key: str, **overrides) -> str:
    with pytest.raises(PlanError) as e:
        solve(overrides.pop("_spec"), ARCH, **overrides)
    msg = str(e.value)
    assert msg.startswith(f"plan.{key}: ") and "\n" not in msg, msg
    return msg


def _cases():
    for name in PRESETS:
        yield name, "bf16"
        yield name, "mxfp8"


@pytest.mark.parametrize("name,dtype", list(_cases()))
def test_every_preset_within_the_sm100a_budgets(name, dtype):
    """Every GEMM kernel of the preset's sm_100a plan (forward, gemm1_train, dgrads, weight gradients) within TMEM
    and shared memory, its tile dividing its problem; the forward GEMMs' rings as deep as fit."""
    spec = _spec(name, dtype)
    plan = solve(spec, ARCH)
    mx = dtype == "mxfp8"
    H, I = spec.hidden, spec.ffn
    tiles = R.kernel_tiles(plan)
    assert sorted(tiles) == sorted(R.KERNELS)
    for kname, t in tiles.items():
        assert t.problems(LIMIT) == [], (kname, t)
        assert t.tmem_columns <= t.tmem_alloc <= R.TMEM_COLUMNS, (kname, t)
        assert R.MIN_STAGES <= t.stages and t.smem_bytes <= LIMIT, (kname, t)
        assert t.mx == (mx and not kname.startswith("wgrad")) and not t.pair
        assert t.bn % t.epi_n == 0 and t.bk % R.UMMA_K == 0, (kname, t)
        if t.mx:
            assert (t.bn, t.bk) == (128, MX_BK)
    # the tiles divide: K by the K step, GEMM 1 / dgrad1 (SwiGLU epilogues) N by whole tiles (MXFP8, whose tiles
    # are fixed at 128: K by the 32-element scale blocks, N by the 32-column epilogue slices, the last K / N tile
    # partial where hidden / ffn is not a multiple of 128: gpt-oss-120b's 2880); routing tiles of whole UMMA tiles;
    # the weight gradients' K step divides every group's start (the routing tile)
    k_of = {"gemm1": H, "gemm2": I, "dgrad1": H, "dgrad2": 2 * I}
    for kname, k in k_of.items():
        assert k % (32 if tiles[kname].mx else tiles[kname].bk) == 0, kname
        g = getattr(plan, kname) if kname.startswith("gemm") else getattr(plan.backward, kname)
        assert g.k_tiles == -(-k // tiles[kname].bk), kname
    for kname in ("gemm1", "dgrad1"):
        t = tiles[kname]
        assert I % (t.epi_n if t.mx else t.bn) == 0, kname
    assert plan.bm % R.UMMA_M == 0
    for kname in ("wgrad1", "wgrad2"):
        assert plan.bm % tiles[kname].bk == 0
    # the forward GEMMs' rings: the most stages that fit (capped: BF16 at the plan's 7, MXFP8 at 16)
    for kname in ("gemm1", "gemm2"):
        t = tiles[kname]
        assert t.stages == min(16 if mx else 7, t.stages_fit(LIMIT)), (kname, t)
    assert configs.check_plan(plan) == []


@pytest.mark.parametrize("name", PRESETS)
def test_bad_overrides_are_refused_in_one_line(name):
    """An override that breaks an sm_100a budget is a one-line PlanError from solve naming the knob and the budget
    (not an EmitError later): one stage more than fits, for each forward GEMM whose ring is not at the cap, 1-CTA
    and 2-CTA (each CTA holds half of every W box: more stages fit). MXFP8: its tiles are fixed (the stages too)."""
    spec = _spec(name, "bf16")
    refused = 0
    for cluster in (1, 2):
        plan = solve(spec, ARCH, cluster=cluster)
        tiles = R.kernel_tiles(plan)
        for w in (1, 2):
            t = tiles[f"gemm{w}"]
            fit = t.stages_fit(LIMIT)
            assert t.pair == (cluster == 2)
            if fit >= 7:   # the stages knob stops at 7
                continue
            key = f"gemm{w}_stages"
            msg = _one_line_plan_error(key, _spec=spec, cluster=cluster, **{key: fit + 1})
            assert f"GEMM {w} on sm_100a: {fit + 1} stages" in msg and f"budget {LIMIT} B per CTA" in msg, msg
            assert f"at most {fit} stages fit" in msg and ("2-CTA" in msg) == (cluster == 2), msg
            ok = solve(spec, ARCH, cluster=cluster, **{key: fit})   # the most that fit is accepted
            assert getattr(ok, f"gemm{w}").stages == fit and configs.check_plan(ok) == []
            refused += 1
    assert refused >= 2   # every preset has a GEMM whose ring can be overfilled
    msg = _one_line_plan_error("gemm2_stages", _spec=spec, gemm2_stages=8)
    assert "must be in [3, 7]" in msg
    mx = _spec(name, "mxfp8")   # every preset is taken in MXFP8 (gpt-oss-120b's 2880 with partial last tiles)
    for key, value, say in (("gemm2_stages", 7, "take their fixed tiles"), ("gemm1_stages", 3, "fixed tiles"),
                            ("cluster", 2, "BF16 only so far")):
        assert say in _one_line_plan_error(key, _spec=mx, **{key: value})


def test_tmem_overflow_is_refused_by_plan_and_emit_alike():
    """No override reaches past the 512 TMEM columns (tile N is at most 256: GEMM 1's 2 parts x 2 buffers x 128
    = 512, the 2-CTA form the same per CTA), so a plan made by hand checks it: check_budgets (what solve runs)
    and emit's assertion give the same reason; the rule counts MXFP8's scale columns."""
    plan = solve(load_spec("kimi-k2"), ARCH)
    forged = dataclasses.replace(plan, gemm1=dataclasses.replace(plan.gemm1, bn=384, stages=2))
    with pytest.raises(PlanError) as p:
        check_budgets(forged, {})
    with pytest.raises(EmitError) as e:
        grouped_params(forged, 1)
    why = "TMEM: 2 x 2 accumulators of 192 columns = 768 columns exceed the budget of 512 columns per SM"
    assert str(p.value) == f"plan.gemm1: GEMM 1 on sm_100a: {why}"
    assert str(e.value) == f"plan.gemm1.bn: {why}"
    assert any(m.startswith("gemm1.bn: TMEM") for m in configs.check_plan(forged))
    pair = dataclasses.replace(plan, gemm1=dataclasses.replace(plan.gemm1, cluster=2))   # per CTA: the same columns
    assert R.kernel_tiles(pair)["gemm1"].tmem_columns == R.kernel_tiles(plan)["gemm1"].tmem_columns == 512
    # MXFP8: the scales of A and of each part sit beside the accumulators; GEMM 1 drops to one accumulator buffer
    g1 = R.Tile(2, 128, 128, 4, 32, 2, mx=True)
    assert (g1.sf_columns, g1.acc_stages, g1.tmem_columns) == (48, 1, 304)
    assert R.Tile(1, 128, 128, 6, 32, 2, mx=True).tmem_columns == 2 * 128 + 32
    assert R.Tile(2, 128, 256, 2, 32, 2, mx=True).sf_columns == 3 * 32   # (BM / 32) x (BK / 32) per set


def test_emit_asserts_what_the_plan_checks():
    """A plan forged past a budget: the plan's check and emit's assertion name the same reason (one source)."""
    plan = solve(load_spec("kimi-k2"), ARCH)
    fit = R.kernel_tiles(plan)["gemm2"].stages_fit(LIMIT)
    forged = dataclasses.replace(plan, gemm2=dataclasses.replace(plan.gemm2, stages=fit + 1))
    with pytest.raises(PlanError) as p:
        check_budgets(forged, {"gemm2_stages": fit + 1})
    with pytest.raises(EmitError) as e:
        emit(forged)
    why = str(e.value).removeprefix("plan.gemm2.stages: ")
    assert "shared memory, budget" in why and str(p.value) == f"plan.gemm2_stages: GEMM 2 on sm_100a: {why}"
    with pytest.raises(EmitError, match=r"^plan\.backward\.wgrad1\.stages: 6 stages .* budget 231424 B"):
        wgrad_params(plan, "wgrad1", stages=6)


def _declared(src: str) -> dict:
    """The module-level constants an emitted kernel declares (NAME = expression), evaluated in order; those that
    need the DSL (cutlass, cute) are skipped."""
    ns: dict = {"max": max, "min": min}
    for node in ast.parse(src).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id.isupper()):
            try:
                ns[node.targets[0].id] = eval(compile(ast.Expression(node.value), "<src>", "eval"), ns)
            except Exception:
                pass
    return ns


def _agreement_cases():
    for name in PRESETS:
        yield name, "bf16", {}
        yield name, "mxfp8", {}
    yield "kimi-k2", "bf16", {"cluster": 2}
    yield "kimi-k2", "bf16", {"cluster": 2, "gemm2_stages": 6}   # the pair's ring: 6 fit, 4 for a 1-CTA tile
    yield "gpt-oss-120b", "bf16", {"gemm2_cluster": 2}
    yield "kimi-k2", "bf16", {"dgrad1_cluster": 2, "dgrad2_cluster": 2}   # the dgrads' 2-CTA form (W N-major)
    yield "qwen3-30b-a3b", "bf16", {"cluster": 2, "dgrad1_cluster": 2}
    yield "qwen3-30b-a3b", "bf16", {"epi_n": 64, "epi_stages": 4}


@pytest.mark.parametrize("name,dtype,overrides", list(_agreement_cases()))
def test_plan_accounting_is_what_emit_renders(name, dtype, overrides):
    """For every GEMM kernel emit renders, the tile and budgets the plan checked are the numbers the emitted source
    declares: BN, BK, STAGES, ACC_STAGES, EPI_N, EPI_STAGES, PARTS, the TMEM columns it allocates (TMEM_COLS) and
    uses (accumulators + MXFP8 scales), the bytes of one ring stage in each CTA (TX_BYTES / CTA_GROUP)."""
    plan = solve(_spec(name, dtype), ARCH, **overrides)
    tiles = R.kernel_tiles(plan)
    files = emit(plan).files
    kernels = {"gemm1": "gemm1", "gemm1_train": "gemm1", "gemm2": "gemm2", "dgrad1": "dgrad1", "dgrad2": "dgrad2",
               "wgrad1": "wgrad1", "wgrad1_acc": "wgrad1", "wgrad2": "wgrad2", "wgrad2_acc": "wgrad2"}
    for fname, kname in kernels.items():
        t, d = tiles[kname], _declared(files[f"{fname}.py"])
        got = (d["BN"], d["BK"], d["STAGES"], d["ACC_STAGES"], d["EPI_N"], d["EPI_STAGES"], d.get("PARTS", 1))
        assert got == (t.bn, t.bk, t.stages, t.acc_stages, t.epi_n, t.epi_stages, t.parts), (fname, got, t)
        used = d["ACC_COLS"] + (1 + d["PARTS"]) * d["SF_COLS"] if d.get("MX") else d["ACC_STAGES"] * t.parts * d["BN"]
        assert (used, d["TMEM_COLS"]) == (t.tmem_columns, t.tmem_alloc), fname
        if "TX_BYTES" in d:
            assert d["TX_BYTES"] // d.get("CTA_GROUP", 1) == t.stage_bytes, fname
        assert bool(d.get("MX", False)) == t.mx and ("CTA_GROUP" in d) == t.pair, fname


def test_explain_shows_the_budgets():
    """`mokgen plan --explain` for sm_100a: a line per GEMM kernel with its TMEM columns of 512 and its shared memory
    of the budget (the figures of mokgen.sm100.rules); sm_90a plans have no such section."""
    for spec, ov in ((load_spec("kimi-k2"), {}), (load_spec("kimi-k2"), {"cluster": 2}),
                     (load_spec(ROOT / "tools" / "specs" / "kimi-k2-mxfp8.yaml"), {})):
        plan = solve(spec, ARCH, **ov)
        text = explain(plan)
        section = text.split("sm_100a budgets", 1)[1].splitlines()
        for kname, t in R.kernel_tiles(plan).items():
            line = next(ln for ln in section if ln.startswith(f"  {kname} "))
            assert f"TMEM {t.tmem_columns} / 512 columns" in line and f"smem {t.smem_bytes} / {LIMIT} B" in line
    assert "sm_100a budgets" in text and "sm_100a budgets" not in explain(solve(load_spec("kimi-k2"), "sm_90a"))


def test_dgrad_pair_plan_explains_and_checks():
    """``dgrad1_cluster`` / ``dgrad2_cluster`` = 2 on sm_100a (BF16): 256-row routing tiles, that dgrad's tile in the
    2-CTA form in the budgets (half of each W box per CTA: more stages would fit; the plan's ring kept), the
    explanation saying the dgrad runs as a CTA pair; a forward cluster=2 keeps the dgrads 1-CTA; the default plan
    has none of it."""
    spec = load_spec("kimi-k2")
    assert all(not R.kernel_tiles(solve(spec, ARCH, cluster=2))[n].pair for n in ("dgrad1", "dgrad2"))
    plan = solve(spec, ARCH, dgrad1_cluster=2)
    tiles = R.kernel_tiles(plan)
    assert plan.bm == 256 and tiles["dgrad1"].pair and not tiles["dgrad2"].pair and configs.check_plan(plan) == []
    assert not tiles["gemm1"].pair and not tiles["gemm2"].pair
    text = explain(plan)
    assert "dgrad1 yes, dgrad2 no" in text and "a CTA pair (dgrad1_cluster=2" in text
    assert any(ln.startswith("  dgrad1 ") and "2-CTA" in ln for ln in text.split("sm_100a budgets", 1)[1].splitlines())
    assert "overrides: dgrad1_cluster=2: dgrad1 in the 2-CTA form" in text
    default = explain(solve(spec, ARCH))
    assert "dgrad1 yes" not in default and "dgrad1 no" not in default and "dgrad1_cluster" not in default
