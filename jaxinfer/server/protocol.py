"""OpenAI request bodies -> (prompt token ids, SamplingParams); OpenAI-shaped responses and errors.

Bodies are plain dicts parsed by hand (not pydantic models) so that every problem becomes an OpenAI-style
400 error naming the bad field, rather than FastAPI's 422.
"""
from __future__ import annotations

import json
import time
import uuid

from jaxinfer.sampling_params import SamplingParams


class RequestError(ValueError):
    """An invalid request (400) or one the server cannot serve now (5xx): an {"error": {...}} response."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status

    @property
    def type(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"


def error_body(message: str, param: str | None = None, code: str | None = None,
               type_: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# Sampling fields we take from the body: OpenAI's, plus vLLM's extensions (top_k, min_p, ignore_eos, ...).
_PASSTHROUGH = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos")
_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}


def sampling_params(body: dict, prompt_len: int, max_model_len: int, default_max_tokens: int | None) -> SamplingParams:
    """SamplingParams for one prompt of `prompt_len` tokens; default_max_tokens None = the rest of the context."""
    for name, ok in (("n", (None, 1)), ("best_of", (None, 1)), ("echo", (None, False)),
                     ("presence_penalty", (None, 0, 0.0)), ("frequency_penalty", (None, 0, 0.0)),
                     ("logprobs", (None, False)), ("top_logprobs", (None, 0)), ("logit_bias", (None, {}))):
        if body.get(name) not in ok:
            raise RequestError(f"{name}={body[name]!r} is not supported by this server", param=name)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    room = max_model_len - prompt_len
    if max_tokens is None:
        max_tokens = default_max_tokens if default_max_tokens is not None else room
        max_tokens = max(1, min(max_tokens, room))
    elif isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and prompt_len + max_tokens > max_model_len:
        raise RequestError(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                           f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the "
                           f"completion). Please reduce the prompt or {key}.", param=key,
                           code="context_length_exceeded")
    kw = {k: body[k] for k in _PASSTHROUGH if body.get(k) is not None}
    for k in ("stop", "stop_token_ids"):
        if k in kw and not (isinstance(kw[k], list) or (k == "stop" and isinstance(kw[k], str))):
            raise RequestError(f"{k}={kw[k]!r} must be a list" + (" or a string" if k == "stop" else ""), param=k)
    for k, v in _DEFAULTS.items():
        kw.setdefault(k, v)
    if kw.get("top_k") == -1:
        kw["top_k"] = 0
    try:
        return SamplingParams(max_tokens=max_tokens, **kw)
    except (ValueError, TypeError) as e:
        raise RequestError(str(e).replace("SamplingParams.", ""), param=str(e).split("=")[0].split(".")[-1]) from None


def check_request(ids: list[int], params: SamplingParams, limits: dict) -> None:
    """The engine's own request check (LLMEngine.check_request), against the limits the core reported, so
    that a bad prompt is a 400 before any streaming starts. The core checks again, authoritatively."""
    V, mml, bs, nb = limits["vocab_size"], limits["max_model_len"], limits["block_size"], limits["num_blocks"]
    bad = [t for t in ids if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < V)]
    if bad:
        raise RequestError(f"the prompt has token id {bad[0]!r} outside the vocabulary [0, {V})", param="prompt")
    need = -(-min(len(ids) + params.max_tokens, mml) // bs)
    if need > nb:
        raise RequestError(f"the request needs {need} KV blocks for {len(ids)} prompt + {params.max_tokens} output "
                           f"tokens but the pool has only {nb}", param="prompt")


def completion_prompts(body: dict) -> list[str | list[int]]:
    """`prompt` as a list of prompts: a string, a list of token ids, or a list of either."""
    p = body.get("prompt")
    if isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) for t in p)):
        return [p]
    if isinstance(p, list) and p and all(isinstance(x, str) or (isinstance(x, list) and x and all(
            isinstance(t, int) for t in x)) for x in p):
        return list(p)
    raise RequestError(f"prompt must be a non-empty string, a list of token ids, or a list of those; got {p!r:.100}",
                       param="prompt")


def chat_messages(body: dict) -> list[dict]:
    """`messages` as [{"role": str, "content": str}]; text content parts are joined, other parts rejected."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError(f"messages must be a non-empty list, got {msgs!r:.100}", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string 'role', got {m!r:.100}", param="messages")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                       for c in content):
                raise RequestError(f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(c["text"] for c in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string or text parts, got {content!r:.100}",
                               param="messages")
        out.append({"role": m["role"], "content": content})
    kw = body.get("chat_template_kwargs")
    if kw is not None and not isinstance(kw, dict):
        raise RequestError(f"chat_template_kwargs must be an object, got {kw!r:.100}", param="chat_template_kwargs")
    return out


def apply_chat_template(tokenizer, messages: list[dict], kwargs: dict | None) -> str:
    """The conversation as a prompt string ending with the assistant's turn (as `LLM.apply_chat_template`)."""
    if getattr(tokenizer, "chat_template", None) is None and hasattr(tokenizer, "vocab_size"):
        raise RequestError("this model's tokenizer has no chat template; use /v1/completions", param="messages")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **(kwargs or {}))
    except Exception as e:            # template errors (jinja) as well as our ValueErrors
        raise RequestError(f"cannot apply the chat template: {e}", param="messages") from None


