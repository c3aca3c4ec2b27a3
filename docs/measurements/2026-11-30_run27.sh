#!/usr/bin/env bash
# run 27: FA3 epilogue with full-sector O stores (quad shuffle) and the shared output helpers,
# against HEAD (the run-24 build).
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
echo "=== gpu tests: default"
FAGEN_BUNDLE=$PWD/.carry/default timeout 200 python3 -m pytest tests/gpu -m gpu -q -p no:cacheprovider --maxfail=5 2>&1 | tee "$R/pytest_default.log" | grep -E "passed|failed|error|FAIL" | tail -8
echo "=== bench hopper vs base"
timeout 200 python3 -m bench.attention --bundle .carry/hopper --baseline .carry/hopper_base --seqlens 512,1k,2k,4k,8k,16k \
  --head-dims 64,128,256 --causal both --json "$R/bench_hopper.json" --table "$R/bench_hopper.txt" --png "$R/bench_hopper.png" > "$R/bench_hopper.log" 2>&1
cat "$R/bench_hopper.txt"
