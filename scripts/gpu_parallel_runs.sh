#!/usr/bin/env bash
# Tensor / data parallelism on nvidia-h200-x2 (issue 16), in one command that fits ~9 minutes:
#   bash scripts/gpu_parallel_runs.sh            # writes $OUT/*.json, *.log (OUT defaults to ./out_parallel)
#   ONLY="check 8b_tp1 8b_tp2" bash scripts/gpu_parallel_runs.sh     # a subset, by run name
# Order: the correctness check first (tp=2 / dp=2 greedy tokens == tp=1, seeded tp=2 == tp=1, on a tiny fp32
# checkpoint, pallas backend), then the W workload (nano-vllm's 256 requests) for Qwen3-8B TP1 / TP2, Qwen3-0.6B
# on 1 GPU / DP2 / TP2 (with a profile), Qwen3-32B TP2, and batch-1 latency (TPOT) for 8B TP1 / TP2.
# Every run has its own timeout and the whole script stops starting runs when BUDGET_S (default 530 s) is spent.
# Shorter than the default workload: the latency runs decode 128 tokens (not 256); everything else is W as is.
# The latency runs reuse the W runs' compiled steps through JAX's persistent cache ($OUT/jax_cache), so their
# warm-up is not a cold one; the W runs' warmup_s are cold.
set -u
OUT=${OUT:-out_parallel}
BUDGET_S=${BUDGET_S:-530}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-1}
T0=$(date +%s)

SHOW='us_per_all_reduce|tok/s|TTFT|TPOT|compilations|roofline|floor is|host ms per step|latency|== |OK|MISMATCH|Error|error'
MIN_LEFT=40
. "$(dirname "$0")/gpu_runs_lib.sh"

nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$OUT/gpus.txt" 2>&1
nvidia-smi topo -m >> "$OUT/gpus.txt" 2>&1

run check        120 python scripts/check_parallel.py --backends pallas --json "$OUT/check.json"
C="env JAX_COMPILATION_CACHE_DIR=$OUT/jax_cache"     # 8B: the latency runs reuse the W runs' compilations
run 8b_tp1       110 $C python scripts/bench.py qwen3-8b --json "$OUT/8b_tp1.json" \
                     --step-log "$OUT/8b_tp1_steps.json"
run 8b_tp2       240 $C python scripts/bench.py qwen3-8b -tp 2 --json "$OUT/8b_tp2.json" \
                     --step-log "$OUT/8b_tp2_steps.json"
run 06b_1gpu      90 python scripts/bench.py qwen3-0.6b --json "$OUT/06b_1gpu.json"
run 06b_dp2      120 python scripts/bench.py qwen3-0.6b -dp 2 --json "$OUT/06b_dp2.json" \
                     --step-log "$OUT/06b_dp2_steps.json"
run 32b_tp2      330 python scripts/bench.py qwen3-32b -tp 2 --json "$OUT/32b_tp2.json"
run 8b_tp1_lat    90 $C python scripts/bench.py qwen3-8b --latency --latency-output 128 --json "$OUT/8b_tp1_lat.json"
run 8b_tp2_lat   120 $C python scripts/bench.py qwen3-8b -tp 2 --latency --latency-output 128 \
                     --json "$OUT/8b_tp2_lat.json"
run 06b_tp2      120 python scripts/bench.py qwen3-0.6b -tp 2 --json "$OUT/06b_tp2.json"
# the same with a device trace (tracing W whole took longer than 140 s on 2xH200: give it room)
run 06b_tp2_prof 240 python scripts/bench.py qwen3-0.6b -tp 2 --json "$OUT/06b_tp2_prof.json" \
                     --profile "$OUT/trace_06b_tp2"
# dp=2 with 3 timed repeats (median wall: the run-to-run spread of one machine is ~3%)
run 06b_dp2_rep  150 python scripts/bench.py qwen3-0.6b -dp 2 --repeats 3 --json "$OUT/06b_dp2_rep.json"
# where an 8B tp=2 step's time goes, per GPU (trace_summary: collective / gemm / attention / other, idle);
# outputs of up to 128 tokens keep the trace small, at W's 256 rows
run 8b_tp2_prof  240 python scripts/bench.py qwen3-8b -tp 2 --max-output-len 128 --json "$OUT/8b_tp2_prof.json" \
                     --profile "$OUT/trace_8b_tp2"
# dp=2 with K-step calls at its 128-row bucket (probe only: the engine compiles K-step variants for <= 8 rows)
run dp2_k4        90 python scripts/probe_dispatch.py --dp 2 --rows 128 --steps 60 --steps-per-call 4 \
                     --json "$OUT/dp2_k4.json"
run dp2_k1        90 python scripts/probe_dispatch.py --dp 2 --rows 128 --steps 60 --json "$OUT/dp2_k1.json"
# extras, if the budget allows (or ONLY=...): W has 256 requests, so DP2 halves each GPU's batch; the same
# per-GPU load (512 requests on 2 GPUs vs 256 on 1... and 512 on 1) shows how DP scales apart from batch size
run 06b_1gpu_512  60 python scripts/bench.py qwen3-0.6b --num-seqs 512 --json "$OUT/06b_1gpu_512.json"
run 06b_dp2_512   75 python scripts/bench.py qwen3-0.6b -dp 2 --num-seqs 512 --json "$OUT/06b_dp2_512.json"
# the all-reduce cost of an 8B tp=2 step (72 x 2 MiB) and NCCL's protocol knobs (read when its comms start)
AR="python scripts/probe_allreduce.py --rows 256 --hidden 4096 --layers 36"
run ar_default    40 $AR --json "$OUT/ar_default.json"
run ar_ll128      40 env NCCL_PROTO=LL128 $AR --json "$OUT/ar_ll128.json"
run ar_ll         40 env NCCL_PROTO=LL $AR --json "$OUT/ar_ll.json"
run ar_oneshot    40 $AR --one-shot --json "$OUT/ar_oneshot.json"
rm -rf "$OUT/jax_cache" "$OUT/trace_06b_tp2" "$OUT/trace_8b_tp2"   # large; the summaries are in the JSON
echo "total $(( $(date +%s) - T0 )) s"
