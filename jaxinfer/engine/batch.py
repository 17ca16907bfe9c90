"""Pack one scheduled step into the single padded int32 array the jitted step reads (numpy only).

The hot path is a decode step of up to 256 sequences, so per-row fields are built with one numpy call
each (no per-sequence numpy ops); only prefill chunks (few per step) loop per sequence.
"""
from __future__ import annotations

import bisect

import numpy as np

from jaxinfer import bad_words
from jaxinfer.config import EngineConfig
from jaxinfer.engine.scheduler import ScheduledBatch
from jaxinfer.engine.sequence import PLACEHOLDER
from jaxinfer.multistep import STOP_IDS, multistep_layout
from jaxinfer.step import BAN_PAD, FLOAT_FIELDS, Extras, batch_layout, extras_layout
from jaxinfer.structured import NO_COND, OFF


def pick_bucket(buckets: tuple[int, ...], n: int) -> int:
    """Smallest bucket >= n (buckets sorted ascending)."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def flat_pages(seqs, chunk_pages: int) -> np.ndarray:
    """Pages each row takes in flat tables: its table rounded up to whole chunks of `chunk_pages`."""
    n = np.fromiter((len(s.block_table) for s in seqs), np.int64, len(seqs))
    return -(-n // chunk_pages) * chunk_pages


def bucket_for(config: EngineConfig, widths: tuple[int, ...], batch: ScheduledBatch,
               chunk_pages: int = 0) -> tuple[str, int, int, int]:
    """(kind, T, B, W) of the compiled step that runs this batch (`widths`: decode's; prefill's are the config's).
    chunk_pages > 0 (the xla decode's flat tables, see `pack`): W is the smallest width whose B * W pages hold all
    rows' tables, each rounded up to whole chunks."""
    if batch.is_prefill:
        T = pick_bucket(config.prefill_buckets, sum(batch.num_new_tokens))
        W = pick_bucket(config.prefill_table_widths(T), max([len(s.block_table) for s in batch.seqs]))
        return "prefill", T, min(config.max_num_seqs, T), W
    B = pick_bucket(config.decode_buckets, len(batch.seqs))
    if chunk_pages:
        return "decode", B, B, pick_bucket(widths, -(-int(flat_pages(batch.seqs, chunk_pages).sum()) // B))
    return "decode", B, B, pick_bucket(widths, max([len(s.block_table) for s in batch.seqs]))


def _tables(seqs, B: int, W: int, chunk_pages: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Block tables [B, W] and each row's start in them flattened (each sequence's numpy copy is cached by the
    sequence until its table changes). chunk_pages > 0: flat tables, the rows' pages one after another, each
    row's starting on a chunk boundary (W is then a budget per row, not the longest row's width)."""
    tables = np.zeros(B * W, np.int32)
    start = np.arange(B, dtype=np.int64) * W
    if chunk_pages:
        pages = flat_pages(seqs, chunk_pages)
        start[:] = 0
        start[:len(seqs)] = np.cumsum(pages) - pages
    for i, seq in enumerate(seqs):
        t = seq.block_table_array()
        tables[start[i]:start[i] + len(t)] = t
    return tables, start


def pack(batch: ScheduledBatch, T: int, B: int, W: int, block_size: int, num_slots: int,
         chunk_pages: int = 0) -> np.ndarray:
    """chunk_pages > 0 and a decode batch: flat block tables (`_tables`), for the xla backend's chunked decode."""
    layout = batch_layout(T, B, W)
    buf = np.zeros(layout["_size"][0], np.int32)
    f = {name: buf[off:off + n] for name, (off, n) in layout.items() if name != "_size"}
    seqs, counts = batch.seqs, batch.num_new_tokens
    n = len(seqs)
    tables, table_start = _tables(seqs, B, W, 0 if batch.is_prefill else chunk_pages)
    f["block_tables"][:] = tables
    f["table_start"][:] = table_start
    start = np.fromiter((s.num_computed_tokens for s in seqs), np.int32, n)
    count = np.asarray(counts, np.int32)
    ends = np.cumsum(count, dtype=np.int32)
    used = int(ends[-1])
    f["slot_mapping"][:] = num_slots                              # padding tokens write nowhere
    f["prev_row"][:] = -1
    if batch.is_prefill:
        t = 0
        for seq, s0, c in zip(seqs, start.tolist(), counts):
            f["token_ids"][t:t + c] = seq.token_ids[s0:s0 + c]
            t += c
        row = np.repeat(np.arange(n), count)
        pos = np.arange(used, dtype=np.int32) - np.repeat(ends - count, count) + np.repeat(start, count)
    else:                                                         # one token per row: fully vectorised
        last = [s.token_ids[-1] for s in seqs]
        f["token_ids"][:n] = last
        # a token still on the device is read from the previous step's output, row s.row
        f["prev_row"][:n] = [s.row if t == PLACEHOLDER else -1 for s, t in zip(seqs, last)]
        row, pos = np.arange(n), start
    f["positions"][:used] = pos
    f["slot_mapping"][:used] = tables[table_start[row] + pos // block_size] * block_size + pos % block_size
    f["cu_seqlens"][1:n + 1] = ends
    f["cu_seqlens"][n + 1:] = used
    f["seq_lens"][:n] = start + count
    # Rows by decreasing context (padding rows, length 0, last): the decode kernel starts the longest
    # sequences' programs first, so no long one is left running alone at the end (2-7% on the H200).
    f["attn_order"][:] = np.argsort(-f["seq_lens"], kind="stable")
    f["sample_idx"][:n] = ends - 1
    for i, s in enumerate(seqs):
        s.row = i
    params = [s.params for s in seqs]
    f["top_k"][:n] = [min(p.top_k, 2**31 - 1) for p in params]       # past the vocabulary: no filtering
    f["seeds"][:n] = [s.seed for s in seqs]
    # The noise counter is the index of the token this row samples: every output token so far, read back or
    # still on the device. (The read-back count alone depended on whether the previous step had been
    # applied yet, i.e. on what else was queued: seeded tokens then changed with the batch.)
    f["counters"][:n] = [len(s.token_ids) - s.num_prompt_tokens for s in seqs]     # Sequence.num_scheduled_outputs
    fl = {name: f[name].view(np.float32) for name in FLOAT_FIELDS}
    fl["temperature"][:n] = [p.temperature for p in params]
    fl["top_p"][:] = 1.0
    fl["top_p"][:n] = [p.top_p for p in params]
    fl["min_p"][:n] = [p.min_p for p in params]
    return buf


def pack_multistep(batch: ScheduledBatch, B: int, W: int, block_size: int, num_slots: int,
                   stop_ids: list[list[int]], remaining: list[int], chunk_pages: int = 0) -> np.ndarray:
    """A K-step decode call's batch (multistep.py): step 0 as `pack`, then stop_ids [B, STOP_IDS] (-1 pads)
    and remaining [B] (0 for padding rows). Block tables include the look-ahead blocks."""
    layout = multistep_layout(B, W)
    buf = np.zeros(layout["_size"][0], np.int32)
    base = pack(batch, B, B, W, block_size, num_slots, chunk_pages)
    buf[:len(base)] = base
    stop = np.full((B, STOP_IDS), -1, np.int32)
    for i, ids in enumerate(stop_ids):
        stop[i, :len(ids)] = ids
    off, n = layout["stop_ids"]
    buf[off:off + n] = stop.reshape(-1)
    off, _ = layout["remaining"]
    buf[off:off + len(remaining)] = remaining
    return buf


def pack_extras(batch: ScheduledBatch, T: int, B: int, W: int, block_size: int, num_slots: int, extras: Extras,
                pen_slots: list[int], num_pen_slots: int, chunk_pages: int = 0,
                eos=frozenset(), in_flight=dict, defer: bool = False) -> tuple[np.ndarray, list[tuple], object]:
    """The extras variant's batch (step.make_extras_step): `pack`'s fields, then per row its penalty slot
    (pen_slots; num_pen_slots = none), prompt length and penalties, then the prompt tokens whose logprobs
    this step computes: their index in the step's tokens and the prompt token that follows each; with bans, the
    ids each row may not sample (min_tokens not reached: its stop_token_ids and the `eos` ids); with bias, each row's
    logit_bias / allowed_token_ids entries; with bad_words, its bans; with choice or grammar, the ids it may sample
    (a grammar row's mask after its input token still on the device: `in_flight()`, seq_id -> that token, waits).
    Returns (packed, [(seq, position of the token whose logprob it is), ...] per prompt-logprob entry, None); with
    `defer` and grammar rows, the masks are left out and the third item writes them into a copy and returns it (the
    step's draw, run after its model part: ExtrasRunner)."""
    layout = extras_layout(T, B, W, extras)
    buf = np.zeros(layout["_size"][0], np.int32)
    base = pack(batch, T, B, W, block_size, num_slots, chunk_pages)
    buf[:len(base)] = base
    f = {name: buf[off:off + n] for name, (off, n) in layout.items() if name != "_size"}
    seqs, n = batch.seqs, len(batch.seqs)
    f["pen_slot"][:] = num_pen_slots
    f["pen_slot"][:n] = pen_slots
    f["num_prompt"][:n] = [s.num_prompt_tokens for s in seqs]
    rep = f["repetition"].view(np.float32)
    rep[:] = 1.0
    rep[:n] = [s.params.repetition_penalty for s in seqs]
    f["frequency"].view(np.float32)[:n] = [s.params.frequency_penalty for s in seqs]
    f["presence"].view(np.float32)[:n] = [s.params.presence_penalty for s in seqs]
    if extras.bans:
        ban = f["ban_ids"].reshape(B, extras.bans)
        ban[:] = BAN_PAD
        for i, seq in enumerate(seqs):
            if seq.banning:
                # EOS too under ignore_eos: vLLM's min_tokens bans all its stop ids (`_all_stop_token_ids`)
                ids = sorted(t for t in set(seq.params.stop_token_ids) | set(eos)
                             if t < 2**31)           # (an id past int32 is past any vocabulary: never sampled)
                ban[i, :len(ids[:extras.bans])] = ids[:extras.bans]
    if extras.bias:                     # logit_bias / allowed_token_ids (SamplingParams.biased_ids)
        ids, vals = f["bias_ids"].reshape(B, extras.bias), f["bias_vals"].view(np.float32).reshape(B, extras.bias)
        ids[:] = BAN_PAD
        for i, p in enumerate(s.params for s in seqs):
            got = p.biased_ids()
            ids[i, :len(got)] = got
            vals[i, :len(got)] = [(p.logit_bias or {}).get(t, 0.0) for t in got]
            f["bias_only"][i] = bool(p.allowed_token_ids)
    def fill(prefix: str, width: int, entries) -> None:     # (id, condition) entries per row (None: none)
        ids, cond = f[prefix + "_ids"].reshape(B, width), f[prefix + "_cond"].reshape(B, width)
        ids[:] = BAN_PAD
        for i, got in enumerate(entries):
            if got is not None:
                ids[i, :len(got)] = [t for t, _ in got]
                cond[i, :len(got)] = [c for _, c in got]

    def bans(seq):                      # (only the output's last tokens are read: not a copy of it all)
        done, span = seq.num_scheduled_outputs, max(map(len, seq.bad_words_ids), default=0)
        return bad_words.entries(seq.bad_words_ids, seq.token_ids[len(seq) - min(done, span):], seq.num_pending, done)
    if extras.bad_words:                # bans of the token each row samples (bad_words.entries)
        fill("bad", extras.bad_words, map(bans, seqs))
    # structured outputs: a row applies them when its on-condition is -1 or its input token (Sequence.constraint)
    gates = [s.constraint() if s.choice is not None or s.grammar is not None else (OFF, 0) for s in seqs]
    if extras.choice:                   # the choice kind: the only ids each constrained row may sample
        fill("choice", extras.choice, [None if s.choice is None or c == OFF else s.choice.entries(
            s.token_ids, s.num_pending if c == NO_COND else 0, eos, start) for s, (c, start) in zip(seqs, gates)])
        f["choice_on"][:] = OFF
        f["choice_on"][:n] = [c if s.choice is not None else OFF for s, (c, _) in zip(seqs, gates)]

    def masks(out: np.ndarray) -> np.ndarray:   # json / regex: each constrained row's bitmask of the ids it may sample
        (off, size), (on_off, _) = layout["grammar_mask"], layout["grammar_on"]
        mask, on, last = out[off:off + size].reshape(B, extras.grammar), out[on_off:on_off + B], None
        on[:] = OFF
        for i, (s, (c, start)) in enumerate(zip(seqs, gates)):
            if s.grammar is not None and c != OFF:
                pending = s.num_pending if c == NO_COND else 0
                if pending and last is None:
                    last = in_flight()                          # (the step in flight's tokens, read once)
                s.grammar.write(mask[i], s.token_ids, start, pending, last.get(s.seq_id) if pending else None)
                on[i] = c
        return out
    where: list[tuple] = []
    if extras.prompt_rows:
        t = 0
        for seq, c in zip(seqs, batch.num_new_tokens):
            s0 = seq.num_computed_tokens
            if seq.params.prompt_logprobs is not None:
                # the token at position p predicts prompt token p + 1 (the last prompt token predicts the
                # first output: that one is a sampled token's logprob, not a prompt logprob)
                for p in range(s0, min(s0 + c, seq.num_prompt_tokens - 1)):
                    f["plp_idx"][len(where)] = t + p - s0
                    f["plp_target"][len(where)] = seq.token_ids[p + 1]
                    where.append((seq, p + 1))
            t += c
        assert len(where) <= extras.prompt_rows, (len(where), extras.prompt_rows)   # the scheduler's limit
    if defer and extras.grammar:
        return buf, where, lambda: masks(buf.copy())
    return (masks(buf) if extras.grammar else buf), where, None


class StepPlan:
    """A step between `LLMEngine.prepare` (scheduled, packed) and `LLMEngine.finish_dispatch` (launched)."""
    __slots__ = ("batch", "key", "K", "filtered", "extras", "packed", "done", "t0", "t1", "t_launch", "t2", "t_put",
                 "ids", "pending")

    def __init__(self, batch, key, K, filtered, extras, packed, done, t0, t1):
        self.batch, self.key, self.K, self.filtered, self.extras, self.packed = batch, key, K, filtered, extras, packed
        self.done, self.t0, self.t1 = done, t0, t1
        self.t_launch = self.t2 = self.t_put = 0.0
        self.ids = self.pending = None
