"""The server's errors: RequestError (a 4xx / 5xx answer naming the field) and OpenAI's error body."""
from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel


class RequestError(ValueError):
    """An invalid request (400), an unknown model (404), or one the server cannot serve now (5xx)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 headers: dict | None = None):
        super().__init__(message)
        self.param, self.code, self.status, self.headers = param, code, status, headers

    @property
    def type(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"


def error_body(message: str, param: str | None = None, code: str | None = None,
               type_: str = "invalid_request_error") -> dict:
    # a lone surrogate the client sent (e.g. in `model`) cannot be encoded as UTF-8: written as its escape instead
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ErrorResponse(BaseModel):
    """{"error": {message, type, param, code}}: every non-200 answer (OpenAI's shape)."""
    error: dict[str, Any]


async def validation_error(request, e) -> JSONResponse:
    """FastAPI's RequestValidationError as OpenAI's 400 naming the field (FastAPI's own answer is a 422)."""
    errs = e.errors()       # (of a union's alternatives, the deepest: "content.0.type: should be 'text', ...")
    err = max((x for x in errs if x.get("loc", ())[:2] == errs[0].get("loc", ())[:2]), key=lambda x: len(x["loc"]))
    loc = [x for x in err.get("loc", ()) if x != "body"]
    param = loc[0] if loc and isinstance(loc[0], str) and err.get("type") != "json_invalid" else None
    where = ".".join(str(x) for x in loc if not isinstance(x, str) or not x[:1].isupper() and "[" not in x)
    got = f" (got {err['input']!r:.80})" if param and "input" in err and err.get("type") != "missing" else ""
    msg = f"{where}: {err.get('msg')}{got}" if param else f"the request body is invalid: {err.get('msg')}"
    if err.get("type") == "json_invalid":
        msg = f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}"
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if not loc and not (media == "application/json" or media.endswith("+json")):   # (FastAPI parses only those)
        msg += f" (send it as JSON with Content-Type: application/json; got {media or 'none'!r})"
    return JSONResponse(error_body(msg, param), status_code=400)


async def internal_error(request, e: Exception) -> JSONResponse:
    """An exception no handler expected (a bug), as OpenAI's 500 rather than a plain-text one."""
    return JSONResponse(error_body(f"internal error: {type(e).__name__}: {str(e)[:200]}", code="internal_error",
                                   type_="server_error"), status_code=500)
