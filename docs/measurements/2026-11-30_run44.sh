#!/usr/bin/env bash
# run 44: early_first_qk on the hd64 m128n128 tiles (causal <= 4k, non-causal <= 1k) and the
# hd256 causal <= 512 tile: each tile's first Q K^T issued before the previous tile's epilogue,
# into a second S accumulator. GPU tests on the default bundle, then the changed rows against
# the previous kernels in the same rows (3 rounds).
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
echo "=== GPU tests (default bundle)"
FAGEN_BUNDLE=$PWD/.carry/default timeout 240 python3 -m pytest tests/gpu -m gpu -q > "$R/pytest_default.log" 2>&1
tail -n 2 "$R/pytest_default.log"; grep -E "^FAILED" "$R/pytest_default.log" | head
echo "=== bench hd64 (new vs base), 3 rounds"
timeout 150 python3 -m bench.attention --bundle .carry/hopper_new --baseline .carry/hopper_base --seqlens 512,1k,2k,4k,8k,16k \
  --head-dims 64 --causal both --repeats 3 --json "$R/bench_hd64.json" --table "$R/bench_hd64.txt" > "$R/bench_hd64.log" 2>&1
cat "$R/bench_hd64.txt"
echo "=== bench hd256 causal 512-1k (new vs base), 3 rounds"
timeout 60 python3 -m bench.attention --bundle .carry/hopper_new --baseline .carry/hopper_base --seqlens 512,1k \
  --head-dims 256 --causal yes --repeats 3 --json "$R/bench_hd256.json" --table "$R/bench_hd256.txt" > "$R/bench_hd256.log" 2>&1
cat "$R/bench_hd256.txt"
