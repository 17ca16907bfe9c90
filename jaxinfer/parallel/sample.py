"""Sampling over logits split by vocabulary across the mesh axis "tp" (sampling.py's draws, the same tokens):
the plain draw reduces each shard to (max, id) per row and gathers those; a small top_k gathers each shard's top
candidates; the sorted filters split the rows over the devices instead (one all-to-all of the logits)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer.parallel import shard_map
from jaxinfer.sampling import CANDIDATE_CHUNK, draw_among, gumbel_noise, sample, top_n_of
from jaxinfer.sampling_params import TOP_K_CANDIDATES


def sample_sharded(logits, temperature, top_k, top_p, min_p, seeds, counters, filtered: bool | str, mesh,
                   vocab_size: int, plain=None):
    """`sample` for logits [B, V'] split by vocabulary over the mesh axis "tp" (V' >= vocab_size, padding -inf).

    Each device takes argmax(logits / T + gumbel) over its own shard, with the noise of the global token ids
    it holds; then the [tp, B] (max, id) pairs are all-gathered and the first largest wins: the same token
    as `sample` on the whole row (argmax returns the first maximum, and shards are in vocabulary order).
    "top_k" / "top_k_only" (every filtering row has a small top_k, Qwen3's generation config) take each shard's
    top candidates and gather those ([B, tp * n]); the sorted variant (True) splits the rows instead of the vocabulary
    (`_sorted_by_rows`)."""
    if filtered in ("top_k", "top_k_only"):
        n = min(TOP_K_CANDIDATES, vocab_size)

        def cands(lg, temperature):                                  # lg [B, V'/tp]
            m = lg.shape[-1]
            start = jax.lax.axis_index("tp") * m
            scaled = lg / jnp.where(temperature > 0, temperature, 1.0)[:, None]
            vals, ids = top_n_of(scaled, min(n, m), CANDIDATE_CHUNK)  # ties: lower id first
            return vals, ids + start
        vals, ids = shard_map(cands, mesh, (P(None, "tp"), P()), (P(None, "tp"), P(None, "tp")))(logits, temperature)
        vals, j = jax.lax.top_k(vals, n)         # shards in vocabulary order: ties keep the lower id, as `sample`
        ids = jnp.take_along_axis(ids, j, axis=-1)
        drawn = draw_among(vals, ids, top_k, top_p, min_p, (temperature > 0)[:, None], seeds, counters)
        if filtered == "top_k_only":
            return drawn
        if plain is None:
            plain = sample_sharded(logits, temperature, top_k, top_p, min_p, seeds, counters, False, mesh, vocab_size)
        return jnp.where((top_k > 0) & (top_k <= TOP_K_CANDIDATES), drawn, plain)
    if filtered:
        return _sorted_by_rows(logits, (temperature, top_k, top_p, min_p, seeds, counters), mesh, vocab_size)

    def local(lg, temperature, seeds, counters):                    # lg [B, V'/tp]
        n = lg.shape[-1]
        start = jax.lax.axis_index("tp") * n
        sampled_row = (temperature > 0)[:, None]
        scaled = lg / jnp.where(sampled_row, temperature[:, None], 1.0)
        z = scaled + jnp.where(sampled_row, gumbel_noise(seeds, counters, n, start), 0.0)
        best = jnp.argmax(z, axis=-1)                                            # [B]
        # one collective for both: ids ride as fp32 (exact below 2^24, and vocabularies are far smaller)
        mine = jnp.stack([jnp.max(z, axis=-1), (best + start).astype(jnp.float32)])  # [2, B]
        peaks, ids = jnp.moveaxis(jax.lax.all_gather(mine, "tp"), 1, 0)          # [tp, B] each
        shard = jnp.argmax(peaks, axis=0)                                        # first shard with the maximum
        return jnp.take_along_axis(ids, shard[None, :], axis=0)[0].astype(jnp.int32)
    return shard_map(local, mesh, (P(None, "tp"), P(), P(), P()), P())(logits, temperature, seeds, counters)


def _sorted_by_rows(logits, params, mesh, vocab_size: int):
    """The sorted draw (`sample(..., True)`, which needs whole rows) with the rows split over "tp" instead of the
    vocabulary: one all-to-all of the logits (B / tp whole rows a device, not all B), each device draws its own rows
    with their per-row params [B], then the [B] ids are gathered. A row's token is `sample`'s on that row alone."""
    B, tp = logits.shape[0], mesh.shape["tp"]
    pad = lambda x: jnp.pad(x, [(0, -B % tp)] + [(0, 0)] * (x.ndim - 1))      # (padding rows: greedy, dropped)
    # (split by vocabulary first: else XLA may gather a tied embedding [V, E] to every device instead of the logits)
    logits = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P(None, "tp")))
    logits = jax.lax.with_sharding_constraint(pad(logits), NamedSharding(mesh, P("tp", None)))

    def draw(lg, *params):                          # lg [B / tp, V'] whole rows; params replicated, sliced here
        rows = jax.lax.axis_index("tp") * lg.shape[0]
        params = [jax.lax.dynamic_slice_in_dim(x, rows, lg.shape[0]) for x in params]
        return sample(lg[:, :vocab_size], *params, True)
    return shard_map(draw, mesh, (P("tp", None),) + (P(),) * len(params), P("tp"))(logits, *map(pad, params))[:B]
