#!/usr/bin/env bash
# run 46: sweep16 (early_first_qk at 2-4 K/V stages next to the shipped hd64 tiles), two passes
# per seqlen so that a single slow sample shows.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
for pass in 1 2; do
  for L in 512 1024 2048 4096; do
    echo "=== pass $pass seqlen $L"
    timeout 60 python3 -m bench.tile_sweep --bundle .carry/sweep16 --seqlen $L --json "$R/sweep16_${L}_p${pass}.json" > "$R/sweep16_${L}_p${pass}.txt" 2>&1
    grep -E "m128n128" "$R/sweep16_${L}_p${pass}.txt"
  done
done
