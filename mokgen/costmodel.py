"""A cost model whose efficiency terms are fitted to measurements, and the plan as a piecewise function of T.

**The model.** The forward time of a plan at T tokens is a sum of terms, each a coefficient times a feature:

    t(T) = sum_j theta_j * f_j(plan, T)

Features are what the plan's arithmetic knows (milliseconds of ideal work): GEMM 1 / GEMM 2 compute at the
arch's peak over the padded rows, split by the knob values that change a mainloop's efficiency (consumer mode,
A-load path; tile N enters through the prior mainloop factor and the N tail); the gather pass's and routing +
combine's HBM bytes; the weights streamed once (bytes / HBM); a per-(group x N tile) start-up cost per A-load
path (what makes the fused gather lose on small routed groups); deltas for 2-CTA clusters and the fused
schedule. Every f_j is affine in T (the padding of each routed group is its expected (BM-1)/2 rows; wave
quantization is averaged out), so t(T) of a candidate is a line in T.

**The fit.** The coefficients are fitted by least squares on relative error, ridge-regularized toward priors
(``PRIORS``: the constants ``mokgen.plan`` uses), from measurement records: ``mokgen tune`` records (the tuning
database) and the forward benchmark's records (``bench/results/forward-h200.json``, whose plans are
reconstructed with the solver and the defaults of the commit that ran them, ``ERAS``). A term no record
varies stays at its prior; :class:`Fit` records every input, the coefficients, the priors and the residuals.

**The piecewise plan.** Candidates' lines cross; sympy solves the crossovers (``solve(Eq(t_a, t_b), T)``) of
the fitted model into breakpoints, and :func:`piecewise` returns a :class:`PiecewisePlan`: pieces
``[T_lo, T_hi) -> overrides`` (a config of :mod:`mokgen.space`). Where a second piece is not worth at least
``min_gain`` (by measurement where tune timed both, by the model otherwise), the pieces merge: one piece.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import sympy as sp

from . import plan as P
from . import configs as C
from .spec import Spec, load_spec

__all__ = ["Record", "Fit", "PRIORS", "features", "predict", "fit", "bench_records", "Piece", "PiecewisePlan",
           "piecewise", "crossover", "T_RANGE", "MIN_GAIN", "with_tokens"]

T = sp.Symbol("T", positive=True)
T_RANGE = (512, 16384)
# the run-to-run spread of the sustained regime on the H200 (bench/NOTES.md v3-v5: ~3%): a second piece must
# beat the first by more than that to be kept
MIN_GAIN = 0.03
_REPO = Path(__file__).resolve().parent.parent
BENCH_FILES = (_REPO / "bench" / "results" / "forward-h200.json",)

# prior coefficients: 1 / the plan's mainloop factors (PINGPONG_EFF), the plan's byte model for the glue and the
# gather pass; zero where the plan has no term (what the fit may find)
PRIORS: dict[str, float] = {
    "g1.cooperative.gather": 1.0, "g1.cooperative.tma": 1.0, "g1.cooperative.tma_rows": 1.0,
    "g1.pingpong.gather": 1 / P.PINGPONG_EFF[1], "g1.pingpong.tma": 1 / P.PINGPONG_EFF[1],
    "g1.pingpong.tma_rows": 1 / P.PINGPONG_EFF[1],
    "g2.cooperative": 1.0, "g2.pingpong": 1 / P.PINGPONG_EFF[2],
    "cluster2": 0.0, "fused": 0.0,
    "gather_pass": 1.0, "glue": 1.0, "weights": 0.0,
    "tiles.gather": 0.0, "tiles.tma": 0.0, "tiles.tma_rows": 0.0,
    "fp8": 1.0,   # an FP8 plan's whole forward by the plan's fitted FP8 model (fit_fp8); no BF16 record varies it
}
TERMS = tuple(PRIORS)
RIDGE = 0.05  # weight of (theta - prior) / max(prior, 1) against relative residuals


def with_tokens(spec: Spec, tokens: int) -> Spec:
    return spec if spec.tokens == tokens else dataclasses.replace(spec, tokens=int(tokens))


def _lin(slope: float, icept: float) -> tuple[float, float]:
    return float(slope), float(icept)


def features(spec: Spec, plan: Any) -> dict[str, tuple[float, float]]:
    """``{term: (slope, intercept)}``: f_term(T) = slope * T + intercept (milliseconds), for ``plan`` (a Plan
    or its dict view) of ``spec``'s shape."""
    a = P.get_arch(plan.arch)
    peak = a.peak_bf16_tflops * 1e9  # flop per ms
    hbm = a.hbm_tbps * 1e9  # bytes per ms
    g1, g2 = plan.gemm1, plan.gemm2
    if g1.elem_bytes == 1:   # FP8: the plan's FP8 model (mokgen.plan FP8_MAINLOOP_EFF ...), as a line through
        f = {t: (0.0, 0.0) for t in TERMS}   # its times at two token counts
        t_lo, t_hi = T_RANGE[0], T_RANGE[1]
        ms = []
        for t in (t_lo, t_hi):
            s_t = with_tokens(spec, t)
            c1, c2, glue = P._costs(s_t, a, g1, g2)
            ms.append(c1.ms + c2.ms + glue)
        slope = (ms[1] - ms[0]) / (t_hi - t_lo)
        f["fp8"] = (slope, ms[0] - slope * t_lo)
        return f
    bm = plan.bm
    K, Sx, E, G, H, I = spec.topk, spec.shared_experts, spec.local_experts, spec.groups, spec.hidden, spec.ffn
    # padded rows = (K + S) T + E (bm - 1) / 2 (expected padding of the routed groups; shared groups have T rows)
    pad_s, pad_i = K + Sx, E * (bm - 1) / 2
    f = {t: (0.0, 0.0) for t in TERMS}
    comp = {}
    for which, g in ((1, g1), (2, g2)):
        n, k = P._gemm_shape(spec, which)
        n_eff = n / (g.n_tiles * g.bn)
        per_row = 2 * n * k / (peak * n_eff * P.MAINLOOP_EFF[g.bn])
        comp[which] = (per_row * pad_s, per_row * pad_i)
    f[f"g1.{g1.consumer}.{g1.a_load}"] = comp[1]
    f[f"g2.{g2.consumer}"] = comp[2]
    if plan.schedule == "fused":
        f["fused"] = (comp[1][0] + comp[2][0], comp[1][1] + comp[2][1])
    if 2 in (g1.cluster, g2.cluster):
        c = [comp[w] for w, g in ((1, g1), (2, g2)) if g.cluster == 2]
        f["cluster2"] = (sum(x[0] for x in c), sum(x[1] for x in c))
    if g1.a_load == "tma":
        f["gather_pass"] = _lin(2 * 2 * (K + Sx) * H / hbm, 0)
    # routing (ids/weights in, row maps out), combine (ys rows in, y out): plan._glue_bytes without the gather
    slots = K + Sx
    f["glue"] = _lin((8 * K + 8 * pad_s + 4 * slots + 4 * slots + 2 * slots * H + 2 * H) / hbm, 8 * pad_i / hbm)
    f["weights"] = _lin(0, 2 * G * 3 * H * I / hbm)
    f[f"tiles.{g1.a_load}"] = _lin(0, G * g1.n_tiles * 1e-3)  # 1 us per (group, N tile) at theta = 1
    return f


