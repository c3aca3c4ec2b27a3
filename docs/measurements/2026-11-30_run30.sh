#!/usr/bin/env bash
# run 30: sweep14 (hd64 causal at 512 and 1k), numerics of every kernel.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
FAGEN_BUNDLE=$PWD/.carry/sweep14 timeout 100 python3 -m pytest tests/gpu/test_fa2_fwd.py -k every_kernel -m gpu -q -p no:cacheprovider 2>&1 | tee "$R/pytest_sweep14.log" | grep -E "passed|failed|error|FAIL" | tail -4
for s in 512 1024; do
  for rep in 1 2; do
    echo "=== sweep14 seqlen $s (repeat $rep)"
    timeout 100 python3 -m bench.tile_sweep --bundle .carry/sweep14 --seqlen $s --json "$R/sweep14_${s}_$rep.json" > "$R/sweep14_${s}_$rep.log" 2>&1
    cut -c1-100 "$R/sweep14_${s}_$rep.log" | tail -5
  done
done
