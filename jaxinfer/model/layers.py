"""The small math pieces of a Qwen3 block, written to match HF transformers bit for bit in fp32."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF Qwen3RMSNorm: normalise in fp32, cast back to x's dtype, then scale."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


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


# Decode steps of at most this many rows run their matmuls (and the LM head) through pallas_kernels/gemv.py,
# which streams each weight once, instead of XLA's cuBLAS GEMMs (~1.7 TB/s at batch 2). 0 = off: set it from
# the H200 A/B of scripts/bench_small_batch.py. Read when a step is built (make_step / make_multistep).
GEMV_MAX_ROWS = 0
# With the kernel, fold the RMSNorms into the qkv / gate_up kernels and silu(gate) * up into gate_up's: 2-3 fewer
# kernels a layer (set from the same A/B: "gemv" against "gemv-unfused").
GEMV_FUSE = True


def decode_matmul(rows: int, interpret: bool = False, tp: int = 1):
    """The `matmul` for qwen3.forward / compute_logits in a decode step of `rows` rows: the gemv kernel when
    rows <= GEMV_MAX_ROWS on one device, else None (XLA's dot). With tp > 1 XLA partitions the dots itself; the
    kernel would need a shard_map per matmul (and the all-reduce after o_proj / down_proj)."""
    if rows > GEMV_MAX_ROWS or tp > 1:
        return None
    return functools.partial(gemv_matmul, interpret=interpret, fuse=GEMV_FUSE)


def gemv_matmul(x: jax.Array, w: jax.Array, row: int | None = None, transpose_w: bool = False, out_dtype=None,
                norm=None, gated: bool = False, *, interpret: bool = False, fuse: bool = True) -> jax.Array:
    """x [M, E] @ w[row] (w stacked [L, E, N]) or @ w (row None, w [E, N]); transpose_w: w is [.., N, E] and
    x @ w^T is computed. Result [M, N] in out_dtype (default x's). norm = (weight [E] or stacked [L, E], eps):
    RMSNorm x first; gated: w's columns are [gate | up] and the result silu(gate) * up [M, N / 2]. `fuse`
    (GEMV_FUSE when the step was built): both happen inside the kernel. Shapes the kernel does not take use XLA."""
    from pallas_kernels.gemv import gemv, supported
    N, E = w.shape[-2:] if transpose_w else w.shape[-2:][::-1]
    kernel = supported(x.shape[0], E, N) and not (gated and N % 32)
    fuse = kernel and fuse
    g, eps = norm if norm is not None else (None, 1e-6)
    if g is not None and not fuse:                          # the RMSNorm as its own op
        x, g = rms_norm(x, g if row is None or g.ndim == 1 else g[row], eps), None
    if kernel:
        y = gemv(x, w, 0 if row is None else row, norm_weight=g, eps=eps, swiglu=gated and fuse,
                 transpose_w=transpose_w, out_dtype=out_dtype, interpret=interpret)
    else:
        w = w if row is None else w[row]
        y = jnp.einsum("me,ne->mn" if transpose_w else "me,en->mn", x, w, preferred_element_type=out_dtype or x.dtype)
    return swiglu(y) if gated and not fuse else y
