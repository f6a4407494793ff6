"""templates/sm90/wgrad.py.j2 (the varlen-K weight-gradient grouped GEMM): render it with several parameter
sets, check the rendered modules, and (slow) compile them for sm_90a and check their PTX.

The rendering and compiling go through tools/wgrad_check.py, so the test and the tool cannot drift apart."""
from __future__ import annotations

import ast
import re
import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _tool():
    name = "mokgen_tools_wgrad_check"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / "wgrad_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


# label -> render parameters (the model shapes of the brief, plus edge cases: partial M / N tiles, BN 64 / 128)
CASES = {
    "kimi-dw1": dict(m_out=4096, n_out=7168, groups=7, bn=256),
    "kimi-dw2": dict(m_out=7168, n_out=2048, groups=7, bn=256),
    "gpt-oss-dw1": dict(m_out=5760, n_out=2880, groups=128, bn=192),
    "gpt-oss-dw2-acc": dict(m_out=2880, n_out=2880, groups=128, bn=192, accumulate=True),
    "qwen3-30b-dw1": dict(m_out=1536, n_out=2048, groups=128, bn=256),
    "kimi-dw1-acc": dict(m_out=4096, n_out=7168, groups=7, bn=256, accumulate=True),
    "edges-bn128": dict(m_out=1000, n_out=520, groups=5, bn=128),
    "edges-bn64-acc": dict(m_out=1000, n_out=520, groups=3, bn=64, accumulate=True, group_m=64),
}


def _params(label: str) -> dict:
    return _tool().full_params(**CASES[label])


@pytest.mark.parametrize("label", sorted(CASES))
def test_render(label: str) -> None:
    tool = _tool()
    p = _params(label)
    text = tool.render(p, name="wgrad")
    tree = ast.parse(text)  # valid Python
    names = {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)}
    assert {"KERNEL_NAME", "M_OUT", "N_OUT", "GROUPS", "STAGES", "TOTAL_TILES"} <= names
    funcs = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert {"kernel", "launch", "compile", "tile_coords"} <= funcs
    assert f"M_OUT = {p['m_out']} " in text and f"N_OUT = {p['n_out']} " in text
    assert f"STAGES = {p['stages']}\n" in text and f"ACCUMULATE = {p['accumulate']} " in text
    assert 'KERNEL_NAME = "wgrad"' in text
    assert "OperandMajorMode.MN" in text and "LayoutEnum.COL_MAJOR" in text
    if p["accumulate"]:
        assert "CopyBulkTensorTileS2GOp" not in text and "cutlass.Float32, (GROUPS, M_OUT, N_OUT)" in text
    else:
        assert "CopyBulkTensorTileS2GOp" in text and "cutlass.BFloat16, (GROUPS, M_OUT, N_OUT)" in text
    # deterministic rendering
    assert tool.render(p, name="wgrad") == text


def test_stage_budget() -> None:
    tool = _tool()
    for label in CASES:
        p = _params(label)
        assert p["stages"] >= 2
        assert p["smem"] <= tool.SMEM_PER_CTA
        # one more stage would not fit
        assert p["smem"] + tool.stage_bytes(p) > tool.SMEM_PER_CTA
    assert _params("kimi-dw1")["stages"] == 4           # (128 + 256) * 64 * 2 = 48 KiB a stage, 16 KiB epilogue
    assert _params("gpt-oss-dw1")["stages"] == 5        # 40 KiB a stage
    assert _params("gpt-oss-dw2-acc")["stages"] == 5    # no smem epilogue in the fp32 accumulate mode


def test_tile_order_matches_reference() -> None:
    """tile_coords (run here as plain Python on ints) visits every (group, m, n) once, group-major, panels of
    RASTER M tiles with M fastest."""
    tool = _tool()
    p = tool.full_params(m_out=1000, n_out=520, groups=3, bn=128, raster=3)
    ns: dict = {}
    src = tool.render(p, name="wgrad")
    tree = ast.parse(src)
    consts = [n for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)
              and n.targets[0].id.isupper() and n.targets[0].id not in ("KERNEL_NAME", "ELEM")]
    exec(compile(ast.Module(body=consts, type_ignores=[]), "consts", "exec"), ns)
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in ("raster", "tile_coords")]
    assert len(fns) == 2  # tile_coords composes the block library's raster
    for fn in fns:
        fn.decorator_list = []
        for a in fn.args.args:
            a.annotation = None
    ns["cutlass"] = type("C", (), {"min": staticmethod(min)})
    exec(compile(ast.Module(body=fns, type_ignores=[]), "tile_coords", "exec"), ns)
    seen = [ns["tile_coords"](t) for t in range(ns["TOTAL_TILES"])]
    assert len(set(seen)) == ns["TOTAL_TILES"] == 3 * 8 * 5
    assert all(0 <= m < 8 and 0 <= n < 5 for _, m, n in seen)
    assert [g for g, _, _ in seen] == sorted(g for g, _, _ in seen)
    assert seen[:4] == [(0, 0, 0), (0, 1, 0), (0, 2, 0), (0, 0, 1)]
    assert seen[15:18] == [(0, 3, 0), (0, 4, 0), (0, 5, 0)]  # second panel
    assert seen[30:33] == [(0, 6, 0), (0, 7, 0), (0, 6, 1)]  # last panel: 2 M tiles


def _have_dsl() -> bool:
    return importlib.util.find_spec("cutlass") is not None


@pytest.mark.slow
@pytest.mark.skipif(not _have_dsl(), reason="the CuTe DSL (nvidia-cutlass-dsl) is not installed")
@pytest.mark.parametrize("label", ["kimi-dw1", "gpt-oss-dw1", "gpt-oss-dw2-acc", "kimi-dw1-acc", "edges-bn64-acc"])
def test_compile_sm90a(label: str, tmp_path: Path) -> None:
    tool = _tool()
    res = tool.check_one(label, _params(label), tmp_path, "sm_90a", ptxas=False)
    assert "error" not in res, res.get("error")
    ptx = Path(res["ptx"]).read_text()
    assert "wgmma.mma_async" in ptx
    assert "cp.async.bulk.tensor" in ptx
    assert "mbarrier" in ptx
    assert ".target sm_90a" in ptx and "setmaxnreg" in ptx
    # both operands MN-major: the wgmma's transpose immediates are set
    assert re.search(r"wgmma\.mma_async[^;]*,\s*p,\s*1,\s*1,\s*1,\s*1;", ptx)
    if CASES[label].get("accumulate"):
        assert "stmatrix" not in ptx and "ld.global.v2" in ptx and "st.global.v2" in ptx
    else:
        assert "stmatrix" in ptx and "cp.async.bulk.tensor.3d.global.shared" in ptx
    assert res["ok"]
    if res.get("cubin"):
        assert res["cubin"].get("frame", 0) == 0  # no local memory (spills)
