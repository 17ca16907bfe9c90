"""Tokenizers: the checkpoint's own (transformers AutoTokenizer), or a byte-level stand-in for presets."""
from __future__ import annotations

import datetime
import os


class ByteTokenizer:
    """For random-weight presets, which ship no tokenizer: UTF-8 bytes are ids 0..255; any other id is
    shown as `<id>` (random weights produce ids from the whole vocabulary)."""
    eos_token_id = None
    chat_template = None
    byte_level = True                 # one UTF-8 byte a token (server/tokens.py: prompt_char_limit)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out, raw = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                raw.append(i)
                continue
            out.append(raw.decode("utf-8", errors="replace"))
            raw = bytearray()
            out.append(f"<{i}>")
        out.append(raw.decode("utf-8", errors="replace"))
        return "".join(out)

    def convert_ids_to_tokens(self, ids) -> list[str]:
        """The vocabulary's strings: a printable ASCII byte as itself, other bytes `<0xNN>`, other ids `<id>`."""
        return [chr(i) if 32 <= i < 127 else f"<0x{i:02X}>" if 0 <= i < 256 else f"<{i}>" for i in ids]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, continue_final_message=False,
                            chat_template=None, **kwargs):
        """ChatML; a `chat_template` given (or set as `.chat_template`, e.g. by the server's --chat-template) is
        rendered as transformers renders one (a Jinja sandbox, `raise_exception`; extra kwargs go to it)."""
        template = chat_template or self.chat_template
        if template is not None:
            text = render_template(template, messages, add_generation_prompt=add_generation_prompt, **kwargs)
            if continue_final_message:                 # transformers': cut after the last message's own text
                last = messages[-1]["content"]
                last = last if isinstance(last, str) else "".join(p.get("text") or "" for p in last)
                if last.strip() not in text:
                    raise ValueError("continue_final_message: the final message's text is not in the rendered chat")
                text = text[:text.rindex(last.strip()) + len(last.strip())]
            return self.encode(text) if tokenize else text
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        if continue_final_message:                     # the last message stays open
            text = text[:-len("<|im_end|>\n")]
        text += "<|im_start|>assistant\n" if add_generation_prompt else ""
        return self.encode(text) if tokenize else text


class NoTokenizer:
    """vLLM's skip_tokenizer_init=True: no tokenizer. Prompts are token ids; outputs carry their token ids and empty
    text (as vLLM's); what needs text (a text prompt, chat, stop strings, bad_words, structured outputs) is a
    ValueError saying so, and so is `LLM.get_tokenizer()` (vLLM's)."""
    eos_token_id = None
    chat_template = None
    skipped = True

    def __init__(self, why: str = "skip_tokenizer_init=True"):
        self.why = why             # what the error messages blame: the option, or a folder without tokenizer files

    def encode(self, text: str, **kwargs) -> list[int]:
        raise ValueError(needs_tokenizer("a text prompt", self.why))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return ["" for _ in ids]

    def apply_chat_template(self, *args, **kwargs):
        raise ValueError(needs_tokenizer("chat", self.why))


def needs_tokenizer(what: str, why: str = "skip_tokenizer_init=True") -> str:
    return f"{what} needs a tokenizer, and this LLM has none ({why}): give prompts as token ids"


def check_text_fields(tokenizer, params, error=ValueError) -> None:
    """With no tokenizer (NoTokenizer), a request's fields that need text are refused by name."""
    if getattr(tokenizer, "skipped", False):
        for name in ("stop", "bad_words", "structured_outputs"):
            if getattr(params, name, None):
                raise error(needs_tokenizer(f"{name}={getattr(params, name)!r:.60}", getattr(tokenizer, "why",
                                                                                          "skip_tokenizer_init=True")))


def usable(tokenizer):
    """`LLM.get_tokenizer()`'s answer: the tokenizer, or vLLM's ValueError when there is none."""
    if getattr(tokenizer, "skipped", False):
        raise ValueError("Unable to get tokenizer because skip_tokenizer_init is True")
    return tokenizer


