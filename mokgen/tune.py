"""``mokgen tune``: pick the fastest plan for a spec on this GPU, as a piecewise function of the token count.

    mokgen tune SPEC [--tokens T1,T2,...] [--budget MINUTES] [--json FILE] [--top N] [--rounds N] [--arch A]
    mokgen tune --show [SPEC]          mokgen tune --clear [SPEC]

1. candidates: the config space's enumeration (:func:`mokgen.configs.enumerate_configs`), plus the solver's
   default plan at each T; the cost model (:mod:`mokgen.costmodel`, fitted to the benchmark records and earlier
   tune records) ranks them at each T and keeps the best ``--top`` per T (and every default);
2. compile the survivors' forward kernels in parallel on CPU workers through the cache (a kernel several
   candidates share, such as routing or combine, is compiled once: :mod:`mokgen.kcache`);
3. time them on the GPU at each T: a warm-up to the sustained (power-capped) clock, then interleaved rounds
   (every candidate once per round, in a rotated order), CUDA events, the median of the rounds;
4. verify each T's winner against :func:`mokgen.reference.forward` (relative error, and the same bits on a
   rerun);
5. the winners -> a :class:`mokgen.costmodel.PiecewisePlan` (breakpoints between token counts whose winners
   differ: the refitted model's crossover, solved by sympy), stored in the tuning database
   (:mod:`mokgen.tunedb`); ``mokgen compile`` / ``mokgen.compile`` then use it and say so.

The compile, timing and verification steps are functions passed to :func:`tune` (CPU tests give fakes).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from . import costmodel as C
from . import plan as P
from . import configs as CF
from . import space as S
from . import tunedb
from .spec import Spec, load_spec

__all__ = ["Candidate", "TuneError", "tune", "main", "config_of", "select_candidates", "CudaTimer", "time_rounds",
           "tune_train", "TrainStep", "time_rounds_settled", "verify_train_gpu", "train_inputs"]

DEFAULT_BUDGET_MIN = 5.0
DEFAULT_TOP = 4
VERIFY_TOL = 1e-2


class TuneError(RuntimeError):
    """Tuning cannot run or failed (no GPU, every candidate failed, a winner failed verification)."""


@dataclasses.dataclass
class Candidate:
    cfg: dict[str, Any]  # plan overrides (complete for the searched axes)
    label: str
    plan: Any = None  # forward-only plan (backward=None) at spec.tokens
    defaults: tuple[int, ...] = ()  # the T values whose solver default this is
    predicted: dict[int, float] = dataclasses.field(default_factory=dict)
    moe: Any = None
    error: str | None = None
    compile_s: float = 0.0
    times: dict[int, list[float]] = dataclasses.field(default_factory=dict)

    def median(self, t: int) -> float | None:
        xs = self.times.get(t)
        return statistics.median(xs) if xs else None


def _label(cfg: Mapping[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(cfg.items()))


def config_of(plan: Any) -> dict[str, Any]:
    """Overrides that make :func:`mokgen.plan.solve` reproduce ``plan``'s forward choices at any token count."""
    cfg: dict[str, Any] = {"schedule": plan.schedule}
    for name in ("gemm1", "gemm2"):
        g = getattr(plan, name)
        cfg.update({f"{name}_bn": g.bn, f"{name}_consumer": g.consumer, f"{name}_raster_group": g.raster_group,
                    f"{name}_cluster": g.cluster, f"{name}_stages": g.stages})
        if g.w_hint != "normal":
            cfg[f"{name}_w_hint"] = g.w_hint
        if g.a_hint != "normal":
            cfg[f"{name}_a_hint"] = g.a_hint
    cfg["gemm1_a_load"] = plan.gemm1.a_load
    if getattr(plan.spec, "dtype", "bf16") == "mxfp8":   # sm_100a's MXFP8 form fixes the tiles and stages (no keys)
        for k in [k for k in cfg if k.endswith(("_bn", "_stages"))]:
            del cfg[k]
    if plan.schedule == "fused":  # the fused schedule takes no cluster / consumer / stages keys of its own
        for k in [k for k in cfg if k.endswith(("_cluster", "_consumer", "_stages", "_raster_group"))]:
            del cfg[k]
        cfg.pop("gemm1_a_load")
    return cfg


def _key(cfg: Mapping[str, Any]) -> str:
    return json.dumps(dict(cfg), sort_keys=True)


def select_candidates(spec: Spec, arch: str, tokens: Sequence[int], theta: Mapping[str, float],
                      top: int = DEFAULT_TOP) -> tuple[list[Candidate], int]:
    """(the candidates worth compiling, how many configs the space has): the model's best ``top`` at each T,
    plus the solver's default plan at each T."""
    configs = list(CF.enumerate_configs(spec, arch))
    by_key: dict[str, Candidate] = {}
    for t in tokens:
        d = config_of(P.solve(C.with_tokens(spec, t), arch))
        c = by_key.setdefault(_key(d), Candidate(d, "default@" + ",".join(map(str, [t]))))
        c.defaults += (t,)
    lines = {}
    for cfg in configs:
        p = P.solve(spec, arch, **cfg)
        lines[_key(cfg)] = (cfg, C.line(theta, C.features(spec, p)))
    for t in tokens:
        ranked = sorted(lines.values(), key=lambda cl: cl[1][0] * t + cl[1][1])
        for cfg, _ln in ranked[:top]:
            by_key.setdefault(_key(cfg), Candidate(cfg, _label(cfg)))
    for c in by_key.values():
        if c.defaults:
            c.label = "default@" + ",".join(map(str, c.defaults))
        full = P.solve(spec, arch, **c.cfg)
        c.plan = dataclasses.replace(full, backward=None)  # tune times the forward: its kernels only
        ln = C.line(theta, C.features(spec, c.plan))
        c.predicted = {t: ln[0] * t + ln[1] for t in tokens}
    return list(by_key.values()), len(configs)


