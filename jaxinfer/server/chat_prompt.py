"""Chat requests into prompts: the messages as the template takes them, the template's keyword arguments (the
request's fields over chat_template_kwargs, as current vLLM), the rendered prompt and the answer's role and echo."""
from __future__ import annotations

from jaxinfer.prompts import joined_text, render_chat
from jaxinfer.server.protocol import ChatCompletionRequest, ChatMessage, RequestError


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """[{"role", "content", "name"?}] as LLM.chat takes them (parts stay parts: render_chat's content format); an
    assistant's `reasoning` (vLLM's; or `reasoning_content`) goes to the template as both, its `tool_calls` as they
    are (render_chat parses their arguments), a tool result's `tool_call_id` too; other fields are refused unless
    empty."""
    out = []
    for i, m in enumerate(messages):
        extra = {k: v for k, v in (m.model_extra or {}).items() if v is not None and v != []}
        both = [extra.pop(k, None) for k in ("reasoning", "reasoning_content")] if m.role == "assistant" else []
        think = next((t for t in both if t is not None), None)
        keep = {k: extra.pop(k) for k in ({"assistant": ("tool_calls",), "tool": ("tool_call_id",)}.get(m.role, ()))
                if k in extra}
        if extra or not isinstance(think, (str, type(None))):
            raise RequestError(f"messages[{i}].{next(iter(extra), 'reasoning')} is not supported by this server "
                               f"(or not a string)", param="messages")
        _check_calls(i, keep)
        out.append({"role": m.role, "content": [p if isinstance(p, str) else p.model_dump(exclude_none=True) for p in
                                                m.content] if isinstance(m.content, list) else m.content,
                    **({} if m.name is None else {"name": m.name}), **keep,
                    **({} if think is None else {"reasoning": think, "reasoning_content": think})})
    return out


def _check_calls(i: int, keep: dict) -> None:
    """An assistant's tool_calls: a list of {"type": "function", "function": {"name", "arguments"}} (vLLM's checks);
    a tool result's tool_call_id: a string."""
    if not isinstance(keep.get("tool_call_id", ""), str):
        raise RequestError(f"messages[{i}].tool_call_id must be a string", param="messages")
    calls = keep.get("tool_calls", [])
    for c in calls if isinstance(calls, list) else [None]:
        f = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(f, dict) and isinstance(f.get("name"), str) and c.get("type", "function") == "function"
                and isinstance(f.get("arguments", ""), (str, dict, type(None)))):
            raise RequestError(f'messages[{i}].tool_calls entries must be objects with "type": "function" and a '
                               f'"function" holding a string "name" (and "arguments"), got {c!r:.80}',
                               param="messages")


def chat_template_kwargs(req: ChatCompletionRequest, tools: list | None = None) -> dict:
    """The template's keyword arguments: the request's chat_template_kwargs, then add_generation_prompt and
    continue_final_message (and `tools`: /tokenize's) over them (current vLLM's merge); both True is a 400."""
    given = req.chat_template_kwargs or {}
    for name in ("chat_template",) + (() if tools is not None else ("tools",)):    # as the request's own fields
        if given.get(name) is not None:
            raise RequestError(f"chat_template_kwargs.{name} is not supported", param=name, code="unsupported_parameter")
    kw = {**given, "add_generation_prompt": req.add_generation_prompt,
          "continue_final_message": req.continue_final_message, **({"tools": tools} if tools else {})}
    if kw["add_generation_prompt"] and kw["continue_final_message"]:
        raise RequestError("cannot set both continue_final_message and add_generation_prompt to true",
                           param="continue_final_message")
    effort = getattr(req, "reasoning_effort", None)        # vLLM's: thinking unless "none" (enable_thinking given wins)
    return kw if effort is None else {"enable_thinking": effort != "none", **kw, "reasoning_effort": effort}


def chat_prompt(tokenizer, req: ChatCompletionRequest, tools: list | None = None,
                response_role: str = "assistant") -> tuple[str, str, str]:
    """(prompt, the answer's role, the text it starts with): with add_generation_prompt the role is
    `response_role` (--response-role), else the last message's; `echo` starts the answer with the last message's
    text if that message has the answer's role (vLLM's). `tools`: for the template (tools.resolve)."""
    messages, kw = chat_messages(req.messages), chat_template_kwargs(req)
    kw = {**kw, "tools": tools} if tools else kw
    role = response_role if kw["add_generation_prompt"] else messages[-1]["role"]
    echo = joined_text(messages[-1]["content"]) if req.echo and messages[-1]["role"] == role else ""
    if not (role + echo).encode(errors="replace").decode() == role + echo:     # (a lone surrogate the template
        raise RequestError("the last message's role or content is not valid UTF-8 (a lone surrogate), and the "
                           "answer would repeat it", param="messages")      # dropped: the answer repeats it)
    return apply_chat_template(tokenizer, messages, kw), role, echo


def apply_chat_template(tokenizer, messages: list[dict], kwargs: dict | None,
                        add_generation_prompt: bool = True) -> str:
    """The conversation as a prompt string ending with the assistant's turn (as `LLM.apply_chat_template`);
    `kwargs` (chat_template_kwargs) may override add_generation_prompt."""
    if getattr(tokenizer, "chat_template", None) is None and hasattr(tokenizer, "vocab_size"):
        raise RequestError("this model's tokenizer has no chat template; use /v1/completions", param="messages")
    try:                              # LLM.chat's rendering (prompts.render_chat)
        return render_chat(tokenizer, messages, {"add_generation_prompt": add_generation_prompt, **(kwargs or {})})
    except Exception as e:            # template errors (jinja) as well as its ValueErrors (already saying so)
        raise RequestError(f"cannot apply the chat template: {e}".replace(": cannot apply the chat template", ""),
                           param="messages") from None
