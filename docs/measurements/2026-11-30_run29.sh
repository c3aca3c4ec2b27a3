#!/usr/bin/env bash
# run 29: a second sample of the shipped build (HEAD, same cubins as run 27's `hopper`): the
# benchmark table against SDPA-FA2 and cuDNN, and cold start.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
echo "=== cold start: hopper"
timeout 60 python3 -m bench.cold_start --bundle .carry/hopper --json "$R/cold_hopper.json" > "$R/cold_hopper.log" 2>&1; grep total "$R/cold_hopper.log"
echo "=== bench hopper"
timeout 200 python3 -m bench.attention --bundle .carry/hopper --seqlens 512,1k,2k,4k,8k,16k \
  --head-dims 64,128,256 --causal both --json "$R/bench_hopper.json" --table "$R/bench_hopper.txt" --png "$R/bench_hopper.png" > "$R/bench_hopper.log" 2>&1
cat "$R/bench_hopper.txt"
