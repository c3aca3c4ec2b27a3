#!/usr/bin/env bash
# run 52: hd64 softmax with four independent partial maxima and sums (chains of 4 instead of 16
# per row; entry 22 tried it before the softmax overlapped the P V) against the shipped kernels.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
timeout 200 python3 -m bench.attention --bundle .carry/hd64_split --baseline .carry/hd64_cur --seqlens 512,1k,2k,4k,8k,16k \
  --head-dims 64 --causal both --repeats 3 --json "$R/bench_hd64.json" --table "$R/bench_hd64.txt" > "$R/bench_hd64.log" 2>&1
cat "$R/bench_hd64.txt"
