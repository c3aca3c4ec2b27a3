#!/usr/bin/env bash
# run 55: the shipped state of this stop (hd64: peel_masked_blocks on every kernel, early_first_qk
# at non-causal <= 512; head dims 128/256 unchanged), every row, 3 rounds.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
timeout 280 python3 -m bench.attention --bundle .carry/hopper_new --seqlens 512,1k,2k,4k,8k,16k \
  --head-dims 64,128,256 --causal both --repeats 3 --json "$R/bench_hopper.json" --table "$R/bench_hopper.txt" > "$R/bench_hopper.log" 2>&1
cat "$R/bench_hopper.txt"
