#!/usr/bin/env bash
# run 31: hd64 causal three-stage kernel for seqlen_k <= 512 in the default bundle: GPU tests, and
# the hd64 rows against the previous build.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
FAGEN_BUNDLE=$PWD/.carry/default timeout 200 python3 -m pytest tests/gpu -m gpu -q -p no:cacheprovider --maxfail=5 2>&1 | tee "$R/pytest_default.log" | grep -E "passed|failed|error|FAIL" | tail -4
timeout 100 python3 -m bench.attention --bundle .carry/hopper --baseline .carry/hopper_base --seqlens 512,1k,2k \
  --head-dims 64 --causal both --json "$R/bench_hopper_hd64.json" --table "$R/bench_hopper_hd64.txt" > "$R/bench_hopper_hd64.log" 2>&1
cat "$R/bench_hopper_hd64.txt"
