"""The extras variant of a step (step.make_step with `extras`): penalties, logprobs, prompt logprobs, and the
logit edits of min_tokens, logit_bias / allowed_token_ids and bad_words, for the batches that need them."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.model.layers import decode_matmul
from jaxinfer.model.qwen3 import compute_logits, tp_size
from jaxinfer.sampling import apply_bias, apply_penalties, logprob_stats, sample
from jaxinfer.step import BAN_PAD, BAN_WIDTH, Extras, forward_rows, unpack


def make_extras_step(config: ModelConfig, kind: str, T: int, B: int, W: int, backend: str, interpret: bool,
                     max_rows: int, filtered: bool | str, mesh, extras: Extras, part: str = "whole"):
    """`step(params, kv_caches, packed, prev_ids, counts) -> (ids, kv_caches, counts, logprobs)`.

    counts (penalties only, else None): (prompt_seen [S, V] bool, output_counts [S, V] int32), one row per
    penalty slot (`pen_slot`; S = a padding slot: dropped). Every token that enters the step is counted in its
    row's slot as it goes in (prompt tokens as seen, later ones as outputs), so a row samples with the counts
    of every token before it; a row whose chunk starts at position 0 clears its slot first (a new or
    recomputed sequence: such requests never reuse the prefix cache, so they always start at 0).
    logprobs: fp32 [B (if extras.logprobs) + Tp, 2 + 2 * top_n] (sampling.logprob_stats); only it leaves
    the device, never [B, V]. Logits: logit_bias / allowed_token_ids, the penalties, then the bans (min_tokens,
    bad_words: -inf stays -inf under a penalty, so the order of vLLM's processors is kept in effect).

    part: "whole", or the step in two programs (a decode step with json / regex rows, whose masks need the tokens of
    the step before it: the model part runs while the host writes them): "model" `(params, kv_caches, packed,
    prev_ids, counts) -> (rows [B, E], input tokens [B], kv_caches, counts)` and "draw" `(params, rows, packed, last,
    counts) -> (ids, logprobs)`, the same computation as "whole" (no prompt logprobs)."""
    V = config.vocab_size
    mm = decode_matmul(B, interpret, tp_size(mesh)) if kind == "decode" else None    # as the plain step's logits

    def model(params, kv_caches, packed, prev_ids, counts):
        b = unpack(packed, T, B, W, extras)
        token_ids, rows, kv_caches = forward_rows(config, kind, backend, interpret, mesh, params, kv_caches, b,
                                                  prev_ids, mm)
        if extras.penalties:
            counts = _count_tokens(counts, token_ids, b, kind == "prefill")
        return b, (rows, token_ids[b["sample_idx"]], kv_caches, counts)     # (each row's input token)

    def draw(params, rows, b, last, counts):
        logits = _full_vocab(compute_logits(config, params, rows, mm), V, mesh)   # [B, V] fp32
        last = last[:, None]                                                      # [B, 1]
        if extras.choice:             # structured outputs first (vLLM applies its grammar mask before the sampler)
            logits = _only_entries(logits, b["choice_ids"].reshape(B, extras.choice),
                                   b["choice_cond"].reshape(B, extras.choice), last, b["choice_on"])
        if extras.grammar:            # json / regex rows: the ids of their bitmask's set bits
            words = b["grammar_mask"].reshape(B, extras.grammar, 1)
            allowed = ((words >> jnp.arange(32, dtype=jnp.int32)) & 1).reshape(B, -1)[:, :V]
            logits = jnp.where(_on(b["grammar_on"], last) & (allowed == 0), -jnp.inf, logits)
        raw = logits
        if extras.bias:                                    # before the penalties, as vLLM's logits processors
            logits = apply_bias(logits, b["bias_ids"].reshape(B, extras.bias), b["bias_vals"].reshape(B, extras.bias),
                                b["bias_only"])
        if extras.penalties:
            slot = b["pen_slot"]
            seen, outs = (jnp.take(c, slot, axis=0, mode="fill", fill_value=0) for c in counts)   # [B, V] each
            logits = apply_penalties(logits, seen, outs, b["repetition"], b["frequency"], b["presence"])
        rows_b = jnp.arange(B)[:, None]
        if extras.bans:                                    # (BAN_PAD is out of range: dropped)
            logits = logits.at[rows_b, b["ban_ids"].reshape(B, BAN_WIDTH)].set(-jnp.inf, mode="drop")
        if extras.bad_words:                               # an entry bans its id when its condition holds
            cond = b["bad_cond"].reshape(B, extras.bad_words)
            hit = (cond < 0) | (cond == last)
            ban = jnp.where(hit, b["bad_ids"].reshape(B, extras.bad_words), BAN_PAD)
            logits = logits.at[rows_b, ban].set(-jnp.inf, mode="drop")
        ids = sample(logits, b["temperature"], b["top_k"], b["top_p"], b["min_p"], b["seeds"], b["counters"],
                     filtered)
        stats = [logprob_stats(raw, ids, extras.top_n)] if extras.logprobs else []
        return jnp.pad(ids, (0, max_rows - B)), stats

    def step(params, kv_caches, packed, prev_ids, counts):
        b, (rows, last, kv_caches, counts) = model(params, kv_caches, packed, prev_ids, counts)
        ids, stats = draw(params, rows, b, last, counts)
        if extras.prompt_rows:                 # (b["hidden"]: every token's hidden state, kept by forward_rows)
            plogits = _full_vocab(compute_logits(config, params, b["hidden"][b["plp_idx"]]), V, mesh)  # [Tp, V]
            stats.append(logprob_stats(plogits, b["plp_target"], extras.top_n))
        return ids, kv_caches, counts, jnp.concatenate(stats) if stats else None

    def draw_part(params, rows, packed, last, counts):
        ids, stats = draw(params, rows, unpack(packed, T, B, W, extras), last, counts)
        return ids, jnp.concatenate(stats) if stats else None
    return {"model": lambda *args: model(*args)[1], "draw": draw_part, "whole": step}[part]


def _only_entries(logits, ids, cond, last, on):
    """Rows `on` (_on) keep only the ids [B, N] of entries whose condition [B, N] is -1 or their input token `last`
    [B, 1]; the rest of such a row is -inf (BAN_PAD ids are padding)."""
    ids = jnp.where((cond < 0) | (cond == last), ids, BAN_PAD)
    kept = jnp.take_along_axis(logits, jnp.minimum(ids, logits.shape[1] - 1), axis=1)
    only = jnp.full_like(logits, -jnp.inf).at[jnp.arange(logits.shape[0])[:, None], ids].set(kept, mode="drop")
    return jnp.where(_on(on, last), only, logits)


def _on(cond, last):
    """[B, 1]: the rows whose structured output applies: on-condition [B] -1 or their input token (reasoning)."""
    return (cond[:, None] == -1) | (cond[:, None] == last)


def _full_vocab(logits, V: int, mesh):
    """Logits split by vocabulary over "tp" gathered whole (the extras variant's penalties and logprobs
    work on full rows), without the padding columns."""
    if tp_size(mesh) > 1:
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P
        # (split first: else XLA may gather a tied embedding [V, E] to every device instead of the logits)
        logits = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P(None, "tp")))
        logits = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P()))
    return logits[:, :V]


def _count_tokens(counts, token_ids, b, prefill: bool):
    """Add this step's tokens [T] to their rows' slots (see make_extras_step). Only a prefill step can start a
    sequence at position 0 (clearing [B, V] of slots costs a pass over them: decode steps skip it)."""
    seen, outs = counts
    S = seen.shape[0]
    T, B = token_ids.shape[0], b["pen_slot"].shape[0]
    cu = b["cu_seqlens"]                                                           # [B + 1]
    row = jnp.minimum(jnp.searchsorted(cu[1:], jnp.arange(T), side="right"), B)  # [T]; padding tokens -> B
    slot_of_row = jnp.concatenate([b["pen_slot"], jnp.full((1,), S, jnp.int32)])  # [B + 1]
    if prefill:
        first = b["positions"][jnp.minimum(cu[:-1], T - 1)]                       # [B] first token's position
        clear = jnp.where((first == 0) & (cu[1:] > cu[:-1]), b["pen_slot"], S)
        seen = seen.at[clear].set(False, mode="drop")
        outs = outs.at[clear].set(0, mode="drop")
    slot = slot_of_row[row]
    in_prompt = b["positions"] < jnp.concatenate([b["num_prompt"], jnp.zeros((1,), jnp.int32)])[row]
    seen = seen.at[jnp.where(in_prompt, slot, S), token_ids].set(True, mode="drop")
    outs = outs.at[jnp.where(in_prompt, S, slot), token_ids].add(1, mode="drop")
    return seen, outs
