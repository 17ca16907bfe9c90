"""The engine's host work per decode step, with the device taken out: schedule, pack, apply, in ms per step.

    python scripts/bench_host.py [--rows 128 256] [--steps 300] [--json out.json]
    python scripts/bench_host.py --against /path/to/another/checkout      # in-process A/B of the host path

A data-parallel round on 2 H200s is bound by this host work (each replica's step costs the one Python thread
its schedule + pack + transfer + launch + apply; docs/performance.md), so it is measured here on its own: the
engine runs on a tiny checkpoint whose compiled step is replaced by a stub that returns a fixed ids array
(no device work, no transfer), and every step's host phases come from the engine's own step log.
`LLM.generate` over the same stub adds the facade's per-token loop.

Separate runs of this script vary by up to 2x on a small shared CPU, so `--against DIR` compares versions in
one process instead: it loads DIR's engine/{batch,scheduler,llm_engine}.py beside this checkout's and
alternates the two sets of step functions (dispatch, apply, on_dispatch, the prefill scan) on one engine,
timing `engine.step` for each in turn.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402


def tiny_llm(path: str, rows: int):
    from jaxinfer import LLM
    return LLM(path, max_num_seqs=rows, decode_buckets=(rows,), prefill_buckets=(rows * 256,),
               max_num_batched_tokens=rows * 256, max_model_len=1024, num_scheduler_steps=1,
               num_kvcache_blocks=rows * 64, block_size=16, attn_backend="xla", warmup=False)


def stub_device(engine) -> None:
    import jax
    runner = engine.runner
    ids = jax.device_put(np.zeros(runner.max_rows, np.int32))
    runner.run = lambda key, packed, source=None: ids     # the device step, taken out
    runner.put = lambda packed: packed             # and the transfer


def fill(engine, rows: int, max_tokens: int, prompt: int = 200) -> None:
    """rows running sequences, past their prefill."""
    from jaxinfer import SamplingParams
    sp = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_tokens)
    rng = np.random.default_rng(0)
    for _ in range(rows):
        engine.add_request(rng.integers(0, 500, prompt).tolist(), sp)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()
    for _ in range(10):
        engine.step()


def host_ms(llm, rows: int, steps: int) -> dict:
    engine = llm.engine
    stub_device(engine)
    fill(engine, rows, steps + 50)
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


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module                     # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def against(llm, rows: int, other: str, rounds: int = 6, steps: int = 50) -> dict:
    """engine.step ms (stubbed device) with this checkout's step functions and with `other`'s, alternating."""
    import jaxinfer.engine.llm_engine as LE
    import jaxinfer.engine.scheduler as S
    src = os.path.join(other, "jaxinfer", "engine")
    ob, os_, ole = (_load(f"other_{n}", os.path.join(src, f"{n}.py")) for n in ("batch", "scheduler", "llm_engine"))
    ole.pack, ole.bucket_for = ob.pack, ob.bucket_for

    def functions(le, s):
        return [(LE.LLMEngine, "dispatch", le.LLMEngine.dispatch), (LE.LLMEngine, "_apply", le.LLMEngine._apply),
                (S.Scheduler, "on_dispatch", s.Scheduler.on_dispatch),
                (S.Scheduler, "_schedule_prefill", s.Scheduler._schedule_prefill)]
    versions = {"this": functions(LE, S), "other": functions(ole, os_)}
    engine = llm.engine
    stub_device(engine)
    fill(engine, rows, 2 * rounds * (steps + 5) + 20)
    out = {"this": [], "other": []}
    for _ in range(rounds):
        for name, fns in versions.items():
            for cls, attr, fn in fns:
                setattr(cls, attr, fn)
            for _ in range(5):
                engine.step()
            t = time.perf_counter()
            for _ in range(steps):
                engine.step()
            out[name].append((time.perf_counter() - t) / steps * 1e3)
    for cls, attr, fn in versions["this"]:
        setattr(cls, attr, fn)
    return {k: float(np.median(v)) for k, v in out.items()} | {"rows": rows, "runs_ms": out}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--against", default=None, metavar="DIR", help="another checkout: in-process A/B")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from make_tiny_model import make_tiny_model
    from bench import write_json
    out = []
    with tempfile.TemporaryDirectory() as d:
        path = make_tiny_model(os.path.join(d, "m"), num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=16)
        for rows in a.rows:
            if a.against:
                r = against(tiny_llm(path, rows), rows, a.against)
                print(f"{rows:4d} rows: engine.step {r['this']:.3f} ms (this checkout) vs {r['other']:.3f} ms "
                      f"({a.against}), medians of alternating runs")
            else:
                llm = tiny_llm(path, rows)
                r = host_ms(llm, rows, a.steps)
                r["generate_ms_per_step"] = generate_ms(llm, rows, a.steps)
                print(f"{rows:4d} rows: host ms per step: schedule {r['schedule_ms']:.3f}, pack {r['pack_ms']:.3f}, "
                      f"apply {r['apply_ms']:.3f}; wall {r['wall_ms_per_step']:.3f}; through LLM.generate "
                      f"{r['generate_ms_per_step']:.3f} (prefill included)")
            out.append(r)
    write_json(a.json, {"host": out})
    return {"host": out}


if __name__ == "__main__":
    main()
