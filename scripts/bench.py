"""Throughput benchmark: nano-vllm's workload (256 requests, prompts of 100-1024 random token ids,
100-1024 output tokens, ignore_eos, temperature 0.6, one warm-up generate), with a roofline report.

    python scripts/bench.py                              # embedded Qwen3-0.6B, random weights
    python scripts/bench.py --attn-backend xla --json out.json
    python scripts/bench.py --latency                    # 1 request: 1024-token prompt, 256 outputs
    python scripts/bench.py qwen3-8b -tp 2               # also vLLM's --num-prompts, --input-len, --output-len
Engine options are the engine's own flags (as `jaxinfer generate --help`), with the engine's defaults: the
benchmark runs what `LLM(model)` runs, compiled ahead of time (`warmup=True`: a GPU's default; the JSON's "engine").
The roofline: every step must read the weights once and the K/V of every context token it attends to;
those bytes divided by the HBM bandwidth measured in this process give the floor time.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import time

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]

import numpy as np  # noqa: E402
from timing import measure_bandwidth, pct, write_json  # noqa: E402,F401  (write_json: scripts import it from here)


def workload(num_seqs: int, max_input: int, max_output: int, vocab: int = 151936, seed: int = 0,
             fixed_input: bool = False, fixed_output: bool = False):
    """Exactly nano-vllm bench.py's prompts and lengths (same random calls, same order); token ids modulo the
    vocabulary (tiny test models run it too). fixed_*: every length is the max (vLLM's --input-len / --output-len)."""
    from jaxinfer import SamplingParams
    random.seed(seed)
    lo_in = max_input if fixed_input else min(100, max_input)
    lo_out = max_output if fixed_output else min(100, max_output)
    prompts = [[random.randint(0, 10000) % vocab for _ in range(random.randint(lo_in, max_input))]
               for _ in range(num_seqs)]       # (limits below 100: lengths up to them; nano-vllm's needs >= 100)
    params = [SamplingParams(temperature=0.6, ignore_eos=True,
                             max_tokens=random.randint(lo_out, max_output)) for _ in range(num_seqs)]
    return prompts, params


HOST_TIMES = ("host_schedule_s", "host_dispatch_s", "host_wait_s", "host_apply_s")


def report(llm, st: dict, outs, wall: float, bw: float, args) -> dict:
    """st: the engine counters of the timed run only."""
    from jaxinfer.engine.memory import kv_bytes_per_block
    from jaxinfer.model.kv_scales import kv_cache_dtype
    mc = llm.model_config
    out_tokens = sum(len(o.token_ids) for o in outs)
    in_tokens, steps = sum(len(o.prompt_token_ids) for o in outs), st["prefill_steps"] + st["decode_steps"]
    weight_bytes = mc.num_params() * (2 if llm.config.dtype != "float32" else 4)
    kv_dtype = kv_cache_dtype(llm.config.kv_cache_dtype, llm.config.dtype)    # fp8: one byte a value
    kv_per_token = kv_bytes_per_block(mc, 1, kv_dtype)
    need = weight_bytes * steps + kv_per_token * st["kv_tokens_read"]
    # tp x dp devices each read their share at bw (steps are summed over data-parallel replicas)
    devices = llm.config.tensor_parallel_size * llm.config.data_parallel_size
    bw, ref_bw = bw * devices, args.reference_bw * devices
    floor = need / bw
    ttft = [o.metrics["ttft_s"] * 1e3 for o in outs if "ttft_s" in o.metrics]
    tpot = [o.metrics["tpot_s"] * 1e3 for o in outs if "tpot_s" in o.metrics]
    r = dict(model=args.model, attn_backend=llm.config.attn_backend, kv_cache_dtype=str(kv_dtype), num_seqs=len(outs),
             tensor_parallel_size=llm.config.tensor_parallel_size, data_parallel_size=llm.config.data_parallel_size,
             output_tokens=out_tokens, prompt_tokens=in_tokens, wall_s=wall,
             output_tok_s=out_tokens / wall, total_tok_s=(out_tokens + in_tokens) / wall,
             prefill_steps=st["prefill_steps"], decode_steps=st["decode_steps"],
             compilations_after_warmup=st["compilations"], preemptions=st["preemptions"],
             padded_tokens=st["padded_tokens"], prefix_cache_hit_tokens=st.get("prefix_cache_hit_tokens", 0),
             ttft_ms_p50=pct(ttft, 50), ttft_ms_p90=pct(ttft, 90), ttft_ms_p99=pct(ttft, 99),
             tpot_ms_p50=pct(tpot, 50), tpot_ms_p90=pct(tpot, 90), tpot_ms_p99=pct(tpot, 99),
             bytes_needed=need, bandwidth_GBs=bw / 1e9, floor_s=floor, pct_of_floor=100 * floor / wall,
             achieved_GBs=need / wall / 1e9, warmup_s=args.warmup_s, warmup_breakdown=args.warmup_breakdown,
             reference_bandwidth_GBs=ref_bw * 1e3, floor_s_at_reference=need / (ref_bw * 1e12),
             pct_of_reference_floor=100 * need / (ref_bw * 1e12) / wall,
             host_ms_per_step={k[5:-2]: 1e3 * st[k] / steps for k in HOST_TIMES if k in st})
    print(f"\n== {args.model} | backend={r['attn_backend']} | kv cache {r['kv_cache_dtype']} | {len(outs)} requests ==")
    print(f"output: {out_tokens} tok in {wall:.2f} s = {r['output_tok_s']:,.0f} tok/s "
          f"(total {r['total_tok_s']:,.0f} tok/s incl. {in_tokens} prompt tokens)")
    print(f"steps: {r['prefill_steps']} prefill + {r['decode_steps']} decode; compilations after warm-up: "
          f"{r['compilations_after_warmup']}; preemptions: {r['preemptions']}; warm-up {args.warmup_s:.1f} s")
    print(f"TTFT ms p50/p90/p99: {r['ttft_ms_p50']:.1f}/{r['ttft_ms_p90']:.1f}/{r['ttft_ms_p99']:.1f}; "
          f"TPOT ms p50/p90/p99: {r['tpot_ms_p50']:.2f}/{r['tpot_ms_p90']:.2f}/{r['tpot_ms_p99']:.2f}")
    if r["host_ms_per_step"]:
        h = r["host_ms_per_step"]
        print("host ms per step: " + ", ".join(f"{k} {v:.2f}" for k, v in h.items()) +
              " (wait = blocked on the GPU; the rest is host work, hidden only while the GPU is busier)")
    print(f"roofline: {need / 1e12:.2f} TB must be read (weights once per step + KV of every context token); "
          f"at the measured {bw / 1e12:.2f} TB/s the floor is {floor:.2f} s -> achieved {r['pct_of_floor']:.1f}% "
          f"of the floor ({r['achieved_GBs']:,.0f} GB/s)")
    print(f"  against the {ref_bw:.1f} TB/s of a raw device copy (--reference-bw; an H200's, measured) the floor is "
          f"{r['floor_s_at_reference']:.2f} s -> {r['pct_of_reference_floor']:.1f}%")
    return r


def build(args):
    """The LLM as a user gets it (the flags given, else defaults), warmed up even where it is lazy by default (CPU)."""
    from jaxinfer import LLM
    from jaxinfer.cli import check_vllm_flags, engine_kwargs
    check_vllm_flags(args)
    t = time.perf_counter()
    llm = LLM(args.model, **{"warmup": True, **engine_kwargs(args)})
    args.warmup_s = time.perf_counter() - t
    args.attn_backend, args.engine = llm.config.attn_backend, dict(vars(llm.config))    # (the JSON records it)
    print(f"engine: {llm.config}", flush=True)
    from timing import warmup_breakdown
    w = args.warmup_breakdown = warmup_breakdown(llm, args.warmup_s)
    print(f"warm-up {args.warmup_s:.1f} s: " + ", ".join(f"{k} {v:.1f}" for k, v in w.items() if k.endswith("_s")) +
          f"; {w['programs']} programs (" + ", ".join(f"{k} {n}: {t:.0f} s" for k, (n, t) in w["compile_by_kind"].items())
          + "), slowest " + ", ".join(f"{x['step']} {x['s']:.1f} s" for x in w["slowest"][:3]))
    check_context(args, llm.config.max_model_len)             # (the pool may have capped it)
    return llm


def check_context(args, max_model_len) -> None:
    """The longest request (prompt + output) fits max_model_len (else it stops short: vLLM's benchmark refuses it)."""
    need = args.latency_prompt + args.latency_output if args.latency else args.max_input_len + args.max_output_len
    if 0 < (max_model_len or 0) < need:
        raise ValueError(f"the requests need {need} tokens of context (prompt + output): more than "
                         f"max_model_len={max_model_len}")


def run_throughput(args) -> dict:
    from jaxinfer import SamplingParams
    from trace_summary import profiled, summarize_profile
    llm = build(args)
    prompts, params = workload(args.num_seqs, args.max_input_len, args.max_output_len, llm.model_config.vocab_size,
                               fixed_input=args.input_len is not None, fixed_output=args.output_len is not None)
    params = with_extras(llm, params, args)
    llm.generate([[1, 2, 3]], SamplingParams(), use_tqdm=False)       # warm-up, as nano-vllm (ids: no tokenizer needed)
    walls = []
    for _ in range(args.repeats):     # the counters, step log and profile are of the last repeat
        llm.reset_prefix_cache()      # every repeat computes its prompts, as the first did
        before = llm.stats()
        if args.step_log:
            llm.engine.step_log = []
        with profiled(args.profile if len(walls) == args.repeats - 1 else None):
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            walls.append(time.perf_counter() - t)
        after = llm.stats()
    wall = float(np.median(walls))
    st = {k: after[k] - before[k] for k in ("prefill_steps", "decode_steps", "kv_tokens_read", "padded_tokens",
                                           "preemptions", "prefix_cache_hit_tokens", *HOST_TIMES)}
    st["compilations"] = after["compilations"]
    r = report(llm, st, outs, wall, measure_bandwidth(), args)
    r.update(logprobs=args.logprobs, presence_penalty=args.presence_penalty, top_p=getattr(args, "top_p", 1.0),
             top_k=getattr(args, "top_k", 0), compiled_extras=after.get("compiled_extras"))
    if args.repeats > 1:
        r["walls_s"] = walls
        print(f"wall of each of the {args.repeats} repeats: " + ", ".join(f"{w:.2f} s" for w in walls) +
              " (the median is reported)")
    if args.step_log:
        from timing import STEP_LOG_COLUMNS, step_log_summary
        r["host_ms_by_bucket"] = step_log_summary(llm.engine.step_log)
        write_json(args.step_log, dict(columns=STEP_LOG_COLUMNS, steps=llm.engine.step_log))
    if args.profile:
        r["profile"] = summarize_profile(args.profile, st["prefill_steps"] + st["decode_steps"])
    if args.peer == "hf":
        from bench_peer import compare
        r["peer"] = compare(llm, args.model, prompts, args.peer_num_seqs, args.peer_max_tokens)
    return r


def with_extras(llm, params, args):
    """--top-p / --top-k / --logprobs / --presence-penalty for every request; extras compiled before the timing."""
    from dataclasses import replace
    if getattr(args, "top_p", 1.0) < 1.0 or getattr(args, "top_k", 0):     # filtered: the step, then a resample
        params = [replace(p, top_p=args.top_p, top_k=args.top_k) for p in params]
    if args.logprobs is None and not args.presence_penalty:
        return params
    params = [replace(p, logprobs=args.logprobs, presence_penalty=args.presence_penalty) for p in params]
    t = time.perf_counter()
    n = llm.engine.warmup_extras(params[0])          # (a data-parallel engine: every replica's)
    print(f"compiled {n} penalty / logprob step variants in {time.perf_counter() - t:.1f} s", flush=True)
    return params


def run_latency(args) -> dict:
    from jaxinfer import SamplingParams
    if args.latency_output < 2:                       # (before the warm-up)
        raise ValueError(f"--output-len {args.latency_output}: a TPOT needs 2 output tokens or more")
    llm = build(args)
    V = min(10000, llm.model_config.vocab_size)
    prompt = np.random.default_rng(0).integers(0, V, args.latency_prompt).tolist()
    hot = dict(temperature=0.6, top_k=args.top_k, top_p=args.top_p, seed=0) if args.top_k or args.top_p < 1 else {}
    sp = SamplingParams(**{"temperature": 0.0, **hot}, ignore_eos=True, max_tokens=args.latency_output)
    sp = with_extras(llm, [sp], args)[0]                  # (--logprobs / --presence-penalty: every request's too)
    n = args.latency_batch
    llm.engine.block_manager.prefix_caching = False       # measure cold prompts
    # the first request after LLM(): warm-up must have left nothing lazy
    first = llm.generate([[(t + 7) % V for t in prompt]], sp, use_tqdm=False)[0].metrics["ttft_s"] * 1e3
    ttfts, tpots = [], []
    for i in range(3):        # n fresh prompts at once: TTFT of the batch's prompts, TPOT of each request
        outs = llm.generate([[(t + 100 * i + j) % V for t in prompt] for j in range(n)], sp, use_tqdm=False)
        ttfts += [o.metrics["ttft_s"] * 1e3 for o in outs]
        tpots += [o.metrics["tpot_s"] * 1e3 for o in outs]
    st = llm.stats()
    r = dict(model=args.model, attn_backend=args.attn_backend, prompt_tokens=args.latency_prompt, batch=n,
             tensor_parallel_size=llm.config.tensor_parallel_size, data_parallel_size=llm.config.data_parallel_size,
             num_scheduler_steps=llm.config.num_scheduler_steps, output_tokens=args.latency_output,
             first_ttft_ms=first, ttft_ms=float(np.median(ttfts)), tpot_ms=float(np.median(tpots)),
             sampling=dict(hot, logprobs=args.logprobs, presence_penalty=args.presence_penalty),
             warmup_s=args.warmup_s, warmup_breakdown=args.warmup_breakdown, compiled_buckets=st["compiled_buckets"],
             compiled_multistep=st.get("compiled_multistep"), multistep_calls=st.get("multistep_calls"),
             decode_steps=st["decode_steps"], compilations_after_warmup=st["compilations"], host=host_name())
    print(f"latency ({args.model}, {args.attn_backend}, batch {n}, num_scheduler_steps="
          f"{llm.config.num_scheduler_steps}, host {r['host']}): first request's TTFT {first:.1f} ms; TTFT "
          f"{r['ttft_ms']:.1f} ms for {args.latency_prompt} prompt tokens; TPOT {r['tpot_ms']:.2f} ms over "
          f"{args.latency_output} tokens (median of 3 x {n}); {st.get('multistep_calls')} K-step calls for "
          f"{st['decode_steps']} decode steps; warm-up {args.warmup_s:.1f} s, {st['compiled_buckets']} compiled "
          f"({st.get('compiled_multistep')} K-step)")
    return r


def host_name() -> str:
    """The machine and its CPU: host-bound figures (TPOT at small batch) depend on it."""
    import platform
    cpu = ""
    with contextlib.suppress(OSError):
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "")
    return f"{platform.node()} ({cpu or platform.processor()})"


