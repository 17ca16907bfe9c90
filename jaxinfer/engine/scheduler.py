"""Continuous batching: which sequences compute which tokens in the next step.

A step is all-prefill or all-decode (as nano-vllm). Prefill steps continue partly computed prompts, then admit waiting
sequences FCFS, chunked to fit `max_num_batched_tokens`. Decode steps compute a token per running sequence; when blocks
run out the newest is preempted (its blocks freed) and goes back to the queue's front, to be recomputed.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from jaxinfer.config import EngineConfig
from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.sequence import PLACEHOLDER, Sequence, Status

PROMPT_LOGPROB_TOKENS = 256   # prompt tokens with logprobs per step: their [Tp, V] fp32 logits stay small


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]     # tokens each sequence computes this step
    is_prefill: bool
    sampled: list[bool] | None = None   # set at dispatch: which rows sample a token
    num_steps: int = 1            # decode steps run on the device in this call (multistep.py)
    steps: list[int] | None = None  # a K-step call: tokens each row may sample in it (min(K, its remaining))


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, eos_token_ids: tuple[int, ...] = ()):
        self.config = config
        self.bm = block_manager
        self.eos = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_prefix_hit_tokens = 0
        self.num_dropped_tokens = 0     # read back, then cut by a stop string (not counted as generated)
        self.building: list[Sequence] = []    # such sequences whose index is being built: they join `waiting` then

    def add(self, seq: Sequence) -> None:
        (self.building if seq.grammar is not None and not seq.grammar.ready() else self.waiting).append(seq)

    def recount_blocks(self) -> None:
        """BlockManager.recount from the sequences queued here (one_thread.recover, after an exception)."""
        self.bm.recount([*self.waiting, *self.running])

    def can_admit(self) -> bool:
        """Whether the next prefill step would admit the first waiting sequence (a free row and blocks)."""
        return bool(self.waiting) and len(self.running) < self.config.max_num_seqs and \
            self.bm.can_allocate(self.waiting[0]) and not self._waits(self.waiting[0])

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.building)

    def schedule(self) -> ScheduledBatch | None:
        if self.building:               # (vLLM's WAITING_FOR_FSM: the requests behind them are not held up)
            ready = [s.grammar.ready() for s in self.building]
            self.waiting.extend(s for s, r in zip(self.building, ready) if r)
            self.building = [s for s, r in zip(self.building, ready) if not r]
        return self._schedule_prefill() or self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledBatch | None:
        budget = self.config.max_num_batched_tokens
        plp = [PROMPT_LOGPROB_TOKENS]                   # prompt tokens with logprobs left in this step
        seqs, counts = [], []
        # chunked prompts first (is_prefilling, inlined: this loop runs over every row of every step)
        for seq in [q for q in self.running if q.num_computed_tokens < len(q.token_ids) - 1]:
            if budget > 0 and self._chunk(seq, budget, plp):
                n = self._chunk(seq, budget, plp, take=True)
                seqs.append(seq), counts.append(n)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self.bm.can_allocate(seq) or not self._chunk(seq, budget, plp) or self._waits(seq):
                break
            seq.status = Status.RUNNING
            self.running.append(seq)    # queued before it leaves `waiting` and before allocate (an exception there:
            self.waiting.popleft()      # recompute_all puts it back)
            self.num_prefix_hit_tokens += self.bm.allocate(seq)
            n = self._chunk(seq, budget, plp, take=True)
            seqs.append(seq), counts.append(n)
            budget -= n
        return ScheduledBatch(seqs, counts, True) if seqs else None

    def _waits(self, seq: Sequence) -> bool:
        """An n > 1 sample waiting for sample 0's prompt to be cached (Sequence.waits_for_prompt)."""
        return self.bm.prefix_caching and seq.waits_for_prompt()

    def _chunk(self, seq: Sequence, budget: int, plp: list[int], take: bool = False) -> int:
        """Tokens of seq's prompt to compute this step, within the budget (and plp[0], prompt-logprob rows left)."""
        n = min(len(seq) - seq.num_computed_tokens, budget)
        if seq.params.prompt_logprobs is not None:
            n = min(n, plp[0])
            plp[0] -= n if take else 0
        return n

    def _schedule_decode(self) -> ScheduledBatch | None:
        # every decode step's hot loop (hundreds of rows): is_prefilling, "last token sampled" and can_append inlined
        seqs, bs, max_len = [], self.config.block_size, self.config.max_model_len
        for seq in list(self.running):
            n = len(seq.token_ids)
            if seq.status is not Status.RUNNING or seq.num_computed_tokens < n - 1 or \
                    n - seq.num_prompt_tokens >= seq.params.max_tokens or n >= max_len and n > seq.num_prompt_tokens:
                continue       # not running, prefilling, or its last token is sampled already (a prompt of max_len
                # tokens, chunked down to its last one, still computes it and samples one token)
            if -(-n // bs) > len(seq.block_table):      # a new block (or preemption when the pool is empty)
                while not self.bm.can_append(seq):
                    victim = self.running[-1]
                    self.preempt(victim)
                    if victim is seq:
                        break
                else:
                    self.bm.append(seq)
                    seqs.append(seq)
            else:
                seqs.append(seq)
            if len(seqs) == self.config.max_num_seqs:
                break
        return ScheduledBatch(seqs, [1] * len(seqs), False) if seqs else None

    def on_dispatch(self, batch: ScheduledBatch) -> None:
        """The step is on its way: count its tokens as computed and give each sampling row a placeholder token (a
        K-step call: one per token it may sample), so the next step can be scheduled before this one is read back."""
        if batch.steps is not None:
            for seq, m in zip(batch.seqs, batch.steps):
                seq.num_computed_tokens += m
                seq.token_ids.extend([PLACEHOLDER] * m)
                seq.num_pending += m
            return
        if not batch.is_prefill:        # a decode row computes its last token, so it always samples one
            for seq in batch.seqs:
                seq.num_computed_tokens += 1
                seq.token_ids.append(PLACEHOLDER)
                seq.num_pending += 1
            batch.sampled = [True] * len(batch.seqs)
            return
        batch.sampled = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            done = seq.num_computed_tokens == len(seq)
            if done:
                seq.token_ids.append(PLACEHOLDER)
                seq.num_pending += 1
            batch.sampled.append(done)

    # -- K-step decode calls (multistep.py) --------------------------------------------------------
    def stop_ids(self, seq: Sequence) -> list[int]:
        """The ids that end seq (EOS unless ignore_eos, stop_token_ids) for the device; ids past int32 left out."""
        ids = [] if seq.params.ignore_eos else sorted(self.eos)
        return ids + [t for t in seq.params.stop_token_ids if t not in ids and t < 2**31]

    def remaining(self, seq: Sequence) -> int:
        """Tokens seq may still sample (max_tokens, max_model_len; those on the device counted; a full prompt: 1)."""
        room = self.config.max_model_len - len(seq)
        return min(seq.params.max_tokens - seq.num_scheduled_outputs, room if len(seq) > seq.num_prompt_tokens else
                   max(room, 1))

    def plan_steps(self, batch: ScheduledBatch, ks: tuple[int, ...], max_stop_ids: int, queued: bool = False) -> int:
        """Steps for this decode batch: 1, or a K of `ks` (sorted) with look-ahead blocks reserved for it. K = 1 while
        requests wait (they join at the next call), for a row whose filter needs the sorted vocabulary (filter_kind),
        with more than max_stop_ids stop ids or in the extras variant, or without the pool's look-ahead blocks; else
        the largest K the longest row's remaining tokens reach (rows that end sooner are masked on the device), or
        the smallest if that wastes at most 3 steps. queued (a K-step call in flight): the smallest K (a row that stops
        in that call wastes this one's steps, and the GPU is busy anyway while the host prepares the next)."""
        if batch.is_prefill or not ks or self.waiting:
            return 1
        if any(s.filter_kind is True or len(self.stop_ids(s)) > max_stop_ids or s.needs_extras and (
                s.params.has_penalties or s.params.logprobs is not None or s.banning or s.params.has_bias or
                s.bad_words_ids or s.choice or s.grammar) for s in batch.seqs):
            return 1
        rem = [self.remaining(s) for s in batch.seqs]
        # none fits: the smallest K, unless it would run more than 3 masked steps (xla compiles K = 16 alone)
        K = max((k for k in ks[:1 if queued else None] if k <= max(rem)),
                default=ks[0] if ks[0] - max(rem) <= 3 else 1)
        if K <= 1:
            return 1
        bs = self.config.block_size
        extra = sum(max(0, -(-(s.num_computed_tokens + min(K, r)) // bs) - len(s.block_table))
                    for s, r in zip(batch.seqs, rem))
        if extra > self.bm.num_free_blocks:
            return 1
        for s, r in zip(batch.seqs, rem):
            self.bm.reserve(s, s.num_computed_tokens + min(K, r))
        batch.num_steps, batch.steps = K, [min(K, r) for r in rem]
        batch.sampled = [True] * len(batch.seqs)
        return K

    def postprocess_steps(self, batch: ScheduledBatch, ids) -> tuple[list[Sequence], int]:
        """Apply a K-step call's ids [K, rows] (-1 after a row stopped) to its rows' placeholders (on_dispatch); return
        (updated sequences, tokens). Calls apply in dispatch order, so a row's first pending tokens are this call's.
        The host checks every stop condition again; a row that stops drops the tokens still pending after it."""
        updated, count, max_len = [], 0, self.config.max_model_len
        for i, (seq, m) in enumerate(zip(batch.seqs, batch.steps)):
            if seq.status is Status.FINISHED:             # finished (or aborted) while the call ran
                continue
            p, reason, toks = seq.params, None, seq.token_ids
            for tok in ids[:m, i].tolist():
                if tok < 0:                               # (never before a stop the host sees: see multistep.py)
                    reason = "stop"
                    break
                toks[len(toks) - seq.num_pending] = tok
                seq.num_pending -= 1
                count += 1
                if (not p.ignore_eos and tok in self.eos) or tok in p.stop_token_ids:
                    reason = "stop"                       # (first, as vLLM's check_stop: EOS as the last token allowed)
                elif seq.num_output_tokens >= p.max_tokens or len(toks) - seq.num_pending >= max_len:
                    reason = "length"
                if reason:
                    break
            if seq.status is Status.RUNNING:              # (not preempted while the call ran)
                if reason == "stop":                      # the device masked the row: no KV for the stop token
                    seq.num_computed_tokens = min(seq.num_computed_tokens, len(toks) - seq.num_pending - 1)
                self.bm.cache_full_blocks(seq)
            if reason:
                self.finish(seq, reason)
            updated.append(seq)
        return updated, count

    def preempt(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)    # queued before it leaves `running` and before free_seq (an exception there:
        self.running.remove(seq)        # recompute_all frees its blocks)
        self.bm.free_seq(seq)
        self.num_preemptions += 1

    def recompute_all(self) -> None:
        """The KV pages are lost (runner.lost_buffers) or a step was interrupted (one_thread.recover): every queued
        sequence drops its tokens on the device, gives back its blocks and waits; the prefix cache is emptied."""
        keep = [s for s in dict.fromkeys([*reversed(self.running), *self.waiting]) if s.status is not Status.FINISHED]
        for seq in keep:                              # (in the order preempt gives them)
            while seq.token_ids and seq.token_ids[-1] == PLACEHOLDER:
                seq.token_ids.pop()
            if seq.grammar is not None:               # (its guide may have gone past a dropped token: replayed)
                seq.grammar.reset()
            seq.num_pending, n = 0, len(seq.token_ids)     # (its last token may have ended it: an interrupted finish)
            reason = n > seq.num_prompt_tokens and self.check_stop(seq, seq.token_ids[-1], n)
            self.finish(seq, reason) if reason else self.bm.free_seq(seq)
        self.running, self.waiting = [], deque(s for s in keep if s.status is not Status.FINISHED)
        self.num_preemptions += sum(s.status is Status.RUNNING for s in self.waiting)
        for seq in self.waiting:
            seq.status = Status.WAITING
        self.bm.reset_prefix_cache()

    def postprocess(self, batch: ScheduledBatch, token_ids) -> list[Sequence]:
        """Record computed tokens and sampled ids; finish sequences that hit a stop condition. Returns the sequences
        that received a new token this step."""
        updated = []
        bs, caching = self.bm.block_size, self.bm.prefix_caching
        ids = token_ids.tolist() if isinstance(token_ids, np.ndarray) else [int(t) for t in token_ids]
        for seq, sampled, tok in zip(batch.seqs, batch.sampled, ids):
            if seq.status is Status.FINISHED:             # finished (or aborted) while this step ran
                continue
            toks, reason = seq.token_ids, None
            if sampled:                                   # not a prompt chunk that stops mid-prompt
                toks[len(toks) - seq.num_pending] = tok
                seq.num_pending -= 1
                # len - num_pending: a token dispatched after this one is not part of the sequence yet
                reason = self.check_stop(seq, tok, len(toks) - seq.num_pending)
                if reason == "stop":    # a K-step call queued behind this step masks the row: its KV is not written
                    seq.num_computed_tokens = min(seq.num_computed_tokens, len(toks) - seq.num_pending - 1)
            # a block became full (its KV written and its tokens known): register it in the prefix cache
            if caching and min(seq.num_computed_tokens, len(toks) - seq.num_pending) // bs > seq.num_hashed_blocks:
                self.bm.cache_full_blocks(seq)
            if not sampled:
                continue
            updated.append(seq)
            if reason:
                self.finish(seq, reason)
        return updated

    def check_stop(self, seq: Sequence, tok: int, n: int) -> str | None:
        """vLLM's check_stop for seq's n-th token `tok`: stop ids first (EOS as the last token allowed is "stop")."""
        if (not seq.params.ignore_eos and tok in self.eos) or tok in seq.params.stop_token_ids:
            return "stop"
        long = n - seq.num_prompt_tokens >= seq.params.max_tokens or n >= self.config.max_model_len
        return "length" if long else None

    def finish(self, seq: Sequence, reason: str, drop: int = 0) -> None:
        """End a sequence (stop condition, stop string, or abort) and return its blocks to the pool. drop: output
        tokens read back after a stop string's match (a K-step call's), removed even if seq has finished."""
        if drop:
            end = len(seq.token_ids) - seq.num_pending
            del seq.token_ids[end - drop:end]
            self.num_dropped_tokens += drop
        if seq.status is Status.FINISHED:
            return
        if seq.num_pending:                               # drop tokens sampled past the end
            del seq.token_ids[len(seq) - seq.num_pending:]
            seq.num_pending = 0
        queue = self.running if seq.status is Status.RUNNING else self.building if seq in self.building else \
            self.waiting
        seq.finish_reason, seq.status = reason, Status.FINISHED   # first (one line): an exception below, e.g. a
        if seq in queue:       # KeyboardInterrupt, leaves it finished; recompute_all drops it from the queues (in
            queue.remove(seq)  # neither, or both: one cut short a move between them) and recount frees its blocks
        self.bm.free_seq(seq)
