#!/usr/bin/env bash
# run 50: why the warp-uniform consumer index (entry 43) measured slower with fewer main-loop
# instructions: Nsight Compute source counters of the shipped and the warp-uniform build, hd128
# and hd256 non-causal 4k (both lost 2-5 % in run 47).
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
for b in hopper_base hopper_wu; do
  echo "=== $b hd128 full 4k"; prof ${b}_hd128_full_4k --bundle .carry/$b --head-dim 128 --seqlen 4096
  echo "=== $b hd256 full 4k"; prof ${b}_hd256_full_4k --bundle .carry/$b --head-dim 256 --seqlen 4096
done
for n in hd128_full_4k hd256_full_4k; do
  python3 -m bench.source_counters "$R/sass_hopper_base_$n.csv" "$R/sass_hopper_wu_$n.csv" --top 12 > "$R/summary_$n.txt" 2>&1
done
