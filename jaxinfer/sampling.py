"""On-device sampling with per-row parameters: greedy, temperature, top-k, top-p, min-p.

Sampling uses the Gumbel-max trick: argmax(logits / T + g) with g = -log(-log(u)), u uniform, draws from
softmax(logits / T) and needs no normalisation. The uniforms come from a counter-based integer hash of
(seed, counter, token id): a request's draws depend only on its own seed and the index of the token
being sampled, never on its batch neighbours, and XLA fuses the noise into the argmax, so the [B, V]
noise is never written to memory (jax.random's threefry over [256, 151936] cost ~0.2 ms a step on the H200).

The full-vocabulary sort that top-k / top-p / min-p need is not in the model's step: a step samples with the
plain argmax and also returns its sampled rows' hidden states; when some row of the batch asks for a filter
the engine (decided on the host) runs a small "resample" program (step.make_resample) that computes those rows'
logits again and draws with `sample(..., filtered=...)`. A row whose top_k is at most TOP_K_CANDIDATES (Qwen3's
generation config asks for top_k=20, top_p=0.95) needs only its top candidates, not a sorted row: when every
filtering row of a batch has such a top_k, the draw takes the rows' top candidates (`top_n_of`) and skips the sort
(filtered="top_k"); otherwise it sorts the other rows' values (`_draw_by_threshold`) and those rows still draw
from the same candidates, so a row's token never depends on which program its batch ran. A device-side `lax.cond`
would make XLA copy its predicate to the host and block, which serialised every step with the host (measured on
the H200); a filtered copy of every model step doubled the programs compiled at start-up.
"""
from __future__ import annotations

import functools
import hashlib

import jax
import jax.numpy as jnp

from jaxinfer.sampling_params import TOP_K_CANDIDATES

_NEG = -1e30
SORTED_DRAW = "auto"    # rows that need the sort: "threshold" sorts values alone (`_draw_by_threshold`), "ids" sorts
                        # them with their ids (`sort_descending`); "auto": threshold from THRESHOLD_MIN_ROWS rows. Same
                        # tokens. On the H200 at 151,936 ids, ms, threshold / ids: 2.73 / 3.51 at 256 rows, 1.36 / 1.61
                        # at 64, 0.66 / 0.58 at 8, where XLA sorts with its own kernel, not CUB (performance.md)
THRESHOLD_MIN_ROWS = 27         # XLA GPU's rule for CUB on 32-bit keys of more than 2^17: more than 26 rows
SORT_KEYS = "uint32"    # the filtered draw's sort keys: "uint32" (CUB's radix sort on the GPU) | "float" (XLA's sort)
CANDIDATE_CHUNK = 64    # top_n_of's chunk for the no-sort draw's 64 candidates: 0.26 ms at 256 rows on the H200, 0.33
                        # with 128-token chunks (scripts/probe_draw.py)


