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
import time
from pathlib import Path
from typing import Any, Callable, Sequence

EXIT_ERROR = 2

_ERROR_CLASSES = (
    ("mokgen.spec", "SpecError"),
    ("mokgen.plan", "PlanError"),
    ("mokgen.emit", "EmitError"),
    ("mokgen.build", "BuildError"),
    ("mokgen.cache", "CacheError"),
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
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    right = right or [False] * len(headers)

    def fmt(r: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if ra else c.ljust(w) for c, w, ra in zip(r, widths, right)).rstrip()

    lines = [fmt(cells[0]), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in cells[1:]]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# the stages, looked up lazily


def _load_spec(src: str) -> Any:
    return _need("mokgen.spec", "load_spec").load_spec(src)


def _arch(args: argparse.Namespace) -> str:
    from .build import resolve_arch

    return resolve_arch(getattr(args, "arch", None))


def _overrides(items: list[str] | None) -> dict[str, Any]:
    """``--set key=value`` (repeatable) -> plan overrides; integers are converted."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CLIError(f"--set: expected KEY=VALUE, got {item!r}")
        out[key.strip()] = int(value) if value.strip().lstrip("-").isdigit() else value.strip()
    return out


def _solve(spec: Any, arch: str, sets: list[str] | None = None) -> Any:
    return _need("mokgen.plan", "solve").solve(spec, arch, **_overrides(sets))


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
    plan = _solve(spec, arch, args.set)
    if args.json:
        _out(json.dumps(_to_dict(plan), indent=2, sort_keys=True))
        return 0
    if args.explain:
        _out(str(_need("mokgen.plan", "explain").explain(plan)).rstrip())
        return 0
    _out(f"plan for {spec.name} on {arch}:")
    for k, v in _flatten(_to_dict(plan)):
        if k in ("spec",) or k.startswith("spec."):
            continue
        _out(f"  {k}: {v}")
    return 0


def cmd_emit(args: argparse.Namespace) -> int:
    from .build import _safe_relpath, _write_if_changed

    spec = _load_spec(args.spec)
    arch = _arch(args)
    sources = _emit(_solve(spec, arch))
    out = Path(args.out)
    for fname, text in sorted(sources.files.items()):
        _write_if_changed(out / _safe_relpath(fname), text)
        _out(str(out / fname))
    _err(f"mokgen: emitted {len(sources.files)} file(s) for {spec.name} on {arch} "
         f"(template hash {str(sources.template_hash)[:12]}) into {out}")
    return 0


def _print_ptx_report(report: dict[str, dict[str, bool]]) -> None:
    if not report:
        return
    feats = [f for f in next(iter(report.values())) if f != "target"]
    short = {"wgmma.mma_async": "wgmma", "cp.async.bulk.tensor": "tma", "mbarrier": "mbarrier",
             "tcgen05": "tcgen05"}
    rows = [[k] + ["yes" if r.get(f) else "-" for f in feats] + ["yes" if r.get("target") else "NO"]
            for k, r in report.items()]
    _out(_table(["kernel"] + [short.get(f, f) for f in feats] + ["target arch"], rows))


def cmd_compile(args: argparse.Namespace) -> int:
    from . import build, cache

    spec = _load_spec(args.spec)
    arch = _arch(args)
    plan = _solve(spec, arch, args.set)
    sources = _emit(plan)
    key = cache.key_for(sources, arch)
    cached = not args.force and cache.lookup(key, arch) is not None
    t0 = time.monotonic()
    art = cache.get_or_build(sources, arch, force=args.force, jobs=args.jobs, progress=not args.quiet)
    how = "cached" if cached else f"built in {time.monotonic() - t0:.1f} s"
    _out(f"{spec.name} {arch}: {len(art.kernels)} kernel(s), {how}")
    _out(f"entry: {art.dir}")
    _out(f"library: {art.lib}")
    _print_ptx_report(build.ptx_report(art))
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    from . import cache

    what = args.cache_cmd
    if what == "path":
        _out(str(cache.cache_root()))
    elif what == "list":
        entries = cache.list_entries(args.arch)
        if not entries:
            _err(f"mokgen: no cache entries in {cache.cache_root()}")
            return 0
        rows = [[e.arch, e.path.name, e.spec_name, len(e.meta.get("kernels", [])), f"{e.size / 1e6:.1f}",
                 str(e.meta.get("stored_at", "?")), str(e.path)] for e in entries]
        _out(_table(["arch", "key", "spec", "kernels", "MB", "stored", "path"], rows,
                    [False, False, False, True, True, False, False]))
    elif what == "clear":
        n = cache.clear(args.arch)
        _out(f"removed {n} entr{'y' if n == 1 else 'ies'} from {cache.cache_root()}"
             + (f" ({args.arch})" if args.arch else ""))
    elif what == "pack":
        out = cache.pack(args.out, args.arch)
        n = len(cache.list_entries(args.arch))
        _out(f"packed {n} entr{'y' if n == 1 else 'ies'} and the CuTe DSL runtime into {out} "
             f"({out.stat().st_size / 1e6:.1f} MB)")
        _out(f"on the GPU host: mokgen cache unpack {out.name}")
    elif what == "unpack":
        res = cache.unpack(args.tar)
        for p in res["installed"]:
            _out(f"installed {p}")
        for p in res["present"]:
            _out(f"present   {p}")
        if res["runtime"]:
            _out(f"runtime   {res['runtime']}")
        for name, why in res["refused"]:
            _err(f"mokgen: refused {name}: {why}")
        if res["refused"]:
            raise cache.CacheError(f"{len(res['refused'])} entr{'y' if len(res['refused']) == 1 else 'ies'} of "
                                   f"{args.tar} refused (see above)")
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
    return int(tune.main([args.spec, *args.rest]) or 0)


# ----------------------------------------------------------------------------------------------------------


def make_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="mokgen",
        description="Compile Mixture-of-Experts kernels from a spec (preset name or YAML file).",
    )
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND")
    sub.required = True
    arch_help = "target arch: sm_90a or sm_100a (default: $MOKGEN_ARCH, else the visible GPU)"

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
    p.add_argument("--jobs", "-j", type=int, default=None, metavar="N", help="parallel compiles (default: ninja's)")
    p.add_argument("--force", action="store_true", help="rebuild even if the cache has the entry")
    p.add_argument("--quiet", "-q", action="store_true", help="no build progress")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="plan override (repeatable), e.g. schedule=fused, cluster=2, gemm1_bn=128")
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("cache", help="inspect and move the kernel cache")
    csub = p.add_subparsers(dest="cache_cmd", metavar="ACTION")
    csub.required = True
    c = csub.add_parser("list", help="list the complete entries")
    c.add_argument("--arch")
    c = csub.add_parser("clear", help="remove entries")
    c.add_argument("--arch")
    c = csub.add_parser("pack", help="write entries + the CuTe DSL runtime to a .tar.xz for GPU hosts")
    c.add_argument("out", metavar="OUT")
    c.add_argument("--arch")
    c = csub.add_parser("unpack", help="install a pack into this host's cache")
    c.add_argument("tar", metavar="TAR")
    csub.add_parser("path", help="print the cache directory")
    p.set_defaults(func=cmd_cache, arch=None)

    p = sub.add_parser("bench", help="benchmark the forward pass of a spec (tools/bench_forward.py)")
    p.add_argument("spec", metavar="SPEC")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="passed on to the benchmark")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("tune", help="pick the fastest plan on this GPU")
    p.add_argument("spec", metavar="SPEC")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_tune)
    return ap


def _one_line(e: BaseException) -> str:
    msg = str(e).strip() or type(e).__name__
    return msg.splitlines()[0]


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
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
        raise


if __name__ == "__main__":
    sys.exit(main())
