"""Data-parallel replicas stepped from one thread vs one thread each (engine/dp_engine.THREADED), in one process
(one warm-up, the same executables), alternating; then one GPU's W for the ratio:

    python scripts/probe_dp_threads.py [model] [-dp 2] [--json out.json]

Prints W output tok/s and host ms per step for each way. An experiment: the engine's way is THREADED = True.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="qwen3-0.6b")
    ap.add_argument("-dp", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from jaxinfer.xla_options import set_process_flags
    set_process_flags()               # this script owns its process, as the jaxinfer commands and bench.py do
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.engine import dp_engine
    from bench import workload
    res = {"model": a.model, "dp": a.dp}
    t = time.perf_counter()
    llm = LLM(a.model, data_parallel_size=a.dp)
    res["warmup_s"] = time.perf_counter() - t
    prompts, params = workload(256, 1024, 1024, llm.model_config.vocab_size)
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
    ntok = None
    for threaded in (True, False, True, False):
        dp_engine.THREADED = threaded
        llm.reset_prefix_cache()
        before = llm.stats()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
        after = llm.stats()
        ntok = sum(len(o.token_ids) for o in outs)
        steps = max(1, sum(after[k] - before[k] for k in ("decode_steps", "prefill_steps")))
        host = {k[5:-2]: round(1e3 * (after[k] - before[k]) / steps, 3)
                for k in ("host_schedule_s", "host_dispatch_s", "host_wait_s", "host_apply_s")}
        key = "threaded" if threaded else "one_thread"
        res.setdefault(key, []).append({"tok_s": ntok / wall, "wall_s": wall, "host_ms_per_replica_step": host})
        print(f"dp={a.dp} {key}: {ntok / wall:,.0f} tok/s ({wall:.2f} s); host ms per replica-step {host}",
              flush=True)
    res["compilations_after_warmup"] = llm.stats()["compilations"]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