def _mix(x):
    """A 32-bit integer finaliser (lowbias32): every input bit affects every output bit."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def gumbel_noise(seeds, counters, V: int, start=0):
    """[B, V] fp32 Gumbel noise for token ids start .. start + V - 1; entry (b, t) depends only on (seeds[b],
    counters[b], t), so a device holding one vocabulary shard draws exactly the noise of those ids."""
    ids = jnp.arange(V, dtype=jnp.uint32) + jnp.asarray(start).astype(jnp.uint32)                     # [V]
    return gumbel_at(seeds, counters, ids[None, :])


def gumbel_at(seeds, counters, ids):
    """Gumbel noise of row b at token ids[b, j] (ids [1 or B, N]): the entries of `gumbel_noise` at those ids,
    computed where they are needed (the filtered draw takes them in sorted order without a gather)."""
    row = _mix(_mix(seeds.astype(jnp.uint32) ^ jnp.uint32(0x9E3779B9)) + counters.astype(jnp.uint32))  # [B]
    bits = _mix(row[:, None] ^ _mix(ids.astype(jnp.uint32) + jnp.uint32(0x632BE5AB)))
    return -jnp.log(exponential(bits))


def exponential(bits):
    """uint32 -> Exp(1) fp32, positive and finite: -log1p(-v) with v = (bits + 1/2) / 2^32, which fp32 holds to full
    precision near 0, where the small E that give the largest noise -log(E) come from (up to 22.9: a token 20
    logits below the top keeps its odds). -log(u) with u in 23 or 24 bits stopped the noise at 16.6 (tokens more
    than ~19.4 below the top were never drawn, and 16-19 below too rarely) and once rounded u to 1.0 (+inf noise
    for one id in 2^24: ~0.9% of draws at Qwen3's 151,936 ids took a token whatever the logits and filters)."""
    v = jnp.minimum(bits.astype(jnp.float32) * (1.0 / 2**32) + 1.0 / 2**33, 1.0 - 1.0 / 2**24)
    return -jnp.log1p(-v)


def _filter_sorted(sorted_logits, top_k, top_p, min_p):
    """Mask (to -1e30) the entries of descending-sorted, temperature-scaled logits [B, V] that
    top-k / top-p / min-p exclude (`_keep_sorted`)."""
    return jnp.where(_keep_sorted(sorted_logits, top_k, top_p, min_p), sorted_logits, _NEG)


def _keep_sorted(sorted_logits, top_k, top_p, min_p):
    """Which entries of descending-sorted, temperature-scaled logits [B, V] top-k / top-p / min-p keep (a prefix),
    in vLLM's order: min-p (against the top probability), top-k, then top-p over what those two left,
    renormalised. The top entry always survives."""
    V = sorted_logits.shape[-1]
    rank = jnp.arange(V)[None, :]
    k = jnp.where(top_k > 0, top_k, V)[:, None]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    keep = (rank < k) & (probs >= min_p[:, None] * probs[:, :1])       # a prefix of the sorted row
    kept = jnp.where(keep, probs, 0.0)
    kept = kept / jnp.sum(kept, axis=-1, keepdims=True)
    mass_before = jnp.cumsum(kept, axis=-1) - kept                    # exclusive cumulative mass of the survivors
    # (top_p >= 1 keeps all: the fp32 sum of the survivors' mass reaches 1.0 before the row's smallest tokens)
    return (keep & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))) | (rank == 0)


def sample(logits, temperature, top_k, top_p, min_p, seeds, counters, filtered: bool | str = True,
           candidates: int = TOP_K_CANDIDATES, plain=None):
    """logits [B, V] fp32 and per-row parameters [B] -> token ids [B] int32.

    filtered (static): False ignores top-k / top-p / min-p, which is right only when no row sets them
    (`SamplingParams.needs_filter`); both variants draw the same token for such rows. True sorts each row's values
    and applies them (`_draw_by_threshold`). "top_k": every row that filters has 0 < top_k <= TOP_K_CANDIDATES
    (`SamplingParams.filter_kind`), so its draw needs only its top candidates; the other rows take the plain
    draw. A row with such a top_k draws the same token in all of these variants. "top_k_only": every row is greedy
    or has such a top_k (the host checks, `step.draws_from_candidates`), so no row needs the plain draw over the
    whole vocabulary. `candidates` (static): that bound, the host's (`SamplingParams.filter_kind`) unless timing
    another. `plain` [B]: "top_k"'s draw for the rows that do not filter when it was made already (the model step's
    own ids: the resample program need not draw them again).
    A greedy row (temperature 0) gets no noise, so one argmax serves greedy and sampled rows alike."""
    sampled_row = (temperature > 0)[:, None]
    scaled = logits / jnp.where(sampled_row, temperature[:, None], 1.0)
    if not filtered:
        gumbel = jnp.where(sampled_row, gumbel_noise(seeds, counters, logits.shape[-1]), 0.0)
        return jnp.argmax(scaled + gumbel, axis=-1).astype(jnp.int32)
    n = min(candidates, scaled.shape[-1])
    few = (top_k > 0) & (top_k <= candidates)              # rows whose draw lies among their top n candidates
    draw = functools.partial(draw_among, top_k=top_k, top_p=top_p, min_p=min_p, sampled_row=sampled_row, seeds=seeds,
                             counters=counters)
    if filtered == "top_k_only":       # every row is greedy or has such a top_k: no plain draw at all (a greedy
        return draw(*top_n_of(scaled, n, CANDIDATE_CHUNK))    # row's argmax is its first candidate, lowest id first)
    if filtered == "top_k":
        if plain is None:
            plain = sample(logits, temperature, top_k, top_p, min_p, seeds, counters, False)
        return jnp.where(few, draw(*top_n_of(scaled, n, CANDIDATE_CHUNK)), plain)
    if SORTED_DRAW == "ids" or (SORTED_DRAW == "auto" and scaled.shape[0] < THRESHOLD_MIN_ROWS):
        values, order = sort_descending(scaled)
        return jnp.where(few, draw(values[:, :n], order[:, :n]), draw(values, order))
    return jnp.where(few, draw(*top_n_of(scaled, n, CANDIDATE_CHUNK)),
                     _draw_by_threshold(scaled, top_k, top_p, min_p, sampled_row, seeds, counters))


