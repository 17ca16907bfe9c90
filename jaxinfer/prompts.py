"""What `LLM.generate` / `LLM.stream` accept as prompts, in vLLM's forms: a string, a list of token ids, or a
dict ({"prompt": text} / {"prompt_token_ids": ids}); one prompt or a list of them."""
from __future__ import annotations

import json
import re
from numbers import Integral
from typing import NotRequired, TypedDict

Prompt = str | list[int] | dict     # dict: vLLM's {"prompt": str} or {"prompt_token_ids": [int]}


class TextPrompt(TypedDict):
    """vLLM's TextPrompt: `TextPrompt(prompt="Hello")` is the dict {"prompt": "Hello"}."""
    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict, total=False):
    """vLLM's TokensPrompt: `TokensPrompt(prompt_token_ids=[1, 2])`; an optional "prompt" is only shown."""
    prompt_token_ids: list[int]
    prompt: str
    cache_salt: str


def is_token_id(x) -> bool:
    """An int, or a numpy / JAX integer scalar (a 0-d array: `list(jnp.array(ids))` gives those)."""
    return isinstance(x, Integral) or (getattr(x, "ndim", None) == 0 and getattr(x, "dtype", None) is not None
                                       and x.dtype.kind in "iu")


def as_list(prompts) -> list:
    """One prompt (a string, a dict, or a list of ints) or a list of prompts -> a list of prompts."""
    if not isinstance(prompts, (str, dict, list, tuple)) and not hasattr(prompts, "tolist"):
        raise ValueError(f"prompts must be a string, a list of token ids, a dict or a list of those, got "
                         f"{type(prompts).__name__} {prompts!r:.80}")
    prompts = prompts.tolist() if hasattr(prompts, "tolist") else prompts      # a numpy array of ids
    if not isinstance(prompts, (str, dict, list, tuple)):                       # (a numpy scalar)
        raise ValueError(f"prompts must be a string, a list of token ids, a dict or a list of those, got {prompts!r:.80}")
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                            and is_token_id(prompts[0])):
        return [prompts]
    return list(prompts)


TEXT_ONLY_KEYS = ("multi_modal_data", "mm_processor_kwargs")    # vLLM prompt keys a text model takes only empty


def cache_salt(prompt: Prompt, i: int) -> str | None:
    """vLLM's "cache_salt" of a dict prompt (None: none): requests with different salts never share prefix-cache
    blocks (engine/block_manager.py), as vLLM isolates them."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"prompt {i}: cache_salt must be a non-empty string, got {salt!r:.80}")
    return salt


def _cut(ids: list, kw: dict, tokenizer, i: int) -> list:
    """vLLM's tokenization_kwargs truncation (truncation=True or a strategy, max_length=k; without max_length the
    tokenizer's model_max_length, as Hugging Face's): k ids from the tokenizer's side."""
    if kw.get("truncation") in (None, False, "do_not_truncate"):
        return ids
    k = kw.get("max_length")
    k = getattr(tokenizer, "model_max_length", None) if k is None else k
    if k is None:
        return ids
    if not isinstance(k, Integral) or isinstance(k, bool) or k < 1:
        raise ValueError(f"prompt {i}: tokenization_kwargs truncation needs max_length an int >= 1, got {k!r:.80}")
    return ids[-int(k):] if getattr(tokenizer, "truncation_side", "right") == "left" else ids[:int(k)]