def stream_flags(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage) from `stream` and `stream_options`."""
    stream, opts = body.get("stream", False), body.get("stream_options")
    if stream not in (True, False, None):
        raise RequestError(f"stream must be a boolean, got {stream!r}", param="stream")
    if opts is not None and not isinstance(opts, dict):
        raise RequestError(f"stream_options must be an object, got {opts!r}", param="stream_options")
    return bool(stream), bool((opts or {}).get("include_usage"))


# -- responses ----------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(rid: str, model: str, texts: list[str], reasons: list[str], use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "text": t, "logprobs": None, "finish_reason": r}
                        for i, (t, r) in enumerate(zip(texts, reasons))], "usage": use}


def completion_chunk(rid: str, model: str, index: int, text: str, reason: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": reason}]}


def chat_completion(rid: str, model: str, text: str, reason: str, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": reason}], "usage": use}


def chat_chunk(rid: str, model: str, delta: dict, reason: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}


def usage_chunk(rid: str, model: str, object_: str, use: dict) -> dict:
    return {"id": rid, "object": object_, "created": int(time.time()), "model": model, "choices": [], "usage": use}


# -- server-sent events -------------------------------------------------------------------------------------
def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class ChunkEncoder:
    """The SSE events of one streamed response, as text: equal (as JSON) to `sse(completion_chunk(...))` and
    `sse(chat_chunk(rid, model, {"content": text}, None))`. What every event shares is rendered once and only
    the text is encoded per event: json.dumps of each whole chunk dict took ~8% of the API process's time
    at 64 streams (py-spy, CPU)."""

    def __init__(self, rid: str, model: str, object_: str):
        self.created = int(time.time())
        self._head = (f'data: {{"id": {json.dumps(rid)}, "object": "{object_}", "created": {self.created}, '
                      f'"model": {json.dumps(model, ensure_ascii=False)}, "choices": [{{"index": ')

    def completion(self, index: int, text: str, reason: str | None) -> str:
        return (f'{self._head}{index}, "text": {json.dumps(text, ensure_ascii=False)}, "logprobs": null, '
                f'"finish_reason": {json.dumps(reason)}}}]}}\n\n')

    def chat_content(self, text: str) -> str:
        return (f'{self._head}0, "delta": {{"content": {json.dumps(text, ensure_ascii=False)}}}, "logprobs": null, '
                f'"finish_reason": null}}]}}\n\n')
