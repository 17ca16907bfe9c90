"""The server's errors: RequestError (a 4xx / 5xx answer naming the field) and OpenAI's error body."""
from __future__ import annotations

from typing import Any

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
