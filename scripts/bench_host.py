"""The engine's host work per decode step, with the device taken out: schedule, pack, apply, in ms per step.

    python scripts/bench_host.py [--rows 128 256] [--steps 300] [--json out.json]

`LLM.generate` over the same stub adds the facade's per-token loop. A data-parallel round on 2 H200s is bound by this host work (each replica's step costs the one Python thread
its schedule + pack + transfer + launch + apply; docs/performance.md), so it is measured here on its own: the
engine runs on a tiny checkpoint whose compiled step is replaced by a stub that returns a fixed ids array
(no device work, no transfer), and every step's host phases come from the engine's own step log. A/B two
versions of the engine by running this script in each (same machine, same run); CPU numbers, not the H200
host's, but Python's costs move together.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402


def host_ms(llm, rows: int, steps: int, prompt: int = 200) -> dict:
    import jax
    engine = llm.engine
    runner = engine.runner
    ids = jax.device_put(np.zeros(runner.max_rows, np.int32))
    runner.run = lambda key, packed: ids           # the device step, taken out
    runner.put = lambda packed: packed             # and the transfer
    from jaxinfer import SamplingParams
    sp = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=steps + 50)
    rng = np.random.default_rng(0)
    for _ in range(rows):
        engine.add_request(rng.integers(0, 500, prompt).tolist(), sp)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()
    for _ in range(10):
        engine.step()
    engine.step_log = []
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - t) / steps * 1e3
    log = np.array([e[3:8] for e in engine.step_log if e[0] == "decode"]) * 1e3
    engine.step_log = None
    for s in list(engine.scheduler.running):
        engine.abort(s)
    sched, disp, wait, apply, _ = np.median(log, axis=0)
    return dict(rows=rows, wall_ms_per_step=wall, schedule_ms=float(sched), pack_ms=float(disp),
                apply_ms=float(apply + wait))


def generate_ms(llm, rows: int, steps: int, prompt: int = 200) -> float:
    """Wall ms per decode step of `LLM.generate` over the stubbed device: the engine's host work plus the
    facade's per-token loop (what a user's `generate` adds on top of `engine.step`)."""
    from jaxinfer import SamplingParams
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 500, prompt).tolist() for _ in range(rows)]
    sp = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=steps)
    t = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    return (time.perf_counter() - t) / steps * 1e3


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from make_tiny_model import make_tiny_model
    from bench import write_json
    from jaxinfer import LLM
    out = []
    with tempfile.TemporaryDirectory() as d:
        path = make_tiny_model(os.path.join(d, "m"), num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=16)
        for rows in a.rows:
            llm = LLM(path, max_num_seqs=rows, decode_buckets=(rows,), prefill_buckets=(rows * 256,),
                      max_num_batched_tokens=rows * 256, max_model_len=1024, num_scheduler_steps=1,
                      num_kvcache_blocks=rows * 64, block_size=16, attn_backend="xla", warmup=False)
            r = host_ms(llm, rows, a.steps)
            r["generate_ms_per_step"] = generate_ms(llm, rows, a.steps)
            out.append(r)
            print(f"{rows:4d} rows: host ms per step: schedule {r['schedule_ms']:.3f}, pack {r['pack_ms']:.3f}, "
                  f"apply {r['apply_ms']:.3f}; wall {r['wall_ms_per_step']:.3f}; through LLM.generate "
                  f"{r['generate_ms_per_step']:.3f} (prefill included)")
    write_json(a.json, {"host": out})
    return {"host": out}


if __name__ == "__main__":
    main()