def predict(theta: Mapping[str, float], feats: Mapping[str, tuple[float, float]], tokens: float) -> float:
    return sum(theta[t] * (s * tokens + i) for t, (s, i) in feats.items())


def line(theta: Mapping[str, float], feats: Mapping[str, tuple[float, float]]) -> tuple[float, float]:
    """(slope, intercept) of the predicted time in T."""
    return (sum(theta[t] * s for t, (s, _) in feats.items()), sum(theta[t] * i for t, (_, i) in feats.items()))


# ---- measurement records ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Record:
    """One measured forward time: the spec's shape at ``tokens``, the plan (override dict + the plan dict that
    ran), milliseconds, and where it came from."""

    spec: dict[str, Any]
    tokens: int
    overrides: dict[str, Any]
    plan: dict[str, Any]
    ms: float
    source: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# The default plan of the commits whose bench records are used (the kernels of v3's last run, 765034f, onward:
# bench/NOTES.md v4 says the later kernels differ by one constant): what to override on today's solver to get
# the plan that ran. Flat panels = the L2-fit raster before the tall panels of 8cd2e0f; the A-load rule by
# group size came in 855560f (before it GEMM 1 always gathered).
ERAS: dict[str, dict[str, bool]] = {
    **{c: {"flat_raster": True, "gather_always": True} for c in ("765034f", "72230c9", "4c27f32")},
    **{c: {"flat_raster": True} for c in ("855560f", "13ae3e6", "dcd38f2", "50a582d", "abbfe93", "9a85b02")},
    # before SMALL_GROUPS_GEMM1_RASTER (v28) GEMM 1 of small-group specs rastered by the L2 fit
    "8cd2e0f": {"small_groups_flat": True},
}


