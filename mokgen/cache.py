"""On-disk cache of built kernels.

Layout (root = ``$MOKGEN_CACHE_DIR``, else ``~/.cache/mokgen``)::

    <root>/<arch>/<key[:16]>/          an entry: libmokgen.so, <kernel>.o, <kernel>.ptx, sources/, meta.json
    <root>/<arch>/<key[:16]>.tmp.<pid>  an entry being stored (renamed into place with os.replace)
    <root>/build/<arch>/<key[:16]>/    the ninja build directory of an entry being built
    <root>/locks/<key[:16]>.lock       flock lock of a key (holder pid written inside)
    <root>/runtime/                    libcute_dsl_runtime.so from an unpacked pack (hosts without the DSL)

Key = sha256 of the canonical JSON of {arch, DSL package versions, template hash, spec, plan}. ``meta.json`` is
written last and records the file list with sizes; an entry whose ``meta.json`` is missing, does not parse,
names another arch or key, or whose files are missing is never used (and is rebuilt).

Locks are ``fcntl.flock`` locks: the kernel drops them when the holder dies, so there are no stale lock files
to clean up by hand. They are not re-entrant: do not take the same key's lock twice in one thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import socket
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

__all__ = [
    "CacheError",
    "Entry",
    "cache_root",
    "dsl_versions",
    "cache_key",
    "key_for",
    "content_key_for",
    "entry_dir",
    "lock_path",
    "lookup",
    "find",
    "store",
    "lock",
    "get_or_build",
    "load_artifacts",
    "list_entries",
    "clear",
    "pack",
    "unpack",
    "runtime_library",
]

META_FORMAT = 1
META = "meta.json"
LIB_NAME = "libmokgen.so"
RUNTIME_LIB = "libcute_dsl_runtime.so"
_TVM_FFI = "apache-tvm-ffi"
_DSL_PREFIX = "nvidia-cutlass-dsl"


class CacheError(RuntimeError):
    """A cache operation failed (lock timeout, wrong-arch entry, bad pack, ...)."""


@dataclasses.dataclass(frozen=True)
class Entry:
    path: Path
    arch: str
    key: str
    meta: Mapping[str, Any]
    size: int

    @property
    def spec_name(self) -> str:
        return str(self.meta.get("spec_name") or (self.meta.get("spec") or {}).get("name") or "?")


# ----------------------------------------------------------------------------------------------------------
# keys


def cache_root() -> Path:
    env = os.environ.get("MOKGEN_CACHE_DIR")
    if env:
        return Path(env).expanduser().resolve()
    return (Path.home() / ".cache" / "mokgen").resolve()


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


@functools.lru_cache(maxsize=None)
def _dsl_versions_cached(path_key: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        try:
            name = _norm(dist.metadata["Name"] or "")
        except Exception:
            continue
        if name.startswith(_DSL_PREFIX) or name == _TVM_FFI:
            found.setdefault(name, dist.version)
    return tuple(sorted(found.items()))


def dsl_versions() -> dict[str, str]:
    """``{distribution: version}`` of the installed ``nvidia-cutlass-dsl*`` packages and ``apache-tvm-ffi``."""
    return dict(_dsl_versions_cached(tuple(sys.path)))


def to_plain(obj: Any) -> Any:
    """A JSON-able value for a Spec / Plan (``to_dict()``), a dataclass, a mapping or a plain value."""
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    if hasattr(obj, "to_dict"):
        return to_plain(obj.to_dict())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_plain(dataclasses.asdict(obj))
    if isinstance(obj, Mapping):
        return {str(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    raise CacheError(f"cannot hash a {type(obj).__name__} into a cache key")


def canonical_json(obj: Any) -> str:
    return json.dumps(to_plain(obj), sort_keys=True, separators=(",", ":"))


def files_hash(files: Mapping[str, str]) -> str:
    """sha256 of the canonical JSON of the emitted files (name -> text)."""
    return hashlib.sha256(canonical_json(dict(files)).encode()).hexdigest()


def cache_key(arch: str, template_hash: str | None, spec: Any, plan: Any, versions: Mapping[str, str] | None = None,
              files: Mapping[str, str] | None = None) -> str:
    """sha256 (hex) of the canonical JSON of {arch, DSL versions, template hash, spec, plan} (and, when given,
    the hash of the emitted files themselves: what is compiled is exactly what is keyed)."""
    doc = {
        "arch": arch,
        "dsl": dict(dsl_versions() if versions is None else versions),
        "template_hash": template_hash,
        "spec": to_plain(spec),
        "plan": to_plain(plan),
    }
    if files is not None:
        doc["files"] = files_hash(files)
    return hashlib.sha256(canonical_json(doc).encode()).hexdigest()


def _parts(sources: Any) -> tuple[Any, Any, Any, Mapping[str, str]]:
    """(template hash, spec, plan, files) of a Sources (or of a bare mapping of files)."""
    if isinstance(sources, Mapping):
        return None, None, None, sources
    plan = getattr(sources, "plan", None)
    spec = getattr(sources, "spec", None)
    if spec is None and plan is not None:
        spec = getattr(plan, "spec", None)
    if spec is None:
        spec = getattr(sources, "spec_name", None)
    return getattr(sources, "template_hash", None), spec, plan, sources.files


def key_for(sources: Any, arch: str) -> str:
    """The cache key of a ``mokgen.emit.Sources`` (or a mapping file name -> text) for ``arch``."""
    th, spec, plan, files = _parts(sources)
    return cache_key(arch, th, spec, plan, files=files)


def content_key_for(sources: Any, arch: str) -> str:
    """The key without the compiler's versions (tvm-ffi's, the runtime ABI, stays in): how a host that has
    no CuTe DSL installed finds an entry someone else compiled (see :func:`find`)."""
    tvm = {k: v for k, v in dsl_versions().items() if k == _TVM_FFI}
    th, spec, plan, files = _parts(sources)
    return cache_key(arch, th, spec, plan, versions=tvm, files=files)


def entry_dir(key: str, arch: str) -> Path:
    if not key or any(c not in "0123456789abcdef" for c in key):
        raise CacheError(f"bad cache key {key!r}: expected a sha256 hex digest")
    if not arch or "/" in arch or arch.startswith("."):
        raise CacheError(f"bad arch {arch!r}")
    return cache_root() / arch / key[:16]


def lock_path(key: str) -> Path:
    return cache_root() / "locks" / f"{key[:16]}.lock"


def build_dir(key: str, arch: str) -> Path:
    return cache_root() / "build" / arch / key[:16]


def runtime_dir() -> Path:
    return cache_root() / "runtime"


# ----------------------------------------------------------------------------------------------------------
# entries


def _read_meta(d: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads((d / META).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def _check_entry(d: Path) -> tuple[dict[str, Any] | None, str]:
    """(meta, "") for a complete entry, else (None or meta, why not)."""
    meta = _read_meta(d)
    if meta is None:
        return None, f"{d / META} is missing or does not parse"
    for k in ("arch", "key", "files"):
        if k not in meta:
            return None, f"{d / META} has no {k!r}"
    files = meta["files"]
    if not isinstance(files, dict) or LIB_NAME not in files:
        return None, f"{d / META} lists no {LIB_NAME}"
    for rel, size in files.items():
        p = d / rel
        try:
            if p.stat().st_size != size:
                return None, f"{p} has {p.stat().st_size} bytes, meta.json says {size}"
        except OSError:
            return None, f"{p} is missing"
    return meta, ""


def lookup(key: str, arch: str) -> Path | None:
    """The entry directory of ``key`` for ``arch`` if a complete one exists, else None.

    Raises :class:`CacheError` when the entry there, or the entry of this key found under another arch's
    directory, was built for another arch: artifacts are never reused across archs silently."""
    d = entry_dir(key, arch)
    if d.is_dir():
        meta, _why = _check_entry(d)
        if meta is None:
            return None  # partial / corrupt: never trusted, rebuilt by get_or_build
        if meta["arch"] != arch:
            raise CacheError(f"cache entry {d} was built for {meta['arch']}, not {arch}; "
                             f"run `mokgen cache clear --arch {arch}` or rebuild with --force")
        if meta["key"] != key:
            raise CacheError(f"cache entry {d} belongs to key {meta['key'][:16]}..., not {key[:16]}... "
                             f"(a key prefix collision); remove it: rm -r {d}")
        return d
    root = cache_root()
    if root.is_dir():
        for other in sorted(root.iterdir()):
            if other.name == arch or not other.is_dir():
                continue
            od = other / key[:16]
            meta = _read_meta(od) if od.is_dir() else None
            if meta and meta.get("key") == key:
                raise CacheError(f"the cache entry for this key ({od}) was built for {meta.get('arch')}, "
                                 f"not {arch}; build it for {arch} (mokgen compile SPEC --arch {arch})")
    return None


def find(sources: Any, arch: str) -> Path | None:
    """The entry for ``sources`` on ``arch``: the exact key; or, on a host without the CuTe DSL (one that
    loads packed caches), an entry with the same content (arch, tvm-ffi, templates, spec, plan)."""
    hit = lookup(key_for(sources, arch), arch)
    if hit is not None or importlib.util.find_spec("cutlass") is not None:
        return hit
    want = content_key_for(sources, arch)
    for e in list_entries(arch):
        if e.meta.get("content_key") == want:
            return e.path
    return None


def load_artifacts(path: str | os.PathLike) -> "Any":
    """The :class:`mokgen.build.Artifacts` of a cache entry directory."""
    from .build import Artifacts

    d = Path(path)
    meta, why = _check_entry(d)
    if meta is None:
        raise CacheError(f"not a complete cache entry: {why}")
    return Artifacts(dir=d, lib=d / LIB_NAME, kernels=tuple(meta.get("kernels", ())), arch=meta["arch"],
                     key=meta["key"], meta=meta)


def _dir_size(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def _rmtree(p: Path) -> None:
    """Remove ``p`` quickly and safely: rename it aside first, so a half-removed entry is never seen."""
    if not p.exists():
        return
    aside = p.with_name(f"{p.name}.del.{os.getpid()}.{time.monotonic_ns()}")
    try:
        os.replace(p, aside)
    except OSError:
        aside = p
    shutil.rmtree(aside, ignore_errors=True)


def _copy_into(src_dir: Path, dst_dir: Path, artifacts: Any) -> dict[str, int]:
    """Copy what an entry keeps; returns {relative path: size}."""
    files: dict[str, int] = {}

    def put(src: Path, rel: str) -> None:
        dst = dst_dir / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
        files[rel] = dst.stat().st_size

    put(Path(artifacts.lib), LIB_NAME)
    for k in artifacts.kernels:
        for ext in ("o", "ptx"):
            p = src_dir / f"{k}.{ext}"
            if p.exists():
                put(p, f"{k}.{ext}")
    if (src_dir / "build.log").exists():
        put(src_dir / "build.log", "build.log")
    srcs = src_dir / "sources"
    if srcs.is_dir():
        for p in sorted(srcs.rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts:
                put(p, str(Path("sources") / p.relative_to(srcs)))
    return files


def _fsync_dir(d: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def store(artifacts: Any) -> Path:
    """Copy a build's artifacts into their cache entry, atomically: into ``<entry>.tmp.<pid>`` first, with
    ``meta.json`` written last, then ``os.replace`` into place. Returns the entry directory. If a complete
    entry is already there it is kept (and returned); a partial one is replaced."""
    entry = entry_dir(artifacts.key, artifacts.arch)
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.with_name(f"{entry.name}.tmp.{os.getpid()}")
    _rmtree(tmp)
    tmp.mkdir()
    try:
        files = _copy_into(Path(artifacts.dir), tmp, artifacts)
        meta = dict(artifacts.meta)
        meta.update({
            "format": META_FORMAT,
            "arch": artifacts.arch,
            "key": artifacts.key,
            "kernels": list(artifacts.kernels),
            "files": files,
            "stored_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "stored_by": {"pid": os.getpid(), "host": socket.gethostname()},
        })
        mtmp = tmp / f"{META}.tmp"
        with open(mtmp, "w") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(mtmp, tmp / META)  # written last
        _fsync_dir(tmp)
        if entry.exists():
            meta_there, _ = _check_entry(entry)
            if meta_there is not None and meta_there.get("key") == artifacts.key \
                    and meta_there.get("arch") == artifacts.arch:
                _rmtree(tmp)
                return entry
            _rmtree(entry)  # partial or corrupt
        try:
            os.replace(tmp, entry)
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST) and _check_entry(entry)[0] is not None:
                _rmtree(tmp)  # another process stored it first
                return entry
            raise
        _fsync_dir(entry.parent)
        return entry
    except BaseException:
        _rmtree(tmp)
        raise


# ----------------------------------------------------------------------------------------------------------
# locks


def _lock_holder(path: Path) -> str:
    try:
        text = path.read_text().strip()
    except OSError:
        return "unknown"
    if not text:
        return "unknown"
    fields = dict(f.split("=", 1) for f in text.split() if "=" in f)
    pid = fields.get("pid", "unknown")
    host = fields.get("host")
    return f"{pid}" + (f" on {host}" if host and host != socket.gethostname() else "")


def _try_flock(path: Path) -> int | None:
    """An fd holding an exclusive flock on ``path``, or None if another holder has it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return None
            raise
        # The file may have been unlinked (cache clear) between our open and our flock: then our lock is on
        # a dead inode and means nothing. Retry on the current file.
        try:
            st = os.stat(path)
        except FileNotFoundError:
            os.close(fd)
            continue
        fst = os.fstat(fd)
        if (st.st_ino, st.st_dev) != (fst.st_ino, fst.st_dev):
            os.close(fd)
            continue
        return fd


