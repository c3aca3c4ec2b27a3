#!/usr/bin/env bash
# run 33: where the FA3 consumer warps stall, per SASS instruction (Nsight Compute source page),
# hd128 non-causal 4k and hd64 causal 512, with cuDNN on the same shapes for the summary metrics.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" --exclude="*.ncu-rep" -C "$R" .; mkdir -p $OUT/rep; mv $R/*.ncu-rep $OUT/rep/ 2>/dev/null' EXIT
ncu --version | tail -1
M='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
prof() {  # name kernel-regex args...
  local name=$1 kre=$2; shift 2
  timeout 170 ncu --clock-control none --kernel-name "regex:$kre" --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SourceCounters --section ComputeWorkloadAnalysis \
    --section InstructionStats --metrics "$M" -o "$R/$name" -f \
    python3 -m bench.profile_kernel "$@" > "$R/ncu_$name.log" 2>&1
  timeout 60 ncu --import "$R/$name.ncu-rep" > "$R/ncu_$name.txt" 2>&1
  timeout 60 ncu --import "$R/$name.ncu-rep" --page source --csv --print-source sass > "$R/sass_$name.csv" 2>&1
  grep -E "Duration|SM Frequency|Issue Slots Busy|stalled_(barrier|wait|long_scoreboard|dispatch|short_scoreboard|not_selected|math|mio|lg)" "$R/ncu_$name.txt" | head -14
  wc -l "$R/sass_$name.csv"
}
echo "=== fagen hd128 full 4k"; prof fa3_hd128_full_4k fa3 --bundle .carry/hopper --head-dim 128 --seqlen 4096
echo "=== cuDNN hd128 full 4k"; prof cudnn_hd128_full_4k "cudnn|sm90|fprop" --peer cuDNN --head-dim 128 --seqlen 4096
echo "=== fagen hd64 causal 512"; prof fa3_hd64_causal_512 fa3 --bundle .carry/hopper --head-dim 64 --seqlen 512 --causal
echo "=== cuDNN hd64 causal 512"; prof cudnn_hd64_causal_512 "cudnn|sm90|fprop" --peer cuDNN --head-dim 64 --seqlen 512 --causal
rm -f "$R"/*.ncu-rep.tmp
ls -la $R
