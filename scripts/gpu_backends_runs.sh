#!/usr/bin/env bash
# The cuDNN and Triton attention backends on one H200 (issue 20, items 2-6), by run name:
#   ONLY="setup tests probe" bash scripts/gpu_backends_runs.sh          # ~5 min
#   ONLY="setup kernels" bash scripts/gpu_backends_runs.sh              # ~5 min
#   ONLY="setup w_cudnn w_triton" bash scripts/gpu_backends_runs.sh     # ~5 min
#   ONLY="setup notebook" bash scripts/gpu_backends_runs.sh             # ~6 min; executes the notebook in place
#   ONLY="w_mosaic xla_fusion" bash scripts/gpu_backends_runs.sh        # ~6 min; W with both Mosaic kernels (issue
#                                                                       # 21), the xla backend's GPU fusions
#   ONLY="xla_fusion w_xla_fp8" bash scripts/gpu_backends_runs.sh      # ~6 min; the xla decode forms timed (incl.
#                                                                       # "mixed"), W on xla with fp8 pages
#   ONLY="probe_chunks w_xla" bash scripts/gpu_backends_runs.sh         # ~3 min; the chunked xla decode against
#                                                                       # einsum (scripts/probe_xla_chunks.py), W on xla
# (the device machine takes 10-minute commands: run them one by one). Results: $OUT (default out_backends)
# *.json, *.log and the executed notebook (copy them to scripts/results/ and notebooks/ here). Run the W runs
# first and commit their JSON, so the notebook's W section finds them. Needs .whl/ carried along: jax-triton
# 0.3.1 and matplotlib's wheels are installed (--no-deps) into $DEPS, which is put on PYTHONPATH.
set -u
OUT=${OUT:-out_backends}
DEPS=${DEPS:-/tmp/jaxinfer_deps}
BUDGET_S=${BUDGET_S:-570}
mkdir -p "$OUT"
export PYTHONPATH="$DEPS:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-1}
# jaxlib runs a `ptxas` program to load jax-triton kernels, and the GPU machine has none on PATH: triton's own
TRITON_BIN=$(python -c "import os, triton; print(os.path.join(os.path.dirname(triton.__file__), 'backends/nvidia/bin'))" 2>/dev/null)
# appended, and only without one: Mosaic GPU builds with the first ptxas on PATH, and triton's (CUDA 12.8) miscompiles
# the Mosaic prefill (pallas_kernels/mosaic/ptxas.py)
command -v ptxas >/dev/null || { [ -x "$TRITON_BIN/ptxas" ] && export PATH="$PATH:$TRITON_BIN"; }
T0=$(date +%s)
SHOW='passed|failed|Error|error|tok/s|warm-up|TB/s|TFLOP/s|us a program|FAILED|skipping|trace:|^ *[0-9]+ +[0-9]+ \||run_notebook'
MIN_LEFT=30
. "$(dirname "$0")/gpu_runs_lib.sh"

# (matplotlib's wheels only when carried: without them the notebook run alone cannot plot)
run setup     60 python -m pip install -q --no-deps --no-index --target "$DEPS" .whl/jax_triton-0.3.1-py3-none-any.whl \
                  $(ls .whl/notebook/*.whl 2>/dev/null)
run tests    300 python -m pytest -q -rs -m gpu tests/test_backends.py
run probe    240 python scripts/probe_triton_call.py --json "$OUT/probe_triton_call.json" --trace "$OUT/traces"
run kernels  480 python scripts/bench_kernels.py --quick --json scripts/results/h200_kernels_four_backends.json
run w_cudnn  280 python scripts/bench.py --attn-backend cudnn --json scripts/results/h200_w_backend_cudnn.json
run w_triton 280 python scripts/bench.py --attn-backend triton --json scripts/results/h200_w_backend_triton.json
run w_mosaic 200 python scripts/bench.py --attn-backend mosaic --json scripts/results/h200_w_backend_mosaic.json
run probe_chunks 90 python scripts/probe_xla_chunks.py --json "$OUT/probe_xla_chunks.json"
run w_xla    220 python scripts/bench.py --attn-backend xla --json scripts/results/h200_w_backend_xla.json
run xla_fusion 240 python scripts/xla_fusion_report.py --batch 256 --json "$OUT/xla_fusion.json" --time
run w_xla_fp8 280 python scripts/bench.py --attn-backend xla --kv-cache-dtype fp8 --json "$OUT/w_xla_fp8.json"
run notebook 560 python scripts/run_notebook.py notebooks/xla_vs_pallas.ipynb -o "$OUT/xla_vs_pallas.ipynb"
cp -f scripts/results/h200_kernels_four_backends.json scripts/results/h200_w_backend_*.json "$OUT"/ 2>/dev/null
echo "== done in $(( $(date +%s) - T0 )) s; logs in $OUT"