def token_ids(tokenizer, prompt: Prompt, i: int, tokenization_kwargs: dict | None = None) -> list[int]:
    """The prompt's token ids (text is encoded with the tokenizer's special tokens, e.g. a BOS, as vLLM's generate;
    LLM.chat's rendered prompts without; `tokenization_kwargs`, vLLM's, reach the tokenizer, and truncation cuts
    token prompts too). Raises ValueError naming prompt i."""
    kw = {} if tokenization_kwargs is None else tokenization_kwargs
    if not isinstance(kw, dict):
        raise ValueError(f"tokenization_kwargs must be a dict or None, got {kw!r:.80}")
    if isinstance(prompt, dict):       # vLLM's TextPrompt / TokensPrompt
        if any(prompt.get(k) for k in TEXT_ONLY_KEYS):
            raise ValueError(f"prompt {i}: {sorted(k for k in TEXT_ONLY_KEYS if prompt.get(k))} given, but Qwen3 "
                             f"models take text only")
        cache_salt(prompt, i)                                               # (checked; the engine takes it)
        prompt = {k: v for k, v in prompt.items() if k not in (*TEXT_ONLY_KEYS, "cache_salt")}
        ids = prompt.get("prompt_token_ids")
        ids = ids.tolist() if hasattr(ids, "tolist") else ids                      # (a numpy array of ids)
        if set(prompt) <= {"prompt_token_ids", "prompt"} and isinstance(ids, (list, tuple)):
            return token_ids(tokenizer, ids, i, kw)                 # (vLLM: the ids win; "prompt" is only shown)
        if set(prompt) == {"prompt"} and isinstance(prompt["prompt"], str):
            return token_ids(tokenizer, prompt["prompt"], i, kw)
        name = "prompt_token_ids" if "prompt_token_ids" in prompt else "prompt"
        got = f"keys {sorted(prompt)}" if set(prompt) - {"prompt", "prompt_token_ids"} or not prompt else \
            f"'{name}' = {prompt[name]!r:.80}"
        raise ValueError(f"prompt {i}: a dict prompt holds 'prompt' (a string) or 'prompt_token_ids' (a list of "
                         f"ints; with it, 'prompt' is only shown), got {got}")
    if isinstance(prompt, str):
        rest = {k: v for k, v in kw.items() if k not in ("truncation", "max_length")}
        try:
            return _cut(list(tokenizer.encode(prompt, **{"add_special_tokens": True, **rest})), kw, tokenizer, i)
        except (TypeError, UnicodeError) as e:        # (a lone surrogate: the tokenizer's TypeError)
            raise ValueError(f"prompt {i}: the tokenizer cannot encode {prompt!r:.80}"
                             f"{f' with tokenization_kwargs {rest}' if rest else ''} ({e})") from None
    if isinstance(prompt, (list, tuple)) or hasattr(prompt, "tolist"):
        ids = prompt.tolist() if hasattr(prompt, "tolist") else prompt
        return _cut([x.item() if is_token_id(x) and hasattr(x, "item") else x for x in ids], kw, tokenizer, i)
    raise ValueError(f"prompt {i} must be a string, a list of token ids or a dict, got {type(prompt).__name__}")


def text(prompt: Prompt) -> str | None:
    """The prompt's text, for RequestOutput.prompt (None when it was given as token ids)."""
    if isinstance(prompt, dict):
        return prompt.get("prompt")
    return prompt if isinstance(prompt, str) else None


# the part types vLLM reads as text, and the key holding it (a part whose text is None is skipped, as vLLM)
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
              "thinking": "thinking"}
SKIP = object()     # (a part with no text)


def _part_text(p) -> str | None:
    """A content part's text; SKIP for a text part with no text (None or "": vLLM keeps only non-empty ones);
    None for a part that is not text."""
    if isinstance(p, str):
        return p or SKIP
    key = TEXT_PARTS.get(p.get("type")) if isinstance(p, dict) else None
    t = p.get(key) if key else None
    return t if isinstance(t, str) and t else SKIP if key and not t else None


def joined_text(content) -> str:
    """A message's content as a string (vLLM's "string" format): text parts (dicts or pydantic models) joined by
    newlines, empty ones left out; None is ""."""
    if not isinstance(content, (list, tuple)):
        return content or ""
    parts = (_part_text(p.model_dump() if hasattr(p, "model_dump") else p) for p in content)
    return "\n".join(t for t in parts if t is not SKIP and t is not None)


