"""Filtered sampling on the device: the plain draw against top-k / top-p / min-p (a stable sort of every row).

    python scripts/bench_sampling.py [--rows 8 64 256] [--vocab 151936] [--draws auto threshold ids ids_float]
                                     [--json F]

Times `sampling.sample` alone on logits already on the device, in ms per call. "sort": half the rows ask for
top_k=50, all for top_p=0.9 (temperature 0.8); "top_p": top_p=0.95 alone (temperature 0.8); "qwen3_*": Qwen3's
generation config (top_k=20, top_p=0.95, temperature 0.6), sorted or by the rows' top candidates
(filtered="top_k", `--candidates` of them). The sorted forms run once per `--draws` entry: "" the engine's
(`sampling.SORTED_DRAW="auto"`), "_threshold" values sorted alone, "_ids" sorted with their ids on uint32 keys,
"_ids_float" on float keys; the JSON's "cub" says which ones XLA handed to CUB's radix sort. A filtered decode
step on W's 256 rows cost ~3.5 ms more than a plain one on the H200 (docs/performance.md, ninth run); this is the
part the draw itself takes. (A sort-free form, radix
searches over the row in plain jnp, measured 1.3-5.4x slower than the sort at 8-256 rows and was dropped:
docs/performance.md, tenth run.)
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


DRAWS = {"auto": ("auto", "uint32"), "threshold": ("threshold", "uint32"), "ids": ("ids", "uint32"),
         "ids_float": ("ids", "float")}


def time_forms(rows: int, vocab: int, candidates: tuple[int, ...], draws: tuple[str, ...] = ("auto",),
               cub: dict | None = None) -> dict:
    import jax
    import jax.numpy as jnp

    import jaxinfer.sampling as sampling
    from timing import time_loop
    logits = jax.random.normal(jax.random.PRNGKey(rows), (rows, vocab), jnp.float32) * 4
    full = lambda v, dt: jnp.full((rows,), v, dt)
    mixed = (full(0.8, jnp.float32), jnp.where(jnp.arange(rows) % 2 == 0, 50, 0).astype(jnp.int32),
             full(0.9, jnp.float32), full(0.0, jnp.float32))
    qwen3 = (full(0.6, jnp.float32), full(20, jnp.int32), full(0.95, jnp.float32), full(0.0, jnp.float32))
    top_p = (full(0.8, jnp.float32), full(0, jnp.int32), full(0.95, jnp.float32), full(0.0, jnp.float32))
    forms = [("plain", False, mixed, 0, None)]
    for d in draws:                # how rows that need the sort draw (sampling.SORTED_DRAW, SORT_KEYS): DRAWS
        tag = "" if d == "auto" else f"_{d}"
        forms += [(f"sort{tag}", True, mixed, 0, d), (f"top_p{tag}", True, top_p, 0, d),
                  (f"qwen3_sort{tag}", True, qwen3, 0, d)]
    forms += [(f"qwen3_top_k_{n}", "top_k", qwen3, n, None) for n in candidates]
    out = {}
    for form, filtered, per_row, n, d in forms:
        sampling.SORTED_DRAW, sampling.SORT_KEYS = DRAWS[d or "auto"]
        def draw(state, filtered=filtered, n=n or sampling.TOP_K_CANDIDATES):  # the counters move: each call draws
            lg, counters, per_row = state     # anew; the parameters are arguments XLA cannot fold, as in the engine
            ids = sampling.sample(lg, *per_row, jnp.arange(rows, dtype=jnp.int32), counters, filtered=filtered,
                                  candidates=n)
            return lg, counters + 1 + jnp.minimum(ids, 0), per_row     # (ids >= 0: keeps the draw alive)
        state = (logits, jnp.zeros((rows,), jnp.int32), per_row)
        if filtered is True:           # whether XLA handed the sort to CUB (a radix-sort custom call)
            hlo = jax.jit(draw).lower(state).compile().as_text()
            if cub is not None:
                cub[form] = "cub_sort" in hlo.lower() or "radixsort" in hlo.lower()
        s = time_loop(draw, state, est_s=1e-3)
        out[form] = s * 1e3
        tag = " (CUB)" if (cub or {}).get(form) else ""
        print(f"rows {rows:4d}, vocab {vocab}: {form:16s} {s * 1e3:8.3f} ms{tag}", flush=True)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--candidates", type=int, nargs="+", default=[64],
                    help="TOP_K_CANDIDATES values to time the no-sort draw with (Qwen3's top_k=20, top_p=0.95)")
    ap.add_argument("--draws", nargs="+", default=list(DRAWS), choices=list(DRAWS),
                    help="how rows that need the sort draw: the engine's choice, by threshold, sorted with their "
                         "ids on uint32 keys, or on float keys (the draw before both changes)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import jax
    from bench import write_json
    cub = {}           # per row count: which sorted draws XLA handed to CUB's radix sort
    r = dict(device=str(jax.devices()[0]), vocab=a.vocab, cub=cub,
             ms={str(n): time_forms(n, a.vocab, tuple(a.candidates), tuple(a.draws), cub.setdefault(str(n), {}))
                 for n in a.rows})
    write_json(a.json, r)
    return r


if __name__ == "__main__":
    main()
