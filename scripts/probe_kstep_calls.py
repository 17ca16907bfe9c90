"""Why a batch-1 request's K-step calls take longer in the engine than the same program called back to back.

    python scripts/probe_kstep_calls.py [--model qwen3-0.6b] [--json out.json]

One request (a 1,024-token prompt, 128 greedy tokens, 16 steps a call) through `LLM.generate`, with:
- order: when each call was dispatched and when its ids were read (ms from the start), so that the GPU time of
  a call shows as the time between two reads while the next call was already queued;
- replay: the engine's compiled K-step program called again on the packed batches the engine sent for a second
  request, back to back, reading each call's ids after the next call is dispatched (the engine's pattern), or
  right after each call ("serial"): in the engine's order, the first batch 8 times, the last batch 8 times.
The process runs with the jaxinfer commands' XLA flags (xla_options.set_process_flags).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from jaxinfer.xla_options import set_process_flags  # noqa: E402

set_process_flags()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from bench import write_json  # noqa: E402

from jaxinfer import LLM, SamplingParams  # noqa: E402


def order(llm, prompt, sp) -> list[tuple]:
    """(event, kind or steps, start ms, end ms) of every device call ("run") and read ("read") of one request."""
    eng, r = llm.engine, llm.engine.runner
    log, t0, run, apply = [], time.perf_counter(), r.run, eng._apply

    def run_spy(key, *a):
        t = time.perf_counter()
        out = run(key, *a)
        log.append(("run", key[-1] if key[0] == "multistep" else key[0], t, time.perf_counter()))
        return out

    def apply_spy(batch, *a):
        t = time.perf_counter()
        out = apply(batch, *a)
        log.append(("read", batch.num_steps, t, time.perf_counter()))
        return out
    r.run, eng._apply = run_spy, apply_spy
    try:
        llm.generate([prompt], sp, use_tqdm=False)
    finally:
        r.run, eng._apply = run, apply
    return [(e, k, round((a - t0) * 1e3, 2), round((b - t0) * 1e3, 2)) for e, k, a, b in log]


def replay(llm, prompt, sp) -> dict:
    """ms a call of the engine's K-step program replayed on the engine's own packed batches (see the top)."""
    r, packs, run = llm.engine.runner, [], llm.engine.runner.run

    def run_spy(key, packed, *a):
        if key[0] == "multistep":
            packs.append((key, np.array(packed)))
        return run(key, packed, *a)
    r.run = run_spy
    try:
        llm.generate([prompt], sp, use_tqdm=False)
    finally:
        r.run = run
    key = packs[0][0]
    exe, batches, out = r.compile(key), [p for k, p in packs if k == key], {"key": str(key)}
    for name, seq in (("in_order", batches), ("first_x8", batches[:1] * 8), ("last_x8", batches[-1:] * 8)):
        for pattern in ("read_previous", "serial"):
            jax.block_until_ready(r.kv_caches)
            t, prev = time.perf_counter(), None
            for pk in seq:
                ids, r.kv_caches, r.last_ids = exe(r.params, r.kv_caches, pk, r.last_ids)
                ids.copy_to_host_async()
                if pattern == "serial":
                    np.asarray(ids)
                elif prev is not None:
                    np.asarray(prev)
                prev = ids
            np.asarray(prev)
            out[f"{name}_{pattern}_ms"] = ms = round((time.perf_counter() - t) * 1e3 / len(seq), 3)
            print(f"replay {name}, {pattern}: {ms:.2f} ms a call ({len(seq)} calls of {key[-1]} steps)", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    llm = LLM(a.model, num_scheduler_steps=16)
    V, L = llm.engine.model_config.vocab_size, min(1024, llm.engine.config.max_model_len - 300)
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=128)
    rng = np.random.default_rng(0)
    res = dict(model=a.model, orders=[order(llm, rng.integers(0, V, L).tolist(), sp) for _ in range(2)])
    for e in res["orders"][-1]:
        print("  ", *e, flush=True)
    reads = [e for e in res["orders"][-1] if e[0] == "read" and e[1] > 1]
    res["read_to_read_ms"] = [round(b[3] - a[3], 2) for a, b in zip(reads, reads[1:])]
    print("ms between reads of consecutive K-step calls:", res["read_to_read_ms"], flush=True)
    res["replay"] = replay(llm, rng.integers(0, V, L).tolist(), sp)
    write_json(a.json, res)


if __name__ == "__main__":
    main()
