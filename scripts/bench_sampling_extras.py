"""What logprobs, penalties and structured outputs cost on the throughput workload (W), in one process: one warm-up,
the same executables, the variants timed in turn (twice each) so machine drift hits all of them alike.

    python scripts/bench_sampling_extras.py [model] [--logprobs 5] [--penalty 0.5] [--regex RE] [--json out.json]

Variants: plain (the W workload as bench.py runs it); every request with logprobs=N; every request with
presence_penalty = frequency_penalty = X and repetition_penalty = 1 + X / 10 (--structured-only: neither); with
--schema, every request under structured_outputs {"json": SCHEMA}; with --regex, every request under
structured_outputs {"regex": RE} (grammar.py: a bitmask per row, written once the step before it is read; W's
ignore_eos keeps the output lengths). Prints output tok/s of each and the ratio to plain (issue targets: logprobs=5
costs <= 10%, penalties <= 5%).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="qwen3-0.6b")
    ap.add_argument("--logprobs", type=int, default=5)
    ap.add_argument("--penalty", type=float, default=0.5)
    ap.add_argument("--regex", default=None, help='a structured_outputs regex variant too (e.g. "[a-z ]+")')
    ap.add_argument("--schema", default=None, help='a structured_outputs json variant too (a JSON schema, e.g. '
                    '\'{"type": "object", "properties": {"text": {"type": "string"}}}\')')
    ap.add_argument("--structured-only", action="store_true", help="plain and the structured variants alone")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-len", type=int, default=1024, help="longest prompt and output (W: 1024)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from jaxinfer.xla_options import set_process_flags
    set_process_flags()                    # as bench.py and the jaxinfer commands: this process is ours
    from bench import workload
    from jaxinfer import LLM, SamplingParams
    t = time.perf_counter()
    llm = LLM(a.model)
    warmup_s = time.perf_counter() - t
    prompts, plain = workload(a.num_seqs, a.max_len, a.max_len, llm.model_config.vocab_size)
    variants = {
        "plain": plain,
        f"logprobs={a.logprobs}": [replace(p, logprobs=a.logprobs) for p in plain],
        f"penalties={a.penalty}": [replace(p, presence_penalty=a.penalty, frequency_penalty=a.penalty,
                                           repetition_penalty=1 + a.penalty / 10) for p in plain],
    }
    if a.structured_only:
        variants = {"plain": plain}
    if a.regex:
        variants["regex"] = [replace(p, structured_outputs={"regex": a.regex}) for p in plain]
    if a.schema:
        variants["json"] = [replace(p, structured_outputs={"json": json.loads(a.schema)}) for p in plain]
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
    t = time.perf_counter()
    for params in list(variants.values())[1:]:        # their step variants, before anything is timed
        llm.engine.warmup_extras(params[0])
    extras_s = time.perf_counter() - t
    before = llm.stats()["compilations"]
    res = {"model": a.model, "warmup_s": warmup_s, "extras_compile_s": extras_s, "runs": {k: [] for k in variants}}
    for _ in range(a.rounds):
        for name, params in variants.items():
            llm.reset_prefix_cache()
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t
            tok = sum(len(o.token_ids) for o in outs)
            res["runs"][name].append(tok / wall)
            print(f"{name:>16}: {tok / wall:9,.0f} tok/s ({wall:.2f} s)", flush=True)
    best = {k: max(v) for k, v in res["runs"].items()}
    res["ratio_to_plain"] = {k: v / best["plain"] for k, v in best.items()}
    res["compilations_during_runs"] = llm.stats()["compilations"] - before
    print("best of each, relative to plain: " + ", ".join(f"{k} {v:.3f}" for k, v in res["ratio_to_plain"].items())
          + f"; compilations during the timed runs: {res['compilations_during_runs']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
