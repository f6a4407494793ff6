#!/usr/bin/env bash
# One device call that produces the project's GPU evidence (see bench/NOTES.md):
#   the forward benchmark of every shape (mokgen + baselines, same process), kernel variants with eager vs
#   CUDA-graph timing, and the GPU test suite. Expects `mokgen cache pack` output in .prebuilt/ and the
#   tvm-ffi wheel + DSL runtime in .devdeps/ (tools/device_env.sh says how they are used).
source tools/device_env.sh || exit 1
timeout 110 python3 tools/bench_forward.py --loop-reps 1 --out "$OUT/forward-h200.json" 2>&1 | tail -24
# .prebuilt/<spec> and .prebuilt/<spec>@<variant>: built libraries to check and time side by side
variants=$(for d in .prebuilt/*/; do d=${d%/}; n=$(basename "$d"); echo "$d:${n%@*}"; done)
timeout 100 python3 tools/kernel_check.py $variants --json "$OUT/variants.json" 2>/dev/null | cut -c1-400
timeout 90 python3 -m pytest -q -x tests/test_gpu_forward.py 2>&1 | tail -15
