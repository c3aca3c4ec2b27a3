#!/usr/bin/env bash
# run 22: cross-tile pipeline with a warp-uniform tile index vs HEAD 4ebfdea;
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
echo "=== gpu tests: default"
FAGEN_BUNDLE=$PWD/.carry/default timeout 240 python3 -m pytest tests/gpu -m gpu -q -p no:cacheprovider --maxfail=5 2>&1 | tee "$R/pytest_default.log" | grep -E "passed|failed|error|FAIL" | tail -8
echo "=== bench hopper vs base"
timeout 170 python3 -m bench.attention --bundle .carry/hopper --baseline .carry/hopper_base --seqlens 512,1k,2k,4k,8k,16k \
  --head-dims 64,128,256 --causal both --json "$R/bench_hopper.json" --table "$R/bench_hopper.txt" --png "$R/bench_hopper.png" > "$R/bench_hopper.log" 2>&1
cat "$R/bench_hopper.txt"
for s in 512 1024; do
  echo "=== sweep10 seqlen $s"
  timeout 100 python3 -m bench.tile_sweep --bundle .carry/sweep10 --seqlen $s --json "$R/sweep10_$s.json" > "$R/sweep10_$s.log" 2>&1
  cut -c1-110 "$R/sweep10_$s.log" | tail -24
done