def _impl_overrides(impl: str) -> dict[str, Any] | None:
    if impl == "mokgen":
        return {}
    if impl.startswith("mokgen[") and impl.endswith("]"):
        try:
            return P.parse_overrides(impl[len("mokgen["):-1])
        except P.PlanError:
            return None
    return None


def _era_plan(spec: Spec, arch: str, ov: dict[str, Any], era: Mapping[str, bool]) -> Any:
    ov = dict(ov)
    if era.get("gather_always") and "gemm1_a_load" not in ov and ov.get("schedule") != "fused":
        ov["gemm1_a_load"] = "gather"
    p = P.solve(spec, arch, **ov)
    if any("raster" in k for k in ov) or p.schedule != "chain":
        return p
    a = P.get_arch(arch)
    # the GEMMs whose panels that era sized by the L2 fit alone: both (flat_raster), or GEMM 1 where the
    # small-group panel rule now applies (small_groups_flat)
    flat = ((1, 2) if era.get("flat_raster") else
            (1,) if era.get("small_groups_flat") and P._small_groups_panel(spec, a, 1) else ())
    for which in flat:
        g = p.gemm1 if which == 1 else p.gemm2
        ov[f"gemm{which}_raster_group"] = P._raster_group(a, P._gemm_shape(spec, which)[1], g.bn)
    return P.solve(spec, arch, **ov) if flat else p


def bench_records(paths: Iterable[Path] = BENCH_FILES, arch: str = "sm_90a") -> list[Record]:
    """The forward benchmark's mokgen records whose plan can be reconstructed (a preset shape, a commit in
    :data:`ERAS`, a successful median)."""
    out: list[Record] = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            continue
        for i, r in enumerate(data if isinstance(data, list) else []):
            era = ERAS.get(str((r.get("versions") or {}).get("mokgen")))
            ov = _impl_overrides(str(r.get("impl", "")))
            ms = r.get("median_ms")
            if era is None or ov is None or not isinstance(ms, (int, float)) or ms <= 0:
                continue
            try:
                spec = load_spec(r["shape"])
            except Exception:
                continue
            d = r.get("dims") or {}
            if (d.get("H"), d.get("I"), d.get("K"), d.get("local_experts")) != (
                    spec.hidden, spec.ffn, spec.topk, spec.local_experts):
                continue
            spec = with_tokens(spec, int(d["T"]))
            try:
                p = _era_plan(spec, arch, ov, era)
            except P.PlanError:
                continue
            out.append(Record(spec.to_dict(), spec.tokens, ov, p.to_dict(), float(ms),
                              f"{Path(path).name}#{i} {r['versions'].get('mokgen')} {r['impl']}"))
    return out


# ---- the fit -------------------------------------------------------------------------------------------------
@dataclass
class Fit:
    """The fitted coefficients, and what they were fitted from."""

    theta: dict[str, float]
    priors: dict[str, float]
    inputs: list[dict[str, Any]]  # each record: source, spec name, T, overrides, ms measured, ms fitted
    fitted_terms: list[str]  # the terms some record varies (the others stay at their priors)
    rms_rel_err: float  # of the fit on its inputs (0 with no inputs)
    prior_rms_rel_err: float  # of the priors on the same inputs

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Fit":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})

    def describe(self) -> list[str]:
        lines = [f"cost model: {len(self.inputs)} measurement(s), relative rms error {100 * self.rms_rel_err:.1f}% "
                 f"(priors alone: {100 * self.prior_rms_rel_err:.1f}%)"]
        for t in TERMS:
            how = "fitted" if t in self.fitted_terms else "prior (no measurement varies it)"
            lines.append(f"  {t:<24} {self.theta[t]:8.4f}  prior {self.priors[t]:7.4f}  {how}")
        return lines


