"""vLLM's reasoning parsers for Qwen3 (`--reasoning-parser qwen3`, or `deepseek_r1`): a chat answer's thinking,
between `<think>` and `</think>`, goes to the message's `reasoning` field (vLLM's name since 2026; also sent
as `reasoning_content`, the older one) and the rest to `content`.

As vLLM's Qwen3ReasoningParser: the first `<think>` (before any `</think>`) is dropped (a template may also put it
in the prompt); the text before `</think>` is reasoning, after it content; with no `</think>` the whole output is
reasoning (cut off while thinking), unless the prompt closed the thinking of the turn it ends in (Qwen3's template
with `enable_thinking: false` ends with an empty `<think></think>`; an assistant answer continued after its closed
thinking) or the request turned thinking off
(`enable_thinking: false`, `reasoning_effort: "none"`): then it is all content. (Text before that `<think>` stays
reasoning, as vLLM streams it; vLLM's unstreamed answer drops it.) The split works on the text, holding back the
end of a delta that may be the start of a tag, so it is the same streamed or not, whether the tags are single
tokens (Qwen3's) or not.
"""
from __future__ import annotations

import weakref

from jaxinfer.structured import REASONING_PARSERS, TURN_OPENERS, reasoning_marks

PARSERS = REASONING_PARSERS
_END_IDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()    # tokenizer -> {parser: id or None}
START, END = "<think>", "</think>"


def thinking_closed(parser: str | None, prompt: str, kwargs: dict) -> bool | None:
    """None without a parser; else whether the answer starts as content: the prompt closed the thinking of the turn
    it ends in, a `</think>` after its last `<think>` and the last turn's start (Qwen3's template with
    enable_thinking false: `<think>\n\n</think>\n\n`; an answer continued after its closed thinking counts; an
    earlier turn's thinking, or a user quoting the tags, does not), or enable_thinking is false (also
    reasoning_effort "none"), as vLLM's serving turns thinking off for every parser. Otherwise a request's
    structured outputs apply after the thinking (from the token after `</think>`), as vLLM's."""
    if parser is None:
        return None
    closed = prompt.rfind(END) > max(prompt.rfind(t) for t in TURN_OPENERS)
    return closed or kwargs.get("enable_thinking", True) is False


def after_thinking(items: list[tuple], parser: str, tokenizer) -> None:
    """Mark the structured outputs of a chat request's (ids, SamplingParams) items to apply after `</think>`: the
    engine core's add_request gets `reasoning_end` (client.py reads the mark)."""
    end = end_id(parser, tokenizer)
    for _, sp in items:
        if sp.structured_outputs is not None:
            object.__setattr__(sp, "_reasoning_end", end)     # (not a field: SamplingParams refuses unknown ones)


def end_id(parser: str, tokenizer) -> int | None:
    """The id of `</think>` (structured.reasoning_marks, once per tokenizer), None where the vocabulary lacks it
    (then structured outputs apply from the first token)."""
    got = _END_IDS.get(tokenizer, {})
    if parser not in got:
        try:
            got[parser] = reasoning_marks(parser, tokenizer)[0]
        except ValueError:
            got[parser] = None
        _END_IDS[tokenizer] = got
    return got[parser]


def held(text: str, tags: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could be the start of one of `tags`."""
    return max((n for tag in tags for n in range(1, len(tag)) if text.endswith(tag[:n])), default=0)


class Splitter:
    """One choice's text, delta by delta, as (reasoning, content) pieces."""

    def __init__(self, closed: bool):
        self.in_content, self.started, self.buf = closed, False, ""

    def feed(self, text: str, last: bool = False) -> tuple[str, str]:
        self.buf += text
        reasoning = ""
        while not self.in_content:
            if not self.started:                  # the first <think> (before any </think>) is dropped
                i, j = self.buf.find(START), self.buf.find(END)
                if i >= 0 and not 0 <= j < i:
                    reasoning, self.buf = reasoning + self.buf[:i], self.buf[i + len(START):]
                self.started = i >= 0 or j >= 0
            if (j := self.buf.find(END)) >= 0:
                reasoning += self.buf[:j]
                self.buf, self.in_content = self.buf[j + len(END):], True
                break
            keep = 0 if last else held(self.buf, (END,) if self.started else (END, START))
            reasoning += self.buf[:len(self.buf) - keep]
            self.buf = self.buf[len(self.buf) - keep:]
            return reasoning, ""
        content, self.buf = self.buf, ""
        return reasoning, content


def split(text: str, closed: bool) -> tuple[str | None, str | None]:
    """A whole answer's (reasoning, content), None for an empty one (vLLM's)."""
    reasoning, content = Splitter(closed).feed(text, last=True)
    return reasoning or None, content or None
