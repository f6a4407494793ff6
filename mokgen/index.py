"""The warm-start index: what :func:`mokgen.compile` was asked for -> the cache entry it resolved.

A cache entry's key hashes the plan and the emitted sources, so finding it the full way means solving the plan
(sympy), rendering the templates (jinja2) and, where the compiler is, knowing the CuTe DSL's versions. A call
that has been answered before skips all of that: :func:`index_key` describes the call from its inputs alone,
:func:`lookup` reads the record an earlier full resolution wrote (:func:`remember`), and the driver then loads
the entry it names (every file's sha256 checked against ``meta.json``, as always) with the plan from the
entry's ``meta.json`` (``Plan.from_dict``). Neither sympy, jinja2 nor the CuTe DSL is imported on that path.

Records live in ``<cache root>/index/<arch>/<h[:16]>.json``, ``h`` the sha256 of the canonical JSON of the
index key, which holds everything the full resolution depends on besides the call's arguments, so that a
record is never used for other inputs:

* ``code``: sha256 of mokgen's own sources (every ``mokgen/*.py``: the spec parser, plan solver, emitter and
  cache key code) and of every file of the templates directory;
* ``spec``: a preset name or YAML path as the file :func:`mokgen.spec.spec_file` resolves it to, with the
  sha256 of its bytes; a mapping or a ``Spec`` as its canonical JSON;
* ``overrides`` (parsed: ``"k=v,k=v"`` and the equal mapping give one key), ``arch`` (resolved);
* ``dsl``: the ``*.dist-info`` / ``*.egg-info`` names (so versions) of ``nvidia-cutlass-dsl*`` and
  ``apache-tvm-ffi`` on ``sys.path``, listed without importing or parsing anything;
* ``tuning``: a fingerprint of the tuning database's records for the arch (``mokgen tune``): a new, cleared or
  unpacked record re-keys the arch's warm entries, so the full way decides which record applies.

The record repeats the whole key (compared on read: no hash-prefix collision is trusted) and names the entry
and its full cache key; ``exact`` says whether that was the entry of the exact key (where the compiler is, only
such records are used: that is all a full resolution there would take) or one found by content (an entry
built on another host, for hosts without the compiler). Anything unexpected (no record, a record of other
inputs, an entry that is gone, damaged or re-keyed, a runtime library that does not check out) is a miss: the
full resolution runs and writes the record again. Writing is best effort (a read-only cache just stays cold).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Mapping

from . import cache

__all__ = ["FORMAT", "index_key", "index_path", "lookup", "remember", "code_hash", "dsl_fingerprint",
           "template_dir"]

FORMAT = 1
_PKG = Path(__file__).resolve().parent
_DIST_RE = re.compile(r"^(nvidia[-_.]cutlass[-_.]dsl|apache[-_.]tvm[-_.]ffi)[^/]*\.(dist|egg)-info$", re.IGNORECASE)


def template_dir() -> Path:
    """The templates directory, found as ``mokgen.emit.TEMPLATE_DIR`` is (without importing emit / jinja2)."""
    d = _PKG / "templates"
    return d if d.is_dir() else _PKG.parent / "templates"


@functools.lru_cache(maxsize=None)
def code_hash() -> str:
    """sha256 over mokgen's modules and every template file (relative names and bytes), once per process."""
    h = hashlib.sha256()
    tdir = template_dir()
    files = [("mokgen/" + p.name, p) for p in sorted(_PKG.glob("*.py"))]
    files += [("templates/" + p.relative_to(tdir).as_posix(), p) for p in sorted(tdir.rglob("*")) if p.is_file()]
    for name, p in files:
        h.update(name.encode() + b"\0")
        h.update(p.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def _dsl_fingerprint(path_key: tuple[str, ...]) -> tuple[str, ...]:
    found = set()
    for entry in path_key:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        found.update(n for n in names if _DIST_RE.match(n))
    return tuple(sorted(found))


def dsl_fingerprint() -> list[str]:
    """The metadata directory names (``nvidia_cutlass_dsl-4.8.1.dist-info``, ...) of the CuTe DSL and tvm-ffi
    distributions on ``sys.path``: they change whenever :func:`mokgen.cache.dsl_versions` (which parses every
    installed distribution's metadata, ~40 ms) can."""
    return list(_dsl_fingerprint(tuple(sys.path)))


def _spec_ref(spec: Any) -> dict[str, Any] | None:
    from .spec import Spec, SpecError, spec_file

    if isinstance(spec, Spec):
        return {"spec": spec.to_dict()}
    if isinstance(spec, Mapping):
        try:
            return {"mapping": json.loads(cache.canonical_json(spec))}
        except (cache.CacheError, TypeError, ValueError):
            return None
    if isinstance(spec, (str, os.PathLike)):
        try:
            path = spec_file(spec)
            data = path.read_bytes()
        except (SpecError, OSError):
            return None  # the full resolution says what is wrong
        return {"file": str(path.resolve()), "sha256": hashlib.sha256(data).hexdigest()}
    return None


def _overrides_ref(overrides: Any) -> dict[str, Any] | None:
    if overrides is None:
        return {}
    try:
        if isinstance(overrides, str):
            from .plan import parse_overrides  # light: sympy is imported by the solver only

            overrides = parse_overrides(overrides, what="overrides")
        return json.loads(cache.canonical_json(dict(overrides)))
    except Exception:  # malformed: the full resolution reports it
        return None


def tuning_fingerprint(arch: str) -> str:
    """The state of the tuning database for ``arch`` (``mokgen tune``'s records: names, sizes, mtimes), hashed.
    Which record (if any) applies to a call depends on the GPU and toolchain, which the warm path does not
    determine; so any change to the records (a new tune, --clear, an unpack) re-keys every warm entry of the
    arch and the next call takes the full way, which picks the record."""
    from .tunedb import tuning_dir

    h = hashlib.sha256()
    d = tuning_dir(arch)
    try:
        for e in sorted(os.scandir(d), key=lambda e: e.name):
            if e.name.endswith(".json"):
                st = e.stat()
                h.update(f"{e.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    except FileNotFoundError:
        return "none"
    return h.hexdigest()[:16]


def index_key(spec: Any, arch: str, overrides: Any = None, *, tuning: str | None = None) -> dict[str, Any] | None:
    """The index key of ``mokgen.compile(spec, arch, overrides=...)`` for a resolved ``arch``, or None when the
    call cannot be described without the full resolution (an unknown preset, a malformed override, ...).
    ``tuning``: the state of the tuning database (default: :func:`tuning_fingerprint` of ``arch``)."""
    ref = _spec_ref(spec)
    over = _overrides_ref(overrides)
    if ref is None or over is None:
        return None
    return {"format": FORMAT, "code": code_hash(), "spec": ref, "overrides": over, "arch": arch,
            "dsl": dsl_fingerprint(), "tuning": tuning if tuning is not None else tuning_fingerprint(arch)}


def index_path(key_doc: Mapping[str, Any]) -> Path:
    h = hashlib.sha256(cache.canonical_json(key_doc).encode()).hexdigest()
    return cache.cache_root() / "index" / str(key_doc["arch"]) / f"{h[:16]}.json"


def lookup(key_doc: Mapping[str, Any], *, compiler: bool) -> tuple[Path, dict[str, Any]] | None:
    """``(entry directory, record)`` for ``key_doc``, or None. The entry is not checked here (the caller loads
    it with :func:`mokgen.cache.load_artifacts`, which verifies every file). ``compiler``: whether the CuTe DSL
    compiler is available (then only a record of the exact key's entry is used)."""
    try:
        p = index_path(key_doc)
        with open(p, "rb") as f:
            rec = json.loads(f.read(1 << 20))
    except (OSError, ValueError, cache.CacheError):
        return None
    if not isinstance(rec, dict) or rec.get("format") != FORMAT or rec.get("index_key") != json.loads(
            cache.canonical_json(key_doc)):
        return None
    entry, key = rec.get("entry"), rec.get("key")
    if not (isinstance(entry, str) and isinstance(key, str) and re.fullmatch(r"[0-9a-f]{64}", key)):
        return None
    if compiler and rec.get("exact") is not True:
        return None
    try:
        d = cache.entry_dir(key, str(key_doc["arch"]))
    except cache.CacheError:
        return None
    if entry != f"{d.parent.name}/{d.name}":
        return None
    return d, rec


def remember(key_doc: Mapping[str, Any] | None, art: Any, *, exact: bool,
             runtime: Mapping[str, Any] | None = None) -> Path | None:
    """Write the record ``key_doc`` -> ``art`` (a :class:`mokgen.cache.Artifacts` the full resolution returned)
    atomically; ``runtime``: the runtime-library hint (:func:`mokgen.ops.dsl_runtime_hint`). Returns the record's
    path, or None when nothing was written (no key, an unwritable cache: warm start is an optimisation)."""
    if key_doc is None:
        return None
    try:
        p = index_path(key_doc)
        rec = {"format": FORMAT, "index_key": json.loads(cache.canonical_json(key_doc)),
               "entry": f"{art.arch}/{Path(art.dir).name}", "key": art.key, "exact": bool(exact),
               "runtime": dict(runtime) if runtime else None}
        if cache.entry_dir(art.key, art.arch).resolve() != Path(art.dir).resolve():
            return None  # not a cache entry (a plain build directory)
        try:
            old = json.loads(p.read_text())
        except (OSError, ValueError):
            old = None
        if rec["runtime"] is None and isinstance(old, dict) and {k: old.get(k) for k in ("entry", "key")} == {
                k: rec[k] for k in ("entry", "key")}:
            rec["runtime"] = old.get("runtime")   # keep what a process that loaded the library found
        if old == rec:
            return p
        text = json.dumps(rec, sort_keys=True, indent=1) + "\n"
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f"{p.name}.tmp.{os.getpid()}")
        try:
            tmp.write_text(text)
            os.replace(tmp, p)
        finally:
            if tmp.exists():
                tmp.unlink()
        return p
    except (OSError, cache.CacheError, TypeError, ValueError):
        return None
