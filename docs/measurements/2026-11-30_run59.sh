#!/usr/bin/env bash
# run 59: sweep18 (hd64 m128 with Q K^T a block ahead, qk_ahead; block_n 96 and 128; with and
# without mma_row_sum) at 512-4k, both masks.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
for L in 512 1024 2048 4096; do
  timeout 80 python3 -m bench.tile_sweep --bundle .carry/sweep18 --seqlen $L --json "$R/sweep18_$L.json" > "$R/sweep18_$L.log" 2>&1
  grep -E "TFLOP" "$R/sweep18_$L.log" | sed -E 's/ +\(FA2.*diff/ diff/' 
done
