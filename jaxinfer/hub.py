"""Model ids: a local checkpoint directory, the shipped demo model, an embedded preset (random weights), or a
Hugging Face hub id.

    resolve_model("/ckpt/Qwen3-0.6B")  -> "/ckpt/Qwen3-0.6B"        (a directory)
    resolve_model("qwen3-pydoc")       -> ".../jaxinfer/assets/qwen3-pydoc"   (the demo model in the package)
    resolve_model("qwen3-0.6b")        -> "qwen3-0.6b"              (a preset: random weights, no files)
    resolve_model("Qwen/Qwen3-0.6B")   -> ".../snapshots/<rev>"     (hub id: local cache, else download)

A hub id ("owner/name") is looked up in the local Hugging Face cache first; if it is not there and we are
online it is downloaded with `huggingface_hub.snapshot_download` (only config, tokenizer and safetensors
files). Offline (HF_HUB_OFFLINE=1, or no network) and not cached is a FileNotFoundError that says how to
get the files.
"""
from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

from jaxinfer.assets import DEMO_MODEL, demo_model_path
from jaxinfer.model.presets import PRESETS, is_preset

if TYPE_CHECKING:
    from jaxinfer.config import ModelConfig

# What a checkpoint needs: config, tokenizer, weights (never *.bin / *.pth / optimizer state).
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def is_hub_id(model: str) -> bool:
    return bool(_HUB_ID.match(model)) and not model.startswith((".", "/", "~"))


def resolve_model(model: str, revision: str | None = None, cache_dir: str | None = None, token=None) -> str:
    """A directory path or a preset name for `model`; see the module docstring. Raises FileNotFoundError.
    `cache_dir` overrides the Hugging Face cache (default: HF_HUB_CACHE / ~/.cache/huggingface/hub); `token`:
    the hub token for a download (vLLM's hf_token: a string, or True for the one `hf auth login` saved)."""
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a non-empty string (a directory, preset or hub id), got {model!r}")
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        return path
    if "/" not in model and is_preset(model):
        return model
    if model == DEMO_MODEL:
        return demo_model_path()
    if not is_hub_id(model):
        raise FileNotFoundError(
            f"model {model!r} is not a directory, the demo model ({DEMO_MODEL!r}), an embedded preset "
            f"({', '.join(PRESETS)}) or a Hugging Face hub id (owner/name)")
    return _snapshot(model, revision, cache_dir, token)


def _snapshot(repo_id: str, revision: str | None, cache_dir: str | None, token=None) -> str:
    import huggingface_hub

    kw = dict(repo_id=repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=ALLOW_PATTERNS, token=token)
    try:  # the cache first: no network round trip when the files are already here
        return huggingface_hub.snapshot_download(local_files_only=True, **kw)
    except Exception:
        pass
    if _offline():
        raise FileNotFoundError(_how_to_get(repo_id, "offline mode (HF_HUB_OFFLINE) is on and it is not in the "
                                                     "local Hugging Face cache")) from None
    try:
        return huggingface_hub.snapshot_download(**kw)
    except Exception as e:  # no network, unknown repo, gated repo, ...: all end the same way
        raise FileNotFoundError(_how_to_get(repo_id, f"downloading it failed ({type(e).__name__}: "
                                                     f"{str(e).splitlines()[0][:200]})")) from None


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _how_to_get(repo_id: str, why: str) -> str:
    preset_hint = ""
    if is_preset(repo_id):
        preset_hint = f", or use the embedded preset {repo_id.split('/')[-1].lower()!r} (random weights)"
    return (f"cannot load hub model {repo_id!r}: {why}. Get the files on a machine with network access with "
            f"`huggingface-cli download {repo_id}` (or `hf download {repo_id}`) and copy the Hugging Face cache "
            f"(~/.cache/huggingface/hub), or pass a local checkpoint directory{preset_hint}")


