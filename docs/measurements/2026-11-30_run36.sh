#!/usr/bin/env bash
# run 36: prepared launches reused across calls (host time per call), GPU tests on the default
# bundle, and the hopper bundle against the previous kernels in the same rows (3 rounds).
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
echo "=== host time per call"
timeout 120 python3 -m bench.launch_overhead --bundle .carry/hopper_new --profile "$R/profile.txt" --json "$R/overhead.json" 2>&1 | tee "$R/overhead.log"
echo "=== GPU tests (default bundle)"
FAGEN_BUNDLE=$PWD/.carry/default timeout 240 python3 -m pytest tests/gpu -m gpu -q > "$R/pytest_default.log" 2>&1
tail -n 3 "$R/pytest_default.log"
echo "=== bench hopper (new vs base), 3 rounds"
timeout 240 python3 -m bench.attention --bundle .carry/hopper_new --baseline .carry/hopper --seqlens 512,1k,2k,4k,8k,16k \
  --head-dims 64,128,256 --causal both --repeats 3 --json "$R/bench_hopper.json" --table "$R/bench_hopper.txt" > "$R/bench_hopper.log" 2>&1
cat "$R/bench_hopper.txt"
echo "=== cold start"
timeout 60 python3 -m bench.cold_start --bundle .carry/hopper_new --json "$R/cold_hopper.json" > "$R/cold_hopper.log" 2>&1; grep -E "total" "$R/cold_hopper.log"
