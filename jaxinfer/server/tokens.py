"""vLLM's tokenizer routes: /tokenize, /detokenize and /tokenizer_info (lm-evaluation-harness' remote tokenizer
backend uses them)."""
from __future__ import annotations

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, StrictInt

from jaxinfer.server import protocol as P


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt (its TokenizeCompletionRequest), or chat messages rendered with the chat template
    (its TokenizeChatRequest; the template's fields as in chat completions). A per-request chat_template or tools
    are refused, as vLLM does by default; null means absent."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[P.ChatMessage] | None = None
    add_special_tokens: bool | None = None          # vLLM's defaults: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    chat_template: str | None = None
    tools: list | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[StrictInt]


def add_token_routes(app: FastAPI, tokenizer, text_of, check_model, max_model_len: int, vocab_size: int) -> None:
    @app.post("/tokenize")
    async def tokenize_route(req: TokenizeRequest):
        """vLLM's /tokenize: `prompt`, or `messages` rendered with the chat template."""
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise P.RequestError("give exactly one of prompt and messages", param="prompt")
        for name in ("chat_template", "tools"):
            if getattr(req, name):
                raise P.RequestError(f"{name} is not supported by this server", param=name,
                                     code="unsupported_parameter")
        chat = req.messages is not None
        text = P.apply_chat_template(tokenizer, P.chat_messages(req.messages), P.chat_template_kwargs(req)) \
            if chat else req.prompt
        special = (not chat) if req.add_special_tokens is None else req.add_special_tokens
        ids = P.encode(tokenizer, text, special, "messages" if chat else "prompt")
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                "token_strs": [text_of(t) for t in ids] if req.return_token_strs else None}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """vLLM's: what a client needs to tokenize as the server does."""
        return {"tokenizer_class": type(tokenizer).__name__, "model_max_length": max_model_len,
                **{k: getattr(tokenizer, k, None) for k in ("eos_token", "bos_token", "pad_token", "chat_template")}}

    @app.post("/detokenize")
    async def detokenize_route(req: DetokenizeRequest):
        check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < vocab_size]
        if bad:
            raise P.RequestError(f"token id {bad[0]} is out of vocabulary: ids are in [0, {vocab_size})", param="tokens")
        return {"prompt": tokenizer.decode(req.tokens)}