def model_config_for(model: str, hf_overrides: dict | None = None, revision: str | None = None,
                     download_dir: str | None = None, hf_token=None) -> tuple[str, "ModelConfig"]:
    """(resolved path or preset name, ModelConfig) of a checkpoint directory, an embedded preset (random
    weights) or a Hugging Face hub id. Reads config.json only. vLLM's options: `hf_overrides`, config.json fields
    that replace the checkpoint's (a preset's own fields are written as its config.json first), or a function of
    the transformers config (`overrides_of`); `revision` and
    `download_dir` (the Hugging Face cache to use) and `hf_token` (str or bool), for hub ids."""
    from jaxinfer.config import ModelConfig
    from jaxinfer.model.presets import preset
    if hf_overrides is not None and not isinstance(hf_overrides, dict) and not callable(hf_overrides):
        raise ValueError(f"hf_overrides={hf_overrides!r:.80} must be a dict of config.json fields or a function "
                         "of the transformers config (vLLM's two forms)")
    for name, v in (("revision", revision), ("download_dir", download_dir), ("hf_token", hf_token)):
        if v is not None and not (isinstance(v, str) and v) and not (name == "hf_token" and isinstance(v, bool)):
            raise ValueError(f"{name}={'***' if name == 'hf_token' else repr(v)[:80]} must be a non-empty string"
                             + (" or a bool" if name == "hf_token" else ""))
    model = resolve_model(model, revision, os.path.expanduser(download_dir) if download_dir else None, hf_token)
    if callable(hf_overrides) and (os.path.isdir(model) or is_preset(model)):
        hf_overrides = overrides_of(hf_overrides, model)
    if os.path.isdir(model):
        return model, ModelConfig.from_pretrained(model, hf_overrides)
    if not is_preset(model):
        raise FileNotFoundError(f"model {model!r} is neither a checkpoint directory nor an embedded preset")
    if not hf_overrides:
        return model, preset(model)
    from jaxinfer.model.loader import hf_config
    from jaxinfer.model.rope import with_overrides
    try:
        return model, ModelConfig.from_dict(with_overrides(hf_config(preset(model)), hf_overrides), name=model)
    except KeyError as e:                      # a required field overridden with None
        raise ValueError(f"hf_overrides leave {model!r} without the field {e.args[0]!r}") from None


def overrides_of(fn, model: str) -> dict:
    """vLLM's callable hf_overrides as a dict: the config.json fields that `fn` changes in the model's transformers
    config (it gets a copy, and may change it in place or return another)."""
    import copy

    from transformers import AutoConfig

    from jaxinfer.config import read_json
    from jaxinfer.model.loader import hf_config
    from jaxinfer.model.presets import preset
    d = read_json(os.path.join(model, "config.json")) if os.path.isdir(model) else hf_config(preset(model))
    d = dict(d)
    before = AutoConfig.for_model(d.pop("model_type", "qwen3"), **d)
    out = fn(copy.deepcopy(before))
    if not hasattr(out, "to_dict"):
        raise ValueError(f"hf_overrides={fn!r:.80} must return the config it is given (or another), got {out!r:.80}")
    old, new = before.to_dict(), out.to_dict()
    return {k: v for k, v in new.items() if k not in old or old[k] != v}


def load_weights(model: str, config: "ModelConfig", dtype: str, seed: int = 0, placement=None, kv_scales: bool = True):
    """The params of `model` (a resolved directory or a preset: random weights) as `config` describes it.
    placement (parallel.Placement): params go to its devices, split for tensor parallelism. kv_scales: read a
    checkpoint's fp8 KV cache scales (loader.load_params)."""
    import jax.numpy as jnp

    from jaxinfer.model.loader import load_params, random_params
    if os.path.isdir(model):
        return load_params(model, config, jnp.dtype(dtype), placement, kv_scales)
    return random_params(config, jnp.dtype(dtype), seed, placement)


def load_model(model: str, dtype: str, seed: int = 0, placement=None):
    """(ModelConfig, params, tokenizer) of `model` (see `model_config_for`); presets get random weights."""
    from jaxinfer.tokenizer import load_tokenizer
    model, config = model_config_for(model)
    return config, load_weights(model, config, dtype, seed, placement), load_tokenizer(
        model if os.path.isdir(model) else None)
