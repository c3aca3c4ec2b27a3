#!/usr/bin/env bash
# run 53: the masked iterations of the FA3 main loop peeled into a loop of their own, so that the
# main loop has no mask code (hd64 / hd128 bf16 kernels of the hopper tuning), against the shipped
# kernels, 3 rounds.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
timeout 250 python3 -m bench.attention --bundle .carry/peel --baseline .carry/cur --seqlens 512,1k,2k,4k,8k,16k \
  --head-dims 64,128 --causal both --repeats 3 --json "$R/bench.json" --table "$R/bench.txt" > "$R/bench.log" 2>&1
cat "$R/bench.txt"