def render_template(template: str, messages, **kwargs) -> str:
    """A chat template rendered as transformers does (sandboxed Jinja, trim_blocks / lstrip_blocks, loop
    controls, `raise_exception`)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    kwargs = {"tools": None, "documents": None, **kwargs}      # (transformers passes both, None when absent)
    out = []                 # as transformers 5 normalises them: keys whose value is None dropped, and a message's
    for m in messages:       # reasoning under any of its names given as reasoning_content (and thinking) too
        m = {k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m
        r = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if k in m), None) \
            if isinstance(m, dict) else None
        out.append(m if r is None else {"thinking": r, **m, "reasoning_content": r})
    return env.from_string(template).render(messages=out, **kwargs)


def has_tokenizer_files(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json"))


def check_text_tokenizer(path: str) -> None:
    """For commands that print text: a checkpoint folder without tokenizer files is a ValueError naming --tokenizer
    (LLM() would run without one, on token ids only)."""
    if os.path.isdir(path) and not has_tokenizer_files(path):
        raise ValueError(f"no tokenizer files (tokenizer.json / tokenizer_config.json) in {path!r}: give --tokenizer "
                         f"FOLDER")


def load_tokenizer(path: "str | NoTokenizer | None", missing_ok: bool = False):
    """The tokenizer in folder `path` (None: the presets' ByteTokenizer; a NoTokenizer: itself). A folder without
    tokenizer files is a FileNotFoundError, or with `missing_ok` (LLM()) a NoTokenizer and a warning saying so."""
    if path is None or isinstance(path, NoTokenizer):
        return path or ByteTokenizer()
    if not has_tokenizer_files(path):
        if missing_ok:
            import warnings
            warnings.warn(f"no tokenizer files in {path!r}: running without a tokenizer, as vLLM's "
                          f"skip_tokenizer_init=True (token-id prompts, outputs without text); give tokenizer=FOLDER "
                          f"for text", stacklevel=3)
            return NoTokenizer(f"no tokenizer files in {path!r}; give tokenizer=FOLDER for text")
        raise FileNotFoundError(f"no tokenizer files (tokenizer.json / tokenizer_config.json) in {path!r}: give "
                                f"tokenizer=FOLDER (--tokenizer FOLDER); LLM() runs without one on token ids")
    cls = _direct_class(path)
    if cls is not None:
        return cls.from_pretrained(path)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


# The classes AutoTokenizer resolves Qwen3's `tokenizer_class` names to in transformers >= 5, where every fast
# tokenizer derives from TokenizersBackend. Importing one of them directly gives the same object without
# AutoTokenizer's import of the configuration machinery, which imports torch (~3 s at every `LLM()`, CLI and server
# start). Other names, and transformers 4 (whose Qwen2Tokenizer is the slow Python one), go through AutoTokenizer.
_DIRECT = {"Qwen2Tokenizer": ("transformers.models.qwen2.tokenization_qwen2", "Qwen2Tokenizer"),
           "Qwen2TokenizerFast": ("transformers.models.qwen2.tokenization_qwen2", "Qwen2Tokenizer"),
           "PreTrainedTokenizerFast": ("transformers", "PreTrainedTokenizerFast"),
           "TokenizersBackend": ("transformers", "PreTrainedTokenizerFast")}


def _direct_class(path: str):
    """The tokenizer class AutoTokenizer would pick for `path`, when it can be imported without torch; else None."""
    import importlib
    import importlib.metadata
    import json
    try:
        if int(importlib.metadata.version("transformers").split(".")[0]) < 5:
            return None
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError, importlib.metadata.PackageNotFoundError):
        return None
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    if name not in _DIRECT or not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return None
    module, attr = _DIRECT[name]
    try:
        return getattr(importlib.import_module(module), attr, None)
    except ImportError:          # a transformers that lays its modules out otherwise: AutoTokenizer decides
        return None
