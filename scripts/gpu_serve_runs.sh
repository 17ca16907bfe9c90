#!/usr/bin/env bash
# The server targets of issue 19 on one H200, in one command that fits ~8 minutes:
#   bash scripts/gpu_serve_runs.sh              # writes $OUT/*.json, *.log (OUT defaults to ./out_serve)
#   ONLY="overload" bash scripts/gpu_serve_runs.sh
# 1. overload: bench_serve.py starts the server with --max-waiting-requests 64, runs 256 streams (the baseline),
#    then 512 streams (2x) against the bound: every request must complete or get an immediate 503
#    ("... -> OK": 0 errors, 0 lost tokens, completed + refused = requests, every 503 in < 1 s).
# 2. extras: one server; 256 streams of W plain, then with logprobs=5, then with penalties (each extra run twice:
#    the first compiles the step variants, the second is the number). Targets: logprobs <= 10% and penalties
#    <= 5% below plain (output tok/s of the second runs). API_COUNT=2: two API processes (logprobs are ~25 us of
#    Python per streamed token in the API process).
# Needs the server wheels: bash scripts/fetch_server_wheels.sh here first (.whl/ travels with the tree).
# A CPU smoke run of this script (tiny model, bench_serve --quick loads): MODEL=DIR CONC=8 OVER=16 \
#   ENGINE='{"max_num_seqs": 8, "max_model_len": 128}' BENCH_ARGS=--quick bash scripts/gpu_serve_runs.sh
set -u
MODEL=${MODEL:-qwen3-0.6b}; ENGINE=${ENGINE:-'{}'}; CONC=${CONC:-256}; OVER=${OVER:-512}; NPROMPTS=${NPROMPTS:-512}
BENCH_ARGS=${BENCH_ARGS:-}
OUT=${OUT:-out_serve}
BUDGET_S=${BUDGET_S:-480}
mkdir -p "$OUT"
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > "$OUT/pip.log" 2>&1 || { echo "wheel install failed:"; tail -5 "$OUT/pip.log"; }
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-1}
export JAX_COMPILATION_CACHE_DIR="$OUT/jax_cache"
T0=$(date +%s)
SHOW='tok/s|overload|requests =|jaxinfer:|server exit|Error|error|FAIL'
MIN_LEFT=30
. "$(dirname "$0")/gpu_runs_lib.sh"

run overload 300 python scripts/bench_serve.py "$MODEL" --engine "$ENGINE" --concurrency $CONC --request-rates "" \
    --num-prompts $NPROMPTS --overload $OVER --max-waiting-requests 64 --no-offline --json "$OUT/overload.json" $BENCH_ARGS

extras() {      # one server, several loads against it
  local port=8011 url=http://127.0.0.1:8011
  python -m jaxinfer.server "$MODEL" --engine "$ENGINE" --port $port --served-model-name bench --log-level warning \
    --api-server-count ${API_COUNT:-1} &
  local pid=$!
  python3 -c "
import time, urllib.request
for _ in range(300):
    try:
        urllib.request.urlopen('$url/health', timeout=2); break
    except Exception:
        time.sleep(1)"
  local b=(python scripts/bench_serve.py --url "$url" --concurrency $CONC --request-rates "" --num-prompts $NPROMPTS
           $BENCH_ARGS)
  local pen='{"frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.1}'
  "${b[@]}" --json "$OUT/plain.json"
  "${b[@]}" --extra-body '{"logprobs": 5}' --json "$OUT/logprobs5_warm.json"
  "${b[@]}" --extra-body '{"logprobs": 5}' --json "$OUT/logprobs5.json"
  "${b[@]}" --extra-body "$pen" --json "$OUT/penalties_warm.json"
  "${b[@]}" --extra-body "$pen" --json "$OUT/penalties.json"
  python3 -c "
import urllib.request
for ln in urllib.request.urlopen('$url/metrics').read().decode().splitlines():
    if ln.startswith(('jaxinfer:num_', 'jaxinfer:kv_', 'jaxinfer:generation', 'jaxinfer:e2e_request_latency_seconds_count')):
        print(ln)"
  kill -TERM $pid; wait $pid; echo "server exit $?"
}
API_COUNT=${API_COUNT:-1}
export OUT MODEL ENGINE CONC NPROMPTS BENCH_ARGS API_COUNT
export -f extras
run extras 330 bash -c extras
python3 - "$OUT" <<'EOF' || true
import json, os, sys
out = sys.argv[1]
def tok(name):
    p = os.path.join(out, name + ".json")
    return json.load(open(p))["levels"][-1]["output_tok_s"] if os.path.exists(p) else None
plain = tok("plain")
for name, target in (("logprobs5", 0.10), ("penalties", 0.05)):
    t = tok(name)
    if plain and t:
        print(f"{name}: {t:.0f} vs plain {plain:.0f} tok/s: {1 - t / plain:+.1%} slower (target <= {target:.0%})")
ov = os.path.join(out, "overload.json")
if os.path.exists(ov):
    o = json.load(open(ov)).get("overload", {})
    print("overload:", {k: o.get(k) for k in ("requests", "completed", "rejected_503", "errors", "lost_tokens", "ok")},
          "503 ms:", o.get("rejected_ms"))
EOF
rm -rf "$OUT/jax_cache"
echo "total $(( $(date +%s) - T0 )) s"
