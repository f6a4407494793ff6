"""Issue 13 point 4: warm start. ``mokgen.compile`` of a spec resolved before is answered from the warm-start index
(``mokgen.index``) without the plan solver (sympy), emit (jinja2) or the CuTe DSL (cutlass); the index never
serves an entry for other inputs (spec file, overrides, templates, mokgen sources, DSL install, tuning slot)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers11 import gcc_fake_libs, have_gcc, real_entry
from mokgen import cache, driver, index

REPO = Path(__file__).resolve().parents[1]
PRESET = "qwen3-30b-a3b"

_BLOCK_ALL = r'''
import sys, importlib.abc

BLOCKED = ("cutlass", "nvidia_cutlass_dsl", "sympy", "jinja2")

class Blocker(importlib.abc.MetaPathFinder):
    """Importing the CuTe DSL, sympy or jinja2 fails, whoever asks."""
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"blocked: {name}", name=name)
        return None

for n in BLOCKED:
    sys.modules.pop(n, None)
sys.modules["cutlass"] = None   # importlib.util.find_spec("cutlass") -> None: a host without the compiler
sys.meta_path.insert(0, Blocker())
'''


@pytest.fixture(autouse=True)
def _fresh_code_hash():
    index.code_hash.cache_clear()
    yield
    index.code_hash.cache_clear()


class StubMoE:
    """Stands in for ops.CompiledMoE (no library loading in this process)."""

    def __init__(self, spec: Any, plan: Any, entry_dir: Any, *, arch: Any = None, runtime_hint: Any = None, **kw: Any):
        self.spec, self.plan, self.entry_dir, self.arch, self.runtime_hint = spec, plan, Path(entry_dir), arch, runtime_hint


class FullWay(Exception):
    pass


@pytest.fixture
def stub(monkeypatch: pytest.MonkeyPatch, mokgen_cache: Path):
    from mokgen import ops

    monkeypatch.setattr(ops, "CompiledMoE", StubMoE)
    monkeypatch.setattr(driver, "_COMPILED", {})
    monkeypatch.delenv("MOKGEN_NO_WARM_START", raising=False)
    real_prepare = driver.prepare
    calls: list[Any] = []

    def prepare(*a: Any, **k: Any) -> Any:
        calls.append(a)
        if getattr(prepare, "forbid", False):
            raise FullWay("the full way was taken")
        return real_prepare(*a, **k)

    monkeypatch.setattr(driver, "prepare", prepare)

    def no_build(*a: Any, **k: Any) -> Any:
        raise AssertionError("these tests compile nothing")

    from mokgen import build

    monkeypatch.setattr(build, "build", no_build)
    return prepare, calls


def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(driver, "_COMPILED", {})


def test_compile_records_and_the_next_call_is_warm(stub: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prepare, calls = stub
    entry, sources = real_entry(tmp_path)
    calls.clear()
    moe = driver.compile(PRESET, arch="sm_90a")
    assert moe.entry_dir == entry and len(calls) == 1
    recs = list((cache.cache_root() / "index" / "sm_90a").glob("*.json"))
    assert len(recs) == 1
    rec = json.loads(recs[0].read_text())
    assert rec["entry"] == f"sm_90a/{entry.name}" and rec["key"] == cache.key_for(sources, "sm_90a")
    assert rec["exact"] is True
    assert rec["index_key"]["tuning"] == "none" and rec["index_key"]["spec"]["file"].endswith(f"{PRESET}.yaml")
    # a fresh process (no _COMPILED): answered from the index, the plan from meta.json equal to the solver's
    _fresh(monkeypatch)
    prepare.forbid = True
    warm = driver.compile(PRESET, arch="sm_90a")
    assert warm.entry_dir == entry and len(calls) == 1
    from mokgen.plan import Plan

    assert isinstance(warm.plan, Plan) and warm.plan == sources.plan and warm.spec == sources.spec
    assert driver.compile(PRESET, arch="sm_90a") is warm          # one object per entry per process
    with pytest.raises(FullWay):                                  # force: always the full way
        driver.compile(PRESET, arch="sm_90a", force=True)
    monkeypatch.setenv("MOKGEN_NO_WARM_START", "1")
    _fresh(monkeypatch)
    with pytest.raises(FullWay):
        driver.compile(PRESET, arch="sm_90a")
    # "k=v" and the equal mapping are one key; the CLI records what the API finds
    monkeypatch.delenv("MOKGEN_NO_WARM_START")
    prepare.forbid = False
    real_entry(tmp_path, overrides={"schedule": "fused"})
    from mokgen.cli import main

    assert main(["compile", PRESET, "--arch", "sm_90a", "--set", "schedule=fused", "-q"]) == 0
    _fresh(monkeypatch)
    prepare.forbid = True
    assert driver.compile(PRESET, arch="sm_90a", overrides="schedule=fused").plan.schedule == "fused"
    assert driver.compile(PRESET, arch="sm_90a", overrides={"schedule": "fused"}).plan.schedule == "fused"


def test_cli_answers_from_the_index_and_says_so(stub: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture) -> None:
    """`mokgen compile` looks up the record of its call (the one mokgen.compile's call has): the full way once,
    then `cached (warm-start index)`, a tuned plan still said to be one; --force and MOKGEN_NO_WARM_START=1 skip
    the lookup; the API finds the CLI's record."""
    from mokgen import cli, tunedb
    from mokgen.emit import template_hash
    from mokgen.spec import load_spec

    prepare, _calls = stub
    monkeypatch.setenv("MOKGEN_GPU_NAME", "FakeGPU")
    pw = {"spec_name": PRESET, "arch": "sm_90a", "source": "tune", "notes": [],
          "pieces": [{"lo": 1, "hi": 0, "overrides": {"gemm2_bn": 128}, "predicted_ms": 1.0, "at": 64,
                      "measured_ms": 1.1}]}
    tunedb.save(arch="sm_90a", gpu="FakeGPU", tools=tunedb.toolchain(), template_hash=template_hash(),
                spec=load_spec(PRESET), piecewise=pw)
    entry, sources = real_entry(tmp_path)   # the tuned plan's entry
    assert sources.plan.gemm2.bn == 128
    solved: list[Any] = []
    real_solve_tuned = cli._solve_tuned
    monkeypatch.setattr(cli, "_solve_tuned", lambda *a: solved.append(a) or real_solve_tuned(*a))
    argv = ["compile", PRESET, "--arch", "sm_90a", "-q"]
    assert cli.main(argv) == 0 and len(solved) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{PRESET} sm_90a: tuned plan from ") and out[1].endswith("kernel(s), cached")
    assert cli.main(argv) == 0 and len(solved) == 1                      # no plan solved: the index answered
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{PRESET} sm_90a: tuned plan, tuned: record ")
    assert out[1].endswith("kernel(s), cached (warm-start index)") and out[2] == f"entry: {entry}"
    with pytest.raises(AssertionError, match="compile nothing"):        # --force: the full way, a rebuild
        cli.main(argv + ["--force"])
    capsys.readouterr()
    monkeypatch.setenv("MOKGEN_NO_WARM_START", "1")
    n = len(solved)
    assert cli.main(argv) == 0 and len(solved) == n + 1
    assert capsys.readouterr().out.splitlines()[1].endswith("kernel(s), cached")
    monkeypatch.delenv("MOKGEN_NO_WARM_START")
    _fresh(monkeypatch)
    prepare.forbid = True
    assert driver.compile(PRESET, arch="sm_90a").entry_dir == entry      # the CLI's record, for the API


def test_index_never_serves_other_inputs(stub: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every input of the full resolution that can change without the call changing is in the key."""
    prepare, calls = stub
    entry, _ = real_entry(tmp_path)
    yml = tmp_path / "my-layer.yaml"
    shutil.copy(REPO / "mokgen" / "presets" / f"{PRESET}.yaml", yml)
    real_entry(tmp_path, preset=str(yml))
    for spec in (PRESET, str(yml)):
        driver.compile(spec, arch="sm_90a")

    def full_way(spec: Any = PRESET, **kw: Any) -> bool:
        _fresh(monkeypatch)
        prepare.forbid = True
        try:
            driver.compile(spec, arch="sm_90a", **kw)
            return False
        except FullWay:
            return True
        finally:
            prepare.forbid = False

    assert not full_way() and not full_way(str(yml))
    # the spec file's bytes
    yml.write_text(yml.read_text().replace("tokens: 4096", "tokens: 2048"))
    assert full_way(str(yml))
    # overrides
    assert full_way(overrides={"schedule": "fused"}) and full_way(overrides="consumer=cooperative")
    # the DSL install (a new nvidia-cutlass-dsl version on sys.path)
    site = tmp_path / "site"
    (site / "nvidia_cutlass_dsl-99.0.dist-info").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(site))
    assert full_way()
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(site)])
    assert not full_way()
    # a template, and mokgen's own sources (a copy of the package, then one byte changed in each)
    pkg = tmp_path / "pkg"
    shutil.copytree(REPO / "mokgen", pkg / "mokgen", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(index.template_dir(), pkg / "templates")
    monkeypatch.setattr(index, "_PKG", pkg / "mokgen")
    index.code_hash.cache_clear()
    assert index.template_dir() == pkg / "templates" and not full_way()   # the same bytes: the same key
    for f in (pkg / "templates" / "sm90" / "routing.py.j2", pkg / "mokgen" / "plan.py"):
        f.write_text(f.read_text() + "\n# changed\n")
        index.code_hash.cache_clear()
        assert full_way(), f


def test_index_key_fields_and_tuning_slot(mokgen_cache: Path) -> None:
    from mokgen.emit import TEMPLATE_DIR
    from mokgen.spec import load_spec

    assert index.template_dir() == TEMPLATE_DIR
    k = index.index_key(PRESET, "sm_90a")
    assert set(k) == {"format", "code", "spec", "overrides", "arch", "dsl", "tuning"} and k["tuning"] == "none"
    assert index.index_key(PRESET, "sm_90a", tuning="rec-1") != k
    # a tuning record appearing (mokgen tune, cache unpack) re-keys the arch's warm entries: the full way picks it
    from mokgen.tunedb import tuning_dir

    tuning_dir("sm_90a").mkdir(parents=True, exist_ok=True)
    (tuning_dir("sm_90a") / "0123456789abcdef.json").write_text("{}")
    k2 = index.index_key(PRESET, "sm_90a")
    assert k2["tuning"] not in ("none", None) and k2 != k
    (tuning_dir("sm_90a") / "0123456789abcdef.json").unlink()
    assert index.index_key(PRESET, "sm_90a") != k2
    assert index.index_key(PRESET, "sm_100a") != k
    assert index.index_key(PRESET, "sm_90a", "schedule=fused") == index.index_key(PRESET, "sm_90a",
                                                                                  {"schedule": "fused"})
    spec = load_spec(PRESET)
    assert index.index_key(spec, "sm_90a")["spec"] == {"spec": spec.to_dict()}
    assert index.index_key(spec.to_dict(), "sm_90a")["spec"] == {"mapping": json.loads(cache.canonical_json(spec))}
    assert index.index_key("no-such-preset", "sm_90a") is None            # the full way says what is wrong
    assert index.index_key(PRESET, "sm_90a", "nonsense") is None
    names = cache.dsl_versions()
    fp = " ".join(index.dsl_fingerprint()).lower().replace("_", "-")
    for dist, version in names.items():
        assert f"{dist}-{version}" in fp, (dist, version, fp)


def test_a_stale_record_is_a_miss(stub: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prepare, _ = stub
    entry, sources = real_entry(tmp_path)
    driver.compile(PRESET, arch="sm_90a")
    key_doc = index.index_key(PRESET, "sm_90a")
    path = index.index_path(key_doc)
    good = path.read_text()

    def warm() -> Any:
        _fresh(monkeypatch)
        return driver._warm(key_doc, "sm_90a")

    assert warm() is not None
    # a record for other inputs at this path (a hash-prefix collision, a hand edit): never used
    rec = json.loads(good)
    rec["index_key"]["overrides"] = {"schedule": "fused"}
    path.write_text(json.dumps(rec))
    assert warm() is None
    # a record naming another key than the entry there now has
    rec = json.loads(good)
    rec["key"] = entry.name + "0" * 48
    path.write_text(json.dumps(rec))
    assert warm() is None
    # where the compiler is, only the exact key's entry (an entry found by content elsewhere is not taken)
    rec = json.loads(good)
    rec["exact"] = False
    path.write_text(json.dumps(rec))
    monkeypatch.setattr(driver, "_dsl_available", lambda: True)
    assert warm() is None
    # the entry is gone / damaged: a miss where the compiler is (the full way rebuilds it)
    path.write_text(good)
    b = bytearray((entry / "libmokgen.so").read_bytes())
    b[0] ^= 1
    (entry / "libmokgen.so").write_bytes(bytes(b))
    assert warm() is None
    # ... and, without the compiler, the full way's DamagedEntryError (no sympy needed to say so)
    monkeypatch.setattr(driver, "_dsl_available", lambda: False)
    with pytest.raises(cache.DamagedEntryError, match="does not match its sha256"):
        warm()
    # garbage
    path.write_text("{not json")
    assert warm() is None
    # cache clear removes the index with the entries
    cache.clear_report()
    assert not (cache.cache_root() / "index").exists()


def test_record_keeps_the_runtime_hint_and_ignores_build_dirs(mokgen_cache: Path, tmp_path: Path) -> None:
    entry, sources = real_entry(tmp_path)
    art = cache.load_artifacts(entry)
    k = index.index_key(PRESET, "sm_90a")
    hint = {"path": "/x/libcute_dsl_runtime.so", "size": 1, "mtime_ns": 2}
    p = index.remember(k, art, exact=True, runtime=hint)
    assert p is not None and json.loads(p.read_text())["runtime"] == hint
    index.remember(k, art, exact=True, runtime=None)               # e.g. `mokgen compile` (no library loaded)
    assert json.loads(p.read_text())["runtime"] == hint
    other = cache.Artifacts(dir=tmp_path, lib=tmp_path / "libmokgen.so", kernels=(), arch="sm_90a", key=art.key,
                            meta={})
    assert index.remember(k, other, exact=True) is None          # not a cache entry directory


def test_runtime_hint_skips_importing_the_dsl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mokgen import ops

    monkeypatch.delenv("MOKGEN_RUNTIME_LIB", raising=False)
    lib = tmp_path / "libcute_dsl_runtime.so"
    lib.write_bytes(b"\x7fELF")
    hint = ops._file_id(str(lib))
    real_find_spec = ops.importlib.util.find_spec
    monkeypatch.setattr(ops.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "cutlass" else real_find_spec(name, *a))
    monkeypatch.setitem(sys.modules, "cutlass", None)                  # importing the DSL would fail
    monkeypatch.setitem(sys.modules, "cutlass.cute.runtime", None)
    monkeypatch.setattr(ops, "_DSL_RUNTIME", [])
    assert ops.find_runtime_library(None, dsl_hint=hint) == str(lib)
    assert ops.dsl_runtime_hint() == hint
    lib.write_bytes(b"\x7fELF changed")                              # another file now: the hint is not used
    with pytest.raises(ops.LoadError, match="failed to import"):
        ops.find_runtime_library(None, dsl_hint=hint)


def test_runtime_hint_without_the_dsl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The record's runtime library is used while it is the same file, whether or not the DSL imports (or is
    found at all: importlib.util.find_spec raising is "not installed", as for mokgen.cache)."""
    from mokgen import ops

    monkeypatch.delenv("MOKGEN_RUNTIME_LIB", raising=False)
    lib = tmp_path / "libcute_dsl_runtime.so"
    lib.write_bytes(b"\x7fELF")
    hint = ops._file_id(str(lib))
    real_find_spec = ops.importlib.util.find_spec

    def find_spec(name: str, *a: Any) -> Any:
        if name.split(".")[0] == "cutlass":
            raise ImportError("blocked", name=name)
        return real_find_spec(name, *a)

    monkeypatch.setattr(ops.importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(ops, "_DSL_RUNTIME", [])
    assert ops.find_runtime_library(None, dsl_hint=hint) == str(lib) and ops.dsl_runtime_hint() == hint
    lib.write_bytes(b"\x7fELF changed")
    with pytest.raises(ops.LoadError, match="the CuTe DSL is not installed"):
        ops.find_runtime_library(None, dsl_hint=hint)


def test_without_the_compiler_a_record_naming_the_dsl_runtime(stub: Any, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the DSL cannot be imported, a record written where it could (exact) that names its runtime library,
    unchanged since, is used without a packed runtime; any other record needs the full way's runtime check."""
    from mokgen import ops

    entry, _sources = real_entry(tmp_path)
    key_doc = index.index_key(PRESET, "sm_90a")
    art = cache.load_artifacts(entry)
    lib = tmp_path / "libcute_dsl_runtime.so"
    lib.write_bytes(b"\x7fELF runtime")
    hint = ops._file_id(str(lib))
    index.remember(key_doc, art, exact=True, runtime=hint)
    monkeypatch.setattr(driver, "_dsl_available", lambda: False)
    monkeypatch.delenv("MOKGEN_RUNTIME_LIB", raising=False)
    hit = driver.warm_entry(key_doc, "sm_90a")
    assert hit is not None and hit.art.dir == entry and hit.rec["runtime"] == hint
    _fresh(monkeypatch)
    assert driver._warm(key_doc, "sm_90a").runtime_hint == hint
    index.remember(key_doc, art, exact=False, runtime=hint)        # found by content: maybe another DSL's entry
    assert driver.warm_entry(key_doc, "sm_90a") is None           # no packed runtime here: the full way says so
    index.remember(key_doc, art, exact=True, runtime=hint)
    lib.write_bytes(b"\x7fELF runtime, reinstalled")
    assert driver.warm_entry(key_doc, "sm_90a") is None


def test_an_arch_that_does_not_resolve_is_not_replaced(mokgen_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """compile(spec, arch="sm_91") is an error, also where $MOKGEN_ARCH names an arch (it used to be replaced)."""
    from mokgen.arch import ArchError

    monkeypatch.setenv("MOKGEN_ARCH", "sm_90a")

    def no_resolve(*a: Any, **k: Any) -> Any:
        raise AssertionError("resolved for another arch")

    monkeypatch.setattr(driver, "resolve", no_resolve)
    with pytest.raises(ArchError, match="sm_91"):
        driver.compile(PRESET, arch="sm_91")
    assert driver.call_key(PRESET, "sm_91") == (None, None)
    arch, key = driver.call_key(PRESET)
    assert arch == "sm_90a" and key == index.index_key(PRESET, "sm_90a")


def test_light_imports() -> None:
    code = ("import sys, torch\n"
            "import mokgen.ops, mokgen.plan, mokgen.spec, mokgen.driver, mokgen.index\n"
            "bad = [m for m in ('sympy', 'jinja2', 'yaml', 'torch._dynamo', 'cutlass') if m in sys.modules]\n"
            "assert not bad, bad\n"
            "import mokgen.plan as p\n"
            "assert p.Plan.from_dict and 'sympy' not in sys.modules\n"
            "s = mokgen.spec.load_spec('qwen3-30b-a3b')\n"
            "plan = p.solve(s, 'sm_90a')\n"
            "assert p.Plan.from_dict(plan.to_dict()) == plan and 'sympy' in sys.modules\n"
            "assert str(p.STAGES_FIT).startswith('(-barrier_bytes')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.skipif(not have_gcc(), reason="needs gcc to build a stand-in library")
def test_warm_start_without_cutlass_sympy_jinja2(mokgen_cache: Path, tmp_path: Path) -> None:
    """The issue's check: a cached spec loads through mokgen.compile in a process where importing cutlass, sympy
    and jinja2 fails (a host with the compiler recorded it; here it is as good as absent)."""
    lib, rt = gcc_fake_libs(tmp_path / "libs")
    entry, sources = real_entry(tmp_path, lib=lib)
    cache.install_runtime(rt, cache.dsl_versions(), origin="test")
    env = dict(os.environ, PYTHONPATH=str(REPO), MOKGEN_CACHE_DIR=str(mokgen_cache))
    env.pop("MOKGEN_NO_WARM_START", None)
    env.pop("MOKGEN_RUNTIME_LIB", None)
    compile_it = f'''
import json, sys, mokgen
moe = mokgen.compile({PRESET!r}, arch="sm_90a")
print(json.dumps({{"entry": str(moe.entry_dir), "plan": moe.plan.to_dict(), "plan_type": type(moe.plan).__name__,
                  "kernels": sorted(moe._fns), "trainable": moe.trainable,
                  "modules": sorted(m for m in ("cutlass", "sympy", "jinja2", "yaml", "torch._dynamo", "mokgen.emit",
                                                "mokgen.build") if sys.modules.get(m) is not None)}}))
'''
    # the first call, on this host (compiler and all): the full way, which records it (the runtime stand-in
    # by MOKGEN_RUNTIME_LIB: the real DSL runtime is not needed for that)
    r = subprocess.run([sys.executable, "-c", compile_it], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                       env=dict(env, MOKGEN_RUNTIME_LIB=str(rt)))
    assert r.returncode == 0, r.stderr[-3000:]
    first = json.loads(r.stdout.strip().splitlines()[-1])
    assert {"sympy", "jinja2"} <= set(first["modules"])
    # then without cutlass, sympy and jinja2
    r = subprocess.run([sys.executable, "-c", _BLOCK_ALL + compile_it], capture_output=True, text=True, cwd=tmp_path,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["entry"] == str(entry) and got["plan_type"] == "Plan" and got["trainable"]
    assert got["plan"] == json.loads(cache.canonical_json(sources.plan))
    assert got["modules"] == [], got["modules"]
    # the same setting, the entry damaged: refused, with the full way's message
    b = bytearray((entry / "libmokgen.so").read_bytes())
    b[100] ^= 1
    (entry / "libmokgen.so").write_bytes(bytes(b))
    r = subprocess.run([sys.executable, "-c", _BLOCK_ALL + compile_it], capture_output=True, text=True, cwd=tmp_path,
                       timeout=300, env=env)
    assert r.returncode != 0 and "DamagedEntryError" in r.stderr and "does not match its sha256" in r.stderr


def test_ops_are_registered_on_first_use() -> None:
    """torch.ops.mokgen.* are registered on first use, not at import (~10 ms of a warm start); a first use under
    torch.compile tracing registers them behind a graph break."""
    code = r'''
import torch
from mokgen import ops, reference as ref
from mokgen.reference import LayerConfig
assert not ops._OPS_READY and not hasattr(torch.ops.mokgen, "moe_forward")
cfg = LayerConfig(hidden=32, ffn=16, experts=6, ep=1, topk=3, tokens=8, shared_experts=1, activation="swiglu",
                  swiglu_limit=None, gate_up_layout="concat", bias=False)
moe = ops.CompiledMoE(cfg, 16, functions=ref.reference_kernels(cfg, 16, training=True), allow_cpu=True)
assert not ops._OPS_READY
x, idx, w, w1, w2, b1, b2 = ref.random_inputs(cfg, tokens=8)
f = lambda x, idx, w, w1, w2: ops.moe_forward(x, idx, w, w1, w2, moe=moe) * 2
y = torch.compile(f, backend="aot_eager")(x, idx, w, w1, w2)
assert ops._OPS_READY and torch.equal(y, f(x, idx, w, w1, w2))
assert torch.ops.mokgen.moe_forward(x, idx, w, w1, w2, None, None, moe.registry_id).shape == (8, 32)
print("ok")
'''
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------------------
# issue 21 item 3: one record serves `mokgen compile` and mokgen.compile(), both ways

# sitecustomize.py for a process in which importing the CuTe DSL fails. "absent": a meta-path finder raises
# ImportError for it (importlib.util.find_spec too: a host without the compiler, as far as mokgen can tell);
# "broken": it is found, but importing it raises (the DSL installed, and nothing may import it). Both count the
# attempts to import it (not importlib.util.find_spec's questions) in sys.cutlass_attempts. TEST_BLOCK_MORE: more
# top-level modules, blocked the "absent" way.
_SITECUSTOMIZE = r'''
import importlib.abc, importlib.machinery, os, sys

MODE = os.environ["TEST_BLOCK_CUTLASS"]
DSL = ("cutlass", "nvidia_cutlass_dsl")
MORE = tuple(m for m in os.environ.get("TEST_BLOCK_MORE", "").split(",") if m)
sys.cutlass_attempts = []


class BrokenLoader(importlib.abc.Loader):
    def create_module(self, spec):
        sys.cutlass_attempts.append(spec.name)
        raise ImportError(f"blocked: import {spec.name}", name=spec.name)

    def exec_module(self, module):
        raise ImportError("blocked")


def _probing():
    """Whether importlib.util.find_spec asks (whether it is installed), rather than an import statement."""
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_name.startswith("_find_and_load"):
            return False
        if f.f_code.co_name == "find_spec" and f.f_code.co_filename.replace(os.sep, "/").endswith(
                ("importlib.util>", "importlib/util.py")):
            return True
        f = f.f_back
    return False


class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in DSL and MODE == "broken":
            return importlib.machinery.ModuleSpec(name, BrokenLoader(), is_package=True)
        if top in DSL or top in MORE:
            if top in DSL and not _probing():
                sys.cutlass_attempts.append(name)
            raise ImportError(f"blocked: {name}", name=name)
        return None


sys.meta_path.insert(0, Blocker())
'''

_API_CALL = f'''
import json, sys, mokgen
from mokgen import ops
moe = mokgen.compile({PRESET!r}, arch="sm_90a")
print(json.dumps({{"entry": str(moe.entry_dir), "plan_type": type(moe.plan).__name__, "plan": moe.plan.to_dict(),
                  "kernels": sorted(moe._fns), "runtime": sorted(ops._RUNTIME_HANDLES),
                  "attempts": sys.cutlass_attempts,
                  "modules": sorted(m for m in ("cutlass", "sympy", "jinja2", "yaml", "mokgen.emit", "mokgen.build")
                                    if sys.modules.get(m) is not None)}}))
'''

_CLI_CALL = f'''
import json, sys
from mokgen.cli import main
rc = main(["compile", {PRESET!r}, "--arch", "sm_90a", "-q"])
print(json.dumps({{"rc": rc, "attempts": getattr(sys, "cutlass_attempts", None),
                  "modules": sorted(m for m in ("cutlass", "sympy", "jinja2", "yaml", "torch", "mokgen.emit")
                                    if sys.modules.get(m) is not None)}}))
'''


def _env(cache_root: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), MOKGEN_CACHE_DIR=str(cache_root))
    for k in ("MOKGEN_NO_WARM_START", "MOKGEN_RUNTIME_LIB", "MOKGEN_ARCH"):
        env.pop(k, None)
    return dict(env, **extra)


def _blocked_env(cache_root: Path, tmp_path: Path, mode: str, more: str = "") -> dict[str, str]:
    site = tmp_path / f"block-{mode}"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    env = _env(cache_root, TEST_BLOCK_CUTLASS=mode, TEST_BLOCK_MORE=more)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO)])
    return env


def _py(code: str, env: dict[str, str], cwd: Path) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _records() -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((cache.cache_root() / "index" / "sm_90a").glob("*.json"))]


def _assert_warm_load(got: dict[str, Any], entry: Path, rec: dict[str, Any]) -> None:
    """An API call in a process where the DSL cannot be imported, answered from the record: the entry's kernels
    loaded, with the runtime library the record names, and nothing of the compiler imported or asked for."""
    meta = json.loads((entry / "meta.json").read_text())
    assert got["entry"] == str(entry) and got["plan_type"] == "Plan" and got["plan"] == meta["plan"]
    assert got["kernels"] == sorted(meta["kernels"])
    assert got["runtime"] == [rec["runtime"]["path"]]
    assert got["attempts"] == [] and got["modules"] == [], (got["attempts"], got["modules"])


@pytest.mark.skipif(not have_gcc(), reason="needs gcc to build a stand-in library")
@pytest.mark.parametrize("mode", ["absent", "broken"])
def test_cli_record_serves_the_api_without_cutlass(mokgen_cache: Path, tmp_path: Path, mode: str) -> None:
    """`mokgen compile SPEC` writes the record the next process's mokgen.compile(SPEC) finds, complete: that
    call imports neither cutlass nor the compiler (here importing cutlass fails), and loads the kernels."""
    lib, _rt = gcc_fake_libs(tmp_path / "libs")
    entry, _sources = real_entry(tmp_path, lib=lib)   # what `mokgen compile` builds (objects faked): the CLI finds it
    r = subprocess.run([sys.executable, "-m", "mokgen", "compile", PRESET, "--arch", "sm_90a", "-q"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=600, env=_env(mokgen_cache))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines()[0].endswith("kernel(s), cached") and f"entry: {entry}" in r.stdout
    (rec,) = _records()
    assert rec["entry"] == f"sm_90a/{entry.name}" and rec["exact"] is True
    assert Path(rec["runtime"]["path"]).name == "libcute_dsl_runtime.so"   # the CuTe DSL's, named without loading it
    got = _py(_API_CALL, _blocked_env(mokgen_cache, tmp_path, mode), tmp_path)
    _assert_warm_load(got, entry, rec)
    assert _records() == [rec]   # the same record served it (and was not rewritten)


@pytest.mark.skipif(not have_gcc(), reason="needs gcc to build a stand-in library")
def test_api_record_serves_the_cli(mokgen_cache: Path, tmp_path: Path) -> None:
    """The other way: after mokgen.compile(SPEC), `mokgen compile SPEC` answers `cached` from the same record
    without the plan solver, emit, torch or the CuTe DSL (all blocked here); with MOKGEN_NO_WARM_START=1 it takes
    the full way to the same entry."""
    lib, _rt = gcc_fake_libs(tmp_path / "libs")
    entry, _sources = real_entry(tmp_path, lib=lib)
    first = _py(_API_CALL.replace("sys.cutlass_attempts", "[]"), _env(mokgen_cache), tmp_path)
    assert first["entry"] == str(entry) and "sympy" in first["modules"]   # the full way
    (rec,) = _records()
    assert rec["exact"] is True and rec["runtime"]["path"] == first["runtime"][0]
    env = _blocked_env(mokgen_cache, tmp_path, "absent", more="sympy,jinja2,torch,yaml")
    r = subprocess.run([sys.executable, "-c", _CLI_CALL], capture_output=True, text=True, cwd=tmp_path, timeout=600,
                       env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.splitlines()
    got = json.loads(out[-1])
    assert got == {"rc": 0, "attempts": [], "modules": []}, got
    n = len(json.loads((entry / "meta.json").read_text())["kernels"])
    assert out[0] == f"{PRESET} sm_90a: {n} kernel(s), cached (warm-start index)"
    assert out[1] == f"entry: {entry}"
    assert _records() == [rec]
    r = subprocess.run([sys.executable, "-m", "mokgen", "compile", PRESET, "--arch", "sm_90a", "-q"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=600,
                       env=_env(mokgen_cache, MOKGEN_NO_WARM_START="1"))
    assert r.returncode == 0 and r.stdout.splitlines()[0].endswith("kernel(s), cached"), r.stderr[-3000:]
    assert f"entry: {entry}" in r.stdout and _records() == [rec]


@pytest.mark.slow
def test_cli_compile_for_real_then_the_api_without_cutlass(mokgen_cache: Path, tmp_path: Path) -> None:
    """The issue's scenario end to end: a real `mokgen compile SPEC --arch sm_90a` (CuTe DSL build) in a fresh
    cache, then mokgen.compile(SPEC, arch="sm_90a") in a process where importing cutlass fails: the built
    library and the DSL's runtime loaded from the CLI's record; the CLI again: `cached` from the same record."""
    cli = [sys.executable, "-m", "mokgen", "compile", PRESET, "--arch", "sm_90a", "-q"]
    r = subprocess.run(cli, capture_output=True, text=True, cwd=tmp_path, timeout=1800, env=_env(mokgen_cache))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "built" in r.stdout.splitlines()[0]
    (rec,) = _records()
    entry = cache.cache_root() / rec["entry"]
    got = _py(_API_CALL, _blocked_env(mokgen_cache, tmp_path, "absent"), tmp_path)
    _assert_warm_load(got, entry, rec)
    r = subprocess.run(cli, capture_output=True, text=True, cwd=tmp_path, timeout=600, env=_env(mokgen_cache))
    assert r.returncode == 0 and r.stdout.splitlines()[0].endswith("cached (warm-start index)"), r.stderr[-3000:]
    assert _records() == [rec]