def parse(argv=None):
    from jaxinfer.cli import CHUNKED, add_engine_args
    from jaxinfer.cli_types import at_least_two, bare_flags, dashed, output_path, positive_float, positive_int
    from jaxinfer.cli_types import probability
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="checkpoint dir, preset (random weights) or hub id (default: qwen3-0.6b)")
    ap.add_argument("--model", dest="model_flag", metavar="MODEL", help="the same as the positional MODEL (vLLM's)")
    g = ap.add_argument_group("workload (nano-vllm's bench.py)")
    g.add_argument("--num-seqs", "--num-prompts", type=positive_int, default=256, help="requests (default: 256)")
    g.add_argument("--max-input-len", type=positive_int, default=1024, help="longest prompt (default: 1024)")
    g.add_argument("--max-output-len", type=positive_int, default=1024, help="most output tokens (default: 1024)")
    g.add_argument("--input-len", type=positive_int, help="every prompt this long (vLLM's; --latency: its prompt)")
    g.add_argument("--output-len", type=positive_int, help="every output this long (vLLM's; --latency: its output)")
    add_engine_args(ap, with_model=False)
    ap.add_argument("--latency", action="store_true", help="one request: TTFT and TPOT")
    ap.add_argument("--latency-prompt", type=positive_int, default=1024, help="--latency: prompt tokens (default 1024)")
    ap.add_argument("--latency-output", type=at_least_two, default=256, help="output tokens (TPOT needs >= 2)")
    ap.add_argument("--latency-batch", type=positive_int, default=1, help="--latency: requests decoded together")
    ap.add_argument("--peer", choices=["hf"], help="also HF transformers' continuous batching (bench_peer.py)")
    ap.add_argument("--peer-num-seqs", type=positive_int, default=64, help="--peer: requests (default 64)")
    ap.add_argument("--peer-max-tokens", type=positive_int, default=256, help="--peer: tokens each (default 256)")
    ap.add_argument("--json", type=output_path, default=None, help="write the results here")
    ap.add_argument("--reference-bw", type=positive_float, default=4.3,
                    help="TB/s per device for a second floor (times the devices used): XLA's own pass reaches "
                         "less than the HBM can (default 4.3, a torch device copy on the H200)")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="every request asks for N logprobs per token (cost of logprobs; default: none)")
    g.add_argument("--presence-penalty", type=float, default=0.0, metavar="X",
                   help="every request has presence_penalty=X (cost of penalties; default: 0)")
    g.add_argument("--top-p", type=probability, default=1.0, metavar="P",
                   help="every request has top_p=P (default 1: no filter; Qwen3's config: --top-k 20 --top-p 0.95)")
    g.add_argument("--top-k", type=int, default=0, metavar="K", help="every request has top_k=K (default 0)")
    ap.add_argument("--repeats", type=positive_int, default=1, help="time it N times; the median wall (A/B runs)")
    ap.add_argument("--step-log", type=output_path, default=None, metavar="PATH",
                    help="log every step's host times (schedule, dispatch, wait, apply) to PATH; print them by bucket")
    ap.add_argument("--profile", metavar="DIR", help="trace the timed run into DIR; where the GPU time went")
    ap.add_argument("--no-process-flags", action="store_true", help="run as a plain `LLM()` in a user's Python does: "
                    "XLA_FLAGS left as they are (A/B of the SKIP_TEMP mode that the jaxinfer commands set)")
    return ap.parse_args(bare_flags(dashed(sys.argv[1:] if argv is None else list(argv)), CHUNKED))


