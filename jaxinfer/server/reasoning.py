"""vLLM's reasoning parsers for Qwen3 (`--reasoning-parser qwen3`, or `deepseek_r1`): a chat answer's thinking,
between `<think>` and `</think>`, goes to the message's `reasoning` field (vLLM's name since 2026; it was
`reasoning_content`) and the rest to `content`.

As vLLM's Qwen3ReasoningParser: a `<think>` the model opens its answer with is dropped (a template may also put
it in the prompt); the text before `</think>` is reasoning, after it content; with no `</think>` the whole output is
reasoning (cut off while thinking), unless the prompt already closed the thinking (Qwen3's template with
`enable_thinking: false` ends the prompt with an empty `<think></think>`) or, for qwen3, the request turned it
off: then it is all content. The split works on the text, holding back the end of a delta that may be the start
of a tag, so it is the same streamed or not, whether the tags are single tokens (Qwen3's) or not.
"""
from __future__ import annotations

PARSERS = ("qwen3", "deepseek_r1")
START, END = "<think>", "</think>"


def thinking_closed(parser: str | None, prompt: str, kwargs: dict) -> bool | None:
    """None without a parser; else whether the answer starts as content (the prompt closed its thinking, or
    qwen3's enable_thinking is false)."""
    if parser is None:
        return None
    closed = prompt.rfind(END) > prompt.rfind(START) >= 0
    return closed or (parser == "qwen3" and kwargs.get("enable_thinking", True) is False)


def _held(text: str, tags: tuple[str, ...]) -> int:
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
            if not self.started:                  # a <think> that opens the answer is dropped
                if START.startswith(self.buf) and not last:
                    return reasoning, ""
                self.buf, self.started = self.buf[len(START):] if self.buf.startswith(START) else self.buf, True
            if (j := self.buf.find(END)) >= 0:
                reasoning += self.buf[:j]
                self.buf, self.in_content = self.buf[j + len(END):], True
                break
            keep = 0 if last else _held(self.buf, (END,))
            reasoning += self.buf[:len(self.buf) - keep]
            self.buf = self.buf[len(self.buf) - keep:]
            return reasoning, ""
        content, self.buf = self.buf, ""
        return reasoning, content


def split(text: str, closed: bool) -> tuple[str | None, str | None]:
    """A whole answer's (reasoning, content), None for an empty one (vLLM's)."""
    reasoning, content = Splitter(closed).feed(text, last=True)
    return reasoning or None, content or None
