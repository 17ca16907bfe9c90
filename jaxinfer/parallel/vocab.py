"""The extras step (extras_step.py) on logits split by vocabulary over the mesh axis "tp", never gathered whole.

Each device edits its own columns (`over_vocab`: logit bias, penalties, bans, masks; the penalty counts [S, V'] are
split the same way), and logprobs reduce each shard to a few numbers per row before a small cross-shard combine
(`logprob_stats_split`); the draw is sample_sharded's. Padding columns (ids >= vocab_size, -inf) are never chosen
or counted. With one device these are the plain code on whole rows.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer.parallel.compat import shard_map
from jaxinfer.sampling import logprob_stats, top_n_of

VOCAB_SPEC = P(None, "tp")      # [rows, V'] split by vocabulary: logits, and the penalty counts [S, V']


def _tp(mesh) -> int:
    return 1 if mesh is None else mesh.shape["tp"]


def split_logits(logits, mesh):
    """Logits [R, V'] pinned split by vocabulary (unpinned, XLA may gather a tied [V, E] embedding instead)."""
    if _tp(mesh) == 1:
        return logits
    return jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, VOCAB_SPEC))


def over_vocab(fn, mesh, split, rest):
    """fn(split, rest, start) on each device's own vocabulary columns: `split` a pytree of [R, V'] arrays split by
    vocabulary (the result's arrays are too), `rest` replicated, `start` the shard's first token id. With one device,
    fn(split, rest, 0) on whole rows."""
    if _tp(mesh) == 1:
        return fn(split, rest, 0)

    def local(split, rest):
        start = jax.lax.axis_index("tp") * jax.tree.leaves(split)[0].shape[-1]
        return fn(split, rest, start)
    return shard_map(local, mesh, (VOCAB_SPEC, P()), VOCAB_SPEC)(split, rest)


def local_ids(ids, start, n: int):
    """Token ids -> columns of the shard holding ids start .. start + n - 1; other ids -> n, which a scatter with
    mode="drop" drops (a negative index would wrap)."""
    return jnp.where((ids >= start) & (ids < start + n), ids - start, n)


def logprob_stats_split(logits, token_ids, top_n: int, mesh, vocab_size: int):
    """sampling.logprob_stats (the same packed rows [R, 2 + 2 * top_n]) for logits [R, V'] split by vocabulary
    (padding columns -inf) and token ids [R]. logsumexp: the global max (pmax), then each shard's sum of exp (psum);
    the token's logit from its owning shard; its rank: each shard's count of larger logits, summed; the top_n: each
    shard's own top_n (ties: lower id first), gathered ([R, tp * top_n]) and merged, shards in vocabulary order, so
    ties keep the lower id as on whole rows. Same ids and ranks as one device; logprobs up to fp32 rounding (the
    sum of exp is added in another order)."""
    if _tp(mesh) == 1:
        return logprob_stats(logits, token_ids, top_n)
    top_n = min(top_n, vocab_size)

    def local(lg, token_ids):                                               # lg [R, n]
        n = lg.shape[-1]
        start = jax.lax.axis_index("tp") * n
        m = jax.lax.pmax(jnp.max(lg, axis=-1, keepdims=True), "tp")           # [R, 1]
        m = jnp.where(jnp.isfinite(m), m, 0.0)                              # (as jax.nn.logsumexp)
        lse = m + jnp.log(jax.lax.psum(jnp.sum(jnp.exp(lg - m), axis=-1, keepdims=True), "tp"))
        col = local_ids(token_ids, start, n)[:, None]
        mine = jnp.take_along_axis(lg, jnp.minimum(col, n - 1), axis=-1)
        own = jax.lax.psum(jnp.where(col < n, mine, 0.0), "tp")           # exact: one shard adds its value to zeros
        rank = 1 + jax.lax.psum(jnp.sum(lg > own, axis=-1, keepdims=True), "tp")
        cols = [own - lse, rank.astype(jnp.float32)]
        if top_n > 0:
            vals, ids = top_n_of(lg, min(top_n, n))
            # one collective for both: ids ride as fp32 (exact below 2^24)
            both = jax.lax.all_gather(jnp.stack([vals, (ids + start).astype(jnp.float32)]), "tp", axis=2, tiled=True)
            vals, j = jax.lax.top_k(both[0], top_n)                         # ties: the lower index, the lower id
            cols += [jnp.take_along_axis(both[1], j, axis=-1), vals - lse]
        return jnp.concatenate(cols, axis=-1)
    return shard_map(local, mesh, (VOCAB_SPEC, P()), P())(logits, token_ids)