# ---- GPU pieces (real implementations; tests pass fakes) ---------------------------------------------------
def compile_candidate(spec: Spec, arch: str, plan: Any, jobs: int | None = 2) -> Any:
    """Emit + build (through the cache) + load one candidate's forward kernels -> CompiledMoE."""
    from . import driver, emit
    from .ops import CompiledMoE

    art = driver.get_or_build(emit.emit(plan), arch, jobs=jobs, progress=False)
    return CompiledMoE(spec, plan, Path(art.dir), arch=arch)


class CudaTimer:
    """CUDA-event timing in the sustained regime: :meth:`sustain` runs the functions back to back until the
    GPU has held its load for ``warmup_s`` seconds (the H200 settles at its power cap, ~1.5 GHz, within a
    second or so: bench/NOTES.md v2); :meth:`__call__` times ``reps`` calls of one function."""

    def __init__(self, warmup_s: float = 2.0, reps: int = 10):
        import torch

        self.torch = torch
        self.warmup_s = warmup_s
        self.reps = reps

    def sustain(self, fns: Sequence[Callable[[], Any]], seconds: float | None = None) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < (self.warmup_s if seconds is None else seconds):
            for f in fns:
                f()
            self.torch.cuda.synchronize()

    def __call__(self, fn: Callable[[], Any]) -> float:
        torch = self.torch
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(self.reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / self.reps


def time_rounds(fns: Mapping[str, Callable[[], Any]], timer: Any, rounds: int,
                on_round: Callable[[int], None] | None = None) -> dict[str, list[float]]:
    """Interleaved rounds: every function once per round, the order rotated each round; ms per call."""
    names = list(fns)
    out: dict[str, list[float]] = {n: [] for n in names}
    if hasattr(timer, "sustain"):
        timer.sustain(list(fns.values()))
    for r in range(rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            out[n].append(float(timer(fns[n])))
        if on_round:
            on_round(r)
    return out


def verify_gpu(spec: Spec, moe: Any, inputs: Any) -> dict[str, Any]:
    """The winner against the float32 reference (relative error) and itself (same bits on a rerun)."""
    import torch

    from . import reference

    x, idx, w, w1, w2, b1, b2 = inputs
    y = moe(x, idx, w, w1, w2, b1, b2).clone()
    y2 = moe(x, idx, w, w1, w2, b1, b2)
    ref = reference.forward(x, idx, w, w1, w2, spec, b1, b2, dtype=torch.float32)
    err = reference.rel_err(y.float(), ref.float())
    return {"rel_err": err, "bitwise_rerun": bool(torch.equal(y, y2)), "ok": err <= VERIFY_TOL and
            bool(torch.equal(y, y2)) and bool(torch.isfinite(y.float()).all())}


def _inputs_gpu(spec: Spec, t: int) -> Any:
    from . import reference

    return reference.random_inputs(C.with_tokens(spec, t), tokens=t, device="cuda", seed=0)


# ---- the run ---------------------------------------------------------------------------------------------------
class _Progress:
    """A rich progress bar on a terminal, plain lines otherwise (stderr)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.bar = None
        if enabled and sys.stderr.isatty():
            try:
                from rich.console import Console
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

                self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                    TimeElapsedColumn(), console=Console(stderr=True))
                self.bar.start()
            except Exception:
                self.bar = None
        self.task = None

    def phase(self, what: str, total: int) -> None:
        if self.bar is not None:
            if self.task is not None:
                self.bar.update(self.task, visible=True)
            self.task = self.bar.add_task(what, total=total)
        elif self.enabled:
            print(f"mokgen tune: {what} ({total})", file=sys.stderr, flush=True)

    def step(self, msg: str = "") -> None:
        if self.bar is not None and self.task is not None:
            self.bar.advance(self.task)
            if msg:
                self.bar.console.print("  " + msg, markup=False, highlight=False)
        elif self.enabled and msg:
            print(f"  {msg}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _session(tokens: Sequence[int], gpu: str | None, tools: Mapping[str, str] | None,
             template_hash: str | None) -> tuple[list[int], str, dict[str, str], str]:
    """What a tuning run keys its record by, checked: the sorted distinct token counts, the GPU's name (the
    visible one unless given), the toolchain and the template hash."""
    tokens = sorted({int(t) for t in tokens})
    if not tokens or tokens[0] < 1:
        raise TuneError(f"--tokens: positive token counts needed, got {tokens}")
    if gpu is None:
        gpu = tunedb.gpu_name()
        if gpu is None:
            raise TuneError("tune times kernels on a GPU and none is visible (torch.cuda.is_available() is False)")
    tools = dict(tools if tools is not None else tunedb.toolchain())
    if template_hash is None:
        from .emit import template_hash as th

        template_hash = th()
    return tokens, gpu, tools, template_hash


def tune(spec: Spec, arch: str, tokens: Sequence[int], *, budget_min: float = DEFAULT_BUDGET_MIN,
         top: int = DEFAULT_TOP, rounds: int = 5, workers: int | None = None,
         compiler: Callable[[Candidate], Any] | None = None, timer: Any = None,
         inputs: Callable[[int], Any] | None = None, verifier: Callable[[Candidate, int, Any], dict] | None = None,
         gpu: str | None = None, tools: Mapping[str, str] | None = None, template_hash: str | None = None,
         records: Sequence[C.Record] | None = None, save: bool = True, progress: bool = True) -> dict[str, Any]:
    """Tune ``spec`` at ``tokens`` within ``budget_min`` minutes; returns the result record (what ``--json``
    writes) with the tuning database path under ``"record"``. The GPU steps default to the real ones."""
    t_start = time.monotonic()
    deadline = t_start + 60 * budget_min
    tokens, gpu, tools, template_hash = _session(tokens, gpu, tools, template_hash)
    if compiler is None:
        _import_dsl_once()
        compiler = lambda c: compile_candidate(spec, arch, c.plan)  # noqa: E731
    if timer is None:
        timer = CudaTimer()
    if inputs is None:
        inputs = lambda t: _inputs_gpu(spec, t)  # noqa: E731
    if verifier is None:
        verifier = lambda c, t, inp: verify_gpu(C.with_tokens(spec, t), c.moe, inp)  # noqa: E731
    # the model: bench records + this GPU's earlier tune records
    prior_records = list(records) if records is not None else C.bench_records() + _db_records(arch, gpu)
    fit0 = C.fit(prior_records)
    cands, n_space = select_candidates(spec, arch, tokens, fit0.theta, top)
    prog = _Progress(progress)
    try:
        # compile (parallel CPU workers; the build's ninja runs the kernel compiles as processes)
        prog.phase(f"compiling {len(cands)} candidate(s) of {n_space} in the space", len(cands))
        _compile_all(cands, compiler, t_start + 0.6 * (deadline - t_start), prog, workers)
        ready = [c for c in cands if c.moe is not None and c.error is None]
        if not ready:
            raise TuneError(f"no candidate compiled ({'; '.join(sorted({str(c.error) for c in cands}))[:300]})")
        # time, per T, in interleaved rounds
        left = deadline - time.monotonic()
        per_round = sum(max(c.predicted.values()) for c in ready) * 12 * len(tokens) / 1e3  # s, reps + warm-up
        n_rounds = max(3, min(rounds, int(left * 0.8 / max(per_round, 1e-3))))
        prog.phase(f"timing {len(ready)} candidate(s) at T = {', '.join(map(str, tokens))}, {n_rounds} rounds",
                   n_rounds * len(tokens))
        inp_by_t = {}
        for t in tokens:
            inp = inp_by_t[t] = inputs(t)
            fns = {}
            for c in ready:
                def call(c=c, inp=inp):
                    return c.moe(*inp)
                fns[c.label] = call
            got = time_rounds(fns, timer, n_rounds, on_round=lambda r, t=t: prog.step(f"T={t}: round {r + 1}"))
            for c in ready:
                c.times[t] = got[c.label]
        # winners, verified
        measured: dict[int, dict[str, Any]] = {}
        verify: dict[int, dict[str, Any]] = {}
        for t in tokens:
            ranked = sorted(ready, key=lambda c: c.median(t))
            for w in ranked:
                v = verifier(w, t, inp_by_t[t])
                verify[t] = {"candidate": w.label, **{k: v[k] for k in v}}
                if v.get("ok"):
                    break
                prog.step(f"T={t}: {w.label} failed verification ({v}); next candidate")
            else:
                raise TuneError(f"T={t}: no candidate passed verification against the reference")
            dflt = [c.median(t) for c in ready if t in c.defaults]
            measured[t] = {"overrides": w.cfg, "ms": w.median(t),
                           "runner": {_key(c.cfg): c.median(t) for c in ready},
                           "default_ms": dflt[0] if dflt else None}
    finally:
        prog.close()
    # the refitted model places the breakpoints
    run_records = [C.Record(C.with_tokens(spec, t).to_dict(), t, c.cfg, P.solve(C.with_tokens(spec, t), arch,
                                                                                 **c.cfg).to_dict(),
                            c.median(t), f"tune {gpu} {c.label}")
                   for c in ready for t in tokens]
    fit1 = C.fit(prior_records + run_records)
    pw = C.piecewise(spec, arch, fit1.theta, measured=measured)
    default_ms = {t: next(c.median(t) for c in ready if t in c.defaults) if any(t in c.defaults for c in ready)
                  else None for t in tokens}
    # the chosen piece's plan at each tuned T (a piece may serve T values other than the one it won at)
    tuned_ms = {t: measured[t]["runner"].get(_key(pw.piece(t).overrides), pw.piece(t).measured_ms) for t in tokens}
    tune_s = time.monotonic() - t_start
    result: dict[str, Any] = {
        "spec": spec.name, "spec_dict": spec.to_dict(), "arch": arch, "gpu": gpu, "toolchain": tools,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "tokens": tokens,
        "default_ms": default_ms, "tuned_ms": tuned_ms,
        "speedup": {t: (default_ms[t] / tuned_ms[t]) if default_ms[t] and tuned_ms[t] else None for t in tokens},
        "tune_s": round(tune_s, 1), "budget_min": budget_min, "rounds": n_rounds,
        "candidates": {"space": n_space, "selected": len(cands), "compiled": len(ready),
                       "timed": len(ready), "failed": {c.label: c.error for c in cands if c.error}},
        "chosen": pw.to_dict(), "verify": verify,
        "table": [{"candidate": c.label, "overrides": c.cfg, "default_at": list(c.defaults),
                   "compile_s": round(c.compile_s, 1),
                   "predicted_ms": {t: round(v, 4) for t, v in c.predicted.items()},
                   "median_ms": {t: c.median(t) for t in tokens}, "round_ms": c.times} for c in ready],
        "fit": {"inputs": len(fit1.inputs), "rms_rel_err": fit1.rms_rel_err,
                "prior_rms_rel_err": fit1.prior_rms_rel_err, "theta": fit1.theta},
    }
    if save:
        path = tunedb.save(arch=arch, gpu=gpu, tools=tools, template_hash=template_hash, spec=spec,
                           piecewise=pw.to_dict(), tune={k: result[k] for k in
                                                         ("tokens", "default_ms", "tuned_ms", "tune_s", "candidates",
                                                          "verify", "rounds")},
                           results=[r.to_dict() for r in run_records], fit=fit1.to_dict())
        result["record"] = str(path)
    return result


# ---- tune --train: the backward GEMMs' knobs, timed as whole training steps -------------------------------------
TRAIN_SETTLE_S = 0.5  # each candidate runs back to back this long before each of its timings (its own sustained regime)


class TrainStep:
    """One training step of a candidate: ``mokgen.moe_forward`` + ``.backward(dy)`` under autograd (the leaves'
    grads reset first), as tools/bench_backward.py and tools/graph_vs_eager.py time it."""

    def __init__(self, label: str, moe: Any, inp: Sequence[Any]):
        self.label, self.moe, self.inp = label, moe, inp

    def grads(self) -> tuple[Any, ...]:
        x, _idx, tw, w1, w2, b1, b2, _dy = self.inp
        return tuple(t.grad if t is not None else None for t in (x, tw, w1, w2, b1, b2))

    def __call__(self) -> None:
        import mokgen

        x, idx, tw, w1, w2, b1, b2, dy = self.inp
        for t in (x, tw, w1, w2, b1, b2):
            if t is not None:
                t.grad = None
        mokgen.moe_forward(x, idx, tw, w1, w2, b1, b2, moe=self.moe).backward(dy)


def train_inputs(spec: Spec, t: int, device: str = "cuda", seed: int = 0) -> tuple[Any, ...]:
    """(x, topk_idx, topk_weight, w1, w2, b1, b2, dy) at T = t: the float inputs are leaves requiring grad."""
    import torch

    from . import reference

    inp = reference.random_inputs(C.with_tokens(spec, t), tokens=t, device=device, seed=seed)
    leaf = lambda v: v.detach().clone().requires_grad_(True) if v is not None else None  # noqa: E731
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    dy = torch.randn(t, spec.hidden, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)
    return (leaf(inp.x), inp.topk_idx, leaf(inp.topk_weight), leaf(inp.w1), leaf(inp.w2), leaf(inp.b1),
            leaf(inp.b2), dy)


def verify_train_gpu(spec: Spec, moe: Any, inp: Sequence[Any]) -> dict[str, Any]:
    """A candidate's gradients against the float32 reference (relative error of each <= VERIFY_TOL) and against
    themselves on a rerun (the same bits)."""
    import torch

    from . import reference

    step = TrainStep("verify", moe, inp)
    step()
    first = [g.detach().clone() if g is not None else None for g in step.grads()]
    step()
    again = step.grads()
    x, idx, tw, w1, w2, b1, b2, dy = inp
    det = lambda v: v.detach() if v is not None else None  # noqa: E731
    ref = reference.backward(dy, det(x), idx, det(tw), det(w1), det(w2), spec, det(b1), det(b2),
                             dtype=torch.float32)
    errs, finite = {}, True
    for name, g, r in zip(reference.Grads._fields, first, ref):
        if r is None:
            continue
        if g is None:
            errs[name] = float("inf")
            continue
        errs[name] = reference.rel_err(g.float(), r.float())
        finite = finite and bool(torch.isfinite(g.float()).all())
    bitwise = all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                  for a, b in zip(first, again))
    worst = max(errs.values()) if errs else float("inf")
    return {"rel_err": worst, "rel_errs": errs, "bitwise_rerun": bitwise,
            "ok": worst <= VERIFY_TOL and bitwise and finite}


def time_rounds_settled(fns: Mapping[str, Callable[[], Any]], timer: Any, rounds: int, settle_s: float,
                        on_round: Callable[[int], None] | None = None) -> dict[str, list[float]]:
    """Interleaved rounds (every function once per round, the order rotated), each function run back to back for
    ``settle_s`` seconds right before its timing (``timer.sustain``, where the timer has one): each is timed in
    its own sustained regime, not in the one the previous candidate left (bench/NOTES.md v7)."""
    names = list(fns)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            if hasattr(timer, "sustain"):
                timer.sustain([fns[n]], settle_s)
            out[n].append(float(timer(fns[n])))
        if on_round:
            on_round(r)
    return out


def _train_label(cfg: Mapping[str, Any]) -> str:
    return _label(cfg) if cfg else "default"


TRAIN_MIN_GAIN = 0.01  # tune --train keeps the default unless a variant is at least this much faster (geo. mean)


def _geo_ratio(c: Candidate, base: Candidate, tokens: Sequence[int], phase: str) -> float:
    """The geometric mean over ``tokens`` of c's median over base's median, both from the same timing phase."""
    prod = 1.0
    for t in tokens:
        prod *= statistics.median(c.times[(phase, t)]) / statistics.median(base.times[(phase, t)])
    return prod ** (1.0 / len(tokens))


def tune_train(spec: Spec, arch: str, tokens: Sequence[int], *, budget_min: float = DEFAULT_BUDGET_MIN,
               rounds: int = 5, workers: int | None = None, compiler: Callable[[Candidate], Any] | None = None,
               timer: Any = None, inputs: Callable[[int], Any] | None = None,
               verifier: Callable[[Candidate, int, Any], dict] | None = None, gpu: str | None = None,
               tools: Mapping[str, str] | None = None, template_hash: str | None = None,
               settle_s: float = TRAIN_SETTLE_S, save: bool = True, progress: bool = True) -> dict[str, Any]:
    """``mokgen tune SPEC --train``: choose the backward GEMMs' knobs by timing whole training steps.

    The forward stays at the plan ``mokgen.compile`` uses: the tuning record's piece for each T where this
    spec has a record (``mokgen tune`` run before), else the solver's default. Candidates: that plan, and each
    backward variant of :func:`mokgen.configs.enumerate_backward_configs` (one knob of one backward GEMM changed;
    valid with the forward at every T); compiled in parallel (the per-kernel object cache compiles the kernels
    a variant shares with the others once); each timed as ``moe_forward`` + ``backward`` at every T in
    interleaved rounds, settled for ``settle_s`` s before each timing; medians. Each backward GEMM's best variant
    (geometric mean over T of the time relative to the default) is then composed into one candidate, which is
    compiled and timed against the default and the best single variant in a second phase. The winner (lowest
    geometric-mean ratio; verified at every T against the float32 reference gradients and a bitwise rerun) is
    stored as the record's ``backward`` section (the forward's pieces and results are kept); ``mokgen.compile``
    applies it with the forward's pieces. The GPU steps default to the real ones (tests pass fakes)."""
    t_start = time.monotonic()
    deadline = t_start + 60 * budget_min
    tokens, gpu, tools, template_hash = _session(tokens, gpu, tools, template_hash)
    if compiler is None:
        _import_dsl_once()

        def compiler(c: Candidate) -> dict[int, Any]:  # one CompiledMoE per distinct plan (forward piece)
            built: dict[str, Any] = {}
            for p in c.plan.values():
                if p.canonical_json() not in built:
                    built[p.canonical_json()] = compile_candidate(spec, arch, p)
            return {t: built[p.canonical_json()] for t, p in c.plan.items()}
    if timer is None:
        timer = CudaTimer()
    if inputs is None:
        inputs = lambda t: train_inputs(spec, t)  # noqa: E731
    if verifier is None:
        verifier = lambda c, t, inp: verify_train_gpu(C.with_tokens(spec, t), c.moe[t], inp)  # noqa: E731
    # the forward: the tuned record's piece at each T, else the solver's default
    rec, _path = tunedb.find(arch, gpu, tools, template_hash, spec)
    pw = C.PiecewisePlan.from_dict(rec["piecewise"]) if rec is not None else None
    fwd = {t: dict(pw.piece(t).overrides) if pw is not None else {} for t in tokens}
    # the variants valid with the forward at every T
    variants: list[dict[str, Any]] = []
    for t in tokens:
        for cfg in CF.enumerate_backward_configs(spec, arch, fixed=fwd[t]):
            if cfg not in variants and all(not CF.check_config(spec, arch, {**fwd[u], **cfg}) for u in tokens):
                variants.append(cfg)

    def make(cfg: Mapping[str, Any]) -> Candidate:
        c = Candidate(dict(cfg), _train_label(cfg))
        c.plan = {t: P.solve(spec, arch, **fwd[t], **cfg) for t in tokens}
        return c

    cands = [make({})] + [make(cfg) for cfg in variants]
    base = cands[0]
    prog = _Progress(progress)
    inp_by_t: dict[int, Any] = {}
    try:
        def time_phase(phase: str, group: list[Candidate], share: float) -> int:
            left = deadline - time.monotonic()
            per_round = len(group) * len(tokens) * (settle_s + 0.2)  # s: settle + the timed reps, roughly
            n = max(3, min(rounds, int(left * share / max(per_round, 1e-3))))
            prog.phase(f"{phase}: timing {len(group)} training step(s) at T = {', '.join(map(str, tokens))}, "
                       f"{n} rounds", n * len(tokens))
            for t in tokens:
                if t not in inp_by_t:
                    inp_by_t[t] = inputs(t)
                fns = {c.label: TrainStep(c.label, c.moe[t], inp_by_t[t]) for c in group}
                got = time_rounds_settled(fns, timer, n, settle_s,
                                          on_round=lambda r, t=t: prog.step(f"T={t}: round {r + 1}"))
                for c in group:
                    c.times[(phase, t)] = got[c.label]
            return n

        prog.phase(f"compiling {len(cands)} training candidate(s): the default and {len(variants)} backward "
                   f"variant(s)", len(cands))
        _compile_all(cands, compiler, t_start + 0.5 * (deadline - t_start), prog, workers)
        if base.error is not None:
            raise TuneError(f"the default plan did not compile: {base.error}")
        ready = [c for c in cands if c.moe is not None and c.error is None]
        n1 = time_phase("single", ready, 0.6)
        ratio1 = {c.label: _geo_ratio(c, base, tokens, "single") for c in ready}
        # each backward GEMM's best variant, composed
        composed: dict[str, Any] = {}
        for kernel in P.BACKWARD_GEMMS + ("bwd",):   # "bwd": the whole backward's knobs (bwd_streams)
            own = [c for c in ready if c.cfg and all(S.backward_kernel(k) == kernel for k in c.cfg)]
            best = min(own, key=lambda c: ratio1[c.label], default=None)
            if best is not None and ratio1[best.label] < 1.0:
                composed.update(best.cfg)
        best1 = min(ready, key=lambda c: ratio1[c.label])
        final, phase, n2 = ready, "single", 0
        if len(composed) >= 2 and all(not CF.check_config(spec, arch, {**fwd[t], **composed}) for t in tokens):
            comp = make(composed)
            prog.phase("compiling the composition of the per-kernel winners", 1)
            _compile_all([comp], compiler, max(time.monotonic() + 60.0, t_start + 0.75 * (deadline - t_start)), prog,
                         workers)
            if comp.moe is not None and comp.error is None:
                final = [base] + ([best1] if best1 is not base else []) + [comp]
                cands.append(comp)
                n2 = time_phase("composed", final, 0.8)
                phase = "composed"
        ratio = {c.label: _geo_ratio(c, base, tokens, phase) for c in final}
        order = sorted(final, key=lambda c: ratio[c.label])
        train_note = None
        if order[0] is not base and ratio[order[0].label] > 1.0 - TRAIN_MIN_GAIN:
            # within the spread of sustained rounds on a power-capped GPU: not a measured gain
            train_note = (f"best variant {order[0].label} only {(1.0 - ratio[order[0].label]) * 100:.1f}% ahead of the "
                          f"default (< {TRAIN_MIN_GAIN * 100:.0f}%): the default kept")
            prog.step(train_note)
            order = [base] + [c for c in order if c is not base]
        verify: dict[int, dict[str, Any]] = {}
        for w in order:
            verify = {t: {"candidate": w.label, **verifier(w, t, inp_by_t[t])} for t in tokens}
            if all(v.get("ok") for v in verify.values()):
                break
            prog.step(f"{w.label} failed verification ({verify}); next candidate")
        else:
            raise TuneError("no training candidate passed verification against the reference gradients")
    finally:
        prog.close()
    med = lambda c, ph, t: statistics.median(c.times[(ph, t)]) if (ph, t) in c.times else None  # noqa: E731
    timed = [c for c in cands if c.times]
    result: dict[str, Any] = {
        "spec": spec.name, "spec_dict": spec.to_dict(), "arch": arch, "gpu": gpu, "toolchain": tools, "train": True,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "tokens": tokens,
        "forward": {"source": f"tuning record {rec['key'][:16]}" if rec is not None else "solver default",
                    "overrides": {t: fwd[t] for t in tokens}},
        "chosen_backward": w.cfg, "phase": phase, **({"note": train_note} if train_note else {}),
        "default_ms": {t: med(base, phase, t) for t in tokens}, "tuned_ms": {t: med(w, phase, t) for t in tokens},
        "speedup": {t: med(base, phase, t) / med(w, phase, t) for t in tokens},
        "tune_s": round(time.monotonic() - t_start, 1), "budget_min": budget_min, "settle_s": settle_s,
        "rounds": {"single": n1, **({"composed": n2} if n2 else {})},
        "candidates": {"space": len(variants) + 1, "compiled": len(ready) + (phase == "composed"),
                       "timed": len(timed), "failed": {c.label: c.error for c in cands if c.error}},
        "verify": verify,
        "table": [{"candidate": c.label, "overrides": c.cfg, "compile_s": round(c.compile_s, 1),
                   "median_ms": {f"{ph}@{t}": statistics.median(v) for (ph, t), v in c.times.items()},
                   "round_ms": {f"{ph}@{t}": v for (ph, t), v in c.times.items()}} for c in timed],
    }
    if save:
        keep = {k: v for k, v in (rec or {}).items() if k not in (
            "format", "key", "arch", "gpu", "toolchain", "template_hash", "spec", "spec_name", "created",
            "piecewise", "sha256", "backward")}
        piecewise = rec["piecewise"] if rec is not None else C.PiecewisePlan(
            spec.name, arch, (C.Piece(1, 0, {}, P.solve(C.with_tokens(spec, tokens[-1]), arch).predicted_ms, tokens[-1], None),),
            "default",
            ("forward not tuned: the solver's default at every T (the record holds a tune --train result)",)).to_dict()
        backward = {"overrides": w.cfg, "tokens": tokens, "forward": result["forward"],
                    **{k: result[k] for k in ("default_ms", "tuned_ms", "tune_s", "settle_s", "rounds", "candidates",
                                              "verify", "table", "phase", "date")}}
        path = tunedb.save(arch=arch, gpu=gpu, tools=tools, template_hash=template_hash, spec=spec,
                           piecewise=piecewise, **keep, backward=backward)
        result["record"] = str(path)
    return result


