"""vLLM's tokenizer routes: /tokenize, /detokenize and /tokenizer_info (lm-evaluation-harness' remote tokenizer
backend uses them)."""
from __future__ import annotations

from fastapi import FastAPI

from jaxinfer.server import protocol as P


def add_token_routes(app: FastAPI, tokenizer, text_of, check_model, max_model_len: int, vocab_size: int) -> None:
    @app.post("/tokenize")
    async def tokenize_route(req: P.TokenizeRequest):
        """vLLM's /tokenize: `prompt`, or `messages` rendered with the chat template."""
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise P.RequestError("give exactly one of prompt and messages", param="prompt")
        text = req.prompt if req.messages is None else P.apply_chat_template(
            tokenizer, P.chat_messages(req.messages), req.chat_template_kwargs, req.add_generation_prompt)
        ids = P.encode(tokenizer, text, req.add_special_tokens, "prompt" if req.messages is None else "messages")
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                "token_strs": [text_of(t) for t in ids] if req.return_token_strs else None}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """vLLM's: what a client needs to tokenize as the server does."""
        return {"tokenizer_class": type(tokenizer).__name__, "model_max_length": max_model_len,
                **{k: getattr(tokenizer, k, None) for k in ("eos_token", "bos_token", "pad_token", "chat_template")}}

    @app.post("/detokenize")
    async def detokenize_route(req: P.DetokenizeRequest):
        check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < vocab_size]
        if bad:
            raise P.RequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param="tokens")
        return {"prompt": tokenizer.decode(req.tokens)}
