"""OpenAI request bodies as pydantic models (FastAPI's /docs, OpenAPI), translated into (prompt ids, SamplingParams).

Every problem is an OpenAI-style 400 naming the field (app.py turns FastAPI's validation errors into that,
not 422). A field this server does not implement is refused by name (`check_unsupported`), never ignored:
`best_of`, `guided_grammar`, ... (UNSUPPORTED below); so is a field nobody knows. (Chat's `tools`: tools.py.)
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from jaxinfer.sampling_params import SamplingParams, openai_bias
from jaxinfer.server import formats
from jaxinfer.server.errors import ErrorResponse, RequestError, error_body  # noqa: F401  (the routes' names)
from jaxinfer.server.tools import NamedToolChoice, Tool

MAX_N = 128                      # OpenAI's bound on n: it multiplies the engine requests of one HTTP request


# Fields of OpenAI's API that this server does not implement, with the values that mean "not used" (accepted).
UNSUPPORTED: dict[str, tuple] = {
    "best_of": (1,), "suffix": ("",), "tools": ([],), "tool_choice": ("none",),
    "functions": ([],), "function_call": ("none",), "parallel_tool_calls": (),
    "audio": (), "modalities": (["text"],), "prediction": (), "web_search_options": (), "logits_processors": (),
    "guided_grammar": (),
    "chat_template": (), "documents": (), "mm_processor_kwargs": (), "priority": (0,), "verbosity": ("medium",),
}
# bookkeeping fields with no effect on the output (the openai package sends the last three on request)
IGNORED = ("user", "store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key",
           "prompt_cache_retention", "guided_decoding_backend")     # (vLLM's deprecated backend choice: one here)


def check_unsupported(req: BaseModel) -> None:
    """400 naming the first field that is unsupported (UNSUPPORTED) or unknown; no-op values pass."""
    extra = {k: v for k, v in (req.model_extra or {}).items() if v is not None and k not in IGNORED}
    if not isinstance(user := (req.model_extra or {}).get("user"), (str, type(None))):     # (vLLM: str | None)
        raise RequestError(f"user={user!r:.200} must be a string", param="user")
    for name, ok in UNSUPPORTED.items():          # in this table's order: `tools` before `tool_choice`
        if name in extra and extra[name] not in ok:
            raise RequestError(f"{name}={extra[name]!r:.200} is not supported by this server (see docs/serving.md)",
                               param=name, code="unsupported_parameter")
    unknown = [k for k in extra if k not in UNSUPPORTED]
    if unknown:
        raise RequestError(f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0],
                           code="unrecognized_parameter")
    if getattr(req, "stream", False) and (getattr(req, "prompt_logprobs", None) or 0) > 0:
        raise RequestError("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
    so = getattr(req, "stream_options", None)                   # as vLLM: an empty {} is taken as absent
    if so is not None and so.model_fields_set and not getattr(req, "stream", False):
        raise RequestError("stream_options can only be given when stream is true", param="stream_options")


class StreamOptions(BaseModel):
    """include_usage (default false, as vLLM's): a last chunk with the usage; continuous_usage_stats: in each."""
    model_config = ConfigDict(extra="forbid")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False
    include_obfuscation: bool | None = None   # (OpenAI's random padding field; this server sends none)


class _Request(BaseModel):
    """Fields common to both routes: OpenAI's sampling fields plus vLLM's extensions (top_k, min_p,
    repetition_penalty, ignore_eos, stop_token_ids). Unknown fields are kept (extra='allow') so that
    check_unsupported can name them."""
    model_config = ConfigDict(extra="allow")
    model: str | None = Field(None, description="the served model id (default: it)")
    temperature: Annotated[float, Field(ge=0, le=2)] | None = Field(None, description="0 = greedy (default 1)")
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = Field(None, description="completions per prompt (default 1)")
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = Field(None, description='{"include_usage": true}: a last chunk with '
                                                                     'usage ("continuous_usage_stats": in every chunk)')
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    seed: Annotated[int, Field(ge=-2**63, lt=2**63)] | None = Field(
        None, description="reproducible samples (sample i of n: seed + i)")
    # vLLM's extensions
    top_k: Annotated[int, Field(lt=2**63)] | None = Field(
        None, description="vLLM: sample among the k most likely (0 or -1: off)")
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = Field(None, description="vLLM: > 1 discourages repeats")
    ignore_eos: bool | None = None
    stop_token_ids: list[Annotated[int, Field(lt=2**63)]] | None = None
    skip_special_tokens: bool | None = Field(None, description="vLLM: leave special tokens out of the text (default)")
    spaces_between_special_tokens: bool | None = None     # vLLM's (slow tokenizers only; Qwen3's are fast)
    include_stop_str_in_output: bool | None = Field(None, description="vLLM: keep the stop string in the text")
    min_tokens: Annotated[int, Field(ge=0)] | None = Field(
        None, description="vLLM: EOS, stop_token_ids and stop strings end the output only after this many tokens")
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = Field(
        None, description="vLLM: keep only the prompt's last k tokens (-1: max_model_len of them)")
    cache_salt: Annotated[str, Field(min_length=1)] | None = Field(
        None, description="vLLM: only requests with the same salt (or none) share prefix-cache blocks")
    return_token_ids: bool | None = Field(None, description="vLLM: the prompt's and each choice's token ids too")
    return_tokens_as_token_ids: bool | None = Field(None, description='vLLM: logprobs name tokens "token_id:N"')
    prompt_logprobs: Annotated[int, Field(ge=-1)] | None = Field(
        None, description="vLLM: each prompt token's logprob and this many most likely (not streamed)")
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> bias added to its logit "
                                                                  "(clamped to [-100, 100])")
    allowed_token_ids: list[Annotated[int, Field(ge=0, lt=2**63)]] | None = Field(
        None, description="vLLM: only these tokens may be sampled")
    bad_words: list[str] | None = Field(None, description="vLLM: words the output must not contain")
    request_id: str | None = Field(None, description="vLLM: the answer's id is cmpl- / chatcmpl- and this (an "
                                                     "X-Request-Id header wins)")
    structured_outputs: dict | None = Field(None, description='vLLM: {"choice": [...]}, {"json": schema}, {"regex": '
                                                               '...} or {"json_object": true} (formats.py)')
    response_format: dict | None = Field(None, description='OpenAI: {"type": "json_schema", "json_schema": {"schema": '
                                                           '...}} or {"type": "json_object"}')
    use_beam_search: bool = Field(False, description="vLLM: n beams (n <= 10) searched, the best first (beam.py)")
    length_penalty: float = Field(1.0, description="vLLM: beam scores are logprob sums / length ** this")
    guided_choice: list[str] | None = Field(None, description="vLLM's older form of structured_outputs' choice")
    guided_json: dict | str | None = Field(None, description="vLLM's older form of structured_outputs' json")
    guided_regex: str | None = Field(None, description="vLLM's older form of structured_outputs' regex")
    guided_whitespace_pattern: str | None = Field(None, description="vLLM's older form of structured_outputs' "
                                                                    "whitespace_pattern (with guided_json)")
    _structured_from: str | None = None       # (a private attribute: tools.resolve's forced-call schema, "tools")


