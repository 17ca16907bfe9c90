"""The OpenAI-compatible HTTP API of one API process (FastAPI): /v1/models, /v1/completions,
/v1/chat/completions; vLLM's /tokenize, /detokenize, /version; /health, /stats, /metrics; /docs (offline).

Handlers validate (pydantic models, protocol.py; errors are OpenAI-shaped 400s, not 422) and tokenize on the
event loop, submit token ids to the engine core (`CoreClient`; choices.py follows each engine request), and
build OpenAI-shaped answers (responses.py) or server-sent events (streams.py).
"""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from jaxinfer.generation_config import max_tokens_cap, sampling_defaults
from jaxinfer.server import chat_prompt as CP, choices as C, protocol as P, responses as R
from jaxinfer.server import beam, formats, reasoning, streams, tools
from jaxinfer.server.admission import Admission
from jaxinfer.server.client import CoreClient, EngineDeadError, RequestFailed
from jaxinfer.server.docs import add_docs, package_version
from jaxinfer.server.errors import internal_error, validation_error
from jaxinfer.server.gate import add_middleware
from jaxinfer.server.metrics import ServerMetrics
from jaxinfer.server.options import ServerOptions
from jaxinfer.server.process import CoreInfo
from jaxinfer.server.tokens import TokenizerThread, add_token_routes, prompt_encoder, truncation
from jaxinfer.tokenizer import load_tokenizer

DISCONNECT_POLL_S = 0.25      # how often a plain (non-streaming) handler checks that its client is still there
ERRORS = {400: {"model": P.ErrorResponse}, 401: {"model": P.ErrorResponse}, 404: {"model": P.ErrorResponse},
          503: {"model": P.ErrorResponse}}


def load_model_tokenizer(model: str):
    """The tokenizer of a resolved model: its directory's, or the byte-level stand-in of a preset."""
    return load_tokenizer(model if os.path.isdir(model) else None)


