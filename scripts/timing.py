"""Timers shared by the bench scripts: back-to-back dispatch timing, the in-process copy bandwidth, where warm-up
went, the engine step log by bucket; percentiles and the results' JSON."""
from __future__ import annotations

import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


ONE_CALL = False    # scripts' --smoke (CPU, interpret mode: a call takes ~1 s): time a single call, checking only that it runs


def time_loop(fn, x, *args, est_s: float, repeats: int = 7, donate: bool = False) -> float:
    """Seconds per application of fn(x, *args) -> same structure as x: the jitted fn is dispatched n times in a
    row, each output fed back as the next x, and timed to the last result. Dispatch is asynchronous, so for
    kernels longer than the ~20-40 us dispatch cost the GPU never waits. (A jitted fori_loop instead adds ~8 us
    per iteration on the H200: its loop condition goes through the host, which understated short kernels by
    10-20%, measured 2026-11-29.) `donate`: x is donated, so caches it carries are updated in place, as in
    the engine."""
    n = int(min(200, max(3, 3e-3 / max(est_s, 1e-7)))) if not ONE_CALL else 1
    repeats = 1 if ONE_CALL else repeats
    step = jax.jit(fn, donate_argnums=0) if donate else jax.jit(fn)
    x = jax.block_until_ready(step(x, *args))  # compile + warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            x = step(x, *args)
        jax.block_until_ready(x)
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def measure_bandwidth() -> float:
    """HBM bandwidth (bytes/s) as XLA's own elementwise pass over 2 GiB reaches it, in this process (bench.py)."""
    return copy_bandwidth(2**30 if jax.devices()[0].platform == "gpu" else 2**24)


def copy_bandwidth(n: int) -> float:
    """Bytes/s of a jitted elementwise pass over n bf16 values (read + write), best of 10."""
    x = jnp.ones((n,), jnp.bfloat16)
    neg = jax.jit(lambda x: -x)  # at 2 GiB: ~1 ms a call, so dispatch cost is noise
    neg(x).block_until_ready()
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        neg(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * n * 2 / min(times)


def warmup_breakdown(llm, total_s: float) -> dict:
    """Where `LLM(...)`'s `total_s` went: the engine's warm-up phases (compile, first runs, warm requests; with
    replicas also the other replicas' loading of replica 0's steps), the rest (weights, KV pool, tokenizer), and
    replica 0's slowest compiles."""
    engine = llm.engine
    phases = dict(getattr(engine, "warmup_phases", {}))
    runner = getattr(engine, "replicas", [engine])[0].runner
    slow = sorted(runner.compile_s.items(), key=lambda kv: -kv[1])[:5]
    by_kind = {}                                  # kind -> [programs, seconds summed]: which kinds cost the most
    for k, s in runner.compile_s.items():
        n, t = by_kind.get(k[0], (0, 0.0))
        by_kind[k[0]] = (n + 1, round(t + s, 1))
    return dict(**phases, load_and_other_s=total_s - sum(phases.values()), programs=len(runner.compile_s),
                compile_sum_s=sum(runner.compile_s.values()), compile_by_kind=by_kind,
                slowest=[{"step": "/".join(map(str, k[:4])) + ("/filtered" if k[4] else "") +
                          "".join(f"/{x}" for x in k[5:]), "s": s} for k, s in slow])


STEP_LOG_COLUMNS = ("kind", "rows", "bucket", "schedule_s", "dispatch_s", "wait_s", "apply_s", "transfer_s",
                    "table_width", "context_tokens")     # one entry of the engine's step log (LLMEngine.step_log)


def step_log_summary(log: list) -> dict:
    """Host ms per step for each (kind, bucket) of the engine's step log: where `wait` is ~0 the host, not the
    GPU, set the pace of those steps."""
    groups: dict[str, list] = {}
    for kind, _, bucket, *times in log:
        groups.setdefault(f"{kind} {bucket}", []).append(times[:5])
    out = {}
    print("host ms per step by bucket (schedule / dispatch (of it: transfer) / wait / apply):")
    for name, rows in sorted(groups.items(), key=lambda kv: (kv[0].split()[0], int(kv[0].split()[1]))):
        mean = np.mean(np.asarray(rows), axis=0) * 1e3
        out[name] = dict(steps=len(rows), **dict(zip(("schedule", "dispatch", "wait", "apply", "transfer"),
                                                     mean.tolist())))
        print(f"  {name:>14}: {len(rows):5d} steps  {mean[0]:6.2f} / {mean[1]:6.2f} ({mean[4]:5.2f}) / {mean[2]:6.2f}"
              f" / {mean[3]:6.2f}")
    return out


def pct(xs, q):
    return float(np.percentile(xs, q)) if xs else float("nan")


def write_json(path: str | None, result: dict) -> None:
    """Strict JSON: a NaN (a percentile of nothing, e.g. the TPOT of one-token outputs) is written as null."""
    if path:
        with open(path, "w") as f:
            json.dump(_no_nan(result), f, indent=2, allow_nan=False)


def _no_nan(x):
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    return [_no_nan(v) for v in x] if isinstance(x, (list, tuple)) else x
