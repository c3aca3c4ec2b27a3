#!/usr/bin/env bash
# run 25: stall profiles of the shipped FA3 kernels after the overlap fix (the two furthest rows at
# 2k) and of cuDNN on hd64 causal 2k; same metrics as run 18, plus SourceCounters for fagen.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
M='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
prof() {  # name kernel-regex args...
  local name=$1 kre=$2; shift 2
  timeout 150 ncu --clock-control none --kernel-name "regex:$kre" --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SourceCounters --metrics "$M" \
    python3 -m bench.profile_kernel "$@" > "$R/ncu_$name.txt" 2>&1
  grep -E "Duration|Issue Slots Busy|stalled_(barrier|wait|long_scoreboard|dispatch|short_scoreboard|not_selected|math|mio)" "$R/ncu_$name.txt" | head -12
}
echo "=== fagen hd128 full 2k"; prof fa3_hd128_full_2k fa3 --bundle .carry/hopper --head-dim 128 --seqlen 2048
echo "=== fagen hd64 causal 2k"; prof fa3_hd64_causal_2k fa3 --bundle .carry/hopper --head-dim 64 --seqlen 2048 --causal
echo "=== cuDNN hd64 causal 2k"; prof cudnn_hd64_causal_2k "cudnn|sm90|fprop" --peer cuDNN --head-dim 64 --seqlen 2048 --causal
