"""Build stage: emitted CuTe DSL sources -> compiled objects -> ``libmokgen.so``.

``build(sources, arch, out_dir)`` writes the kernel sources into ``out_dir/sources/``, generates a
``build.ninja`` with one compile edge per kernel file and one link edge, and runs ninja (parallel,
incremental: a second build of the same sources does nothing).

Each compile edge runs ``python -m mokgen.build compile-one SRC OUT.o --arch ARCH --name NAME`` in a fresh
process (the CuTe DSL keeps global state; one process per kernel keeps builds independent and parallel):
it imports the kernel file, calls its ``compile(arch)``, exports the result with
``export_to_c(OUT.o, function_name=NAME)`` and writes ``NAME.ptx`` next to the object.

The DSL writes PTX only when asked through its environment (``CUTE_DSL_KEEP=ptx``,
``CUTE_DSL_DUMP_DIR``); the kernel file's own ``--keep-ptx`` option is not needed, and the env route also
turns the DSL's own JIT file cache off, so nothing outside the build directory is consulted.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import glob
import hashlib
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Iterable, Mapping

from . import cache
from .arch import ARCH_NAMES, ARCHS, ArchError, check_arch, resolve_arch
from .cache import Artifacts

__all__ = [
    "Artifacts",
    "BuildError",
    "ArchError",
    "build",
    "resolve_arch",
    "check_arch",
    "ptx_report",
    "ptxas_report",
    "ptxas_advisories",
    "run_ptxas",
    "find_nvdisasm",
    "sass_of_ptx",
    "sass_opcodes",
    "sass_report",
    "sass_texts",
    "kernel_files",
    "LIB_NAME",
    "SUPPORTED_ARCHS",
]

LIB_NAME = cache.LIB_NAME
SUPPORTED_ARCHS = ARCH_NAMES
# PTX features the report looks for, per arch (from the arch table).
PTX_FEATURES = {f: tuple(a for a, v in ARCHS.items() if f in v.ptx_features)
                for f in dict.fromkeys(f for v in ARCHS.values() for f in v.ptx_features)}
_TAIL_LINES = 40
_KERNEL_NAME_RE = re.compile(r"""^KERNEL_NAME\s*(?::\s*str\s*)?=\s*["']([A-Za-z_][A-Za-z0-9_]*)["']""", re.M)
_IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class BuildError(RuntimeError):
    """A kernel failed to compile or the library failed to link.

    ``kernels``: the names of the failing kernels (``"link"`` for the link step); ``tail``: the last lines of
    the compiler output; ``log``: the full build log.
    """

    def __init__(self, message: str, kernels: Iterable[str] = (), tail: str = "", log: Path | None = None):
        super().__init__(message)
        self.kernels = tuple(kernels)
        self.tail = tail
        self.log = log


# ----------------------------------------------------------------------------------------------------------
# helpers


def _files_of(sources: Any) -> Mapping[str, str]:
    files = sources.files if hasattr(sources, "files") else sources
    if not isinstance(files, Mapping):
        raise BuildError("sources must be a mokgen.emit.Sources or a mapping of file name -> text")
    return files


def kernel_files(sources: Any) -> dict[str, str]:
    """``{kernel name: file name}`` for the files of ``sources`` that define ``KERNEL_NAME`` (the kernel
    modules); other files (helpers, headers) are written next to them but not compiled on their own."""
    out: dict[str, str] = {}
    for fname, text in sorted(_files_of(sources).items()):
        if not fname.endswith(".py"):
            continue
        m = _KERNEL_NAME_RE.search(text)
        if not m:
            continue
        name = m.group(1)
        if name in out:
            raise BuildError(f"kernel name {name!r} is defined by both {out[name]} and {fname}")
        out[name] = fname
    return out


def _safe_relpath(fname: str) -> Path:
    p = Path(fname)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise BuildError(f"source file name {fname!r} must be a relative path inside the build directory")
    return p


def _write_if_changed(path: Path, text: str) -> bool:
    """Write ``text`` to ``path`` unless it already holds exactly that (keeps mtimes, so ninja stays a
    no-op); atomic via a pid-suffixed temp file."""
    data = text.encode()
    try:
        if path.read_bytes() == data:
            return False
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return True


def ninja_binary() -> str:
    try:
        import ninja  # type: ignore

        cand = Path(ninja.BIN_DIR) / "ninja"
        if cand.exists():
            return str(cand)
    except Exception:
        pass
    found = shutil.which("ninja")
    if found:
        return found
    raise BuildError("ninja not found: pip install ninja")


def runtime_libraries() -> list[str]:
    """The shared libraries an exported kernel object links against (CuTe DSL runtime + tvm-ffi)."""
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
            import cutlass.cute as cute  # type: ignore
    except Exception as e:  # pragma: no cover - depends on the install
        raise BuildError(
            f"the CuTe DSL is not importable ({type(e).__name__}: {e}); "
            'install the compiler: pip install -e ".[compiler]"'
        ) from None
    return [str(p) for p in cute.runtime.find_runtime_libraries(enable_tvm_ffi=True)]


def _pythonpath_for_children() -> str:
    """PYTHONPATH for compile-one processes: this mokgen's parent directory first, then what we have."""
    here = str(Path(__file__).resolve().parent.parent)
    parts = [here] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != here]
    return os.pathsep.join(parts)


