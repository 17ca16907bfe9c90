"""Which sorts of [rows, 151936] XLA GPU hands to CUB's radix sort, and what each costs (the filtered draw's sort).

    python scripts/probe_sort.py [--rows 256 64 8] [--json out.json]

Forms: uint32 keys with int32 / uint32 ids as payload (stable or not), uint32 keys alone, float32 alone, and
float32 keys with int32 ids (stable: what `sampling.sort_descending` did with SORT_KEYS="float"). Prints ms per
call (20 calls after two warm ones) and whether the compiled program calls CUB (a "cub_sort" custom call).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 64, 8])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp
    x = jax.random.normal(jax.random.PRNGKey(0), (max(a.rows), a.vocab))
    u = jax.lax.bitcast_convert_type(x, jnp.uint32)
    ids = jnp.broadcast_to(jnp.arange(a.vocab, dtype=jnp.int32), x.shape)
    sort = jax.lax.sort
    cases = {
        "u32_s32_stable": lambda u, i, x: sort((u, i), dimension=-1, is_stable=True, num_keys=1),
        "u32_s32_unstable": lambda u, i, x: sort((u, i), dimension=-1, is_stable=False, num_keys=1),
        "u32_u32_stable": lambda u, i, x: sort((u, i.astype(jnp.uint32)), dimension=-1, is_stable=True, num_keys=1),
        "u32_alone": lambda u, i, x: sort(u, dimension=-1),
        "f32_alone": lambda u, i, x: sort(x, dimension=-1),
        "f32_s32_stable": lambda u, i, x: sort((x, i), dimension=-1, is_stable=True, num_keys=1),
    }
    out = {"device": str(jax.devices()[0]), "vocab": a.vocab, "ms": {}, "cub": {}}
    for name, f in cases.items():
        for rows in a.rows:
            args = (u[:rows], ids[:rows], x[:rows])
            c = jax.jit(f).lower(*args).compile()
            cub = "cub_sort" in c.as_text().lower() or "radixsort" in c.as_text().lower()
            jax.block_until_ready(c(*args))
            jax.block_until_ready(c(*args))
            t = time.perf_counter()
            for _ in range(20):
                r = c(*args)
            jax.block_until_ready(r)
            ms = (time.perf_counter() - t) / 20 * 1e3
            out["ms"].setdefault(name, {})[str(rows)] = ms
            out["cub"].setdefault(name, {})[str(rows)] = cub
            print(f"{name:18s} rows {rows:3d}: {ms:7.3f} ms  cub={cub}", flush=True)
    from bench import write_json
    write_json(a.json, out)
    return out


if __name__ == "__main__":
    main()
