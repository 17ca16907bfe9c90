"""The extras variant of a step (step.make_step with `extras`): penalties, logprobs, prompt logprobs, and the
logit edits of min_tokens, logit_bias / allowed_token_ids and bad_words, for the batches that need them."""
from __future__ import annotations

import functools

import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.model.layers import decode_matmul
from jaxinfer.model.qwen3 import compute_logits, tp_size
from jaxinfer.parallel.sample import sample_sharded
from jaxinfer.parallel.vocab import local_ids, logprob_stats_split, over_vocab, split_logits
from jaxinfer.sampling import apply_bias, apply_penalties, sample
from jaxinfer.step import BAN_PAD, Extras, forward_rows, unpack


def make_extras_step(config: ModelConfig, kind: str, T: int, B: int, W: int, backend: str, interpret: bool,
                     max_rows: int, filtered: bool | str, mesh, extras: Extras, part: str = "whole"):
    """`step(params, kv_caches, packed, prev_ids, counts) -> (ids, kv_caches, counts, logprobs)`.

    counts (penalties only, else None): (prompt_seen [S, V'] bool, output_counts [S, V'] int32), one row per
    penalty slot (`pen_slot`; S = a padding slot: dropped). Every token that enters the step is counted in its
    row's slot as it goes in (prompt tokens as seen, later ones as outputs), so a row samples with the counts
    of every token before it; a row whose chunk starts at position 0 clears its slot first (a new or
    recomputed sequence: such requests never reuse the prefix cache, so they always start at 0).
    logprobs: fp32 [B (if extras.logprobs) + Tp, 2 + 2 * top_n] (sampling.logprob_stats); only it leaves
    the device, never [B, V]. Logits: logit_bias / allowed_token_ids, the penalties, then the bans (min_tokens,
    bad_words: -inf stays -inf under a penalty, so the order of vLLM's processors is kept in effect).
    tp > 1: the logits [B, V'] and the counts stay split by vocabulary (V' = V padded, parallel/vocab.py): each
    device edits and counts its own columns, the draw is sample_sharded's and the logprobs logprob_stats_split's.

    part: "whole", or the step in two programs (a decode step with json / regex rows, whose masks need the tokens of
    the step before it: the model part runs while the host writes them): "model" `(params, kv_caches, packed,
    prev_ids, counts) -> (rows [B, E], input tokens [B], kv_caches, counts)` and "draw" `(params, rows, packed, last,
    counts) -> (ids, logprobs)`, the same computation as "whole" (no prompt logprobs)."""
    V, tp = config.vocab_size, tp_size(mesh)
    mm = decode_matmul(B, interpret, tp) if kind == "decode" else None    # as the plain step's logits

    def model(params, kv_caches, packed, prev_ids, counts):
        b = unpack(packed, T, B, W, extras)
        token_ids, rows, kv_caches = forward_rows(config, kind, backend, interpret, mesh, params, kv_caches, b,
                                                  prev_ids, mm)
        if extras.penalties:
            fields = {k: b[k] for k in ("pen_slot", "cu_seqlens", "positions", "num_prompt")}
            counts = over_vocab(functools.partial(_count_tokens, prefill=kind == "prefill"), mesh, counts,
                                (token_ids, fields))
        return b, (rows, token_ids[b["sample_idx"]], kv_caches, counts)     # (each row's input token)

    def draw(params, rows, b, last, counts):
        logits = split_logits(compute_logits(config, params, rows, mm), mesh)       # [B, V'] fp32, split if tp > 1
        fields = {k: v for k, v in b.items() if k != "hidden"}
        raw, logits = over_vocab(functools.partial(_edit, extras), mesh, (logits, counts), (fields, last[:, None]))
        args = (logits, b["temperature"], b["top_k"], b["top_p"], b["min_p"], b["seeds"], b["counters"], filtered)
        ids = sample_sharded(*args, mesh, V) if tp > 1 else sample(*args)
        if config.eos_token_id and (extras.choice or extras.grammar or extras.bias or extras.bans or extras.bad_words):
            # masks that leave a row no token (a choice or grammar against allowed_token_ids / bad_words, say): the
            # draw of an all -inf row is id 0, which none of them allowed; such a row ends with EOS instead
            ids = jnp.where(jnp.any(logits > -jnp.inf, axis=-1), ids, config.eos_token_id[0])
        stats = [logprob_stats_split(raw, ids, extras.top_n, mesh, V)] if extras.logprobs else []
        return jnp.pad(ids, (0, max_rows - B)), stats

    def step(params, kv_caches, packed, prev_ids, counts):
        b, (rows, last, kv_caches, counts) = model(params, kv_caches, packed, prev_ids, counts)
        ids, stats = draw(params, rows, b, last, counts)
        if extras.prompt_rows:                 # (b["hidden"]: every token's hidden state, kept by forward_rows)
            plogits = split_logits(compute_logits(config, params, b["hidden"][b["plp_idx"]]), mesh)   # [Tp, V']
            stats.append(logprob_stats_split(plogits, b["plp_target"], extras.top_n, mesh, V))
        return ids, kv_caches, counts, jnp.concatenate(stats) if stats else None

    def draw_part(params, rows, packed, last, counts):
        ids, stats = draw(params, rows, unpack(packed, T, B, W, extras), last, counts)
        return ids, jnp.concatenate(stats) if stats else None
    return {"model": lambda *args: model(*args)[1], "draw": draw_part, "whole": step}[part]