def _tool_calls(j: int, m: dict) -> dict:
    """vLLM gives the template an assistant's tool-call arguments as a mapping: a JSON string is parsed, no
    arguments ("" or None) is {} (Qwen3's template prints a string as is; others iterate the mapping)."""
    calls = m.get("tool_calls")
    if isinstance(calls, (list, tuple)) and not calls:
        return {k: v for k, v in m.items() if k != "tool_calls"}      # none: left out (vLLM's)
    if m.get("role") != "assistant" or not isinstance(calls, (list, tuple)):
        return m
    out = []
    for c in calls:
        f = c.get("function") if isinstance(c, dict) else None
        if isinstance(f, dict):
            a = f.get("arguments") or {}
            if isinstance(a, str):
                try:
                    a = json.loads(a)
                except ValueError as e:
                    raise ValueError(f"message {j}: tool call arguments {a!r:.80} are not JSON ({e})") from None
            c = {**c, "function": {**f, "arguments": a}}
        out.append(c)
    return {**m, "tool_calls": out}


# a chat template that loops over a message's content parts (`{% for part in message['content'] %}`) takes them as
# a list (vLLM's "openai" content format, which its "auto" picks for such templates); others take a string
# (the loop is over the content itself, maybe filtered or sliced: not over `m['content'].split(...)`, as vLLM's check)
_LOOPS_OVER_CONTENT = re.compile(r"for\s+\w+\s+in\s+\w+(?:\[\s*['\"]content['\"]\s*\]|\.content\b)(?!\s*[.(])")


def content_format(tokenizer, chosen: str, chat_template: str | None = None) -> str:
    """"string" or "openai": `chosen` ("auto": what the template given, else the tokenizer's, iterates over)."""
    if chosen != "auto":
        return chosen
    template = chat_template or getattr(tokenizer, "chat_template", None)
    return "openai" if isinstance(template, str) and _LOOPS_OVER_CONTENT.search(template) else "string"


def _text_message(j: int, m, fmt: str = "string") -> dict:
    """A message as vLLM's LLM.chat and server give it to the template. "string" format: text parts ([{"type": "text",
    "text": ...}] or plain strings) are joined by newlines, and no content (None, missing, []: e.g. an assistant turn
    that only has `tool_calls`) is "". "openai" format: the content is a list of {"type": "text", "text": ...} parts
    (a string is one part, no content none). Other keys (tool_calls, tool_call_id, name) reach the template as given."""
    c = m.get("content") if isinstance(m, dict) else None
    parts = [_part_text(p) for p in c] if isinstance(c, (list, tuple)) else [c] if isinstance(c, str) else []
    parts = [t for t in parts if t is not SKIP]
    if isinstance(m, dict) and isinstance(c, (list, tuple)) and None in parts:
        p = c[parts.index(None)]
        raise ValueError(f"message {j}: unsupported chat content part type "
                         f"{p.get('type') if isinstance(p, dict) else type(p).__name__!r} (jaxinfer takes text parts: "
                         f"{', '.join(TEXT_PARTS)}), in {p!r:.80}")
    if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(c, (str, list, tuple, type(None)))):
        raise ValueError(f"message {j} must be a dict with a string 'role' and 'content' a string, a list of text "
                         f"parts or None, got {m!r:.80}")
    m = _tool_calls(j, m)
    if fmt == "openai" and m["role"] != "tool":           # (a tool result's parts: one string, as vLLM's)
        return {**m, "content": [{"type": "text", "text": t} for t in parts]}
    return {**m, "content": "\n".join(parts)}