class CompletionRequest(_Request):
    prompt: str | list[StrictInt] | list[str | list[StrictInt]] = Field(
        ..., description="a string, token ids, or a list of either (one choice per prompt and n)")
    max_tokens: Annotated[int, Field(ge=0)] | None = Field(
        None, description="default 16; 0 only with echo (the prompt and its logprobs, nothing generated: vLLM's)")
    logprobs: Annotated[int, Field(ge=0)] | None = Field(
        None, description="log-probabilities of the sampled tokens and this many most likely ones")
    echo: bool | None = Field(False, description="prepend the prompt to the text (and its logprobs)")
    add_special_tokens: bool = Field(True, description="vLLM: the tokenizer's special tokens (e.g. BOS) around a "
                                                       "text prompt")


class TextPart(BaseModel):      # vLLM's text parts (refusal / thinking parts hold theirs under that key)
    type: Literal["text", "input_text", "output_text", "refusal", "thinking"]
    text: str | None = None        # (None or "": the part is left out, as vLLM)
    refusal: str | None = None
    thinking: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[TextPart | str] | None = None
    name: str | None = None


class ChatCompletionRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = Field(None, description="default: the rest of the context")
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=-1)] | None = None      # (-1: all; at most the core's max_logprobs)
    chat_template_kwargs: dict | None = Field(None, description='e.g. {"enable_thinking": false} (Qwen3); '
                                                                 'the two fields below win over it')
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None   # vLLM's: "none" = no thinking
    add_generation_prompt: bool = Field(True, description="vLLM: end the prompt with the assistant's turn")
    continue_final_message: bool = Field(False, description="vLLM: leave the last message open, to be continued")
    echo: bool = Field(False, description="vLLM: the answer starts with the last message's text (the same role)")
    add_special_tokens: bool = Field(False, description="vLLM: special tokens around the templated prompt")
    include_reasoning: bool = Field(True, description="vLLM: with --reasoning-parser, the answer's `reasoning` too")
    tools: list[Tool] | None = Field(None, description="function schemas for the chat template (tools.py)")
    tool_choice: str | NamedToolChoice | None = Field(None, description='"auto" (needs --enable-auto-tool-choice: '
                                                                        'tool calls parsed) or "none"')
    parallel_tool_calls: bool | None = Field(None, description="false: the first tool call only")


