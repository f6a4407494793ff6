"""On-disk cache of built kernels: keys, entry metadata and integrity, locks (packs: :mod:`mokgen.packs`).

Layout (root = ``$MOKGEN_CACHE_DIR``, else ``$XDG_CACHE_HOME/mokgen``, else ``~/.cache/mokgen``)::

    <root>/<arch>/<key[:16]>/          an entry: libmokgen.so, <kernel>.o, <kernel>.ptx, sources/, meta.json
    <root>/<arch>/<key[:16]>.tmp.<pid>  an entry being stored (renamed into place with os.replace)
    <root>/build/<arch>/<key[:16]>/    the ninja build directory of an entry being built
    <root>/locks/<key[:16]>.lock       flock lock of a key (holder pid written inside)
    <root>/runtime/                    libcute_dsl_runtime.so + its meta.json (version, sha256) from a pack
    <root>/index/<arch>/<h16>.json     warm-start index records (mokgen.index): a compile call -> its entry

Key = sha256 of the canonical JSON of {arch, DSL package versions, template hash, spec, plan, emitted files}.
``meta.json`` is written last and records every file of the entry with its size and sha256. An entry is used
only if ``meta.json`` parses, names the arch of its directory and a key matching the directory name, and every
listed file is a regular file with that size and sha256 (verified on every load: well under a millisecond for
a real entry, see README); anything else is *damaged*: rebuilt where the compiler is, refused where it is not,
never loaded.

This module owns the metadata (``Artifacts``, :func:`entry_meta`); ``mokgen.build`` compiles and imports it,
never the other way round: :func:`get_or_build` takes the build function (``mokgen.driver.get_or_build``
passes ``mokgen.build.build``).

Locks are ``fcntl.flock`` locks: the kernel drops them when the holder dies, so there are no stale lock files
to clean up by hand. They are not re-entrant: do not take the same key's lock twice in one thread. The wait
is bounded by ``timeout`` (default ``$MOKGEN_LOCK_TIMEOUT`` seconds, else 600).
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
import re
import shutil
import socket
import stat
import sys
import time
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterator, Mapping

__all__ = [
    "Artifacts",
    "CacheError",
    "DamagedEntryError",
    "Entry",
    "cache_root",
    "dsl_versions",
    "cache_key",
    "key_for",
    "content_key_for",
    "entry_meta",
    "entry_dir",
    "lock_path",
    "lock_timeout",
    "lookup",
    "probe",
    "find",
    "store",
    "lock",
    "get_or_build",
    "load_artifacts",
    "list_entries",
    "scan_entries",
    "verify",
    "clear",
    "clear_report",
    "sweep_stale",
    "runtime_library",
    "check_runtime",
    "os_error_message",
]

META_FORMAT = 2  # 2: every file with its sha256 (format 1 entries, sizes only, are not trusted)
META = "meta.json"
LIB_NAME = "libmokgen.so"
RUNTIME_LIB = "libcute_dsl_runtime.so"
MANIFEST = "MANIFEST.json"
_TVM_FFI = "apache-tvm-ffi"
_DSL_PREFIX = "nvidia-cutlass-dsl"
DEFAULT_LOCK_TIMEOUT = 600.0
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_MAX_META_BYTES = 4 << 20  # meta.json / MANIFEST.json larger than this are not read from a pack
_STALE_RE = re.compile(r"^(?P<base>[^.]+)\.(?:tmp|del)\.(?P<pid>\d+)(?:\..*)?$")


class CacheError(RuntimeError):
    """A cache operation failed (lock timeout, wrong-arch entry, bad pack, unwritable cache, ...)."""


class DamagedEntryError(CacheError):
    """A cache entry whose files do not match its ``meta.json`` (or whose ``meta.json`` is missing or bad)."""

    def __init__(self, message: str, path: Path | None = None, why: str = ""):
        super().__init__(message)
        self.path = path
        self.why = why


@dataclasses.dataclass(frozen=True)
class Artifacts:
    """What a build produced, or what a cache entry holds. ``dir`` holds ``libmokgen.so`` (``lib``),
    ``<kernel>.o``, ``<kernel>.ptx`` and ``sources/``; ``kernels`` are the exported function names; ``key`` the
    cache key of the inputs; ``meta`` what ``meta.json`` records (arch, key, DSL versions, template hash, spec,
    plan, files with sha256, ...). ``status`` says how :func:`get_or_build` got it ("cached", "built",
    "rebuilt", "waited": another process built it while this one waited on the lock) and ``note`` says it in
    words; both are empty for a plain build directory."""

    dir: Path
    lib: Path
    kernels: tuple[str, ...]
    arch: str
    key: str
    meta: Mapping[str, Any]
    status: str = dataclasses.field(default="", compare=False)
    note: str = dataclasses.field(default="", compare=False)

    def ptx(self, kernel: str) -> Path:
        return self.dir / f"{kernel}.ptx"

    def obj(self, kernel: str) -> Path:
        return self.dir / f"{kernel}.o"

    def to_dict(self) -> dict[str, Any]:
        return {
            "dir": str(self.dir),
            "lib": str(self.lib),
            "kernels": list(self.kernels),
            "arch": self.arch,
            "key": self.key,
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Artifacts":
        return cls(
            dir=Path(d["dir"]),
            lib=Path(d["lib"]),
            kernels=tuple(d["kernels"]),
            arch=str(d["arch"]),
            key=str(d["key"]),
            meta=dict(d.get("meta", {})),
        )


@dataclasses.dataclass(frozen=True)
class Entry:
    path: Path
    arch: str
    key: str
    meta: Mapping[str, Any]
    size: int
    problem: str | None = None  # None: complete and verified; else why it is damaged or misfiled

    @property
    def ok(self) -> bool:
        return self.problem is None

    @property
    def spec_name(self) -> str:
        return str(self.meta.get("spec_name") or (self.meta.get("spec") or {}).get("name") or "?")


# ----------------------------------------------------------------------------------------------------------
# file system errors, in one line with a remedy


_OS_REASONS = {
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exhausted",
    errno.ENOTDIR: "a component of the path is not a directory",
    errno.EISDIR: "it is a directory",
    errno.ENOENT: "no such file or directory",
    errno.EEXIST: "it already exists",
}


def os_error_message(e: OSError, doing: str, remedy: str | None = None, path: Any = None) -> str:
    """``cannot <doing> <path>: <reason>; <remedy>`` (one line) for an OSError."""
    where = path if path is not None else (e.filename if e.filename is not None else "")
    reason = _OS_REASONS.get(e.errno or -1) or (e.strerror or type(e).__name__).lower()
    if remedy is None:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            remedy = "free space there"
        elif e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            remedy = "choose a writable location"
    msg = f"cannot {doing}" + (f" {where}" if where != "" else "") + f": {reason}"
    return msg + (f"; {remedy}" if remedy else "")


def _cache_remedy(e: OSError) -> str:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free space on that file system, or set MOKGEN_CACHE_DIR to a directory on another one"
    if e.errno in (errno.ENOTDIR, errno.EEXIST):
        return "set MOKGEN_CACHE_DIR to a directory (or remove what is in the way)"
    return "set MOKGEN_CACHE_DIR to a writable directory"


def _cache_os_error(e: OSError, doing: str, path: Any = None) -> CacheError:
    return CacheError(os_error_message(e, doing, _cache_remedy(e), path))


# ----------------------------------------------------------------------------------------------------------
# keys


def cache_root() -> Path:
    """``$MOKGEN_CACHE_DIR``, else ``$XDG_CACHE_HOME/mokgen`` (an absolute XDG_CACHE_HOME), else
    ``~/.cache/mokgen``."""
    env = os.environ.get("MOKGEN_CACHE_DIR")
    if env:
        return Path(env).expanduser().resolve()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return (Path(xdg) / "mokgen").resolve()
    return (Path.home() / ".cache" / "mokgen").resolve()


def _root_where() -> str:
    if os.environ.get("MOKGEN_CACHE_DIR"):
        return "MOKGEN_CACHE_DIR"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return "XDG_CACHE_HOME" if xdg and os.path.isabs(xdg) else "the default cache directory"


def ensure_root() -> Path:
    """The cache root, created if needed; :class:`CacheError` with a remedy when it cannot be a writable
    directory (a file in the way, a read-only file system, no permission)."""
    root = cache_root()
    if root.exists() and not root.is_dir():
        raise CacheError(f"the cache directory {root} ({_root_where()}) is not a directory; "
                         "set MOKGEN_CACHE_DIR to a directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _cache_os_error(e, "create the cache directory", root) from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise CacheError(f"cannot write to the cache directory {root}: "
                         f"{'the file system is read-only' if _read_only_fs(root) else 'permission denied'}; "
                         "set MOKGEN_CACHE_DIR to a writable directory")
    return root


def _read_only_fs(p: Path) -> bool:
    try:
        return bool(os.statvfs(p).f_flag & os.ST_RDONLY)
    except OSError:
        return False


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


def _dsl_only(versions: Mapping[str, Any] | None) -> dict[str, str]:
    """The CuTe DSL part of a versions mapping (what a runtime library belongs to)."""
    return {str(k): str(v) for k, v in (versions or {}).items() if str(k).startswith(_DSL_PREFIX)}


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


def entry_meta(sources: Any, arch: str, key: str, kernels: Any, lib: str = LIB_NAME) -> dict[str, Any]:
    """What ``meta.json`` records about a build of ``sources`` (``store`` adds the files and their hashes)."""
    meta: dict[str, Any] = {
        "format": META_FORMAT,
        "arch": arch,
        "key": key,
        "content_key": content_key_for(sources, arch),
        "dsl_versions": dsl_versions(),
        "template_hash": getattr(sources, "template_hash", None),
        "kernels": sorted(kernels),
        "lib": lib,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": sys.version.split()[0],
    }
    _th, spec, plan, _files = _parts(sources)
    if spec is not None and not isinstance(spec, str):
        meta["spec"] = to_plain(spec)
    if plan is not None:
        meta["plan"] = to_plain(plan)
    if isinstance(spec, Mapping):
        name = spec.get("name")
    else:
        name = getattr(spec, "name", spec if isinstance(spec, str) else None)
    if name:
        meta["spec_name"] = str(name)
    return meta


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
# entries and their integrity


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _safe_rel(rel: Any) -> bool:
    if not isinstance(rel, str) or not rel or "\\" in rel or "\x00" in rel:
        return False
    p = PurePosixPath(rel)
    return not p.is_absolute() and ".." not in p.parts and "." not in p.parts and rel == str(p)


def _read_meta(d: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads((d / META).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def _file_records(meta: Mapping[str, Any], where: str) -> tuple[dict[str, dict[str, Any]] | None, str]:
    """(``{rel: {"size", "sha256"}}``, "") of a meta.json, or (None, why not)."""
    files = meta.get("files")
    if not isinstance(files, dict) or LIB_NAME not in files:
        return None, f"{where} lists no {LIB_NAME}"
    fmt = meta.get("format")
    if not isinstance(fmt, int) or fmt < META_FORMAT:
        return None, (f"{where} is format {fmt} (no content hashes: written by an older mokgen); "
                      "rebuild the entry")
    for rel, rec in files.items():
        if not _safe_rel(rel) or rel == META:
            return None, f"{where} lists an unsafe path {rel!r}"
        if not (isinstance(rec, dict) and isinstance(rec.get("size"), int) and not isinstance(rec["size"], bool)
                and isinstance(rec.get("sha256"), str) and _HEX64.match(rec["sha256"])):
            return None, f"{where} has no size and sha256 for {rel}"
    return files, ""


def _check_entry(d: Path, *, hashes: bool = True, strict: bool = False) -> tuple[dict[str, Any] | None, str]:
    """(meta, "") for a complete entry, else (None, why not). ``hashes``: compare every listed file's sha256
    (else only its size); ``strict``: also refuse files and links that ``meta.json`` does not list."""
    meta = _read_meta(d)
    if meta is None:
        return None, f"{d / META} is missing or does not parse"
    for k in ("arch", "key", "files"):
        if k not in meta:
            return None, f"{d / META} has no {k!r}"
    if not isinstance(meta["arch"], str) or not isinstance(meta["key"], str) or not _HEX64.match(meta["key"]):
        return None, f"{d / META} has a malformed arch or key"
    files, why = _file_records(meta, str(d / META))
    if files is None:
        return None, why
    for rel, rec in sorted(files.items()):
        p = d / rel
        try:
            st = os.lstat(p)
        except OSError:
            return None, f"{p} is missing"
        if not stat.S_ISREG(st.st_mode):
            return None, f"{p} is not a regular file"
        if st.st_size != rec["size"]:
            return None, f"{p} has {st.st_size} bytes, meta.json says {rec['size']}"
        if hashes:
            try:
                digest = sha256_file(p)
            except OSError as e:
                return None, f"{p} cannot be read ({e.strerror or e})"
            if digest != rec["sha256"]:
                return None, f"{p} does not match its sha256 in meta.json (changed after it was stored)"
    if strict:
        for sub, dirs, names in os.walk(d):
            for n in dirs + names:
                p = Path(sub) / n
                rel = p.relative_to(d).as_posix()
                if p.is_symlink():
                    return None, f"{p} is a symbolic link"
                if n in names and rel not in files and rel != META:
                    return None, f"{p} is not listed in meta.json"
    return meta, ""


def _misfiled(d: Path, meta: Mapping[str, Any]) -> str | None:
    arch_dir = d.parent.name
    if meta.get("arch") != arch_dir:
        return f"built for {meta.get('arch')}, filed under {arch_dir}"
    if not str(meta.get("key", "")).startswith(d.name):
        return f"meta.json key {str(meta.get('key'))[:16]} does not match the directory name {d.name}"
    return None


def inspect_entry(d: Path, *, hashes: bool = True) -> Entry:
    """An :class:`Entry` for directory ``d`` (``<root>/<arch>/<key16>``), ``problem`` set when it is damaged
    or misfiled."""
    meta, why = _check_entry(d, hashes=hashes)
    try:
        size = _dir_size(d)
    except OSError:
        size = 0
    if meta is None:
        raw = _read_meta(d) or {}
        return Entry(path=d, arch=d.parent.name, key=str(raw.get("key", "")), meta=raw, size=size,
                     problem=f"damaged: {why}")
    mis = _misfiled(d, meta)
    return Entry(path=d, arch=d.parent.name, key=meta["key"], meta=meta, size=size,
                 problem=f"misfiled: {mis}" if mis else None)


def probe(key: str, arch: str) -> tuple[Path | None, str | None]:
    """``(entry, None)`` for a complete, verified entry of ``key`` on ``arch``; ``(None, None)`` when there
    is none; ``(path, why)`` when the entry there is damaged. Wrong-arch and key-collision entries raise
    :class:`CacheError` (see :func:`lookup`)."""
    d = entry_dir(key, arch)
    if d.is_dir():
        meta, why = _check_entry(d)
        if meta is None:
            return d, why  # partial / corrupt / changed: never trusted
        if meta["arch"] != arch:
            raise CacheError(f"cache entry {d} was built for {meta['arch']}, not {arch}; "
                             f"run `mokgen cache clear --arch {arch}` or rebuild with --force")
        if meta["key"] != key:
            raise CacheError(f"cache entry {d} belongs to key {meta['key'][:16]}..., not {key[:16]}... "
                             f"(a key prefix collision); remove it: rm -r {d}")
        return d, None
    if d.exists():
        return d, f"{d} is not a directory"
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
    return None, None


def lookup(key: str, arch: str) -> Path | None:
    """The entry directory of ``key`` for ``arch`` if a complete, verified one exists, else None.

    Raises :class:`CacheError` when the entry there, or the entry of this key found under another arch's
    directory, was built for another arch: artifacts are never reused across archs silently."""
    d, why = probe(key, arch)
    return d if why is None else None


def _compiler_available() -> bool:
    try:
        return importlib.util.find_spec("cutlass") is not None
    except (ImportError, ValueError):
        return False


def find(sources: Any, arch: str, *, compiler: bool | None = None) -> Path | None:
    """The entry for ``sources`` on ``arch``: the exact key; or, on a host without the CuTe DSL (one that
    loads packed caches), an entry with the same content (arch, tvm-ffi, templates, spec, plan).

    Where the compiler is (``compiler``, default: ``cutlass`` importable) a damaged entry is a miss (the
    caller rebuilds it); where it is not, a damaged entry raises :class:`DamagedEntryError` saying what to do."""
    if compiler is None:
        compiler = _compiler_available()
    key = key_for(sources, arch)
    d, why = probe(key, arch)
    if d is not None and why is None:
        return d
    if compiler:
        return None  # a miss, or damaged: the caller (re)builds it
    if d is not None:
        raise _damaged(d, why or "")
    want = content_key_for(sources, arch)
    for e in scan_entries(arch):
        if e.meta.get("content_key") == want:
            if e.ok:
                return e.path
            raise _damaged(e.path, e.problem or "")
    return None


def _damaged(d: Path, why: str, rebuild: bool = False) -> DamagedEntryError:
    if rebuild:
        what = "rebuild it (mokgen compile SPEC --force)"
    else:
        what = ("the CuTe DSL compiler is not installed here to rebuild it: rebuild it where the compiler is and "
                "unpack a new pack, or remove it (mokgen cache clear)")
    return DamagedEntryError(f"cache entry {d} is damaged and will not be loaded ({why}); {what}", d, why)


def load_artifacts(path: str | os.PathLike, *, status: str = "", note: str = "") -> Artifacts:
    """The :class:`Artifacts` of a cache entry directory, after verifying every file against ``meta.json``
    (:class:`DamagedEntryError` if anything differs)."""
    d = Path(path)
    meta, why = _check_entry(d)
    if meta is None:
        raise DamagedEntryError(f"not a complete cache entry: {why}", d, why)
    return Artifacts(dir=d, lib=d / LIB_NAME, kernels=tuple(meta.get("kernels", ())), arch=meta["arch"],
                     key=meta["key"], meta=meta, status=status, note=note)


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


def _remove(p: Path) -> str | None:
    """Remove directory ``p`` (renamed aside first); None when it is gone, else why not."""
    aside = p.with_name(f"{p.name}.del.{os.getpid()}.{time.monotonic_ns()}")
    try:
        os.replace(p, aside)
    except FileNotFoundError:
        return None
    except OSError as e:
        return _OS_REASONS.get(e.errno or -1) or (e.strerror or str(e))
    errors: list[str] = []

    def onerror(_func: Any, path: str, exc: Any) -> None:
        err = exc[1] if isinstance(exc, tuple) else exc
        errors.append(f"{path}: {_OS_REASONS.get(getattr(err, 'errno', -1) or -1) or err}")

    shutil.rmtree(aside, onerror=onerror)
    if aside.exists():
        return f"partly removed, the rest is left in {aside} ({errors[0] if errors else 'unknown error'})"
    return None


def _copy_into(src_dir: Path, dst_dir: Path, artifacts: Any) -> dict[str, dict[str, Any]]:
    """Copy what an entry keeps; returns {relative path: {"size", "sha256"}} of the copies."""
    files: dict[str, dict[str, Any]] = {}

    def put(src: Path, rel: str) -> None:
        dst = dst_dir / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
        files[rel] = {"size": dst.stat().st_size, "sha256": sha256_file(dst)}

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


def _write_json(path: Path, doc: Any) -> None:
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def store(artifacts: Any) -> Path:
    """Copy a build's artifacts into their cache entry, atomically: into ``<entry>.tmp.<pid>`` first, with
    ``meta.json`` (every file's size and sha256) written last, then ``os.replace`` into place. Returns the
    entry directory. If a complete entry is already there it is kept (and returned); a damaged one is
    replaced. File system failures raise :class:`CacheError` naming the path and a remedy."""
    entry = entry_dir(artifacts.key, artifacts.arch)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _cache_os_error(e, "create the cache directory", entry.parent) from None
    tmp = entry.with_name(f"{entry.name}.tmp.{os.getpid()}")
    _rmtree(tmp)
    try:
        tmp.mkdir()
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
        _write_json(tmp / META, meta)  # written last
        _fsync_dir(tmp)
        if entry.exists():
            meta_there, _ = _check_entry(entry)
            if meta_there is not None and meta_there.get("key") == artifacts.key \
                    and meta_there.get("arch") == artifacts.arch:
                _rmtree(tmp)
                return entry
            _rmtree(entry)  # partial or damaged
        try:
            os.replace(tmp, entry)
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST) and _check_entry(entry)[0] is not None:
                _rmtree(tmp)  # another process stored it first
                return entry
            raise
        _fsync_dir(entry.parent)
        return entry
    except OSError as e:
        _rmtree(tmp)
        raise _cache_os_error(e, "store the cache entry", e.filename or tmp) from None
    except BaseException:
        _rmtree(tmp)
        raise


# ----------------------------------------------------------------------------------------------------------
# locks


def lock_timeout() -> float:
    """``$MOKGEN_LOCK_TIMEOUT`` (seconds, > 0) if set, else 600."""
    env = os.environ.get("MOKGEN_LOCK_TIMEOUT", "").strip()
    if not env:
        return DEFAULT_LOCK_TIMEOUT
    try:
        t = float(env)
    except ValueError:
        t = float("nan")
    if not (t > 0 and t != float("inf")):
        raise CacheError(f"MOKGEN_LOCK_TIMEOUT={env!r}: expected a number of seconds > 0")
    return t


def _lock_fields(path: Path) -> dict[str, str]:
    try:
        text = path.read_text().strip()
    except OSError:
        return {}
    return dict(f.split("=", 1) for f in text.split() if "=" in f)


def _lock_holder(path: Path) -> str:
    fields = _lock_fields(path)
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
def lock(key: str, timeout: float | None = None, *, wait_message: bool = True,
         info: dict[str, Any] | None = None) -> Iterator[Path]:
    """Exclusive lock of ``key`` across processes (``fcntl.flock`` on ``<root>/locks/<key[:16]>.lock``).

    Waits up to ``timeout`` seconds (default :func:`lock_timeout`), then raises :class:`CacheError` naming the
    lock file and the pid of the holder (written into the lock file). The kernel releases the lock if the
    holder dies. ``info`` (a dict) receives ``waited`` (seconds) and ``holder`` (the pid waited for, if any)."""
    if timeout is None:
        timeout = lock_timeout()
    path = lock_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = _try_flock(path)
    except OSError as e:
        raise _cache_os_error(e, "take the cache lock", e.filename or path) from None
    t0 = time.monotonic()
    delay = 0.02
    told = False
    holder = None
    while fd is None:
        holder = _lock_holder(path) if holder in (None, "unknown") else holder
        waited = time.monotonic() - t0
        if waited >= timeout:
            raise CacheError(f"timed out after {timeout:g} s waiting for the cache lock {path} "
                             f"(held by pid {_lock_holder(path)}); set MOKGEN_LOCK_TIMEOUT to wait longer")
        if wait_message and not told and waited > 2.0:
            print(f"mokgen: waiting for {path} (held by pid {holder}: another build of the "
                  f"same kernels)", file=sys.stderr, flush=True)
            told = True
        time.sleep(min(delay, max(0.0, timeout - waited)))
        delay = min(delay * 1.5, 0.25)
        fd = _try_flock(path)
    if info is not None:
        info["waited"] = time.monotonic() - t0 if holder is not None else 0.0
        info["holder"] = holder
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
# stale temporary directories


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(arch: str | None = None, *, held_key16: str | None = None) -> list[Path]:
    """Remove ``<key16>.tmp.<pid>`` / ``.del.<pid>`` directories of processes that are gone (a build or clear
    killed mid-way), and ``.unpack.<pid>.*`` staging directories of dead unpacks. A directory is left alone
    while its key's lock is held by someone else. ``held_key16``: the key whose lock the caller holds.
    Returns what was removed."""
    root = cache_root()
    removed: list[Path] = []
    dirs: list[Path] = []
    with contextlib.suppress(OSError):
        for ad in _arch_dirs(arch):
            dirs += [d for d in ad.iterdir() if _STALE_RE.match(d.name)]
        if root.is_dir():
            dirs += [d for d in root.iterdir() if d.name.startswith(".unpack.")]
    for d in dirs:
        if d.name.startswith(".unpack."):
            pid_s = d.name.split(".")[2]
            key16 = None
        else:
            m = _STALE_RE.match(d.name)
            assert m is not None
            pid_s, key16 = m.group("pid"), m.group("base")
        pid = int(pid_s) if pid_s.isdigit() else -1
        if pid == os.getpid() or _pid_alive(pid):
            continue
        fd = None
        if key16 is not None and key16 != held_key16 and _is_entry_name(key16):
            lp = root / "locks" / f"{key16}.lock"
            if lp.exists():
                try:
                    fd = _try_flock(lp)
                except OSError:
                    continue
                if fd is None:
                    continue  # someone is working on this key right now
        try:
            if _remove(d) is None:
                removed.append(d)
        finally:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
    return removed


# ----------------------------------------------------------------------------------------------------------
# get_or_build


def get_or_build(sources: Any, arch: str, build_fn: Callable[..., Any] | None = None, *, force: bool = False,
                 timeout: float | None = None, progress: bool = True) -> Artifacts:
    """The :class:`Artifacts` (``dir`` = the cache entry, ``status`` / ``note`` say how) of ``sources`` on
    ``arch``.

    lookup (verified); else take the key's lock, lookup again (another process may have built it meanwhile:
    then ``status`` is "waited"), build into ``<root>/build/<arch>/<key16>`` with
    ``build_fn(sources, arch, out_dir)``, store. A damaged entry is rebuilt ("rebuilt"). ``force`` rebuilds
    even if an entry exists. ``build_fn`` is required: this module does not import the compiler
    (``mokgen.driver.get_or_build`` builds with :func:`mokgen.build.build`)."""
    if build_fn is None:
        raise TypeError("cache.get_or_build needs build_fn(sources, arch, out_dir); "
                        "mokgen.driver.get_or_build builds with mokgen.build.build")
    key = key_for(sources, arch)
    damaged: str | None = None
    if not force:
        hit, damaged = probe(key, arch)
        if hit is not None and damaged is None:
            return load_artifacts(hit, status="cached", note="cached")
    ensure_root()
    info: dict[str, Any] = {}
    with lock(key, timeout=timeout, info=info, wait_message=progress):
        sweep_stale(arch, held_key16=key[:16])
        if not force:
            hit, damaged_now = probe(key, arch)
            if hit is not None and damaged_now is None:
                if info.get("waited"):
                    return load_artifacts(hit, status="waited", note=(
                        f"loaded the build of pid {info.get('holder')} (waited {info['waited']:.1f} s "
                        "on its lock)"))
                return load_artifacts(hit, status="cached", note="cached")
            damaged = damaged_now or damaged
        if damaged and progress:
            print(f"mokgen: cache entry {entry_dir(key, arch)} is damaged ({damaged}); rebuilding it",
                  file=sys.stderr, flush=True)
        out_dir = build_dir(key, arch)
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _cache_os_error(e, "create the build directory", e.filename or out_dir) from None
        t0 = time.monotonic()
        art = build_fn(sources, arch, out_dir)
        if art.key != key or art.arch != arch:
            raise CacheError(f"build produced artifacts for key {art.key[:16]}/{art.arch}, "
                             f"expected {key[:16]}/{arch}")
        if force or damaged:
            _rmtree(entry_dir(key, arch))
        entry = store(art)
        _rmtree(out_dir)  # on failure it stays, with build.log, for inspection
        took = time.monotonic() - t0
        if damaged:
            return load_artifacts(entry, status="rebuilt", note=f"rebuilt a damaged entry in {took:.1f} s")
        return load_artifacts(entry, status="built", note=f"built in {took:.1f} s")


# ----------------------------------------------------------------------------------------------------------
# listing, verifying, clearing


def _arch_dirs(arch: str | None) -> list[Path]:
    root = cache_root()
    if not root.is_dir():
        return []
    if arch is not None:
        return [root / arch] if (root / arch).is_dir() else []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("sm_"))


def _is_entry_name(name: str) -> bool:
    return len(name) == 16 and all(c in "0123456789abcdef" for c in name)


def _check_root_readable() -> None:
    root = cache_root()
    if root.exists() and not root.is_dir():
        raise CacheError(f"the cache directory {root} ({_root_where()}) is not a directory; "
                         "set MOKGEN_CACHE_DIR to a directory")


def scan_entries(arch: str | None = None, *, hashes: bool = True) -> list[Entry]:
    """Every entry directory (all archs, or one), verified: ``problem`` says which are damaged or misfiled."""
    _check_root_readable()
    out = []
    try:
        for ad in _arch_dirs(arch):
            for d in sorted(ad.iterdir()):
                if d.is_dir() and _is_entry_name(d.name):
                    out.append(inspect_entry(d, hashes=hashes))
    except OSError as e:
        raise _cache_os_error(e, "read the cache directory", e.filename or cache_root()) from None
    return out


def list_entries(arch: str | None = None) -> list[Entry]:
    """The complete, verified entries (all archs, or one)."""
    return [e for e in scan_entries(arch) if e.ok]


def verify(arch: str | None = None) -> list[Entry]:
    """Every entry, checked strictly (every listed file's sha256, nothing unlisted, no links); see
    :attr:`Entry.problem`. Also the runtime library of an unpacked pack, as an Entry named ``runtime``."""
    out = []
    for e in scan_entries(arch):
        if e.ok:
            _meta, why = _check_entry(e.path, strict=True)
            if why:
                e = dataclasses.replace(e, problem=f"damaged: {why}")
        out.append(e)
    rt = runtime_dir() / RUNTIME_LIB
    if arch is None and (rt.exists() or (runtime_dir() / META).exists()):
        why = check_runtime(rt)
        meta = _read_meta(runtime_dir()) or {}
        out.append(Entry(path=runtime_dir(), arch="-", key="runtime", meta=meta,
                         size=rt.stat().st_size if rt.exists() else 0, problem=f"damaged: {why}" if why else None))
    return out


def clear_report(arch: str | None = None) -> tuple[list[Path], list[tuple[Path, str]]]:
    """Remove the entries (complete or not), temp and build directories of ``arch`` (or of all archs).
    Keys whose lock is held (a build in progress) are kept. Returns (removed, [(kept, why)])."""
    root = cache_root()
    _check_root_readable()
    removed: list[Path] = []
    kept: list[tuple[Path, str]] = []
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
        fd = None
        if _is_entry_name(key16) and lp.parent.is_dir():
            try:
                fd = _try_flock(lp)
            except OSError:
                fd = -1  # cannot even open the lock file (read-only): removal below will say why
            if fd is None:
                kept.append((d, f"in use (lock {lp} held by pid {_lock_holder(lp)})"))
                continue
        try:
            why = _remove(d)
            if why is None:
                removed.append(d)
            else:
                kept.append((d, why))
        finally:
            if fd is not None and fd >= 0:
                with contextlib.suppress(OSError):
                    lp.unlink()
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
    for ad in _arch_dirs(arch):
        with contextlib.suppress(OSError):
            ad.rmdir()
    # the warm-start index (mokgen.index) of those archs: records of removed entries would only miss
    idx = root / "index"
    for d in ([idx / arch] if arch is not None else [idx]):
        if d.is_dir() and not d.is_symlink():
            _remove(d)
    return removed, kept


def clear(arch: str | None = None) -> int:
    """:func:`clear_report`, returning the number of directories removed."""
    return len(clear_report(arch)[0])


# ----------------------------------------------------------------------------------------------------------
# the CuTe DSL runtime library (hosts without the compiler get it from a pack)


def runtime_library() -> Path | None:
    """``libcute_dsl_runtime.so``: ``$MOKGEN_RUNTIME_LIB`` if set, else the CuTe DSL install's (found without
    importing the DSL), else the copy an unpacked pack put in ``<root>/runtime/``."""
    env = os.environ.get("MOKGEN_RUNTIME_LIB")
    if env and Path(env).is_file():
        return Path(env)
    try:
        spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for base in spec.submodule_search_locations:
            for sub in ("cu13/lib", "cu12/lib", "lib"):
                p = Path(base) / sub / RUNTIME_LIB
                if p.exists():
                    return p
    p = runtime_dir() / RUNTIME_LIB
    return p if p.exists() else None


def check_runtime(path: str | os.PathLike | None = None) -> str:
    """"" if the runtime library an unpacked pack installed (``<root>/runtime/``) matches its ``meta.json``
    (size, sha256), else why not."""
    p = Path(path) if path is not None else runtime_dir() / RUNTIME_LIB
    meta = _read_meta(p.parent)
    if meta is None:
        return f"{p.parent / META} is missing or does not parse (installed by an older mokgen?); unpack the pack again"
    try:
        st = os.lstat(p)
    except OSError:
        return f"{p} is missing"
    if not stat.S_ISREG(st.st_mode):
        return f"{p} is not a regular file"
    if st.st_size != meta.get("size"):
        return f"{p} has {st.st_size} bytes, {META} says {meta.get('size')}"
    if sha256_file(p) != meta.get("sha256"):
        return f"{p} does not match its sha256 in {META}"
    return ""


def install_runtime(src: str | os.PathLike, dsl_versions: Mapping[str, str], *, origin: str = "",
                    sha256: str | None = None) -> Path:
    """Install ``src`` as ``<root>/runtime/libcute_dsl_runtime.so`` with a ``meta.json`` recording its size,
    sha256 and CuTe DSL version (what :func:`check_runtime` verifies before a load)."""
    d = runtime_dir()
    d.mkdir(parents=True, exist_ok=True)
    dst = d / RUNTIME_LIB
    tmp = dst.with_name(f"{dst.name}.tmp.{os.getpid()}")
    shutil.copy2(src, tmp)
    digest = sha256_file(tmp)
    if sha256 is not None and digest != sha256:
        tmp.unlink()
        raise CacheError(f"{src} changed while it was installed (sha256 {digest[:12]}, expected {sha256[:12]})")
    _write_json(d / f"{META}.new", {
        "format": META_FORMAT, "file": RUNTIME_LIB, "size": tmp.stat().st_size, "sha256": digest,
        "dsl_versions": _dsl_only(dsl_versions),
        "installed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "from": origin})
    os.replace(tmp, dst)
    os.replace(d / f"{META}.new", d / META)
    return dst


def runtime_versions() -> dict[str, str]:
    """The CuTe DSL versions the unpacked runtime library belongs to (empty if unknown)."""
    return _dsl_only((_read_meta(runtime_dir()) or {}).get("dsl_versions"))