@contextlib.contextmanager
def lock(key: str, timeout: float = 600, *, wait_message: bool = True) -> Iterator[Path]:
    """Exclusive lock of ``key`` across processes (``fcntl.flock`` on ``<root>/locks/<key[:16]>.lock``).

    Waits up to ``timeout`` seconds, then raises :class:`CacheError` naming the lock file and the pid of the
    holder (written into the lock file). The kernel releases the lock if the holder dies."""
    path = lock_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    delay = 0.02
    told = False
    while True:
        fd = _try_flock(path)
        if fd is not None:
            break
        waited = time.monotonic() - t0
        if waited >= timeout:
            raise CacheError(f"timed out after {timeout:g} s waiting for the cache lock {path} "
                             f"(held by pid {_lock_holder(path)})")
        if wait_message and not told and waited > 2.0:
            print(f"mokgen: waiting for {path} (held by pid {_lock_holder(path)}: another build of the "
                  f"same kernels)", file=sys.stderr, flush=True)
            told = True
        time.sleep(min(delay, max(0.0, timeout - waited)))
        delay = min(delay * 1.5, 0.25)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid={os.getpid()} host={socket.gethostname()} since={int(time.time())}\n".encode(), 0)
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


# ----------------------------------------------------------------------------------------------------------
# get_or_build


