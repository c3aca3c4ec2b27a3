#!/usr/bin/env bash
# run 20: ptxas wait placement fix (v1) and O rescale under Q K^T (v2) against HEAD; tile sweep.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
for b in default default_v1; do
  echo "=== gpu tests: $b"
  FAGEN_BUNDLE=$PWD/.carry/$b timeout 200 python3 -m pytest tests/gpu -m gpu -q -p no:cacheprovider --maxfail=5 2>&1 | tee "$R/pytest_$b.log" | grep -E "passed|failed|error|FAIL" | tail -8
done
echo "=== bench v2 vs HEAD"
timeout 170 python3 -m bench.attention --bundle .carry/hopper --baseline .carry/hopper_head --seqlens 512,1k,2k,4k,8k,16k \
  --head-dims 64,128,256 --causal both --json "$R/bench_v2_vs_head.json" --table "$R/bench_v2_vs_head.txt" > "$R/bench_v2_vs_head.log" 2>&1
cat "$R/bench_v2_vs_head.txt"
echo "=== bench v2 vs v1"
timeout 100 python3 -m bench.attention --bundle .carry/hopper --baseline .carry/hopper_v1 --seqlens 1k,2k,4k,8k \
  --head-dims 64,128,256 --causal both --json "$R/bench_v2_vs_v1.json" --table "$R/bench_v2_vs_v1.txt" > "$R/bench_v2_vs_v1.log" 2>&1
cat "$R/bench_v2_vs_v1.txt"
for s in 1024 2048 4096 8192; do
  echo "=== sweep9 seqlen $s"
  timeout 100 python3 -m bench.tile_sweep --bundle .carry/sweep9 --seqlen $s --json "$R/sweep9_$s.json" > "$R/sweep9_$s.log" 2>&1
  tail -25 "$R/sweep9_$s.log"
done
