"""The tuning database: what ``mokgen tune`` chose, keyed like the kernel cache.

One JSON file per record, ``<cache root>/tuning/<arch>/<key16>.json``. The key is the sha256 of the canonical
JSON of {arch, GPU name, toolchain versions (CuTe DSL, tvm-ffi, torch, CUDA), template hash, the spec's shape
(the spec without ``tokens``: a record covers the token counts it was tuned at, as a piecewise plan)}: another
GPU, another toolchain or other templates never match. Each file carries the sha256 of its own canonical
content; a file that does not match is never used (``mokgen tune --show`` marks it). Light (the cache layer):
no torch, sympy or compiler at import.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any, Mapping

from . import cache

__all__ = ["TuneDBError", "record_key", "spec_shape", "tuning_dir", "record_path", "save", "load", "find",
           "list_records", "clear", "toolchain", "gpu_name", "check_record"]

FORMAT = 1
DIRNAME = "tuning"


class TuneDBError(cache.CacheError):
    """A tuning record cannot be read or written."""


def spec_shape(spec: Any) -> dict[str, Any]:
    """The spec's canonical dict without ``tokens`` (a record is for a shape; it holds the token counts)."""
    d = dict(cache.to_plain(spec))
    d.pop("tokens", None)
    return d


def toolchain() -> dict[str, str]:
    """The versions a measurement depends on: the CuTe DSL and tvm-ffi (the kernels), torch and its CUDA."""
    out = dict(cache.dsl_versions())
    try:
        import torch

        out["torch"] = str(torch.__version__)
        out["cuda"] = str(torch.version.cuda)
    except Exception:  # pragma: no cover - torch is a dependency
        pass
    return out


def gpu_name() -> str | None:
    """``$MOKGEN_GPU_NAME`` (to use another host's records, e.g. compiling on a CPU host for an H200), else the
    visible GPU's name, else None."""
    env = os.environ.get("MOKGEN_GPU_NAME", "").strip()
    if env:
        return env
    try:
        import torch

        if torch.cuda.is_available():
            return str(torch.cuda.get_device_name())
    except Exception:
        pass
    return None


def gpu_tag(name: str) -> str:
    """A GPU name's tag in benchmark record file names (``bench/results/<kind>-<tag>.json``): its model number
    (``NVIDIA H200`` -> ``h200``, ``NVIDIA H100 80GB HBM3`` -> ``h100``, ``NVIDIA A100-SXM4-80GB`` -> ``a100``),
    else the whole name in lower case with each run of other characters as one '-' (``NVIDIA GeForce RTX 4090``
    -> ``nvidia-geforce-rtx-4090``)."""
    m = re.search(r"(?<![A-Za-z0-9])([A-Za-z]+[0-9]+[A-Za-z]*)(?![A-Za-z0-9])", name)
    if m:
        return m.group(1).lower()
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def record_key(arch: str, gpu: str, tools: Mapping[str, str], template_hash: str, spec: Any) -> str:
    doc = {"arch": arch, "gpu": gpu, "toolchain": dict(tools), "template_hash": template_hash,
           "spec": spec_shape(spec)}
    return hashlib.sha256(cache.canonical_json(doc).encode()).hexdigest()


def tuning_dir(arch: str | None = None) -> Path:
    root = cache.cache_root() / DIRNAME
    return root / arch if arch else root


def record_path(key: str, arch: str) -> Path:
    if len(key) < 16 or any(c not in "0123456789abcdef" for c in key):
        raise TuneDBError(f"bad tuning key {key!r}")
    return tuning_dir(arch) / f"{key[:16]}.json"


def _digest(doc: Mapping[str, Any]) -> str:
    body = {k: v for k, v in doc.items() if k != "sha256"}
    return hashlib.sha256(cache.canonical_json(body).encode()).hexdigest()


def check_record(doc: Any, path: Path | None = None) -> str:
    """"" if ``doc`` is an intact record (format, fields, its own sha256, filed under its key), else why not."""
    if not isinstance(doc, dict):
        return "not a JSON object"
    if doc.get("format") != FORMAT:
        return f"format {doc.get('format')!r}, expected {FORMAT}"
    for f in ("key", "arch", "gpu", "toolchain", "template_hash", "spec", "piecewise", "sha256"):
        if f not in doc:
            return f"no {f!r}"
    if doc["sha256"] != _digest(doc):
        return "content does not match its sha256"
    want = record_key(doc["arch"], doc["gpu"], doc["toolchain"], doc["template_hash"], doc["spec"])
    if doc["key"] != want:
        return "key does not match its arch/gpu/toolchain/templates/spec"
    if path is not None and (path.stem != doc["key"][:16] or path.parent.name != doc["arch"]):
        return f"filed under {path.parent.name}/{path.name}, expected {doc['arch']}/{doc['key'][:16]}.json"
    return ""


def save(*, arch: str, gpu: str, tools: Mapping[str, str], template_hash: str, spec: Any,
         piecewise: Mapping[str, Any], **extra: Any) -> Path:
    """Write a record atomically (replacing the one with the same key); returns its path."""
    key = record_key(arch, gpu, tools, template_hash, spec)
    doc: dict[str, Any] = {"format": FORMAT, "key": key, "arch": arch, "gpu": gpu, "toolchain": dict(tools),
                           "template_hash": template_hash, "spec": spec_shape(spec),
                           "spec_name": spec_shape(spec).get("name"),
                           "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "piecewise": cache.to_plain(dict(piecewise)), **cache.to_plain(extra)}
    doc["sha256"] = _digest(doc)
    path = record_path(key, arch)
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise TuneDBError(cache.os_error_message(e, "write the tuning record", None, e.filename or path)) from None
    return path


def load(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise TuneDBError(f"cannot read the tuning record {p}: {e}") from None
    why = check_record(doc, p)
    if why:
        raise TuneDBError(f"tuning record {p} is damaged ({why}); `mokgen tune --clear` removes it")
    return doc


def find(arch: str, gpu: str | None, tools: Mapping[str, str], template_hash: str, spec: Any
         ) -> tuple[dict[str, Any] | None, Path]:
    """(the intact record for these keys or None, its path). A damaged file is ignored (None)."""
    if gpu is None:
        return None, tuning_dir(arch)
    path = record_path(record_key(arch, gpu, tools, template_hash, spec), arch)
    if not path.is_file():
        return None, path
    try:
        return load(path), path
    except TuneDBError:
        return None, path


def list_records(arch: str | None = None) -> list[tuple[Path, dict[str, Any] | None, str]]:
    """Every record file: (path, record or None, problem or "")."""
    base = tuning_dir()
    if not base.is_dir():
        return []
    out = []
    for d in sorted(p for p in base.iterdir() if p.is_dir() and (arch is None or p.name == arch)):
        for f in sorted(d.glob("*.json")):
            try:
                doc = json.loads(f.read_text())
                why = check_record(doc, f)
            except (OSError, ValueError) as e:
                doc, why = None, f"does not parse ({e})"
            out.append((f, doc if not why else None, why))
    return out


def clear(arch: str | None = None, spec: Any = None) -> list[Path]:
    """Remove records (of ``arch``, of ``spec``'s shape, or all); returns the removed paths."""
    removed = []
    shape = spec_shape(spec) if spec is not None else None
    for path, doc, _why in list_records(arch):
        if shape is not None and (doc is None or doc.get("spec") != shape):
            continue
        try:
            path.unlink()
            removed.append(path)
        except OSError as e:
            raise TuneDBError(cache.os_error_message(e, "remove", None, path)) from None
    return removed
