"""Where a decode step's host time goes, for one GPU, data-parallel replicas and a tensor-parallel mesh.

    python scripts/probe_dispatch.py --tp 1 --dp 2 --json out.json [--profile DIR]

Builds the engine as `LLM` does (random weights of a preset), with one decode bucket of B rows per replica
and few other buckets so that it starts quickly; fills every replica with B sequences (prompt 512 tokens,
then decoding), and measures:
- engine steps: host ms per step (schedule / dispatch / wait / apply) and wall ms per step, over N steps;
- raw calls: the compiled decode step called again and again on the last packed batch (no Python
  scheduling): host ms per call, and wall ms per call, first back to back, then with the device idle before
  each call (if a call blocks until the previous step has run, its host time is the step's GPU time);
- with --profile: a jax.profiler trace of a few engine steps, summarised for the device (kernels, gaps) and
  for the host threads (the events that took the most time).
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
from bench import write_json  # noqa: E402


def engine_steps(engine, n: int) -> dict:
    engine.step_log = []
    before = engine.stats()["decode_steps"]
    t = time.perf_counter()
    for _ in range(n):
        engine.step()
    wall = time.perf_counter() - t
    decode = engine.stats()["decode_steps"] - before       # per replica, summed (K per call with --steps-per-call)
    log = np.array([e[3:8] for e in engine.step_log]) * 1e3
    engine.step_log = None
    cols = ("schedule", "dispatch", "wait", "apply", "transfer")
    return dict(steps=n, wall_ms_per_step=wall * 1e3 / n, replica_steps=len(log),
                wall_ms_per_decode_round=wall * 1e3 * len(getattr(engine, "replicas", [engine])) / max(decode, 1),
                host_ms_per_replica_step={c: float(log[:, i].mean()) for i, c in enumerate(cols)})


def raw_calls(runners, n: int) -> dict:
    """Call each runner's decode step n times (round robin), on the batch its last step sent."""
    import jax
    keys = [max((k for k in r.compiled if k[0] == "decode"), key=lambda k: k[2]) for r in runners]
    packed = [r.placement.put(r.last_packed) for r in runners]      # on the device already: the call alone
    for r in runners:
        jax.block_until_ready(r.last_ids)
    host = []
    t = time.perf_counter()
    for _ in range(n):
        for r, k, p in zip(runners, keys, packed):
            t0 = time.perf_counter()
            r.run(k, p)
            host.append(time.perf_counter() - t0)
    for r in runners:
        jax.block_until_ready(r.last_ids)
    wall = time.perf_counter() - t
    idle_host, gpu = [], []
    for _ in range(max(5, n // 10)):
        for r, k, p in zip(runners, keys, packed):
            t0 = time.perf_counter()
            r.run(k, p)
            t1 = time.perf_counter()
            jax.block_until_ready(r.last_ids)
            idle_host.append(t1 - t0)
            gpu.append(time.perf_counter() - t0)
    return dict(calls_per_runner=n, wall_ms_per_round=wall * 1e3 / n,
                host_ms_per_call_back_to_back=float(np.median(host) * 1e3),
                host_ms_per_call_p90=float(np.percentile(host, 90) * 1e3),
                host_ms_per_call_device_idle=float(np.median(idle_host) * 1e3),
                call_plus_sync_ms=float(np.median(gpu) * 1e3), key=str(keys[0]))


def double_exe(runner, n: int) -> dict:
    """Raw calls alternating between two loaded copies of the decode step (one compile, serialized and loaded
    twice) against calls of one copy: without the SKIP_TEMP mode a launch waits while its own CUDA graph is
    updated; if that wait is per copy, two copies taking turns would not wait (the lever for running the fast
    mode without touching XLA_FLAGS)."""
    import jax
    from jax.experimental.serialize_executable import deserialize_and_load, serialize
    key = max((k for k in runner.compiled if k[0] == "decode" and not k[4]), key=lambda k: k[2])
    exe = runner.compile(key)
    exes = [exe, deserialize_and_load(*serialize(exe))]
    packed = runner.placement.put(runner.last_packed)
    out = {}
    for name, pool in (("one_copy", exes[:1]), ("two_copies", exes)):
        jax.block_until_ready(runner.last_ids)
        host = []
        t = time.perf_counter()
        for i in range(n):
            t0 = time.perf_counter()
            runner.last_ids, runner.kv_caches = pool[i % len(pool)](runner.params, runner.kv_caches, packed,
                                                                    runner.last_ids)
            host.append(time.perf_counter() - t0)
        jax.block_until_ready(runner.last_ids)
        out[name] = dict(wall_ms_per_call=(time.perf_counter() - t) * 1e3 / n,
                         host_ms_per_call=float(np.median(host) * 1e3))
    return out


def gil_check(runner, n: int = 20) -> dict:
    """Python progress of another thread while this one launches steps (device idle before each launch),
    against its progress while this thread sleeps as long: ~1 means the launch releases the GIL."""
    import threading

    import jax
    key = max((k for k in runner.compiled if k[0] == "decode" and not k[4]), key=lambda k: k[2])
    packed = runner.placement.put(runner.last_packed)
    count, stop = [0], threading.Event()

    def spin():
        while not stop.is_set():
            count[0] += 1
    th = threading.Thread(target=spin)
    th.start()
    launch_s, launch_n, sleep_n = 0.0, 0, 0
    for _ in range(n):
        jax.block_until_ready(runner.last_ids)
        c0, t0 = count[0], time.perf_counter()
        runner.run(key, packed)
        dt = time.perf_counter() - t0
        launch_s, launch_n = launch_s + dt, launch_n + count[0] - c0
        c0 = count[0]
        time.sleep(dt)
        sleep_n += count[0] - c0
    stop.set()
    th.join()
    jax.block_until_ready(runner.last_ids)
    return dict(launch_ms=launch_s * 1e3 / n, spins_during_launch=launch_n, spins_during_sleep=sleep_n,
                ratio=launch_n / max(sleep_n, 1))


def threaded_steps(engine, n: int, switch_interval: float | None = None) -> dict:
    """engine_steps with each replica's step in its own thread, a barrier per round (as DPEngine could)."""
    from concurrent.futures import ThreadPoolExecutor
    old = sys.getswitchinterval()
    if switch_interval:
        sys.setswitchinterval(switch_interval)
    pool = ThreadPoolExecutor(len(engine.replicas))
    step = type(engine).step

    def threaded(self):
        active = [r for r in self.replicas if r.has_unfinished() or r.in_flight is not None]
        futures = [pool.submit(r.step) for r in active]
        return [s for f in futures for s in f.result()]
    type(engine).step = threaded
    try:
        out = engine_steps(engine, n)
    finally:
        type(engine).step = step
        sys.setswitchinterval(old)
        pool.shutdown()
    return out


def host_events(trace_dir: str, top: int = 60) -> list[dict]:
    """The host-side trace events that took the most time (summed by name; nested events count twice)."""
    from collections import defaultdict

    from jax._src.profiler import ProfileData

    from trace_summary import _newest_xplane
    data = ProfileData.from_file(_newest_xplane(trace_dir))
    total, count = defaultdict(float), defaultdict(int)
    for p in data.planes:
        if p.name.startswith("/device:"):
            continue
        for line in p.lines:
            for e in line.events:
                name = f"{line.name[:24]} | {e.name[:90]}"
                total[name] += e.duration_ns / 1e6
                count[name] += 1
    rows = sorted(total.items(), key=lambda kv: -kv[1])[:top]
    return [dict(event=n, ms=round(ms, 3), count=count[n]) for n, ms in rows]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--rows", type=int, default=128, help="sequences per replica (its decode bucket)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-process-flags", action="store_true",
                    help="leave XLA_FLAGS as they are (no SKIP_TEMP mode), e.g. to try --compile-option instead")
    ap.add_argument("--double-exe", action="store_true", help="also time two loaded copies of the step taking turns")
    ap.add_argument("--steps-per-call", type=int, default=1, metavar="K",
                    help="K decode steps per device call at this bucket (an experiment: the engine compiles K-step "
                         "variants for batches of up to 8 rows only)")
    ap.add_argument("--compile-option", action="append", default=[], metavar="KEY=VALUE",
                    help="one more XLA option for every compiled step (e.g. "
                         "xla_gpu_command_buffer_update_mode=SKIP_TEMP)")
    a = ap.parse_args(argv)

    from jaxinfer.xla_options import set_process_flags
    if not a.no_process_flags:
        set_process_flags()
    import jax

    if a.compile_option:
        from jaxinfer.engine import extras, runner
        def value(v: str):
            return {"true": True, "false": False}.get(v.lower(), int(v) if v.lstrip("-").isdigit() else v)
        extra = {k: value(v) for k, v in (kv.split("=", 1) for kv in a.compile_option)}
        for mod in (runner, extras):
            base = mod.step_compiler_options
            mod.step_compiler_options = (lambda base: lambda *args: {**base(*args), **extra})(base)

    if a.steps_per_call > 1:
        from jaxinfer.engine import runner
        runner.MULTISTEP_MAX_ROWS = a.rows          # this process only: K-step variants at the probe's bucket
    from jaxinfer import LLM, SamplingParams
    t = time.perf_counter()
    llm = LLM(a.model, tensor_parallel_size=a.tp, data_parallel_size=a.dp, max_num_seqs=a.rows,
              decode_buckets=(a.rows,), prefill_buckets=(4096,), max_num_batched_tokens=4096,
              max_model_len=2048, num_scheduler_steps=a.steps_per_call)
    warm = time.perf_counter() - t
    engine = llm.engine
    replicas = getattr(engine, "replicas", [engine])
    runners = [r.runner for r in replicas]
    for r in runners:                    # keep the last packed batch of each runner (raw calls reuse it)
        put = r.put
        r.put = (lambda put, r: lambda x: (setattr(r, "last_packed", x), put(x))[1])(put, r)
    rng = np.random.default_rng(0)
    sp = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1000)
    for _ in range(a.rows * a.dp):
        engine.add_request([int(x) for x in rng.integers(0, min(10000, llm.model_config.vocab_size), 512)], sp)
    while any(r.scheduler.waiting for r in replicas) or any(
            s.num_computed_tokens < s.num_prompt_tokens for r in replicas for s in r.scheduler.running):
        engine.step()
    for _ in range(20):
        engine.step()
    out = dict(model=a.model, tp=a.tp, dp=a.dp, rows=a.rows, warmup_s=warm, devices=str(jax.devices()),
               xla_flags=os.environ.get("XLA_FLAGS", ""), compile_options=a.compile_option)
    out["engine"] = engine_steps(engine, a.steps)
    if a.steps_per_call == 1:            # the one-step call's anatomy (K-step runs time the engine only)
        out["raw"] = raw_calls(runners, a.steps)
        if a.dp > 1:
            out["raw_one_replica"] = raw_calls(runners[:1], a.steps)
        if a.double_exe:
            out["double_exe"] = double_exe(runners[0], a.steps)
        out["gil"] = gil_check(runners[0])
        if a.dp > 1:
            out["engine_threaded"] = threaded_steps(engine, a.steps)
            out["engine_threaded_switch_0.2ms"] = threaded_steps(engine, a.steps, 2e-4)
    out["engine_again"] = engine_steps(engine, a.steps)
    if a.profile:
        from trace_summary import summarize
        with jax.profiler.trace(a.profile):
            engine_steps(engine, 20)
        out["profile_device"] = summarize(a.profile, top=15, steps=20)
        out["profile_host"] = host_events(a.profile)
    out["compilations_after_warmup"] = llm.stats()["compilations"]
    print(json.dumps(out, indent=1))
    write_json(a.json, out)
    return out


if __name__ == "__main__":
    main()
