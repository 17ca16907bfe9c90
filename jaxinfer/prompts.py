"""What `LLM.generate` / `LLM.stream` accept as prompts, in vLLM's forms: a string, a list of token ids, or a
dict ({"prompt": text} / {"prompt_token_ids": ids}); one prompt or a list of them."""
from __future__ import annotations

Prompt = str | list[int] | dict     # dict: vLLM's {"prompt": str} or {"prompt_token_ids": [int]}


def as_list(prompts) -> list:
    """One prompt (a string, a dict, or a list of ints) or a list of prompts -> a list of prompts."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                            and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def token_ids(tokenizer, prompt: Prompt, i: int) -> list[int]:
    """The prompt's token ids (text is encoded without special tokens). Raises ValueError naming prompt i."""
    if isinstance(prompt, dict):       # vLLM's TextPrompt / TokensPrompt
        if set(prompt) == {"prompt_token_ids"} and isinstance(prompt["prompt_token_ids"], (list, tuple)):
            return list(prompt["prompt_token_ids"])
        if set(prompt) == {"prompt"} and isinstance(prompt["prompt"], str):
            return token_ids(tokenizer, prompt["prompt"], i)
        raise ValueError(f"prompt {i}: a dict prompt holds exactly one of 'prompt' (a string) or "
                         f"'prompt_token_ids' (a list of ints), got keys {sorted(prompt)}")
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    if isinstance(prompt, (list, tuple)):
        return list(prompt)
    raise ValueError(f"prompt {i} must be a string, a list of token ids or a dict, got {type(prompt).__name__}")


def text(prompt: Prompt) -> str | None:
    """The prompt's text, for RequestOutput.prompt (None when it was given as token ids)."""
    if isinstance(prompt, dict):
        return prompt.get("prompt")
    return prompt if isinstance(prompt, str) else None
