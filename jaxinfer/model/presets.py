"""Embedded configs of the public Qwen3 dense models (numbers from their config.json), so a model with
random weights can be built with no files at all: `LLM("qwen3-0.6b")` or `ModelConfig` via `preset(...)`.
"""
from __future__ import annotations

from jaxinfer.config import ModelConfig

#          hidden, intermediate, layers, q heads, kv heads, tied
_SIZES = {
    "qwen3-0.6b": (1024, 3072, 28, 16, 8, True),
    "qwen3-1.7b": (2048, 6144, 28, 16, 8, True),
    "qwen3-4b": (2560, 9728, 36, 32, 8, True),
    "qwen3-8b": (4096, 12288, 36, 32, 8, False),
    "qwen3-14b": (5120, 17408, 40, 40, 8, False),
    "qwen3-32b": (5120, 25600, 64, 64, 8, False),
}
PRESETS = tuple(_SIZES)
DEFAULT_PRESET = "qwen3-0.6b"


def is_preset(name: str) -> bool:
    return str(name).lower().removeprefix("qwen/") in _SIZES


def preset(name: str) -> ModelConfig:
    """ModelConfig of a public Qwen3 size by name ('qwen3-0.6b', 'Qwen/Qwen3-8B', ...)."""
    key = str(name).lower().removeprefix("qwen/")
    if key not in _SIZES:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    hidden, inter, layers, heads, kv_heads, tied = _SIZES[key]
    return ModelConfig(vocab_size=151936, hidden_size=hidden, intermediate_size=inter,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=tied,
                       max_position_embeddings=40960, torch_dtype="bfloat16", eos_token_id=(151645, 151643),
                       name=key)
