"""vLLM's tool calling for Qwen3 on /v1/chat/completions: `--enable-auto-tool-choice --tool-call-parser hermes`.

A request's `tools` (OpenAI's function schemas) reach the chat template, which tells the model how to call them;
Qwen3 (like Hermes 2 Pro) answers a call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block
per call. With `tool_choice` "auto" (the default when tools are given) the answer is parsed as vLLM's hermes
parser does:
- no `<tool_call>`: the text is the message's `content`;
- else every block is parsed as JSON (a last block left open counts too): `tool_calls` [{id, type: "function",
  function: {name, arguments: the arguments as a JSON string}}], `content` the text before the first block (null
  when empty), text after the last block dropped, and finish_reason "tool_calls" (when the answer ended on a stop;
  "length" stays "length"). If any block is not a JSON object with `name` and `arguments`, there are no calls and
  the whole text is the content (nothing is lost);
- `parallel_tool_calls: false` keeps the first call only;
- with a reasoning parser, only the content (after `</think>`) is parsed.
Streamed, the text before the first `<tool_call>` is sent as it comes (the start of a tag held back), and from that
tag on the text is held until the answer ends and then parsed whole, so that a streamed answer's calls are the
unstreamed one's: they come as one delta `{"tool_calls": [{index, id, type, function: {name, arguments}}]}` with
the finish reason (vLLM streams the arguments in pieces; a client that joins the pieces gets the same).
While tool calls are parsed, special tokens stay in the text (vLLM's: a tokenizer may mark the tags special).

`tool_choice` "none": the tools still reach the template (not with `--exclude-tools-when-tool-choice-none`) and
the answer is not parsed. "required" and a named function constrain the answer with structured outputs, as vLLM's
(with or without the tool-call flags): a named function's answer is its arguments (its `parameters` schema), a
call to it; "required"'s is a JSON list of at least one `{"name": ..., "parameters": {...}}` of the tools (their
schemas' `$defs` merged; one with `parallel_tool_calls` false; keywords outlines-core cannot enforce, such as
`minimum`, left out), each a call. Either way `content` is ""; the finish
reason is vLLM's: "tool_calls" for "required" (when it stopped), "stop" for a named function. A named function's
answer cut short (finish "length") is still its call, with the arguments as far as they came (vLLM's); a "required"
answer that does not parse is the content instead, where vLLM drops it (streamed: the whole answer comes in the last
delta).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from jaxinfer import grammar
from jaxinfer.server import formats
from jaxinfer.server.errors import RequestError
from jaxinfer.server.reasoning import held

START, END = "<tool_call>", "</tool_call>"
_BLOCKS = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):           # OpenAI's function schema, as the chat template gets it
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class _Name(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: _Name


@dataclass(frozen=True)
class ToolUse:
    tools: list[dict] | None          # what the template gets
    parse: bool                       # the answer is parsed for calls (tool_choice "auto", "required" or named)
    first_only: bool = False          # parallel_tool_calls false
    forced: str | None = None         # "required", or the named function's name: the answer is constrained

    def extract(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of an answer's text."""
        if self.forced is None:
            return extract(text, self.first_only)
        if self.forced != "required":     # vLLM's: the answer is the arguments, even cut short (finish "length")
            return "", [_call({"name": self.forced, "arguments": text}, raw=True)]
        try:
            calls = [_call({"name": c["name"], "arguments": c["parameters"]}) for c in json.loads(text)]
            return ("", calls[:1] if self.first_only else calls) if calls else (text, [])
        except (ValueError, KeyError, TypeError, IndexError, RecursionError):
            return text, []

    def finish_reason(self, reason: str | None, calls: list) -> str | None:
        """vLLM's: "tool_calls" after a stop with calls, but for a named function ("stop")."""
        return reason if self.forced not in (None, "required") else finish_reason(reason, calls)


