"""The driver: spec -> plan -> emit -> cache / build -> loaded kernels (:class:`mokgen.ops.CompiledMoE`).

This is the one place that ties the compiler (``mokgen.plan``, ``mokgen.emit``, ``mokgen.build``: imported on
first use) to the runtime (``mokgen.ops``, which imports none of them). The API (:func:`compile`, also
``mokgen.compile``) and the command line (``mokgen compile``) resolve entries through the same function,
:func:`resolve`, so they find the same entries:

* where the CuTe DSL compiler is installed: the cache entry of the exact key, built (and stored) on a miss,
  rebuilt when damaged;
* where it is not (a GPU host loading packed caches): the exact key, else an entry with the same content
  (arch, tvm-ffi, templates, spec, plan) that another host compiled; a miss says exactly what is missing, a
  damaged entry is refused, the runtime library a pack installed is verified (sha256, DSL version).

:func:`load_entry` loads a cache entry directory from its ``meta.json`` alone (no plan solver, no compiler).

Warm start: :func:`compile` first asks the warm-start index (:mod:`mokgen.index`) whether the same call was
resolved before; if so it loads that entry (verified) with the plan from its ``meta.json``, importing neither
sympy, jinja2 nor the CuTe DSL. Every full resolution records its answer there. ``mokgen compile`` describes
its call with the same function (:func:`call_key`, before anything is resolved), answers from the same records
(:func:`warm_entry`) and writes complete ones (:func:`remember`: with the DSL's runtime library, which it looks
up as loading the entry would), so that a record either writes serves the other.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any, Mapping

from . import cache, index
from .arch import ArchError, resolve_arch

__all__ = ["CompilerMissingError", "compile", "resolve", "get_or_build", "load_entry", "prepare", "plan_for", "tuned",
           "PiecewiseMoE", "call_key", "warm_entry", "remember", "record_runtime"]

_COMPILED: dict[str, Any] = {}


class CompilerMissingError(cache.CacheError):
    """Kernels are needed that are not in the cache, and the CuTe DSL compiler is not installed."""


def _dsl_available() -> bool:
    return cache._compiler_available()


def _as_spec(spec: Any) -> Any:
    from .spec import Spec, load_spec

    return spec if isinstance(spec, Spec) else load_spec(spec)


def _overrides(overrides: Any) -> dict[str, Any]:
    """Plan overrides from a mapping or a ``"k=v,k=v"`` string (:func:`mokgen.plan.parse_overrides`)."""
    if overrides is None:
        return {}
    if isinstance(overrides, str):
        return importlib.import_module("mokgen.plan").parse_overrides(overrides, what="overrides")
    return dict(overrides)


def tuned(spec: Any, arch: str) -> tuple[Any, Any, str]:
    """``(record, PiecewisePlan, why)`` of the tuning database for ``spec``'s shape on ``arch``, this GPU
    (``$MOKGEN_GPU_NAME`` or the visible one), this toolchain and these templates; ``(None, None, why not)``
    when there is none."""
    from . import tunedb

    gpu = tunedb.gpu_name()
    if gpu is None:
        return None, None, "no GPU visible (set MOKGEN_GPU_NAME to use another host's tuning records)"
    th = importlib.import_module("mokgen.emit").template_hash()
    rec, path = tunedb.find(arch, gpu, tunedb.toolchain(), th, spec)
    if rec is None:
        return None, None, f"no tuning record for {spec.name} on {gpu} ({arch}) at {path}"
    pw = importlib.import_module("mokgen.costmodel").PiecewisePlan.from_dict(rec["piecewise"])
    return rec, pw, str(path)


def _tuned_note(rec: Any, pw: Any, piece: Any) -> str:
    rng = f"[{piece.lo}, {piece.hi or 'inf'})"
    return (f"tuned: record {rec['key'][:16]} ({rec['gpu']}, {rec['created']}), piece T in {rng} of "
            f"{len(pw.pieces)}")


def tuned_plan(spec: Any, arch: str, rec: Any, pw: Any, piece: Any) -> Any:
    """The plan of a tuning record's piece: its forward overrides and the record's tuned backward overrides
    (``mokgen tune --train``: the ``backward`` section; records without one give the solver's backward), the
    notes naming the record."""
    import dataclasses

    P = importlib.import_module("mokgen.plan")
    bwd = dict((rec.get("backward") or {}).get("overrides") or {})
    plan = P.solve(spec, arch, **piece.overrides, **bwd)
    notes = (_tuned_note(rec, pw, piece),)
    if "backward" in rec:
        ov = ",".join(f"{k}={v}" for k, v in sorted(bwd.items())) or "the solver's default"
        notes += (f"tuned backward: record {rec['key'][:16]} (tune --train {rec['backward'].get('date', '')}): {ov}",)
    return dataclasses.replace(plan, notes=plan.notes + notes)


def plan_for(spec: Any, arch: str, overrides: Any = None, *, use_tuned: bool = True) -> tuple[Any, Any]:
    """``(plan, tuned_info)``: with no overrides and a tuning record, the record's piece for ``spec.tokens``
    (its note names the record); else the solver's plan. ``tuned_info`` is ``(record, PiecewisePlan, path)`` or
    ``(None, None, why there is none)`` (None when overrides were given)."""
    P = importlib.import_module("mokgen.plan")
    ov = _overrides(overrides)
    if ov or not use_tuned:
        return P.solve(spec, arch, **ov), None
    rec, pw, where = tuned(spec, arch)
    if rec is None:
        return P.solve(spec, arch), (None, None, where)
    return tuned_plan(spec, arch, rec, pw, pw.piece(spec.tokens)), (rec, pw, where)


def prepare(spec: Any, arch: str | None = None, overrides: Any = None, *, with_info: bool = False) -> tuple:
    """``(spec, arch, plan, sources)``: load_spec -> resolve_arch -> plan (the tuned one where the tuning
    database has a record for this spec and GPU, see :func:`plan_for`) -> emit.emit. ``with_info``: also
    :func:`plan_for`'s ``tuned_info`` (a fifth element)."""
    spec = _as_spec(spec)
    arch = resolve_arch(arch)
    plan, info = plan_for(spec, arch, overrides)
    sources = importlib.import_module("mokgen.emit").emit(plan)
    return (spec, arch, plan, sources, info) if with_info else (spec, arch, plan, sources)


class PiecewiseMoE:
    """The layer of a tuned piecewise plan: one :class:`mokgen.ops.CompiledMoE` per piece, all built up front;
    every call picks its piece from T = x.shape[0] on the host (no sync, no recompile; a CUDA graph captures
    the piece of the T it was captured with). ``mokgen.moe_forward`` / ``mokgen.MoE`` accept it."""

    def __init__(self, pieces: list[tuple[int, int, Any]], piecewise: Any = None):
        if not pieces or pieces[0][0] != 1 or pieces[-1][1] != 0:
            raise ValueError("PiecewiseMoE: pieces must cover T >= 1")
        self.pieces = pieces
        self.piecewise = piecewise

    def select(self, tokens: int) -> Any:
        for lo, hi, moe in self.pieces:
            if tokens >= lo and (hi == 0 or tokens < hi):
                return moe
        return self.pieces[0][2]  # T < 1: an empty call, any piece returns the empty output

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return self.select(x.shape[0])(x, *args, **kwargs)

    def forward_train(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return self.select(x.shape[0]).forward_train(x, *args, **kwargs)

    def backward(self, dy: Any, saved: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
        return self.select(x.shape[0]).backward(dy, saved, x, *args, **kwargs)

    def check_errors(self) -> None:
        for _lo, _hi, moe in self.pieces:
            moe.check_errors()

    def __getattr__(self, name: str) -> Any:  # spec, name, arch, ... of the first piece
        return getattr(self.pieces[0][2], name)

    def __repr__(self) -> str:
        return "PiecewiseMoE(" + ", ".join(f"[{lo}, {hi or 'inf'}): {m!r}" for lo, hi, m in self.pieces) + ")"


def get_or_build(sources: Any, arch: str, *, force: bool = False, jobs: int | None = None, progress: bool = True,
                 timeout: float | None = None) -> cache.Artifacts:
    """:func:`mokgen.cache.get_or_build` with :func:`mokgen.build.build` as the build function."""
    build = importlib.import_module("mokgen.build")
    build.check_jobs(jobs)

    def build_fn(s: Any, a: str, d: Path) -> Any:
        return build.build(s, a, d, jobs=jobs, progress=progress)

    return cache.get_or_build(sources, arch, build_fn, force=force, timeout=timeout, progress=progress)


def _spec_name(sources: Any) -> str:
    _th, spec, _plan, _files = cache._parts(sources)
    if isinstance(spec, Mapping):
        return str(spec.get("name", "?"))
    return str(getattr(spec, "name", spec) or "?")


def _missing_message(sources: Any, arch: str, force: bool) -> str:
    """What a host without the compiler lacks to load ``sources``: one line, with what to do."""
    name = _spec_name(sources)
    fix = ("pip install 'mokgen[compiler]' (the CuTe DSL compiler), or build it on a host that has it and carry "
           "it here: mokgen cache pack / mokgen cache unpack")
    if force:
        return f"rebuilding {name!r} for {arch} (force) needs the CuTe DSL compiler, which is not installed: {fix}"
    root = cache.cache_root()
    key, ckey = cache.key_for(sources, arch), cache.content_key_for(sources, arch)
    try:
        entries = cache.scan_entries(arch)
    except cache.CacheError:
        entries = []
    same = [e for e in entries if e.spec_name == name]
    damaged = [e for e in entries if not e.ok]
    th, _spec, plan, _files = cache._parts(sources)
    why = ""
    if same:
        e = same[0]
        diffs = []
        if e.meta.get("template_hash") != th:
            diffs.append(f"templates {str(e.meta.get('template_hash'))[:12]} vs {str(th)[:12]} here")
        if plan is not None and e.meta.get("plan") != cache.to_plain(plan):
            diffs.append("another plan (other overrides or another mokgen version)")
        tvm_e = (e.meta.get("dsl_versions") or {}).get(cache._TVM_FFI)
        tvm_here = cache.dsl_versions().get(cache._TVM_FFI)
        if tvm_e != tvm_here:
            diffs.append(f"apache-tvm-ffi {tvm_e} vs {tvm_here} here")
        why = (f"; the {len(same)} {arch} entr{'y' if len(same) == 1 else 'ies'} for {name!r} there "
               f"{'was' if len(same) == 1 else 'were'} built from other inputs ({', '.join(diffs) or 'other sources'})")
    elif damaged:
        why = f"; {len(damaged)} damaged {arch} entr{'y' if len(damaged) == 1 else 'ies'} there (mokgen cache verify)"
    return (f"no cached kernels for {name!r} on {arch} in {root} (key {key[:16]}, content key {ckey[:16]}){why}, "
            f"and building needs the CuTe DSL compiler, which is not installed: {fix}")


def _check_runtime_for(art: cache.Artifacts) -> None:
    """On a host without the compiler: the runtime library ``mokgen.ops`` will load is there, matches its
    sha256 and belongs to the CuTe DSL version the entry was built with."""
    if os.environ.get("MOKGEN_RUNTIME_LIB"):
        return  # an explicit choice (mokgen.ops checks that it is a file)
    rt = cache.runtime_dir() / cache.RUNTIME_LIB
    if not rt.exists():
        raise CompilerMissingError(
            f"no {cache.RUNTIME_LIB} to load {art.dir} with: the CuTe DSL is not installed and {rt.parent} has "
            "none; unpack a pack (it ships the runtime library), pip install 'mokgen[compiler]', or set "
            f"MOKGEN_RUNTIME_LIB=/path/to/{cache.RUNTIME_LIB}")
    why = cache.check_runtime(rt)
    if why:
        raise cache.DamagedEntryError(f"the CuTe DSL runtime library will not be loaded: {why}", rt, why)
    have = cache.runtime_versions()
    want = cache._dsl_only(art.meta.get("dsl_versions"))
    if have and want and have != want:
        raise cache.CacheError(
            f"{art.dir} was built with CuTe DSL {want.get(cache._DSL_PREFIX)} but the runtime library in {rt.parent} "
            f"is {have.get(cache._DSL_PREFIX)}; unpack a pack built with one version (mokgen cache pack on the "
            "build host)")


def resolve(sources: Any, arch: str, *, force: bool = False, jobs: int | None = None, progress: bool = True,
            timeout: float | None = None) -> cache.Artifacts:
    """The verified cache entry (:class:`mokgen.cache.Artifacts`, ``status``/``note`` say how it was found)
    of ``sources`` on ``arch``: built where the compiler is, found (by key or by content) where it is not."""
    if _dsl_available():
        return get_or_build(sources, arch, force=force, jobs=jobs, progress=progress, timeout=timeout)
    if force:
        raise CompilerMissingError(_missing_message(sources, arch, True))
    entry = cache.find(sources, arch, compiler=False)  # a damaged entry raises DamagedEntryError
    if entry is None:
        raise CompilerMissingError(_missing_message(sources, arch, False))
    exact = entry == cache.entry_dir(cache.key_for(sources, arch), arch)
    art = cache.load_artifacts(entry, status="cached",
                               note="cached" if exact else "cached (built on another host: found by content)")
    _check_runtime_for(art)
    return art


def compile(spec: Any, arch: str | None = None, force: bool = False, overrides: Any = None) -> Any:
    """spec (a Spec, preset name, YAML path or mapping) -> load_spec -> plan.solve -> emit.emit ->
    :func:`resolve` (cache / build, verified) -> :class:`mokgen.ops.CompiledMoE` (one per cache entry per
    process).

    ``arch``: as :func:`mokgen.arch.resolve_arch` (argument, ``$MOKGEN_ARCH``, the visible GPU). Without the
    CuTe DSL a cached (or unpacked) entry is still loaded; a miss raises :class:`CompilerMissingError` saying
    what is missing. ``force=True`` rebuilds (needs the DSL). ``overrides``: plan choices passed to
    :func:`mokgen.plan.solve` (a mapping, or ``"k=v,k=v"``; e.g. ``{"schedule": "chain"}``).

    A call resolved before (same spec file bytes or spec, overrides, arch, mokgen sources and templates, DSL
    install) is answered from the warm-start index (:mod:`mokgen.index`) without the plan solver, emit or the
    DSL; the entry is verified as on every load. ``$MOKGEN_NO_WARM_START=1`` always takes the full way (which
    still records its answer).
    """
    arch_r, key_doc = call_key(spec, arch, overrides)
    if key_doc is not None and warm_start_wanted(force):
        moe = _warm(key_doc, arch_r)
        if moe is not None:
            return moe
    # an arch that does not resolve goes on as given: prepare raises its ArchError
    spec, arch, plan, sources, info = prepare(spec, arch_r or arch, overrides, with_info=True)
    if info is not None and info[1] is not None and len(info[1].pieces) > 1:  # a tuned piecewise plan
        rec, pw, _where = info
        pieces = [(piece.lo, piece.hi, _load(spec, arch, tuned_plan(spec, arch, rec, pw, piece), force))
                  for piece in pw.pieces]
        return PiecewiseMoE(pieces, pw)   # not recorded in the warm-start index: several entries
    return _load(spec, arch, plan, force, key_doc, sources)


def _load(spec: Any, arch: str, plan: Any, force: bool, key_doc: Mapping[str, Any] | None = None,
          sources: Any = None) -> Any:
    if sources is None:
        sources = importlib.import_module("mokgen.emit").emit(plan)
    art = resolve(sources, arch, force=force)
    key = str(Path(art.dir).resolve())
    moe = None if force else _COMPILED.get(key)
    if moe is None:
        from .ops import CompiledMoE

        moe = _COMPILED[key] = CompiledMoE(spec, plan, Path(art.dir), arch=arch)
    remember(key_doc, art, sources)
    return moe


def index_key(spec: Any, arch: str, overrides: Any = None) -> dict[str, Any] | None:
    """:func:`mokgen.index.index_key`, or None when it fails (e.g. an unreadable template: no warm start; the full
    way says what is wrong)."""
    try:
        return index.index_key(spec, arch, overrides)
    except Exception:
        return None


def call_key(spec: Any, arch: str | None = None, overrides: Any = None) -> tuple[str | None, dict[str, Any] | None]:
    """``(arch, index key)`` of the call ``compile(spec, arch, overrides=...)``: the one way :func:`compile` and
    ``mokgen compile`` describe a call to the warm-start index, so that a record either of them writes is the
    one the other looks up. Computed from the call's inputs alone, before anything is resolved (the same inputs
    give the same key in any process). ``arch`` resolved (:func:`mokgen.arch.resolve_arch`), None when it does
    not resolve; the key None when the call cannot be described without the full resolution (which then says
    what is wrong)."""
    try:
        arch = resolve_arch(arch)
    except ArchError:
        return None, None
    return arch, index_key(spec, arch, overrides)


def warm_start_wanted(force: bool = False) -> bool:
    """Whether a call looks in the warm-start index first: not with ``force``, not with
    ``$MOKGEN_NO_WARM_START=1``."""
    return not force and os.environ.get("MOKGEN_NO_WARM_START", "") in ("", "0")


def remember(key_doc: Mapping[str, Any] | None, art: cache.Artifacts, sources: Any, *,
             find_runtime: bool = False) -> None:
    """Record a full resolution (``sources`` -> ``art``) in the warm-start index under ``key_doc``
    (:func:`call_key`; None: nothing to record). :func:`compile` and ``mokgen compile`` call it.

    The record names the CuTe DSL runtime library this process found (``mokgen.ops.dsl_runtime_hint``), which
    lets a later process load the entry without importing the DSL. :func:`compile` has found it by loading the
    entry; ``find_runtime=True`` (``mokgen compile``, which loads nothing) looks it up in the DSL install now,
    where the compiler is and the index does not already name it for this entry."""
    if key_doc is None:
        return
    from .ops import dsl_runtime_hint

    hint = dsl_runtime_hint()
    if hint is None and find_runtime:
        hint = _dsl_runtime_hint_for(key_doc, art)
    index.remember(key_doc, art, exact=art.key == cache.key_for(sources, art.arch), runtime=hint)


def _runtime_hint_ok(hint: Any) -> bool:
    """Whether ``hint`` (``{path, size, mtime_ns}``, :func:`mokgen.ops.dsl_runtime_hint` in an earlier process)
    still names that file: the same identity ``mokgen.ops.find_runtime_library`` checks before it uses one."""
    if not isinstance(hint, Mapping) or not isinstance(hint.get("path"), str):
        return False
    try:
        st = os.stat(hint["path"])
    except OSError:
        return False
    return dict(hint) == {"path": hint["path"], "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _dsl_runtime_hint_for(key_doc: Mapping[str, Any], art: cache.Artifacts) -> dict[str, Any] | None:
    """The runtime hint for a record of ``art`` written without loading it: the one the index already has for
    this entry (if it still checks out), else the CuTe DSL's own answer (``cutlass.cute.runtime``, as loading the
    entry would ask it; imported here where the compiler is). None without the compiler or with
    ``$MOKGEN_RUNTIME_LIB`` (then the runtime is not the DSL install's: nothing to record)."""
    if os.environ.get("MOKGEN_RUNTIME_LIB") or not _dsl_available():
        return None
    old = index.lookup(key_doc, compiler=True)
    if old is not None and old[1].get("key") == art.key and _runtime_hint_ok(old[1].get("runtime")):
        return dict(old[1]["runtime"])
    from . import ops

    try:
        ops.find_runtime_library(None)
    except Exception:
        return None   # loading the entry says what is wrong
    return ops.dsl_runtime_hint()


def record_runtime(key_doc: Mapping[str, Any], hit: "WarmHit") -> None:
    """For a warm answer that loads nothing (``mokgen compile``): where the record does not name a runtime
    library that still checks out (a record from an older mokgen, a reinstalled DSL), name the DSL's now, so
    that the next :func:`compile` need not import the DSL to find it."""
    if _runtime_hint_ok(hit.rec.get("runtime")):
        return
    hint = _dsl_runtime_hint_for(key_doc, hit.art)
    if hint is not None:
        index.remember(key_doc, hit.art, exact=bool(hit.rec.get("exact")), runtime=hint)


class WarmHit:
    """What the warm-start index answered: the verified entry (``art``), its plan (``plan.Plan`` from the
    entry's ``meta.json``) and the index record (``rec``)."""

    __slots__ = ("art", "plan", "rec")

    def __init__(self, art: cache.Artifacts, plan: Any, rec: Mapping[str, Any]):
        self.art, self.plan, self.rec = art, plan, rec


def warm_entry(key_doc: Mapping[str, Any], arch: str) -> WarmHit | None:
    """The entry the warm-start index names for ``key_doc`` (:func:`call_key`), verified, with its plan, or None
    (a miss: no record, or an entry that is gone, damaged, re-keyed or whose runtime library does not check out;
    the full resolution then decides, and says what is wrong). Imports neither sympy, jinja2, the CuTe DSL nor
    torch. :func:`compile` and ``mokgen compile`` both answer from it.

    Without the compiler the runtime library must check out as on the full way (:func:`_check_runtime_for`),
    unless the record names the DSL install's runtime library and that file is unchanged: a record written
    where the compiler is (``exact``) on a host whose DSL install (part of the key) is the same."""
    compiler = _dsl_available()
    hit = index.lookup(key_doc, compiler=compiler)
    if hit is None:
        return None
    entry, rec = hit
    try:
        note = "cached (warm-start index)" if rec.get("exact") is True else (
            "cached (warm-start index; built on another host: found by content)")
        art = cache.load_artifacts(entry, status="cached", note=note)
    except cache.DamagedEntryError as e:
        if compiler or not entry.is_dir():
            return None   # the full way rebuilds it (or finds that it is gone)
        raise cache._damaged(entry, e.why) from None   # what the full way would raise here, without sympy
    except Exception:
        return None
    try:
        if art.key != rec["key"] or art.arch != arch or not isinstance(art.meta.get("plan"), Mapping):
            return None
        if not compiler and not (rec.get("exact") is True and not os.environ.get("MOKGEN_RUNTIME_LIB")
                                 and _runtime_hint_ok(rec.get("runtime"))):
            _check_runtime_for(art)
        from .plan import Plan

        plan = Plan.from_dict(art.meta["plan"])
    except Exception:
        return None
    return WarmHit(art, plan, rec)


def _warm(key_doc: Mapping[str, Any], arch: str) -> Any:
    """The :class:`mokgen.ops.CompiledMoE` of :func:`warm_entry`'s entry for ``key_doc``, or None (a miss)."""
    hit = warm_entry(key_doc, arch)
    if hit is None:
        return None
    art, plan, rec = hit.art, hit.plan, hit.rec
    key = str(Path(art.dir).resolve())
    moe = _COMPILED.get(key)
    if moe is None:
        from .ops import CompiledMoE, dsl_runtime_hint

        moe = _COMPILED[key] = CompiledMoE(plan.spec, plan, Path(art.dir), arch=arch, runtime_hint=rec.get("runtime"))
        hint = dsl_runtime_hint()
        if hint and hint != rec.get("runtime"):   # found by importing the DSL this time: keep it for next time
            index.remember(key_doc, art, exact=bool(rec.get("exact")), runtime=hint)
    return moe


class _PlanView:
    """Attribute access to a plan's ``to_dict()`` (from ``meta.json``): what the runtime reads of a plan
    (``bm``, ``schedule``, ``gemm1.a_load``, ...) without the plan module (and its solver)."""

    def __init__(self, data: Mapping[str, Any]):
        object.__setattr__(self, "_data", dict(data))

    def __getattr__(self, name: str) -> Any:
        try:
            v = self._data[name]
        except KeyError:
            raise AttributeError(name) from None
        return _PlanView(v) if isinstance(v, Mapping) else v

    def to_dict(self) -> dict[str, Any]:
        return dict(self._data)

    def __repr__(self) -> str:
        return f"_PlanView({self._data!r})"


def load_entry(path: str | os.PathLike, *, functions: Mapping[str, Any] | None = None) -> Any:
    """A :class:`mokgen.ops.CompiledMoE` for the cache entry directory ``path``, from its ``meta.json``
    alone: verified (every file's sha256), no plan solver, no emit, no compiler imported."""
    art = cache.load_artifacts(path, status="cached")
    if not _dsl_available():
        _check_runtime_for(art)
    meta = art.meta
    if not isinstance(meta.get("spec"), Mapping) or not isinstance(meta.get("plan"), Mapping):
        raise cache.CacheError(f"{path}/meta.json records no spec and plan (an entry built outside mokgen.emit)")
    from .ops import CompiledMoE
    from .spec import Spec

    spec = Spec.from_dict(meta["spec"])
    return CompiledMoE(spec, _PlanView(meta["plan"]), Path(art.dir), arch=art.arch, functions=functions)
