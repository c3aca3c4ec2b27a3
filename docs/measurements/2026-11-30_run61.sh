#!/usr/bin/env bash
# run 61: is the benchmark's order biased? Identical fagen kernels measured 0.96-1.03 against
# themselves (median ~0.985) in the A/B runs 57-60, the copy in the "fagen" slot slower; in the
# rotation that slot follows cuDNN in two of three rounds. Random orders, per-predecessor medians.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
timeout 300 python3 .carry/slot_bias.py .carry/hopper "$R/slot_bias.json" 2>&1 | tee "$R/slot_bias.log" | grep -v Warning
