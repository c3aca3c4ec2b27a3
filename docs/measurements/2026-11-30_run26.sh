#!/usr/bin/env bash
# run 26: hd64 with exp2 emulation / conditional rescale (sweep12), numerics of every kernel.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
echo "=== every kernel of sweep12"
FAGEN_BUNDLE=$PWD/.carry/sweep12 timeout 120 python3 -m pytest tests/gpu/test_fa2_fwd.py -k every_kernel -m gpu -q -p no:cacheprovider 2>&1 | tee "$R/pytest_sweep12.log" | grep -E "passed|failed|error|FAIL" | tail -8
for s in 1024 2048 4096 8192; do
  echo "=== sweep12 seqlen $s"
  timeout 100 python3 -m bench.tile_sweep --bundle .carry/sweep12 --seqlen $s --json "$R/sweep12_$s.json" > "$R/sweep12_$s.log" 2>&1
  cut -c1-100 "$R/sweep12_$s.log" | tail -12
done