def get_or_build(sources: Any, arch: str, build_fn: Callable[..., Any] | None = None, *, force: bool = False,
                 timeout: float = 600, jobs: int | None = None, progress: bool = True) -> Any:
    """The :class:`mokgen.build.Artifacts` (``dir`` = the cache entry) of ``sources`` on ``arch``.

    lookup; else take the key's lock, lookup again (another process may have built it meanwhile), build
    into ``<root>/build/<arch>/<key16>`` with ``build_fn(sources, arch, out_dir)`` (default
    :func:`mokgen.build.build`), store. ``force`` rebuilds even if an entry exists."""
    if build_fn is None:
        from . import build as _build

        def build_fn(s: Any, a: str, d: Path) -> Any:
            return _build.build(s, a, d, jobs=jobs, progress=progress)

    key = key_for(sources, arch)
    if not force:
        hit = lookup(key, arch)
        if hit is not None:
            return load_artifacts(hit)
    with lock(key, timeout=timeout):
        if not force:
            hit = lookup(key, arch)
            if hit is not None:
                return load_artifacts(hit)
        out_dir = build_dir(key, arch)
        out_dir.mkdir(parents=True, exist_ok=True)
        art = build_fn(sources, arch, out_dir)
        if art.key != key or art.arch != arch:
            raise CacheError(f"build produced artifacts for key {art.key[:16]}/{art.arch}, "
                             f"expected {key[:16]}/{arch}")
        if force:
            _rmtree(entry_dir(key, arch))
        entry = store(art)
        _rmtree(out_dir)  # on failure it stays, with build.log, for inspection
        return load_artifacts(entry)


