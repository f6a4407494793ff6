"""Per-kernel object cache: one compiled kernel shared by every plan that emits the same kernel code.

Many plans share kernels (routing and combine depend on a few spec fields and the routing tile; the training
kernels do not depend on the forward GEMMs' knobs), so ``mokgen tune``'s candidates, or a piecewise plan's
pieces, would otherwise compile them once per plan. ``mokgen.build``'s compile step asks this cache first:
the key is the sha256 of {arch, CuTe DSL / tvm-ffi versions, kernel name, the kernel file without the two
header comment lines that name the spec and plan (comments: they do not change what compiles), the helper
modules next to it}. Entries are ``<cache root>/objects/<arch>/<key16>/`` with ``<name>.o``, ``<name>.ptx``
and a ``meta.json`` holding their sha256 (written last, checked on every fetch). ``MOKGEN_KERNEL_CACHE=0``
turns it off.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from . import cache

_HEADER_RE = re.compile(r"^# (spec|plan): .*$")
_KERNEL_RE = re.compile(r"""^KERNEL_NAME\s*(?::\s*str\s*)?=""", re.M)


def enabled() -> bool:
    return os.environ.get("MOKGEN_KERNEL_CACHE", "1") not in ("0", "", "no", "off")


def code_of(text: str) -> str:
    """The kernel file without its spec/plan header comments (the first lines emit writes)."""
    lines = text.split("\n")
    return "\n".join(l for i, l in enumerate(lines) if not (i < 8 and _HEADER_RE.match(l)))


def kernel_key(src: Path, arch: str, name: str) -> str:
    helpers = {p.name: p.read_text() for p in sorted(src.parent.glob("*.py"))
               if p != src and not _KERNEL_RE.search(p.read_text())}
    doc = {"arch": arch, "dsl": cache.dsl_versions(), "name": name, "code": code_of(src.read_text()),
           "helpers": helpers}
    return hashlib.sha256(cache.canonical_json(doc).encode()).hexdigest()


def _dir(key: str, arch: str) -> Path:
    return cache.cache_root() / "objects" / arch / key[:16]


def fetch(key: str, arch: str, name: str, out_o: Path) -> bool:
    """Copy the cached ``.o`` and ``.ptx`` of ``key`` next to ``out_o`` if intact; False on a miss."""
    d = _dir(key, arch)
    try:
        meta = json.loads((d / "meta.json").read_text())
        if meta.get("key") != key:
            return False
        for f in (f"{name}.o", f"{name}.ptx"):
            if cache.sha256_file(d / f) != meta["files"][f]:
                return False
        ptx = out_o.with_name(f"{name}.ptx")
        for src, dst in ((d / f"{name}.ptx", ptx), (d / f"{name}.o", out_o)):
            tmp = dst.with_name(f"{dst.name}.tmp.{os.getpid()}")
            shutil.copyfile(src, tmp)
            os.replace(tmp, dst)
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False


def store(key: str, arch: str, name: str, out_o: Path) -> None:
    """Keep ``out_o`` and its ``.ptx`` under ``key`` (best effort: a failure only costs a later recompile)."""
    d = _dir(key, arch)
    tmp = d.with_name(f"{d.name}.tmp.{os.getpid()}")
    try:
        if (d / "meta.json").exists():
            return
        tmp.mkdir(parents=True, exist_ok=True)
        files = {}
        for src in (out_o, out_o.with_name(f"{name}.ptx")):
            shutil.copyfile(src, tmp / f"{name}{src.suffix}")
            files[f"{name}{src.suffix}"] = cache.sha256_file(tmp / f"{name}{src.suffix}")
        (tmp / "meta.json").write_text(json.dumps({"key": key, "arch": arch, "name": name, "files": files}))
        os.replace(tmp, d)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
