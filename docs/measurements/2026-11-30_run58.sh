#!/usr/bin/env bash
# run 58: why mma_row_sum lost on the two-consumer hd64 kernels (hd64 causal 4k: 0.95x the
# previous kernel in run 57): Nsight Compute of both kernels on that shape (pipes, stall reasons,
# source counters), then a second A/B at hd64, five rounds per row.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
M='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,sm__cycles_active.avg,sm__cycles_active.min,sm__cycles_active.max,sm__cycles_elapsed.max,smsp__inst_executed.sum,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active'
prof() {  # name bundle
  local name=$1 bundle=$2
  timeout 120 ncu --clock-control none --kernel-name "regex:fa3" --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SourceCounters --metrics "$M" -o "$R/$name" -f \
    python3 -m bench.profile_kernel --bundle "$bundle" --head-dim 64 --seqlen 4096 --causal > "$R/ncu_$name.log" 2>&1
  timeout 60 ncu --import "$R/$name.ncu-rep" > "$R/ncu_$name.txt" 2>&1
  timeout 60 ncu --import "$R/$name.ncu-rep" --page source --csv --print-source sass > "$R/sass_$name.csv" 2>&1
  rm -f "$R/$name.ncu-rep"
  grep -E "Duration|sm__cycles_active|inst_executed.sum|pipe_xu|gmma|issue_active" "$R/ncu_$name.txt" | head -12
}
echo "=== base hd64 causal 4k"; prof base_hd64_causal_4k .carry/base_hopper
echo "=== mma_row_sum hd64 causal 4k"; prof ms_hd64_causal_4k .carry/hopper
python3 -m bench.source_counters "$R/sass_base_hd64_causal_4k.csv" "$R/sass_ms_hd64_causal_4k.csv" --top 15 > "$R/summary_hd64_causal_4k.txt" 2>&1
grep -E "stalled" "$R/ncu_base_hd64_causal_4k.txt" | sort -k3 -n -r | head -8
grep -E "stalled" "$R/ncu_ms_hd64_causal_4k.txt" | sort -k3 -n -r | head -8
rm -f "$R"/*.csv
timeout 200 python3 -m bench.attention --bundle .carry/hopper --baseline .carry/base_hopper --seqlens 512,1k,2k,4k,8k,16k \
  --head-dims 64 --causal both --repeats 5 --json "$R/bench_hopper.json" --table "$R/bench_hopper.txt" > "$R/bench_hopper.log" 2>&1
cat "$R/bench_hopper.txt"
