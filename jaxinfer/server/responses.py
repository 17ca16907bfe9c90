"""OpenAI-shaped responses: pydantic models (the OpenAPI schema of /docs), the dicts the handlers return
(built directly: validating every response through pydantic would cost time per streamed event), logprobs in
OpenAI's two shapes, and the server-sent events of a stream.

Logprobs arrive per token as the engine's rows (jaxinfer/outputs.py: [logprob, rank, top ids x W, top logprobs
x W], best first; the same numbers as vLLM's `{token_id: Logprob}`), formatted straight from them (building
Logprob objects per token cost ~2x the API process's time per streamed token):
- completions (legacy shape): {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"};
  with echo the prompt's tokens come first, the very first one with null logprobs (nothing precedes it);
- chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel

from jaxinfer.detokenizer import FIXUP_TOKENS
from jaxinfer.output_processor import TokenTexts     # each token id decoded once (vLLM's decoded_token)
from jaxinfer.server.errors import RequestError



class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    prompt_token_ids: list[int] | None = None          # with return_token_ids (vLLM's)
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    """Also each streamed chunk (choices hold one choice's new text; a last chunk may carry only usage)."""
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[dict[str, Any]] = []


class ChatChoice(BaseModel):
    index: int
    message: dict[str, Any]
    logprobs: dict[str, list[ChatLogprob] | None] | None = None
    finish_reason: str | None
    token_ids: list[int] | None = None                 # with return_token_ids (vLLM's)


class ChatCompletionResponse(BaseModel):
    """Streamed chunks ("chat.completion.chunk") carry `delta` instead of `message`."""
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None


# -- builders -----------------------------------------------------------------------------------------------
def new_id(prefix: str, request=None, req=None) -> str:
    """An answer's id as vLLM's: `prefix`-, then the X-Request-Id header of `request` if it has one, else the
    body's `request_id` (vLLM's field), else a new uuid."""
    given = request.headers.get("X-Request-Id") if request is not None else None
    rid = f"{prefix}-{given if given is not None else getattr(req, 'request_id', None) or uuid.uuid4().hex}"
    if rid.encode("utf-8", "replace").decode("utf-8") != rid:       # (a lone surrogate: no JSON answer could carry it)
        raise RequestError(f"request_id {rid[len(prefix) + 1:]!r:.80} is not valid UTF-8", param="request_id")
    return rid


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(rid: str, model: str, choices: list[dict], use: dict) -> dict:
    """choices: [{"index", "text", "logprobs", "finish_reason", "stop_reason"}]"""
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": use}


def completion_chunk(rid: str, model: str, index: int, text: str, reason: str | None, logprobs=None,
                     stop_reason=None) -> dict:
    """A streamed completion chunk: `usage` null unless given (vLLM's completion chunks always carry it)."""
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason,
                         "stop_reason": stop_reason}], "usage": None}


def chat_completion(rid: str, model: str, choices: list[dict], use: dict, prompt_ids: list[int] | None = None,
                    **extra) -> dict:
    """choices: [{"index", "message": {"role", "content"}, "logprobs", "finish_reason", "stop_reason"}];
    `prompt_ids`: the prompt's token ids, given with vLLM's return_token_ids; `extra`: vLLM's prompt_logprobs."""
    out = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
           "choices": choices, "usage": use, **extra}
    return out if prompt_ids is None else {**out, "prompt_token_ids": prompt_ids}


def chat_chunk(rid: str, model: str, delta: dict, reason: str | None, index: int = 0, logprobs=None,
               stop_reason=None, created: int | None = None, use: dict | None = None, ids: dict | None = None) -> dict:
    """`created`: the stream's (every chunk of a stream has the same); `use`: this chunk's usage, if any; `ids`:
    the choice's token ids of this chunk (return_token_ids: {"token_ids": [...]})."""
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": created or int(time.time()), "model": model,
             "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason,
                          "stop_reason": stop_reason, **(ids or {})}]}
    return chunk if use is None else {**chunk, "usage": use}


def usage_chunk(rid: str, model: str, object_: str, use: dict, created: int | None = None) -> dict:
    return {"id": rid, "object": object_, "created": created or int(time.time()), "model": model, "choices": [],
            "usage": use}


# -- logprobs -----------------------------------------------------------------------------------------------
def as_token_id(tid: int, context=()) -> str:
    """vLLM's return_tokens_as_token_ids: a logprob's token named by its id ("token_id:N"), not its text."""
    return f"token_id:{tid}"


def token_texts(text_of: TokenTexts, req):
    """How the request's logprobs name tokens: their texts, or with return_tokens_as_token_ids their ids."""
    return as_token_id if getattr(req, "return_tokens_as_token_ids", None) else text_of


def _top(row: list, k: int) -> list[tuple[int, float]]:
    """The k most likely (token id, logprob) of one position, best first, from its engine row (-inf, a token masked
    by structured outputs, as vLLM's -9999.0: JSON has no infinity)."""
    w = (len(row) - 2) // 2
    return [(int(row[2 + r]), max(row[2 + w + r], -9999.0)) for r in range(min(k, w))]


def _in_context(ids: list[int], rows: list, before) -> Iterator[tuple[int, list, list[int]]]:
    """(token id, its row, the ids before it: up to FIXUP_TOKENS, from `before` first) of each token."""
    context = list(before)[-FIXUP_TOKENS:]
    for tid, row in zip(ids, rows):
        yield tid, row, context
        context = (context + [tid])[-FIXUP_TOKENS:]


