"""Serving benchmark, modelled on vLLM's: the HTTP server under load, then the same requests offline.

    python scripts/bench_serve.py                          # qwen3-0.6b preset (random weights), engine defaults
    python scripts/bench_serve.py qwen3-0.6b --concurrency 1,16,64,256 --request-rates 8,32 --client-procs 4
    python scripts/bench_serve.py --url http://127.0.0.1:8000 --served-model-name M   # a running server
    python scripts/bench_serve.py --quick                  # CPU smoke run on a tiny model (tests run it)
    python scripts/bench_serve.py --concurrency 256 --request-rates "" --overload 512 --max-waiting-requests 64
                                   # 2x the 256-stream load against the queue bound: every request completes
                                   # or gets an immediate 503 (counts and 503 latencies reported)

Requests follow the W length distribution (nano-vllm's bench.py: random.seed(0), prompts of 100-1024 random
token ids in [0, 10000], 100-1024 output tokens, ignore_eos, temperature 0.6), sent as token ids to
/v1/completions with stream=true. Each level gets its own requests (no prefix-cache hits across levels).
1. Start `python -m jaxinfer.server` (unless --url), wait for /health.
2. Concurrency sweep: at most C streams in flight (C = 1, 16, 64, 256), min(--num-prompts, 4 C) requests
   (at least --min-prompts); then request-rate sweep: Poisson arrivals at R req/s. Requests are spread over
   --client-procs processes so that the client is never the bottleneck.
3. Stop the server; in a fresh process, run each level's requests through offline `LLM.generate` (all at
   once), and the 1-stream requests one at a time (batch-1 TTFT / TPOT). Print the ratios.
Reports output tok/s, TTFT, TPOT, ITL and latency percentiles (ms); writes JSON to scripts/results/.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]
from serve_load import min_lens, percentiles, probe_refusals, run_level, summarize, vocab_size, workload  # noqa: E402

# --quick: two buckets in all (prefill 64, decode 8), compiled by the warm-up requests (tests/test_server.py's
# engine options: its tests' engine cores leave these steps in a shared compilation cache)
QUICK_ENGINE = dict(dtype="float32", attn_backend="xla", max_num_seqs=8, max_num_batched_tokens=64,
                    max_model_len=128, kvcache_block_size=4, num_kvcache_blocks=256, warmup=False,
                    num_scheduler_steps=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, env) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "jaxinfer.server", args.model, "--engine", json.dumps(args.engine), "--port",
           str(port), "--served-model-name", args.served_model_name, "--log-level", "warning",
           "--api-server-count", str(args.api_server_count)]
    if args.max_waiting_requests is not None:
        cmd += ["--max-waiting-requests", str(args.max_waiting_requests)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    url, end = f"http://127.0.0.1:{port}", time.time() + args.startup_timeout
    import httpx
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode} while starting")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.time() > end:
            proc.kill()
            raise SystemExit(f"the server did not come up in {args.startup_timeout} s")
        time.sleep(0.5)


def offline(model: str, engine: dict, levels: list[dict], env: dict) -> list[dict]:
    """In its own (spawned) process, as the server's core: LLM.generate on each level's requests. `env`: the
    server's compilation cache (its steps compiled already)."""
    os.environ.update(env)
    from jaxinfer.xla_options import set_process_flags
    set_process_flags()                          # what the server's core and the jaxinfer commands do
    from jaxinfer import LLM, SamplingParams
    llm = LLM(model, **engine)
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)      # warm-up, as bench.py
    out = []
    for lv in levels:
        reqs = lv["requests"]
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for _, m in reqs]
        llm.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate([p for p, _ in reqs], params, use_tqdm=False)
        wall = time.perf_counter() - t
        n = sum(len(o.token_ids) for o in outs)
        r = dict(name=lv["name"], output_tokens=n, wall_s=wall, output_tok_s=n / wall)
        if lv.get("concurrency") == 1:           # batch 1: each request alone
            llm.reset_prefix_cache()
            single = [llm.generate([p], sp, use_tqdm=False)[0].metrics for (p, _), sp in zip(reqs, params)]
            r["batch1_ttft_ms"] = percentiles([m["ttft_s"] for m in single])
            r["batch1_tpot_ms"] = percentiles([m["tpot_s"] for m in single if "tpot_s" in m])
        out.append(r)
    return out


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="qwen3-0.6b", help="checkpoint dir, preset or hub id")
    ap.add_argument("--engine", type=json.loads, default={}, help="engine options as JSON (LLM kwargs)")
    ap.add_argument("--url", default=None, help="benchmark this running server (no start, no offline run)")
    ap.add_argument("--served-model-name", default="bench")
    ap.add_argument("--api-server-count", type=int, default=1)
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",") if x], default=[1, 16, 64, 256])
    ap.add_argument("--request-rates", type=lambda s: [float(x) for x in s.split(",") if x], default=[8.0, 32.0],
                    help="Poisson arrival rates, requests/s (default 8,32: about 20 and 100 streams on the H200)")
    ap.add_argument("--num-prompts", type=int, default=512, help="most requests of one level (default 512)")
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--rate-prompts", type=int, default=128, help="requests of one request-rate level")
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--max-output-len", type=int, default=1024)
    ap.add_argument("--client-procs", type=int, default=4)
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="prompt ids are taken modulo this (default: the model's vocabulary)")
    ap.add_argument("--no-offline", dest="offline", action="store_false")
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument("--json", default=None, help="default: scripts/results/serve_<model>_<time>.json")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: tiny model, few short requests")
    ap.add_argument("--max-waiting-requests", type=int, default=None, help="the server's queue bound")
    ap.add_argument("--extra-body", type=json.loads, default={},
                    help='more fields for every request, e.g. \'{"logprobs": 5}\' or \'{"frequency_penalty": 0.5}\' '
                         '(the offline comparison does not use them)')
    ap.add_argument("--overload", type=int, default=None, metavar="C",
                    help="last, an overload level: C streams in flight (e.g. 512 = 2x 256) against the queue bound; "
                         "each request must complete or get a 503 at once (no errors, no lost tokens)")
    ap.add_argument("--overload-prompts", type=int, default=None, help="requests of the overload level (default 2 C)")
    a = ap.parse_args(argv)
    if a.quick:
        if a.model == "qwen3-0.6b":            # not given: a tiny random checkpoint (vocabulary 512)
            from make_tiny_model import make_tiny_model
            a.model = make_tiny_model(os.path.join(tempfile.mkdtemp(prefix="bench-serve-"), "tiny"))
        a.engine = {**QUICK_ENGINE, **a.engine}
        a.concurrency, a.request_rates, a.num_prompts, a.min_prompts, a.rate_prompts = [1, 4], [20.0], 8, 3, 6
        a.max_input_len, a.max_output_len, a.client_procs, a.vocab_size = 40, 24, 2, 512
    return a


