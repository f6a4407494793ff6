"""Build cache entries for specs x plan variants and pack them for the GPU host (needs the CuTe DSL).

    python tools/prebuild.py OUT.tar.xz SPEC[:DTYPE][,SPEC[:DTYPE]...] [VARIANT ...] [--no-runtime]

SPEC is a preset name or a YAML path; ``:DTYPE`` (bf16 / fp8) builds the spec with its dtype set, which is how
``tools/bench_fp8.py`` and ``tools/bench_backward.py`` ask ``mokgen.compile`` for a shape's BF16 and FP8 twins
(``kimi-k2:fp8`` is not the preset ``kimi-k2-fp8``: another name, another key). A variant is "default" or
"k=v+k=v" plan overrides (``consumer=pingpong+cluster=2``). Every entry is built by ``mokgen.compile`` for sm_90a
(the call the benches make, so the keys are theirs) into ``$MOKGEN_CACHE_DIR`` (set it to a scratch directory to
pack only these), and the whole cache is then packed with ``mokgen cache pack``. On the GPU host,
``tools/device_env.sh`` unpacks ``.prebuilt/*.tar.xz`` and the benches, ``tools/kernel_check.py SPEC@VARIANT``
and ``--variants`` find the entries through the same plans, with no compile.

``--no-runtime`` leaves the 43 MB runtime library out (3 MB for the six bench shapes' twins instead of ~20): for a
host that has the CuTe DSL itself, as the device machine has with the bundle of ../shared/device. That host uses
an entry only where its cache key matches, and the key holds the version of every ``nvidia-cutlass-dsl*``
package installed: the bundle has no ``nvidia-cutlass-dsl-libs-cu12``, which ``pip install nvidia-cutlass-dsl``
brings here, so uninstall that package here before building (the cu13 libraries compile the same), or the
device builds the kernels again (correct, only slower). A plan the host solves differently (tuning records
there) is likewise built there.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mokgen.plan import parse_overrides  # noqa: E402
from mokgen.spec import load_spec  # noqa: E402

DTYPES = ("bf16", "fp8")


def parse_items(arg: str) -> list[tuple[str, str | None]]:
    """``"kimi-k2:fp8,glm-5"`` -> ``[("kimi-k2", "fp8"), ("glm-5", None)]`` (None: the spec's own dtype)."""
    out: list[tuple[str, str | None]] = []
    for item in filter(None, (s.strip() for s in arg.split(","))):
        name, sep, dtype = item.rpartition(":")
        if not sep or "/" in dtype or dtype.endswith((".yaml", ".yml")):
            out.append((item, None))
        elif dtype in DTYPES:
            out.append((name, dtype))
        else:
            raise ValueError(f"{item!r}: the dtype after ':' must be one of {', '.join(DTYPES)}")
    if not out:
        raise ValueError("no spec named")
    return out


def spec_for(name: str, dtype: str | None) -> Any:
    """The loaded spec, or with ``dtype`` set: the benches' own twin (``bench_fp8.spec_as``)."""
    spec = load_spec(name)
    if dtype is None:
        return spec
    from bench_fp8 import spec_as   # tools/ is on sys.path when this script runs

    return spec_as(spec, dtype)


def main(argv=None) -> int:
    a = list(sys.argv[1:] if argv is None else argv)
    runtime = "--no-runtime" not in a
    a = [x for x in a if x != "--no-runtime"]
    if len(a) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        items = parse_items(a[1])
    except ValueError as e:
        print(f"prebuild: {e}", file=sys.stderr)
        return 2
    out, variants = a[0], a[2:] or ["default"]
    import mokgen
    from mokgen.cli import main as cli_main

    for name, dtype in items:
        for v in variants:
            ov = None if v == "default" else parse_overrides(v)
            t0 = time.time()
            mokgen.compile(spec_for(name, dtype), arch="sm_90a", overrides=ov)
            print(f"{name}{':' + dtype if dtype else ''}@{v}: built ({time.time() - t0:.0f} s)", flush=True)
    return cli_main(["cache", "pack", out, "--arch", "sm_90a"] + ([] if runtime else ["--no-runtime"]))


if __name__ == "__main__":
    sys.exit(main())