def _plan_view(d: Mapping[str, Any]) -> Any:
    return P.Plan.from_dict(d)


def _ridge_nonneg(Ar: Any, target: Any, prior: Any, ridge: float) -> Any:
    """theta >= 0 minimising |Ar theta - target|^2 + ridge |(theta - prior) / max(|prior|, 1)|^2 over the columns
    of ``Ar`` that are not all zero (the others keep their prior): least squares, then every coefficient that came
    out negative is fixed at 0 and the rest solved again. ``Ar`` holds each record's terms over its time, so
    ``target`` is 1 (or 1 minus the record's fixed share) and the residuals are relative errors."""
    import numpy as np

    theta = prior.copy()
    free = [j for j in range(Ar.shape[1]) if np.any(Ar[:, j] != 0)]
    scale = np.maximum(np.abs(prior), 1.0)
    for _ in range(Ar.shape[1]):
        fixed = [j for j in range(Ar.shape[1]) if j not in free]
        rhs = target - Ar[:, fixed] @ theta[fixed]
        M = np.vstack([Ar[:, free], math.sqrt(ridge) * np.diag(1 / scale[free])])
        b = np.concatenate([rhs, math.sqrt(ridge) * prior[free] / scale[free]])
        sol, *_ = np.linalg.lstsq(M, b, rcond=None)
        theta[free] = sol
        neg = [j for j, v in zip(free, sol) if v < 0]
        if not neg:
            break
        for j in neg:
            theta[j] = 0.0
            free.remove(j)
    return theta


def fit(records: Sequence[Record], priors: Mapping[str, float] = PRIORS, ridge: float = RIDGE) -> Fit:
    """Least squares on relative residuals, ridge toward ``priors``; the coefficients are kept >= 0 (a term
    that fits negative is clamped to 0 and the rest refitted)."""
    import numpy as np

    rows, ys, info = [], [], []
    for r in records:
        spec = Spec.from_dict(r.spec)
        feats = features(spec, _plan_view(r.plan))
        rows.append([feats[t][0] * r.tokens + feats[t][1] for t in TERMS])
        ys.append(r.ms)
        info.append(r)
    prior = np.array([priors[t] for t in TERMS])
    if not rows:
        theta = dict(priors)
        return Fit(theta, dict(priors), [], [], 0.0, 0.0)
    A = np.array(rows)
    y = np.array(ys)
    Ar = A / y[:, None]
    theta = _ridge_nonneg(Ar, np.ones(len(y)), prior, ridge)
    pred = A @ theta
    rel = pred / y - 1
    prel = (A @ prior) / y - 1
    inputs = [{"source": r.source, "spec": r.spec.get("name"), "T": r.tokens, "overrides": r.overrides,
               "ms": r.ms, "fitted_ms": round(float(p), 4)} for r, p in zip(info, pred)]
    return Fit({t: round(float(v), 6) for t, v in zip(TERMS, theta)}, dict(priors), inputs,
               [t for j, t in enumerate(TERMS) if np.any(A[:, j] != 0)], float(np.sqrt(np.mean(rel ** 2))), float(np.sqrt(np.mean(prel ** 2))))


# ---- crossovers and the piecewise plan ----------------------------------------------------------------------
def crossover(a: tuple[float, float], b: tuple[float, float], lo: float, hi: float) -> float | None:
    """The T in (lo, hi) where the lines t_a(T) = a0 T + a1 and t_b(T) cross (sympy), or None."""
    ta = sp.nsimplify(a[0], rational=True) * T + sp.nsimplify(a[1], rational=True)
    tb = sp.nsimplify(b[0], rational=True) * T + sp.nsimplify(b[1], rational=True)
    sols = sp.solveset(sp.Eq(ta, tb), T, domain=sp.Interval.open(lo, hi))
    if isinstance(sols, sp.FiniteSet) and len(sols) == 1:
        return float(next(iter(sols)))
    return None