# -- request -> engine ---------------------------------------------------------------------------------------
_PASSTHROUGH = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "n",
                "presence_penalty", "frequency_penalty", "repetition_penalty", "skip_special_tokens",
                "spaces_between_special_tokens", "include_stop_str_in_output", "min_tokens", "truncate_prompt_tokens",
                "bad_words")
_PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")


def sampling_params(req: _Request, prompt_len: int, max_model_len: int, default_max_tokens: int | None,
                    logprobs: int | None = None, prompt_logprobs: int | None = None,
                    pool_tokens: int | None = None, defaults: dict | None = None,
                    cap: int | None = None) -> SamplingParams:
    """SamplingParams for one prompt of `prompt_len` tokens (with n: choices.expand sends n engine requests,
    `for_sample(i)`); default_max_tokens None = the rest of the context, which a KV pool of `pool_tokens`
    smaller than max_model_len limits too. `defaults`: the model's recommended values for the fields the
    request leaves out (generation_config.py: its max_tokens only fills in); `cap`: generation_config.max_tokens_cap."""
    defaults, mct = defaults or {}, getattr(req, "max_completion_tokens", None)
    key, max_tokens = ("max_completion_tokens", mct) if mct is not None else ("max_tokens", req.max_tokens)
    scoring = max_tokens == 0                 # (echo only: the token generated is dropped, so it needs no room)
    if scoring:                    # completions: echo only (streams.echo_only) runs one token and drops it
        if not getattr(req, "echo", False):
            raise RequestError("max_tokens=0 needs echo=true (the prompt's logprobs, nothing generated); "
                               "else give max_tokens >= 1", param="max_tokens")
        max_tokens = 1
    if max_tokens is None and default_max_tokens is not None:
        max_tokens = default_max_tokens      # completions left out or null: vLLM's 16, as if given
    if max_tokens is None:
        room = min(max_model_len, pool_tokens or max_model_len) - prompt_len
        max_tokens = max(1, min(room, defaults.get("max_tokens", room), cap or room))
    elif prompt_len + (0 if scoring else max_tokens) > max_model_len:
        raise RequestError(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                           f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the "
                           f"completion). Please reduce the prompt or {key}.", param=key,
                           code="context_length_exceeded")
    elif cap is not None:
        max_tokens = min(max_tokens, cap)
    kw = {**{k: v for k, v in defaults.items() if k != "max_tokens"},
          **{k: getattr(req, k) for k in _PASSTHROUGH if getattr(req, k) is not None}}
    if kw.get("top_k") == -1:
        kw["top_k"] = 0
    if req.logit_bias is not None:            # OpenAI's string keys; values clamped as vLLM's
        try:
            kw["logit_bias"] = openai_bias(req.logit_bias)
        except ValueError:
            raise RequestError(f"logit_bias keys must be token ids (integers as strings), got "
                               f"{list(req.logit_bias)[:4]!r:.80}", param="logit_bias") from None
    if req.allowed_token_ids is not None:
        kw["allowed_token_ids"] = req.allowed_token_ids
    so, guided, field = formats.structured(req)
    if field is not None:
        kw.update(structured_outputs=so, guided_decoding=guided)
    if logprobs is not None:
        kw["logprobs"] = logprobs
    if prompt_logprobs is not None:
        kw["prompt_logprobs"] = prompt_logprobs
    if kw.get("n") == 1 or req.use_beam_search:           # (beam search: n is the beam width, beam.py)
        kw.pop("n", None)
    missing = [k for k in (*_PENALTIES, "n", "logprobs", "prompt_logprobs") if k in kw and k not in _FIELDS]
    if missing:
        raise RequestError(f"{missing[0]} is not supported by this engine build", param=missing[0])
    try:
        return SamplingParams(max_tokens=max_tokens, **kw)
    except (ValueError, TypeError) as e:       # (structured outputs: named as the request gave them)
        message = str(e).replace("SamplingParams.", "")
        param = message.split("=")[0].split(".")[-1]
        if field is not None and (name := param.split()[0]) in ("structured_outputs", "guided_decoding"):
            head = f"{name}={kw.get(name)!r:.100} "     # (another field's internal form: not what the client sent)
            cut = field != name and message.startswith(head)
            message = f"{field}: {message[len(head):]}" if cut else message.replace(name, field, 1)
            param = field
        raise RequestError(message, param=param) from None


