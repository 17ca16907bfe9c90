"""One request's output as it is generated: token ids in, text deltas out. Shared by `LLM` and the server.

    proc = OutputProcessor(tokenizer, params.stop, stream=True)
    for new_ids, reason in engine_outputs:           # reason: None until the engine finishes the request
        delta = proc.update(new_ids, reason)         # TextDelta(text, token_ids, finish_reason)
        if proc.stopped and reason is None:          # a stop string matched: end the request in the engine
            abort(request)

What it does:
- detokenizes incrementally (jaxinfer.detokenizer: HF tokenizers' DecodeStream for fast tokenizers) when
  the caller streams or the request has stop strings; otherwise it only collects ids and decodes once,
  at the end (no per-token work at all);
- applies stop strings: the text is cut before the first match and the request finishes with "stop";
- holds back the last `len(longest stop) - 1` characters until they cannot start a stop string, so a
  client is never sent text that a later match cuts off. The deltas' texts concatenate to `text`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from jaxinfer.detokenizer import FIXUP_TOKENS, REPLACEMENT, make_detokenizer
from jaxinfer.outputs import CompletionOutput, LogprobsList, cumulative_logprob


@dataclass
class TextDelta:
    """What one request gained in one update."""
    text: str                     # new text ('' while held back or while a character is unfinished)
    token_ids: list[int]          # new token ids
    finish_reason: str | None     # set on the request's last delta ("stop" when a stop string matched)


class OutputProcessor:
    def __init__(self, tokenizer, stop: tuple[str, ...] | list[str] = (), *, stream: bool = True,
                 skip_special_tokens: bool = True, include_stop_str_in_output: bool = False, min_tokens: int = 0,
                 detokenize: bool = True):
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens                      # stop strings count only after this many tokens
        self.include_stop = include_stop_str_in_output    # the text keeps a matched stop string / stop token
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop or ())
        # (with include_stop_str_in_output a match is cut after its end, in new text: nothing to hold back, as vLLM)
        self.holdback = 0 if include_stop_str_in_output else max((len(s) for s in self.stop), default=1) - 1
        self.detokenize = detokenize                       # False: token ids only, the text stays ""
        self.incremental = (stream or bool(self.stop)) and detokenize
        self._detok = make_detokenizer(tokenizer, skip_special_tokens) if self.incremental else None
        self.token_ids: list[int] = []
        self.text = ""                # output text so far, cut before a matched stop string
        self.finish_reason: str | None = None
        self.stopped = False          # a stop string matched (the caller ends the engine request)
        self.stop_string: str | None = None   # the one that matched
        self._sent_chars = 0

    @classmethod
    def for_params(cls, tokenizer, params, stream: bool) -> "OutputProcessor":
        """The processor of a request with these SamplingParams (its stop strings, stop ids and text options)."""
        return cls(tokenizer, params.stop, stream=stream, skip_special_tokens=params.skip_special_tokens,
                   include_stop_str_in_output=params.include_stop_str_in_output, min_tokens=params.min_tokens,
                   detokenize=params.detokenize)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, new_token_ids, finish_reason: str | None = None) -> TextDelta:
        """Consume new token ids (and the engine's finish reason, on its last output). After the request
        finished (by the engine or by a stop string), further ids are ignored. With stop strings, several ids are
        taken one at a time: the output ends at the token that completes a match (the delta and `token_ids` hold
        no id after it), however many tokens an update carried (a K-step call, a reader that fell behind)."""
        if self.finished:
            return TextDelta("", [], None)
        new = list(new_token_ids)
        if self.stop and len(new) > 1:
            parts = []
            for i, t in enumerate(new):
                parts.append(self._update([t], finish_reason if i == len(new) - 1 else None))
                if self.finished:
                    break
            return TextDelta("".join(d.text for d in parts), [t for d in parts for t in d.token_ids],
                             parts[-1].finish_reason)
        return self._update(new, finish_reason)

    def since(self, chars: int, ids: int, ended: bool = False) -> TextDelta:
        """What the deltas so far gave after their first `chars` characters and `ids` ids (and the finish reason,
        unless `ended`): a caller's catch-up after an exception lost deltas it was given (engine_api)."""
        return TextDelta(self.text[chars:self._sent_chars], self.token_ids[ids:], None if ended else self.finish_reason)

    def _update(self, new: list[int], finish_reason: str | None) -> TextDelta:
        self.token_ids += new
        shown = text_ids(new, finish_reason, self.include_stop)
        if not self.incremental:
            if finish_reason is not None:
                ids = self.token_ids[:len(self.token_ids) - len(new) + len(shown)]
                self.text = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) \
                    if self.detokenize else ""
                self.finish_reason = finish_reason
                self._sent_chars = len(self.text)
                return TextDelta(self.text, new, finish_reason)
            return TextDelta("", new, None)
        piece = self._detok.add(shown) if shown else ""
        if finish_reason is not None:
            piece += self._detok.flush()
        if piece:
            old = len(self.text)
            self.text += piece
            # each string: a match ending in the piece, also in a stop token's text kept by include_stop_str_in_output
            # (current vLLM checks it: the string is then the stop_reason; vLLM <= 0.10 skipped that update)
            if self.stop and len(self.token_ids) > self.min_tokens:
                hits = [(i, s) for i, s in ((self.text.find(s, max(0, old - len(s) + 1)), s) for s in self.stop)
                        if i >= 0]
                if hits:
                    # the one completing first; ties: listed first (current vLLM's check_stop_strings)
                    at, self.stop_string = min(hits, key=lambda h: h[0] + len(h[1]))
                    self.text = self.text[:at + len(self.stop_string) if self.include_stop else at]
                    self.stopped = True
                    finish_reason = "stop"
        self.finish_reason = finish_reason
        end = len(self.text) if self.finished else max(self._sent_chars, len(self.text) - self.holdback)
        text, self._sent_chars = self.text[self._sent_chars:end], end
        return TextDelta(text, new, finish_reason)