def _draw_by_threshold(scaled, top_k, top_p, min_p, sampled_row, seeds, counters):
    """The filtered draw over whole rows with the values sorted alone, not with their ids (CUB's radix sort of
    keys alone moves half the bytes). `_keep_sorted` gives the kept prefix's length J and its last value tau; the
    row then draws in its own order among the tokens above tau and, of those equal to tau, the lowest ids up to
    J: the tokens a stable sort's prefix holds, and picks as `draw_among` does over the sorted row with ids (the largest
    logit + noise; of equal ones the larger logit, then the lower id), so both give the same token."""
    values = from_descending_key(jax.lax.sort(descending_key(scaled), dimension=-1))
    J = jnp.sum(_keep_sorted(values, top_k, top_p, min_p), axis=-1, keepdims=True)      # [B, 1], >= 1
    tau = jnp.take_along_axis(values, J - 1, axis=-1)                                     # the last kept value
    above, tie = scaled > tau, scaled == tau
    room = J - jnp.sum(above, axis=-1, keepdims=True)                                   # ties the prefix holds
    before = jnp.cumsum(tie.astype(jnp.int32), axis=-1) - tie                           # ties with a lower id
    keep = above | (tie & (before < room))
    noise = jnp.where(sampled_row, gumbel_noise(seeds, counters, scaled.shape[-1]), 0.0)
    z = jnp.where(keep, scaled + noise, -jnp.inf)
    best = z == jnp.max(z, axis=-1, keepdims=True)       # (two kept tokens' logit + noise equal in fp32: rare)
    # among the best, the sorted draw's order: the larger logit, then the lower id (argmax takes the first)
    return jnp.argmax(jnp.where(best, scaled, -jnp.inf), axis=-1).astype(jnp.int32)


def sort_descending(x):
    """x [B, V] fp32 -> (its rows sorted by decreasing value, their ids), ties lower id first (a stable sort).
    Each sorted entry's noise is computed from its id, so per-token noise stays fixed without a gather.

    SORT_KEYS "uint32" sorts unsigned integer keys that order as the floats do (-0.0 as +0.0, as lax.sort's
    float comparator has it), with the ids as payload. Float keys ("float") went through XLA GPU's sort rewriter
    as uint32 keys with a 64-bit payload (the float and its id), so CUB's radix sort moved more bytes: 2.95 against
    2.46 ms for the sort alone at 256 rows of 151,936 on the H200 (8 rows, below CUB's threshold: XLA's own sort)."""
    ids = jnp.broadcast_to(jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape)
    if SORT_KEYS == "float":
        neg_sorted, order = jax.lax.sort((-x, ids), dimension=-1, is_stable=True, num_keys=1)
        return -neg_sorted, order
    keys, order = jax.lax.sort((descending_key(x), ids), dimension=-1, is_stable=True, num_keys=1)
    return from_descending_key(keys), order


def descending_key(x):
    """fp32 -> uint32 keys whose ascending order is x's descending order (-0.0 keyed as +0.0; no NaNs here)."""
    u = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x).astype(jnp.float32), jnp.uint32)
    return jnp.where(u >> 31 == 0, u ^ jnp.uint32(0x7FFFFFFF), u)        # >= +0: flip the magnitude; < 0: as is


def from_descending_key(k):
    """The floats `descending_key` was made from (zeros as +0.0)."""
    return jax.lax.bitcast_convert_type(jnp.where(k >> 31 == 0, k ^ jnp.uint32(0x7FFFFFFF), k), jnp.float32)


def draw_among(values, ids, top_k, top_p, min_p, sampled_row, seeds, counters):
    """The token drawn from descending scaled logits `values` [B, N] (token `ids` [B, N]), filtered."""
    masked = _filter_sorted(values, top_k, top_p, min_p)        # a greedy row keeps its top entry
    noise = jnp.where(sampled_row, gumbel_at(seeds, counters, ids), 0.0)
    pick = jnp.argmax(masked + noise, axis=-1)
    return jnp.take_along_axis(ids, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)


