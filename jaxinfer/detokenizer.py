"""Incremental detokenization: turn a growing list of token ids into text pieces as they are generated.

Decoding one token at a time is wrong in two ways: a byte-level BPE token can hold part of a multi-byte
UTF-8 character (decode gives U+FFFD until the rest arrives), and some tokenizers decode a token
differently depending on its left neighbour (leading-space handling). Three decoders handle both:

- `FastDetokenizer`: HF tokenizers' own `DecodeStream` (Rust; what vLLM uses for fast tokenizers). Used
  whenever the tokenizer is a fast one (it has a `backend_tokenizer`).
- `ByteDetokenizer`: for the byte-level stand-in of the presets (jaxinfer.tokenizer.ByteTokenizer), with
  Python's incremental UTF-8 decoder.
- `WindowDetokenizer`: for other tokenizers (slow HF tokenizers).
  As vLLM's slow path, it decodes a short *window* of recent tokens and emits only what the window's text
  gained since the last call, holding back a trailing run of U+FFFD (an unfinished character).

Each promises: the pieces returned by `add` and then `flush` concatenate to exactly
`tokenizer.decode(all_ids, skip_special_tokens=...)`. `make_detokenizer` picks one.
"""
from __future__ import annotations

import codecs

REPLACEMENT = "\ufffd"
FIXUP_TOKENS = 4            # tokens before a logprob entry that may finish its split character (vLLM's)
CONTEXT_TOKENS = 5          # tokens of left context kept in the decode window


class WindowDetokenizer:
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


# The window decoder's old name (kept for code that imported it).
IncrementalDetokenizer = WindowDetokenizer


class FastDetokenizer:
    """HF tokenizers' `DecodeStream` behind the same `add` / `flush` interface as `WindowDetokenizer`.

    DecodeStream returns None while a character is unfinished and never emits bytes that stay
    unfinished at the end; `flush` then falls back to one full decode, only in that case. When DecodeStream
    gives up ("Invalid prefix encountered": a byte-fallback tokenizer's earlier text changed), a new stream
    goes on from the token, as vLLM's `_protected_step` does (the text then drops the bytes that were cut)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream
        self._new_stream = lambda: DecodeStream(skip_special_tokens=skip_special_tokens)
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._backend = tokenizer.backend_tokenizer
        self._stream = self._new_stream()
        self.token_ids: list[int] = []
        self.text = ""
        self._pending = False        # the last step returned None: bytes wait for the rest of a character

    def add(self, new_token_ids) -> str:
        pieces = []
        for t in new_token_ids:
            t = int(t)
            self.token_ids.append(t)
            try:
                piece = self._stream.step(self._backend, t)
            except Exception as e:                 # (tokenizers raises a plain Exception)
                if not str(e).startswith("Invalid prefix"):
                    raise
                self._stream = self._new_stream()
                piece = self._stream.step(self._backend, t)
            self._pending = piece is None
            if piece:
                pieces.append(piece)
        piece = "".join(pieces)
        self.text += piece
        return piece

    def flush(self) -> str:
        if not self._pending:
            return ""
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        piece = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += piece
        self._pending = False
        return piece


class ByteDetokenizer:
    """ByteTokenizer's decode (ids 0..255 are UTF-8 bytes, any other id is shown as `<id>`), incrementally:
    the window decoder's Python decode per token was ~9% of the API process streaming a preset (py-spy)."""

    def __init__(self, tokenizer=None, skip_special_tokens: bool = True):
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.token_ids: list[int] = []
        self.text = ""

    def add(self, new_token_ids) -> str:
        parts = []
        for t in new_token_ids:
            t = int(t)
            self.token_ids.append(t)
            if 0 <= t < 256:
                parts.append(self._utf8.decode(bytes((t,))))
            else:                               # ends a byte run: its unfinished character shows as U+FFFD
                parts.append(self.flush_bytes())
                parts.append(f"<{t}>")
        piece = "".join(parts)
        self.text += piece
        return piece

    def flush_bytes(self) -> str:
        piece = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return piece

    def flush(self) -> str:
        piece = self.flush_bytes()
        self.text += piece
        return piece


def has_fast_decoder(tokenizer) -> bool:
    """Whether `tokenizer` can use `FastDetokenizer`: an HF fast tokenizer whose `decode` adds no
    post-processing that DecodeStream lacks (clean_up_tokenization_spaces)."""
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream  # noqa: F401  (tokenizers >= 0.21)
    except ImportError:
        return False
    return (isinstance(getattr(tokenizer, "backend_tokenizer", None), Tokenizer)
            and not getattr(tokenizer, "clean_up_tokenization_spaces", False))


def make_detokenizer(tokenizer, skip_special_tokens: bool = True):
    """The fast decoder where the tokenizer has one, the byte decoder for the presets' stand-in, else the
    window decoder."""
    from jaxinfer.tokenizer import ByteTokenizer
    if type(tokenizer) is ByteTokenizer:
        return ByteDetokenizer(tokenizer, skip_special_tokens)
    cls = FastDetokenizer if has_fast_decoder(tokenizer) else WindowDetokenizer
    return cls(tokenizer, skip_special_tokens)
