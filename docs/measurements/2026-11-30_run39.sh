#!/usr/bin/env bash
# run 39: the shipped state (kernels of 8236899, the adapter reusing prepared launches): GPU
# tests, host time per call, the hopper table with three rotating rounds per row, cold start.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
echo "=== GPU tests (default bundle)"
FAGEN_BUNDLE=$PWD/.carry/default timeout 240 python3 -m pytest tests/gpu -m gpu -q > "$R/pytest_default.log" 2>&1
tail -n 2 "$R/pytest_default.log"
echo "=== host time per call"
timeout 120 python3 -m bench.launch_overhead --bundle .carry/hopper --json "$R/overhead.json" 2>&1 | tee "$R/overhead.log"
echo "=== bench hopper, 3 rounds"
timeout 240 python3 -m bench.attention --bundle .carry/hopper --seqlens 512,1k,2k,4k,8k,16k \
  --head-dims 64,128,256 --causal both --repeats 3 --json "$R/bench_hopper.json" --table "$R/bench_hopper.txt" --png "$R/bench_hopper.png" > "$R/bench_hopper.log" 2>&1
cat "$R/bench_hopper.txt"
echo "=== cold start"
timeout 60 python3 -m bench.cold_start --bundle .carry/hopper --json "$R/cold_hopper.json" > "$R/cold_hopper.log" 2>&1; grep -E "total" "$R/cold_hopper.log"
