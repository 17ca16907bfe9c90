"""What every HTTP request passes before a handler: the API key, the drain, the body size limit. A plain ASGI
middleware (Starlette's BaseHTTPMiddleware would wrap every streamed event of every response).

- API key (`--api-key` / JAXINFER_API_KEY): paths under /v1/ need `Authorization: Bearer KEY` (not an OPTIONS
  request), else 401 in OpenAI's error shape (the openai client raises AuthenticationError). /health, /metrics,
  /version, /docs and the rest stay open, as in vLLM.
- Draining (after SIGTERM): new requests get 503 with Retry-After (/health too, so a load balancer moves on);
  requests already inside run to their end.
- Queue bound (`--max-waiting-requests`): while this API process is at its share of the bound, a generate
  request gets 503 with Retry-After before its body is read (the handler checks the exact need again), so an
  overloaded server refuses at the cost of one pass through this gate.
- Body size: a Content-Length over the limit is refused (413) before the body is read; a chunked body is
  counted as it arrives and cut off the same way (an HTTPException(413) from the body read).
- `X-data-parallel-rank` (vLLM's): a generate request runs on that data-parallel replica (0 .. dp - 1; else 400).
- `--enable-request-id-headers` (vLLM's): every answer carries X-Request-Id, the request's own or a new id
  (`RequestId`, outside CORS too, so a preflight's answer has one).
Paths are the routes' own: a request under `--root-path`'s prefix (FastAPI's root_path) has it taken off here as
Starlette's routing does (else no path would start with /v1/ and the API key would not be asked for).
"""
from __future__ import annotations

import contextvars
import hmac
import json
import uuid

OPEN_WHILE_DRAINING = ("/metrics", "/stats", "/version")
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
DP_RANK: contextvars.ContextVar = contextvars.ContextVar("dp_rank", default=None)   # (this request's replica)


def _json_response(status: int, message: str, type_: str, code: str | None, headers: tuple = ()):
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    start = {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         *headers]}
    return start, {"type": "http.response.body", "body": body}


def add_middleware(app, options) -> None:
    """The Gate, then CORS outside it (a browser's preflight needs no API key, as vLLM's), then RequestId."""
    from fastapi.middleware.cors import CORSMiddleware
    app.add_middleware(Gate, state=app.state)
    if options.origins():
        app.add_middleware(CORSMiddleware, **options.cors())
    if options.enable_request_id_headers:
        app.add_middleware(RequestId)


def route_path(scope) -> str:
    """The request's path without the root path uvicorn put in front of it (Starlette's routing takes it off)."""
    path, root = scope["path"], scope.get("root_path", "").rstrip("/")
    return path[len(root):] or "/" if root and (path + "/").startswith(root + "/") else path


class RequestId:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = dict(scope["headers"]).get(b"x-request-id") or uuid.uuid4().hex.encode()

        async def sending(msg):
            if msg["type"] == "http.response.start":
                msg = {**msg, "headers": [*msg.get("headers", []), (b"x-request-id", rid)]}
            await send(msg)
        await self.app(scope, receive, sending)


class Gate:
    def __init__(self, app, state):
        """`state`: the FastAPI app's state: .options (ServerOptions), .draining (bool), .active (int)."""
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        opts, path = self.state.options, route_path(scope)
        rank = dict(scope["headers"]).get(b"x-data-parallel-rank") if scope["method"] == "POST" and \
            path in GENERATE_PATHS else None                 # (vLLM's header: the replica a generate request runs on)
        refused = None
        if opts.api_key is not None and path.startswith("/v1/") and scope["method"] != "OPTIONS" and \
                not self._authorized(scope, opts.api_key):                # (a preflight carries no key: vLLM's)
            refused = _json_response(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                                     "invalid_request_error", "invalid_api_key")
        elif self.state.draining and path not in OPEN_WHILE_DRAINING:
            refused = _json_response(503, "the server is shutting down", "server_error", "shutting_down",
                                     ((b"retry-after", str(opts.retry_after_s).encode()),))
        elif scope["method"] == "POST" and path in GENERATE_PATHS and (msg := self._queue_full()):
            refused = _json_response(503, msg, "server_error", "overloaded",
                                     ((b"retry-after", str(opts.retry_after_s).encode()),))
        elif rank is not None and (msg := self._bad_rank(rank)):
            refused = _json_response(400, msg, "invalid_request_error", "invalid_data_parallel_rank")
        else:
            length = dict(scope["headers"]).get(b"content-length")
            if length is not None and length.isdigit() and int(length) > opts.max_request_body_bytes:
                refused = self._too_large(opts)
        if refused is not None:
            for msg in refused:
                await send(msg)
            return
        limit, seen = opts.max_request_body_bytes, 0

        async def counted_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:         # FastAPI re-raises an HTTPException from reading the body
                    from starlette.exceptions import HTTPException
                    raise HTTPException(413, self._too_large_message(opts))
            return msg
        self.state.active += 1
        token = DP_RANK.set(None if rank is None else int(rank))      # (a bad one was refused above)
        try:
            await self.app(scope, counted_receive, send)
        finally:
            self.state.active -= 1
            DP_RANK.reset(token)

    def _bad_rank(self, rank: bytes) -> str | None:
        """vLLM's X-data-parallel-rank header: the replica a generate request runs on, an integer in [0, dp)."""
        size = getattr(self.state, "dp_size", 1)
        if rank.strip().isdigit() and int(rank) < size:
            return None
        return f"X-data-parallel-rank {rank.decode('latin-1')!r:.40} is not an integer in [0, {size})"

    def _queue_full(self) -> str | None:
        check = getattr(self.state, "queue_full", None)      # admission.py (set by app.py)
        return check() if check is not None else None

    @staticmethod
    def _too_large_message(opts) -> str:
        return f"the request body is larger than {opts.max_request_body_bytes} bytes (--max-request-body-bytes)"

    def _too_large(self, opts):
        return _json_response(413, self._too_large_message(opts), "invalid_request_error", "request_too_large")

    @staticmethod
    def _authorized(scope, key: str | tuple[str, ...]) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and any(hmac.compare_digest(token.strip().encode(), k.encode())
                                                          for k in ((key,) if isinstance(key, str) else key))
        return False
