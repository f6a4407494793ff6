"""mokgen.build with a toy CuTe DSL kernel (a vector scale): objects, library, PTX, incremental no-op,
one-kernel rebuilds, a broken kernel reported by name, the PTX report, and the cache round trip.

The compiles are small (a few seconds each on 2 cores); the module fixture builds once for several tests."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("cutlass", reason="the CuTe DSL (nvidia-cutlass-dsl) is not installed")

from mokgen import build, cache  # noqa: E402
from mokgen.build import ArchError, BuildError  # noqa: E402

TOY = '''\
"""toy kernel for mokgen's build tests: b = a * FACTOR"""
import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
import cuda.bindings.driver as cuda

from toy_common import FACTOR

KERNEL_NAME = "{name}"


@cute.kernel
def _scale_kernel(a: cute.Tensor, b: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = bidx * 128 + tidx
    if i < a.shape[0]:
        b[i] = a[i] * {expr}


@cute.jit
def _scale(a: cute.Tensor, b: cute.Tensor, stream: cuda.CUstream):
    n = a.shape[0]
    _scale_kernel(a, b).launch(grid=((n + 127) // 128, 1, 1), block=(128, 1, 1), stream=stream)


def compile(arch: str):
    n = cute.sym_int32()
    a = make_fake_compact_tensor(cutlass.Float32, (n,), assumed_align=16)
    b = make_fake_compact_tensor(cutlass.Float32, (n,), assumed_align=16)
    return cute.compile(_scale, a, b, make_fake_stream(use_tvm_ffi_env_stream=True),
                        options=f"--gpu-arch {{arch}} --enable-tvm-ffi")
'''


def toy(name: str, expr: str = "FACTOR") -> str:
    return TOY.format(name=name, expr=expr)


def toy_files(**over: str) -> dict[str, str]:
    files = {"scale.py": toy("scale"), "scale3.py": toy("scale3", "FACTOR * 1.5"), "toy_common.py": "FACTOR = 2.0\n"}
    files.update(over)
    return files


@dataclasses.dataclass(frozen=True)
class ToySources:
    spec: Any
    plan: Any
    template_hash: str
    files: dict


def mtimes(d: Path, names: list[str]) -> dict[str, int]:
    return {n: (d / n).stat().st_mtime_ns for n in names}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> build.Artifacts:
    out = tmp_path_factory.mktemp("toybuild")
    return build.build(toy_files(), "sm_90a", out, jobs=2, progress=True)


@pytest.mark.slow
def test_build_outputs(built: build.Artifacts) -> None:
    d = built.dir
    assert built.kernels == ("scale", "scale3") and built.arch == "sm_90a"
    assert built.lib == d / "libmokgen.so" and built.lib.stat().st_size > 0
    for k in built.kernels:
        assert (d / f"{k}.o").stat().st_size > 0
        ptx = (d / f"{k}.ptx").read_text()
        assert ".target sm_90a" in ptx and ".entry" in ptx
    assert (d / "sources" / "toy_common.py").read_text() == "FACTOR = 2.0\n"
    ninja = (d / "build.ninja").read_text()
    assert ninja.count("compile-one") == 1 and ninja.count(": compile ") == 2 and "gcc -shared" in ninja
    assert "CUTE_DSL_ARCH=sm_90a" in ninja
    assert len(built.key) == 64 and built.meta["arch"] == "sm_90a" and built.meta["kernels"] == ["scale", "scale3"]
    if shutil.which("nm"):
        syms = subprocess.run(["nm", "-D", "--defined-only", str(built.lib)], capture_output=True, text=True).stdout
        assert "__tvm_ffi_scale\n" in syms and "__tvm_ffi_scale3\n" in syms
    if shutil.which("readelf"):
        dyn = subprocess.run(["readelf", "-d", str(built.lib)], capture_output=True, text=True).stdout
        assert "libcute_dsl_runtime.so" in dyn  # by soname: loadable where the runtime sits elsewhere


@pytest.mark.slow
def test_ptx_report(built: build.Artifacts) -> None:
    rep = build.ptx_report(built)
    assert set(rep) == {"scale", "scale3"}
    for row in rep.values():
        assert set(row) == {"wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier", "target"}
        assert row["target"] is True and row["wgmma.mma_async"] is False  # a plain elementwise kernel
    assert build.ptx_report(built.dir)["scale"]["target"] in (True, False)  # a bare dir works too


@pytest.mark.slow
def test_incremental_noop(built: build.Artifacts, capfd: pytest.CaptureFixture) -> None:
    names = ["scale.o", "scale3.o", "scale.ptx", "libmokgen.so", "sources/scale.py"]
    before = mtimes(built.dir, names)
    capfd.readouterr()
    again = build.build(toy_files(), "sm_90a", built.dir, jobs=2)
    assert mtimes(built.dir, names) == before
    assert again.key == built.key and again.kernels == built.kernels
    assert "compile" not in capfd.readouterr().err  # silent: nothing to do
    dry = subprocess.run([build.ninja_binary(), "-C", str(built.dir), "-n"], capture_output=True, text=True)
    assert "no work to do" in dry.stdout


@pytest.mark.slow
def test_rebuilds_only_what_changed(tmp_path: Path, built: build.Artifacts) -> None:
    d = tmp_path / "b"
    shutil.copytree(built.dir, d, symlinks=True)
    # ninja's log names outputs relative to the build dir: the copy is a valid build dir of its own,
    # but build.ninja is regenerated (it records no absolute output paths); the copy keeps mtimes.
    build.build(toy_files(), "sm_90a", d, jobs=2)
    before = mtimes(d, ["scale.o", "scale3.o", "libmokgen.so"])
    build.build(toy_files(**{"scale3.py": toy("scale3", "FACTOR * 3.0")}), "sm_90a", d, jobs=2)
    after = mtimes(d, ["scale.o", "scale3.o", "libmokgen.so"])
    assert after["scale.o"] == before["scale.o"]
    assert after["scale3.o"] != before["scale3.o"] and after["libmokgen.so"] != before["libmokgen.so"]


@pytest.mark.slow
def test_broken_kernel_names_the_kernel(tmp_path: Path) -> None:
    files = {"scale.py": toy("scale"), "bad.py": toy("bad", "undefined_thing"), "toy_common.py": "FACTOR = 2.0\n"}
    with pytest.raises(BuildError) as ei:
        build.build(files, "sm_90a", tmp_path / "b", jobs=2, progress=False)
    e = ei.value
    assert e.kernels == ("bad",)
    msg = str(e)
    assert "'bad'" in msg.splitlines()[0] and "sm_90a" in msg
    assert "undefined_thing" in e.tail and "scale" not in e.kernels
    assert e.log is not None and e.log.exists()
    assert (tmp_path / "b" / "scale.o").exists()  # the good one still compiled (ninja -k 0)
    assert not (tmp_path / "b" / "libmokgen.so").exists()


@pytest.mark.slow
def test_sm100a(tmp_path: Path) -> None:
    art = build.build({"scale.py": toy("scale"), "toy_common.py": "FACTOR = 2.0\n"}, "sm_100a", tmp_path, jobs=1)
    assert ".target sm_100a" in (tmp_path / "scale.ptx").read_text()
    assert set(build.ptx_report(art)["scale"]) == {"wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier",
                                                    "tcgen05", "clusterlaunchcontrol", "block_scale", "target"}
    assert build.ptx_report(art)["scale"]["target"] is True


@pytest.mark.slow
def test_get_or_build_with_real_build(mokgen_cache: Path) -> None:
    s = ToySources(spec={"name": "toy"}, plan={"bm": 128}, template_hash="toy-1",
                   files={"scale.py": toy("scale"), "toy_common.py": "FACTOR = 2.0\n"})
    from mokgen import driver

    art = driver.get_or_build(s, "sm_90a", jobs=1)
    assert art.status == "built" and art.note.startswith("built in ")
    assert art.dir == cache.entry_dir(cache.key_for(s, "sm_90a"), "sm_90a")
    assert cache.verify() and all(e.ok for e in cache.verify())  # every artifact hashed, verified strictly
    assert (art.dir / "meta.json").exists() and art.lib.exists() and (art.dir / "scale.ptx").exists()
    assert art.meta["spec_name"] == "toy" and art.meta["template_hash"] == "toy-1"
    assert not cache.build_dir(art.key, "sm_90a").exists()  # the build dir is gone once stored

    def no(*a: Any) -> Any:
        raise AssertionError("cached: must not build")

    hit = cache.get_or_build(s, "sm_90a", no)
    assert hit.dir == art.dir and hit.status == "cached"
    assert build.ptx_report(art.dir)["scale"]["target"] is True


# ------------------------------------------------------------------------------------------ fast unit tests


def test_kernel_files_detection() -> None:
    files = toy_files(**{"README.txt": "x", "helper.py": "X = 1\n"})
    assert build.kernel_files(files) == {"scale": "scale.py", "scale3": "scale3.py"}
    with pytest.raises(BuildError, match="both"):
        build.kernel_files({"a.py": 'KERNEL_NAME = "k"\n', "b.py": 'KERNEL_NAME = "k"\n'})


def test_build_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match="no kernel files"):
        build.build({"helper.py": "X = 1\n"}, "sm_90a", tmp_path)
    with pytest.raises(BuildError, match="relative path"):
        build.build({"../evil.py": 'KERNEL_NAME = "evil"\n'}, "sm_90a", tmp_path)
    with pytest.raises(ArchError, match="use sm_90a"):
        build.build(toy_files(), "sm_90", tmp_path)


def test_parse_ninja_failures() -> None:
    lines = [
        "[1/3] compile bad (sm_90a)",
        "FAILED: [code=1] bad.o bad.ptx ",
        "CUTE_DSL_ARCH=sm_90a python -m mokgen.build compile-one sources/bad.py bad.o --arch sm_90a --name bad",
        "Traceback (most recent call last):",
        "NameError: nope",
        "[2/3] compile good (sm_90a)",
        "FAILED: libmokgen.so",
        "gcc -shared ...",
        "ld: cannot find -lfoo",
        "ninja: build stopped: subcommand failed.",
    ]
    fails = build._parse_failures(lines, {"bad.o": "bad", "good.o": "good"})
    assert [k for k, _ in fails] == ["bad", "link"]
    assert fails[0][1] == ["Traceback (most recent call last):", "NameError: nope"]
    assert fails[1][1] == ["ld: cannot find -lfoo"]


def test_resolve_arch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOKGEN_ARCH", raising=False)
    assert build.resolve_arch("sm_100a") == "sm_100a"
    monkeypatch.setenv("MOKGEN_ARCH", "sm_90a")
    assert build.resolve_arch() == "sm_90a"
    assert build.resolve_arch("sm_100a") == "sm_100a"  # --arch wins
    monkeypatch.setenv("MOKGEN_ARCH", "sm_80")
    with pytest.raises(ArchError, match=r"MOKGEN_ARCH"):
        build.resolve_arch()
    monkeypatch.delenv("MOKGEN_ARCH")
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ArchError, match="pass --arch sm_90a"):
        build.resolve_arch()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert build.resolve_arch() == "sm_90a"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))
    assert build.resolve_arch() == "sm_100a"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    with pytest.raises(ArchError, match="sm_80"):
        build.resolve_arch()


def test_cli_errors_are_one_line(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from mokgen.cli import main

    monkeypatch.delenv("MOKGEN_ARCH", raising=False)
    assert main(["compile", "kimi-k2", "--arch", "sm_91"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mokgen: error: unknown arch 'sm_91'") and len(err.strip().splitlines()) == 1


def test_compile_one_reports_missing_compile(tmp_path: Path) -> None:
    src = tmp_path / "k.py"
    src.write_text('KERNEL_NAME = "k"\n')
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    r = subprocess.run([os.sys.executable, "-m", "mokgen.build", "compile-one", str(src), str(tmp_path / "k.o"),
                        "--arch", "sm_90a", "--name", "k"], capture_output=True, text=True, env=env)
    assert r.returncode == 1 and "defines no compile(arch)" in r.stderr


def test_cli_specs_plan_emit(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import json

    from mokgen.cli import main

    assert main(["specs"]) == 0
    out = capsys.readouterr().out
    head = out.splitlines()[0].split()
    assert head[:4] == ["name", "H", "I", "experts"] and "kimi-k2" in out
    assert main(["plan", "kimi-k2", "--arch", "sm_90a", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["arch"] == "sm_90a"
    assert main(["plan", "no-such-preset", "--arch", "sm_90a"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mokgen: error: ") and len(err.strip().splitlines()) == 1
    assert main(["emit", "kimi-k2", "--arch", "sm_90a", "--out", str(tmp_path / "src")]) == 0
    written = sorted(p.name for p in (tmp_path / "src").iterdir())
    assert "gemm1.py" in written and set(build.kernel_files(
        {n: (tmp_path / "src" / n).read_text() for n in written})) >= {"routing", "gemm1", "gemm2", "combine"}


def test_cli_plan_overrides(capsys: pytest.CaptureFixture) -> None:
    import json

    from mokgen.cli import main

    assert main(["plan", "kimi-k2", "--arch", "sm_90a", "--json", "--set", "schedule=fused"]) == 0
    assert json.loads(capsys.readouterr().out)["schedule"] == "fused"
    assert main(["plan", "kimi-k2", "--arch", "sm_90a", "--json", "--set", "cluster=2"]) == 0
    assert json.loads(capsys.readouterr().out)["gemm2"]["cluster"] == 2
    assert main(["plan", "kimi-k2", "--arch", "sm_90a", "--set", "cluster=3"]) == 2
    assert "plan.cluster: must be one of 1, 2" in capsys.readouterr().err
    # per GEMM: gemm2_cluster wins over cluster for GEMM 2 only
    assert main(["plan", "kimi-k2", "--arch", "sm_90a", "--json", "--set", "cluster=2", "--set", "gemm2_cluster=1"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert (p["gemm1"]["cluster"], p["gemm2"]["cluster"]) == (2, 1)
    assert main(["plan", "kimi-k2", "--arch", "sm_90a", "--set", "gemm1_cluster=4"]) == 2
    assert "plan.gemm1_cluster: must be one of 1, 2" in capsys.readouterr().err
    assert main(["plan", "kimi-k2", "--arch", "sm_90a", "--set", "schedule"]) == 2
    assert "--set: expected KEY=VALUE" in capsys.readouterr().err
