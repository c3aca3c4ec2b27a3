#!/usr/bin/env bash
# run 64: sweep19 (hd64 m128 block_n 112 with Q K^T a block ahead and the row sums from P V,
# where both S accumulators fit persistent) at 512-4k, both masks.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
for L in 512 1024 2048 4096; do
  timeout 80 python3 -m bench.tile_sweep --bundle .carry/sweep19 --seqlen $L --json "$R/sweep19_$L.json" > "$R/sweep19_$L.log" 2>&1
  grep -E "TFLOP" "$R/sweep19_$L.log" | sed -E 's/ +\(FA2.*diff/ diff/' 
done