def completion_logprobs(text_of: TokenTexts, ids: list[int], rows: list, k: int, offset: int = 0,
                        before: list[int] = ()) -> dict:
    """The legacy shape for tokens `ids` and their engine rows (a None row: no logprob, e.g. the first prompt
    token). `offset`: the character offset of the first token (the text already sent, when streaming).
    top_logprobs holds the k most likely tokens and the sampled one (as vLLM). `before`: the ids before the
    first (a character split across tokens is the text of the token that completes it: TokenTexts)."""
    tokens, lps, tops, offs = [], [], [], []
    for tid, row, context in _in_context(ids, rows, before):
        s = text_of(tid, context)
        tokens.append(s)
        offs.append(offset)
        offset += len(s)
        if row is None:
            lps.append(None)
            tops.append(None)
            continue
        lps.append(max(row[0], -9999.0))
        top = {s: lps[-1]}          # the token itself first, then the k most likely (vLLM's order)
        for t, lp in _top(row, k):  # ids with the same text (e.g. "" for byte pieces) share a key: the best one's
            if lp > top.get(key := text_of(t, context), -float("inf")):     # (the token itself may be the worse)
                top[key] = lp
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}


def prompt_logprobs(text_of: TokenTexts, ids: list[int], rows: list | None, k: int) -> list:
    """vLLM's prompt_logprobs: per prompt token None (the first: nothing precedes it) or {token id: {"logprob",
    "rank", "decoded_token"}}, the token itself first, then the k most likely (-inf as vLLM's -9999.0)."""
    def entry(lp, rank, tid, context):
        return {"logprob": max(lp, -9999.0), "rank": rank, "decoded_token": text_of(tid, context)}
    out = []
    for tid, row, context in _in_context(ids, rows or [None] * len(ids), ()):
        if row is None:
            out.append(None)
            continue
        d = {str(tid): entry(row[0], int(row[1]), tid, context)}
        for rank, (t, lp) in enumerate(_top(row, k), 1):
            d.setdefault(str(t), entry(lp, rank, t, context))
        out.append(d)
    return out


def chat_logprobs(text_of: TokenTexts, ids: list[int], rows: list, k: int, before: list[int] = (),
                  as_ids: bool = False) -> dict:
    """`as_ids` (return_tokens_as_token_ids): tokens named "token_id:N"; as vLLM's, a sampled token's `bytes` stay
    its text's, its alternatives' are their names'."""
    def one(tid, lp, context, sampled=False):
        s = text_of(tid, context)
        name = as_token_id(tid) if as_ids else s
        return {"token": name, "logprob": lp, "bytes": list((s if sampled else name).encode("utf-8"))}
    return {"content": [{**one(tid, max(row[0], -9999.0), c, True), "top_logprobs": [one(t, lp, c)
                                                                                      for t, lp in _top(row, k)]}
                        for tid, row, c in _in_context(ids, rows, before)]}


# -- server-sent events -------------------------------------------------------------------------------------
def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class ChunkEncoder:
    """The SSE events of one streamed response, as text: equal (as JSON) to `sse(completion_chunk(...))` and
    `sse(chat_chunk(rid, model, {"content": text}, None, index))`. What every event shares is rendered once
    and only the text is encoded per event: json.dumps of each whole chunk dict took ~8% of the API
    process's time at 64 streams (py-spy, CPU). Completion events with logprobs: `completion_lp`."""

    def __init__(self, rid: str, model: str, object_: str):
        self.created = int(time.time())
        self._head = (f'data: {{"id": {json.dumps(rid)}, "object": "{object_}", "created": {self.created}, '
                      f'"model": {json.dumps(model, ensure_ascii=False)}, "choices": [{{"index": ')

    def completion(self, index: int, text: str, reason: str | None, stop_reason=None, use: dict | None = None,
                   ids: dict | None = None) -> str:
        return (f'{self._head}{index}, "text": {json.dumps(text, ensure_ascii=False)}, "logprobs": null, '
                f'"finish_reason": {json.dumps(reason)}, "stop_reason": {json.dumps(stop_reason)}{_end(use, ids, True)}')

    def completion_lp(self, index: int, text: str, reason: str | None, logprobs: dict, stop_reason=None,
                      use: dict | None = None, ids: dict | None = None) -> str:
        return (f'{self._head}{index}, "text": {json.dumps(text, ensure_ascii=False)}, "logprobs": '
                f'{json.dumps(logprobs, ensure_ascii=False)}, "finish_reason": {json.dumps(reason)}, '
                f'"stop_reason": {json.dumps(stop_reason)}{_end(use, ids, True)}')

    def chat_content(self, text: str, index: int = 0, use: dict | None = None, ids: dict | None = None) -> str:
        return (f'{self._head}{index}, "delta": {{"content": {json.dumps(text, ensure_ascii=False)}}}, '
                f'"logprobs": null, "finish_reason": null, "stop_reason": null{_end(use, ids)}')


def _end(use: dict | None, ids: dict | None = None, null_usage: bool = False) -> str:
    """The end of an encoded chunk: the choice's token ids if given (return_token_ids), the choice, the choices
    list and the chunk closed, with `usage` if given (null if not given and null_usage: completion chunks)."""
    more = "".join(f', "{k}": {json.dumps(v)}' for k, v in ids.items()) if ids else ""
    if use is None and not null_usage:
        return f"{more}}}]}}\n\n"
    return f'{more}}}], "usage": {json.dumps(use)}}}\n\n'
