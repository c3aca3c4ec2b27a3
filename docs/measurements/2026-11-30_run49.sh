#!/usr/bin/env bash
# run 49: the final bundle: hd64 non-causal <= 512 takes early_first_qk with three K/V stages,
# <= 1k keeps the previous kernel. GPU tests on the default bundle; hd64 non-causal 512 and 1k
# against the previous stop's kernels (3 rounds).
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
echo "=== GPU tests (default bundle)"
FAGEN_BUNDLE=$PWD/.carry/default timeout 240 python3 -m pytest tests/gpu -m gpu -q > "$R/pytest_default.log" 2>&1
tail -n 2 "$R/pytest_default.log"; grep -E "^FAILED" "$R/pytest_default.log" | head
echo "=== bench hd64 non-causal 512-1k (new vs base), 3 rounds"
timeout 100 python3 -m bench.attention --bundle .carry/hopper_new --baseline .carry/hopper_base --seqlens 512,1k \
  --head-dims 64 --causal no --repeats 3 --json "$R/bench_hd64.json" --table "$R/bench_hd64.txt" > "$R/bench_hd64.log" 2>&1
cat "$R/bench_hd64.txt"
