"""``mokgen`` command line (also ``python -m mokgen``).

Every mokgen error (a bad spec, an infeasible plan, a failing kernel, a cache problem, no target arch) ends
the command with one line ``mokgen: error: ...`` on stderr and exit status 2; no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from .cliargs import EXIT_ERROR, Parser, positive_int

_ERROR_CLASSES = (
    ("mokgen.arch", "ArchError"),
    ("mokgen.spec", "SpecError"),
    ("mokgen.plan", "PlanError"),
    ("mokgen.emit", "EmitError"),
    ("mokgen.build", "BuildError"),
    ("mokgen.cache", "CacheError"),
    ("mokgen.tune", "TuneError"),
)


class CLIError(Exception):
    """An error of the command line itself (bad arguments, a missing tool)."""


def _mokgen_errors() -> tuple[type[BaseException], ...]:
    """The mokgen error classes whose modules import (spec/plan/emit may be absent in a partial tree)."""
    out: list[type[BaseException]] = [CLIError]
    for mod, name in _ERROR_CLASSES:
        m = sys.modules.get(mod)
        if m is None:
            try:
                m = importlib.import_module(mod)
            except Exception:
                continue
        cls = getattr(m, name, None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            out.append(cls)
    return tuple(out)


def _need(module: str, *names: str) -> Any:
    """Import ``module`` (and check it has ``names``), or a CLIError that says what is missing."""
    try:
        m = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:
            raise CLIError(f"{module} is not available in this checkout") from None
        raise
    for n in names:
        if not hasattr(m, n):
            raise CLIError(f"{module} has no {n}() yet")
    return m


def _out(line: str = "") -> None:
    print(line, flush=True)


def _err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[bool] | None = None) -> str:
    """A plain-text table (rich): a header line, a line of dashes, one line per row; never wrapped."""
    import io

    from rich import box
    from rich.console import Console
    from rich.table import Table

    dashes = box.Box("    \n    \n -  \n    \n    \n    \n    \n    \n", ascii=True)
    t = Table(box=dashes, show_edge=False, pad_edge=False, padding=(0, 1), header_style=None)
    right = right or [False] * len(headers)
    for h, r in zip(headers, right):
        t.add_column(str(h), justify="right" if r else "left", no_wrap=True, overflow="ignore")
    for r in rows:
        t.add_row(*["" if c is None else str(c) for c in r])
    buf = io.StringIO()
    Console(file=buf, width=1 << 16, color_system=None, force_terminal=False, highlight=False,
            emoji=False, markup=False).print(t)
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines())


# ----------------------------------------------------------------------------------------------------------
# the stages, looked up lazily


def _load_spec(src: str) -> Any:
    return _need("mokgen.spec", "load_spec").load_spec(src)


def _arch(args: argparse.Namespace) -> str:
    from .arch import resolve_arch

    return resolve_arch(getattr(args, "arch", None))


def _overrides(items: list[str] | None) -> dict[str, Any]:
    """``--set key=value`` (repeatable; also ``k=v,k=v``) -> plan overrides, through the one parser
    (:func:`mokgen.plan.parse_overrides`); integers are converted."""
    parse = _need("mokgen.plan", "parse_overrides").parse_overrides
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise CLIError(f"--set: expected KEY=VALUE, got {item!r}")
        out.update(parse(item, what="--set"))
    return out


def _solve(spec: Any, arch: str, sets: list[str] | None = None) -> Any:
    return _solve_tuned(spec, arch, sets)[0]


def _solve_tuned(spec: Any, arch: str, sets: list[str] | None = None) -> tuple[Any, Any]:
    """(plan, tuned info) as ``mokgen.compile`` gets them: the tuned plan where the tuning database has one
    and no --set is given (mokgen.driver.plan_for)."""
    _need("mokgen.plan", "solve")
    from .driver import plan_for

    return plan_for(spec, arch, _overrides(sets))


def _emit(plan: Any) -> Any:
    return _need("mokgen.emit", "emit").emit(plan)


def _to_dict(obj: Any) -> Any:
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    import dataclasses

    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return obj


def _flatten(d: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(d, dict):
        out: list[tuple[str, Any]] = []
        for k in d:
            out += _flatten(d[k], f"{prefix}{k}.")
        return out
    return [(prefix[:-1], d)]


# ----------------------------------------------------------------------------------------------------------
# commands


def cmd_specs(args: argparse.Namespace) -> int:
    specs = _need("mokgen.spec", "list_presets").list_presets()
    rows = []
    for s in specs:
        rows.append([s.name, s.hidden, s.ffn, s.experts, s.topk, s.ep, s.local_experts, s.shared_experts,
                     s.tokens, s.activation])
    _out(_table(["name", "H", "I", "experts", "topk", "ep", "local experts", "shared", "tokens", "activation"],
                rows, [False] + [True] * 8 + [False]))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    spec = _load_spec(args.spec)
    arch = _arch(args)
    plan, info = _solve_tuned(spec, arch, args.set)
    if args.json:
        _out(json.dumps(_to_dict(plan), indent=2, sort_keys=True))
        return 0
    if args.explain:
        _out(str(_need("mokgen.plan", "explain").explain(plan)).rstrip())
        _out("")
        _out("\n".join(_explain_tuning(spec, arch, info)))
        return 0
    _out(f"plan for {spec.name} on {arch}:")
    for k, v in _flatten(_to_dict(plan)):
        if k in ("spec",) or k.startswith("spec."):
            continue
        _out(f"  {k}: {v}")
    return 0


def _explain_tuning(spec: Any, arch: str, info: Any) -> list[str]:
    """The tuned record and its pieces, or why there is none and the fitted model's piecewise plan."""
    C = _need("mokgen.costmodel", "fit", "piecewise")
    if info is None:
        return ["tuning: not consulted (--set overrides the plan)"]
    rec, pw, where = info
    from .arch import ARCHS

    if arch in ARCHS and ARCHS[arch].has_tcgen05:   # sm_100a: its kernels' one form, nothing measured to tune
        return [f"tuning: none for {arch} (no {arch} GPU here: its plan is its kernels' form, not tuned or fitted)"]
    if rec is not None:
        return [f"tuning: this plan is the tuned one: record {where} ({rec['gpu']}, {rec['created']}, tuned at "
                f"T = {', '.join(map(str, (rec.get('tune') or {}).get('tokens', [])))})", *pw.describe()]
    if getattr(spec, "dtype", "bf16") == "fp8":
        return [f"tuning: {where}; `mokgen tune {spec.name}` on the GPU measures the FP8 candidates (the fitted "
                "model has no FP8 records: no piecewise plan)"]
    fit = C.fit(C.bench_records())
    pw = C.piecewise(spec, arch, fit.theta)
    return [f"tuning: {where}; `mokgen tune {spec.name}` on the GPU measures the candidates",
            *fit.describe(), "the fitted model's plan as a function of T (not measured):", *pw.describe()]