_FIELDS = set(SamplingParams.__dataclass_fields__)


def check_request(ids: list[int], params: SamplingParams, limits: dict, param: str = "prompt",
                  tokenizer=None, structured: str | None = None, wait: bool = True) -> None:
    """The engine's own request check (LLMEngine.check_request), against the limits the core reported, so
    that a bad prompt is a 400 before any streaming starts (bad_words and structured choices: read with
    `tokenizer`, as the core does; `structured`: the request field its structured outputs came from, which errors
    name; wait False: a json / regex index is left building, formats.index_built awaits it). The core checks again,
    authoritatively."""
    V, bs, nb = limits["vocab_size"], limits["block_size"], limits["num_blocks"]
    if bad := [t for t in ids if not 0 <= t < V]:
        raise RequestError(f"the prompt has token id {bad[0]!r} out of vocabulary: ids are in [0, {V})", param=param)
    def error(message):
        first = message.split()[0].split("=")[0]
        if first == "logprobs" and param == "messages":        # (a chat request's field for it)
            first, message = "top_logprobs", "top_" + message
        return RequestError(message, param=structured if structured and first == "structured_outputs" else first)
    params.check_vocab(V, error, eos=limits.get("eos", ((),))[0], tokenizer=tokenizer, wait=wait,
                       max_logprobs=limits.get("max_logprobs", 20))
    need = -(-min(len(ids) + params.max_tokens - 1, limits["max_model_len"]) // bs)     # (the last token: no KV)
    if need > nb:
        raise RequestError(f"the request needs {need} KV blocks for {len(ids)} prompt + {params.max_tokens} output "
                           f"tokens but the pool has only {nb}", param=param)


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    p = req.prompt
    prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
    if not prompts or any(not x for x in prompts):
        raise RequestError("prompt must be a non-empty string, a list of token ids, or a list of those",
                           param="prompt")
    return prompts


def engine_prompt_logprobs(req: _Request, vocab_size: int, echo_k: int | None = None) -> int | None:
    """The prompt logprobs the engine computes: vLLM's prompt_logprobs (-1: the vocabulary, `vocab_size` from
    here on), and a completion's echo with logprobs."""
    if req.prompt_logprobs == -1:
        req.prompt_logprobs = vocab_size
    asked = [k for k in (req.prompt_logprobs, echo_k) if k is not None]
    return max(asked) if asked else None


def chat_top_logprobs(req: ChatCompletionRequest, vocab_size: int) -> int | None:
    """A chat request's logprobs: None (not asked), else how many alternatives per token (-1: `vocab_size`)."""
    if req.top_logprobs == -1:                     # (vLLM's "all of them"; the bound: the core's max_logprobs)
        req.top_logprobs = vocab_size
    if req.top_logprobs and not req.logprobs:
        raise RequestError("top_logprobs needs logprobs=true", param="top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def include_usage(req: _Request) -> bool:        # a last chunk with the usage
    return bool(req.stream_options and req.stream_options.include_usage)


def continuous_usage(req: _Request) -> bool:     # each chunk with its choice's usage so far (needs include_usage)
    return include_usage(req) and bool(req.stream_options.continuous_usage_stats)