def _dsl_fingerprint() -> str:
    return hashlib.sha256(json.dumps(cache.dsl_versions(), sort_keys=True).encode()).hexdigest()[:12]


# ----------------------------------------------------------------------------------------------------------
# build.ninja


def write_ninja(out_dir: Path, kernels: Mapping[str, str], helpers: Iterable[str], arch: str,
                link_libs: list[str]) -> Path:
    """``build.ninja`` (written with ninja's own ``ninja_syntax``): one compile edge per kernel, one link edge.
    Every command is ``exec``-ed by the shell, so ninja is the compilers' parent (see :func:`run_ninja`)."""
    from ninja.ninja_syntax import Writer, escape

    env = (
        f"CUTE_DSL_ARCH={shlex.quote(arch)} PYTHONPATH={shlex.quote(_pythonpath_for_children())} "
        f"PYTHONWARNINGS=ignore::RuntimeWarning:runpy MOKGEN_DSL_FINGERPRINT={_dsl_fingerprint()}"
    )
    buf = io.StringIO()
    n = Writer(buf, width=10000)
    n.comment("generated by mokgen.build; do not edit")
    n.variable("ninja_required_version", "1.10")
    n.variable("arch", arch)
    n.newline()
    n.rule("compile", f"exec env {escape(env)} {escape(shlex.quote(sys.executable))} -m mokgen.build compile-one "
                      "$in $out_o --arch $arch --name $name", description="compile $name ($arch)")
    n.newline()
    n.rule("link", f"exec gcc -shared -o $out $in {escape(' '.join(shlex.quote(l) for l in link_libs))}",
           description="link $out")
    n.newline()
    helper_deps = [str(Path("sources") / h) for h in sorted(helpers)]
    objs = []
    for name, fname in sorted(kernels.items()):
        obj = f"{name}.o"
        objs.append(obj)
        n.build([obj, f"{name}.ptx"], "compile", str(Path("sources") / fname), implicit=helper_deps or None,
                variables={"name": name, "out_o": obj})
        n.newline()
    n.build(LIB_NAME, "link", objs)
    n.newline()
    n.default(LIB_NAME)
    path = out_dir / "build.ninja"
    _write_if_changed(path, buf.getvalue())
    return path


# ----------------------------------------------------------------------------------------------------------
# running ninja, with progress

_STATUS_RE = re.compile(r"^\[(\d+)/(\d+)\] (.*)$")


