"""FP8 KV cache (`kv_cache_dtype="fp8"`): the cache dtype and the per-layer dequantisation scales.

A cache value c (float8_e4m3fn) stands for c * scale (vLLM's convention; pallas_kernels/quant.py). Scales are
per layer, one for k and one for v, kept in the params pytree as `k_scale`, `v_scale` [L, 1] float32
(replicated under tensor parallelism). They come from, in order:

1. the checkpoint, when it has them under a name vLLM reads: `model.layers.N.self_attn.k_scale` / `v_scale` (also
   under `self_attn.attn.`), ModelOpt's `k_proj.k_scale` / `v_proj.v_scale` (fused: `qkv_proj.k_scale`),
   compressed-tensors' (llm-compressor's) `k_proj.output_scale` / `v_proj.output_scale`, or the old
   `self_attn.kv_scale` for both;
2. otherwise a bound computed from the weights, which no activation can exceed (so nothing is ever clipped):
   * k: Qwen3 RMS-normalises each k head (k_norm) before RoPE. A normalised head n has sum(n^2) <= D, so after
     the weight w, |n_i w_i| <= sqrt(D) max|w|, and RoPE only rotates pairs (i, i + D/2), whose joint length
     is bounded the same way: |k| <= sqrt(D) * max|k_norm|.
   * v: v is not normalised, but the layer input is: h = n * w_ln with sum(n^2) <= E, so
     |v_j| = |sum_e n_e (w_ln,e W_ej)| <= sqrt(E) * ||w_ln * W[:, j]||_2 (Cauchy-Schwarz), max over v columns j.
   Both get a 3% margin for bf16 rounding of the activations (the cast still clips anything beyond).

Why a loose bound is safe in e4m3: it is a floating-point format, so its relative precision (3 mantissa bits,
at most 2^-4 rounding error) is the same from 448 down to 2^-6, and only values below 2^-6 of the scale fall
into subnormals (absolute error 2^-10 * scale). A bound R times the values' real maximum puts that floor at
R * 2.2e-6 of the real maximum: below the 6% normal rounding error for any R < ~28,000, and it only touches
values far too small to matter in a dot product. An int8 cache could not afford this (its step is absolute).
`scripts/fp8_accuracy.py` reports R per layer (bound / calibrated amax) and compares the two kinds of scales.

`calibrated_amax` measures the real per-layer max |k| and |v| on given tokens (full-precision forward).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import KV_CACHE_DTYPES
from pallas_kernels.quant import FP8_DTYPE, FP8_MAX, is_fp8

BOUND_MARGIN = 1.03
# the names vLLM reads a layer's scales under (weight_utils.maybe_remap_kv_scale_name, the quantisation configs'
# get_cache_scale), first found wins: its own (plain and attn.), ModelOpt's, compressed-tensors' (llm-compressor's
# output_scale), and the deprecated kv_scale that vLLM uses for both k and v
_CHECKPOINT_NAMES = {w: (f"self_attn.{w}", f"self_attn.attn.{w}", f"self_attn.{w[0]}_proj.{w}",
                         f"self_attn.qkv_proj.{w}", f"self_attn.{w[0]}_proj.output_scale", "self_attn.kv_scale")
                     for w in ("k_scale", "v_scale")}


def kv_cache_dtype(name: str, model_dtype) -> jnp.dtype:
    """'auto' -> the model dtype; 'fp8' / 'fp8_e4m3' -> float8_e4m3fn."""
    if name == "auto":
        return jnp.dtype(model_dtype)
    if name in ("fp8", "fp8_e4m3"):
        return FP8_DTYPE
    raise ValueError(f"kv_cache_dtype={name!r} is not one of {KV_CACHE_DTYPES}")


def checkpoint_scales(tensors: dict, num_layers: int) -> dict | None:
    """{'k_scale': [L], 'v_scale': [L]} float32 from a checkpoint's tensors (name -> object with .get(name)), or
    None when it has none. A checkpoint with some scales but not all (a layer, or k or v, missing) is a ValueError
    naming the first gap."""
    names = {which: [next((f"model.layers.{l}.{p}" for p in _CHECKPOINT_NAMES[which]
                           if f"model.layers.{l}.{p}" in tensors), None) for l in range(num_layers)]
             for which in ("k_scale", "v_scale")}
    if not any(n for ns in names.values() for n in ns):
        return None
    out = {}
    for which, ns in names.items():
        vals = []
        for l, name in enumerate(ns):
            if name is None:
                raise ValueError(f"the checkpoint has KV cache scales for some layers but lacks "
                                 f"model.layers.{l}.self_attn.{which}")
            a = np.asarray(tensors[name].get(name), np.float32).reshape(-1)
            if a.size != 1 or not np.isfinite(a[0]) or a[0] <= 0:
                raise ValueError(f"tensor {name!r} must be one positive scale (per-tensor), got {a.tolist()}")
            vals.append(a[0])
        out[which] = np.asarray(vals, np.float32)
    return out


def _stacked(params: dict, name: str) -> jax.Array:
    layers = params["layers"]
    if isinstance(layers, (tuple, list)):
        return jnp.stack([d[name] for d in layers])
    return layers[name]


def bound_amax(config, params: dict, tp: int = 1) -> tuple[jax.Array, jax.Array]:
    """(k bound [L], v bound [L]): per layer, values |k| and |v| can never exceed (see the module docstring).
    params in the layout of parallel/layout.py for `tp` (qkv_proj columns regrouped per device)."""
    c = config
    D, E = c.head_dim, c.hidden_size
    k_norm = _stacked(params, "k_norm").astype(jnp.float32)                      # [L, D]
    rope_gain = max(1.0, float(c.rope_yarn[3])) if c.rope_yarn else 1.0      # YaRN scales cos / sin (attention_factor)
    k_amax = math.sqrt(D) * jnp.abs(k_norm).max(axis=1) * rope_gain
    ln = _stacked(params, "input_layernorm").astype(jnp.float32)               # [L, E]
    qkv = _stacked(params, "qkv_proj").astype(jnp.float32)                     # [L, E, tp (Hl + 2Kl) D]
    cols = qkv.reshape(qkv.shape[0], E, tp, -1, D)                              # [L, E, tp, Hl + 2Kl, D]
    kl = (cols.shape[3] - c.num_attention_heads // tp) // 2                      # kv heads per device
    v_cols = cols[:, :, :, -kl:, :] * ln[:, :, None, None, None]                # [L, E, tp, Kl, D]
    v_amax = math.sqrt(E) * jnp.sqrt(jnp.sum(v_cols * v_cols, axis=1)).reshape(qkv.shape[0], -1).max(axis=1)
    return k_amax, v_amax


def with_kv_scales(config, params: dict, kv_dtype, tp: int = 1) -> dict:
    """params ready for a cache of `kv_dtype`: fp8 -> `k_scale` / `v_scale` [L, 1] float32 (the checkpoint's, else
    the weight bound's); otherwise without them (a full-precision cache needs none: the step does not carry them)."""
    params = dict(params)
    given = {k: params.pop(k) for k in ("k_scale", "v_scale") if k in params}
    if not is_fp8(kv_dtype):
        return params
    if len(given) == 2:
        ks, vs = (jnp.asarray(given[k], jnp.float32).reshape(-1, 1) for k in ("k_scale", "v_scale"))
    else:
        k_amax, v_amax = jax.jit(bound_amax, static_argnums=(0, 2))(config, params, tp)
        ks, vs = ((a * BOUND_MARGIN / FP8_MAX).reshape(-1, 1) for a in (k_amax, v_amax))
    L = config.num_hidden_layers
    if ks.shape != (L, 1) or vs.shape != (L, 1):
        raise ValueError(f"k_scale / v_scale must hold one scale per layer ({L}), got {ks.shape} and {vs.shape}")
    return {**params, "k_scale": ks, "v_scale": vs}


def calibrated_amax(config, params: dict, token_ids, per_head: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(max |k|, max |v|) per layer [L] (per_head: per layer and kv head [L, K]) over token_ids [B, S], from a
    full-precision dense forward (k after norm and RoPE, as cached). For measuring how tight the bound is, or
    for calibrated scales (scripts/fp8_accuracy.py)."""
    from jaxinfer.model.qwen3 import dense_attention, forward

    def record(l, q, k, v, cache):        # the "cache" slot carries this layer's amax [K] out of the forward
        o, _ = dense_attention(l, q, k, v, None)
        return o, tuple(jnp.abs(x).max(axis=(0, 1, 3)).astype(jnp.float32) for x in (k, v))    # x [B, S, K, D]

    def run(params, ids):
        pos = jnp.broadcast_to(jnp.arange(ids.shape[-1]), ids.shape)
        _, amax = forward(config, params, ids, pos, record)
        return jnp.stack([jnp.stack(a) for a in amax])                  # [L, 2, K]
    out = np.asarray(jax.jit(run)(params, jnp.asarray(token_ids, jnp.int32)))
    if not per_head:
        out = out.max(axis=2)
    return out[:, 0], out[:, 1]