# -- penalties and logprobs (the step's "extras" variant: step.py; only batches that ask for them pay) -----
def apply_penalties(logits, prompt_seen, output_counts, repetition, frequency, presence):
    """vLLM's penalties on logits [B, V] fp32, before temperature: repetition over prompt + output tokens
    (a positive logit is divided by it, a negative one multiplied), then frequency (times the token's count
    in the output) and presence (once if it occurred) subtracted. prompt_seen [B, V] bool, output_counts
    [B, V] int32, the penalties [B]; a row with 1 / 0 / 0 is unchanged."""
    seen = prompt_seen | (output_counts > 0)
    rep = repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    counts = output_counts.astype(jnp.float32)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).astype(jnp.float32)


def apply_bias(logits, ids, vals, only):
    """vLLM's logit_bias and allowed_token_ids on logits [B, V] fp32: vals [B, N] added at ids [B, N] (ids past the
    vocabulary are padding, dropped); a row with `only` [B] set keeps just those ids (its allowed_token_ids, each
    with its bias, maybe 0) and masks the rest."""
    rows = jnp.arange(logits.shape[0])[:, None]
    biased = logits.at[rows, ids].add(vals, mode="drop")
    kept = jnp.take_along_axis(logits, jnp.minimum(ids, logits.shape[1] - 1), axis=1) + vals
    allowed = jnp.full_like(logits, -jnp.inf).at[rows, ids].set(kept, mode="drop")
    return jnp.where(only[:, None] != 0, allowed, biased)


def logprob_stats(logits, token_ids, top_n: int):
    """Raw logprobs (log_softmax of the model's fp32 logits, as vLLM's default) of `token_ids` [R] under
    logits [R, V], packed for one device->host copy as fp32 [R, 2 + 2 * top_n]: the token's logprob, its
    rank (1 + how many tokens have a larger logprob), then the top_n ids (exact in fp32 below 2^24) and
    their logprobs, best first. A vocabulary smaller than top_n gives all of it (V columns each)."""
    top_n = min(top_n, logits.shape[-1])
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)                         # [R, 1]
    own = jnp.take_along_axis(logits, token_ids[:, None], axis=-1)                  # [R, 1]
    rank = 1 + jnp.sum(logits > own, axis=-1, keepdims=True)                        # [R, 1]
    cols = [own - lse, rank.astype(jnp.float32)]
    if top_n > 0:
        vals, ids = top_n_of(logits, top_n)                                         # [R, N] each
        cols += [ids.astype(jnp.float32), vals - lse]
    return jnp.concatenate(cols, axis=-1)


def top_n_of(logits, n: int, chunk: int = 128):
    """lax.top_k(logits [R, V], n) without sorting whole rows: the n largest entries lie in the n chunks (of
    `chunk` ids) with the largest maxima, since a chunk left out has n larger maxima above it. So: one pass
    for the chunk maxima [R, V / chunk], then top_k over them and over the n chosen chunks' n * chunk entries.
    (lax.top_k over a 151936-wide row can lower to a full sort on the GPU: the logprob variant of a 256-row
    step reads the logits a few times instead.) Ties resolve to the lower id, as lax.top_k's do."""
    R, V = logits.shape
    C = -(-V // chunk)
    if C <= n:                                   # small vocabularies: nothing to save
        return jax.lax.top_k(logits, n)
    x = jnp.pad(logits, ((0, 0), (0, C * chunk - V)), constant_values=-jnp.inf) if C * chunk != V else logits
    x = x.reshape(R, C, chunk)                                                        # [R, C, chunk]
    _, best = jax.lax.top_k(jnp.max(x, axis=-1), n)                                   # [R, n] chunk ids
    best = jnp.sort(best, axis=-1)               # candidates in id order: equal values keep the lower id first
    cand = jnp.take_along_axis(x, best[:, :, None], axis=1).reshape(R, n * chunk)     # [R, n * chunk]
    vals, j = jax.lax.top_k(cand, n)
    ids = jnp.take_along_axis(best, j // chunk, axis=1) * chunk + j % chunk
    return vals, ids


def device_seed(seed: int) -> int:
    """A request's seed as the 31-bit one the device's noise takes: the seed itself when it fits, else a hash of
    all of it (masking the low bits made seeds 0, 2**32 and -2**32 draw the same tokens)."""
    if 0 <= seed < 2**31:
        return seed
    return int.from_bytes(hashlib.blake2b(str(seed).encode(), digest_size=4).digest(), "little") & 0x7FFFFFFF


def batch_filter(kinds) -> bool | str:
    """How a batch draws, from its rows' `filter_kind`s: the sort if any row needs it, else "top_k" if any row
    filters, else False."""
    kinds = list(kinds)
    return True if any(k is True for k in kinds) else ("top_k" if "top_k" in kinds else False)
