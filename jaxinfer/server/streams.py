"""Finished choices -> OpenAI choice dicts, and running choices -> server-sent events (streaming).

Completions: with `echo`, a choice's text starts with its prompt (decoded), and with `logprobs` its logprobs
start with the prompt's tokens (the first with null: nothing precedes it). Streaming sends the echo in each
choice's first chunk. Chat: logprobs per generated token, `top_logprobs` of them.

vLLM's `return_token_ids`: each choice (each chunk: its new ones) carries `token_ids`, the generated ids, and
a completion choice (its first chunk) `prompt_token_ids`; a chat response (each stream's role chunk) carries
`prompt_token_ids` at its top. As vLLM's, an echo then leaves the prompt's text out (its ids are there).
"""
from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from jaxinfer.detokenizer import FIXUP_TOKENS
from jaxinfer.server import protocol as P
from jaxinfer.server import reasoning
from jaxinfer.server import responses as R
from jaxinfer.server import tools as T
from jaxinfer.server.choices import Choice


def echo_only(req) -> bool:
    """A completion with echo and max_tokens=0 (vLLM's prompt scoring, e.g. lm-evaluation-harness): its one
    generated token is dropped, so the choice is the prompt, its logprobs the prompt's, and 0 completion tokens;
    the finish reason is that token's, as vLLM's ("length", or "stop" when it is a stop id or EOS)."""
    return bool(getattr(req, "echo", False)) and getattr(req, "max_tokens", None) == 0


def total_usage(prompts: list[list[int]], done, req=None) -> dict:
    """Prompt tokens once per prompt (whatever n), completion tokens of every choice; with
    --enable-prompt-tokens-details (options.apply marks the request) and prefix-cache hits, vLLM's
    prompt_tokens_details.cached_tokens (per prompt: the most of its choices)."""
    use = R.usage(sum(len(p) for p in prompts), 0 if echo_only(req) else sum(len(ch.token_ids) for ch in done))
    if getattr(req, "_prompt_tokens_details", False):
        per_prompt: dict[int, int] = {}
        for ch in done:
            per_prompt[id(ch.prompt_ids)] = max(per_prompt.get(id(ch.prompt_ids), 0), ch.cached)
        if cached := sum(per_prompt.values()):
            use["prompt_tokens_details"] = {"cached_tokens": cached}
    return use


