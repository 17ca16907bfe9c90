"""The OpenAI-compatible HTTP API (FastAPI): /v1/models, /v1/completions, /v1/chat/completions, /health, /stats.

    jaxinfer serve Qwen/Qwen3-0.6B --port 8000
    curl localhost:8000/v1/chat/completions -d '{"model": "Qwen/Qwen3-0.6B",
        "messages": [{"role": "user", "content": "Hi"}], "stream": true}'

Handlers validate and tokenize on the event loop, then hand the request to the single engine thread
(`AsyncEngine`) and stream its deltas back as server-sent events (`stream: true`) or one JSON body.
"""
from __future__ import annotations

import json
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from jaxinfer.server import protocol as P
from jaxinfer.server.engine_loop import AsyncEngine


def build_app(llm, served_model_name: str) -> FastAPI:
    """A FastAPI app serving `llm` under the model id `served_model_name`; the engine thread runs while
    the app is up (started and stopped by the app's lifespan)."""
    engine = AsyncEngine(llm)
    max_model_len = llm.config.max_model_len

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="jaxinfer", lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(P.RequestError)
    async def _request_error(request: Request, e: P.RequestError):
        return JSONResponse(P.error_body(str(e), e.param, e.code), status_code=e.status)

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
        try:
            with engine.tokenizer_lock:
                ids = llm._tokenize(prompt, 0)
        except ValueError as e:
            raise P.RequestError(str(e), param="prompt") from None
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
            try:
                llm.engine.check_request(ids, params)   # reads only constants: safe off the engine thread
            except ValueError as e:
                raise P.RequestError(str(e), param="prompt") from None
            items.append((ids, params))
        return items

    async def collect(items) -> tuple[list[str], list[str], dict]:
        texts, reasons = [""] * len(items), [None] * len(items)
        out_tokens = [0] * len(items)
        async for d in engine.generate(items):
            texts[d.index] += d.text
            out_tokens[d.index] = d.num_output_tokens
            if d.finish_reason:
                reasons[d.index] = d.finish_reason
        return texts, reasons, P.usage(sum(len(ids) for ids, _ in items), sum(out_tokens))

    def sse(gen) -> StreamingResponse:
        async def body():
            try:
                async for obj in gen:
                    yield f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
            except Exception as e:        # headers are sent: report in-band, as OpenAI does
                yield f"data: {json.dumps(P.error_body(str(e), type_='server_error'))}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # -- routes -------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "error", "message": "engine thread is not running"}, status_code=503)
        return {"status": "ok"}

    @app.get("/stats")
    async def stats():
        return await engine.stats()

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
            texts, reasons, use = await collect(items)
            return P.completion(rid, model, texts, reasons, use)

        async def chunks():
            out_tokens = [0] * len(items)
            async for d in engine.generate(items):
                out_tokens[d.index] = d.num_output_tokens
                yield P.completion_chunk(rid, model, d.index, d.text, d.finish_reason)
            if include_usage:
                use = P.usage(sum(len(ids) for ids, _ in items), sum(out_tokens))
                yield P.usage_chunk(rid, model, "text_completion", use)
        return sse(chunks())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_body(request)
        stream, include_usage = P.stream_flags(body)
        messages = P.chat_messages(body)
        try:
            with engine.tokenizer_lock:
                prompt = llm.apply_chat_template(messages, body.get("chat_template_kwargs"))
        except Exception as e:            # template errors (jinja) as well as our ValueErrors
            raise P.RequestError(f"cannot apply the chat template: {e}", param="messages") from None
        items = prepare(body, [prompt], default_max_tokens=None)
        rid, model = P.new_id("chatcmpl"), served_model_name
        if not stream:
            texts, reasons, use = await collect(items)
            return P.chat_completion(rid, model, texts[0], reasons[0], use)

        async def chunks():
            yield P.chat_chunk(rid, model, {"role": "assistant", "content": ""}, None)
            n_out = 0
            async for d in engine.generate(items):
                n_out = d.num_output_tokens
                if d.text:
                    yield P.chat_chunk(rid, model, {"content": d.text}, None)
                if d.finish_reason:
                    yield P.chat_chunk(rid, model, {}, d.finish_reason)
            if include_usage:
                yield P.usage_chunk(rid, model, "chat.completion.chunk", P.usage(len(items[0][0]), n_out))
        return sse(chunks())

    return app


def serve(llm, served_model_name: str, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Run the server in the foreground until interrupted."""
    import uvicorn
    uvicorn.run(build_app(llm, served_model_name), host=host, port=port, log_level=log_level)

