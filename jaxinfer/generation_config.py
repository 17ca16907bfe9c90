"""The sampling defaults a checkpoint recommends, as vLLM applies them (its `generation_config="auto"`).

A checkpoint's generation_config.json may carry temperature, top_p, top_k, min_p, repetition_penalty and
max_new_tokens (Qwen3's: temperature 0.6, top_p 0.95, top_k 20). vLLM makes those the defaults of a request
that does not set them: `LLM.generate` without sampling params uses `LLM.get_default_sampling_params()`, and the
server fills the fields a request leaves out. Values equal to the installed transformers' own GenerationConfig
defaults are not overrides (vLLM reads the file's `to_diff_dict()`; transformers 5 has no such defaults, 4.x had
top_k 50, top_p 1, ...). `generation_config="vllm"` keeps the plain SamplingParams defaults; a folder reads that
folder's generation_config.json instead of the model's. `override_generation_config` (vLLM's engine argument) is
merged over the file's values ("auto" or a folder), or is the whole of them ("vllm").
"""
from __future__ import annotations

import os

from jaxinfer.config import read_json

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def hf_defaults() -> dict:
    """The installed transformers' GenerationConfig defaults of FIELDS (None where it has none)."""
    from transformers import GenerationConfig
    g = GenerationConfig()
    return {k: getattr(g, k, None) for k in FIELDS}


def check(generation_config) -> None:
    """ValueError unless the value is "auto", "vllm" or an existing folder."""
    g = generation_config
    if not isinstance(g, str) or g not in ("auto", "vllm") and not os.path.isdir(g):
        raise ValueError(f"generation_config={g!r} must be 'auto', 'vllm' or a folder")


def sampling_defaults(model_dir: str | None, generation_config: str = "auto", override: dict | None = None) -> dict:
    """SamplingParams keyword defaults (max_new_tokens as max_tokens) from `generation_config`: "auto" (the
    model folder's file, if any), "vllm" (none: {}), or a folder holding a generation_config.json; `override`
    (FIELDS' names) merged over them."""
    check(generation_config)
    if override is not None and (not isinstance(override, dict) or set(override) - set(FIELDS)):
        raise ValueError(f"override_generation_config={override!r:.120} must be a dict of {FIELDS}")
    folder = model_dir if generation_config == "auto" else generation_config
    path = os.path.join(folder, "generation_config.json") if folder and os.path.isdir(folder) else None
    out = {}
    if generation_config != "vllm" and path is not None and os.path.isfile(path):
        d, base = read_json(path), hf_defaults()
        out = {k: d[k] for k in FIELDS if d.get(k) is not None and d[k] != base[k]}
    out.update(override or {})
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    from jaxinfer.sampling_params import SamplingParams
    for where, values in (("override_generation_config", override or {}), (repr(path), out)):
        try:                            # bad values fail here, not in every request that leaves them out
            SamplingParams(**{"max_tokens" if k == "max_new_tokens" else k: v for k, v in values.items()})
        except (ValueError, TypeError) as e:
            raise ValueError(f"{where}: {e}") from None
    return out


def max_tokens_cap(generation_config, override: dict | None, defaults: dict) -> int | None:
    """The server's ceiling on any request's max_tokens (current vLLM's `override_max_tokens`): a folder's
    max_new_tokens (over which `override` is merged: `defaults`), else `override`'s; the model's own file
    ("auto") only fills in a request that leaves max_tokens out."""
    if generation_config not in ("auto", "vllm"):
        return defaults.get("max_tokens")
    return (override or {}).get("max_new_tokens")


def folder_eos_ids(generation_config) -> tuple[int, ...]:
    """The eos_token_id (an id or a list) of a folder's generation_config.json: as vLLM, they end generation too
    (reported as stop_reason). () for "auto" (the model folder's file is read with its config) and "vllm"."""
    path = os.path.join(generation_config, "generation_config.json") if generation_config not in ("auto", "vllm") \
        else None
    if path is None or not os.path.isfile(path):
        return ()
    ids = read_json(path).get("eos_token_id")
    ids = [] if ids is None else ids if isinstance(ids, list) else [ids]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{path!r}: eos_token_id={ids!r} must be token ids (integers >= 0)")
    return tuple(ids)

