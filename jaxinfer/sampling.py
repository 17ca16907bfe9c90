"""On-device sampling with per-row parameters: greedy, temperature, top-k, top-p, min-p.

Each row draws its randomness from `fold_in(PRNGKey(seed), counter)` where `counter` is the index of the
token being sampled, so a request's samples depend only on its own seed, never on its batch neighbours.
Sampling uses the Gumbel-max trick (argmax of logits/T + Gumbel noise), which needs no normalisation.
The full-vocabulary sort that top-k/top-p/min-p need is skipped (lax.cond) when no row asks for them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG = -1e30


def _filter_sorted(sorted_logits, top_k, top_p, min_p):
    """Mask (to -1e30) the entries of descending-sorted, temperature-scaled logits [B, V] that
    top-k / top-p / min-p exclude. The top entry always survives."""
    V = sorted_logits.shape[-1]
    rank = jnp.arange(V)[None, :]
    k = jnp.where(top_k > 0, top_k, V)[:, None]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs                 # exclusive cumulative mass
    keep = (rank < k) & (mass_before < top_p[:, None]) & (probs >= min_p[:, None] * probs[:, :1])
    keep = keep | (rank == 0)
    return jnp.where(keep, sorted_logits, _NEG)


def sample(logits, temperature, top_k, top_p, min_p, seeds, counters):
    """logits [B, V] fp32 and per-row parameters [B] -> token ids [B] int32."""
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    scaled = logits / t
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.PRNGKey(s), c))(seeds, counters)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],), jnp.float32))(keys)
    needs_filter = jnp.any((top_k > 0) | (top_p < 1.0) | (min_p > 0.0))

    def filtered(_):
        order = jnp.argsort(-scaled, axis=-1)                         # [B, V] descending
        sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
        masked = _filter_sorted(sorted_logits, top_k, top_p, min_p)
        noise = jnp.take_along_axis(gumbel, order, axis=-1)           # keeps per-token noise fixed
        pick = jnp.argmax(masked + noise, axis=-1)
        return jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)

    def plain(_):
        return jnp.argmax(scaled + gumbel, axis=-1).astype(jnp.int32)

    sampled = jax.lax.cond(needs_filter, filtered, plain, None)
    return jnp.where(temperature > 0, sampled, greedy_ids)
