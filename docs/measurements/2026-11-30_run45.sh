#!/usr/bin/env bash
# run 45: early_first_qk (as run 44) with two Q buffers, so that the next tile's Q is loaded a tile
# ahead instead of after the last Q K^T; hd64 m128n128 tiles only (hd256 has no room for a
# second Q). GPU tests on the default bundle, then the changed rows against
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