def _compile_all(group: Sequence[Candidate], compiler: Callable[[Candidate], Any], until: float, prog: Any,
                 workers: int | None) -> None:
    """Compile ``group`` on parallel CPU workers (the build's ninja runs the kernel compiles as processes),
    setting each candidate's moe / compile_s / error; what is not done by ``until`` (monotonic) fails with
    "not compiled within the budget"."""
    pool = cf.ThreadPoolExecutor(max_workers=workers or max(1, (os.cpu_count() or 2) // 2))
    futs = {pool.submit(_timed, compiler, c): c for c in group}
    try:
        for f in cf.as_completed(futs, timeout=max(1.0, until - time.monotonic())):
            c = futs[f]
            c.moe, c.compile_s, c.error = f.result()
            prog.step(f"{c.label}: " + (f"compiled in {c.compile_s:.1f} s" if c.error is None else
                                         f"FAILED: {c.error}"))
    except cf.TimeoutError:
        for f, c in futs.items():
            if not f.done():
                f.cancel()
                c.error = "not compiled within the budget"
    pool.shutdown(wait=False, cancel_futures=True)


def _import_dsl_once() -> None:
    """Import the CuTe DSL in this thread before the compile workers start: several threads importing
    `cutlass.cute.runtime` for the first time at once deadlock on Python's module locks (seen on the H200:
    3 of 22 candidates failed with _DeadlockError). A missing DSL is reported per candidate by the build."""
    try:
        from .build import runtime_libraries

        runtime_libraries()
    except Exception:
        pass


def _timed(compiler: Callable[[Candidate], Any], c: Candidate) -> tuple[Any, float, str | None]:
    t0 = time.monotonic()
    try:
        return compiler(c), time.monotonic() - t0, None
    except Exception as e:  # a candidate that does not build is reported, the others go on
        return None, time.monotonic() - t0, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


def _db_records(arch: str, gpu: str) -> list[C.Record]:
    out = []
    for _path, doc, _why in tunedb.list_records(arch):
        if doc is None or doc.get("gpu") != gpu:
            continue
        for r in doc.get("results") or []:
            try:
                out.append(C.Record(**r))
            except TypeError:
                continue
    return out


# ---- command line ---------------------------------------------------------------------------------------------
def _table(result: Mapping[str, Any]) -> str:
    tokens = result["tokens"]
    head = ["candidate"] + [f"T={t} ms" for t in tokens] + [f"T={t} pred" for t in tokens]
    rows = []
    for r in sorted(result["table"], key=lambda r: r["median_ms"][tokens[-1]] or 1e9):
        rows.append([r["candidate"][:90]] + [f"{r['median_ms'][t]:.4f}" if r["median_ms"][t] else "-" for t in tokens]
                    + [f"{r['predicted_ms'][t]:.4f}" for t in tokens])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    fmt = lambda row: "  ".join(str(x).ljust(w) for x, w in zip(row, widths))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, rows)])


