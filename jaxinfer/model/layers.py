"""The small math pieces of a Qwen3 block, written to match HF transformers bit for bit in fp32."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF Qwen3RMSNorm: normalise in fp32, cast back to x's dtype, then scale."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float, scaling: float = 1.0):
    """cos/sin tables [..., D] for integer positions [...] (HF's default / linear rope)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = (positions.astype(jnp.float32) / scaling)[..., None] * inv_freq      # [..., D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)                               # [..., D]
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [..., N, D] rotated by the half-split ("rotate_half") convention; cos/sin [..., D]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[..., None, :].astype(x.dtype), sin[..., None, :].astype(x.dtype)
    return x * cos + rotated * sin


def swiglu(gate_up: jax.Array) -> jax.Array:
    """[..., 2I] (gate | up) -> silu(gate) * up  [..., I]."""
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return jax.nn.silu(gate) * up