class _Progress:
    """Shows ninja's progress: a rich bar on a terminal, ``[n/N]`` lines otherwise."""

    def __init__(self, enabled: bool, total: int, title: str):
        self.enabled = enabled
        self.bar = None
        self.t0 = time.monotonic()
        if not enabled:
            return
        if sys.stderr.isatty():
            try:
                from rich.console import Console
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn
                from rich.progress import TimeElapsedColumn

                self.bar = Progress(
                    SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=Console(stderr=True), transient=False,
                )
                self.bar.start()
                self.task = self.bar.add_task(title, total=total)
                return
            except Exception:
                self.bar = None

    def line(self, line: str) -> None:
        if not self.enabled:
            return
        m = _STATUS_RE.match(line)
        if self.bar is not None:
            if m:
                self.bar.update(self.task, completed=int(m.group(1)), total=int(m.group(2)))
                self.bar.console.print(f"  [{m.group(1)}/{m.group(2)}] {m.group(3)}", highlight=False)
            elif line.strip() and not line.startswith("ninja: "):
                self.bar.console.print("    " + line, markup=False, highlight=False)
        elif m:
            print(f"  {line}", file=sys.stderr, flush=True)
        elif line.strip() and not line.startswith("ninja: "):
            print(f"    {line}", file=sys.stderr, flush=True)

    def close(self, ok: bool) -> None:
        if self.bar is not None:
            self.bar.stop()
        if self.enabled:
            state = "done" if ok else "FAILED"
            print(f"mokgen: build {state} in {time.monotonic() - self.t0:.1f} s", file=sys.stderr, flush=True)


def _parse_failures(lines: list[str], obj_to_kernel: Mapping[str, str]) -> list[tuple[str, list[str]]]:
    """``[(kernel, output lines)]`` for each ``FAILED:`` block in ninja's output."""
    out: list[tuple[str, list[str]]] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("FAILED:"):
            outs = [t for t in line[len("FAILED:"):].split() if not t.startswith("[code=")]
            kernel = "link"
            for t in outs:
                t = t.replace("$ ", " ")
                if t in obj_to_kernel:
                    kernel = obj_to_kernel[t]
                    break
            body: list[str] = []
            i += 1
            if i < len(lines):  # the command line itself
                i += 1
            while i < len(lines) and not (
                _STATUS_RE.match(lines[i]) or lines[i].startswith("FAILED:") or lines[i].startswith("ninja: ")
            ):
                body.append(lines[i])
                i += 1
            out.append((kernel, body))
            continue
        i += 1
    return out