def build_levels(a, vocab: int) -> list[dict]:
    lo_in, lo_out = min_lens(a)
    sizes = [min(a.num_prompts, max(a.min_prompts, 4 * c)) for c in a.concurrency] + [a.rate_prompts] * len(a.request_rates)
    reqs = workload(sum(sizes), a.max_input_len, a.max_output_len, lo_in, lo_out, vocab)
    levels, i = [], 0
    for k, n in enumerate(sizes):
        conc = a.concurrency[k] if k < len(a.concurrency) else None
        rate = None if conc else a.request_rates[k - len(a.concurrency)]
        part = reqs[i:i + n]
        i += n
        levels.append(dict(name=f"concurrency {conc}" if conc else f"rate {rate:g}/s", concurrency=conc, rate=rate,
                           requests=part))
    return levels


def main(argv=None) -> dict:
    a = parse(argv)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if not a.url:     # the offline process compiles the same steps: let it read them from a shared cache
        env.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="bench-serve-jax-cache-"))
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    path = a.json or os.path.join(HERE, "results", f"serve_{os.path.basename(a.model.rstrip('/'))}_"
                                                   f"{time.strftime('%Y%m%d-%H%M%S')}.json")
    r = dict(model=a.model, engine=a.engine, url=a.url, client_procs=a.client_procs, extra_body=a.extra_body,
             api_server_count=a.api_server_count, levels=[])
    save = (lambda: write_json(path, r)) if not a.quick or a.json else (lambda: None)   # after every level
    proc, url = (None, a.url) if a.url else start_server(a, env)
    import httpx
    try:
        a.vocab_size = vocab_size(a)
        levels = build_levels(a, a.vocab_size)
        r["engine_core_xla_flags"] = httpx.get(url + "/stats").json().get("engine_core_xla_flags")
        print(f"engine core XLA_FLAGS: {r['engine_core_xla_flags']!r}", flush=True)
        ctx = mp.get_context("spawn")
        with ctx.Pool(a.client_procs) as pool:
            pool.map(int, range(a.client_procs))                  # start the client processes first
            warm = workload(2, 64, 8, 16, 4, vocab=a.vocab_size, seed=1)   # one short request through every process
            errors = [r["error"] for r in run_level(pool, url, a.served_model_name, [(p, m, None) for p, m in warm],
                                                    2, a.client_procs) if r["error"]]
            if errors:
                raise SystemExit(f"bench_serve.py: the warm-up requests failed: {errors[0]}")
            for lv in levels:
                rng = random.Random(1)
                reqs, t = [], 0.0
                for ids, m in lv["requests"]:
                    if lv["rate"]:
                        t += rng.expovariate(lv["rate"])
                    reqs.append((ids, m, t if lv["rate"] else None))
                before = httpx.get(url + "/stats").json()
                recs = run_level(pool, url, a.served_model_name, reqs, lv["concurrency"], a.client_procs, a.extra_body)
                after = httpx.get(url + "/stats", timeout=60).json()
                s = dict(name=lv["name"], concurrency=lv["concurrency"], rate=lv["rate"], **summarize(recs),
                         preemptions=after["preemptions"] - before["preemptions"],
                         kv_blocks_free_after=after["kv_blocks_free"], kv_blocks_total=after["kv_blocks_total"])
                print_level(s)
                r["levels"].append(s)
                save()
            if a.overload:
                r["overload"] = overload_level(a, pool, url)
                save()
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            r["server_exit_code"] = proc.wait(timeout=120)
    if a.offline and not a.url:
        with mp.get_context("spawn").Pool(1) as pool:
            cache = {k: v for k, v in env.items() if k.startswith("JAX_")}
            r["offline"] = pool.apply(offline, (a.model, a.engine, levels, cache))
        compare(r)
    save()
    if not a.quick or a.json:
        print(f"wrote {path}")
    return r