# ----------------------------------------------------------------------------------------------------------
# listing, clearing


def _arch_dirs(arch: str | None) -> list[Path]:
    root = cache_root()
    if not root.is_dir():
        return []
    if arch is not None:
        return [root / arch] if (root / arch).is_dir() else []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("sm_"))


def _is_entry_name(name: str) -> bool:
    return len(name) == 16 and all(c in "0123456789abcdef" for c in name)


def list_entries(arch: str | None = None) -> list[Entry]:
    """The complete entries (all archs, or one)."""
    out = []
    for ad in _arch_dirs(arch):
        for d in sorted(ad.iterdir()):
            if not (d.is_dir() and _is_entry_name(d.name)):
                continue
            meta, _ = _check_entry(d)
            if meta is None or meta.get("arch") != ad.name:
                continue
            out.append(Entry(path=d, arch=ad.name, key=meta["key"], meta=meta, size=_dir_size(d)))
    return out


def clear(arch: str | None = None) -> int:
    """Remove the entries (complete or not), temp and build directories of ``arch`` (or of all archs).
    Keys whose lock is held (a build in progress) are skipped. Returns the number of directories removed."""
    root = cache_root()
    n = 0
    dirs: list[Path] = []
    for ad in _arch_dirs(arch):
        dirs += [d for d in ad.iterdir() if d.is_dir()]
        bd = root / "build" / ad.name
        if bd.is_dir():
            dirs += [d for d in bd.iterdir() if d.is_dir()]
    if arch is None and (root / "build").is_dir():
        dirs += [d for d in (root / "build").iterdir() if d.is_dir() and not d.name.startswith("sm_")]
    for d in sorted(set(dirs)):
        key16 = d.name.split(".", 1)[0]
        lp = root / "locks" / f"{key16}.lock"
        fd = _try_flock(lp) if (_is_entry_name(key16) and lp.parent.is_dir()) else None
        if _is_entry_name(key16) and lp.parent.is_dir() and fd is None:
            print(f"mokgen: {d} is in use (lock {lp} held by pid {_lock_holder(lp)}); kept", file=sys.stderr)
            continue
        try:
            _rmtree(d)
            n += 1
        finally:
            if fd is not None:
                with contextlib.suppress(OSError):
                    lp.unlink()
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
    for ad in _arch_dirs(arch):
        with contextlib.suppress(OSError):
            ad.rmdir()
    return n


