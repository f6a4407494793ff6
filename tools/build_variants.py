"""Build kernel variants side by side for tools/kernel_check.py (the kernel author's tool; needs the CuTe DSL).

    python tools/build_variants.py OUT_DIR SPEC[,SPEC...] VARIANT[,VARIANT...]

Writes OUT_DIR/<spec>@<variant> (``default`` writes OUT_DIR/<spec>). A variant is a '+'-joined list of
plan overrides ``key=value`` (``gemm1_a_load=tma``) and ``emit`` instrumentation (``fused_profile``), e.g.
``schedule=fused+fused_profile``. Short names: tma, cluster2, epi4 (epi_stages=4), epin64 (epi_n=64).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mokgen import build, emit, plan  # noqa: E402
from mokgen.spec import load_spec  # noqa: E402

SHORT = {"tma": "gemm1_a_load=tma", "cluster2": "cluster=2", "epi4": "epi_stages=4", "epin64": "epi_n=64"}


def parse_variant(v: str) -> tuple[tuple[str, ...], dict[str, object]]:
    experiments, overrides = [], {}
    if v == "default":
        return (), {}
    for part in v.split("+"):
        part = SHORT.get(part, part)
        if "=" in part:
            k, val = part.split("=", 1)
            overrides[k] = int(val) if val.isdigit() else val
        else:
            experiments.append(part)
    return tuple(experiments), overrides


def main(argv=None) -> int:
    a = sys.argv[1:] if argv is None else argv
    if len(a) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    out, specs, variants = Path(a[0]), a[1].split(","), a[2].split(",")
    for s in specs:
        spec = load_spec(s)
        for v in variants:
            experiments, overrides = parse_variant(v)
            p = plan.solve(spec, "sm_90a", **overrides)
            src = emit.emit(p, experimental=experiments)
            d = out / (s if v == "default" else f"{s}@{v}")
            print(f"== {d}", flush=True)
            build.build(src, "sm_90a", d, progress=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
