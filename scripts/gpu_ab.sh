#!/usr/bin/env bash
# The A/B runs the next GPU session should make, in two device calls of ~5 minutes each:
#   bash scripts/gpu_ab.sh OUT_DIR bench     # default vs per-layer weights vs Triton GEMMs; latency; HF peer
#   bash scripts/gpu_ab.sh OUT_DIR anatomy   # where one decode step's time goes (batch 256 and 1, 1k context)
# Writes OUT_DIR/<name>.json and .log per run.
set -u
out=${1:-/tmp/ab}; part=${2:-bench}; mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
b=scripts/bench.py
run() { name=$1; shift; timeout 170 "$@" --json "$out/$name.json" 2>&1 | grep -v -i warn > "$out/$name.log"; tail -6 "$out/$name.log"; }
if [ "$part" = bench ]; then
  run default python $b
  run unstacked python $b --unstack-weights
  # compare with the cuBLAS run of the same two buckets: 11,623 tok/s (2026-11-29)
  XLA_FLAGS=--xla_gpu_enable_triton_gemm=true run triton_gemm python $b --decode-buckets 256 --prefill-buckets 16384
  run latency_unstacked python $b --latency --unstack-weights --max-num-seqs 1 --decode-buckets 1 \
      --prefill-buckets 64,1024 --max-num-batched-tokens 1024
  run peer python $b --peer hf --peer-num-seqs 64 --peer-max-tokens 256
else
  for w in "" --unstack-weights; do
    run "anatomy256${w}" python scripts/bench_step.py --batch 256 $w
    run "anatomy1${w}" python scripts/bench_step.py --batch 1 $w
  done
fi
