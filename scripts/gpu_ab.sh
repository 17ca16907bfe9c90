#!/usr/bin/env bash
# One device call's worth of A/B runs of the throughput benchmark on the GPU machine (each ~1 minute):
#   bash scripts/gpu_ab.sh OUT_DIR
# Writes OUT_DIR/<name>.json and .log for: the default engine, per-layer weight arrays, Triton GEMMs,
# latency with per-layer weights, the HF transformers peer on a subset, and the step anatomy.
set -u
out=${1:-/tmp/ab}; mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
b=scripts/bench.py
run() { name=$1; shift; timeout 170 "$@" --json "$out/$name.json" 2>&1 | grep -v -i warn > "$out/$name.log"; tail -6 "$out/$name.log"; }
run default python $b
run unstacked python $b --unstack-weights
XLA_FLAGS=--xla_gpu_enable_triton_gemm=true run triton_gemm python $b --decode-buckets 256 --prefill-buckets 16384
run latency_unstacked python $b --latency --unstack-weights --max-num-seqs 1 --decode-buckets 1 \
    --prefill-buckets 64,1024 --max-num-batched-tokens 1024
run peer python $b --peer hf --peer-num-seqs 64 --peer-max-tokens 256
for w in "" --unstack-weights; do       # where one decode step's time goes (batch 256 and 1, 1k context)
  run "anatomy256${w}" python scripts/bench_step.py --batch 256 $w
  run "anatomy1${w}" python scripts/bench_step.py --batch 1 $w
done