def text_ids(ids: list[int], finish_reason: str | None, include_stop: bool) -> list[int]:
    """The ids whose text a request shows: all but the token that ended it on a stop condition (the engine's
    finish reason "stop": an EOS id or a stop_token_ids entry), unless include_stop. vLLM leaves that token's
    text out (even with skip_special_tokens=False); its id stays in token_ids."""
    return ids[:-1] if finish_reason == "stop" and ids and not include_stop else ids


# -- logprobs: engine rows (outputs.py) into vLLM's {token_id: Logprob} ---------------------------------

class TokenTexts:
    """decoded_token of logprob entries: each token id decoded once, when an entry is first read. Given the ids
    before it (`context`, up to FIXUP_TOKENS are used), a token holding part of a character (U+FFFD) gets, as vLLM's
    logprobs processor gives one that ends inside a character, the text it completes with them beyond what they
    showed on their own ('' while the character is unfinished): the pieces then concatenate to the text (vLLM
    leaves a token that starts inside a character as U+FFFD + the rest)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.cache = tokenizer, {}
        self.none = getattr(tokenizer, "skipped", False)      # no tokenizer: decoded_token None (vLLM's)

    def __call__(self, token_id: int, context=None) -> str | None:
        if self.none:
            return None
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id])
        if context is not None and REPLACEMENT in text:
            return self.completed(token_id, list(context)[-FIXUP_TOKENS:])
        return text

    def completed(self, token_id: int, context: list[int]) -> str:
        for k in range(1, len(context) + 1):             # the fewest tokens before it that finish its characters
            before = context[-k:]
            full = self.tokenizer.decode(before + [token_id])
            clean = len(before)                          # their text, less their own split tail
            while clean and REPLACEMENT in self(before[clean - 1]):
                clean -= 1
            shown = self.tokenizer.decode(before[:clean]) if clean else ""
            piece = full[len(os.path.commonprefix([shown, full])):]
            if REPLACEMENT not in piece:
                return piece
        text = self(token_id)          # no earlier tokens finish it: "" if it ends inside a character (vLLM's),
        return "" if text.endswith(REPLACEMENT) else text      # else its text (invalid bytes stay U+FFFD)


def stop_reason(seq, proc: OutputProcessor | None, eos, primary: int | None = None) -> int | str | None:
    """vLLM's CompletionOutput.stop_reason: the stop string that matched (proc), or the token id that ended seq
    when it is a stop_token_ids entry or an EOS id other than `primary` (the tokenizer's EOS: vLLM adds a
    generation config's other EOS ids to stop_token_ids); None when it ended on `primary`, on length, or is still
    running. `eos`: the engine's EOS ids."""
    if proc is not None and proc.stopped:
        return proc.stop_string
    if seq.finish_reason != "stop" or not seq.output_token_ids:
        return None
    return stop_token_reason(seq.output_token_ids[-1], seq.params, eos, primary)


def completion(index: int, seq, texts: "TokenTexts", proc: OutputProcessor | None, tokenizer, eos: tuple):
    """A finished sample's CompletionOutput (LLM.generate's): with stop strings the processor's text (cut before the
    match) and reason, else its ids decoded; `eos`: (the engine's EOS ids, the primary one) for stop_reason."""
    if proc is not None:
        text, reason = proc.text, proc.finish_reason or seq.finish_reason
    else:
        p = seq.params
        ids = text_ids(seq.output_token_ids, seq.finish_reason, p.include_stop_str_in_output)
        text = tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens) if p.detokenize else ""
        reason = seq.finish_reason
    lps, cum = logprobs_of(seq, 0, seq.output_token_ids, texts)
    return CompletionOutput(index, text, seq.output_token_ids, cum, lps, reason, stop_reason(seq, proc, *eos))