def _die_with_parent(sig: int = signal.SIGKILL) -> None:
    """In a child (preexec_fn / at start): ask the kernel to send ``sig`` when our parent dies (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:  # pragma: no cover - not Linux
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM ninja's process group (ninja, the compilers), SIGKILL what is left after 5 s."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def check_jobs(jobs: Any) -> int | None:
    """``jobs`` as a positive int (or None), else :class:`BuildError`."""
    if jobs is None:
        return None
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise BuildError(f"jobs must be a positive integer (parallel compiles), got {jobs!r}")
    return jobs


def run_ninja(out_dir: Path, jobs: int | None, progress: bool, kernels: Mapping[str, str], arch: str) -> list[str]:
    cmd = [ninja_binary(), "-C", str(out_dir), "-k", "0"]
    if check_jobs(jobs):
        cmd += ["-j", str(jobs)]
    env = dict(os.environ)
    env["NINJA_STATUS"] = "[%f/%t] "
    # Do ninja's dry run first: it tells whether there is anything to do, so a no-op build stays silent.
    dry = subprocess.run(cmd + ["-n"], capture_output=True, text=True, env=env)
    work = [l for l in dry.stdout.splitlines() if _STATUS_RE.match(l)]
    if dry.returncode == 0 and not work:
        return []
    if progress:
        print(f"mokgen: building {len(kernels)} kernel(s) for {arch} in {out_dir}" + (f" (-j {jobs})" if jobs else ""),
              file=sys.stderr, flush=True)
    prog = _Progress(progress, max(len(work), 1), f"compiling for {arch}")
    lines: list[str] = []
    ok = False
    try:
        # ninja leads its own process group (the compilers' too: the rules exec them) and gets SIGKILL when
        # this process dies, however it dies; the compile-one processes die with ninja (see compile_one).
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                bufsize=1, start_new_session=True, preexec_fn=_die_with_parent)
        try:
            assert proc.stdout is not None
            for raw in proc.stdout:
                line = raw.rstrip("\n")
                lines.append(line)
                prog.line(line)
            rc = proc.wait()
        finally:
            if proc.poll() is None:  # interrupted (KeyboardInterrupt, an error): stop the whole build
                _kill_group(proc)
        ok = rc == 0
    finally:
        prog.close(ok)
    log = out_dir / "build.log"
    log.write_text("\n".join(lines) + "\n")
    if not ok:
        obj_to_kernel = {f"{k}.o": k for k in kernels} | {f"{k}.ptx": k for k in kernels}
        fails = _parse_failures(lines, obj_to_kernel)
        if not fails:
            tail = "\n".join(lines[-_TAIL_LINES:])
            raise BuildError(f"build failed for {arch} in {out_dir} (log: {log}):\n{tail}", (), tail, log)
        names = [k for k, _ in fails]
        parts = []
        for k, body in fails:
            body = [b for b in body if b.strip()]
            tail = "\n".join(body[-_TAIL_LINES:])
            what = "library link" if k == "link" else f"kernel {k!r}"
            parts.append(f"{what} failed for {arch}:\n{tail}")
        kn = [n for n in names if n != "link"]
        if kn:
            what = f"kernel {kn[0]!r}" if len(kn) == 1 else "kernels " + ", ".join(repr(n) for n in kn)
            first = f"{what} failed to compile for {arch} ({len(kn)} of {len(kernels)}; log: {log})"
        else:
            first = f"linking {LIB_NAME} failed for {arch} (log: {log})"
        msg = first + "\n" + "\n".join(parts)
        raise BuildError(msg, names, "\n".join(parts), log)
    return lines


# ----------------------------------------------------------------------------------------------------------
# public entry points


def build(sources: Any, arch: str, out_dir: str | os.PathLike, jobs: int | None = None,
          progress: bool = True) -> Artifacts:
    """Compile ``sources`` (a ``mokgen.emit.Sources``, or a mapping file name -> text) for ``arch`` into
    ``out_dir``; returns the :class:`Artifacts`. Raises :class:`BuildError` naming the failing kernel."""
    check_arch(arch)
    check_jobs(jobs)
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    files = _files_of(sources)
    kernels = kernel_files(sources)
    if not kernels:
        raise BuildError("no kernel files in sources (a kernel file is a .py defining KERNEL_NAME)")
    src_dir = out / "sources"
    src_dir.mkdir(exist_ok=True)
    wanted = set()
    for fname, text in files.items():
        rel = _safe_relpath(fname)
        wanted.add(rel)
        _write_if_changed(src_dir / rel, text)
    for p in sorted(src_dir.rglob("*")):  # files left over from an earlier build of other sources
        if p.is_file() and p.relative_to(src_dir) not in wanted and "__pycache__" not in p.parts:
            p.unlink()
    helpers = [f for f in files if f not in set(kernels.values())]
    write_ninja(out, kernels, helpers, arch, runtime_libraries())
    run_ninja(out, jobs, progress, kernels, arch)
    lib = out / LIB_NAME
    if not lib.exists():
        raise BuildError(f"ninja succeeded but {lib} is missing")
    key = cache.key_for(sources, arch)
    meta = cache.entry_meta(sources, arch, key, kernels)
    return Artifacts(dir=out, lib=lib, kernels=tuple(sorted(kernels)), arch=arch, key=key, meta=meta)


def ptx_report(artifacts: Artifacts | str | os.PathLike) -> dict[str, dict[str, bool]]:
    """``{kernel: {feature: present}}`` for the PTX of each kernel: ``wgmma.mma_async``,
    ``cp.async.bulk.tensor``, ``mbarrier`` (and for sm_100a ``tcgen05``, ``clusterlaunchcontrol`` and
    ``block_scale``: the MXFP8 GEMMs' ``tcgen05.mma ... kind::mxf8f6f4.block_scale``), plus ``target`` (the PTX names the
    arch). Accepts :class:`Artifacts` or a directory (build dir or cache entry)."""
    if isinstance(artifacts, Artifacts):
        d, arch, kernels = artifacts.dir, artifacts.arch, list(artifacts.kernels)
    else:
        d = Path(artifacts)
        try:
            meta = json.loads((d / "meta.json").read_text())
            arch, kernels = meta["arch"], list(meta["kernels"])
        except Exception:
            arch = ""
            kernels = sorted(p.stem for p in d.glob("*.ptx"))
    report: dict[str, dict[str, bool]] = {}
    for k in kernels:
        try:
            text = (Path(d) / f"{k}.ptx").read_text(errors="replace")
        except OSError:
            text = ""
        row = {feat: (feat in text) for feat, archs in PTX_FEATURES.items() if not arch or arch in archs}
        row["target"] = bool(arch) and re.search(rf"^\.target\s+{re.escape(arch)}\b", text, re.M) is not None
        report[k] = row
    return report


_PTXAS_VERSION_RE = re.compile(r"Unsupported \.version (\d+\.\d+); current version is '(\d+\.\d+)'")
# ptxas's performance advisories about the wgmma pipeline: C7514 (wgmma serialized), C7515-C7520 (waits injected,
# pipeline broken across calls / branches). Any of them in a GEMM means its tensor cores wait on every wgmma.
_PTXAS_ADVISORY_RE = re.compile(r"\((C75\d\d)\)\s*(.*)")


def find_ptxas() -> str | None:
    """The ptxas to check PTX with: ``$MOKGEN_PTXAS``, else ``ptxas`` on PATH, else None."""
    env = os.environ.get("MOKGEN_PTXAS")
    if env:
        return env if os.access(env, os.X_OK) else None
    return shutil.which("ptxas")


def run_ptxas(ptx: str, arch: str, ptxas: str | None = None) -> tuple[int, str, str | None] | None:
    """Assemble one kernel's PTX with an independent ptxas (``find_ptxas``; the DSL assembles with its own) to read
    its report: ``(return code, log, version change)``, or None when no ptxas is available. A PTX ``.version``
    newer than that ptxas knows is lowered to the newest it names (the header only: the instructions of our
    kernels exist in both; good for advisories, register and spill counts, not for shipping); the third field
    then says ``"9.4 -> 9.0"``."""
    ptxas = ptxas or find_ptxas()
    if not ptxas:
        return None
    patched = None
    with tempfile.TemporaryDirectory(prefix="mokgen-ptxas.") as td:
        src = Path(td) / "k.ptx"
        for _ in range(2):
            src.write_text(ptx)
            r = subprocess.run([ptxas, f"-arch={arch}", "-v", str(src), "-o", str(Path(td) / "k.cubin")],
                               capture_output=True, text=True)
            log = r.stdout + r.stderr
            m = _PTXAS_VERSION_RE.search(log)
            if r.returncode == 0 or not m:
                break
            ptx = re.sub(r"^\.version\s+\S+", f".version {m.group(2)}", ptx, count=1, flags=re.M)
            patched = f"{m.group(1)} -> {m.group(2)}"
    return r.returncode, log, patched


def ptxas_advisories(ptx: str, arch: str, ptxas: str | None = None) -> list[str] | None:
    """ptxas's wgmma performance advisories for one kernel's PTX (``["C7514 ...", ...]``; ``[]`` when clean), or
    None when no ptxas is available (:func:`run_ptxas`)."""
    res = run_ptxas(ptx, arch, ptxas)
    if res is None:
        return None
    rc, log, _ = res
    if rc != 0:
        raise BuildError(f"ptxas rejected the PTX: {log.strip().splitlines()[-1:]}")
    found = []
    for line in log.splitlines():
        m = _PTXAS_ADVISORY_RE.search(line)
        if m:
            found.append(f"{m.group(1)} {m.group(2).split(' in function')[0].split(' in the function')[0]}")
    return sorted(set(found))


def ptxas_report(artifacts: Artifacts | str | os.PathLike, kernels: Iterable[str] | None = None,
                 ptxas: str | None = None) -> dict[str, list[str]] | None:
    """``{kernel: advisories}`` (``ptxas_advisories``) for the kernels of a build or cache entry that use wgmma;
    None when no ptxas is available."""
    ptxas = ptxas or find_ptxas()
    if not ptxas:
        return None
    d = Path(artifacts.dir if isinstance(artifacts, Artifacts) else artifacts)
    arch = artifacts.arch if isinstance(artifacts, Artifacts) else json.loads((d / "meta.json").read_text())["arch"]
    names = list(kernels) if kernels is not None else sorted(p.stem for p in d.glob("*.ptx"))
    out: dict[str, list[str]] = {}
    for k in names:
        text = (d / f"{k}.ptx").read_text(errors="replace")
        if "wgmma.mma_async" in text:
            out[k] = ptxas_advisories(text, arch, ptxas) or []
    return out


# ----------------------------------------------------------------------------------------------------------
# SASS: a kernel's PTX assembled for its arch by ptxas, the cubin disassembled by nvdisasm

# SASS mnemonics of the instructions the tests look for, as nvdisasm 13.5 prints them for ptxas 13.0's cubins
# (observed on our kernels, not taken from a spec; tests/test_sass.py says which PTX instruction each came from):
# Hopper's wgmma (HGMMA), Blackwell's tcgen05 MMA (UTCHMMA: kind::f16; UTCQMMA: kind::mxf8f6f4, block-scaled with
# TMEM scale operands), tcgen05.commit / cp / alloc+dealloc / ld (UTCBAR, UTCCP, UTCATOMSWS, LDTM), TMA
# (UTMALDG loads, UTMASTG stores, UTMACCTL tensormap prefetch), mbarriers (SYNCS), Cluster Launch Control's
# try_cancel (UGETNEXTWORKID). A mnemonic is an instruction's first word less its dotted modifiers:
# ``UTCCP.T.S.4x32dp128bit ...`` counts as ``UTCCP``.
SASS_OPCODES = ("HGMMA", "UTCHMMA", "UTCQMMA", "UTCBAR", "UTCCP", "UTCATOMSWS", "LDTM", "UTMALDG", "UTMASTG",
                "UTMACCTL", "SYNCS", "UGETNEXTWORKID")
_SASS_INSN_RE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)", re.M)
# nvdisasm's wheel (nvidia-cuda-nvdisasm, in the dev extra) puts the binary under the ``nvidia`` namespace package:
# ``nvidia/cu13/bin/nvdisasm`` (13.x); older wheels used ``nvidia/cuda_nvdisasm/bin/nvdisasm``.
_NVDISASM_WHEEL_PATHS = ("cu13/bin/nvdisasm", "cuda_nvdisasm/bin/nvdisasm")


def find_nvdisasm() -> str | None:
    """The nvdisasm to read SASS with: ``$MOKGEN_NVDISASM``, else ``nvdisasm`` on PATH, else the binary of the
    ``nvidia-cuda-nvdisasm`` wheel, else None."""
    env = os.environ.get("MOKGEN_NVDISASM")
    if env:
        return env if os.access(env, os.X_OK) else None
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia   # a namespace package: one entry per site directory that has an nvidia/ folder
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", ()):
        for rel in _NVDISASM_WHEEL_PATHS:
            cand = Path(root) / rel
            if cand.is_file() and os.access(cand, os.X_OK):
                return str(cand)
    return None


def sass_of_ptx(ptx: str, arch: str, ptxas: str | None = None, nvdisasm: str | None = None) -> str | None:
    """One kernel's SASS: its PTX assembled for ``arch`` by ptxas (``run_ptxas``'s way: a too-new ``.version``
    header lowered) into a cubin, disassembled by nvdisasm. None when either tool is missing; BuildError when
    ptxas rejects the PTX or nvdisasm fails."""
    ptxas = ptxas or find_ptxas()
    nvdisasm = nvdisasm or find_nvdisasm()
    if not ptxas or not nvdisasm:
        return None
    with tempfile.TemporaryDirectory(prefix="mokgen-sass.") as td:
        src, cubin = Path(td) / "k.ptx", Path(td) / "k.cubin"
        for _ in range(2):
            src.write_text(ptx)
            r = subprocess.run([ptxas, f"-arch={arch}", str(src), "-o", str(cubin)], capture_output=True, text=True)
            m = _PTXAS_VERSION_RE.search(r.stdout + r.stderr)
            if r.returncode == 0 or not m:
                break
            ptx = re.sub(r"^\.version\s+\S+", f".version {m.group(2)}", ptx, count=1, flags=re.M)
        if r.returncode != 0:
            raise BuildError(f"ptxas rejected the PTX: {(r.stdout + r.stderr).strip().splitlines()[-1:]}")
        d = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True)
        if d.returncode != 0:
            raise BuildError(f"nvdisasm failed: {(d.stdout + d.stderr).strip().splitlines()[-1:]}")
        return d.stdout


def sass_opcodes(sass: str) -> dict[str, int]:
    """``{mnemonic: count}`` of the instructions in nvdisasm's text (the first word of each instruction line, its
    predicate and dotted modifiers dropped)."""
    out: dict[str, int] = {}
    for m in _SASS_INSN_RE.finditer(sass):
        op = m.group(1)
        out[op] = out.get(op, 0) + 1
    return out


def sass_report(artifacts: Artifacts | str | os.PathLike, kernels: Iterable[str] | None = None,
                ptxas: str | None = None, nvdisasm: str | None = None) -> dict[str, dict[str, int]] | None:
    """``{kernel: {mnemonic: count}}`` (``sass_opcodes``) of each kernel's SASS (``sass_texts``); None when ptxas
    or nvdisasm is missing. ``SASS_OPCODES`` names the mnemonics of the tensor-core, TMEM, TMA and barrier
    instructions the tests look for."""
    texts = sass_texts(artifacts, kernels, ptxas, nvdisasm)
    return None if texts is None else {k: sass_opcodes(t) for k, t in texts.items()}


def sass_texts(artifacts: Artifacts | str | os.PathLike, kernels: Iterable[str] | None = None,
               ptxas: str | None = None, nvdisasm: str | None = None) -> dict[str, str] | None:
    """``{kernel: SASS}`` (``sass_of_ptx``) for the kernels of a build or cache entry (all, or ``kernels``), each
    assembled for the entry's arch (``meta.json``, else the PTX's ``.target``); None when ptxas or nvdisasm is
    missing."""
    ptxas = ptxas or find_ptxas()
    nvdisasm = nvdisasm or find_nvdisasm()
    if not ptxas or not nvdisasm:
        return None
    d = Path(artifacts.dir if isinstance(artifacts, Artifacts) else artifacts)
    names = list(kernels) if kernels is not None else sorted(p.stem for p in d.glob("*.ptx"))
    arch = artifacts.arch if isinstance(artifacts, Artifacts) else None
    if arch is None and (d / "meta.json").exists():   # a cache entry
        arch = json.loads((d / "meta.json").read_text())["arch"]
    if arch is None:   # a build directory: the arch its PTX targets
        m = re.search(r"^\.target\s+(sm_\w+)", (d / f"{names[0]}.ptx").read_text(errors="replace") if names else "",
                      re.M)
        if not m:
            raise BuildError(f"{d}: no meta.json and no PTX naming its target arch")
        arch = m.group(1)
    return {k: sass_of_ptx((d / f"{k}.ptx").read_text(errors="replace"), arch, ptxas, nvdisasm) for k in names}


# ----------------------------------------------------------------------------------------------------------
# compile-one (runs in its own process, one per kernel, from build.ninja)


def _find_ptx(dump_dir: Path, compiled: Any) -> str | None:
    found = sorted(glob.glob(str(dump_dir / "**" / "*.ptx"), recursive=True))
    if not found:
        cand = getattr(compiled, "__ptx__", None)
        if isinstance(cand, str):
            if cand.lstrip().startswith(("//", ".version")):
                return cand
            if os.path.exists(cand):
                found = [cand]
    if not found:
        return None
    if len(found) == 1:
        return Path(found[0]).read_text(errors="replace")
    return "".join(f"// ---- {os.path.basename(f)}\n" + Path(f).read_text(errors="replace") for f in found)


def compile_one(src: str, out_o: str, arch: str, name: str) -> None:
    check_arch(arch)
    if not _IDENT_RE.match(name):
        raise BuildError(f"kernel name {name!r} is not a C identifier")
    out = Path(out_o).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    dump = Path(tempfile.mkdtemp(prefix=f".{name}.dump.", dir=out.parent))
    # Must be set before cutlass is imported: the DSL reads its environment once.
    os.environ["CUTE_DSL_ARCH"] = arch
    os.environ["CUTE_DSL_KEEP"] = "ptx"
    os.environ["CUTE_DSL_DUMP_DIR"] = str(dump)
    t0 = time.monotonic()
    from . import kcache

    kkey = kcache.kernel_key(Path(src).resolve(), arch, name) if kcache.enabled() else None
    with contextlib.ExitStack() as stack:
        if kkey is not None:
            try:  # one compile per kernel code, whoever asks first; no usable cache: compile without it
                stack.enter_context(cache.lock(kkey, wait_message=False))
            except cache.CacheError:
                kkey = None
        if kkey is not None and kcache.fetch(kkey, arch, name, out):
            shutil.rmtree(dump, ignore_errors=True)
            print(f"{name}: from the kernel cache ({kkey[:12]})", flush=True)
            return
        _compile_one(src, out, arch, name, dump, t0)
        if kkey is not None:
            kcache.store(kkey, arch, name, out)


def _compile_one(src: str, out: Path, arch: str, name: str, dump: Path, t0: float) -> None:
    import warnings

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    try:
        srcp = Path(src).resolve()
        sys.path.insert(0, str(srcp.parent))  # helper modules emitted next to the kernel files
        modname = f"mokgen_kernel_{name}"
        spec = importlib.util.spec_from_file_location(modname, srcp)
        if spec is None or spec.loader is None:
            raise BuildError(f"cannot import {srcp}")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[modname] = mod
        spec.loader.exec_module(mod)
        declared = getattr(mod, "KERNEL_NAME", name)
        if declared != name:
            raise BuildError(f"{srcp.name} declares KERNEL_NAME={declared!r}, the build expected {name!r}")
        if not callable(getattr(mod, "compile", None)):
            raise BuildError(f"{srcp.name} defines no compile(arch) function")
        compiled = mod.compile(arch)
        if compiled is None or not hasattr(compiled, "export_to_c"):
            raise BuildError(f"{srcp.name}: compile({arch!r}) must return a cute.compile(...) result, "
                             f"got {type(compiled).__name__}")
        tmp_o = out.with_name(f"{out.stem}.tmp.{os.getpid()}.o")
        compiled.export_to_c(str(tmp_o), function_name=name)
        ptx = _find_ptx(dump, compiled)
        if ptx is None:
            print(f"mokgen: warning: no PTX was produced for {name}", file=sys.stderr)
            ptx = f"// mokgen: the CuTe DSL produced no PTX for {name} ({arch})\n"
        # always rewritten (not _write_if_changed): ninja compares output mtimes with the inputs'
        ptx_path = out.with_name(f"{name}.ptx")
        tmp_ptx = ptx_path.with_name(f"{name}.tmp.{os.getpid()}.ptx")
        tmp_ptx.write_text(ptx)
        os.replace(tmp_ptx, ptx_path)
        os.replace(tmp_o, out)
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    print(f"{name}: compiled for {arch} in {time.monotonic() - t0:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mokgen.build")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c1 = sub.add_parser("compile-one", help="compile one kernel file and export it (used by build.ninja)")
    c1.add_argument("src")
    c1.add_argument("out_o")
    c1.add_argument("--arch", required=True)
    c1.add_argument("--name", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "compile-one":
        _die_with_parent()  # ninja (our parent: the rule execs us) dies -> we die
        try:
            compile_one(args.src, args.out_o, args.arch, args.name)
        except BuildError as e:
            print(f"mokgen: error: {e}", file=sys.stderr)
            return 1
        except BaseException:
            traceback.print_exc()
            print(f"mokgen: error: kernel {args.name!r} ({args.src}) failed to compile for {args.arch}",
                  file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
