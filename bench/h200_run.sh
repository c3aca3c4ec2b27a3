#!/usr/bin/env bash
# One H200 call: GPU tests on every carried bundle, the tile/ablation sweep, the benchmark of
# the FA3 (hopper) and FA2 (ampere) bundles against SDPA, cold start. Bundles are built on the
# CPU machine into .carry/ (fagen build ... -o .carry/NAME) and carried; logs come back as
# $OUT/results.tgz (the device tool returns at most 8 files).
#   bash bench/h200_run.sh "hopper tricks tricks3" sweep2 "hopper ampere"
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
RESULTS=${OUT:?set OUT}
OUT=$(mktemp -d)
trap 'tar czf "$RESULTS/results.tgz" -C "$OUT" .' EXIT
TEST_BUNDLES=${1:-hopper}
SWEEP_BUNDLE=${2:-}
BENCH_BUNDLES=${3:-hopper}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
for b in $TEST_BUNDLES; do
    echo "=== gpu tests: $b"
    FAGEN_BUNDLE=$PWD/.carry/$b timeout 240 python3 -m pytest tests/gpu -m gpu -q -p no:cacheprovider \
        --maxfail=5 2>&1 | tee "$OUT/pytest_$b.log" | grep -E "passed|failed|error|FAIL" | tail -8
done
if [[ -n "$SWEEP_BUNDLE" ]]; then
    echo "=== sweep: $SWEEP_BUNDLE"
    timeout 200 python3 -m bench.tile_sweep --bundle ".carry/$SWEEP_BUNDLE" \
        --json "$OUT/sweep_$SWEEP_BUNDLE.json" 2>&1 | tee "$OUT/sweep_$SWEEP_BUNDLE.log"
fi
for b in $BENCH_BUNDLES; do
    echo "=== cold start: $b"
    timeout 60 python3 -m bench.cold_start --bundle ".carry/$b" --json "$OUT/cold_$b.json" 2>&1 | tail -6
    echo "=== benchmark: $b"
    timeout 150 python3 -m bench.attention --bundle ".carry/$b" --seqlens 512,1k,2k,4k,8k,16k \
        --head-dims 64,128,256 --causal both --json "$OUT/bench_$b.json" --png "$OUT/bench_$b.png" \
        --table "$OUT/bench_$b.txt" > "$OUT/bench_$b.log" 2>&1
    cat "$OUT/bench_$b.txt"
done
