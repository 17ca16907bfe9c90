"""Multi-step decode A/B in one process (one warm-up, same host, same executables): latency at batch 1 / 8 / 32
and the throughput workload, with K-step calls (the engine's choice) and without (one step per call), plus the
first request after LLM(), the TTFT of requests arriving while a K-step call runs, and token agreement.

    python scripts/bench_multistep.py [model] [--json out.json] [--skip-throughput]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402


def latency(llm, batch: int, prompt_len: int = 1024, out_len: int = 256, repeats: int = 3, offset: int = 0):
    from jaxinfer import SamplingParams
    rng = np.random.default_rng(0)
    V = min(10000, llm.model_config.vocab_size)
    prompt = rng.integers(0, V, prompt_len).tolist()
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=out_len)
    ttft, tpot, toks = [], [], []
    for i in range(repeats):
        outs = llm.generate([[(t + offset + 100 * i + j) % V for t in prompt] for j in range(batch)], sp,
                            use_tqdm=False)
        ttft += [o.metrics["ttft_s"] * 1e3 for o in outs]
        tpot += [o.metrics["tpot_s"] * 1e3 for o in outs]
        toks.append([o.token_ids for o in outs])
    return dict(ttft_ms=float(np.median(ttft)), tpot_ms=float(np.median(tpot)),
                tpot_p90_ms=float(np.percentile(tpot, 90))), toks


def arrivals(llm, trials: int = 30, prompt_len: int = 1024):
    """TTFT of a new request that arrives right after a K-step call was dispatched for a running one."""
    from jaxinfer import SamplingParams
    from jaxinfer.engine.llm_engine import is_finished
    eng = llm.engine
    rng = np.random.default_rng(1)
    V = min(10000, llm.model_config.vocab_size)
    bg = eng.add_request(rng.integers(0, V, 64).tolist(), SamplingParams(ignore_eos=True, max_tokens=4000))
    out, in_call = [], 0
    for i in range(trials):
        for _ in range(int(rng.integers(1, 4))):
            eng.step()
        in_call += eng.in_flight is not None and eng.in_flight[0].num_steps > 1
        new = eng.add_request(rng.integers(0, V, prompt_len).tolist(), SamplingParams(max_tokens=1))
        while new.first_token_time is None:
            eng.step()
        out.append((new.first_token_time - new.arrival_time) * 1e3)
        if is_finished(bg):
            break
    eng.abort(bg)
    while eng.in_flight is not None:
        eng.step()
    return dict(ttft_p50_ms=float(np.percentile(out, 50)), ttft_p99_ms=float(np.percentile(out, 99)),
                arrived_during_k_step_call=int(in_call), trials=len(out))


def throughput(llm):
    from bench import workload
    from jaxinfer import SamplingParams
    prompts, params = workload(256, 1024, 1024, llm.model_config.vocab_size)
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
    llm.reset_prefix_cache()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    return dict(tok_s=sum(len(o.token_ids) for o in outs) / wall, wall_s=wall)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="qwen3-0.6b")
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--out-len", type=int, default=256)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--loop", choices=("fori", "unroll"), default=None,
                    help="the device loop (jaxinfer.multistep.LOOP; default: the library's)")
    ap.add_argument("--ks", default=None, help="K-step variants compiled, e.g. 4,16 (runner.MULTISTEP_KS)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    from jaxinfer.xla_options import set_process_flags
    set_process_flags()
    from bench import host_name
    import jaxinfer.engine.runner as runner
    import jaxinfer.multistep as multistep
    multistep.LOOP = args.loop or multistep.LOOP
    if args.ks:
        runner.MULTISTEP_KS = tuple(sorted(int(k) for k in args.ks.split(",")))
    from jaxinfer import LLM, SamplingParams
    t = time.perf_counter()
    llm = LLM(args.model)
    r = dict(host=host_name(), warmup_s=time.perf_counter() - t, config=str(llm.config), loop=multistep.LOOP,
             ks=runner.MULTISTEP_KS)
    st = llm.stats()
    r.update(compiled_buckets=st["compiled_buckets"], compiled_multistep=st["compiled_multistep"])
    print(f"host {r['host']}; warm-up {r['warmup_s']:.1f} s; {st['compiled_buckets']} compiled, "
          f"{st['compiled_multistep']} of them K-step (K in {runner.MULTISTEP_KS}, loop {multistep.LOOP})", flush=True)
    llm.engine.block_manager.prefix_caching = False
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, min(10000, llm.model_config.vocab_size), args.prompt_len).tolist()
    o = llm.generate([prompt], SamplingParams(max_tokens=8), use_tqdm=False)[0]
    r["first_request_ttft_ms"] = o.metrics["ttft_s"] * 1e3
    print(f"first request after LLM(): TTFT {r['first_request_ttft_ms']:.1f} ms", flush=True)
    tokens = {}
    for mode in ("multistep", "one_step"):
        llm.engine.multistep = mode == "multistep"
        for b in batches:
            before = llm.stats()
            m, tokens[mode, b] = latency(llm, b, args.prompt_len, args.out_len)
            after = llm.stats()
            m["k_step_calls"] = after["multistep_calls"] - before["multistep_calls"]
            m["decode_steps"] = after["decode_steps"] - before["decode_steps"]
            r[f"{mode}_batch{b}"] = m
            print(f"{mode:9s} batch {b:2d}: TPOT {m['tpot_ms']:.3f} ms (p90 {m['tpot_p90_ms']:.3f}), TTFT "
                  f"{m['ttft_ms']:.1f} ms, {m['k_step_calls']} K-step calls / {m['decode_steps']} steps", flush=True)
        if mode == "multistep":
            r["arrivals"] = arrivals(llm, prompt_len=args.prompt_len)
            print(f"new request arriving during a K-step call: {r['arrivals']}", flush=True)
    for b in batches:
        a, c = tokens["multistep", b], tokens["one_step", b]
        same = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(p)) for ra, rc in zip(a, c)
                for p, q in zip(ra, rc)]
        r[f"agree_batch{b}"] = dict(identical=sum(s == args.out_len for s in same), of=len(same), min_prefix=min(same))
        print(f"batch {b}: multistep vs one-step tokens: {r[f'agree_batch{b}']}", flush=True)
    if not args.skip_throughput:
        for mode in ("one_step", "multistep", "one_step", "multistep"):
            llm.engine.multistep = mode == "multistep"
            m = throughput(llm)
            r.setdefault(f"W_{mode}", []).append(m["tok_s"])
            print(f"W {mode}: {m['tok_s']:.0f} tok/s ({m['wall_s']:.2f} s)", flush=True)
    r["compilations_after_warmup"] = llm.stats()["compilations"]
    print(f"compilations after warm-up: {r['compilations_after_warmup']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
