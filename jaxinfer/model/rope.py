"""Rotary position embedding: the rope fields of a Hugging Face config.json, and the cos/sin tables.

Three kinds, as transformers computes them (modeling_rope_utils) and vLLM accepts them:
- "default": inv_freq[i] = theta^(-2i/D);
- "linear": positions divided by `factor`;
- "yarn" (Qwen3's documented way past 32k tokens: rope_scaling {"rope_type": "yarn", "factor": 4.0,
  "original_max_position_embeddings": 32768}): low frequencies interpolated by `factor`, high ones kept, a linear
  ramp between (beta_fast / beta_slow rotations over the original length), and cos/sin scaled by an attention
  factor (0.1 ln(factor) + 1 unless given).
The tables are computed once per step from the positions and passed to every layer and kernel, so a kind changes
nothing else. This module imports no JAX at import time: config.py reads the fields through it.
"""
from __future__ import annotations

import math
import warnings

import numpy as np

KINDS = ("default", "linear", "yarn")


def with_overrides(d: dict, overrides: dict | None) -> dict:
    """config.json's fields `d` with vLLM's `hf_overrides` replacing them. A rope_theta given there also replaces
    the one inside rope_parameters (transformers 5 keeps it there, and rope_fields reads it there first), so that
    the override is not silently shadowed."""
    d = {**d, **(overrides or {})}
    if "torch_dtype" in (overrides or {}) and "dtype" not in overrides:     # (transformers' old name of dtype,
        d["dtype"] = overrides["torch_dtype"]                             # which a newer config.json holds)
    if "rope_theta" in (overrides or {}) and isinstance(d.get("rope_parameters"), dict):
        d["rope_parameters"] = {**d["rope_parameters"], "rope_theta": overrides["rope_theta"]}
    return d


def number(d: dict, key: str, default, cast=float):
    """d[key] as `cast` (float or int), `default` when absent or None: a ValueError naming the field otherwise."""
    v = d.get(key)
    v = default if v is None else v
    if not isinstance(v, (int, float)) or isinstance(v, bool) or (cast is int and not float(v).is_integer()):
        raise ValueError(f"{key}={v!r:.80} must be {'an integer' if cast is int else 'a number'}")
    return cast(v)


def flag(d: dict, key: str, default: bool) -> bool:
    """d[key] as a bool (JSON true / false), `default` when absent or None: "false" is not taken for true."""
    v = d.get(key)
    if v is not None and not isinstance(v, bool):
        raise ValueError(f"{key}={v!r:.80} must be true or false")
    return default if v is None else v