@dataclass(frozen=True)
class Piece:
    lo: int  # tokens in [lo, hi)
    hi: int  # 0: no upper bound
    overrides: dict[str, Any]
    predicted_ms: float  # at `at`
    at: int  # the T the piece was timed or predicted at
    measured_ms: float | None = None

    def contains(self, tokens: int) -> bool:
        return tokens >= self.lo and (self.hi == 0 or tokens < self.hi)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class PiecewisePlan:
    """Pieces ``[lo, hi) -> plan overrides`` covering every T >= 1 (the first starts at 1, the last has hi 0),
    the breakpoints between them and how they were derived."""

    spec_name: str
    arch: str
    pieces: tuple[Piece, ...]
    source: str  # "tune" (winners measured) or "model" (the fitted model alone)
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        ps = self.pieces
        if not ps or ps[0].lo != 1 or ps[-1].hi != 0 or any(a.hi != b.lo or a.hi <= a.lo
                                                             for a, b in zip(ps, ps[1:])):
            raise ValueError(f"piecewise plan of {self.spec_name}: pieces must tile [1, inf): "
                             f"{[(p.lo, p.hi) for p in ps]}")

    @property
    def breakpoints(self) -> tuple[int, ...]:
        return tuple(p.lo for p in self.pieces[1:])

    def piece(self, tokens: int) -> Piece:
        for p in self.pieces:
            if p.contains(int(tokens)):
                return p
        raise ValueError(f"T={tokens} is not covered")  # unreachable: pieces tile [1, inf)

    def to_dict(self) -> dict[str, Any]:
        return {"spec_name": self.spec_name, "arch": self.arch, "source": self.source, "notes": list(self.notes),
                "pieces": [p.to_dict() for p in self.pieces]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PiecewisePlan":
        return cls(d["spec_name"], d["arch"], tuple(Piece(**p) for p in d["pieces"]), d["source"],
                   tuple(d.get("notes", ())))

    def describe(self) -> list[str]:
        out = [f"piecewise plan ({self.source}): {len(self.pieces)} piece(s)"
               + (f", breakpoints T = {', '.join(map(str, self.breakpoints))}" if len(self.pieces) > 1 else "")]
        for p in self.pieces:
            rng = f"[{p.lo}, {p.hi if p.hi else 'inf'})"
            ov = ",".join(f"{k}={v}" for k, v in sorted(p.overrides.items())) or "(solver default)"
            m = f", measured {p.measured_ms:.4f} ms" if p.measured_ms is not None else ""
            out.append(f"  T in {rng:<16} {ov}  (at T={p.at}: predicted {p.predicted_ms:.4f} ms{m})")
        out += [f"  {n}" for n in self.notes]
        return out


def _snap(t: float, bm: int = 128) -> int:
    return max(2, int(round(t / bm)) * bm)


def _lines(spec: Spec, arch: str, theta: Mapping[str, float], configs: Iterable[dict[str, Any]]) -> list[tuple]:
    out = []
    for cfg in configs:
        p = P.solve(spec, arch, **cfg)
        out.append((cfg, line(theta, features(spec, p))))
    return out


def piecewise(spec: Spec, arch: str, theta: Mapping[str, float], *, configs: Iterable[dict[str, Any]] | None = None,
              measured: Mapping[int, Mapping[str, Any]] | None = None, t_range: tuple[int, int] = T_RANGE,
              min_gain: float = MIN_GAIN) -> PiecewisePlan:
    """The plan as a function of T.

    ``measured`` (from tune): ``{T: {"overrides": winner config, "ms": its median, "runner": {canonical
    config: ms}}}``; the winners decide which pieces exist (the same winner everywhere: one piece), and the
    fitted model's crossover of two neighbouring winners (sympy) places the breakpoint between their T points.
    A neighbour's piece is kept only if, measured at its T, it beats the other winner by ``min_gain`` or the other
    winner is slower there than the untuned default (``"default_ms"``): the tuned plan is never slower than the
    default at a tuned T.

    Without ``measured``: the lower envelope of the fitted model's lines over ``configs`` (default: the
    space's enumeration) on ``t_range``, breakpoints where the envelope changes hands (sympy), snapped to
    multiples of 128 tokens; a piece whose predicted gain over the neighbouring piece's plan stays below
    ``min_gain`` everywhere in it is merged into that neighbour."""
    cfgs = list(configs) if configs is not None else list(C.enumerate_configs(spec, arch))
    key = lambda c: json.dumps(c, sort_keys=True)  # noqa: E731
    lines = {key(c): (c, ln) for c, ln in _lines(spec, arch, theta, cfgs)}
    at = lambda k, t: lines[k][1][0] * t + lines[k][1][1]  # noqa: E731
    notes: list[str] = []
    if measured:
        pts = sorted(measured)
        seq: list[tuple[int, str]] = []  # (T, winner key)
        for t in pts:
            k = key(dict(measured[t]["overrides"]))
            if k not in lines:
                lines[k] = (dict(measured[t]["overrides"]),
                            line(theta, features(spec, P.solve(spec, arch, **measured[t]["overrides"]))))
            if seq and seq[-1][1] != k:
                # keep the change only if the new winner beats the previous winner by min_gain where measured
                other = (measured[t].get("runner") or {}).get(seq[-1][1])
                dflt = measured[t].get("default_ms")
                # ... and never where that plan would be slower at T than the untuned default measured there
                if other is not None and other < (1 + min_gain) * measured[t]["ms"] and (dflt is None or other <= dflt):
                    notes.append(f"T={t}: {_short(k)} measured {measured[t]['ms']:.4f} ms vs "
                                 f"{other:.4f} ms for the previous piece's plan (< {100 * min_gain:.0f}% apart): "
                                 "one piece")
                    continue
            seq.append((t, k))
        pieces = []
        for i, (t, k) in enumerate(seq):
            if pieces and pieces[-1][1] == k:
                continue
            pieces.append([t, k])
        bounds = [1]
        for (t0, k0), (t1, k1) in zip(pieces, pieces[1:]):
            x = crossover(lines[k0][1], lines[k1][1], t0, t1)
            how = "model crossover" if x is not None else "geometric mean (the model's lines do not cross there)"
            b = _snap(x if x is not None else math.sqrt(t0 * t1))
            b = min(max(b, t0 + 1), t1)
            notes.append(f"breakpoint T={b} between {t0} and {t1}: {how}")
            bounds.append(b)
        out = []
        for i, (t, k) in enumerate(pieces):
            hi = bounds[i + 1] if i + 1 < len(bounds) else 0
            m = measured[t]
            out.append(Piece(bounds[i], hi, dict(lines[k][0]), round(at(k, t), 6), t, m.get("ms")))
        return PiecewisePlan(spec.name, arch, tuple(out), "tune", tuple(notes))
    lo, hi = t_range
    # the envelope on a grid, then exact crossovers between consecutive winners
    grid = sorted({int(lo * (hi / lo) ** (i / 64)) for i in range(65)})
    winners: list[tuple[int, str]] = []
    for t in grid:
        k = min(lines, key=lambda c: (at(c, t), c))
        if not winners or winners[-1][1] != k:
            winners.append((t, k))
    segs = [[1, winners[0][1]]]
    for (t0, k0), (t1, k1) in zip(winners, winners[1:]):
        x = crossover(lines[k0][1], lines[k1][1], t0 * 0.5, t1)
        segs.append([_snap(x if x is not None else t1), k1])
    # merge: a piece whose plan beats its neighbour's by < min_gain at its own representative T joins it
    merged = True
    while merged and len(segs) > 1:
        merged = False
        for i in range(1, len(segs)):
            a_lo = segs[i][0]
            b_hi = segs[i + 1][0] if i + 1 < len(segs) else hi
            rep = max(lo, min(hi, int(math.sqrt(max(a_lo, lo) * max(b_hi, lo)))))
            gain = at(segs[i - 1][1], rep) / at(segs[i][1], rep) - 1
            if gain < min_gain:
                # the two pieces become one, with the plan that is faster at the middle of their joint range
                m_lo = max(segs[i - 1][0], lo)
                mid = max(lo, min(hi, int(math.sqrt(m_lo * max(b_hi, m_lo)))))
                keep = min((segs[i - 1][1], segs[i][1]), key=lambda c: at(c, mid))
                notes.append(f"piece from T={a_lo}: {_short(segs[i][1])} predicted {100 * gain:.1f}% ahead of "
                             f"{_short(segs[i - 1][1])} at T={rep} (< {100 * min_gain:.0f}%): merged, keeping "
                             f"the faster at T={mid}")
                segs[i - 1][1] = keep
                del segs[i]
                merged = True
                break
    # de-duplicate neighbours and non-increasing bounds after snapping
    clean: list[list[Any]] = []
    for b, k in segs:
        if clean and (clean[-1][1] == k or b <= clean[-1][0]):
            continue
        clean.append([b, k])
    out = []
    for i, (b, k) in enumerate(clean):
        nb = clean[i + 1][0] if i + 1 < len(clean) else 0
        rep = max(lo, min(hi, int(math.sqrt(max(b, lo) * (nb or hi)))))
        if i == 0:
            rep = max(lo, min(hi, (nb or hi) // 2))
        out.append(Piece(b, nb, dict(lines[k][0]), round(at(k, rep), 6), rep))
    return PiecewisePlan(spec.name, arch, tuple(out), "model", tuple(notes))


def _short(k: str) -> str:
    c = json.loads(k)
    return ",".join(f"{a}={b}" for a, b in sorted(c.items())) or "(default)"


# ---- the FP8 forward's mainloop efficiencies (plan.FP8_MAINLOOP_EFF) ---------------------------------------
# The H200 runs whose FP8 forward records ran today's kernels and default plans (ce02f25: overlap promotion for
# the forward GEMMs, 128-column tiles; gemm2_bn=256 and the promote overrides are variants of the same kernels).
# Call 3's overlap rows ran a reverted variant (scale loads three blocks ahead: bench/NOTES.md v14), so only its
# serial rows are used.
FP8_RUNS = ("2026-12-04 twelfth session, device call 1", "2026-12-04 twelfth session, device call 2",
            "2026-12-04 twelfth session, device call 5")
FP8_SERIAL_RUNS = ("2026-12-04 twelfth session, device call 3",)
FP8_BENCH_FILES = (_REPO / "bench" / "results" / "forward-h200.json", _REPO / "bench" / "results" / "fp8-h200.json")
FP8_RECORD_BN = 128   # every FP8 GEMM's tile N in the FP8_RUNS records without a *_bn override
FP8_PRIOR_EFF = 0.75   # before any FP8 record: the FP8 GEMMs' tensor pipe was 58-71% active under ncu (NOTES v14)
FP8_FIT_KEYS = ((1, "overlap"), (1, "serial"), (2, "overlap"), (2, "serial"), (2, "wide"))


def fp8_records(paths: Iterable[Path] = FP8_BENCH_FILES, arch: str = "sm_90a") -> list[Record]:
    """The FP8 forward records of :data:`FP8_RUNS` (mokgen rows of ``*-fp8`` shapes in the forward benchmark,
    ``mokgen_fp8`` rows in the FP8 benchmark, whose shape is the BF16 preset run with dtype fp8), each with the
    plan today's solver gives its overrides."""
    out: list[Record] = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            continue
        for i, r in enumerate(data if isinstance(data, list) else []):
            run, impl, shape = str(r.get("run") or ""), str(r.get("impl", "")), str(r.get("shape", ""))
            if impl == "mokgen_fp8":
                ov: dict[str, Any] | None = {}
            elif shape.endswith("-fp8"):
                ov = _impl_overrides(impl)
            else:
                continue
            serial = ov is not None and ov.get("gemm1_promote") == ov.get("gemm2_promote") == "serial"
            if ov is None or not (run.startswith(FP8_RUNS) or (run.startswith(FP8_SERIAL_RUNS) and serial)):
                continue
            ms, d = r.get("median_ms"), r.get("dims") or {}
            if not isinstance(ms, (int, float)) or ms <= 0 or not d.get("T"):
                continue
            # the tiles these runs had: GEMM 1, GEMM 2 and dgrad2 at 128 columns unless the overrides said 256
            # (the 256-column defaults, plan.FP8_WIDE_DEFAULT, came later): solve that plan, not today's default
            ov = {"gemm1_bn": FP8_RECORD_BN, "gemm2_bn": FP8_RECORD_BN, "dgrad2_bn": FP8_RECORD_BN, **ov}
            try:
                spec = load_spec(shape)
                if spec.dtype != "fp8":
                    spec = dataclasses.replace(spec, name=f"{spec.name}-fp8", dtype="fp8")
                spec = with_tokens(spec, int(d["T"]))
                p = P.solve(spec, arch, **ov)
            except Exception:  # noqa: BLE001 - a shape or override today's solver does not plan: not usable
                continue
            out.append(Record(spec.to_dict(), spec.tokens, ov, p.to_dict(), float(ms),
                              f"{Path(path).name}#{i} {r.get('versions', {}).get('mokgen')} {impl}"))
    return out


FP8_EXTRA = ("weights", "tiles")   # the fit's other terms: weight bytes over HBM, per (group x N tile) start-up


def fp8_terms(spec: Spec, plan: Any) -> tuple[dict[Any, float], float]:
    """({term: ms at coefficient 1}, the rest of the forward's ms) of an FP8 plan: per FP8_MAINLOOP_EFF key the
    GEMMs' compute at efficiency 1 (the coefficient is 1 / eff), "weights" the e4m3 weights' bytes over HBM (what
    the weight stream adds beside the compute), "tiles" 1 us per (group x N tile) of both GEMMs; the rest, at
    coefficient 1: the quantizers' and the routing / combine bytes over HBM (plan._glue_bytes)."""
    a = P.get_arch(plan.arch)
    hbm = a.hbm_tbps * 1e9
    f: dict[Any, float] = {"weights": 0.0, "tiles": 0.0}
    for which, g in ((1, plan.gemm1), (2, plan.gemm2)):
        key = P.fp8_eff_key(which, g)
        n, k = P._gemm_shape(spec, which)
        c = P._gemm_cost(spec, a, which, g)
        f[key] = f.get(key, 0.0) + c.flops / (a.peak_fp8_tflops * 1e9 * c.row_eff * c.n_eff * c.wave_eff)
        f["weights"] += spec.groups * n * k * g.elem_bytes / hbm
        f["tiles"] += spec.groups * g.n_tiles * 1e-3
    return f, P._glue_bytes(spec, plan.gemm1) / hbm


def fit_fp8(records: Sequence[Record], prior: float = FP8_PRIOR_EFF, ridge: float = RIDGE) -> dict[str, Any]:
    """The FP8 forward's cost coefficients fitted to ``records``: least squares on relative residuals, linear in
    1 / eff per FP8_MAINLOOP_EFF key and in the "weights" / "tiles" coefficients, ridge toward the priors (1 /
    ``prior``; 0), kept >= 0; a term no record varies keeps its prior, and "stagger" takes "serial"'s value
    (measured no faster: NOTES v13). Returns {"eff": {key: eff}, "weights", "tiles", "rms_rel_err",
    "prior_rms_rel_err", "inputs"}."""
    import numpy as np

    terms = list(FP8_FIT_KEYS) + list(FP8_EXTRA)
    pri = np.array([1 / prior] * len(FP8_FIT_KEYS) + [0.0] * len(FP8_EXTRA))
    rows, rests, ys, info = [], [], [], []
    for r in records:
        f, rest = fp8_terms(Spec.from_dict(r.spec), _plan_view(r.plan))
        rows.append([f.get(t, 0.0) for t in terms])
        rests.append(rest)
        ys.append(r.ms)
        info.append(r)
    theta = pri.copy()
    if rows:
        A, rest, y = np.array(rows), np.array(rests), np.array(ys)
        Ar = A / y[:, None]
        theta = _ridge_nonneg(Ar, 1 - rest / y, pri, ridge)
    eff = {k: float(1 / theta[j]) for j, k in enumerate(FP8_FIT_KEYS)}
    eff[(1, "stagger")], eff[(2, "stagger")] = eff[(1, "serial")], eff[(2, "serial")]
    out: dict[str, Any] = {"eff": eff, **{t: float(theta[len(FP8_FIT_KEYS) + i]) for i, t in enumerate(FP8_EXTRA)},
                           "inputs": [], "rms_rel_err": 0.0, "prior_rms_rel_err": 0.0}
    if rows:
        pred, ppred = A @ theta + rest, A @ pri + rest
        out["rms_rel_err"] = float(np.sqrt(np.mean((pred / y - 1) ** 2)))
        out["prior_rms_rel_err"] = float(np.sqrt(np.mean((ppred / y - 1) ** 2)))
        out["inputs"] = [{"source": r.source, "spec": r.spec.get("name"), "T": r.tokens, "overrides": r.overrides,
                          "ms": r.ms, "fitted_ms": round(float(p), 4)} for r, p in zip(info, pred)]
    return out