def build_app(info: CoreInfo, served_model_name: str | list[str], *, api_index: int = 0, tokenizer=None,
              alive: Callable[[], bool] | None = None, on_dead: Callable[[str], None] | None = None,
              options: ServerOptions | None = None) -> FastAPI:
    """A FastAPI app serving the engine core described by `info` (from `CoreProcess(...).info`) under the
    model id `served_model_name`. `tokenizer`: default, the model's. `alive` tells whether the core process
    still runs (default: by its pid); `on_dead(reason)` runs on the event loop when the core is found dead.
    `options`: ServerOptions (API key, queue bound, drain timeout, body limit)."""
    tokenizer = tokenizer if tokenizer is not None else load_model_tokenizer(info.tokenizer or info.model)
    options = options or ServerOptions()
    limits = info.limits
    max_model_len, V = limits["max_model_len"], limits["vocab_size"]
    defaults = sampling_defaults(info.model if os.path.isdir(info.model) else None, options.generation_config,
                                 options.override_generation_config)
    cap = max_tokens_cap(options.generation_config, options.override_generation_config, defaults)
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    served_model_name = names[0]                  # answers carry the first (vLLM: several names allowed)
    if options.chat_template:                     # --chat-template: a file or the template itself
        tokenizer.chat_template = options.template_text()
    metrics = ServerMetrics(served_model_name, max_model_len, limits.get("kv_cache_dtype", "auto"))
    text_of = R.TokenTexts(tokenizer)

    async def lifespan(app):
        client = CoreClient(info, api_index, alive)
        if on_dead is not None:
            client.on_dead.append(on_dead)
        await client.start()
        app.state.client, app.state.loop = client, asyncio.get_running_loop()
        yield
        client.close()

    app = FastAPI(title="jaxinfer", version=package_version(), lifespan=asynccontextmanager(lifespan), docs_url=None,
                  redoc_url=None, description="OpenAI-compatible API of jaxinfer (see docs/serving.md).",
                  openapi_url=None if options.disable_fastapi_docs else "/openapi.json",
                  root_path=options.root_path or "")                # (vLLM's: paths with or without it are served)
    app.state.client, app.state.options, app.state.draining, app.state.active = None, options, False, 0
    app.state.hurry, app.state.dp_size = 0.0, limits.get("data_parallel_size", 1)  # (hurry: a second signal's time)
    add_middleware(app, options)                   # the Gate (API key, drain, limits), CORS, request ids
    add_docs(app, off=options.disable_fastapi_docs)

    # -- errors: OpenAI's shape for all of them ----------------------------------------------------------
    @app.exception_handler(P.RequestError)
    async def _request_error(request: Request, e: P.RequestError):
        return JSONResponse(P.error_body(str(e), e.param, e.code, e.type), status_code=e.status, headers=e.headers)

    app.exception_handler(RequestValidationError)(validation_error)     # (OpenAI's 400 naming the field, not 422)
    app.exception_handler(Exception)(internal_error)                    # (a bug: still OpenAI's shape, a 500)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status_code)
        where = f": {request.method} {request.scope['path']}" if e.status_code in (404, 405) else ""
        return JSONResponse(P.error_body(f"{e.detail}{where}", code=code), status_code=e.status_code,
                            headers=e.headers)

    def client() -> CoreClient:
        c = app.state.client
        if c is None or c.dead:
            metrics.observe_rejected("engine_dead")
            raise P.RequestError(f"the engine is not running: {c.dead if c else 'not started'}", status=503)
        return c

    def check_model(model: str | None) -> None:
        if model and model not in names:          # (no name, or "": the served model, as vLLM)
            raise P.RequestError(f"The model `{model}` does not exist; this server serves `{'`, `'.join(names)}`",
                                 param="model", code="model_not_found", status=404)

    off_loop, tokenize = TokenizerThread(), prompt_encoder(tokenizer, max_model_len)      # (tokens.py)

    async def prepare(req, prompts: list, default_max_tokens: int | None, logprobs: int | None,
                      prompt_logprobs: int | None, stream: bool) -> tuple[list, list]:
        """Validate, tokenize (off the loop) and admit: (prompt ids per prompt, (ids, params) per choice)."""
        P.check_unsupported(req)
        beam.check(req, limits)
        check_model(req.model)
        ids_list, params, param = [], [], "messages" if isinstance(req, P.ChatCompletionRequest) else "prompt"
        keep, scoring = truncation(req, max_model_len, default_max_tokens), streams.echo_only(req)   # (tokens.py)
        encoded = await off_loop(lambda: [tokenize(p, keep, req.add_special_tokens, param, scoring) for p in prompts])
        for ids in encoded:
            sp = P.sampling_params(req, len(ids), max_model_len, default_max_tokens, logprobs, prompt_logprobs,
                                   pool_tokens=limits["num_blocks"] * limits["block_size"], defaults=defaults, cap=cap)
            tokenizer_work = sp.bad_words or sp.structured_outputs is not None     # (then off the event loop)
            await off_loop(P.check_request, ids, sp, limits, param, tokenizer, formats.structured(req)[2], False) \
                if tokenizer_work else \
                P.check_request(ids, sp, limits, param)
            await formats.index_built(sp, formats.structured(req)[2], lambda: app.state.draining)    # (on the loop)
            ids_list.append(ids)
            params.append(sp)
        items = C.expand(ids_list, params, req.n or 1, stream_prompt_logprobs=stream)
        admit(len(items))
        return ids_list, items

    admission = Admission(app.state, limits.get("max_num_seqs", 0), len(info.out_addrs), metrics, client, api_index)
    app.state.queue_full = admission.full          # the Gate's check, before a generate request's body is read
    admit = admission.admit

    async def collect(items, request: Request, t0: float, n: int, salt: str | None = None) -> list[C.Choice]:
        """All choices to their end (no streaming). A client that disconnects first aborts them in the core:
        Starlette does not cancel a plain handler, so the connection is checked every DISCONNECT_POLL_S."""
        run = C.run(client(), tokenizer, items, False, metrics, t0, n, salt)    # submitted now: admit() counts them

        async def collect_all():
            done = {}
            try:
                async for ch, _ in run:
                    done[ch.index] = ch
            except EngineDeadError as e:
                raise P.RequestError(str(e), status=500) from None
            except RequestFailed as e:
                raise P.RequestError(str(e), param="prompt" if e.status == 400 else None, status=e.status) from None
            return [done[i] for i in range(len(items))]
        task = asyncio.ensure_future(collect_all())
        try:
            while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
                if await request.is_disconnected():
                    task.cancel()                 # run()'s finally aborts the prompts in the core
                    await asyncio.wait({task})
                    raise P.RequestError("the client disconnected", status=499)
            return task.result()
        finally:
            task.cancel()

    def searched(req, request, prompts, items, n: int, t0: float):     # vLLM's beam search (beam.py): its choices
        return beam.search(lambda its: collect(its, request, t0, len(its), req.cache_salt), tokenizer, prompts,
                           [sp for _, sp in items[::n]], n, req.length_penalty, limits.get("eos", ((), None)),
                           max_model_len, None if req.stream else request.is_disconnected)

    # -- routes -------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        c = app.state.client
        if c is None or c.dead:
            return JSONResponse({"status": "error", "message": c.dead if c else "starting"}, status_code=503)
        return {"status": "ok"}

    app.get("/ping")(health)              # vLLM's /ping (load balancers' health check, GET or POST)
    app.post("/ping", operation_id="ping_post")(health)

    @app.get("/version")
    async def version():
        return {"version": package_version()}

    async def core_stats() -> dict:
        try:
            return await client().stats()
        except EngineDeadError as e:
            raise P.RequestError(str(e), status=503) from None

    @app.get("/stats")
    async def stats():
        """The core's engine stats, plus this API process's counters and the core's pid / XLA_FLAGS."""
        st = await core_stats()
        c = app.state.client
        return {**st, **{f"api_{k}": v for k, v in c.counters.items()}, "api_inflight": c.inflight,
                "engine_core_pid": info.pid, "engine_core_xla_flags": limits.get("xla_flags", "")}

    @app.get("/metrics")
    async def prometheus_metrics():
        if not metrics.enabled:
            raise P.RequestError("/metrics needs the prometheus_client package (pip install prometheus_client)",
                                 status=501)
        body, ctype = metrics.render(await core_stats())
        return Response(body, media_type=ctype)

    def model_card(name: str) -> dict:             # (vLLM's fields: root is the model served)
        now = int(time.time())
        permission = {"id": f"modelperm-{name}", "object": "model_permission", "created": now, "allow_view": True,
                      "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True, "group": None,
                      "allow_search_indices": False, "allow_fine_tuning": False, "organization": "*", "is_blocking": False}
        return {"id": name, "object": "model", "created": now, "owned_by": "jaxinfer", "root": info.model,
                "parent": None, "max_model_len": max_model_len, "permission": [permission]}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(n) for n in names]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        """OpenAI's retrieve (the openai client's `models.retrieve`): 404 for another model."""
        if not model:                            # (not the served model, as "" is in a request's body)
            raise P.RequestError("no model id given", param="model", code="model_not_found", status=404)
        check_model(model)
        return model_card(model)

    # (their own thread: /tokenize needs no API key, and a huge one must not hold up the generate requests)
    add_token_routes(app, tokenizer, check_model, max_model_len, V, TokenizerThread())

    @app.post("/v1/completions", responses={200: {"model": R.CompletionResponse}, **ERRORS})
    async def completions(req: P.CompletionRequest, request: Request):
        t0, k, asked = time.perf_counter(), req.logprobs, P.completion_prompts(app.state.options.apply(req))
        prompts, items = await prepare(req, asked, 16, k, P.engine_prompt_logprobs(req, V, k if req.echo else None),
                                       bool(req.stream))
        echoed = await off_loop(streams.echo_texts, tokenizer, asked, prompts, req) if req.echo else None
        rid, n, texts, model = R.new_id("cmpl", request, req), req.n or 1, R.token_texts(text_of, req), names[0]
        found = searched(req, request, prompts, items, n, t0) if req.use_beam_search else None
        if req.stream:
            run = beam.as_run(found) if found else C.run(client(), tokenizer, items, True, metrics, t0, n,
                                                          req.cache_salt)
            return streams.completion_stream(run, rid, model, prompts, n, req, texts, echoed)
        done = await (found or collect(items, request, t0, n, req.cache_salt))
        for ch in done:                           # prompt logprobs are computed for sample 0 of each prompt
            ch.prompt_logprobs = done[ch.index - ch.index % n].prompt_logprobs
        return R.completion(rid, model, [streams.completion_choice(ch, prompts[ch.index // n], req, texts,
                                                                   echoed and echoed[ch.index // n])
                                         for ch in done], streams.total_usage(prompts, done, req))

    @app.post("/v1/chat/completions", responses={200: {"model": R.ChatCompletionResponse}, **ERRORS})
    async def chat_completions(req: P.ChatCompletionRequest, request: Request):
        t0, opts = time.perf_counter(), app.state.options
        P.check_unsupported(opts.apply(req))
        check_model(req.model)
        calls, k = tools.resolve(req, opts), P.chat_top_logprobs(req, V)
        prompt, role, echo = await off_loop(CP.chat_prompt, tokenizer, req, calls.tools, opts.response_role)
        think = reasoning.thinking_closed(opts.reasoning_parser, prompt, CP.chat_template_kwargs(req))
        prompts, items = await prepare(req, [prompt], None, k, P.engine_prompt_logprobs(req, V), bool(req.stream))
        if think is False:                                 # structured outputs apply after the thinking (vLLM's)
            reasoning.after_thinking(items, opts.reasoning_parser, tokenizer)
        rid, model, ids = R.new_id("chatcmpl", request, req), names[0], prompts[0] if req.return_token_ids else None
        found = searched(req, request, prompts, items, len(items), t0) if req.use_beam_search else None
        if req.stream:
            run = beam.as_run(found) if found else C.run(client(), tokenizer, items, True, metrics, t0, len(items),
                                                          req.cache_salt)
            return streams.chat_stream(run, rid, model, prompts, len(items), req, text_of, role, echo, think, calls)
        done = await (found or collect(items, request, t0, len(items), req.cache_salt))
        return R.chat_completion(rid, model, [streams.chat_choice(ch, k, text_of, role, echo, req, think, calls)
                                              for ch in done], streams.total_usage(prompts, done, req), ids,
                                 **streams.prompt_logprobs(done[0], prompts[0], req, text_of))

    # -- SIGTERM: drain ---------------------------------------------------------------------------------
    async def drain(then: Callable[[], None]) -> None:
        """New requests get 503 (Gate); in-flight ones finish, or end with finish_reason "abort" after
        options.shutdown_timeout; then `then()` (uvicorn exits)."""
        app.state.draining = True
        c, end = app.state.client, time.monotonic() + app.state.options.shutdown_timeout
        while c is not None and c.inflight and time.monotonic() < end and not app.state.hurry:
            await asyncio.sleep(0.05)
        if c is not None and c.inflight:
            c.finish_all("abort")
        end = time.monotonic() + 5.0          # the handlers write their last chunks (after a second signal: 1 s)
        while app.state.active and time.monotonic() < (min(end, app.state.hurry + 1.0) if app.state.hurry else end):
            await asyncio.sleep(0.02)
        then(force=bool(app.state.hurry and app.state.active))    # (a handler stuck on a client that stopped reading)

    def start_drain(then: Callable[..., None], now: bool = False) -> None:
        """From a signal handler (any thread): start draining on the event loop; `now` (a second signal): end the
        in-flight requests at once, as the shutdown timeout does."""
        loop = getattr(app.state, "loop", None)
        if loop is None or loop.is_closed():
            return then()
        if now:
            return loop.call_soon_threadsafe(setattr, app.state, "hurry", app.state.hurry or time.monotonic())
        loop.call_soon_threadsafe(lambda: asyncio.ensure_future(drain(then)))
    app.state.start_drain = start_drain
    return app