def rope_fields(d: dict) -> dict:
    """ModelConfig's rope fields (rope_theta, rope_scaling_factor, rope_yarn) from a config.json dict:
    transformers < 5 writes rope_theta / rope_scaling, >= 5 rope_parameters; as in transformers 5, a rope_scaling
    given (say, added by hand as Qwen3's card says) wins over rope_parameters. YaRN's fields and defaults are
    transformers' (_compute_yarn_parameters); rope_yarn = (original_max_position_embeddings, beta_fast, beta_slow,
    attention_factor, truncate), () for the other kinds."""
    rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"rope_scaling / rope_parameters={rope!r:.80} must be a dict (rope_type, factor, ...)")
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind not in KINDS:
        raise ValueError(f"rope scaling type {kind!r} is not supported (only 'default', 'linear' and 'yarn')")
    theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 0:
        raise ValueError(f"rope_theta={theta!r:.80} must be a number > 0")
    theta = float(theta)
    params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    if rope is not params and params.get("rope_theta", theta) != theta:
        # as transformers 5 does (and so vLLM): a rope_scaling without rope_theta, on a checkpoint that keeps its
        # theta only inside rope_parameters, falls back to 10000. Kept for parity, but said
        warnings.warn(f"rope_scaling {rope!r:.120} has no rope_theta, so rope_theta is {theta!r} (as in "
                      f"transformers), not the checkpoint's {params['rope_theta']!r:.40} from rope_parameters; add "
                      f'"rope_theta": {params["rope_theta"]!r:.40} to rope_scaling to keep it', stacklevel=2)
    if kind != "yarn":
        return dict(rope_theta=theta, rope_scaling_factor=number(rope, "factor", None) if kind == "linear" else 1.0)
    longest = d["max_position_embeddings"]          # (ModelConfig.from_dict fills Qwen3Config's default)
    # a top-level original_max_position_embeddings wins, as in transformers (standardize_rope_params)
    orig = d.get("original_max_position_embeddings", rope.get("original_max_position_embeddings", longest))
    if not isinstance(orig, (int, float)) or isinstance(orig, bool) or not float(orig).is_integer() or orig < 1:
        raise ValueError(f"original_max_position_embeddings={orig!r} must be a positive integer")
    orig = int(orig)                                # (64.0 in a config.json is 64, as transformers reads it)
    factor = rope.get("factor")
    factor = longest / orig if factor is None else factor
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not factor > 0:
        raise ValueError(f"rope scaling factor={factor!r} must be a number > 0")
    factor = float(factor)
    mscale = lambda m: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    attention = rope.get("attention_factor")
    if attention is None:
        both = rope.get("mscale") and rope.get("mscale_all_dim")
        attention = mscale(number(rope, "mscale", 1)) / mscale(number(rope, "mscale_all_dim", 1)) if both else \
            mscale(1.0)
    # (beta 0 means the default, as transformers' `or`)
    yarn = (orig, number(rope, "beta_fast", 32) or 32.0, number(rope, "beta_slow", 1) or 1.0,
            number({"attention_factor": attention}, "attention_factor", 1.0), flag(rope, "truncate", True))
    return dict(rope_theta=theta, rope_scaling_factor=factor, rope_yarn=yarn)


def hf_rope_scaling(c) -> dict | None:
    """A ModelConfig's rope scaling as HF's `rope_scaling` dict ("linear" / "yarn"), None for plain RoPE: the inverse
    of rope_fields (ModelConfig.rope_scaling; loader.rope_parameters adds rope_theta)."""
    if c.rope_yarn:
        orig, fast, slow, attention, truncate = c.rope_yarn
        return {"rope_type": "yarn", "factor": c.rope_scaling_factor, "original_max_position_embeddings": orig,
                "beta_fast": fast, "beta_slow": slow, "attention_factor": attention, "truncate": truncate}
    return {"rope_type": "linear", "factor": c.rope_scaling_factor} if c.rope_scaling_factor != 1.0 else None


def rope_inv_freq(head_dim: int, theta: float, scaling: float = 1.0, yarn: tuple = ()) -> tuple[np.ndarray, float]:
    """(inv_freq [D/2] float32, factor cos/sin are multiplied by). Linear scaling is applied to the positions
    (rope_cos_sin), YaRN here."""
    dim = head_dim
    pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    if not yarn:
        return (np.float32(1.0) / pos_freqs).astype(np.float32), 1.0
    orig, beta_fast, beta_slow, attention, truncate = yarn
    # the dimension at which a frequency turns `rotations` times over the original length
    at = lambda rotations: dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = at(beta_fast), at(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / ((high + 0.001 if low == high else high) - low),
                   0, 1)
    keep = (1 - ramp).astype(np.float32)                            # 1: extrapolate (high frequencies kept)
    inv = (1.0 / (scaling * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv.astype(np.float32), float(attention)


def rope_cos_sin(positions, head_dim: int, theta: float, scaling: float = 1.0, yarn: tuple = ()):
    """cos/sin tables [..., D] for integer positions [...] (HF's default, linear and YaRN rope)."""
    import jax.numpy as jnp
    inv_freq, attention = rope_inv_freq(head_dim, theta, scaling, yarn)
    pos = positions.astype(jnp.float32) / (1.0 if yarn else scaling)
    freqs = pos[..., None] * jnp.asarray(inv_freq)                                 # [..., D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)                                 # [..., D]
    if attention == 1.0:
        return jnp.cos(emb), jnp.sin(emb)
    return jnp.cos(emb) * attention, jnp.sin(emb) * attention