def resolve(req, options) -> ToolUse:
    """A chat request's tools and tool_choice, checked as vLLM checks them (400s naming the field); while calls are
    parsed the request keeps special tokens in its text (its skip_special_tokens set false, vLLM's)."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise RequestError(f'Invalid value for `tool_choice`: {choice!r:.80}! Only named tools, "none", "auto" or '
                           f'"required" are supported.', param="tool_choice")
    if choice == "required" and req.tools == []:        # vLLM's (OpenAI's): as "none"
        choice = "none"
    if choice != "none" and req.tools is None:          # ([] with "auto": no calls to make, vLLM's)
        raise RequestError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if not isinstance(choice, str):
        names = [t["function"]["name"] for t in tools]
        if choice.function.name not in names:
            raise RequestError(f"The tool specified in `tool_choice` ({choice.function.name!r:.80}) does not match "
                               f"any of the specified `tools` ({', '.join(names)[:200]})", param="tool_choice")
    on = bool(options.enable_auto_tool_choice and options.tool_call_parser)
    param = "tool_choice" if on else "tools"      # (a server that parses no calls: the tools are what it refuses)
    if choice == "auto" and not on:
        raise RequestError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set; '
                           'without them this server parses no tool calls, and tools may only be given with '
                           'tool_choice "none" (for the chat template)', param=param)
    shown = None if choice == "none" and options.exclude_tools_when_tool_choice_none else tools
    if choice == "auto":
        req.skip_special_tokens = False
    forced = None if choice in ("auto", "none") else "required" if choice == "required" else choice.function.name
    if forced is not None:
        if formats.structured(req)[2] is not None:
            raise RequestError(f"tool_choice={choice if forced == 'required' else 'a named function'} constrains the "
                               f"answer itself: it cannot be given with {formats.structured(req)[2]}",
                               param="tool_choice")
        req.structured_outputs = {"json": _schema(tools, forced, req.parallel_tool_calls is False)}
        req._structured_from = "tools"            # (what a 400 about that schema names: formats.structured)
    return ToolUse(shown, choice != "none", choice != "none" and req.parallel_tool_calls is False, forced)


def _schema(tools: list[dict], forced: str, one: bool) -> dict:
    """The JSON schema of a forced call's answer (vLLM's): the named function's parameters, or for "required" a
    list of at least one {name, parameters} of the tools, their `$defs` at the top (one: at most one item, for
    parallel_tool_calls false). Keywords outlines-core cannot enforce (grammar.UNENFORCED: minimum, ...) are left
    out: the arguments may break them."""
    empty = {"type": "object", "properties": {}}
    fns = [{**t["function"], "parameters": grammar.relaxed(t["function"].get("parameters"))} for t in tools]
    if forced != "required":
        return next(f.get("parameters") or empty for f in fns if f["name"] == forced)
    defs, items = {}, []
    for f in fns:
        params = dict(f.get("parameters") or empty)
        for name, d in params.pop("$defs", {}).items():
            if defs.setdefault(name, d) != d:
                raise RequestError(f"tools define $defs {name!r:.80} twice, differently: tool_choice \"required\" "
                                   f"needs one", param="tools")
        items.append({"properties": {"name": {"type": "string", "enum": [f["name"]]}, "parameters": params},
                      "required": ["name", "parameters"]})
    return {"type": "array", "minItems": 1, **({"maxItems": 1} if one else {}),
            "items": {"type": "object", "anyOf": items}, **({"$defs": defs} if defs else {})}


def _call(obj, raw: bool = False) -> dict:
    """A tool call of {name, arguments} (raw: arguments already JSON text)."""
    name, arguments = obj["name"], obj["arguments"]       # (not a dict, or a key missing: TypeError, KeyError)
    if not isinstance(name, str):
        raise TypeError("a tool call's name must be a string")
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments if raw else json.dumps(arguments, ensure_ascii=False)}}


def extract(text: str, first_only: bool = False) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of an answer's text (the module's rules)."""
    i = text.find(START)
    if i < 0:
        return text, []
    try:
        calls = [_call(json.loads(a or b)) for a, b in _BLOCKS.findall(text)]
    except (ValueError, KeyError, TypeError, IndexError, RecursionError):      # (JSON nested ~1,000 deep)
        return text, []
    return text[:i] or None, calls[:1] if first_only else calls


def finish_reason(reason: str | None, calls: list) -> str | None:
    return "tool_calls" if calls and reason in ("stop", "length") else reason     # (vLLM's: whenever calls came)


class Stream:
    """One streamed choice's content, delta by delta: (content to send, tool calls) per delta."""

    def __init__(self, use: ToolUse):
        self.buf, self.calling, self.use = "", use.forced is not None, use     # (forced: all held to the end)

    def feed(self, text: str, last: bool = False) -> tuple[str, list[dict]]:
        self.buf += text
        out = ""
        if not self.calling:
            i = self.buf.find(START)
            if i < 0:
                keep = 0 if last else held(self.buf, (START,))
                out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return out, []
            out, self.buf, self.calling = self.buf[:i], self.buf[i:], True
        if not last:
            return out, []
        content, calls = self.use.extract(self.buf) if self.buf else (None, [])    # (nothing after the thinking: no
        return out + (content or ""), calls                                        # forced call, as the plain answer)
