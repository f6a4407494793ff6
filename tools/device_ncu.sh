#!/usr/bin/env bash
# One device call: Nsight Compute counters for ITEMS (tools/ncu_profile.py) into $OUT/prof.ncu-rep and $OUT/raw.csv.
# ITEMS (environment) as for tools/ncu_profile.py; the sections actually installed are used, or only the metrics
# NCU_METRICS names (comma-separated), which takes one or two replay passes per kernel.
source tools/device_env.sh || exit 1
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
echo "ncu: $NCU"; $NCU --version | tail -1
avail=$($NCU --list-sections 2>/dev/null | awk '{print $1}')
secs=""
for s in SpeedOfLight ComputeWorkloadAnalysis MemoryWorkloadAnalysis MemoryWorkloadAnalysis_Chart MemoryWorkloadAnalysis_Tables WarpStateStats InstructionStats SchedulerStats LaunchStats Occupancy; do
  echo "$avail" | grep -qx "$s" && secs="$secs --section $s"
done
[ -n "$NCU_METRICS" ] && secs="--metrics $NCU_METRICS"
echo "sections:$secs"
ITEMS=${ITEMS:-"kimi-k2 torch:layer:kimi-k2"}
time timeout 420 $NCU --clock-control none --profile-from-start off $secs -o $OUT/prof python3 tools/ncu_profile.py $ITEMS > $OUT/labels.txt 2> $OUT/ncu.err
echo "rc $?"; grep -c "^label" $OUT/labels.txt; grep "==PROF==\|==ERROR==\|==WARNING==" $OUT/labels.txt $OUT/ncu.err | head -20
$NCU -i $OUT/prof.ncu-rep --page raw --csv > $OUT/raw.csv 2>&1; ls -la $OUT
tail -5 $OUT/ncu.err
