#!/usr/bin/env bash
# run 35: host time per call of fagen's torch adapter against SDPA (and where fagen's goes).
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
timeout 120 python3 -m bench.launch_overhead --bundle .carry/hopper_new --profile "$R/profile.txt" --json "$R/overhead.json" 2>&1 | tee "$R/overhead.log"
head -60 "$R/profile.txt"
