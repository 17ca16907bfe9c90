"""Where the plain draw's time goes (the Gumbel-max argmax over [B, V] that every step runs):

    python scripts/probe_draw.py [--rows 8 64 256] [--vocab 151936] [--json out.json]

Times, in ms per call on fp32 logits already on the device, the engine's draw (`sampling.sample`, unfiltered) and
variants that isolate its parts: the argmax without noise, the maximum alone (one output instead of a value and
an index), the noise summed alone, and two exact reformulations (a max pass, then the first index reaching it;
the exponential race argmax(exp(x / T - max) / -log(u)), one log and one exp instead of two logs); and the
top-64 candidate search of the no-sort filtered draw (`sampling.top_n_of`) by chunk size.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def forms():
    import jax.numpy as jnp

    from jaxinfer.sampling import gumbel_noise, sample

    def scaled(lg, t):
        return lg / t[:, None]

    def uniform_neglog(lg, seeds, counters):          # -log(u) from the same hash: exp(-g) of gumbel_noise
        return jnp.exp(-gumbel_noise(seeds, counters, lg.shape[-1]))

    def two_pass(lg, t, seeds, counters):
        z = scaled(lg, t) + gumbel_noise(seeds, counters, lg.shape[-1])
        m = jnp.max(z, axis=-1, keepdims=True)
        return jnp.min(jnp.where(z >= m, jnp.arange(lg.shape[-1]), lg.shape[-1]), axis=-1)

    def race(lg, t, seeds, counters):
        x = scaled(lg, t)
        p = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
        return jnp.argmax(p / uniform_neglog(lg, seeds, counters), axis=-1)

    from jaxinfer.sampling import top_n_of

    def top64(chunk):             # the no-sort filtered draw's candidate search (sampling.top_n_of), by chunk size
        return lambda lg, t, s, c: top_n_of(scaled(lg, t), 64, chunk)[1][:, 0]

    zeros = lambda t: jnp.zeros(t.shape, jnp.int32)
    return {**{f"top64_chunk{k}": top64(k) for k in (16, 32, 64, 128, 256)},
        "engine": lambda lg, t, s, c: sample(lg, t, zeros(t), t * 0 + 1, t * 0, s, c, False),
        "argmax_no_noise": lambda lg, t, s, c: jnp.argmax(scaled(lg, t), axis=-1),
        "max_with_noise": lambda lg, t, s, c: jnp.max(scaled(lg, t) + gumbel_noise(s, c, lg.shape[-1]), axis=-1),
        "noise_sum": lambda lg, t, s, c: jnp.sum(gumbel_noise(s, c, lg.shape[-1]), axis=-1),
        "two_pass": two_pass,
        "race": race,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp

    from bench import write_json
    from timing import time_loop
    out = {}
    for rows in a.rows:
        logits = jax.random.normal(jax.random.PRNGKey(rows), (rows, a.vocab), jnp.float32) * 4
        t = jnp.full((rows,), 0.6, jnp.float32)
        seeds = jnp.arange(rows, dtype=jnp.int32)
        for name, f in forms().items():
            def call(state, f=f):               # counters move, so each call draws anew; nothing is constant
                lg, t, s, c = state
                r = f(lg, t, s, c)
                return lg, t, s, c + 1 + (r.astype(jnp.int32) == -123456789)      # (keeps r alive)
            ms = time_loop(call, (logits, t, seeds, jnp.zeros((rows,), jnp.int32)), est_s=1e-4) * 1e3
            out.setdefault(str(rows), {})[name] = ms
            print(f"rows {rows:4d}: {name:16s} {ms:7.3f} ms", flush=True)
    r = dict(device=str(jax.devices()[0]), vocab=a.vocab, ms=out)
    write_json(a.json, r)
    return r


if __name__ == "__main__":
    main()