# ----------------------------------------------------------------------------------------------------------
# pack / unpack (prebuilt caches for hosts without the compiler)


def runtime_library() -> Path | None:
    """``libcute_dsl_runtime.so``: ``$MOKGEN_RUNTIME_LIB`` if set, else the CuTe DSL install's (found without
    importing the DSL), else the copy an unpacked pack put in ``<root>/runtime/``."""
    env = os.environ.get("MOKGEN_RUNTIME_LIB")
    if env and Path(env).is_file():
        return Path(env)
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    if spec is not None and spec.submodule_search_locations:
        for base in spec.submodule_search_locations:
            for sub in ("cu13/lib", "cu12/lib", "lib"):
                p = Path(base) / sub / RUNTIME_LIB
                if p.exists():
                    return p
    p = runtime_dir() / RUNTIME_LIB
    return p if p.exists() else None


def _dsl_runtime_for_pack() -> Path:
    p = runtime_library()
    if p is not None:
        return p
    try:
        from .build import runtime_libraries

        for q in runtime_libraries():
            if Path(q).name == RUNTIME_LIB:
                return Path(q)
    except Exception:
        pass
    raise CacheError(f"cannot find {RUNTIME_LIB} (is nvidia-cutlass-dsl installed? or set MOKGEN_RUNTIME_LIB)")


