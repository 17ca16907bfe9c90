"""What the `jaxinfer` commands (cli.py) check before anything loads: vLLM's flags and the engine flags' values,
a checkpoint folder's config.json, tokenizer files and chat template. Each failure is a ValueError (or
FileNotFoundError) naming the flag or file, so a bad command ends in one line, not a "loading ..." line and then the
error."""
from __future__ import annotations

import json
import os
import re

CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")    # (transformers' files beside tokenizer_config)


def check_vllm_flags(a) -> None:
    """vLLM flags given a value (argparse dests "vllm_NAME"): checked as `LLM()` checks the same options
    (compat.py), then dropped."""
    from jaxinfer.compat import FIXED, pop_vllm_options
    kw = {k[5:]: v for k, v in vars(a).items() if k.startswith("vllm_") and k[5:] in FIXED and v is not None}
    pop_vllm_options(kw)


def check_engine_flags(kw: dict) -> None:
    """The engine options given on the command line (EngineConfig fields) as EngineConfig checks them; the error
    names the flag too, e.g. "max_model_len=0 must be a positive integer (--max-model-len)"."""
    from jaxinfer.config import EngineConfig
    try:
        EngineConfig.from_kwargs(**kw)
    except ValueError as e:
        name = re.match(r"(\w+)=", str(e))
        raise ValueError(f"{e} (--{name.group(1).replace('_', '-')})" if name else str(e)) from None


def check_model_folder(model: str, tokenizer: str | None, chat: str | None = None) -> None:
    """A checkpoint folder needs a valid config.json (a name that is no folder, preset or hub id: an error now) and
    tokenizer files (here or in --tokenizer's folder: the commands print text, the server detokenizes); `chat`
    (the command's hint) needs a chat template."""
    from jaxinfer.config import config_json, read_json
    from jaxinfer.hub import is_hub_id, resolve_model
    from jaxinfer.tokenizer import check_text_tokenizer
    if os.path.isdir(model):
        read_json(config_json(model))                     # (not valid JSON: named now, not after "loading")
    elif not is_hub_id(model):
        resolve_model(model)                              # a preset or the demo model, else its FileNotFoundError
    folder = tokenizer or model
    check_text_tokenizer(folder)
    if chat and os.path.isdir(folder) and not has_chat_template(folder):
        raise ValueError(f"the tokenizer in {folder!r} has no chat template (tokenizer_config.json 'chat_template' "
                         f"or {' / '.join(CHAT_TEMPLATE_FILES)}): {chat}")


def has_chat_template(folder: str) -> bool:
    if any(os.path.isfile(os.path.join(folder, f)) for f in CHAT_TEMPLATE_FILES):
        return True
    try:
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
            return bool(json.load(f).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return True                       # (unreadable here: the tokenizer's own load says what is wrong)
