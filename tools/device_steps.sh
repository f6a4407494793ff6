#!/usr/bin/env bash
# One device call, several steps, each with its own time limit (a hung or crashed step costs that step only):
#
#     bash tools/device_steps.sh STEP [STEP ...]
#
# Steps (quote each; SPECS: space-separated preset names or YAML paths, for timeline and ncu each SPEC[@k=v,...];
# bwd / fwd take plan variants only through --variants in BWD_ARGS / FWD_ARGS, for every spec; FILE: under tests/):
#   test:FILE:PRESETS[:K=V,...]   pytest FILE with MOKGEN_GPU_PRESETS=PRESETS (and MOKGEN_GPU_OVERRIDES); log in $OUT
#   timeline:SPECS                tools/step_timeline.py (sustained per-kernel times) -> $OUT/step-timeline.jsonl
#   bwd:SPECS                     tools/bench_backward.py --rounds $ROUNDS --settle-s $SETTLE -> $OUT/backward-GPU.json
#   fwd:SPECS                     tools/bench_forward.py --rounds $ROUNDS --settle-s $SETTLE -> $OUT/forward-GPU.json
#   fp8:SPECS                     tools/bench_fp8.py --backward --rounds $ROUNDS --settle-s $SETTLE, one process per BF16 spec (its FP8
#                                 twin, torch's BF16 and FP8 pipelines; FP8_IMPLS), all appended to $OUT/fp8-GPU.json
#                                 and $OUT/bench-fp8.log (one file each: a call returns at most 8 files from $OUT)
#   py:SCRIPT[:ARGS]              python3 SCRIPT ARGS (ARGS ','-separated; @OUT stands for $OUT, e.g. --out,@OUT/x.json)
#   pyw:SCRIPT[:ARGS]             the same with ARGS separated by whitespace, so an argument may hold ',' and ';'
#                                 (e.g. --variants gemm1_a_load=gather,gemm1_epi_store=ring;pdl=exit)
#   ncu:SPECS                     Nsight Compute over tools/ncu_step.py (one training step's generated kernels):
#                                 $OUT/step.ncu-rep, $OUT/ncu-raw.csv, $OUT/ncu-labels.txt (NCU_ARGS: extra ncu args;
#                                 NCU_SOURCE=1: the SASS source page as $OUT/ncu-source.csv.gz)
# GPU: the card's tag, MOKGEN_GPU_TAG from tools/device_env.sh (h200, h100, ...).
# Knobs: STEP_TIMEOUT (s, default 300), ROUNDS (3), SETTLE (0.5), BWD_ARGS / FWD_ARGS / TIMELINE_ARGS (extra args).
# Environment: tools/device_env.sh (the DSL bundle and wheels carried in .devdeps / .whl).
source tools/device_env.sh || exit 1
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader
: "${OUT:=/tmp/out}"; mkdir -p "$OUT"
ROUNDS=${ROUNDS:-3}; SETTLE=${SETTLE:-0.5}
t0=$SECONDS
for step in "$@"; do
  kind=${step%%:*}; rest=${step#*:}
  echo "=== $step ($((SECONDS - t0)) s)"
  case $kind in
    test)
      file=${rest%%:*}; rest2=${rest#*:}; presets=${rest2%%:*}; ovr=""; [ "$rest2" != "$presets" ] && ovr=${rest2#*:}
      tag=${presets//,/_}; tag=${tag//\//_}; log="$OUT/pytest-$(basename "$file" .py)-$tag.log"
      MOKGEN_GPU_PRESETS=$presets MOKGEN_GPU_OVERRIDES=$ovr timeout "${STEP_TIMEOUT:-300}" \
        python3 -m pytest -q -p no:cacheprovider "tests/$file" >"$log" 2>&1
      echo "exit $?"; grep -E "passed|failed|error" "$log" | tail -3; grep -E "^(FAILED|ERROR)" "$log" | head -10 | cut -c1-300 ;;
    timeline)
      timeout "${STEP_TIMEOUT:-300}" python3 tools/step_timeline.py $rest $TIMELINE_ARGS \
        --json "$OUT/step-timeline.jsonl" 2>>"$OUT/timeline.log" | grep -v '^{' | cut -c1-160
      echo "exit ${PIPESTATUS[0]}" ;;
    bwd)
      timeout "${STEP_TIMEOUT:-300}" python3 tools/bench_backward.py $rest --rounds "$ROUNDS" --settle-s "$SETTLE" \
        $BWD_ARGS --out "$OUT/backward-$MOKGEN_GPU_TAG.json" 2>>"$OUT/bench-bwd.log" | tail -25
      echo "exit ${PIPESTATUS[0]}"; tail -2 "$OUT/bench-bwd.log" | cut -c1-300 ;;
    fwd)
      timeout "${STEP_TIMEOUT:-300}" python3 tools/bench_forward.py $rest --rounds "$ROUNDS" --settle-s "$SETTLE" \
        $FWD_ARGS --out "$OUT/forward-$MOKGEN_GPU_TAG.json" 2>>"$OUT/bench-fwd.log" | tail -25
      echo "exit ${PIPESTATUS[0]}"; tail -2 "$OUT/bench-fwd.log" | cut -c1-300 ;;
    fp8)
      for s in $rest; do
        echo "=== $s" >> "$OUT/bench-fp8.log"; from=$(wc -l < "$OUT/bench-fp8.log")
        timeout "${STEP_TIMEOUT:-300}" python3 tools/bench_fp8.py "$s" --backward --rounds "$ROUNDS" --settle-s "$SETTLE" --no-dense \
          --impls "${FP8_IMPLS:-torch_grouped_mm,mokgen,torch_fp8_grouped_mm,mokgen_fp8}" --out "$OUT/fp8-$MOKGEN_GPU_TAG.json" \
          2>>"$OUT/bench-fp8.log" | grep -E "mokgen|torch" | cut -c1-150
        echo "$s exit ${PIPESTATUS[0]}"; tail -n "+$from" "$OUT/bench-fp8.log" | grep FAILED | head -5 | cut -c1-200
      done ;;
    py|pyw)
      script=${rest%%:*}; args=""; [ "$rest" != "$script" ] && args=${rest#*:}; args=${args//@OUT/$OUT}
      [ "$kind" = py ] && args=${args//,/ }
      read -r -a argv <<< "$args"
      timeout "${STEP_TIMEOUT:-300}" python3 "$script" "${argv[@]}" 2>&1 | tail -40; echo "exit ${PIPESTATUS[0]}" ;;
    ncu)
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
      secs=""; for sct in SpeedOfLight MemoryWorkloadAnalysis MemoryWorkloadAnalysis_Tables WarpStateStats ComputeWorkloadAnalysis; do
        secs="$secs --section $sct"; done
      timeout "${STEP_TIMEOUT:-300}" "$NCU" --clock-control none --profile-from-start off --kernel-name regex:kernel_cutlass \
        $secs $NCU_ARGS -o "$OUT/step" python3 tools/ncu_step.py $rest > "$OUT/ncu-labels.txt" 2> "$OUT/ncu.err"
      echo "exit $?"; grep -c "^label" "$OUT/ncu-labels.txt"; grep "==ERROR==" "$OUT/ncu-labels.txt" "$OUT/ncu.err" | head -5
      "$NCU" -i "$OUT/step.ncu-rep" --page raw --csv > "$OUT/ncu-raw.csv" 2>&1
      python3 tools/ncu_summary.py "$OUT/ncu-raw.csv" "$OUT/ncu-labels.txt" --all 2>&1 | cut -c1-300
      if [ -n "$NCU_SOURCE" ]; then   # per-SASS-line counters (needs --section SourceCounters in NCU_ARGS)
        "$NCU" -i "$OUT/step.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu-source.csv" 2>"$OUT/ncu-source.err"
        echo "source page exit $? ($(wc -l < "$OUT/ncu-source.csv") lines)"; head -c 300 "$OUT/ncu-source.err"
        gzip -f "$OUT/ncu-source.csv"
      fi ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "=== done ($((SECONDS - t0)) s)"
