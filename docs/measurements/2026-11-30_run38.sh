#!/usr/bin/env bash
# run 38: why the per-tile mask count build (run 37) lost 3 % at hd64 causal 1k and hd128 full:
# Nsight Compute source counters of it and of the shipped kernels, same shapes.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
M='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
prof() {  # name args...
  local name=$1; shift
  timeout 120 ncu --clock-control none --kernel-name "regex:fa3" --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SourceCounters --metrics "$M" -o "$R/$name" -f \
    python3 -m bench.profile_kernel "$@" > "$R/ncu_$name.log" 2>&1
  timeout 60 ncu --import "$R/$name.ncu-rep" > "$R/ncu_$name.txt" 2>&1
  timeout 60 ncu --import "$R/$name.ncu-rep" --page source --csv --print-source sass > "$R/sass_$name.csv" 2>&1
  rm -f "$R/$name.ncu-rep"
  grep -E "Duration|SM Frequency" "$R/ncu_$name.txt" | head -3
}
for b in hopper hopper_new; do
  echo "=== $b hd64 causal 1k"; prof ${b}_hd64_causal_1k --bundle .carry/$b --head-dim 64 --seqlen 1024 --causal
  echo "=== $b hd128 full 8k"; prof ${b}_hd128_full_8k --bundle .carry/$b --head-dim 128 --seqlen 8192
done