def overload_level(a, pool, url: str) -> dict:
    """C streams in flight (closed loop: a refused client sends its next request at once) against the queue
    bound; the target: completed + rejected_503 == requests, 0 errors, 0 lost tokens, 503s in well under 1 s."""
    import httpx
    n = a.overload_prompts or 2 * a.overload
    reqs = [(ids, m, None) for ids, m in workload(n, a.max_input_len, a.max_output_len, *min_lens(a), a.vocab_size,
                                                  seed=2)]
    before = httpx.get(url + "/stats").json()
    stop, probes = threading.Event(), []
    prober = threading.Thread(target=probe_refusals, args=(url, a.served_model_name, stop, probes))
    prober.start()
    try:
        recs = run_level(pool, url, a.served_model_name, reqs, a.overload, a.client_procs, a.extra_body)
    finally:
        stop.set()
        prober.join()
    after = httpx.get(url + "/stats", timeout=60).json()
    s = dict(name=f"overload {a.overload}", concurrency=a.overload, max_waiting_requests=a.max_waiting_requests,
             **summarize(recs), preemptions=after["preemptions"] - before["preemptions"],
             kv_blocks_free_after=after["kv_blocks_free"], kv_blocks_total=after["kv_blocks_total"])
    refused = [ms for status, ms in probes if status == 503]
    s["probe"] = dict(requests=len(probes), refused=len(refused), errors=sum(st not in (200, 503) for st, _ in probes),
                      refused_ms=percentiles(refused, 1.0) | ({"max": max(refused)} if refused else {}))
    # the bound is met when an idle client's refusals come at once; the loaded clients' own 503 times also count
    # their event loops' lag (each parses thousands of streamed events a second), reported beside it
    s["ok"] = (s["errors"] == 0 and s["lost_tokens"] == 0 and s["completed"] + s["rejected_503"] == s["requests"]
               and s["probe"]["errors"] == 0 and s["probe"]["refused_ms"].get("max", 0.0) < 1000.0)
    print_level(s)
    print(f"{s['name']:>16}: {s['requests']} requests = {s['completed']} completed + {s['rejected_503']} refused "
          f"(503, max {s['rejected_ms'].get('max', 0.0):.1f} ms, p99 {s['rejected_ms'].get('p99', 0.0):.1f} ms as "
          f"the loaded clients saw them) + {s['errors']} errors; {s['lost_tokens']} lost tokens; an idle client's "
          f"probes: {len(refused)} of {len(probes)} refused, p50 {s['probe']['refused_ms'].get('p50', 0.0):.1f} ms, "
          f"max {s['probe']['refused_ms'].get('max', 0.0):.1f} ms -> {'OK' if s['ok'] else 'FAIL'}", flush=True)
    return s


def write_json(path: str, r: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(r, f, indent=2)


def print_level(s: dict) -> None:
    f = lambda d: f"{d.get('p50', float('nan')):7.1f} / {d.get('p99', float('nan')):7.1f}"  # noqa: E731
    print(f"{s['name']:>16}: {s['output_tok_s']:9.0f} out tok/s  {s['requests']:4d} req  {s['errors']} err  "
          f"{s['lost_tokens']} lost | TTFT p50/p99 {f(s['ttft_ms'])} ms | TPOT {f(s['tpot_ms'])} ms | "
          f"ITL {f(s['itl_ms'])} ms", flush=True)


def compare(r: dict) -> None:
    """server / offline for each level; the targets' ratios."""
    for s, o in zip(r["levels"], r["offline"]):
        s["offline_output_tok_s"] = o["output_tok_s"]
        s["server_over_offline"] = s["output_tok_s"] / o["output_tok_s"]
        line = f"{s['name']:>16}: server {s['output_tok_s']:9.0f} / offline {o['output_tok_s']:9.0f} tok/s = " \
               f"{s['server_over_offline']:.1%}"
        if "batch1_tpot_ms" in o and s["tpot_ms"]:
            s["offline_batch1_tpot_ms"], s["offline_batch1_ttft_ms"] = o["batch1_tpot_ms"], o["batch1_ttft_ms"]
            s["tpot_over_offline_batch1"] = s["tpot_ms"]["p50"] / o["batch1_tpot_ms"]["p50"]
            line += (f"; TPOT p50 {s['tpot_ms']['p50']:.2f} vs offline batch-1 {o['batch1_tpot_ms']['p50']:.2f} ms "
                     f"({s['tpot_over_offline_batch1']:.2f}x)")
        print(line, flush=True)


if __name__ == "__main__":
    main()