def render_chat(tokenizer, messages, chat_template_kwargs: dict | None = None, **template_args) -> str:
    """One conversation ([{"role": ..., "content": ...}, ...]) rendered by the tokenizer's chat template, ending with
    the assistant's turn (LLM.apply_chat_template); bad input is a ValueError naming it. `template_args`:
    add_generation_prompt, continue_final_message, chat_template (vLLM's LLM.chat arguments), under
    chat_template_kwargs."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"a conversation must be a non-empty list of messages, got {messages!r:.80}")
    fmt = content_format(tokenizer, template_args.pop("chat_template_content_format", "auto"),
                         template_args.get("chat_template"))
    messages = [_text_message(j, m, fmt) for j, m in enumerate(messages)]
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be a dict, got {chat_template_kwargs!r}")
    if (chat_template_kwargs or {}).get("chat_template") is not None:       # (current vLLM's check; None: absent)
        raise ValueError("chat_template_kwargs must not hold 'chat_template': give it as chat_template=")
    given = template_args.get("chat_template")
    if getattr(tokenizer, "chat_template", None) is None and hasattr(tokenizer, "vocab_size") and not given:
        raise ValueError("this model's tokenizer has no chat template (tokenizer_config.json "
                         "'chat_template'); use generate() with a plain prompt")
    kw = {"add_generation_prompt": True, **(chat_template_kwargs or {}),      # (the arguments win: current vLLM)
          **{k: v for k, v in template_args.items() if v is not None}}
    if kw["add_generation_prompt"] and kw.get("continue_final_message"):
        raise ValueError("continue_final_message=True needs add_generation_prompt=False (as vLLM)")
    if not kw.get("continue_final_message", True):
        del kw["continue_final_message"]          # (the default: not passed, for templates that predate it)
    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=False, **kw)
    except ValueError:
        raise
    except Exception as e:         # the template's own errors (raise_exception, syntax, types): vLLM's ValueError
        raise ValueError(f"cannot apply the chat template: {type(e).__name__}: {e}") from None


def check_unsupported(where: str, **options) -> None:
    """vLLM's arguments jaxinfer accepts only as "not used" (None): another value is a ValueError naming it."""
    for name, v in options.items():
        if v is not None:
            raise ValueError(f"{where}: {name}={v!r:.80} is not supported by jaxinfer")


def check_priority(priority, n: int) -> None:
    """vLLM's `priority` of LLM.generate: None, or one entry per prompt, all 0 (there is no priority scheduling)."""
    if priority is None:
        return
    if not isinstance(priority, (list, tuple)) or len(priority) != n:
        raise ValueError(f"LLM.generate: priority={priority!r:.80} must be a list with one entry per prompt ({n})")
    if any(p != 0 for p in priority):
        raise ValueError(f"LLM.generate: priority={priority!r:.80} is not supported by jaxinfer (0 for every prompt)")


def chat_prompts(tokenizer, messages, chat_template_kwargs: dict | None, *, tools,
                 chat_template_content_format: str, **template_args) -> list[str]:
    """LLM.chat's prompts: one conversation or a list of them (none: no prompts), rendered (render_chat) with
    `tools` (a list of OpenAI function schemas) given to the template."""
    if tools is not None and not (isinstance(tools, (list, tuple)) and all(isinstance(t, dict) for t in tools)):
        raise ValueError(f"LLM.chat: tools={tools!r:.80} must be a list of dicts (OpenAI's function schemas)")
    if isinstance(messages, (list, tuple)) and not messages:
        return []                                  # no conversations (vLLM: no outputs)
    if chat_template_content_format not in ("auto", "string", "openai"):
        raise ValueError(f"LLM.chat: chat_template_content_format={chat_template_content_format!r} must be 'auto', "
                         f"'string' or 'openai'")
    convs = [messages] if messages and isinstance(messages, (list, tuple)) and isinstance(messages[0], dict) \
        else messages
    if not isinstance(convs, (list, tuple)) or not convs:
        raise ValueError(f"messages must be a conversation (list of dicts) or a list of them, got {messages!r:.80}")
    return [render_chat(tokenizer, c, chat_template_kwargs, tools=tools,
                        chat_template_content_format=chat_template_content_format, **template_args) for c in convs]


def truncate(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """A prompt's ids cut to its last `keep` (SamplingParams.truncate_prompt_tokens; -1: max_model_len)."""
    if keep is not None and keep > max_model_len:         # as vLLM
        raise ValueError(f"truncate_prompt_tokens={keep} is greater than max_model_len={max_model_len}: select a "
                         f"smaller truncation size")
    keep = max_model_len if keep == -1 else keep
    return ids if keep is None or len(ids) <= keep else ids[len(ids) - keep:]
