#!/usr/bin/env bash
# run 40: causal persistent kernels split the last one to two rounds of pair items into single
# tiles, heaviest first in snake order (algo/tile_scheduler.cuh): GPU tests on the default
# bundle, then the causal rows against the previous kernels in the same rows (3 rounds).
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
echo "=== GPU tests (default bundle)"
FAGEN_BUNDLE=$PWD/.carry/default timeout 240 python3 -m pytest tests/gpu -m gpu -q > "$R/pytest_default.log" 2>&1
tail -n 2 "$R/pytest_default.log"; grep -E "^FAILED" "$R/pytest_default.log" | head
echo "=== host time per call"
timeout 60 python3 -m bench.launch_overhead --bundle .carry/hopper_new --json "$R/overhead.json" 2>&1 | tee "$R/overhead.log"
echo "=== bench hopper causal (new vs base), 3 rounds"
timeout 200 python3 -m bench.attention --bundle .carry/hopper_new --baseline .carry/hopper --seqlens 512,1k,2k,4k,8k,16k \
  --head-dims 64,128,256 --causal yes --repeats 3 --json "$R/bench_hopper.json" --table "$R/bench_hopper.txt" > "$R/bench_hopper.log" 2>&1
cat "$R/bench_hopper.txt"
