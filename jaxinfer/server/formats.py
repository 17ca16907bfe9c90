"""A request's structured outputs from any of the forms vLLM's server takes: `structured_outputs` (its fields:
choice, json, regex, json_object), the older `guided_choice` / `guided_json` / `guided_regex`, and OpenAI's
`response_format` (`{"type": "json_schema", "json_schema": {"schema": ...}}` or `{"type": "json_object"}`; "text"
is none). One form a request: several are a 400 naming them."""
from __future__ import annotations

import asyncio

from jaxinfer.server.errors import RequestError

GUIDED = (("guided_choice", "choice"), ("guided_json", "json"), ("guided_regex", "regex"))


def response_format(value) -> dict | None:
    """structured_outputs' fields for OpenAI's response_format (None: "text" or absent)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if schema is None or not isinstance(spec.get("name"), str):    # (OpenAI and vLLM: 400; name is required)
            raise RequestError(f"response_format type 'json_schema' needs json_schema: {{\"name\": ..., \"schema\": "
                               f"{{...}}}}, got json_schema={spec!r:.80}", param="response_format")
        return {"json": schema}
    raise RequestError(f"response_format type {kind!r:.80} is not supported: text, json_object or json_schema",
                       param="response_format")


def structured(req) -> tuple[dict | None, dict | None, str | None]:
    """(structured_outputs, guided_decoding, the request field they came from) for SamplingParams."""
    guided = {key: getattr(req, name) for name, key in GUIDED if getattr(req, name, None) is not None}
    if guided and getattr(req, "guided_whitespace_pattern", None) is not None:
        guided["whitespace_pattern"] = req.guided_whitespace_pattern
    fmt = response_format(getattr(req, "response_format", None))
    given = [name for name, v in (("structured_outputs", req.structured_outputs), ("response_format", fmt))
             if v is not None] + [name for name, key in GUIDED if key in guided]
    if len(given) > 1:
        raise RequestError(f"{given[0]} and {given[1]} are both structured outputs: give one", param=given[0])
    if not given:
        return None, None, None
    return (fmt if fmt is not None else req.structured_outputs), guided or None, \
        getattr(req, "_structured_from", None) or given[0]        # (tools.resolve's schema: "tools")


async def index_built(params, field: str | None, draining=lambda: False) -> None:
    """Wait, on the event loop, for the json / regex index a request's check left building (its tokenizer-thread
    work is done, so other requests' tokenization goes on meanwhile); one that cannot be built, or not within
    grammar.BUILD_TIMEOUT_S, is a 400 naming the request's field, as the check's own errors. A drain (SIGTERM)
    that starts meanwhile makes it a 503, as a new request's (it is not in the engine yet: the drain waits for
    no such request)."""
    rule = getattr(params, "_grammar_rule", None)
    while rule is not None and rule.build.result(True) is None:
        if draining():
            raise RequestError("the server is shutting down", code="shutting_down", status=503)
        await asyncio.sleep(0.005)
    if rule is not None and (why := rule.refusal()):
        raise RequestError(why, param=field or "structured_outputs")
