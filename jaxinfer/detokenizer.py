"""Incremental detokenization: turn a growing list of token ids into text pieces as they are generated.

Decoding one token at a time is wrong in two ways: a byte-level BPE token can hold part of a multi-byte
UTF-8 character (decode gives U+FFFD until the rest arrives), and some tokenizers decode a token
differently depending on its left neighbour (leading-space handling). So, as vLLM does, we decode a short
*window* of recent tokens (`prefix_offset` .. end) and emit only what the window's text gained since the
last call, holding back a trailing run of U+FFFD (an unfinished character). The window starts a few tokens
before the last emitted token, which gives the decoder its left context and keeps each call O(window).

`TextStream` adds what streaming needs on top: stop strings (the text is cut before the first match and the
request is reported as stopped) and a hold-back of `len(longest stop) - 1` characters, so a client is
never sent a prefix of a stop string that is later cut off. Concatenated pieces == the final text.
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 5          # tokens of left context kept in the decode window


class IncrementalDetokenizer:
    """Feed it token ids (`add`); it returns the new stable text each time; `flush` returns the rest."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""               # everything emitted so far
        self._prefix_offset = 0      # first token of the decode window
        self._emitted_in_window = 0  # characters of decode(window) already emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_token_ids) -> str:
        """Append token ids; return the text they complete ('' while a character is unfinished)."""
        self.token_ids.extend(int(t) for t in new_token_ids)
        window = self._decode(self.token_ids[self._prefix_offset:])
        stable = window.rstrip(REPLACEMENT)
        piece = stable[self._emitted_in_window:] if len(stable) > self._emitted_in_window else ""
        self._emitted_in_window = max(self._emitted_in_window, len(stable))
        if len(stable) == len(window):      # nothing pending: slide the window forward
            start = max(self._prefix_offset, len(self.token_ids) - CONTEXT_TOKENS)
            if start != self._prefix_offset:
                self._prefix_offset = start
                self._emitted_in_window = len(self._decode(self.token_ids[start:]))
        self.text += piece
        return piece

    def flush(self) -> str:
        """The text not yet emitted (a trailing unfinished character shows as U+FFFD, as in `decode`)."""
        full = self._decode(self.token_ids)
        piece = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += piece
        return piece


class TextStream:
    """One request's output text as it streams: detokenizes, applies stop strings, yields deltas.

    `update(output_token_ids, finished)` consumes the tokens not seen yet and returns True when a stop
    string matched (the caller then finishes the request). `pop_delta()` returns the (text, token ids)
    produced since the previous call; with `finished=True` it releases everything held back.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True):
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stop = tuple(stop)
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""               # output text, cut before a matched stop string
        self.stopped = False
        self.finished = False
        self._num_tokens = 0         # tokens consumed from the sequence's output
        self._sent_chars = 0
        self._sent_tokens = 0

    def update(self, output_token_ids: list[int], finished: bool = False) -> bool:
        if self.stopped or self.finished:
            return self.stopped
        new = output_token_ids[self._num_tokens:]
        self._num_tokens = len(output_token_ids)
        piece = self.detok.add(new) if new else ""
        if finished:
            piece += self.detok.flush()
            self.finished = True
        if piece and self.stop:
            start = max(0, len(self.text) - self.holdback)   # a match may straddle the old end
            self.text += piece
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                self.stopped = self.finished = True
        else:
            self.text += piece
        return self.stopped

    def pop_delta(self, output_token_ids: list[int] | None = None) -> tuple[str, list[int]]:
        """New text (minus the stop-string hold-back unless finished) and new token ids since last call."""
        end = len(self.text) if self.finished else max(self._sent_chars, len(self.text) - self.holdback)
        text = self.text[self._sent_chars:end]
        self._sent_chars = end
        ids: list[int] = []
        if output_token_ids is not None:
            ids = list(output_token_ids[self._sent_tokens:])
            self._sent_tokens = len(output_token_ids)
        return text, ids
