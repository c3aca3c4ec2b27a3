#!/usr/bin/env bash
# run 57: row sums from P V (mma_row_sum) on every hd64 kernel and hd128 causal: GPU tests on the
# default bundle with it, then A/B against the previous stop's kernels (hd64, hd128, both masks,
# 3 rounds), then sweep17 (hd128 non-causal block_n 128 with it) at 2k and 8k.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
echo "=== GPU tests (default bundle)"
FAGEN_BUNDLE=$PWD/.carry/default timeout 110 python3 -m pytest tests/gpu -m gpu -q -x > "$R/pytest_default.log" 2>&1
tail -n 1 "$R/pytest_default.log"; grep -E "^FAILED|^E " "$R/pytest_default.log" | head -20
timeout 330 python3 -m bench.attention --bundle .carry/hopper --baseline .carry/base_hopper --seqlens 512,1k,2k,4k,8k,16k \
  --head-dims 64,128 --causal both --repeats 3 --json "$R/bench_hopper.json" --table "$R/bench_hopper.txt" > "$R/bench_hopper.log" 2>&1
cat "$R/bench_hopper.txt"
for L in 2048 8192; do
  timeout 50 python3 -m bench.tile_sweep --bundle .carry/sweep17 --seqlen $L --json "$R/sweep17_$L.json" > "$R/sweep17_$L.log" 2>&1
  tail -n 8 "$R/sweep17_$L.log"
done
