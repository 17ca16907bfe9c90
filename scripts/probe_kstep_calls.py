"""Whether a batch-1 request's K-step calls take the GPU time the same program takes when replayed back to back.

    python scripts/probe_kstep_calls.py [--model qwen3-0.6b] [--json out.json] [--profile DIR]

One request (a 1,024-token prompt, 128 greedy tokens, 16 steps a call) through `LLM.generate`, with:
- order: when each call was dispatched and when its ids were read (ms from the start), so that the GPU time of
  a call shows as the time between two reads while the next call was already queued;
- replay: the engine's compiled K-step program called again on the packed batches the engine sent for a second
  request, each call starting from the last ids the engine's call started from (a row given -1 is masked: it
  does no attention), back to back, reading each call's ids after the next call is dispatched (the engine's
  pattern), or right after each call ("serial"): in the engine's order, the first call 8 times, the last 8 times.
--profile: a trace of one more request through the engine and of the in-order replay (read_previous), each
summarised: kernels, GPU busy and idle, the gaps between kernels over 20 us, the kernels only one side ran.
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
from trace_summary import _group, _kernel_events, _newest_xplane, profiled  # noqa: E402

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


def trace_facts(trace_dir: str) -> dict:
    """Kernels by name, busy and idle ms, and the gaps over 20 us between consecutive kernels of a trace."""
    from collections import Counter

    from jax._src.profiler import ProfileData
    ev = sorted(_kernel_events(ProfileData.from_file(_newest_xplane(trace_dir))), key=lambda e: e[1])
    if not ev:
        return dict(kernels=0)
    gaps, end, calls, ms = [], ev[0][2], [[ev[0][1], 0.0]], Counter()
    for n, s, e in ev:
        if s - end > 20_000:
            gaps.append(round((s - end) / 1e3, 1))
        if s - end > 200_000:                        # a new call: its start and the ms its kernels ran
            calls.append([s, 0.0])
        end = max(end, e)
        calls[-1][1] += (e - s) / 1e6
        ms[_group(n)] += (e - s) / 1e6
    span = (end - ev[0][1]) / 1e6
    busy = sum(e - s for _, s, e in ev) / 1e6
    return dict(kernels=len(ev), span_ms=round(span, 3), kernel_ms=round(busy, 3), gaps_over_20us=len(gaps),
                gap_ms=round(sum(gaps) / 1e3, 3), largest_gaps_us=sorted(gaps)[-12:],
                calls_kernel_ms=[round(c[1], 3) for c in calls],
                names=dict(Counter(_group(n) for n, _, _ in ev)), names_ms={n: round(v, 3) for n, v in ms.items()})


def compare(a: dict, b: dict) -> dict:
    """Kernel names whose counts differ between two trace_facts (a's count, b's count)."""
    names = set(a.get("names", {})) | set(b.get("names", {}))
    counts = {n: (a["names"].get(n, 0), b["names"].get(n, 0)) for n in sorted(names)
              if a["names"].get(n, 0) != b["names"].get(n, 0)}
    ms = {n: (a["names_ms"].get(n, 0), b["names_ms"].get(n, 0)) for n in names}
    slower = sorted(ms.items(), key=lambda kv: kv[1][1] - kv[1][0])[:15]   # the most ms more in a than in b
    return dict(counts=counts, most_ms_more_in_first={n: v for n, v in slower})


def replay(llm, prompt, sp, profile: str | None = None) -> dict:
    """ms a call of the engine's K-step program replayed on the engine's own packed batches (see the top)."""
    r, packs, run = llm.engine.runner, [], llm.engine.runner.run

    def run_spy(key, packed, *a):
        if key[0] == "multistep":     # with the last ids the call starts from (a row given -1 is masked)
            packs.append((key, np.array(packed), np.array(r.last_ids)))
        return run(key, packed, *a)
    r.run = run_spy
    try:
        llm.generate([prompt], sp, use_tqdm=False)
    finally:
        r.run = run
    key = packs[0][0]
    exe, calls, out = r.compile(key), [(p, ids) for k, p, ids in packs if k == key], {"key": str(key)}
    runs = [(n, s, p, None) for n, s in (("in_order", calls), ("first_x8", calls[:1] * 8),
                                          ("last_x8", calls[-1:] * 8)) for p in ("read_previous", "serial")]
    if profile:
        runs.append(("in_order", calls, "read_previous", os.path.join(profile, "replay")))
    for name, seq, pattern, trace_dir in runs:
        jax.block_until_ready(r.kv_caches)
        with profiled(trace_dir):
            t, prev = time.perf_counter(), None
            for i, (pk, last) in enumerate(seq):
                if i == 0 or name != "in_order":   # in order, each call starts from the ids the one before gave
                    r.last_ids = jax.device_put(last, r.last_ids.sharding)
                ids, r.kv_caches, r.last_ids = exe(r.params, r.kv_caches, pk, r.last_ids)
                ids.copy_to_host_async()
                if pattern == "serial":
                    np.asarray(ids)
                elif prev is not None:
                    np.asarray(prev)
                prev = ids
            np.asarray(prev)
            ms = round((time.perf_counter() - t) * 1e3 / len(seq), 3)
        if trace_dir:
            out["trace"] = trace_facts(trace_dir)
            print("replay traced:", ms, "ms a call;", {k: v for k, v in out["trace"].items() if not k.startswith("names")})
            continue
        out[f"{name}_{pattern}_ms"] = ms
        print(f"replay {name}, {pattern}: {ms:.2f} ms a call ({len(seq)} calls of {key[-1]} steps)", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default=None, help="a directory for the two traces")
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
    if a.profile:
        with profiled(os.path.join(a.profile, "engine")):
            res["orders"].append(order(llm, rng.integers(0, V, L).tolist(), sp))
        res["engine_trace"] = trace_facts(os.path.join(a.profile, "engine"))
        print("engine traced:", {k: v for k, v in res["engine_trace"].items() if not k.startswith("names")})
    res["replay"] = replay(llm, rng.integers(0, V, L).tolist(), sp, a.profile)
    if a.profile:
        with profiled(os.path.join(a.profile, "engine_after")):
            res["orders"].append(order(llm, rng.integers(0, V, L).tolist(), sp))
        res["engine_after_trace"] = t = trace_facts(os.path.join(a.profile, "engine_after"))
        print("engine traced after the replay:", {k: v for k, v in t.items() if not k.startswith("names")})
        res["kernels_differ"] = compare(res["engine_trace"], res["replay"]["trace"])
        print("kernels (engine, replay):", res["kernels_differ"], flush=True)
    write_json(a.json, res)


if __name__ == "__main__":
    main()
