#!/usr/bin/env bash
# run 51: hd64 causal 2k, the row furthest below cuDNN at >= 2k: Nsight Compute of fagen's kernel
# and cuDNN's on the same shape (instruction mix, stall reasons, and how evenly the SMs are busy:
# sm__cycles_active avg / min / max against the elapsed cycles).
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
M='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,sm__cycles_active.avg,sm__cycles_active.min,sm__cycles_active.max,sm__cycles_elapsed.max,smsp__inst_executed.sum'
prof() {  # name kernel-regex args...
  local name=$1 kre=$2; shift 2
  timeout 150 ncu --clock-control none --kernel-name "regex:$kre" --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SourceCounters --metrics "$M" -o "$R/$name" -f \
    python3 -m bench.profile_kernel "$@" > "$R/ncu_$name.log" 2>&1
  timeout 60 ncu --import "$R/$name.ncu-rep" > "$R/ncu_$name.txt" 2>&1
  timeout 60 ncu --import "$R/$name.ncu-rep" --page source --csv --print-source sass > "$R/sass_$name.csv" 2>&1
  rm -f "$R/$name.ncu-rep"
  grep -E "Duration|SM Frequency|sm__cycles|inst_executed.sum" "$R/ncu_$name.txt" | head -8
}
echo "=== fagen hd64 causal 2k"; prof fa3_hd64_causal_2k fa3 --bundle .carry/hopper_base --head-dim 64 --seqlen 2048 --causal
echo "=== cuDNN hd64 causal 2k"; prof cudnn_hd64_causal_2k "cudnn|sm90|fprop" --peer cuDNN --head-dim 64 --seqlen 2048 --causal
python3 -m bench.source_counters "$R/sass_fa3_hd64_causal_2k.csv" "$R/sass_cudnn_hd64_causal_2k.csv" --top 15 > "$R/summary_hd64_causal_2k.txt" 2>&1
rm -f "$R"/*.csv
