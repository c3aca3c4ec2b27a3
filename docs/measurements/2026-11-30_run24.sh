#!/usr/bin/env bash
# run 24: the final build of the session (HEAD) — GPU tests of the default bundle, the hopper
# bundle against SDPA-FA2/cuDNN with the session-start build (2c55bd7) timed in the same rows,
# cold start.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
echo "=== gpu tests: default"
FAGEN_BUNDLE=$PWD/.carry/default timeout 200 python3 -m pytest tests/gpu -m gpu -q -p no:cacheprovider --maxfail=5 2>&1 | tee "$R/pytest_default.log" | grep -E "passed|failed|error|FAIL" | tail -8
echo "=== cold start: hopper"
timeout 60 python3 -m bench.cold_start --bundle .carry/hopper --json "$R/cold_hopper.json" > "$R/cold_hopper.log" 2>&1; tail -6 "$R/cold_hopper.log"
echo "=== bench hopper vs session start"
timeout 200 python3 -m bench.attention --bundle .carry/hopper --baseline .carry/hopper_start --seqlens 512,1k,2k,4k,8k,16k \
  --head-dims 64,128,256 --causal both --json "$R/bench_hopper.json" --table "$R/bench_hopper.txt" --png "$R/bench_hopper.png" > "$R/bench_hopper.log" 2>&1
cat "$R/bench_hopper.txt"
