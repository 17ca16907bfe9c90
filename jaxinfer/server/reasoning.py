"""vLLM's reasoning parsers for Qwen3 (`--reasoning-parser qwen3`, or `deepseek_r1`): a chat answer's thinking,
between `<think>` and `</think>`, goes to the message's `reasoning` field (vLLM's name since 2026; it was
`reasoning_content`) and the rest to `content`.

As vLLM's Qwen3ReasoningParser: the first `<think>` (before any `</think>`) is dropped (a template may also put it
in the prompt); the text before `</think>` is reasoning, after it content; with no `</think>` the whole output is
reasoning (cut off while thinking), unless the prompt ends by closing the thinking (Qwen3's template with
`enable_thinking: false` ends it with an empty `<think></think>`) or the request turned thinking off
(`enable_thinking: false`, `reasoning_effort: "none"`): then it is all content. (Text before that `<think>` stays
reasoning, as vLLM streams it; vLLM's unstreamed answer drops it.) The split works on the text, holding back the
end of a delta that may be the start of a tag, so it is the same streamed or not, whether the tags are single
tokens (Qwen3's) or not.
"""
from __future__ import annotations

PARSERS = ("qwen3", "deepseek_r1")
START, END = "<think>", "</think>"


def thinking_closed(parser: str | None, prompt: str, kwargs: dict, constrained: bool = False) -> bool | None:
    """None without a parser; else whether the answer starts as content: the prompt ends by closing the thinking
    (Qwen3's template with enable_thinking false: `<think>\n\n</think>\n\n`; a closed block earlier, e.g. an
    earlier turn's thinking or a user quoting the tags, does not count), or enable_thinking is false (also
    reasoning_effort "none"), as vLLM's serving turns thinking off for every parser; or `constrained`: structured
    outputs apply from the answer's first token here (vLLM's wait for the end of the reasoning), so none is."""
    if parser is None:
        return None
    return prompt.rstrip().endswith(END) or kwargs.get("enable_thinking", True) is False or constrained


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
