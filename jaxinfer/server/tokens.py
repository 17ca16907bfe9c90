"""vLLM's tokenizer routes: /tokenize, /detokenize and /tokenizer_info (lm-evaluation-harness' remote tokenizer
backend uses them); `TokenizerThread`, where every request's tokenizing and chat rendering runs."""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, StrictInt

from jaxinfer.prompts import truncate
from jaxinfer.server import chat_prompt as CP
from jaxinfer.server import protocol as P


def encode_text(tokenizer, text: str, special: bool = False, param: str = "prompt") -> list[int]:
    """Token ids of a request's text; text a tokenizer cannot take (a lone surrogate) is a 400 naming `param`."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=special))
    except (TypeError, UnicodeEncodeError, ValueError) as e:
        why = str(e)[:120]
        try:                                  # (the usual cause, said plainly: a lone surrogate, e.g. "\\ud800")
            text.encode("utf-8")
        except UnicodeEncodeError as u:
            why = f"it is not valid UTF-8 text ({u.reason} at character {u.start})"
        raise P.RequestError(f"the {param} cannot be tokenized: {why}", param=param) from None


class TokenizerThread:
    """Runs tokenizer work (encode, chat rendering, decode of whole requests) off the event loop, one call at a time:
    a 25 MiB prompt took ~40 s to encode on the loop, and every stream and /health of the process waited (HF's
    tokenizers release the GIL while they encode). `await off_loop(fn, *args)`; its exceptions are raised there."""
    def __init__(self):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="jaxinfer-tokenizer")

    async def __call__(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))


# a normaliser may shrink text before it is split (NFC composes up to ~3 code points into one)
NORMALISED_SHRINK = 4


def prompt_char_limit(tokenizer, max_model_len: int) -> int | None:
    """The length past which a text prompt cannot fit in max_model_len tokens whatever it says (its vocabulary's
    longest entry times max_model_len, with room for normalisation), so that it is refused before it is encoded:
    encoding a 25 MiB prompt only to refuse it took ~20 s of the tokenizer's thread. None when unknown."""
    try:
        longest = max(map(len, tokenizer.get_vocab()), default=0) if hasattr(tokenizer, "get_vocab") else \
            1 if getattr(tokenizer, "byte_level", False) else 0
    except Exception:                             # (a tokenizer without a usable vocabulary: no early refusal)
        longest = 0
    return longest * max_model_len * NORMALISED_SHRINK or None


def truncation(req, max_model_len: int, default_max_tokens: int | None) -> int | None:
    """A request's truncate_prompt_tokens as current vLLM's server applies it: -1 keeps the prompt's last
    max_model_len - max_tokens tokens (room for the output; without max_tokens: completions' default, else all)."""
    keep, out = getattr(req, "truncate_prompt_tokens", None), getattr(req, "max_completion_tokens", None)
    out = next((o for o in (out, req.max_tokens, default_max_tokens) if o is not None), None)
    return max(1, max_model_len - max(out, 1)) if keep == -1 and out is not None else keep     # (echo-only 0: 1)


def prompt_encoder(tokenizer, max_model_len: int):
    """tokenize(prompt, keep, special, param) -> a request's prompt ids (a text encoded, ids as given), truncated to
    its last `keep` (truncate_prompt_tokens), or a 400 naming `param`: empty, or no room left to generate (`scoring`,
    an echo-only request, which drops the token it generates: the prompt may fill max_model_len, as in vLLM)."""
    char_limit = prompt_char_limit(tokenizer, max_model_len)

    def tokenize(prompt, keep: int | None = None, special: bool = False, param: str = "prompt",
                 scoring: bool = False) -> list[int]:
        if keep == 0:
            raise P.RequestError("truncate_prompt_tokens=0 would leave no prompt: give k >= 1, or -1",
                                 param="truncate_prompt_tokens")
        if isinstance(prompt, str) and keep is None and char_limit and len(prompt) > char_limit:
            raise P.RequestError(f"This model's maximum context length is {max_model_len} tokens; a prompt of "
                                 f"{len(prompt)} characters is longer.", param=param, code="context_length_exceeded")
        ids = encode_text(tokenizer, prompt, special, param) if isinstance(prompt, str) else list(prompt)
        try:
            ids = truncate(ids, keep, max_model_len)
        except ValueError as e:
            raise P.RequestError(str(e), param="truncate_prompt_tokens") from None
        if not ids:
            raise P.RequestError("the prompt is empty", param=param)
        if len(ids) > max_model_len or len(ids) == max_model_len and not scoring:
            raise P.RequestError(f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                                 f"{len(ids)} tokens and leaves no room to generate.", param=param,
                                 code="context_length_exceeded")
        return ids
    return tokenize


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt (its TokenizeCompletionRequest), or chat messages rendered with the chat template
    (its TokenizeChatRequest; the template's fields as in chat completions, and `tools`, which reach the template
    as in vLLM). A per-request chat_template is refused, as vLLM does by default; null means absent."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[P.ChatMessage] | None = None
    add_special_tokens: bool | None = None          # vLLM's defaults: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    chat_template: str | None = None
    tools: list[P.Tool] | None = None           # (checked and given to the template as chat completions do)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None     # (as chat completions)
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[StrictInt]


def add_token_routes(app: FastAPI, tokenizer, check_model, max_model_len: int, vocab_size: int,
                     off_loop: TokenizerThread) -> None:
    @app.post("/tokenize")
    async def tokenize_route(req: TokenizeRequest):
        """vLLM's /tokenize: `prompt`, or `messages` rendered with the chat template."""
        check_model(app.state.options.apply(req).model)
        if (req.prompt is None) == (req.messages is None):
            raise P.RequestError("give exactly one of prompt and messages", param="prompt")
        if req.chat_template:
            raise P.RequestError("chat_template is not supported by this server", param="chat_template",
                                 code="unsupported_parameter")
        chat = req.messages is not None
        special = (not chat) if req.add_special_tokens is None else req.add_special_tokens

        def encode() -> list[int]:
            tools = [t.model_dump(exclude_none=True) for t in req.tools or []]           # (as tools.resolve)
            text = CP.apply_chat_template(tokenizer, CP.chat_messages(req.messages),
                                          CP.chat_template_kwargs(req, tools)) if chat else req.prompt
            return encode_text(tokenizer, text, special, "messages" if chat else "prompt")
        ids = await off_loop(encode)      # token_strs: the vocabulary's strings, as vLLM (a byte piece stays whole)
        strs = await off_loop(tokenizer.convert_ids_to_tokens, ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}

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
        return {"prompt": await off_loop(tokenizer.decode, req.tokens)}