def main(argv=None) -> dict:
    args = parse(argv)
    if args.model_flag and args.model not in (args.model_flag, None):
        raise ValueError(f"two models given: {args.model!r} and --model {args.model_flag!r}")
    args.model = args.model_flag or args.model or "qwen3-0.6b"
    if args.input_len:                          # vLLM's fixed lengths: the workload's, and --latency's request's
        args.max_input_len = args.latency_prompt = args.input_len
    if args.output_len:
        args.max_output_len = args.latency_output = args.output_len
    check_context(args, getattr(args, "max_model_len", None))       # before the warm-up (again after: build)
    from jaxinfer import SamplingParams      # the per-request flags' values: refused now, not after the warm-up
    SamplingParams(top_p=args.top_p, top_k=args.top_k, logprobs=args.logprobs, presence_penalty=args.presence_penalty
                   ).check_vocab(1 << 30, max_logprobs=20 if args.max_logprobs is None else args.max_logprobs)
    if args.peer and (args.latency or args.hf_overrides):   # (transformers loads the checkpoint as config.json says)
        raise ValueError("--peer hf compares the throughput run against the checkpoint as it is; drop "
                         + ("--latency" if args.latency else "--hf-overrides"))
    from jaxinfer.xla_options import set_process_flags, use_triton_ptxas
    if not args.no_process_flags:
        set_process_flags()      # exactly what the `jaxinfer` commands do: this process is ours
        if args.attn_backend == "triton":
            use_triton_ptxas()
    if args.peer:   # leave GPU memory for PyTorch: JAX would otherwise preallocate 75% of it
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")
    r = run_latency(args) if args.latency else run_throughput(args)
    r["xla_flags"], r["engine"] = os.environ.get("XLA_FLAGS", ""), getattr(args, "engine", None)
    write_json(args.json, r)
    return r


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as e:       # a bad engine value: its message, as `jaxinfer bench` prints it
        print(f"bench.py: error: {e}", file=sys.stderr)
        sys.exit(2)
