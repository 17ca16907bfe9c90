#!/usr/bin/env bash
# Multi-step decode (issue 18) on one H200, in one command that fits ~6 minutes:
#   bash scripts/gpu_multistep_runs.sh           # writes $OUT/*.json, *.log (OUT defaults to ./out_multistep)
#   ONLY="ab lat_auto" bash scripts/gpu_multistep_runs.sh      # a subset, by run name
# 1. ab: scripts/bench_multistep.py, ONE process and warm-up (cold: its warmup_s and the first request's TTFT are
#    what a user gets): TPOT / TTFT at batch 1, 8, 32 with K-step calls (the engine's choice) and with one step
#    per call, the TTFT of requests arriving while a K-step call runs (p50 / p99), multistep-vs-one-step token
#    agreement (pallas kernels, bf16), W throughput twice each way (alternating), compilations after warm-up.
# 2. the issue's commands: bench.py --latency with and without multi-step, batch 8 / 32, W A/B. They reuse the
#    first run's compilations through JAX's persistent cache ($OUT/jax_cache): their warmup_s are not cold.
# Every run has its own timeout; the script stops starting runs when BUDGET_S (default 380 s) is spent.
set -u
OUT=${OUT:-out_multistep}
BUDGET_S=${BUDGET_S:-380}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-1}
export JAX_COMPILATION_CACHE_DIR="$OUT/jax_cache"
T0=$(date +%s)

SHOW='tok/s|TTFT|TPOT|compil|warm-up|host |tokens:|arriving|W |latency|Error|error'
MIN_LEFT=30
. "$(dirname "$0")/gpu_runs_lib.sh"

nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$OUT/gpus.txt" 2>&1
run ab          170 python scripts/bench_multistep.py --json "$OUT/ab.json"
run lat_auto     45 python scripts/bench.py --latency --json "$OUT/lat_auto.json"
run lat_k1       45 python scripts/bench.py --latency --num-scheduler-steps 1 --json "$OUT/lat_k1.json"
run W_auto       50 python scripts/bench.py --json "$OUT/W_auto.json"
run W_k1         50 python scripts/bench.py --num-scheduler-steps 1 --json "$OUT/W_k1.json"
# extras while the budget lasts: the device loop as a static Python loop vs lax.fori_loop (K = 4 only: an unrolled
# K = 16 compiles far longer), then the issue's batch 8 / 32 commands (ab above has them too)
run fori4        60 python scripts/bench_multistep.py --loop fori --ks 4 --batches 1,8 --skip-throughput \
                     --json "$OUT/fori4.json"
run unroll4      90 python scripts/bench_multistep.py --loop unroll --ks 4 --batches 1,8 --skip-throughput \
                     --json "$OUT/unroll4.json"
run lat_b8       40 python scripts/bench.py --latency --latency-batch 8 --json "$OUT/lat_b8.json"
run lat_b32      40 python scripts/bench.py --latency --latency-batch 32 --json "$OUT/lat_b32.json"
rm -rf "$OUT/jax_cache"
echo "total $(( $(date +%s) - T0 )) s"
