"""The sampling defaults a checkpoint recommends, as vLLM applies them (its `generation_config="auto"`).

A checkpoint's generation_config.json may carry temperature, top_p, top_k, min_p, repetition_penalty and
max_new_tokens (Qwen3's: temperature 0.6, top_p 0.95, top_k 20). vLLM makes those the defaults of a request
that does not set them: `LLM.generate` without sampling params uses `LLM.get_default_sampling_params()`, and the
server fills the fields a request leaves out. Values equal to Hugging Face's own defaults are not overrides
(vLLM reads the file's difference from them). `generation_config="vllm"` keeps the plain SamplingParams
defaults; a folder reads that folder's generation_config.json instead of the model's.
"""
from __future__ import annotations

import json
import os

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def check(generation_config) -> None:
    """ValueError unless the value is "auto", "vllm" or an existing folder."""
    g = generation_config
    if not isinstance(g, str) or g not in ("auto", "vllm") and not os.path.isdir(g):
        raise ValueError(f"generation_config={g!r} must be 'auto', 'vllm' or a folder")


def sampling_defaults(model_dir: str | None, generation_config: str = "auto") -> dict:
    """SamplingParams keyword defaults (max_new_tokens as max_tokens) from `generation_config`: "auto" (the
    model folder's file, if any), "vllm" (none: {}), or a folder holding a generation_config.json."""
    check(generation_config)
    if generation_config == "vllm":
        return {}
    folder = model_dir if generation_config == "auto" else generation_config
    path = os.path.join(folder, "generation_config.json") if folder and os.path.isdir(folder) else None
    if path is None or not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path!r} is not valid JSON: {e}") from None
    out = {k: d[k] for k in FIELDS if d.get(k) is not None and d[k] != HF_DEFAULTS.get(k)}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    return out