def _choice_usage(req, prompts, n: int):
    """use(ch) -> the usage so far of choice ch (its prompt and its tokens) for every chunk (vLLM's
    continuous_usage_stats), or None without it."""
    if not P.continuous_usage(req):
        return lambda ch: None
    only = echo_only(req)
    return lambda ch: R.usage(len(prompts[ch.index // n]), 0 if only else len(ch.token_ids))


def echo_texts(tokenizer, asked: list, prompts: list[list[int]], req) -> list[str] | None:
    """The echo of each prompt (with echo): a text prompt as sent (vLLM's; decoding its ids would hand back the
    tokenizer's normalisation, e.g. NFC), unless truncated; token ids decoded."""
    if not req.echo:
        return None
    keep = getattr(req, "truncate_prompt_tokens", None) is None
    return [p if isinstance(p, str) and keep else tokenizer.decode(ids) for p, ids in zip(asked, prompts)]


def token_ids(req, new_ids, prompt_ids: list[int] | None = None) -> dict | None:
    """With return_token_ids: {"token_ids": new_ids} and the prompt's ids if given (a choice's first chunk)."""
    if not getattr(req, "return_token_ids", None):
        return None
    return {**({} if prompt_ids is None else {"prompt_token_ids": prompt_ids}), "token_ids": list(new_ids)}


def _prompt_part(ch: Choice, prompt_ids: list[int], req, text_of, text: str, offset: int = 0):
    """(echoed text, its logprobs dict or None) of a completion choice."""
    text = "" if req.return_token_ids else text          # (vLLM's: the ids stand for the prompt)
    if req.logprobs is None:
        return text, None
    entries = ch.prompt_logprobs or [None] * len(prompt_ids)
    return text, R.completion_logprobs(text_of, prompt_ids, [None, *entries[1:]], req.logprobs, offset)


def _merge(a: dict | None, b: dict) -> dict:
    return b if a is None else {k: a[k] + b[k] for k in a}


def completion_choice(ch: Choice, prompt_ids: list[int], req, text_of, echoed: str | None) -> dict:
    text, lp, ids = ch.proc.text, None, token_ids(req, [] if echo_only(req) else ch.token_ids, prompt_ids)
    if req.echo:
        head, lp = _prompt_part(ch, prompt_ids, req, text_of, echoed)
        if echo_only(req):
            return {"index": ch.index, "text": head, "logprobs": lp, "finish_reason": ch.proc.finish_reason,
                    "stop_reason": ch.stop_reason, **(ids or {}), **prompt_logprobs(ch, prompt_ids, req, text_of)}
        text = head + text
    if req.logprobs is not None:
        offset = lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp and lp["tokens"] else 0
        lp = _merge(lp, R.completion_logprobs(text_of, ch.token_ids, ch.logprobs, req.logprobs, offset))
    return {"index": ch.index, "text": text, "logprobs": lp, "finish_reason": ch.proc.finish_reason,
            "stop_reason": ch.stop_reason, **(ids or {}), **prompt_logprobs(ch, prompt_ids, req, text_of)}


def prompt_logprobs(ch: Choice, prompt_ids: list[int], req, text_of) -> dict:
    """{"prompt_logprobs": [...]} when the request asks vLLM's prompt_logprobs (responses.prompt_logprobs)."""
    k = getattr(req, "prompt_logprobs", None)
    return {} if k is None else {"prompt_logprobs": R.prompt_logprobs(text_of, prompt_ids, ch.prompt_logprobs, k)}


def chat_choice(ch: Choice, k: int | None, text_of, role: str = "assistant", echo: str = "", req=None,
                think: bool | None = None, calls: T.ToolUse | None = None) -> dict:
    """A chat choice; `echo`: text that goes before the generated text (the request's echo, vLLM's); `think`
    (with a reasoning parser: whether the answer starts as content): the thinking goes to `reasoning`; `calls`
    (tools.resolve): the content's tool calls go to `tool_calls`."""
    hide = think is not None and not req.include_reasoning      # (vLLM's: no logprobs or ids to show it by)
    lp = None if k is None or hide else R.chat_logprobs(text_of, ch.token_ids, ch.logprobs, k,
                                                        as_ids=bool(req and req.return_tokens_as_token_ids))
    text, thought, found = ch.proc.text, None, []
    if think is not None:                        # (an empty part is null)
        thought, text = reasoning.split(text, think)
    if calls is not None and calls.parse and text:
        text, found = calls.extract(text)
    message = {"role": role, "content": echo + (text or "") if echo else text}
    if think is not None:
        message["reasoning"] = message["reasoning_content"] = thought if req.include_reasoning else None  # (older name)
    if found:
        message["tool_calls"] = found
    reason = calls.finish_reason(ch.proc.finish_reason, found) if calls else ch.proc.finish_reason
    return {"index": ch.index, "message": message, "logprobs": lp, "finish_reason": reason,
            "stop_reason": ch.stop_reason, **({} if hide else token_ids(req, ch.token_ids) or {})}


def _new_logprobs(ch: Choice) -> tuple[list[int], list, list[int]]:
    """The generated tokens whose logprobs were not streamed yet (and mark them sent), and the ids before them."""
    start, ch.sent = ch.sent, len(ch.logprobs)
    return ch.token_ids[start:ch.sent], ch.logprobs[start:ch.sent], ch.token_ids[max(0, start - FIXUP_TOKENS):start]


def completion_stream(run: AsyncIterator, rid: str, model: str, prompts, n: int, req, text_of, echoed: list | None):
    enc = R.ChunkEncoder(rid, model, "text_completion")
    k, use = req.logprobs, _choice_usage(req, prompts, n)

    async def events():
        done, offsets = {}, {}
        only = echo_only(req)
        async for ch, d in run:
            done[ch.index] = ch
            if only:                                     # the echo in its first chunk, then only the end
                first, fin = ch.index not in offsets, d.finish_reason
                offsets[ch.index] = 0
                if first or fin:
                    i = ch.index // n
                    text, lp = _prompt_part(ch, prompts[i], req, text_of, echoed[i]) if first else ("", None)
                    stop = ch.stop_reason if fin is not None else None     # (as the non-streamed choice says)
                    ids = token_ids(req, [], prompts[i] if first else None)
                    yield enc.completion(ch.index, text, fin, stop, use(ch), ids) if k is None else enc.completion_lp(
                        ch.index, text, fin, lp or R.completion_logprobs(text_of, [], [], k), stop, use(ch), ids)
                continue
            text, lp = d.text, None
            stop = ch.stop_reason if d.finish_reason is not None else None
            ids = token_ids(req, d.token_ids, None if ch.index in offsets else prompts[ch.index // n])
            if ch.index not in offsets:                  # this choice's first chunk
                offsets[ch.index] = 0
                if req.echo:
                    head, lp = _prompt_part(ch, prompts[ch.index // n], req, text_of, echoed[ch.index // n])
                    text = head + text
                    offsets[ch.index] = len(head) if lp is None else sum(len(t) for t in lp["tokens"])
            if k is not None:
                lp_ids, entries, before = _new_logprobs(ch)
                new = R.completion_logprobs(text_of, lp_ids, entries, k, offsets[ch.index], before)
                offsets[ch.index] += sum(len(t) for t in new["tokens"])
                lp = _merge(lp, new)
                yield enc.completion_lp(ch.index, text, d.finish_reason, lp, stop, use(ch), ids)
            else:               # (an event per update, even when the text is held back: a client sees progress)
                yield enc.completion(ch.index, text, d.finish_reason, stop, use(ch), ids)
        if P.include_usage(req):
            yield R.sse(R.usage_chunk(rid, model, "text_completion", total_usage(prompts, done.values(), req),
                                      enc.created))
    return sse_response(events())


def chat_stream(run: AsyncIterator, rid: str, model: str, prompts, n: int, req, text_of, role: str = "assistant",
                echo: str = "", think: bool | None = None, calls: T.ToolUse | None = None):
    enc = R.ChunkEncoder(rid, model, "chat.completion.chunk")
    k = (req.top_logprobs or 0) if req.logprobs else None
    use, created = _choice_usage(req, prompts, n), enc.created
    start = R.usage(len(prompts[0]), 0) if P.continuous_usage(req) else None
    prompt_ids = {"prompt_token_ids": prompts[0]} if req.return_token_ids else {}
    as_ids = bool(req.return_tokens_as_token_ids)
    hide = think is not None and not req.include_reasoning      # (vLLM's: no logprobs or ids to show the thinking by)
    k = None if hide else k
    parse = calls is not None and calls.parse
    shaped = think is not None or parse           # deltas other than plain content

    async def events():
        for i in range(n):
            yield R.sse({**R.chat_chunk(rid, model, {"role": role, "content": ""}, None, i, created=created, use=start),
                         **prompt_ids})
        for i in range(n if echo else 0):         # echo: the last message's text first (vLLM)
            yield enc.chat_content(echo, i, start)
        done, split, tool = {}, {}, {}
        async for ch, d in run:
            done[ch.index] = ch
            ids, entries, before = _new_logprobs(ch) if k is not None else ((), (), ())
            new, delta, last, reason = None if hide else token_ids(req, d.token_ids), {"content": d.text}, \
                d.finish_reason is not None, d.finish_reason
            if shaped:
                thought, content = split.setdefault(ch.index, reasoning.Splitter(think)).feed(d.text, last) \
                    if think is not None else ("", d.text)
                content, found = tool.setdefault(ch.index, T.Stream(calls)).feed(content, last) \
                    if parse else (content, [])
                delta = {k_: v for k_, v in (("reasoning", thought if req.include_reasoning else ""),
                                             ("content", content)) if v}
                if "reasoning" in delta:          # (and under its older name, as vLLM 0.11 sent both)
                    delta["reasoning_content"] = delta["reasoning"]
                if found:
                    delta["tool_calls"] = [{"index": j, **c} for j, c in enumerate(found)]
                    reason = calls.finish_reason(reason, found)
            if last:       # the finish rides on the chunk with the last text, as in vLLM; tool calls come in
                lp = R.chat_logprobs(text_of, ids, entries, k, before, as_ids) if ids else None   # a chunk of their
                if "tool_calls" in delta:       # own first (the openai client's stream helper ends each call then)
                    yield R.sse(R.chat_chunk(rid, model, delta, None, ch.index, lp, created=created, use=use(ch),
                                             ids=new))
                    delta, lp, new = {}, None, None
                yield R.sse(R.chat_chunk(rid, model, delta or {"content": ""}, reason, ch.index, lp,
                                         stop_reason=ch.stop_reason, created=created, use=use(ch), ids=new))
            elif ids:
                yield R.sse(R.chat_chunk(rid, model, delta or {"content": ""}, None, ch.index,
                                         R.chat_logprobs(text_of, ids, entries, k, before, as_ids), created=created,
                                         use=use(ch), ids=new))
            elif shaped and (delta or new and d.token_ids):
                yield R.sse(R.chat_chunk(rid, model, delta, None, ch.index, created=created, use=use(ch), ids=new))
            elif not shaped and (d.text or new and d.token_ids):      # (token ids of text held back too)
                yield enc.chat_content(d.text, ch.index, use(ch), new)
        if P.include_usage(req):
            yield R.sse(R.usage_chunk(rid, model, "chat.completion.chunk", total_usage(prompts, done.values(), req),
                                      created))
    return sse_response(events())


def sse_response(gen) -> StreamingResponse:
    """`gen` yields server-sent events (text); an error after the headers went out is reported in-band, as
    OpenAI does, and the stream always ends with [DONE]."""
    async def body():
        try:
            async for event in gen:
                yield event
        except Exception as e:
            yield R.sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
        yield "data: [DONE]\n\n"
    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
