"""The demo model's corpus and tokenizer (scripts/train_demo.py steps 1-3): Python's own documentation, split by a
seeded hash, and a byte-level BPE with Qwen3's pre-tokenizer and special tokens."""
from __future__ import annotations

import ast
import hashlib
import os
import sys
import sysconfig

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Qwen3's added tokens, in Qwen3's order; the last six are not "special" there (they stay in decoded text).
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
           "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
           "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
NON_SPECIAL = ["<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
               "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
# Qwen2/3's pre-tokenizer split (digits one by one, words with their leading space).
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")
from scripts.make_tiny_model import CHAT_TEMPLATE  # noqa: E402  (Qwen3's ChatML template, shared)
QUESTIONS = ["What does {} do?", "Explain {}.", "Tell me about {}.", "How do I use {}?"]
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


# -- 1. corpus ----------------------------------------------------------------------------------------------
def _stdlib_docstrings(max_files: int | None = None) -> list[tuple[str, str]]:
    """(qualified name with signature, docstring) for every module, class and function docstring."""
    root = sysconfig.get_paths()["stdlib"]
    out, files = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("config-"))
        for fn in sorted(f for f in filenames if f.endswith(".py")):
            path = os.path.join(dirpath, fn)
            module = os.path.relpath(path, root)[:-3].replace(os.sep, ".").removesuffix(".__init__")
            try:
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue   # a few files are deliberately broken or not UTF-8
            out.extend(_walk(tree, module))
            files += 1
            if files == max_files:
                return out
    return out


def _walk(node, prefix: str):
    doc = ast.get_docstring(node, clean=True)
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        head = f"{prefix}({ast.unparse(node.args)})"
    else:
        head = f"class {prefix}" if isinstance(node, ast.ClassDef) else f"module {prefix}"
    if doc and len(doc) >= 20:
        yield head, doc
    for child in node.body:
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield from _walk(child, f"{prefix}.{child.name}")


def _hash01(seed: int, text: str) -> float:
    return int.from_bytes(hashlib.sha256(f"{seed}:{text}".encode()).digest()[:8], "big") / 2**64


def build_corpus(seed: int, max_files: int | None = None) -> dict[str, list[str]]:
    """{"train", "valid", "heldout"} -> documents (text without the end-of-text token)."""
    import pydoc_data.topics
    docs, seen = [], set()
    for key in sorted(pydoc_data.topics.topics):
        docs.append((key, pydoc_data.topics.topics[key].strip()))
    for head, doc in _stdlib_docstrings(max_files):
        docs.append((head, f"{head}\n\n{doc}"))
    splits = {"train": [], "valid": [], "heldout": []}
    for key, text in docs:
        if text in seen:
            continue
        seen.add(text)
        u = _hash01(seed, text)
        split = "heldout" if u < 0.02 else "valid" if u < 0.04 else "train"
        if not key.startswith(("module ", "class ")) and "(" not in key:
            splits[split].append(text)                      # a pydoc topic page
            continue
        if _hash01(seed + 1, text) < 0.25:                  # a chat exchange about this docstring
            name = key.split("(")[0].removeprefix("class ").removeprefix("module ")
            q = QUESTIONS[int(_hash01(seed + 2, text) * len(QUESTIONS))].format(name)
            think = "<think>\n\n</think>\n\n" if _hash01(seed + 3, text) < 0.5 else ""
            doc = text.split("\n\n", 1)[1]
            text = f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{think}{doc}<|im_end|>\n"
        splits[split].append(text)
    return splits


# -- 2. tokenizer -------------------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int):
    """A transformers fast tokenizer: byte-level BPE of vocab_size ids, the added tokens after them."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    n_bpe = vocab_size - len(SPECIAL) - len(NON_SPECIAL)
    trainer = trainers.BpeTrainer(vocab_size=n_bpe, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"additional_special_tokens": SPECIAL})
    fast.add_tokens(NON_SPECIAL)
    fast.eos_token, fast.pad_token = "<|im_end|>", "<|endoftext|>"
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 131072
    return fast


def token_stream(tokenizer, docs: list[str]) -> np.ndarray:
    """Each document's ids followed by <|endoftext|>: int32 [N]."""
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids = tokenizer(docs, add_special_tokens=False)["input_ids"]
    return np.fromiter((t for d in ids for t in (*d, eot)), np.int32)
