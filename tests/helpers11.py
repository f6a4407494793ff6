"""Shared helpers of the issue-11 tests (cache integrity, failures, the runtime apart from the compiler)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from mokgen import cache
from mokgen.cache import Artifacts


@dataclasses.dataclass(frozen=True)
class FakeSources:
    spec: Any
    plan: Any
    template_hash: str
    files: dict


def make_sources(**over: Any) -> FakeSources:
    d = dict(
        spec={"name": "toy", "hidden": 256, "ffn": 128},
        plan={"bm": 128, "bn": 256, "stages": 4},
        template_hash="t" * 16,
        files={"k1.py": 'KERNEL_NAME = "k1"\n', "k2.py": 'KERNEL_NAME = "k2"\n'},
    )
    d.update(over)
    return FakeSources(**d)


def fake_build(sources: Any, arch: str, out_dir: Path, lib: bytes | Path = b"\x7fELF fake library",
               kernels: tuple[str, ...] | None = None, delay: float = 0.0) -> Artifacts:
    """Writes what build() would (library, objects, PTX, sources) without compiling anything."""
    if delay:
        time.sleep(delay)
    out = Path(out_dir)
    (out / "sources").mkdir(parents=True, exist_ok=True)
    if kernels is None:
        kernels = tuple(sorted(n[:-3] for n in sources.files if n.endswith(".py")))
    for fname, text in sources.files.items():
        (out / "sources" / fname).write_text(text)
    for k in kernels:
        (out / f"{k}.o").write_bytes(b"\x7fELF fake object " + k.encode())
        (out / f"{k}.ptx").write_text(f"//\n.version 8.0\n.target {arch}\n// {k}\n")
    if isinstance(lib, Path):
        shutil.copy2(lib, out / "libmokgen.so")
    else:
        (out / "libmokgen.so").write_bytes(lib)
    key = cache.key_for(sources, arch)
    meta = cache.entry_meta(sources, arch, key, kernels)
    return Artifacts(dir=out, lib=out / "libmokgen.so", kernels=tuple(kernels), arch=arch, key=key, meta=meta)


def failing_build(sources: Any, arch: str, out_dir: Path) -> Artifacts:
    raise AssertionError("must not build")


def have_gcc() -> bool:
    return shutil.which("gcc") is not None


_FAKE_KERNELS_C = "".join(
    f"int __tvm_ffi_{n}(void* self, const void* args, int num_args, void* result) {{ return 0; }}\n"
    for n in ("routing", "gather", "gemm1", "gemm2", "combine", "fused", "gemm1_train", "dgrad1", "dgrad2", "wgrad1",
              "wgrad2", "wgrad1_acc", "wgrad2_acc"))


def gcc_fake_libs(d: Path) -> tuple[Path, Path]:
    """(libmokgen.so exporting tvm-ffi functions named like the kernels, a stand-in libcute_dsl_runtime.so):
    real shared libraries tvm_ffi loads, built in a second, with no CuTe DSL."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "k.c").write_text(_FAKE_KERNELS_C)
    (d / "rt.c").write_text("void mokgen_fake_runtime(void) {}\n")
    lib, rt = d / "libmokgen.so", d / "libcute_dsl_runtime.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(d / "k.c")], check=True)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(rt), str(d / "rt.c")], check=True)
    return lib, rt


def real_entry(tmp_path: Path, preset: str = "qwen3-30b-a3b", arch: str = "sm_90a", lib: bytes | Path = b"\x7fELF x",
               overrides: Any = None) -> tuple[Path, Any]:
    """A cache entry for the real emitted sources of ``preset`` (fake objects; ``lib`` as the library)."""
    from mokgen import driver, ops

    _spec, arch, plan, sources = driver.prepare(preset, arch, overrides)
    art = fake_build(sources, arch, tmp_path / f"build-{preset}-{time.monotonic_ns()}", lib=lib,
                     kernels=ops.kernels_of(plan))
    return cache.store(art), sources


def tree(root: Path) -> dict[str, Any]:
    """{relative path: bytes or 'dir' or 'link'}: a snapshot to compare before / after."""
    out: dict[str, Any] = {}
    if not root.exists():
        return out
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = "link" if p.is_symlink() else ("dir" if p.is_dir() else p.read_bytes())
    return out


@contextlib.contextmanager
def mounted_tmpfs(where: Path, size: str = "1m", ro: bool = False) -> Iterator[Path]:
    """A tmpfs at ``where`` (root only; skips the test where it cannot be mounted)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a tmpfs")
    where.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if ro else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def remount_ro(where: Path) -> None:
    r = subprocess.run(["mount", "-o", "remount,ro", str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot remount read-only: {r.stderr.strip()}")
