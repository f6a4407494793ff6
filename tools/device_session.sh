#!/usr/bin/env bash
# One device call that produces the project's GPU evidence (see bench/NOTES.md). Expects `mokgen cache pack`
# output and built libraries in .prebuilt/ and the tvm-ffi wheel + DSL runtime in .devdeps/
# (tools/device_env.sh says how they are used). Every step has its own time limit, so a hung kernel costs
# one step, not the call. Knobs (environment):
#   CHECK_BUILDS   built libraries to check and time, "DIR:SPEC ..." (default: every .prebuilt/<spec>[@variant])
#   BENCH_SPECS    presets for tools/bench_forward.py (default: its six)   BENCH_VARIANTS  its --variants
#   BENCH_PLAN     instead: "SPEC[:V1;V2] ..." one bench_forward process per spec with its own variants, then
#                  dense_mm once (BENCH_TIMEOUT is then per spec); BENCH_ROUNDS: bench_forward --rounds
#   PROBE_BUILDS   "DIR:SPEC ..." for tools/probe_clocks.py (default: none)
#   GPU_TESTS      1: run tests/test_gpu_forward.py (MOKGEN_GPU_PRESETS / MOKGEN_GPU_OVERRIDES pass through)
#   GPU_TESTS_FUSED_PRESETS  presets to run that suite on with schedule=fused as well
#   BWD_TESTS      1: run tests/test_gpu_backward.py (MOKGEN_GPU_PRESETS / MOKGEN_GPU_OVERRIDES pass through)
#   BENCH_BWD      1: run tools/bench_backward.py (BENCH_BWD_SPECS: its shapes; BENCH_ROUNDS: --rounds;
#                  Liger comes from .whl/liger_kernel-0.8.5-py3-none-any.whl, installed above)
source tools/device_env.sh || exit 1
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader
# CHECK_BUILDS unset: every .prebuilt/<spec>[@variant] directory; set and empty: none
builds=${CHECK_BUILDS-$(for d in .prebuilt/*/; do [ -d "$d" ] || continue; d=${d%/}; n=$(basename "$d"); echo "$d:${n%@*}"; done)}
hung=""
for b in $builds; do
  n=$(basename "${b%%:*}"); v=${n#*@}; [ "$v" = "$n" ] && v=default
  case " $hung " in *" $v "*) echo "kernel_check $b: skipped (variant $v hung before)"; continue;; esac
  # one JSON line per build on stdout -> checks.jsonl (the device returns few files: keep them few)
  timeout "${CHECK_TIMEOUT:-60}" python3 tools/kernel_check.py "$b" 2>>"$OUT/checks.log" | tee -a "$OUT/checks.jsonl" \
    | cut -c1-900
  rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || { echo "kernel_check $b: exit $rc"; tail -3 "$OUT/checks.log" | cut -c1-300; }
  [ "$rc" = 124 ] && hung="$hung $v"
done
# a variant that failed kernel_check (an error, a timeout, NaN, wrong or non-deterministic output) is not
# benchmarked: a crashed kernel takes the benchmark's CUDA context, and every shape after it, down with it
filter_variants() {  # $1: ';'-separated variants -> those without a failed kernel_check record
  [ -n "$1" ] && [ -s "$OUT/checks.jsonl" ] || { echo "$1"; return; }
  python3 - "$OUT/checks.jsonl" "$1" "$hung" <<'PY'
import json, sys
checks = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
hung = {",".join(sorted(h.replace("+", ",").split(","))) for h in sys.argv[3].split()}
def ok(r):
    return ("error" not in r and r.get("routing_exact") and not r.get("y_nan") and (r.get("y_rel_err") or 1) < 1e-2
            and r.get("bitwise_same_rerun") and r.get("bitwise_same_half_sms"))
keep = []
for v in filter(None, sys.argv[2].split(";")):
    norm = ",".join(sorted(v.split(",")))
    mine = [r for r in checks if "@" in r.get("item", "")
            and ",".join(sorted(r["item"].split("@", 1)[1].replace("+", ",").split(","))) == norm]
    if norm in hung or not all(ok(r) for r in mine):
        print(f"bench: variant {v} dropped (failed kernel_check)", file=sys.stderr)
    else:
        keep.append(v)
print(";".join(keep))
PY
}
if [ -n "$BENCH_PLAN" ]; then
  # one bench_forward process per spec (a crash costs that spec only), each with its own variants
  for entry in $BENCH_PLAN; do
    spec=${entry%%:*}; vars=""; [ "$entry" != "$spec" ] && vars=$(filter_variants "${entry#*:}")
    timeout "${BENCH_TIMEOUT:-240}" python3 tools/bench_forward.py "$spec" --no-dense ${vars:+--variants "$vars"} ${BENCH_ROUNDS:+--rounds $BENCH_ROUNDS} \
      --loop-reps 1 --out "$OUT/forward-$MOKGEN_GPU_TAG.json" 2>>"$OUT/bench.log" | grep -E '^│ ' | cut -c1-130
    echo "bench $spec: exit ${PIPESTATUS[0]}"
  done
  timeout 60 python3 tools/bench_forward.py --impls dense_mm --out "$OUT/forward-$MOKGEN_GPU_TAG.json" 2>>"$OUT/bench.log" \
    | grep -E '^│ '
elif [ "${BENCH:-1}" = 1 ]; then
  BENCH_VARIANTS=$(filter_variants "$BENCH_VARIANTS")
  timeout "${BENCH_TIMEOUT:-240}" python3 tools/bench_forward.py $BENCH_SPECS ${BENCH_VARIANTS:+--variants "$BENCH_VARIANTS"} \
    --loop-reps 1 --out "$OUT/forward-$MOKGEN_GPU_TAG.json" 2>"$OUT/bench.log" | tail -40; tail -3 "$OUT/bench.log"
fi
if [ -n "$PROBE_BUILDS" ]; then
  timeout "${PROBE_TIMEOUT:-120}" python3 tools/probe_clocks.py $PROBE_BUILDS --json "$OUT/probe.json" 2>&1 | grep -v '^{' | cut -c1-400
fi
if [ "${GPU_TESTS:-0}" = 1 ]; then
  timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -x tests/test_gpu_forward.py >"$OUT/pytest.log" 2>&1
  tail -15 "$OUT/pytest.log"
fi
if [ -n "$GPU_TESTS_FUSED_PRESETS" ]; then  # the same suite on the fused schedule
  MOKGEN_GPU_PRESETS=$GPU_TESTS_FUSED_PRESETS MOKGEN_GPU_OVERRIDES=schedule=fused timeout "${TEST_TIMEOUT:-150}" \
    python3 -m pytest -q -x tests/test_gpu_forward.py >"$OUT/pytest-fused.log" 2>&1
  tail -15 "$OUT/pytest-fused.log"
fi
if [ "${BWD_TESTS:-0}" = 1 ]; then
  timeout "${BWD_TEST_TIMEOUT:-540}" python3 -m pytest -q -x tests/test_gpu_backward.py >"$OUT/pytest-bwd.log" 2>&1
  tail -15 "$OUT/pytest-bwd.log"
fi
if [ "${BENCH_BWD:-0}" = 1 ]; then
  timeout "${BENCH_BWD_TIMEOUT:-540}" python3 tools/bench_backward.py $BENCH_BWD_SPECS ${BENCH_ROUNDS:+--rounds $BENCH_ROUNDS} \
    --out "$OUT/backward-$MOKGEN_GPU_TAG.json" 2>"$OUT/bench-bwd.log" | tail -30; tail -3 "$OUT/bench-bwd.log"
fi