def stop_token_reason(tok: int, params, eos, primary: int | None) -> int | None:
    """The stop_reason of a request that ended ("stop") on token `tok`, no stop string having matched."""
    if not params.ignore_eos and tok == primary:
        return None                                   # EOS proper (checked first, as vLLM's check_stop does)
    if tok in params.stop_token_ids or (not params.ignore_eos and tok in eos):
        return tok
    return None


def eos_ids(tokenizer, model_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The ids that end a request unless ignore_eos: the tokenizer's EOS (vLLM's eos_token_id) and the model's
    config.json / generation_config.json ones (vLLM adds those as stop ids), the model's first."""
    t = getattr(tokenizer, "eos_token_id", None)
    return tuple(dict.fromkeys(tuple(model_ids) + ((t,) if t is not None else ())))


def primary_eos(tokenizer, eos: tuple[int, ...]) -> int | None:
    """The EOS id that ends a request with stop_reason None: the tokenizer's when the engine stops on it, else the
    model's first (`eos`: the engine's EOS ids, the model config's first)."""
    t = getattr(tokenizer, "eos_token_id", None)
    return t if t in eos else (eos[0] if eos else None)


def logprobs_of(seq, start: int, token_ids: list[int], texts: TokenTexts, cum_before: float = 0.0):
    """(logprobs, cumulative_logprob) of seq's output tokens start .. start + len(token_ids), or
    (None, None) when the request did not ask for logprobs. cum_before: the cumulative logprob of the
    tokens before start (a stream carries it, instead of summing every row again for each delta)."""
    n = seq.params.logprobs
    if n is None:
        return None, None
    rows = seq.logprob_rows[start:start + len(token_ids)]
    texts = texts if seq.params.detokenize else None              # detokenize=False: decoded_token None (vLLM)
    before = seq.output_token_ids[max(0, start - FIXUP_TOKENS):start]
    return LogprobsList(rows, list(token_ids), n, texts, before), cum_before + cumulative_logprob(rows)


def prompt_logprobs_of(seq, texts: TokenTexts):
    """vLLM's prompt_logprobs of seq (the first entry None), or None when not asked."""
    rows = seq.prompt_logprob_rows
    if rows is None:
        return None
    return LogprobsList(rows, seq.token_ids[:seq.num_prompt_tokens], seq.params.prompt_logprobs,
                        texts if seq.params.detokenize else None, [])


def metrics_of(seq) -> dict:
    """A request's timings from its first sample: ttft_s once a token came, tpot_s once two did."""
    m = {}
    if seq.first_token_time is not None:
        m["ttft_s"] = seq.first_token_time - seq.arrival_time
        if seq.num_output_tokens > 1:
            m["tpot_s"] = (seq.token_times[-1] - seq.first_token_time) / (seq.num_output_tokens - 1)
    return m


def warm_up(tokenizer) -> None:
    """A text prompt's encoding, a stop-string detokenizer and a decode, run once (LLM() after its warm-up), so that
    nothing lazy is left for the first request; nothing without a tokenizer (skip_tokenizer_init=True)."""
    from jaxinfer import prompts
    if getattr(tokenizer, "skipped", False):
        return
    ids = prompts.token_ids(tokenizer, "Warm-up: nothing lazy is left for the first request.", 0)
    OutputProcessor(tokenizer, ("\n\n",), stream=True).update(ids, "length")
    tokenizer.decode(ids, skip_special_tokens=True)
