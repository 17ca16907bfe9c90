"""Filtered sampling on the device: the plain draw against top-k / top-p / min-p (a stable sort of every row).

    python scripts/bench_sampling.py [--rows 8 64 256] [--vocab 151936] [--json out.json]

Times `sampling.sample` alone on logits already on the device, in ms per call. Half the rows ask for top_k=50,
all for top_p=0.9 (temperature 0.8). A filtered decode step on W's 256 rows cost ~3.5 ms more than a plain one
on the H200 (docs/performance.md, ninth run); this is the part the draw itself takes. (A sort-free form, radix
searches over the row in plain jnp, measured 1.3-5.4x slower than the sort at 8-256 rows and was dropped:
docs/performance.md, tenth run.)
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def time_forms(rows: int, vocab: int) -> dict:
    import jax
    import jax.numpy as jnp

    import jaxinfer.sampling as sampling
    from timing import time_loop
    logits = jax.random.normal(jax.random.PRNGKey(rows), (rows, vocab), jnp.float32) * 4
    per_row = (jnp.full((rows,), 0.8, jnp.float32), jnp.where(jnp.arange(rows) % 2 == 0, 50, 0).astype(jnp.int32),
               jnp.full((rows,), 0.9, jnp.float32), jnp.zeros((rows,), jnp.float32), jnp.arange(rows, dtype=jnp.int32))
    out = {}
    for form, filtered in (("plain", False), ("sort", True)):
        def draw(state, filtered=filtered):        # the counters move, so every call draws anew
            lg, counters = state
            ids = sampling.sample(lg, *per_row[:4], per_row[4], counters, filtered=filtered)
            return lg, counters + 1 + jnp.minimum(ids, 0)     # (ids >= 0: keeps the draw alive)
        s = time_loop(draw, (logits, jnp.zeros((rows,), jnp.int32)), est_s=1e-3)
        out[form] = s * 1e3
        print(f"rows {rows:4d}, vocab {vocab}: {form:6s} {s * 1e3:8.3f} ms", flush=True)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import jax
    from bench import write_json
    r = dict(device=str(jax.devices()[0]), vocab=a.vocab,
             ms={str(n): time_forms(n, a.vocab) for n in a.rows})
    write_json(a.json, r)
    return r


if __name__ == "__main__":
    main()