def _writable_dir(path: Path, what: str) -> Path:
    """Create ``path`` (a directory we are about to write into), or a CLIError that says why not and what to do."""
    if path.exists() and not path.is_dir():
        raise CLIError(f"{what} {path} is not a directory; choose a directory (it is created if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        from .cache import os_error_message

        raise CLIError(os_error_message(e, f"create {what}", "choose another directory", e.filename or path)) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise CLIError(f"cannot write into {what} {path}: permission denied or read-only; choose another directory")
    return path


def cmd_emit(args: argparse.Namespace) -> int:
    from .build import _safe_relpath, _write_if_changed
    from .cache import os_error_message

    spec = _load_spec(args.spec)
    arch = _arch(args)
    sources = _emit(_solve(spec, arch))
    out = _writable_dir(Path(args.out), "--out")
    for fname, text in sorted(sources.files.items()):
        try:
            _write_if_changed(out / _safe_relpath(fname), text)
        except OSError as e:
            raise CLIError(os_error_message(e, "write", None, e.filename or out / fname)) from None
        _out(str(out / fname))
    _err(f"mokgen: emitted {len(sources.files)} file(s) for {spec.name} on {arch} "
         f"(template hash {str(sources.template_hash)[:12]}) into {out}")
    return 0


def _print_ptx_report(report: dict[str, dict[str, bool]]) -> None:
    if not report:
        return
    feats = [f for f in next(iter(report.values())) if f != "target"]
    short = {"wgmma.mma_async": "wgmma", "cp.async.bulk.tensor": "tma", "mbarrier": "mbarrier",
             "tcgen05": "tcgen05", "block_scale": "block-scaled mma"}
    rows = [[k] + ["yes" if r.get(f) else "-" for f in feats] + ["yes" if r.get("target") else "NO"]
            for k, r in report.items()]
    _out(_table(["kernel"] + [short.get(f, f) for f in feats] + ["target arch"], rows))


def _report_compiled(name: str, arch: str, art: Any) -> None:
    from . import build

    _out(f"{name} {arch}: {len(art.kernels)} kernel(s), {art.note or art.status or 'ready'}")
    _out(f"entry: {art.dir}")
    _out(f"library: {art.lib}")
    _print_ptx_report(build.ptx_report(art))
    from .arch import ARCHS

    if arch in ARCHS and ARCHS[arch].note:
        _out(ARCHS[arch].note)
    if getattr(art, "status", None) in ("built", "rebuilt"):
        _print_ptxas_report(build.ptxas_report(art))


def _print_ptxas_report(adv: dict[str, list[str]] | None) -> None:
    """After a build, where a ptxas is at hand: its wgmma-pipeline advisories (a serialized wgmma is a kernel
    running its tensor cores one instruction at a time: a bug in the template, not the user's problem to fix)."""
    if not adv:   # no ptxas at hand, or no wgmma kernel (sm_100a's GEMMs are tcgen05)
        return
    bad = {k: v for k, v in adv.items() if v}
    if not bad:
        _out(f"ptxas: wgmma pipelined in all {len(adv)} GEMM kernel(s) (no performance advisories)")
        return
    _out(f"ptxas: performance advisories in {len(bad)} of {len(adv)} GEMM kernel(s) (please report them):")
    for k, v in bad.items():
        _out(f"  {k}: {'; '.join(v)}")


def cmd_compile(args: argparse.Namespace) -> int:
    from . import driver

    # the call as mokgen.compile(SPEC, arch=..., overrides=...) describes it, through the same function and
    # before anything is resolved: `mokgen compile` and mokgen.compile() read and write one warm-start record
    arch, key_doc = None, None
    try:
        overrides = _overrides(args.set)
    except Exception:
        pass   # the full way below reports it (after the spec, as always)
    else:
        arch, key_doc = driver.call_key(args.spec, args.arch, overrides)
    if key_doc is not None and driver.warm_start_wanted(args.force):
        hit = driver.warm_entry(key_doc, arch)
        if hit is not None:   # verified as on every load; no plan solver, emit or CuTe DSL
            driver.record_runtime(key_doc, hit)
            name = str(getattr(hit.plan.spec, "name", None) or args.spec)
            for note in getattr(hit.plan, "notes", ()):   # as the full way says it: "tuned plan from ..."
                if str(note).startswith("tuned"):
                    _out(f"{name} {arch}: tuned plan, {note}")
            _report_compiled(name, arch, hit.art)
            return 0
    spec = _load_spec(args.spec)
    arch = _arch(args)
    plan, info = _solve_tuned(spec, arch, args.set)
    plans = [plan]
    if info is not None and info[0] is not None:
        rec, pw, where = info
        _out(f"{spec.name} {arch}: tuned plan from {where} ({rec['gpu']}, {rec['created']}), "
             f"{len(pw.pieces)} piece(s)")
        if len(pw.pieces) > 1:   # the plans mokgen.compile() loads: each piece with the record's tuned backward
            plans = [driver.tuned_plan(spec, arch, rec, pw, pc) for pc in pw.pieces]
    for plan in plans:
        sources = _emit(plan)
        # the same resolution as mokgen.compile(): build where the compiler is, find (by key or content) where not
        art = driver.resolve(sources, arch, force=args.force, jobs=args.jobs, progress=not args.quiet)
        if len(plans) == 1:   # the record mokgen.compile() of the same call finds (naming the DSL's runtime too)
            driver.remember(key_doc, art, sources, find_runtime=True)
        _report_compiled(spec.name, arch, art)
    return 0


def _n(n: int, word: str = "entr") -> str:
    return f"{n} {word}{'y' if n == 1 else 'ies'}" if word == "entr" else f"{n} {word}{'' if n == 1 else 's'}"


def _status(e: Any) -> str:
    return "ok" if e.ok else str(e.problem).split(":", 1)[0].upper()


def cmd_cache(args: argparse.Namespace) -> int:
    from . import cache

    what = args.cache_cmd
    if what == "path":
        _out(str(cache.cache_root()))
    elif what == "list":
        entries = cache.scan_entries(args.arch)
        if not entries:
            _err(f"mokgen: no cache entries in {cache.cache_root()}")
            return 0
        rows = [[e.arch, e.path.name, e.spec_name, len(e.meta.get("kernels", []) or []), f"{e.size / 1e6:.1f}",
                 str(e.meta.get("stored_at", "?")), _status(e), str(e.path)] for e in entries]
        _out(_table(["arch", "key", "spec", "kernels", "MB", "stored", "status", "path"], rows,
                    [False, False, False, True, True, False, False, False]))
        bad = [e for e in entries if not e.ok]
        for e in bad:
            _err(f"mokgen: {e.path}: {e.problem}")
        if bad:
            _err(f"mokgen: {_n(len(bad))} damaged or misfiled: never loaded; `mokgen compile` rebuilds them, "
                 "`mokgen cache clear` removes them")
    elif what == "verify":
        entries = cache.verify(args.arch)
        bad = [e for e in entries if not e.ok]
        for e in entries:
            _out(f"{'ok' if e.ok else _status(e):9} {e.path}" + ("" if e.ok else f": {e.problem.split(': ', 1)[-1]}"))
        if bad:
            raise cache.CacheError(f"{len(bad)} of {len(entries)} checked in {cache.cache_root()} damaged or "
                                   "misfiled (see above): `mokgen compile SPEC` rebuilds an entry, `mokgen cache "
                                   "clear` removes them, `mokgen cache unpack` reinstalls a runtime")
        _out(f"verified {_n(len(entries), 'item')} in {cache.cache_root()}: all intact")
    elif what == "clear":
        removed, kept = cache.clear_report(args.arch)
        where = f"{cache.cache_root()}" + (f" ({args.arch})" if args.arch else "")
        _out(f"removed {_n(len(removed))} from {where}")
        for p, why in kept:
            _err(f"mokgen: not removed: {p}: {why}")
        if kept:
            raise cache.CacheError(f"{len(kept)} director{'y' if len(kept) == 1 else 'ies'} not removed from "
                                   f"{where} (see above)")
    elif what == "pack":
        from . import packs

        out = packs.pack(args.out, args.arch, runtime=not args.no_runtime)
        import tarfile

        with tarfile.open(out) as tf:
            n = len({m.name.split("/")[1] for m in tf.getmembers() if m.name.startswith("sm_") and "/" in m.name})
        with_rt = ("(no runtime library: the GPU host needs the same CuTe DSL installed, "
                   f"{cache.dsl_versions().get(cache._DSL_PREFIX)})" if args.no_runtime else "and the CuTe DSL runtime")
        _out(f"packed {_n(n)} {with_rt} into {out} ({out.stat().st_size / 1e6:.1f} MB)")
        _out(f"on the GPU host: mokgen cache unpack {out.name}")
    elif what == "unpack":
        from . import packs

        res = packs.unpack(args.tar)
        for p in res["installed"]:
            _out(f"installed {p}")
        for p in res["present"]:
            _out(f"present   {p}")
        if res["runtime"]:
            _out(f"runtime   {res['runtime']} ({res.get('runtime_status') or 'installed'})")
    return 0


def _repo_tool(name: str) -> Path:
    p = Path(__file__).resolve().parent.parent / "tools" / name
    if not p.exists():
        raise CLIError(f"{p} not found (`mokgen bench` runs from a source checkout)")
    return p


def cmd_bench(args: argparse.Namespace) -> int:
    path = _repo_tool("bench_forward.py")
    spec = importlib.util.spec_from_file_location("mokgen_tools_bench_forward", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    if not callable(getattr(mod, "main", None)):
        raise CLIError(f"{path} has no main()")
    rc = mod.main([args.spec, *args.rest])
    return int(rc or 0)


def cmd_tune(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("mokgen.tune") is None:
        _err("mokgen: tune: not implemented yet")
        return EXIT_ERROR
    tune = importlib.import_module("mokgen.tune")
    if not callable(getattr(tune, "main", None)):
        _err("mokgen: tune: not implemented yet")
        return EXIT_ERROR
    try:
        return int(tune.main(list(args.rest)) or 0)
    except SystemExit as e:  # its parser's --help (0) or usage error (already reported in one line)
        return e.code if isinstance(e.code, int) else EXIT_ERROR


# ----------------------------------------------------------------------------------------------------------


def make_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .arch import ARCH_NAMES

    ap = Parser(
        prog="mokgen",
        description="Compile Mixture-of-Experts kernels from a spec (preset name or YAML file).",
    )
    ap.add_argument("--version", action="version", version=f"mokgen {__version__}")
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    arch_help = f"target arch: {' or '.join(ARCH_NAMES)} (default: $MOKGEN_ARCH, else the visible GPU)"

    p = sub.add_parser("specs", help="list the preset specs")
    p.set_defaults(func=cmd_specs)

    p = sub.add_parser("plan", help="solve and show the plan of a spec")
    p.add_argument("spec", metavar="SPEC", help="preset name or YAML path")
    p.add_argument("--arch", help=arch_help)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--explain", action="store_true", help="explain why this plan was chosen")
    g.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="plan override (repeatable), e.g. schedule=fused, cluster=2, gemm1_bn=128")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("emit", help="write the generated kernel sources to a directory")
    p.add_argument("spec", metavar="SPEC")
    p.add_argument("--arch", help=arch_help)
    p.add_argument("--out", required=True, metavar="DIR")
    p.set_defaults(func=cmd_emit)

    p = sub.add_parser("compile", help="emit and build the kernels (through the cache)")
    p.add_argument("spec", metavar="SPEC")
    p.add_argument("--arch", help=arch_help)
    p.add_argument("--jobs", "-j", type=positive_int("parallel compiles"), default=None, metavar="N",
                   help="parallel compiles, >= 1 (default: ninja's)")
    p.add_argument("--force", action="store_true", help="rebuild even if the cache has the entry")
    p.add_argument("--quiet", "-q", action="store_true", help="no build progress")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="plan override (repeatable), e.g. schedule=fused, cluster=2, gemm1_bn=128")
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("cache", help="inspect and move the kernel cache")
    csub = p.add_subparsers(dest="cache_cmd", metavar="ACTION", parser_class=Parser)
    csub.required = True
    c = csub.add_parser("list", help="list the entries (damaged or misfiled ones marked)")
    c.add_argument("--arch")
    c = csub.add_parser("verify", help="check every entry's files against their sha256 (exit 2 on damage)")
    c.add_argument("--arch")
    c = csub.add_parser("clear", help="remove entries")
    c.add_argument("--arch")
    c = csub.add_parser("pack", help="write entries + the CuTe DSL runtime to a .tar.xz for GPU hosts")
    c.add_argument("out", metavar="OUT")
    c.add_argument("--arch")
    c.add_argument("--no-runtime", action="store_true",
                   help="leave the 43 MB runtime library out (for a GPU host with the same CuTe DSL installed)")
    c = csub.add_parser("unpack", help="install a pack into this host's cache")
    c.add_argument("tar", metavar="TAR")
    csub.add_parser("path", help="print the cache directory")
    p.set_defaults(func=cmd_cache, arch=None)

    p = sub.add_parser("bench", help="benchmark the forward pass of a spec (tools/bench_forward.py)")
    p.add_argument("spec", metavar="SPEC")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="passed on to the benchmark")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("tune", help="pick the fastest plan on this GPU (mokgen tune --help)", add_help=False,
                       prefix_chars="\0")  # every argument goes to mokgen.tune's own parser
    p.add_argument("rest", nargs=argparse.REMAINDER, metavar="SPEC [--tokens ...] | --show | --clear")
    p.set_defaults(func=cmd_tune)
    return ap


def _one_line(e: BaseException) -> str:
    msg = str(e).strip() or type(e).__name__
    return msg.splitlines()[0]


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = make_parser().parse_args(argv)
    except SystemExit as e:  # --help, --version (0) or a usage error (already reported in one line)
        return int(e.code or 0) if not isinstance(e.code, str) else EXIT_ERROR
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KeyboardInterrupt:
        _err("mokgen: interrupted")
        return 130
    except BrokenPipeError:
        with __import__("contextlib").suppress(Exception):
            sys.stdout = open(os.devnull, "w")
        return 0
    except Exception as e:
        if isinstance(e, _mokgen_errors()):
            _err(f"mokgen: error: {_one_line(e)}")
            return EXIT_ERROR
        if isinstance(e, OSError):  # a file system failure nothing above turned into a mokgen error
            from .cache import os_error_message

            remedy = ("free space there or set MOKGEN_CACHE_DIR to another file system"
                      if e.errno in (28, 122) else None)  # ENOSPC, EDQUOT
            _err(f"mokgen: error: {os_error_message(e, 'write' if e.errno in (28, 122, 30) else 'access', remedy)}")
            return EXIT_ERROR
        raise


if __name__ == "__main__":
    sys.exit(main())
