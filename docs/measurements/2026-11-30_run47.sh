#!/usr/bin/env bash
# run 47: (a) the consumer index made warp-uniform (main loops 6-24 instructions shorter at head
# dims 128/256); (b) early_first_qk with the shipped main loop (hd64 m128n128 rows). GPU tests on
# the default bundle; sweep16 (early_first_qk next to the same tiles without it); every row
# against the kernels of the previous stop (3 rounds).
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
echo "=== GPU tests (default bundle)"
FAGEN_BUNDLE=$PWD/.carry/default timeout 240 python3 -m pytest tests/gpu -m gpu -q > "$R/pytest_default.log" 2>&1
tail -n 2 "$R/pytest_default.log"; grep -E "^FAILED" "$R/pytest_default.log" | head
for L in 512 1024 2048 4096; do
  echo "=== sweep16 seqlen $L"
  timeout 60 python3 -m bench.tile_sweep --bundle .carry/sweep16 --seqlen $L --json "$R/sweep16_${L}.json" > "$R/sweep16_${L}.txt" 2>&1
  grep -E "m128n128" "$R/sweep16_${L}.txt" | cut -c1-100
done
echo "=== bench hopper (new vs base), 3 rounds"
timeout 280 python3 -m bench.attention --bundle .carry/hopper_new --baseline .carry/hopper_base --seqlens 512,1k,2k,4k,8k,16k \
  --head-dims 64,128,256 --causal both --repeats 3 --json "$R/bench_hopper.json" --table "$R/bench_hopper.txt" > "$R/bench_hopper.log" 2>&1
cat "$R/bench_hopper.txt"
