#!/usr/bin/env bash
# run 32: sweep15 (hd128 non-causal block_n 176, hd64 causal block_n 64) at 512-8k, then the
# shipped hopper bundle against SDPA-FA2 and cuDNN with three rotating rounds per row.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > "$R/gpu.txt"
for s in 512 1024 2048 4096 8192; do
  echo "=== sweep15 $s"
  timeout 100 python3 -m bench.tile_sweep --bundle .carry/sweep15 --seqlen $s --json "$R/sweep15_$s.json" > "$R/sweep15_$s.log" 2>&1
  tail -n 12 "$R/sweep15_$s.log"
done
echo "=== bench hopper, 3 rounds"
timeout 330 python3 -m bench.attention --bundle .carry/hopper --seqlens 512,1k,2k,4k,8k,16k \
  --head-dims 64,128,256 --causal both --repeats 3 --json "$R/bench_hopper.json" --table "$R/bench_hopper.txt" > "$R/bench_hopper.log" 2>&1
cat "$R/bench_hopper.txt"
