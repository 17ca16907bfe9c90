"""Files shipped inside the package: the small trained demo model (see scripts/train_demo.py).

`demo_model_path()` is the checkpoint directory `jaxinfer generate`, `chat` and `serve` use when no model is
named: a ~7M-parameter Qwen3 trained on Python's own English documentation (pydoc topics and standard-library
docstrings), with its byte-level BPE tokenizer (Qwen3's special tokens, a ChatML chat template). It loads with
jaxinfer and with transformers' Qwen3ForCausalLM. heldout.txt in that directory holds documents it never saw
in training, for perplexity checks; training.json is its training log.
"""
from __future__ import annotations

import os

DEMO_MODEL = "qwen3-pydoc"


def demo_model_path() -> str:
    """Absolute path of the shipped demo checkpoint directory (config.json, model.safetensors, tokenizer)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), DEMO_MODEL)
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        raise FileNotFoundError(f"the demo model is missing from {path!r}: the package was installed without its "
                                f"data files; reinstall it, or make it with scripts/train_demo.py --out {path}")
    return path
