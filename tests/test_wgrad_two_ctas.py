"""Two CTAs per SM for the BF16 weight gradients (plan ``wgrad1_ctas_per_sm`` / ``wgrad2_ctas_per_sm`` = 2, opt-in):
the plan's tile, stages and output path, its one-line errors, what the template emits for it, and (slow) that the
four wgrad kernels compile for sm_90a within the registers two CTAs leave each thread, with no spill."""

import dataclasses
import re

import pytest

from mokgen import configs
from mokgen import plan as P
from mokgen import plan_types as PT
from mokgen.emit import emit
from mokgen.plan import Plan, PlanError, solve
from mokgen.spec import load_spec

TWO = dict(wgrad1_ctas_per_sm=2, wgrad2_ctas_per_sm=2)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "kimi-k2", "gpt-oss-120b"])
def test_two_ctas_plan(name):
    """128 x 128 tiles (the default 256 narrowed), half the SM's shared memory each (3 stages of 32 KiB beside two
    32-column epilogue buffers), the output through those buffers (the stage ring's storer warp is gone), and
    nothing else of the plan changed; the plan's dict names the knob only where it is not 1 (older plans keep
    their cache keys) and round-trips."""
    spec = load_spec(name)
    base, two = solve(spec, "sm_90a"), solve(spec, "sm_90a", **TWO)
    a = P.get_arch("sm_90a")
    for n in ("wgrad1", "wgrad2"):
        g = getattr(two.backward, n)
        assert (g.ctas_per_sm, g.bn, g.epi_store) == (2, 128, "smem"), n
        assert g.stages >= P.MIN_STAGES and g.smem_bytes() <= P.smem_budget(a, g) <= a.smem_per_cta // 2, n
        assert 2 * (g.smem_bytes() + PT.SMEM_RESERVED_PER_CTA) <= PT.SMEM_PER_SM, n
        assert g.regs == PT.REGS_TWO_CTAS and "ctas_per_sm" in g.to_dict(), n
        assert getattr(base.backward, n).ctas_per_sm == 1 and "ctas_per_sm" not in getattr(base.backward, n).to_dict()
    assert dataclasses.replace(two, backward=base.backward, notes=base.notes) == base
    assert (two.backward.dgrad1, two.backward.dgrad2) == (base.backward.dgrad1, base.backward.dgrad2)
    assert Plan.from_dict(two.to_dict()) == two and Plan.from_dict(base.to_dict()) == base
    assert configs.check_plan(two) == []
    # one of them alone; an explicit 128 (or 64) tile N is kept
    one = solve(spec, "sm_90a", wgrad2_ctas_per_sm=2, wgrad2_bn=64).backward
    assert (one.wgrad1, one.wgrad2.bn, one.wgrad2.ctas_per_sm) == (base.backward.wgrad1, 64, 2)
    # --explain says it, for both wgrads only
    text = P.explain(two)
    assert text.count("2 CTAs per SM") == 2 and "CTAs per SM" not in P.explain(base)


def test_two_ctas_errors():
    spec = load_spec("qwen3-30b-a3b")
    with pytest.raises(PlanError, match=r"^plan.wgrad1_ctas_per_sm: must be one of 1, 2, got 3"):
        solve(spec, "sm_90a", wgrad1_ctas_per_sm=3)
    with pytest.raises(PlanError, match=r"^plan.wgrad2_ctas_per_sm: two CTAs per SM need wgrad2_bn <= 128"):
        solve(spec, "sm_90a", wgrad2_ctas_per_sm=2, wgrad2_bn=256)
    with pytest.raises(PlanError, match=r"^plan.wgrad1_ctas_per_sm: two CTAs per SM are built for BF16"):
        solve(load_spec("kimi-k2-fp8"), "sm_90a", wgrad1_dtype="fp8", wgrad1_ctas_per_sm=2)
    # a plan that claims two CTAs where the template has none: check_plan says so
    pl = solve(spec, "sm_90a")
    bad = dataclasses.replace(pl, backward=dataclasses.replace(
        pl.backward, dgrad2=dataclasses.replace(pl.backward.dgrad2, ctas_per_sm=2)))
    assert any("ctas_per_sm" in v for v in configs.check_plan(bad))


def test_two_ctas_emitted():
    """The wgrad sources for two CTAs per SM: 288 threads (consumers in warps 0-7, the producer warp 8), no
    setmaxnreg, the launch bound and the shared-memory carveout that let two CTAs share an SM, the grid twice the
    SMs given; the default wgrads are the one-CTA form."""
    src = emit(solve(load_spec("qwen3-30b-a3b"), "sm_90a", **TWO)).files
    base = emit(solve(load_spec("qwen3-30b-a3b"), "sm_90a")).files
    for k in ("wgrad1", "wgrad1_acc", "wgrad2", "wgrad2_acc"):
        t, b = src[f"{k}.py"], base[f"{k}.py"]
        assert "THREADS = 288" in t and "PRODUCER_WARP = 8" in t and "CTAS_PER_SM = 2" in t, k
        assert "setmaxregister" not in t and "preferred_smem_carveout=100" in t, k
        assert "grid=(num_ctas * CTAS_PER_SM, 1, 1)" in t and "min_blocks_per_mp=CTAS_PER_SM" in t, k
        assert "THREADS = 384" in b and "CTAS_PER_SM = 1" in b and "setmaxregister_increase" in b, k
        assert "preferred_smem_carveout" not in b, k
    def body(text):   # the source below its header comment (which holds the whole plan)
        lines = text.splitlines()
        return lines[next(i for i, ln in enumerate(lines) if not ln.startswith("#")):]

    for k in ("dgrad1", "dgrad2", "gemm1_train", "gemm2"):
        assert body(src[f"{k}.py"]) == body(base[f"{k}.py"]), k


@pytest.mark.slow
def test_two_ctas_compile_for_sm90a(tmp_path):
    """The four wgrad kernels compile for sm_90a with two CTAs' launch bound (.minnctapersm 2), no setmaxnreg, and
    (where a ptxas is found) within the 112 registers a thread then has, with no spill and no wgmma advisory."""
    pytest.importorskip("cutlass")
    from pathlib import Path

    from mokgen import build

    src = emit(solve(load_spec("qwen3-30b-a3b"), "sm_90a", **TWO))
    keep = {f"{k}.py" for k in ("wgrad1", "wgrad1_acc", "wgrad2", "wgrad2_acc")}
    art = build.build(dataclasses.replace(src, files={n: t for n, t in src.files.items() if n in keep}), "sm_90a",
                      tmp_path, progress=False)
    for k in ("wgrad1", "wgrad1_acc", "wgrad2", "wgrad2_acc"):
        ptx = (Path(art.dir) / f"{k}.ptx").read_text()
        assert ".minnctapersm 2" in ptx and "setmaxnreg" not in ptx, k
        assert set(re.findall(r"wgmma\.mma_async\.\S+", ptx)) == {"wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16"}, k
        res = build.run_ptxas(ptx, "sm_90a")
        if res is None:
            continue
        rc, log, _ = res
        assert rc == 0, log[-300:]
        regs = int(re.search(r"Used (\d+) registers", log).group(1))
        assert regs <= 112, (k, regs)
        assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", log), (k, log[-300:])
    adv = build.ptxas_report(art)
    if adv is not None:
        assert not any(adv.values()), {k: v for k, v in adv.items() if v}
