#!/usr/bin/env bash
# run 28: sweep13 (hd64 causal, hd128 non-causal after the epilogue fix), numerics of every kernel.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
echo "=== every kernel of sweep13"
FAGEN_BUNDLE=$PWD/.carry/sweep13 timeout 100 python3 -m pytest tests/gpu/test_fa2_fwd.py -k every_kernel -m gpu -q -p no:cacheprovider 2>&1 | tee "$R/pytest_sweep13.log" | grep -E "passed|failed|error|FAIL" | tail -8
for s in 512 1024 2048 4096 8192; do
  echo "=== sweep13 seqlen $s"
  timeout 100 python3 -m bench.tile_sweep --bundle .carry/sweep13 --seqlen $s --json "$R/sweep13_$s.json" > "$R/sweep13_$s.log" 2>&1
  cut -c1-100 "$R/sweep13_$s.log" | tail -9
done
