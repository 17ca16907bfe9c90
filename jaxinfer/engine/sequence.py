"""One request as the engine sees it: token ids, how many have KV in the cache, its block table."""
from __future__ import annotations

import enum
import itertools

import numpy as np

from jaxinfer.sampling_params import SamplingParams
from jaxinfer.structured import NO_COND, OFF


class Status(enum.Enum):
    WAITING = "waiting"      # no blocks (new, or preempted and waiting to be recomputed)
    RUNNING = "running"      # has blocks; prefilling (num_computed < len) or decoding
    FINISHED = "finished"


_ids = itertools.count()


def id_mark() -> int:
    """An id below every later sequence's (it takes one id no sequence gets): `one_thread.recover`'s `since`."""
    return next(_ids)
PLACEHOLDER = -1   # a sampled token still on the device (async scheduling); filled when its step is read


class Sequence:
    def __init__(self, token_ids: list[int], params: SamplingParams, seed: int, block_size: int):
        self.seq_id = next(_ids)
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.params = params
        self.seed = seed                  # per-request RNG seed (params.seed, or drawn by the engine)
        self.block_size = block_size
        self.block_table: list[int] = []
        self._table_array = None          # (block_table list, its numpy copy): see block_table_array
        self.row = -1                     # this sequence's row in the last dispatched step (set by the packer)
        self.num_pending = 0              # trailing PLACEHOLDER tokens (sampled, not yet read back)
        self.num_computed_tokens = 0      # tokens whose KV is in the cache
        self.num_cached_tokens = 0        # of those, tokens found in the prefix cache at (first) admission
        self.admitted = False             # given blocks once (a preempted sequence keeps num_cached_tokens)
        self.num_hashed_blocks = 0        # leading blocks already registered in the prefix cache
        self.last_hash: bytes | None = None   # chained hash of the last of those
        self.hash_seed: bytes | None = None   # the chain's start: the request's cache_salt hashed (None: no salt)
        # params.bad_words as token sequences (SamplingParams.check_vocab, bad_words.token_ids)
        self.bad_words_ids: list[list[int]] = getattr(params, "_bad_words_token_ids", None) or []
        self.choice = getattr(params, "_choice_rule", None)     # structured_outputs' choice (structured.ChoiceRule)
        rule = getattr(params, "_grammar_rule", None)           # its json / regex (grammar.GrammarState)
        self.grammar = rule.start() if rule is not None else None
        self.reasoning_end: int | None = None     # choice / grammar wait for this id (a reasoning parser's </think>)
        self.constrained_from = self.num_prompt_tokens  # where the structured output starts (or the scan, waiting)
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.text = ""                    # detokenized output so far (kept only when stop strings need it)
        self.first_token_time: float | None = None
        self.arrival_time: float | None = None
        self.first_scheduled_time: float | None = None   # given its first KV blocks (block_manager.allocate)
        self.token_times: list[float] = []
        # logprobs (engine/extras.py): one row per output token read back, and per prompt position (None
        # for the first token and for positions not computed yet); rows as outputs.logprob_dict reads them
        self.logprob_rows: list[list[float]] = []
        self.prompt_logprob_rows = [None] * len(token_ids) if params.prompt_logprobs is not None else None
        self.needs_extras = params.needs_extras     # read for every row of every step: computed once
        self.filter_kind = params.filter_kind       # (likewise: False, "top_k" or True, SamplingParams.filter_kind)
        self.prompt_source: Sequence | None = None   # sample 0 of an n > 1 request (see waits_for_prompt)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens read back so far."""
        return len(self.token_ids) - self.num_prompt_tokens - self.num_pending

    @property
    def num_scheduled_outputs(self) -> int:
        """Generated tokens including those still on the device."""
        return len(self.token_ids) - self.num_prompt_tokens

    def constraint(self) -> tuple[int, int]:
        """(condition, start) of this row's structured output (choice / grammar) in the step being packed: (-1, the
        index of its first token in token_ids) when it applies. While it waits for `reasoning_end` (the thinking is
        not constrained): (reasoning_end, len) when the token in flight may be that id (the structured output's
        first step, which applies on the device only if it is), else (OFF, len)."""
        if self.reasoning_end is not None:
            read = len(self.token_ids) - self.num_pending
            tail = self.token_ids[self.constrained_from:read]
            if self.reasoning_end not in tail:
                self.constrained_from = read
                return (self.reasoning_end if self.num_pending else OFF), len(self.token_ids)
            self.constrained_from += tail.index(self.reasoning_end) + 1
            self.reasoning_end = None
        return NO_COND, self.constrained_from

    @property
    def banning(self) -> bool:
        """Whether the token this sequence samples next must not end it (min_tokens not reached; counted with the
        tokens still on the device, as a step is packed before the one in flight is read back)."""
        return self.params.min_tokens > self.num_scheduled_outputs

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:len(self.token_ids) - self.num_pending]

    @property
    def reuses_prefix_cache(self) -> bool:
        """Prompt logprobs and penalty counts are computed from every token that enters a step, so such a
        request computes its whole prompt (as vLLM does for prompt logprobs) instead of skipping cached blocks."""
        return self.params.prompt_logprobs is None and not self.params.has_penalties

    def waits_for_prompt(self) -> bool:
        """A later sample of an n > 1 request waits to be admitted until sample 0's prompt blocks are in the
        prefix cache, then reuses them instead of computing the same prompt again. It stops waiting for good
        once they are there, once sample 0 finished, or when this one cannot reuse the cache anyway."""
        src = self.prompt_source
        if src is not None and (src.status is Status.FINISHED or not self.reuses_prefix_cache or
                                src.num_hashed_blocks >= (self.num_prompt_tokens - 1) // self.block_size):
            self.prompt_source = src = None
        return src is not None

    @property
    def num_blocks_needed(self) -> int:
        """Blocks to hold the KV of every current token."""
        return -(-len(self.token_ids) // self.block_size)

    @property
    def is_prefilling(self) -> bool:
        # More than the last token lacks KV. (Computing just the last token is a decode step.)
        return self.num_computed_tokens < len(self.token_ids) - 1

    def block_table_array(self):
        """block_table as int32 numpy, cached until the table changes (the packer copies it every step)."""
        # block_table only grows in place (append) or is replaced by a new list (allocate / free)
        src, arr = self._table_array or (None, None)
        if src is not self.block_table or len(arr) != len(src):
            arr = np.asarray(self.block_table, np.int32)
            self._table_array = (self.block_table, arr)
        return arr

    def block_tokens(self, i: int) -> tuple[int, ...]:
        return tuple(self.token_ids[i * self.block_size:(i + 1) * self.block_size])

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, len={len(self)}, computed={self.num_computed_tokens}, "
                f"blocks={len(self.block_table)}, {self.status.value})")


def stamp_token_times(updated: list[Sequence], now: float, one_each: bool) -> None:
    """Record `now` as the time of each sequence's new output tokens (one each: the common decode step)."""
    for seq in updated:
        if one_each:
            seq.token_times.append(now)
        else:
            new = len(seq.token_ids) - seq.num_prompt_tokens - seq.num_pending - len(seq.token_times)
            if new > 0:
                seq.token_times.extend([now] * new)
        if seq.first_token_time is None:
            seq.first_token_time = now


def is_finished(seq: Sequence) -> bool:
    return seq.status is Status.FINISHED