def _train_table(result: Mapping[str, Any]) -> str:
    cols = sorted({k for r in result["table"] for k in r["median_ms"]}, key=lambda k: (k.split("@")[0] != "single",
                                                                                         k))
    head = ["candidate"] + [f"{k} ms" for k in cols]
    rows = [[r["candidate"][:60]] + [f"{r['median_ms'][k]:.4f}" if k in r["median_ms"] else "-" for k in cols]
            for r in sorted(result["table"], key=lambda r: r["median_ms"].get(cols[0], 1e9))]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    fmt = lambda row: "  ".join(str(x).ljust(w) for x, w in zip(row, widths))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, rows)])


def _show(arch: str | None, spec: Spec | None) -> int:
    recs = tunedb.list_records(arch)
    shown = 0
    for path, doc, why in recs:
        if doc is None:
            print(f"DAMAGED  {path}: {why}")
            continue
        if spec is not None and doc["spec"] != tunedb.spec_shape(spec):
            continue
        shown += 1
        pw = C.PiecewisePlan.from_dict(doc["piecewise"])
        t = doc.get("tune") or {}
        print(f"{doc['spec_name']}  {doc['arch']}  {doc['gpu']}  tuned {doc['created']}  {path}")
        for line in pw.describe():
            print("  " + line)
        if t:
            print(f"  default ms {t.get('default_ms')}  tuned ms {t.get('tuned_ms')}  ({t.get('tune_s')} s)")
        if doc.get("backward"):
            b = doc["backward"]
            print(f"  backward (tune --train): {_label(b['overrides']) or 'the solver default'}; training step "
                  f"default ms {b.get('default_ms')}  tuned ms {b.get('tuned_ms')}")
    if not shown:
        print(f"mokgen: no tuning records in {tunedb.tuning_dir()}", file=sys.stderr)
    return 0


