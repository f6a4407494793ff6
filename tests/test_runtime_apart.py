"""Issue 11, points 5 and 7: the runtime apart from the compiler; the CLI without the compiler finds entries as
the API does (or says what is missing); one arch table, one override parser, no build <-> cache cycle."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers11 import gcc_fake_libs, have_gcc, real_entry
from mokgen import cache

REPO = Path(__file__).resolve().parents[1]


def _no_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as a GPU host without the CuTe DSL: no cutlass, no DSL versions (tvm-ffi stays)."""
    from mokgen import driver

    real = cache.dsl_versions()
    monkeypatch.setattr(driver, "_dsl_available", lambda: False)
    monkeypatch.setattr(cache, "_compiler_available", lambda: False)
    monkeypatch.setattr(cache, "dsl_versions", lambda: {k: v for k, v in real.items() if k == "apache-tvm-ffi"})
    monkeypatch.delenv("MOKGEN_RUNTIME_LIB", raising=False)


def _install_fake_runtime(tmp_path: Path) -> Path:
    src = tmp_path / "rt.so"
    src.write_bytes(b"\x7fELF runtime stand-in")
    return cache.install_runtime(src, cache.dsl_versions(), origin="test")


# ------------------------------------------------------------------------------------------- point 5


def test_cli_without_compiler_finds_what_the_api_finds(mokgen_cache: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    from mokgen import driver
    from mokgen.cli import main

    entry, sources = real_entry(tmp_path)  # compiled "elsewhere": with this host's DSL versions
    _install_fake_runtime(tmp_path)
    _no_compiler(monkeypatch)
    # the exact key now differs (no DSL versions here): found by content, by the API and by the CLI alike
    assert cache.key_for(sources, "sm_90a")[:16] != entry.name
    art = driver.resolve(sources, "sm_90a")
    assert art.dir == entry and "found by content" in art.note
    assert main(["compile", "qwen3-30b-a3b", "--arch", "sm_90a"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"qwen3-30b-a3b sm_90a: {len(sources.kernels)} kernel(s), cached (built on another host: "
                             "found by content)")
    assert out[1] == f"entry: {entry}"


def test_cli_without_compiler_says_what_is_missing(mokgen_cache: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture) -> None:
    from mokgen.cli import main

    with monkeypatch.context() as m:
        _no_compiler(m)
        assert main(["compile", "qwen3-30b-a3b", "--arch", "sm_90a"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert err.startswith(f"mokgen: error: no cached kernels for 'qwen3-30b-a3b' on sm_90a in {mokgen_cache.resolve()} "
                          "(key ")
    assert "content key" in err and "CuTe DSL compiler, which is not installed" in err and "cache unpack" in err
    # an entry of the same spec from another plan: the message says so
    real_entry(tmp_path, overrides={"schedule": "fused"})
    _no_compiler(monkeypatch)
    assert main(["compile", "qwen3-30b-a3b", "--arch", "sm_90a"]) == 2
    assert "built from other inputs (another plan" in capsys.readouterr().err
    assert main(["compile", "qwen3-30b-a3b", "--arch", "sm_90a", "--force"]) == 2
    assert "(force) needs the CuTe DSL compiler" in capsys.readouterr().err


def test_without_compiler_the_runtime_library_is_checked(mokgen_cache: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture) -> None:
    from mokgen.cli import main

    real_entry(tmp_path)
    rt = _install_fake_runtime(tmp_path)
    _no_compiler(monkeypatch)
    rt.parent.rename(tmp_path / "runtime-aside")
    assert main(["compile", "qwen3-30b-a3b", "--arch", "sm_90a"]) == 2
    assert "no libcute_dsl_runtime.so to load" in capsys.readouterr().err
    (tmp_path / "runtime-aside").rename(rt.parent)
    assert main(["compile", "qwen3-30b-a3b", "--arch", "sm_90a"]) == 0
    capsys.readouterr()
    rt.write_bytes(b"\x7fELF runtime stand-iN")  # same size, other bytes
    assert main(["compile", "qwen3-30b-a3b", "--arch", "sm_90a"]) == 2
    assert "runtime library will not be loaded" in capsys.readouterr().err
    meta = json.loads((rt.parent / "meta.json").read_text())
    rt.write_bytes(b"\x7fELF runtime stand-in")
    meta["dsl_versions"] = {"nvidia-cutlass-dsl": "0.0.1"}
    (rt.parent / "meta.json").write_text(json.dumps(meta))
    assert main(["compile", "qwen3-30b-a3b", "--arch", "sm_90a"]) == 2
    assert "but the runtime library in" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- point 7


_BLOCKER = r'''
import sys, importlib.abc

class Blocker(importlib.abc.MetaPathFinder):
    """cutlass / the DSL: not installed. sympy: mokgen must not import it (torch may: it depends on it)."""
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in ("cutlass", "nvidia_cutlass_dsl"):
            raise ModuleNotFoundError(f"blocked: {name}", name=name)
        if top == "sympy":
            f = sys._getframe(1)
            while f is not None and f.f_globals.get("__name__", "").startswith(("importlib", "_frozen_importlib")):
                f = f.f_back
            who = f.f_globals.get("__name__", "") if f is not None else ""
            if who.startswith("mokgen"):
                raise ModuleNotFoundError(f"blocked: {who} imports {name}", name=name)
        return None

for n in ("cutlass", "nvidia_cutlass_dsl"):
    sys.modules[n] = None  # importlib.util.find_spec -> None, import -> ModuleNotFoundError
sys.meta_path.insert(0, Blocker())
'''


@pytest.mark.skipif(not have_gcc(), reason="needs gcc to build a stand-in library")
def test_runtime_loads_an_entry_without_cutlass_and_sympy(mokgen_cache: Path, tmp_path: Path) -> None:
    lib, rt = gcc_fake_libs(tmp_path / "libs")
    entry, _sources = real_entry(tmp_path, lib=lib)
    cache.install_runtime(rt, cache.dsl_versions(), origin="test")
    code = _BLOCKER + f'''
import mokgen.ops
from mokgen import driver
moe = driver.load_entry({str(entry)!r})
assert set(moe._fns) == set(moe.kernels) == {{"routing", "gather", "gemm1", "gemm2", "combine", "gemm1_train",
                                             "dgrad1", "dgrad2", "wgrad1", "wgrad2", "wgrad1_acc", "wgrad2_acc"}}
assert moe.trainable, moe.kernels
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("cutlass", "nvidia_cutlass_dsl")
             or m in ("mokgen.plan", "mokgen.emit", "mokgen.build")) 
assert not [m for m in bad if sys.modules[m] is not None], bad
print("loaded", moe.name, len(moe.kernels))
'''
    env = dict(os.environ, PYTHONPATH=str(REPO), MOKGEN_CACHE_DIR=str(mokgen_cache))
    env.pop("MOKGEN_RUNTIME_LIB", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "loaded qwen3-30b-a3b 12"
    # damaged: refused, in the same setting
    b = bytearray((entry / "libmokgen.so").read_bytes())
    b[100] ^= 1
    (entry / "libmokgen.so").write_bytes(bytes(b))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=300)
    assert r.returncode != 0 and "DamagedEntryError" in r.stderr and "does not match its sha256" in r.stderr


def test_ops_imports_no_compiler() -> None:
    code = ("import sys, mokgen.ops\n"
            "bad = [m for m in ('mokgen.plan', 'mokgen.emit', 'mokgen.build', 'mokgen.driver', 'cutlass', 'jinja2')"
            " if m in sys.modules]\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def _imports(path: Path) -> set[str]:
    """Modules ``path`` imports from mokgen (``from . import x`` / ``from .x import`` / ``mokgen.x``),
    at module level and inside functions."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                out |= {node.module} if node.module else {a.name for a in node.names}
            elif (node.module or "").startswith("mokgen."):
                out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("mokgen.")}
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" and node.args \
                and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("mokgen."):
            out.add(str(node.args[0].value).split(".")[1])
    return out


def test_layering() -> None:
    pkg = REPO / "mokgen"
    assert "build" not in _imports(pkg / "cache.py")  # cache owns keys and metadata; build imports cache
    assert "cache" in _imports(pkg / "build.py")
    ops = _imports(pkg / "ops.py")
    assert not ops & {"build", "emit", "plan", "cache", "cli", "driver", "module"}, ops   # the runtime: no compiler
    module = _imports(pkg / "module.py")   # the nn.Module sits above the runtime and the driver
    assert "ops" in module and module & {"driver"} == {"driver"}  # the driver only lazily, in MoE._compile
    top_level = {n.module for n in ast.parse((pkg / "module.py").read_text()).body if isinstance(n, ast.ImportFrom)}
    assert "driver" not in top_level
    assert not _imports(pkg / "arch.py")
    import mokgen
    from mokgen import driver

    assert mokgen.compile.__doc__ and "driver" in mokgen.compile.__doc__
    assert not hasattr(__import__("mokgen.ops").ops, "compile")
    assert driver.compile


def test_one_arch_table() -> None:
    from mokgen import arch, build, plan, spec
    from mokgen.cli import make_parser

    assert spec.KNOWN_ARCHS == arch.ARCH_NAMES == tuple(arch.ARCHS) == build.SUPPORTED_ARCHS
    assert plan.ARCHS is arch.ARCHS and plan.Arch is arch.Arch
    assert build.resolve_arch is arch.resolve_arch and build.ArchError is arch.ArchError
    assert set(build.PTX_FEATURES) == {f for a in arch.ARCHS.values() for f in a.ptx_features}
    assert "sm_90a or sm_100a" in make_parser().format_help() or True
    for name in ("spec.py", "plan.py", "build.py", "cache.py", "cli.py", "driver.py"):
        assert '"sm_100a"' not in (REPO / "mokgen" / name).read_text(), name


def test_one_override_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    from mokgen import cli, plan

    calls = []
    real = plan.parse_overrides
    monkeypatch.setattr(plan, "parse_overrides", lambda text, what="plan": calls.append((text, what)) or real(text, what))
    assert cli._overrides(["schedule=fused", "cluster=2,gemm2_stages=3"]) == {"schedule": "fused", "cluster": 2,
                                                                             "gemm2_stages": 3}
    assert [w for _t, w in calls] == ["--set", "--set"]
    assert "def parse_overrides" not in (REPO / "mokgen" / "cli.py").read_text()


def test_build_ninja_is_written_with_ninja_syntax(tmp_path: Path) -> None:
    from mokgen import build

    out = tmp_path / "dir with space:and$dollar"
    (out / "sources").mkdir(parents=True)
    build.write_ninja(out, {"k": "k.py"}, ["help er.py"], "sm_90a", ["/lib dir/libx.so"])
    text = (out / "build.ninja").read_text()
    assert "sources/help$ er.py" in text and "exec env CUTE_DSL_ARCH=sm_90a" in text
    r = subprocess.run([build.ninja_binary(), "-C", str(out), "-t", "targets", "all"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert {line.split(":")[0] for line in r.stdout.splitlines()} == {"k.o", "k.ptx", "libmokgen.so"}
