"""Tokenizers: the checkpoint's own (transformers AutoTokenizer), or a byte-level stand-in for presets."""
from __future__ import annotations

import os


class ByteTokenizer:
    """For random-weight presets, which ship no tokenizer: UTF-8 bytes are ids 0..255; any other id is
    shown as `<id>` (random weights produce ids from the whole vocabulary)."""
    eos_token_id = None
    chat_template = None

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

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, continue_final_message=False,
                            **kwargs):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        if continue_final_message:                     # the last message stays open
            text = text[:-len("<|im_end|>\n")]
        text += "<|im_start|>assistant\n" if add_generation_prompt else ""
        return self.encode(text) if tokenize else text


def load_tokenizer(path: str | None):
    if path is None:
        return ByteTokenizer()
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json",
                                                                  "vocab.json")):
        raise FileNotFoundError(f"no tokenizer files (tokenizer.json / tokenizer_config.json) in {path!r}")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)
