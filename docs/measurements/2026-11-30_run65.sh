#!/usr/bin/env bash
# run 65: the review mends (the ones chunk written through __cvta_shared_to_generic; same main
# loop, the prologue's registers reallocated in the four mma_row_sum kernels): GPU tests on the
# default bundle, then hd64 against the kernels of runs 62/63 in the same rows, 3 rounds.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
echo "=== GPU tests (default bundle)"
FAGEN_BUNDLE=$PWD/.carry/default timeout 110 python3 -m pytest tests/gpu -m gpu -q > "$R/pytest_default.log" 2>&1
tail -n 1 "$R/pytest_default.log"; grep -E "^FAILED" "$R/pytest_default.log" | head
timeout 200 python3 -m bench.attention --bundle .carry/mended --baseline .carry/hopper --seqlens 2k,4k,8k,16k \
  --head-dims 64 --causal both --repeats 3 --json "$R/bench_hopper.json" --table "$R/bench_hopper.txt" > "$R/bench_hopper.log" 2>&1
cat "$R/bench_hopper.txt"