def pack(out_tar: str | os.PathLike, arch: str | None = None) -> Path:
    """Write the complete entries (of ``arch``, or all) and ``runtime/libcute_dsl_runtime.so`` into a
    ``.tar.xz`` that :func:`unpack` installs on another host (one without the compiler)."""
    entries = list_entries(arch)
    if not entries:
        raise CacheError(f"nothing to pack: no complete cache entries{' for ' + arch if arch else ''} in "
                         f"{cache_root()}")
    out = Path(out_tar).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    rt = _dsl_runtime_for_pack()
    manifest = {
        "format": META_FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "dsl_versions": dsl_versions(),
        "entries": [{"arch": e.arch, "key": e.key, "spec": e.spec_name, "kernels": e.meta.get("kernels", [])}
                    for e in entries],
        "runtime": f"runtime/{RUNTIME_LIB}",
    }
    tmp = out.with_name(f"{out.name}.tmp.{os.getpid()}")
    try:
        # preset 1: 5 s for the 43 MB runtime instead of 30 s at the default, for 2 MB more
        with tarfile.open(tmp, "w:xz", preset=1) as tf:
            data = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
            info = tarfile.TarInfo("MANIFEST.json")
            info.size = len(data)
            info.mtime = int(time.time())
            import io

            tf.addfile(info, io.BytesIO(data))
            tf.add(rt, arcname=f"runtime/{RUNTIME_LIB}")
            for e in entries:
                tf.add(e.path, arcname=f"{e.arch}/{e.path.name}")
        os.replace(tmp, out)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return out


def unpack(tar: str | os.PathLike) -> dict[str, Any]:
    """Install the entries of a pack into this host's cache (all archs kept; :func:`lookup` is per arch)
    and its runtime library into ``<root>/runtime/``. Each entry's ``meta.json`` is verified (parses, names
    the arch of its directory and a key matching the directory name, files present with the listed sizes);
    entries that fail are refused. Returns ``{"installed": [...], "present": [...], "refused": [(name, why)],
    "runtime": path | None}``."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    tarp = Path(tar)
    if not tarp.is_file():
        raise CacheError(f"no such pack: {tarp}")
    stage = Path(tempfile.mkdtemp(prefix=f".unpack.{os.getpid()}.", dir=root))
    result: dict[str, Any] = {"installed": [], "present": [], "refused": [], "runtime": None}
    try:
        try:
            with tarfile.open(tarp, "r:*") as tf:
                for m in tf.getmembers():
                    parts = Path(m.name).parts
                    if m.name.startswith("/") or ".." in parts or not (m.isfile() or m.isdir()):
                        raise CacheError(f"{tarp}: refusing unsafe member {m.name!r}")
                if hasattr(tarfile, "data_filter"):
                    tf.extractall(stage, filter="data")
                else:  # pragma: no cover - python < 3.11.4
                    tf.extractall(stage)
        except (tarfile.TarError, OSError, EOFError) as e:
            raise CacheError(f"{tarp} is not a readable mokgen pack: {e}") from None
        rt = stage / "runtime" / RUNTIME_LIB
        if rt.is_file():
            runtime_dir().mkdir(parents=True, exist_ok=True)
            dst = runtime_dir() / RUNTIME_LIB
            tmp = dst.with_name(f"{dst.name}.tmp.{os.getpid()}")
            shutil.copy2(rt, tmp)
            os.replace(tmp, dst)
            result["runtime"] = dst
        for ad in sorted(p for p in stage.iterdir() if p.is_dir() and p.name.startswith("sm_")):
            for d in sorted(ad.iterdir()):
                name = f"{ad.name}/{d.name}"
                if not (d.is_dir() and _is_entry_name(d.name)):
                    result["refused"].append((name, "not a cache entry directory"))
                    continue
                meta, why = _check_entry(d)
                if meta is None:
                    result["refused"].append((name, why.replace(str(stage) + "/", "")))
                    continue
                if meta["arch"] != ad.name:
                    result["refused"].append((name, f"meta.json says arch {meta['arch']}, the entry is filed "
                                                    f"under {ad.name}"))
                    continue
                if not str(meta["key"]).startswith(d.name):
                    result["refused"].append((name, f"meta.json key {str(meta['key'])[:16]} does not match"))
                    continue
                dst = root / ad.name / d.name
                with lock(meta["key"], timeout=60):
                    if dst.exists() and _check_entry(dst)[0] is not None:
                        result["present"].append(dst)
                        continue
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    _rmtree(dst)
                    os.replace(d, dst)
                result["installed"].append(dst)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return result
