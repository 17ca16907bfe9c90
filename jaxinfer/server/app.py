"""The OpenAI-compatible HTTP API of one API process (FastAPI): /v1/models, /v1/completions,
/v1/chat/completions, /health, /stats.

Handlers validate and tokenize on the event loop, submit token ids to the engine core (`CoreClient`), and
turn the core's token ids into text with one `OutputProcessor` per prompt (incremental detokenization only
when streaming or when stop strings need it; a stop string match aborts the request in the core). Streams
are server-sent events; a handler that falls behind gets several tokens in one event.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from jaxinfer.output_processor import OutputProcessor, TextDelta
from jaxinfer.server import protocol as P
from jaxinfer.server.client import CoreClient, EngineDeadError, RequestFailed
from jaxinfer.server.process import CoreInfo
from jaxinfer.tokenizer import load_tokenizer

DISCONNECT_POLL_S = 0.25      # how often a plain (non-streaming) handler checks that its client is still there


def load_model_tokenizer(model: str):
    """The tokenizer of a resolved model: its directory's, or the byte-level stand-in of a preset."""
    return load_tokenizer(model if os.path.isdir(model) else None)


def build_app(info: CoreInfo, served_model_name: str, *, api_index: int = 0, tokenizer=None,
              alive: Callable[[], bool] | None = None, on_dead: Callable[[str], None] | None = None) -> FastAPI:
    """A FastAPI app serving the engine core described by `info` (from `CoreProcess(...).info`) under the
    model id `served_model_name`. `tokenizer`: default, the model's (`load_model_tokenizer(info.model)`).
    `alive` tells whether the core process still runs (default: by its pid); `on_dead(reason)` runs on the
    event loop when the core is found dead (`serve` stops the server then)."""
    tokenizer = tokenizer if tokenizer is not None else load_model_tokenizer(info.model)
    limits = info.limits
    max_model_len = limits["max_model_len"]

    @asynccontextmanager
    async def lifespan(app):
        client = CoreClient(info, api_index, alive)
        if on_dead is not None:
            client.on_dead.append(on_dead)
        client.start()
        app.state.client = client
        yield
        client.close()

    app = FastAPI(title="jaxinfer", lifespan=lifespan)
    app.state.client = None

    @app.exception_handler(P.RequestError)
    async def _request_error(request: Request, e: P.RequestError):
        return JSONResponse(P.error_body(str(e), e.param, e.code, e.type), status_code=e.status)

    def client() -> CoreClient:
        c = app.state.client
        if c is None or c.dead:
            raise P.RequestError(f"the engine is not running: {c.dead if c else 'not started'}", status=503)
        return c

    async def read_body(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise P.RequestError(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise P.RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
        model = body.get("model", served_model_name)
        if model != served_model_name:
            raise P.RequestError(f"The model {model!r} does not exist; this server serves "
                                 f"{served_model_name!r}", param="model", code="model_not_found")
        return body

    def tokenize(prompt) -> list[int]:
        ids = list(tokenizer.encode(prompt, add_special_tokens=False)) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise P.RequestError("the prompt is empty", param="prompt")
        if len(ids) >= max_model_len:
            raise P.RequestError(f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                                 f"{len(ids)} tokens and leaves no room to generate.", param="prompt",
                                 code="context_length_exceeded")
        return ids

    def prepare(body: dict, prompts: list, default_max_tokens: int | None) -> list:
        items = []
        for p in prompts:
            ids = tokenize(p)
            params = P.sampling_params(body, len(ids), max_model_len, default_max_tokens)
            P.check_request(ids, params, limits)
            items.append((ids, params))
        return items

    async def run(items, stream: bool) -> AsyncIterator[tuple[int, TextDelta, OutputProcessor]]:
        """Submit the prompts; yield (prompt index, delta, its processor) as outputs arrive, until all finish.
        Leaving early (client gone, error) aborts what is still running in the core."""
        c = client()
        procs = [OutputProcessor(tokenizer, params.stop, stream=stream) for _, params in items]
        coll = c.submit(items, eager=stream or any(params.stop for _, params in items))
        left = len(items)
        try:
            while left:
                for index, ids, reason in await coll.get():
                    proc = procs[index]
                    if proc.finished:
                        continue
                    d = proc.update(ids, reason)
                    if proc.stopped and reason is None:       # a stop string matched: end it in the core
                        c.abort(coll, [index])
                    left -= d.finish_reason is not None
                    yield index, d, proc
        finally:
            c.abort(coll)

    async def collect(items, request: Request) -> tuple[list[str], list[str], dict]:
        """The whole answer (no streaming). A client that disconnects first aborts it in the core: Starlette
        does not cancel a plain handler, so the connection is checked every DISCONNECT_POLL_S."""
        task = asyncio.ensure_future(collect_all(items))
        try:
            while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
                if await request.is_disconnected():
                    task.cancel()                 # run()'s finally aborts the prompts in the core
                    await asyncio.wait({task})
                    raise P.RequestError("the client disconnected", status=499)
            return task.result()
        finally:
            task.cancel()

    async def collect_all(items) -> tuple[list[str], list[str], dict]:
        procs = {}
        try:
            async for index, _, proc in run(items, stream=False):
                procs[index] = proc
        except EngineDeadError as e:
            raise P.RequestError(str(e), status=500) from None
        except RequestFailed as e:
            raise P.RequestError(str(e), param="prompt" if e.status == 400 else None, status=e.status) from None
        procs = [procs[i] for i in range(len(items))]
        use = P.usage(sum(len(ids) for ids, _ in items), sum(len(p.token_ids) for p in procs))
        return [p.text for p in procs], [p.finish_reason for p in procs], use

    def sse(gen) -> StreamingResponse:
        """`gen` yields server-sent events (text)."""
        async def body():
            try:
                async for event in gen:
                    yield event
            except Exception as e:        # headers are sent: report in-band, as OpenAI does
                yield P.sse(P.error_body(str(e), type_="server_error"))
            yield "data: [DONE]\n\n"
        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # -- routes -------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        c = app.state.client
        if c is None or c.dead:
            return JSONResponse({"status": "error", "message": c.dead if c else "starting"}, status_code=503)
        return {"status": "ok"}

    @app.get("/stats")
    async def stats():
        c = client()
        try:             # the core's engine stats, plus this API process's counters and the core's pid / XLA_FLAGS
            st = await c.stats()
            return {**st, **{f"api_{k}": v for k, v in c.counters.items()}, "engine_core_pid": info.pid,
                    "engine_core_xla_flags": limits.get("xla_flags", "")}
        except EngineDeadError as e:
            raise P.RequestError(str(e), status=503) from None

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "jaxinfer", "max_model_len": max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request)
        stream, include_usage = P.stream_flags(body)
        items = prepare(body, P.completion_prompts(body), default_max_tokens=16)
        rid, model = P.new_id("cmpl"), served_model_name
        if not stream:
            texts, reasons, use = await collect(items, request)
            return P.completion(rid, model, texts, reasons, use)
        client()                                  # 503 now, not inside the stream, if the core is gone

        async def chunks():
            procs, enc = {}, P.ChunkEncoder(rid, model, "text_completion")
            async for index, d, proc in run(items, stream=True):
                procs[index] = proc
                yield enc.completion(index, d.text, d.finish_reason)
            if include_usage:
                use = P.usage(sum(len(ids) for ids, _ in items), sum(len(p.token_ids) for p in procs.values()))
                yield P.sse(P.usage_chunk(rid, model, "text_completion", use))
        return sse(chunks())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_body(request)
        stream, include_usage = P.stream_flags(body)
        messages = P.chat_messages(body)
        prompt = P.apply_chat_template(tokenizer, messages, body.get("chat_template_kwargs"))
        items = prepare(body, [prompt], default_max_tokens=None)
        rid, model = P.new_id("chatcmpl"), served_model_name
        if not stream:
            texts, reasons, use = await collect(items, request)
            return P.chat_completion(rid, model, texts[0], reasons[0], use)
        client()

        async def chunks():
            enc = P.ChunkEncoder(rid, model, "chat.completion.chunk")
            yield P.sse(P.chat_chunk(rid, model, {"role": "assistant", "content": ""}, None))
            n_out = 0
            async for _, d, proc in run(items, stream=True):
                n_out = len(proc.token_ids)
                if d.text:
                    yield enc.chat_content(d.text)
                if d.finish_reason:
                    yield P.sse(P.chat_chunk(rid, model, {}, d.finish_reason))
            if include_usage:
                yield P.sse(P.usage_chunk(rid, model, "chat.completion.chunk", P.usage(len(items[0][0]), n_out)))
        return sse(chunks())

    return app
