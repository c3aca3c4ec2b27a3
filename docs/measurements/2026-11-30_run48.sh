#!/usr/bin/env bash
# run 48: the shipped candidate: hd64 non-causal <= 1k takes early_first_qk with three K/V stages
# (every other kernel byte-identical in SASS to the previous stop). GPU tests on the default
# bundle, then every row against the previous stop's kernels in the same rows (3 rounds).
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
echo "=== GPU tests (default bundle)"
FAGEN_BUNDLE=$PWD/.carry/default timeout 240 python3 -m pytest tests/gpu -m gpu -q > "$R/pytest_default.log" 2>&1
tail -n 2 "$R/pytest_default.log"; grep -E "^FAILED" "$R/pytest_default.log" | head
echo "=== bench hopper (new vs base), 3 rounds"
timeout 280 python3 -m bench.attention --bundle .carry/hopper_new --baseline .carry/hopper_base --seqlens 512,1k,2k,4k,8k,16k \
  --head-dims 64,128,256 --causal both --repeats 3 --json "$R/bench_hopper.json" --table "$R/bench_hopper.txt" > "$R/bench_hopper.log" 2>&1
cat "$R/bench_hopper.txt"