def _tokens(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers T1,T2,..., got {text!r}")
    return out


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = 0.0
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of minutes, got {text!r}")
    return v


def make_parser() -> argparse.ArgumentParser:
    from .cliargs import Parser, positive_int

    ap = Parser(prog="mokgen tune", description="Pick the fastest plan for a spec on this GPU.")
    ap.add_argument("spec", metavar="SPEC", nargs="?", help="preset name or YAML path")
    ap.add_argument("--arch")
    ap.add_argument("--tokens", type=_tokens, default=None, metavar="T1,T2,...",
                    help="token counts to tune at (default: the spec's tokens)")
    ap.add_argument("--budget", type=_positive_float, default=DEFAULT_BUDGET_MIN, metavar="MINUTES",
                    help=f"wall-clock budget (default {DEFAULT_BUDGET_MIN:g})")
    ap.add_argument("--top", type=positive_int(), default=DEFAULT_TOP, help="candidates per T kept by the model")
    ap.add_argument("--rounds", type=positive_int(), default=5, help="interleaved timing rounds (at least 3)")
    ap.add_argument("--json", metavar="FILE", help="write the result record (appended to a JSON list)")
    ap.add_argument("--train", action="store_true",
                    help="tune the backward GEMMs' knobs by timing whole training steps (forward + backward); the "
                         "forward stays at its tuned (or default) plan")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--show", action="store_true", help="list the tuning records (of SPEC, or all)")
    g.add_argument("--clear", action="store_true", help="remove the tuning records (of SPEC, or all)")
    return ap


def append_json(path: str | os.PathLike, record: Mapping[str, Any]) -> None:
    p = Path(path)
    data = []
    if p.exists():
        try:
            data = json.loads(p.read_text())
        except ValueError:
            raise TuneError(f"--json: {p} exists and is not JSON; choose another file") from None
        if not isinstance(data, list):
            raise TuneError(f"--json: {p} holds no JSON list; choose another file")
    data.append(record)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f"{p.name}.tmp.{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, p)


def main(argv: Sequence[str] | None = None) -> int:
    from .arch import resolve_arch

    args = make_parser().parse_args(list(argv) if argv is not None else None)
    spec = load_spec(args.spec) if args.spec else None
    if args.show:
        return _show(args.arch, spec)
    if args.clear:
        removed = tunedb.clear(args.arch, spec)
        print(f"removed {len(removed)} tuning record(s) from {tunedb.tuning_dir()}")
        return 0
    if spec is None:
        raise TuneError("tune: SPEC is required (a preset name or a YAML path), or --show / --clear")
    arch = resolve_arch(args.arch)
    if args.train:
        result = tune_train(spec, arch, args.tokens or [spec.tokens], budget_min=args.budget, rounds=args.rounds)
        print(f"{spec.name} on {result['gpu']} ({arch}), training step: {result['candidates']['timed']} candidate(s) "
              f"timed, forward: {result['forward']['source']}, {result['tune_s']} s")
        print(_train_table(result))
        for t in result["tokens"]:
            d, u = result["default_ms"][t], result["tuned_ms"][t]
            print(f"T={t}: default step {d:.4f} ms, tuned {u:.4f} ms ({d / u:.3f}x)")
        print("backward: " + (_label(result["chosen_backward"]) or "the solver's default")
              + (f" ({result['note']})" if result.get("note") else ""))
        print(f"record: {result['record']}")
        if args.json:
            append_json(args.json, result)
        return 0
    result = tune(spec, arch, args.tokens or [spec.tokens], budget_min=args.budget, top=args.top,
                  rounds=args.rounds)
    print(f"{spec.name} on {result['gpu']} ({arch}): {result['candidates']['timed']} candidate(s) timed of "
          f"{result['candidates']['space']} in the space, {result['tune_s']} s")
    print(_table(result))
    for line in C.PiecewisePlan.from_dict(result["chosen"]).describe():
        print(line)
    for t in result["tokens"]:
        d, u = result["default_ms"][t], result["tuned_ms"][t]
        print(f"T={t}: default {d:.4f} ms, tuned {u:.4f} ms ({d / u:.3f}x)" if d and u else f"T={t}: tuned {u}")
    print(f"record: {result['record']}")
    if args.json:
        append_json(args.json, result)
    return 0
