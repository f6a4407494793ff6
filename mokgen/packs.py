"""Packs of the kernel cache for hosts without the compiler: ``mokgen cache pack`` / ``mokgen cache unpack``.

A pack is a tar.xz of the intact cache entries (every file's size and sha256 in its ``MANIFEST.json``), the CuTe
DSL runtime library they load (its version and sha256), and the tuning records (:mod:`mokgen.tunedb`);
:func:`unpack` verifies every member (paths, types, sizes, sha256) before it writes anything, and installs all
or nothing. It sits above the cache (:mod:`mokgen.cache`: keys, entries, locks) and the tuning database, and
uses both through their own functions.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path, PurePosixPath
from typing import Any

from . import cache

__all__ = ["pack", "unpack"]


def _dsl_runtime_for_pack() -> Path:
    p = cache.runtime_library()
    if p is not None and not str(p).startswith(str(cache.runtime_dir())):
        return p
    try:
        from cutlass.cute.runtime import find_runtime_libraries  # type: ignore

        for q in find_runtime_libraries(enable_tvm_ffi=True):
            if Path(q).name == cache.RUNTIME_LIB:
                return Path(q)
    except Exception:
        pass
    if p is not None:
        return p
    raise cache.CacheError(f"cannot find {cache.RUNTIME_LIB} (is nvidia-cutlass-dsl installed? or set "
                           "MOKGEN_RUNTIME_LIB)")


def _pack_runtime_versions(rt: Path) -> dict[str, str]:
    if str(rt).startswith(str(cache.runtime_dir())):
        return cache.runtime_versions()
    return cache._dsl_only(cache.dsl_versions())


# ----------------------------------------------------------------------------------------------------------
# pack / unpack (prebuilt caches for hosts without the compiler)


def pack(out_tar: str | os.PathLike, arch: str | None = None, runtime: bool = True) -> Path:
    """Write the complete, verified entries (of ``arch``, or all) and ``runtime/libcute_dsl_runtime.so``
    (with its version and sha256 in ``MANIFEST.json``) into a ``.tar.xz`` that :func:`unpack` installs on
    another host (one without the compiler). Damaged entries are left out, with a warning.

    ``runtime=False``: the entries alone (the 43 MB runtime library is most of a pack's size), for a host
    with the CuTe DSL installed: its cache keys include the DSL's package versions, so it uses the entries
    where they match its own (else it builds, as without the pack). A host with neither the DSL nor a runtime
    library refuses to load them with a message saying so (``mokgen.driver``)."""
    out = Path(out_tar).expanduser().resolve()
    if out.is_dir():
        raise cache.CacheError(f"cannot write the pack {out}: it is a directory; name the file to write, "
                         f"e.g. {out / 'kernels.tar.xz'}")
    all_entries = cache.scan_entries(arch)
    rt = _dsl_runtime_for_pack() if runtime else None
    rt_versions = _pack_runtime_versions(rt) if rt is not None else {}
    entries = []
    for e in all_entries:
        if not e.ok:
            print(f"mokgen: not packing {e.path}: {e.problem}", file=sys.stderr, flush=True)
        elif rt_versions and cache._dsl_only(e.meta.get("dsl_versions")) not in ({}, rt_versions):
            print(f"mokgen: not packing {e.path}: built with CuTe DSL "
                  f"{cache._dsl_only(e.meta.get('dsl_versions')).get(cache._DSL_PREFIX)}, the runtime packed is "
                  f"{rt_versions.get(cache._DSL_PREFIX)}", file=sys.stderr, flush=True)
        else:
            entries.append(e)
    if not entries:
        raise cache.CacheError(f"nothing to pack: no complete cache entries{' for ' + arch if arch else ''} in "
                         f"{cache.cache_root()}")
    tuning = _tuning_files(arch)
    manifest = {
        "tuning": {rel: {"size": (cache.cache_root() / rel).stat().st_size,
                         "sha256": cache.sha256_file(cache.cache_root() / rel)}
                   for rel in tuning},
        "format": cache.META_FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "dsl_versions": cache.dsl_versions(),
        "entries": [{"arch": e.arch, "key": e.key, "spec": e.spec_name, "kernels": e.meta.get("kernels", [])}
                    for e in entries],
    }
    if rt is not None:
        manifest["runtime"] = {"path": f"runtime/{cache.RUNTIME_LIB}", "size": rt.stat().st_size,
                               "sha256": cache.sha256_file(rt), "dsl_versions": rt_versions}
    tmp = out.with_name(f"{out.name}.tmp.{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        # preset 1: 5 s for the 43 MB runtime instead of 30 s at the default, for 2 MB more
        with tarfile.open(tmp, "w:xz", preset=1) as tf:
            data = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
            info = tarfile.TarInfo(cache.MANIFEST)
            info.size = len(data)
            info.mtime = int(time.time())
            tf.addfile(info, io.BytesIO(data))
            if rt is not None:
                tf.add(rt, arcname=f"runtime/{cache.RUNTIME_LIB}")
            for e in entries:  # what meta.json lists, and meta.json: nothing else travels
                for rel in sorted(e.meta["files"]) + [cache.META]:
                    tf.add(e.path / rel, arcname=f"{e.arch}/{e.path.name}/{rel}", recursive=False)
            for rel in tuning:  # the tuning database's intact records (sha256 in the manifest)
                tf.add(cache.cache_root() / rel, arcname=rel, recursive=False)
        os.replace(tmp, out)
    except OSError as e:
        raise cache.CacheError(cache.os_error_message(e, "write the pack", "choose another output path or free space",
                                          e.filename or out)) from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return out


_MEMBER_RE = re.compile(r"^(?:MANIFEST\.json|runtime(?:/libcute_dsl_runtime\.so)?|sm_[0-9a-z]+(?:/[0-9a-f]{16}(?:/.+)?)?"
                        r"|tuning(?:/sm_[0-9a-z]+(?:/[0-9a-f]{16}\.json)?)?)$")


def _tuning_files(arch: str | None) -> list[str]:
    """The intact tuning records (``tuning/<arch>/<key16>.json``, see mokgen.tunedb) to pack."""
    from . import tunedb

    out = []
    for path, doc, why in tunedb.list_records(arch):
        if doc is None:
            print(f"mokgen: not packing {path}: {why}", file=sys.stderr, flush=True)
        else:
            out.append(f"{tunedb.DIRNAME}/{path.parent.name}/{path.name}")
    return out


def _scan_pack(tarp: Path) -> tuple[dict[str, tuple[int, str]], dict[str, bytes], list[str], set[str]]:
    """Read a pack without writing anything: ({file: (size, sha256)}, {small json member: bytes},
    problems, dirs)."""
    files: dict[str, tuple[int, str]] = {}
    small: dict[str, bytes] = {}
    dirs: set[str] = set()
    problems: list[str] = []
    try:
        with tarfile.open(tarp, "r:*") as tf:
            for m in tf:
                name = m.name.rstrip("/")
                if name.startswith("./"):
                    name = name[2:]
                parts = PurePosixPath(name).parts
                if m.name.startswith("/") or ".." in parts or not name or not _MEMBER_RE.match(name):
                    problems.append(f"unsafe or unexpected member {m.name!r}")
                    continue
                if m.isdir():
                    dirs.add(name)
                    continue
                if not m.isfile():
                    problems.append(f"member {m.name!r} is not a regular file (links and devices are refused)")
                    continue
                if name in files:
                    problems.append(f"member {m.name!r} appears twice")
                    continue
                f = tf.extractfile(m)
                assert f is not None
                h = hashlib.sha256()
                keep = name == cache.MANIFEST or name.endswith("/" + cache.META) or name.startswith("tuning/")
                buf = bytearray()
                n = 0
                while chunk := f.read(1 << 20):
                    h.update(chunk)
                    n += len(chunk)
                    if keep and n <= cache._MAX_META_BYTES:
                        buf += chunk
                files[name] = (n, h.hexdigest())
                if keep:
                    if n > cache._MAX_META_BYTES:
                        problems.append(f"{name} is too large ({n} bytes)")
                    else:
                        small[name] = bytes(buf)
    except (tarfile.TarError, OSError, EOFError, ValueError) as e:
        raise cache.CacheError(f"{tarp} is not a readable mokgen pack: {e}") from None
    return files, small, problems, dirs


def _verify_pack(tarp: Path) -> dict[str, Any]:
    """Check every member of a pack (paths, types, sizes, sha256, metadata); raise :class:`CacheError` naming
    the problems if anything is wrong. Writes nothing. Returns what to install."""
    files, small, problems, _dirs = _scan_pack(tarp)
    manifest: dict[str, Any] = {}
    if cache.MANIFEST not in small:
        problems.append(f"no {cache.MANIFEST} (not a mokgen pack)")
    else:
        try:
            manifest = json.loads(small[cache.MANIFEST])
            assert isinstance(manifest, dict)
        except Exception:
            problems.append(f"{cache.MANIFEST} does not parse")
            manifest = {}
    rt_name = f"runtime/{cache.RUNTIME_LIB}"
    rt = manifest.get("runtime")
    runtime: dict[str, Any] | None = None
    fmt = manifest.get("format") if manifest else None
    if manifest and (not isinstance(fmt, int) or fmt < cache.META_FORMAT):
        problems.append(f"{cache.MANIFEST} is format {fmt} (a pack from an older mokgen, without "
                        "content hashes); pack it again with this mokgen")
    elif manifest:
        if rt_name in files:
            if not (isinstance(rt, dict) and rt.get("path") == rt_name):
                problems.append(f"{rt_name} is not described in {cache.MANIFEST}")
            elif (rt.get("size"), rt.get("sha256")) != files[rt_name]:
                problems.append(f"{rt_name} does not match its size and sha256 in {cache.MANIFEST}")
            else:
                runtime = {"size": rt["size"], "sha256": rt["sha256"],
                           "dsl_versions": cache._dsl_only(rt.get("dsl_versions"))}
        elif rt is not None:
            problems.append(f"{cache.MANIFEST} names a runtime library the pack does not hold")
    # the entries: every file listed in meta.json with its size and sha256, nothing else
    by_entry: dict[str, list[str]] = {}
    for name in files:
        p = PurePosixPath(name).parts
        if p[0].startswith("sm_"):
            if len(p) < 3:
                problems.append(f"member {name!r} is not inside an entry directory")
                continue
            by_entry.setdefault(f"{p[0]}/{p[1]}", []).append("/".join(p[2:]))
    entries: list[dict[str, Any]] = []
    listed = {f"{e.get('arch')}/{str(e.get('key', ''))[:16]}" for e in manifest.get("entries", [])
              if isinstance(e, dict)} if manifest else set()
    for ename, rels in sorted(by_entry.items()):
        arch_d, key16 = ename.split("/")
        raw = small.get(f"{ename}/{cache.META}")
        if raw is None:
            problems.append(f"{ename}: no {cache.META}")
            continue
        try:
            meta = json.loads(raw)
            assert isinstance(meta, dict)
        except Exception:
            problems.append(f"{ename}: {cache.META} does not parse")
            continue
        if not isinstance(meta.get("key"), str) or not cache._HEX64.match(meta["key"]):
            problems.append(f"{ename}: {cache.META} has no valid key")
            continue
        if meta.get("arch") != arch_d:
            problems.append(f"{ename}: {cache.META} says arch {meta.get('arch')}, the entry is filed under {arch_d}")
            continue
        if not meta["key"].startswith(key16):
            problems.append(f"{ename}: {cache.META} key {meta['key'][:16]} does not match")
            continue
        recs, why = cache._file_records(meta, f"{ename}/{cache.META}")
        if recs is None:
            problems.append(why)
            continue
        bad = False
        for rel, rec in sorted(recs.items()):
            got = files.get(f"{ename}/{rel}")
            if got is None:
                problems.append(f"{ename}/{rel} is listed in {cache.META} but not in the pack")
                bad = True
            elif got != (rec["size"], rec["sha256"]):
                problems.append(f"{ename}/{rel} does not match its size and sha256 in {cache.META}")
                bad = True
        for rel in rels:
            if rel != cache.META and rel not in recs:
                problems.append(f"{ename}/{rel} is not listed in {cache.META}")
                bad = True
        if manifest and ename not in listed:
            problems.append(f"{ename} is not listed in {cache.MANIFEST}")
            bad = True
        if runtime and runtime["dsl_versions"] and cache._dsl_only(meta.get("dsl_versions")) not in ({},
                                                                                             runtime["dsl_versions"]):
            built = cache._dsl_only(meta.get("dsl_versions")).get(cache._DSL_PREFIX)
            problems.append(f"{ename} was built with CuTe DSL {built}"
                            f", the pack's runtime library is {runtime['dsl_versions'].get(cache._DSL_PREFIX)}")
            bad = True
        if not bad:
            entries.append({"name": ename, "arch": arch_d, "key": meta["key"], "meta": meta})
    tuning: list[str] = []
    listed_tuning = manifest.get("tuning") if isinstance(manifest.get("tuning"), dict) else {}
    for name in sorted(n for n in files if n.startswith("tuning/")):
        rec = listed_tuning.get(name)
        if not isinstance(rec, dict) or (rec.get("size"), rec.get("sha256")) != files[name]:
            problems.append(f"{name} does not match its size and sha256 in {cache.MANIFEST}")
            continue
        from . import tunedb

        try:
            why = tunedb.check_record(json.loads(small.get(name, b"")), Path(name))
        except ValueError:
            why = "does not parse"
        if why:
            problems.append(f"{name}: {why}")
            continue
        tuning.append(name)
    for name in sorted(set(listed_tuning) - set(files)):
        problems.append(f"{cache.MANIFEST} lists {name}, which the pack does not hold")
    for missing in sorted(listed - set(by_entry)):
        problems.append(f"{cache.MANIFEST} lists {missing}, which the pack does not hold")
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        raise cache.CacheError(f"{tarp}: refused, nothing installed: {'; '.join(problems[:3])}{more}")
    return {"entries": entries, "runtime": runtime, "tuning": tuning}


def unpack(tar: str | os.PathLike) -> dict[str, Any]:
    """Install a pack into this host's cache, all or nothing: every member is verified first (paths, types,
    every entry file's size and sha256 against its ``meta.json``, the runtime library against the manifest),
    and a pack with any problem is refused (:class:`CacheError`) before anything is written. Then the entries
    (all archs kept; :func:`lookup` is per arch) and the runtime library (``<root>/runtime/``, with a
    ``meta.json`` recording its version and sha256) are installed. Returns ``{"installed": [...],
    "present": [...], "runtime": path | None, "runtime_status": "installed" | "present" | None}``."""
    tarp = Path(tar)
    if not tarp.is_file():
        raise cache.CacheError(f"no such pack: {tarp}" + (" (it is a directory)" if tarp.is_dir() else ""))
    plan = _verify_pack(tarp)  # reads only
    runtime = plan["runtime"]
    # a runtime of another DSL version would break the entries already installed for the one there
    if runtime is not None:
        have = cache.runtime_versions()
        if have and runtime["dsl_versions"] and have != runtime["dsl_versions"] and not cache.check_runtime():
            users = [e for e in cache.list_entries() if cache._dsl_only(e.meta.get("dsl_versions")) == have]
            if users:
                raise cache.CacheError(
                    f"{tarp}: refused, nothing installed: its runtime library is CuTe DSL "
                    f"{runtime['dsl_versions'].get(cache._DSL_PREFIX)} but {len(users)} cached entr"
                    f"{'y' if len(users) == 1 else 'ies'} need the installed {have.get(cache._DSL_PREFIX)} "
                    f"({cache.runtime_dir()}); remove them first (mokgen cache clear) or use another MOKGEN_CACHE_DIR")
    root = cache.ensure_root()
    result: dict[str, Any] = {"installed": [], "present": [], "runtime": None, "runtime_status": None}
    stage: Path | None = None
    installed: list[Path] = []
    try:
        stage = Path(tempfile.mkdtemp(prefix=f".unpack.{os.getpid()}.", dir=root))
        try:
            with tarfile.open(tarp, "r:*") as tf:
                if hasattr(tarfile, "data_filter"):
                    tf.extractall(stage, filter="data")
                else:  # pragma: no cover - python < 3.11.4
                    tf.extractall(stage)
        except (tarfile.TarError, EOFError) as e:
            raise cache.CacheError(f"{tarp} is not a readable mokgen pack: {e}") from None
        # the staged copy is checked again: the pack may have changed between the two reads
        for e in plan["entries"]:
            d = stage / e["name"]
            meta, why = cache._check_entry(d, strict=True)
            if meta is None:
                why = why.replace(str(stage) + "/", "")
                raise cache.CacheError(f"{tarp}: refused, nothing installed: {e['name']}: {why}")
        rt_staged = stage / "runtime" / cache.RUNTIME_LIB
        if runtime is not None:
            if rt_staged.stat().st_size != runtime["size"] or cache.sha256_file(rt_staged) != runtime["sha256"]:
                raise cache.CacheError(f"{tarp}: refused, nothing installed: runtime/{cache.RUNTIME_LIB} changed while "
                                 "it was read")
        for e in plan["entries"]:
            d = stage / e["name"]
            dst = root / e["arch"] / d.name
            with cache.lock(e["key"], timeout=60):
                if dst.exists() and cache._check_entry(dst)[0] is not None:
                    result["present"].append(dst)
                    continue
                dst.parent.mkdir(parents=True, exist_ok=True)
                cache._rmtree(dst)
                os.replace(d, dst)
            installed.append(dst)
            result["installed"].append(dst)
        for name in plan.get("tuning", []):
            from . import tunedb

            try:  # the staged copy is checked again, like the entries
                why = tunedb.check_record(json.loads((stage / name).read_text()), Path(name))
            except ValueError:
                why = "does not parse"
            if why:
                raise cache.CacheError(f"{tarp}: refused, nothing installed: {name} changed while it was read ({why})")
            dst = root / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            if dst.exists() and cache.sha256_file(dst) == cache.sha256_file(stage / name):
                result["present"].append(dst)
                continue
            os.replace(stage / name, dst)
            installed.append(dst)
            result["installed"].append(dst)
        if runtime is not None:
            dst = cache.runtime_dir() / cache.RUNTIME_LIB
            if dst.exists() and not cache.check_runtime(dst) \
                    and (cache._read_meta(cache.runtime_dir()) or {}).get("sha256") \
                    == runtime["sha256"]:
                result["runtime_status"] = "present"
            else:
                cache.install_runtime(rt_staged, runtime["dsl_versions"], origin=str(tarp), sha256=runtime["sha256"])
                result["runtime_status"] = "installed"
            result["runtime"] = dst
    except OSError as e:
        for d in installed:  # all or nothing
            cache._rmtree(d) if d.is_dir() else d.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            for p in cache.runtime_dir().glob(f"*.tmp.{os.getpid()}"):
                p.unlink()
            (cache.runtime_dir() / f"{cache.META}.new").unlink()
        raise cache._cache_os_error(e, "install the pack into", e.filename or root) from None
    except BaseException:
        for d in installed:
            cache._rmtree(d) if d.is_dir() else d.unlink(missing_ok=True)
        raise
    finally:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
    return result