def _edit(extras: Extras, split, rest, start):
    """(raw, edited) logits of one vocabulary shard (all of it at tp = 1; parallel/vocab.over_vocab): split =
    (logits [B, n] of ids start .. start + n - 1, counts [S, n] or None), rest = (the batch's fields, input tokens
    `last` [B, 1]). raw: with the structured outputs' masks (what logprobs are taken from); edited: then logit_bias /
    allowed_token_ids, the penalties, the bans and bad_words (what the draw samples)."""
    (logits, counts), (b, last) = split, rest
    B, n = logits.shape
    cols = functools.partial(local_ids, start=start, n=n)                   # global ids -> this shard's columns
    if extras.choice:             # structured outputs first (vLLM applies its grammar mask before the sampler)
        cond = b["choice_cond"].reshape(B, extras.choice)
        ids = jnp.where((cond < 0) | (cond == last), b["choice_ids"].reshape(B, extras.choice), BAN_PAD)
        logits = _only_entries(logits, cols(ids), _on(b["choice_on"], last))
    if extras.grammar:            # json / regex rows: the ids of their bitmask's set bits (bit k of word j: 32 j + k)
        ids = start + jnp.arange(n)
        words = jnp.take(b["grammar_mask"].reshape(B, extras.grammar), jnp.minimum(ids // 32, extras.grammar - 1), 1)
        allowed = (words >> (ids % 32)) & 1                                  # [B, n] (padding ids are -inf anyway)
        logits = jnp.where(_on(b["grammar_on"], last) & (allowed == 0), -jnp.inf, logits)
    raw = logits
    if extras.bias:                                        # before the penalties, as vLLM's logits processors
        logits = apply_bias(logits, cols(b["bias_ids"].reshape(B, extras.bias)), b["bias_vals"].reshape(B, extras.bias),
                            b["bias_only"])
    if extras.penalties:
        seen, outs = (jnp.take(c, b["pen_slot"], axis=0, mode="fill", fill_value=0) for c in counts)   # [B, n] each
        logits = apply_penalties(logits, seen, outs, b["repetition"], b["frequency"], b["presence"])
    rows = jnp.arange(B)[:, None]
    if extras.bans:                                        # (BAN_PAD is out of range: dropped)
        logits = logits.at[rows, cols(b["ban_ids"].reshape(B, extras.bans))].set(-jnp.inf, mode="drop")
    if extras.bad_words:                                   # an entry bans its id when its condition holds
        cond = b["bad_cond"].reshape(B, extras.bad_words)
        ban = jnp.where((cond < 0) | (cond == last), b["bad_ids"].reshape(B, extras.bad_words), BAN_PAD)
        logits = logits.at[rows, cols(ban)].set(-jnp.inf, mode="drop")
    return raw, logits


def _only_entries(logits, cols, on):
    """Rows `on` [B, 1] keep only the columns cols [B, N] (out of range: padding) of logits [B, n]; the rest of such a
    row is -inf."""
    kept = jnp.take_along_axis(logits, jnp.minimum(cols, logits.shape[1] - 1), axis=1)
    only = jnp.full_like(logits, -jnp.inf).at[jnp.arange(logits.shape[0])[:, None], cols].set(kept, mode="drop")
    return jnp.where(on, only, logits)


def _on(cond, last):
    """[B, 1]: the rows whose structured output applies: on-condition [B] -1 or their input token (reasoning)."""
    return (cond[:, None] == -1) | (cond[:, None] == last)


def _count_tokens(counts, rest, start, prefill: bool):
    """Add this step's tokens [T] to their rows' slots (see make_extras_step), on the counts [S, n] of token ids
    start .. start + n - 1 (parallel/vocab.over_vocab; rest = (token ids, the batch's fields)). Only a prefill step
    can start a sequence at position 0 (clearing [B, V] of slots costs a pass over them: decode steps skip it)."""
    (seen, outs), (token_ids, b) = counts, rest
    S, n = seen.shape
    T, B = token_ids.shape[0], b["pen_slot"].shape[0]
    cols = local_ids(token_ids, start, n)                                          # [T]; another shard's: dropped
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
    seen = seen.at[jnp.where(in_prompt, slot, S), cols].set(True, mode="drop")
    outs = outs.at[jnp.where(in_prompt, S, slot), cols].add(1, mode="drop")
    return seen, outs
