#!/usr/bin/env bash
# run 63: a second sample of the shipped state of this stop (commit 77d152f: mma_row_sum on the hd64 three-consumer
# kernels): GPU tests on the default bundle, then every row, 5 rounds per row (run 62 again).
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
echo "=== GPU tests (default bundle)"
FAGEN_BUNDLE=$PWD/.carry/default timeout 110 python3 -m pytest tests/gpu -m gpu -q > "$R/pytest_default.log" 2>&1
tail -n 1 "$R/pytest_default.log"; grep -E "^FAILED" "$R/pytest_default.log" | head
timeout 400 python3 -m bench.attention --bundle .carry/hopper --seqlens 512,1k,2k,4k,8k,16k \
  --head-dims 64,128,256 --causal both --repeats 5 --json "$R/bench_hopper.json" --table "$R/bench_hopper.txt" > "$R/bench_hopper.log" 2>&1
cat "$R/bench_hopper.txt"
