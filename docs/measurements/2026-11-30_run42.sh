#!/usr/bin/env bash
# run 42: the state after the review mends (FA2/FA3 SASS identical to run 27's; the adapter
# resolving the raw-stream query once): GPU tests, host time per call.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
echo "=== GPU tests (default bundle)"
FAGEN_BUNDLE=$PWD/.carry/default timeout 240 python3 -m pytest tests/gpu -m gpu -q > "$R/pytest_default.log" 2>&1
tail -n 2 "$R/pytest_default.log"; grep -E "^FAILED" "$R/pytest_default.log" | head
echo "=== host time per call"
timeout 60 python3 -m bench.launch_overhead --bundle .carry/hopper --json "$R/overhead.json" 2>&1 | tee "$R/overhead.log"
