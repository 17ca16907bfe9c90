"""Whether work skipped by `lax.cond` inside a scanned step costs a host round trip per cond on the GPU.

The xla backend's steps pad their work to a static size (decode chunks up to a budget, prefill query tiles up to
the bucket's rows): the padding is computed and thrown away. Work split in groups behind `lax.cond` (group used or
not) would skip it, if a cond inside the layers' scan does not stop the host at every layer to read its predicate.

A step: `lax.scan` over LAYERS layers; each layer does GROUPS groups of a gather + GEMM + reduce (rows of a
[P, 16, 1024] pool, as the decode chunks do), each group behind a cond on `used` (a device scalar). Timed per
call (the device busy) and for dispatch alone, all groups used and a quarter used, with XLA's default command
buffers and with WHILE / CONDITIONAL added (XLA_FLAGS, or per compile; a child process each).

    python scripts/probe_cond.py [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = "--child"
ADD = "+WHILE,+CONDITIONAL"
FULL = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"   # XLA's defaults + the two


def child(mode: str) -> dict:
    import time
    import jax
    import jax.numpy as jnp

    LAYERS, GROUPS, ITEMS, P = (28, 8, 512, 65536) if jax.default_backend() == "gpu" else (4, 4, 8, 64)
    pool = jax.random.normal(jax.random.key(0), (P, 16, 1024), jnp.bfloat16)
    print(mode, "pool made", flush=True)
    w = jnp.ones((1024, 256), jnp.bfloat16)
    ids = jax.random.randint(jax.random.key(1), (GROUPS, ITEMS), 0, P, jnp.int32)

    def group(g, x):
        dep = (x[0, 0] > 1e30).astype(jnp.int32)                  # 0, but depends on x: nothing hoisted out of the scan
        rows = pool[ids[g] + dep]                                  # [ITEMS, 16, 1024]: gathered, written out
        return x + jnp.sum(jnp.einsum("ntd,de->nte", rows, w).astype(jnp.float32), axis=(0, 1)) * 1e-9

    def step(x, used, with_cond):
        def layer(x, _):
            for g in range(GROUPS):
                if with_cond:
                    x = jax.lax.cond(g * ITEMS < used, lambda x, g=g: group(g, x), lambda x: x, x)
                else:
                    x = group(g, x)
            return x, None
        return jax.lax.scan(layer, x, None, length=LAYERS)[0]

    out = {}
    x0 = jnp.zeros((1, 256), jnp.float32)
    for name, with_cond in (("plain", False), ("cond", True)):
        f = jax.jit(lambda x, u, c=with_cond: step(x, u, c))
        if mode == "per_compile":      # the same types given to this compile alone
            f = f.lower(x0, jnp.int32(0)).compile(compiler_options={"xla_gpu_enable_command_buffer": FULL})
        for used in (GROUPS * ITEMS, GROUPS * ITEMS // 4):
            u = jnp.int32(used)
            f(x0, u).block_until_ready()
            f(x0, u).block_until_ready()
            t = time.perf_counter()
            for _ in range(10):
                y = f(x0, u)
            t_dispatch = (time.perf_counter() - t) / 10
            y.block_until_ready()
            t_all = (time.perf_counter() - t) / 10
            out[f"{name} used={used}"] = dict(ms_per_call=t_all * 1e3, dispatch_ms=t_dispatch * 1e3)
            print(mode, name, used, f"{t_all * 1e3:.3f} ms a call, dispatch {t_dispatch * 1e3:.3f} ms", flush=True)
    return out


def main():
    if len(sys.argv) > 2 and sys.argv[1] == CHILD:
        print("RESULT " + json.dumps(child(sys.argv[2])))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeout", type=float, default=60, help="seconds for each mode's child process")
    args = ap.parse_args()
    modes = {"default": "", "while_cond": f"--xla_gpu_enable_command_buffer={ADD}", "per_compile": ""}
    results = {}
    for mode, flags in modes.items():
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())
        try:
            p = subprocess.run([sys.executable, __file__, CHILD, mode], env=env, stdout=subprocess.PIPE, text=True,
                               timeout=args.timeout)
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            results[mode] = json.loads(line[0][7:]) if line else dict(error=p.stdout[-2000:])
        except subprocess.TimeoutExpired as e:
            results[mode] = dict(error=f"timed out after {args.timeout} s", output=str(e.stdout)[-2000:])
        print(mode, json.dumps(results[mode]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
