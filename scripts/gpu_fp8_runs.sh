#!/usr/bin/env bash
# FP8 KV cache on one H200 (issue 17), in one command that fits ~9.5 minutes:
#   bash scripts/gpu_fp8_runs.sh             # writes $OUT/fp8_runs.tgz (*.json, *.log; OUT defaults to ./out_fp8)
#   ONLY="tests w_fp8" bash scripts/gpu_fp8_runs.sh      # a subset, by run name
# Everything takes more than one 10-minute device command: run it as two,
#   ONLY="tests w_fp8 w_auto kernels" ...   then   ONLY="accuracy accuracy_demo sweep" ...
# Order: the compiled fp8 kernels against the reference (gpu-marked tests; they also show whether Triton
# compiles float8_e4m3fn loads on this jax), the kernel bench with its fp8 columns (TB/s of the bytes actually
# read; target >= 3.8 for the engine kernel), the W workload (nano-vllm's 256 requests) with kv_cache_dtype
# fp8 then auto on the same machine (target >= 40k tok/s fp8), the accuracy script (qwen3-0.6b random
# weights; the demo model too when it is shipped in jaxinfer/assets), and last the fp8 decode tile sweep
# (likely cut by the budget: run it alone with ONLY=sweep).
# Every run has its own timeout and the whole script stops starting runs when BUDGET_S (default 560 s) is spent.
set -u
OUT=${OUT:-out_fp8}
BUDGET_S=${BUDGET_S:-560}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-1}
T0=$(date +%s)

SHOW='wall_ms_per_step|passed|failed|Error|tok/s|compilations|roofline|floor is|TB/s|fp8 \(|greedy|bound /|^ *[0-9]+ +[0-9]+ \|'
MIN_LEFT=40
. "$(dirname "$0")/gpu_runs_lib.sh"

run tests        180 python -m pytest -q -m gpu tests/test_fp8_kernels.py tests/test_paged_attention.py \
                     tests/test_flash_attention.py
run w_fp8         95 python scripts/bench.py --kv-cache-dtype fp8 --json "$OUT/w_fp8.json"
run w_auto        95 python scripts/bench.py --json "$OUT/w_auto.json"
run kernels      140 python scripts/bench_kernels.py --quick --json "$OUT/kernels.json"
run accuracy     150 python scripts/fp8_accuracy.py qwen3-0.6b --tokens 2048 --json "$OUT/accuracy_06b.json"
if python -c "from jaxinfer.assets import demo_model_path; demo_model_path()" 2>/dev/null; then
  run accuracy_demo 90 python scripts/fp8_accuracy.py --tokens 4096 --json "$OUT/accuracy_demo.json"
fi
# item 4 (LLM() = the benchmarked configuration): the SKIP_TEMP command-buffer mode given per compile instead of
# through XLA_FLAGS (if it works, `LLM()` can run it without touching the process); 128-row steps, engine wall ms
PD="python scripts/probe_dispatch.py --steps 60 --no-process-flags"
run cb_env        60 env XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_TEMP $PD --json "$OUT/cb_env.json"
run cb_none       60 $PD --double-exe --json "$OUT/cb_none.json"
run cb_compile    60 $PD --compile-option xla_gpu_command_buffer_update_mode=SKIP_TEMP --json "$OUT/cb_compile.json"
# item 5 (bf16 speed): XLA's Triton GEMM fusion (off by default: its autotuning made warm-up slow) folds the
# per-layer elementwise kernels into the GEMMs; a 256-row and an 8-row decode step, engine wall ms per step
PT="python scripts/probe_dispatch.py --steps 60"
run tg_off        60 $PT --rows 256 --json "$OUT/tg_off.json"
run tg_on         90 $PT --rows 256 --compile-option xla_gpu_enable_triton_gemm=true --json "$OUT/tg_on.json"
run tg_on_r8      90 $PT --rows 8 --compile-option xla_gpu_enable_triton_gemm=true --json "$OUT/tg_on_r8.json"
run tg_off_r8     60 $PT --rows 8 --json "$OUT/tg_off_r8.json"
run sweep        150 python scripts/bench_kernels.py --only-sweep --decode-only --json "$OUT/sweep.json"
echo "total $(( $(date +%s) - T0 )) s"
# The device tool returns at most 8 files: everything goes back as one archive (PACK=0 keeps the loose files)
if [ "${PACK:-1}" = 1 ]; then
  pack=$(mktemp /tmp/fp8_runs.XXXXXX)
  tar -czf "$pack" -C "$OUT" . && rm -rf "${OUT:?}"/* && mv "$pack" "$OUT/fp8_runs.tgz"
  echo "results: $OUT/fp8_runs.tgz"
fi
