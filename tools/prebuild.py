"""Build cache entries for specs x plan variants and pack them for the GPU host (needs the CuTe DSL).

    python tools/prebuild.py OUT.tar.xz SPEC[,SPEC...] [VARIANT ...]

A variant is "default" or "k=v+k=v" plan overrides (``consumer=pingpong+cluster=2``). Every entry goes into
``$MOKGEN_CACHE_DIR`` (set it to a scratch directory to pack only these) and the whole cache is then packed with
``mokgen cache pack``. On the GPU host, ``tools/kernel_check.py SPEC@VARIANT`` and
``tools/bench_forward.py --variants`` find the entries again through the same plans.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mokgen import driver, emit, plan  # noqa: E402
from mokgen.cli import main as cli_main  # noqa: E402
from mokgen.plan import parse_overrides  # noqa: E402
from mokgen.spec import load_spec  # noqa: E402


def main(argv=None) -> int:
    a = sys.argv[1:] if argv is None else argv
    if len(a) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out, specs, variants = a[0], a[1].split(","), a[2:] or ["default"]
    for s in specs:
        spec = load_spec(s)
        for v in variants:
            ov = {} if v == "default" else parse_overrides(v)
            t0 = time.time()
            src = emit.emit(plan.solve(spec, "sm_90a", **ov))
            art = driver.get_or_build(src, "sm_90a")
            print(f"{s}@{v}: {Path(getattr(art, 'dir', art)).name} ({time.time() - t0:.0f} s)", flush=True)
    return cli_main(["cache", "pack", out, "--arch", "sm_90a"])


if __name__ == "__main__":
    sys.exit(main())
