"""Where a step's compile time goes (issue 16's warm-up): compile single steps of a preset, alone (one thread),
with the engine's options and variants of them, weights as shapes only (no device memory needed).

    python scripts/probe_compile.py [--models qwen3-0.6b,qwen3-32b] [--json FILE]

Per model: a 256-row decode step and a 4096-token prefill step (the engine's kinds), compiled with the engine's
options and with variants of them (--decode-variants / --prefill-variants: engine, no_autotune, no_lhs,
no_command_buffers, cheap_llvm), and the decode step with its layers cut to --layers (how compile time grows)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxinfer.model.presets import preset  # noqa: E402
from jaxinfer.model.qwen3 import init_params  # noqa: E402
from jaxinfer.step import batch_layout, jit_step, make_step  # noqa: E402
from jaxinfer.xla_options import step_compiler_options  # noqa: E402


def compile_one(c, kind: str, T: int, B: int, W: int, options: dict, blocks: int = 20000) -> dict:
    params = jax.eval_shape(lambda: init_params(c))
    shape = (blocks, 16, c.num_key_value_heads, c.head_dim)
    kv = [(jax.ShapeDtypeStruct(shape, jnp.bfloat16),) * 2 for _ in range(c.num_hidden_layers)]
    packed = jax.ShapeDtypeStruct((batch_layout(T, B, W)["_size"][0],), jnp.int32)
    last = jax.ShapeDtypeStruct((256,), jnp.int32)
    t0 = time.perf_counter()
    interpret = jax.devices()[0].platform != "gpu"          # (a CPU run only checks this script)
    lowered = jit_step(make_step(c, kind, T, B, W, "pallas", interpret, 256, False, None)).lower(params, kv, packed,
                                                                                                 last)
    t1 = time.perf_counter()
    exe = lowered.compile(compiler_options=options)
    t2 = time.perf_counter()
    return dict(lower_s=round(t1 - t0, 2), compile_s=round(t2 - t1, 2), hlo_kb=len(exe.as_text()) // 1024)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-32b")
    ap.add_argument("--decode-variants", default="engine,no_autotune")
    ap.add_argument("--prefill-variants", default="engine,no_autotune")
    ap.add_argument("--layers", type=int, default=4, help="also the decode step with this many layers (0: no)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    base = step_compiler_options(jax.devices()[0].platform)
    variants = {"engine": {}, "no_autotune": {"xla_gpu_autotune_level": 0},
                "no_lhs": {"xla_gpu_enable_latency_hiding_scheduler": False},
                "no_command_buffers": {"xla_gpu_enable_command_buffer": ""},
                "cheap_llvm": {"xla_llvm_disable_expensive_passes": True}}
    rows = []
    for name in a.models.split(","):
        c = preset(name)
        cases = [("decode", 256, 256, 256, v, c) for v in a.decode_variants.split(",") if v]
        cases += [("prefill", 4096, 256, 2560, v, c) for v in a.prefill_variants.split(",") if v]
        if a.layers:
            cases.append(("decode", 256, 256, 256, "engine", dataclasses.replace(c, num_hidden_layers=a.layers)))
        for kind, T, B, W, v, cfg in cases:
            r = dict(model=name, layers=cfg.num_hidden_layers, kind=kind, T=T, B=B, W=W, variant=v)
            try:
                r.update(compile_one(cfg, kind, T, B, W, {**base, **variants[v]}))
            except Exception as err:                      # report, and go on with the other cases
                r["error"] = str(err)[:300]
            rows.append(r)
            print(json.dumps(r), flush=True)
    out = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__, rows=rows)
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
