#!/usr/bin/env bash
# run 34: per-row mask bounds + unsigned tile-index division (fewer instructions per tile):
# GPU tests on the new default bundle, then FA3 (hopper) and FA2 (ampere) against the previous
# build in the same rows (three rotating rounds for FA3).
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
echo "=== GPU tests (default bundle)"
FAGEN_BUNDLE=$PWD/.carry/default timeout 240 python3 -m pytest tests/gpu -m gpu -q -x > "$R/pytest_default.log" 2>&1
tail -n 3 "$R/pytest_default.log"
echo "=== bench hopper (new vs base), 3 rounds"
timeout 240 python3 -m bench.attention --bundle .carry/hopper_new --baseline .carry/hopper --seqlens 512,1k,2k,4k,8k,16k \
  --head-dims 64,128,256 --causal both --repeats 3 --json "$R/bench_hopper.json" --table "$R/bench_hopper.txt" > "$R/bench_hopper.log" 2>&1
cat "$R/bench_hopper.txt"
echo "=== bench ampere (new vs base)"
timeout 150 python3 -m bench.attention --bundle .carry/ampere --baseline .carry/ampere_base --seqlens 512,1k,2k,4k,8k,16k \
  --head-dims 64,128,256 --causal both --json "$R/bench_ampere.json" --table "$R/bench_ampere.txt" > "$R/bench_ampere.log" 2>&1
cat "$R/bench_ampere.txt"
