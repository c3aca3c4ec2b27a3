#!/usr/bin/env bash
# Everything the GPU machine runs, in one go: GPU tests, cold start, benchmark.
#   bash bench/device_run.sh BUNDLE_DIR        (from the repository root; writes to $OUT)
# fagen is not pip-installed there and pydantic is absent: PYTHONPATH points at the checkout and
# only the runtime path (bundle format, driver, torch adapter) is imported.
# Stages keep going after a failure so one call gives every result; the exit status is the
# first failure's.
set -uo pipefail

BUNDLE=$(realpath "${1:?usage: bench/device_run.sh BUNDLE_DIR}")
OUT=${OUT:?set OUT to the output directory}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export FAGEN_BUNDLE="$BUNDLE"
PY=python3
status=0
summary=()

stage() {  # stage NAME LOGFILE TIMEOUT_S COMMAND...
    local name=$1 log=$2 limit=$3
    shift 3
    echo "=== $name: $*" | tee "$OUT/$log"
    local start=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee -a "$OUT/$log"
    local rc=${PIPESTATUS[0]}
    summary+=("$name: rc=$rc ($((SECONDS - start)) s)")
    if [[ $rc -ne 0 && $status -eq 0 ]]; then status=$rc; fi
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    $PY -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
    $PY -c "import cuda.bindings; print('cuda-bindings', cuda.bindings.__version__)"
    $PY -c "import triton; print('triton', triton.__version__)" || true
    echo "bundle $BUNDLE"
    $PY -c "import sys, fagen.runtime as rt; b = rt.load(sys.argv[1]); print(b, 'archs', sorted({e.arch for e in b.kernels}))" "$BUNDLE"
} 2>&1 | tee "$OUT/env.log"

stage "gpu tests" pytest.log 270 $PY -m pytest tests/gpu -m gpu -q -x -p no:cacheprovider
stage "cold start" cold_start.log 60 $PY -m bench.cold_start --bundle "$BUNDLE" --json "$OUT/cold_start.json"
stage "benchmark" bench.log 240 $PY -m bench.attention --bundle "$BUNDLE" \
    --seqlens 512,1k,2k,4k,8k,16k --head-dims 64,128,256 --causal both \
    --json "$OUT/bench.json" --png "$OUT/bench.png" --table "$OUT/bench_table.txt"

echo
printf '%s\n' "${summary[@]}"
echo
[[ -f "$OUT/bench_table.txt" ]] && cat "$OUT/bench_table.txt"
exit $status
