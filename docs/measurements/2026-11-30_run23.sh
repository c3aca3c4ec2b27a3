#!/usr/bin/env bash
# run 23: two CTAs per SM for one-consumer FA3 tiles (sweep11), numerics of every sweep11 kernel,
# GPU tests of the default bundle (manifest schema 2 with launch.ctas_per_sm).
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
echo "=== gpu tests: default"
FAGEN_BUNDLE=$PWD/.carry/default timeout 200 python3 -m pytest tests/gpu -m gpu -q -p no:cacheprovider --maxfail=5 2>&1 | tee "$R/pytest_default.log" | grep -E "passed|failed|error|FAIL" | tail -8
echo "=== every kernel of sweep11"
FAGEN_BUNDLE=$PWD/.carry/sweep11 timeout 120 python3 -m pytest tests/gpu/test_fa2_fwd.py -k every_kernel -m gpu -q -p no:cacheprovider 2>&1 | tee "$R/pytest_sweep11.log" | grep -E "passed|failed|error|FAIL" | tail -8
for s in 512 1024 2048 4096; do
  echo "=== sweep11 seqlen $s"
  timeout 100 python3 -m bench.tile_sweep --bundle .carry/sweep11 --seqlen $s --json "$R/sweep11_$s.json" > "$R/sweep11_$s.log" 2>&1
  cut -c1-100 "$R/sweep11_$s.log" | tail -20
done
