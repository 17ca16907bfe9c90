"""One HTTP request's engine requests ("choices": one per prompt and n) as they run: submit, follow the core's
outputs through one `OutputProcessor` each, keep logprobs, time them for /metrics, abort what is left.

Choice index = prompt index * n + sample index (OpenAI's order). Sample i runs as its own engine request with
`SamplingParams.for_sample(i)` (a seed is derived per sample, as LLM.generate does with n).
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace

from jaxinfer.output_processor import OutputProcessor, TextDelta, stop_token_reason
from jaxinfer.server.client import CoreClient
from jaxinfer.server.gate import DP_RANK


class Choice:
    """One engine request's state in the API process."""
    __slots__ = ("index", "prompt_ids", "params", "proc", "logprobs", "prompt_logprobs", "t_first", "t_end", "sent",
                 "eos", "cached")

    def __init__(self, index: int, prompt_ids: list[int], params, proc: OutputProcessor, eos=((), None)):
        self.index, self.prompt_ids, self.params, self.proc = index, prompt_ids, params, proc
        self.eos = eos                                  # (the engine's EOS ids, the one reported as None)
        self.logprobs: list[list] = []              # engine rows (outputs.py), one per generated token (if asked)
        self.prompt_logprobs: list[list | None] | None = None       # one per prompt token, the first None
        self.t_first: float | None = None
        self.t_end: float | None = None
        self.sent = 0                                            # generated tokens whose logprobs were streamed
        self.cached = 0                                          # its prompt tokens found in the prefix cache

    @property
    def token_ids(self) -> list[int]:
        return self.proc.token_ids

    @property
    def stop_reason(self) -> int | str | None:
        """vLLM's stop_reason: the stop string that matched, or the token id the choice ended on when it is a
        stop_token_ids entry or an EOS id other than the tokenizer's (output_processor.stop_reason); else None."""
        if self.proc.stopped:
            return self.proc.stop_string
        ids = self.token_ids
        if self.proc.finish_reason == "stop" and ids:
            return stop_token_reason(ids[-1], self.params, *self.eos)
        return None


def expand(prompts: list[list[int]], params: list, n: int, stream_prompt_logprobs: bool = False) -> list[tuple]:
    """(prompt ids, params) per choice. Prompt logprobs are asked of sample 0 only (the same for every sample),
    except when streaming (each choice's first chunk carries its prompt's)."""
    items = []
    for ids, sp in zip(prompts, params):
        for i in range(n):
            s = sp.for_sample(i) if sp.n > 1 else sp          # (beam search: n copies of one, beam.py)
            if stream_prompt_logprobs and i > 0:
                s = replace(s, prompt_logprobs=sp.prompt_logprobs)
            items.append((ids, s))
    return items


def run(client: CoreClient, tokenizer, items: list[tuple], stream: bool, metrics=None, t_start: float | None = None,
        n: int = 1, cache_salt: str | None = None) -> AsyncIterator[tuple[Choice, TextDelta]]:
    """Submit the choices now (so that they count against the admission bound at once, before a stream's
    first event); the returned iterator yields (choice, delta) as outputs arrive, until all finish. Leaving it
    early (client gone, error) aborts what is still running in the core."""
    t_start = time.perf_counter() if t_start is None else t_start
    eos = client.info.limits.get("eos", ((), None))
    eos = (frozenset(eos[0]), eos[1])
    choices = [Choice(i, ids, sp, OutputProcessor.for_params(tokenizer, sp, stream), eos)
               for i, (ids, sp) in enumerate(items)]
    sources = [i - i % n if i % n else None for i in range(len(items))] if n > 1 else None   # sample 0's prompt KV
    coll = client.submit(items, eager=stream or any(sp.stop for _, sp in items), sources=sources, cache_salt=cache_salt,
                         rank=DP_RANK.get())
    return _follow(client, coll, choices, metrics, t_start, n)


async def _follow(client: CoreClient, coll, choices: list[Choice], metrics, t_start: float, n: int = 1):
    left, done = len(choices), [0] * -(-len(choices) // n)     # choices finished per prompt (n each)
    try:
        while left:
            for index, ids, reason, lps, plps in await coll.get():
                ch = choices[index]
                if ch.proc.finished:
                    continue
                ch.cached = coll.cached.get(index, 0)
                if plps is not None and ch.prompt_logprobs is None:
                    ch.prompt_logprobs = plps
                if lps:
                    ch.logprobs += lps
                now = time.perf_counter()
                if ids and ch.t_first is None:              # (when it reached this process, woken or not)
                    ch.t_first = coll.first.get(index, now)
                d = ch.proc.update(ids, reason)
                if ch.proc.stopped:                         # no token (or logprob row) past the match counts
                    del ch.logprobs[len(ch.token_ids):]
                if ch.proc.stopped and reason is None:      # a stop string matched: end it in the core
                    client.abort(coll, [index], kept=len(ch.token_ids))
                if d.finish_reason is not None:
                    left -= 1
                    ch.t_end = now
                    if metrics is not None:
                        metrics.observe_request(t_start, ch.t_first, now, len(ch.token_ids), d.finish_reason)
                        done[g := index // n] += 1
                        if done[g] == n:
                            group = choices[g * n:(g + 1) * n]
                            metrics.observe_group(n, ch.params.max_tokens, max(len(c.token_ids) for c in group))
                yield ch, d
    finally:
        client.abort(coll)
