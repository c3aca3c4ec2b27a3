#!/usr/bin/env bash
# run 54: the masked iterations of the FA3 main loop peeled into a loop of their own, its bound
# counted from the tile's first row (run 53 counted it per warp: -5...-14 % causal, the loop
# counter was no longer uniform). GPU tests on the default bundle built with it, then every
# row against the shipped kernels (3 rounds).
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
echo "=== GPU tests (default bundle, peeled)"
FAGEN_BUNDLE=$PWD/.carry/peel_default timeout 200 python3 -m pytest tests/gpu -m gpu -q -x > "$R/pytest_default.log" 2>&1
tail -n 2 "$R/pytest_default.log"; grep -E "^FAILED" "$R/pytest_default.log" | head
echo "=== bench hopper (peeled vs shipped), 3 rounds"
timeout 280 python3 -m bench.attention --bundle .carry/peel_hopper --baseline .carry/hopper_cur --seqlens 512,1k,2k,4k,8k,16k \
  --head-dims 64,128,256 --causal both --repeats 3 --json "$R/bench_hopper.json" --table "$R/bench_hopper.txt" > "$R/bench_hopper.log" 2>&1
cat "$R/bench_hopper.txt"
