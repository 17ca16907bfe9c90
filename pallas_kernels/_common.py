"""Helpers shared by the Pallas (Triton backend) attention kernels: validation, page gathers, constants."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.quant import dequantize_cache, is_fp8, is_pairs, pair_halves

# JAX >= 0.11 warns (once) that the Pallas Triton backend is deprecated; it still works through 0.12. The
# `jaxinfer` commands silence it in their own process (xla_options.set_process_flags); an importer's process keeps
# its own warning filters.

LOG2E = math.log2(math.e)
# Finite "minus infinity" for running maxima: keeps exp2(m_old - m_new) finite when a whole row is masked.
NEG_BIG = -1e30


def online_softmax_update(acc, m, l, s, v, prec):
    """One flash-attention step over a key tile. s [R, N] are log2-scaled scores (fp32; masked ones -inf),
    v the tile's value parts (load_kv_tile: ([N, D],), or the even and odd dimensions of pairs); (acc (parts
    [R, D / len(v)]), m [R], l [R]) are the running output, max and normaliser."""
    from jax.experimental.pallas import triton as plt
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    l = l * alpha + p.sum(axis=1)
    acc = tuple(a * alpha[:, None] + plt.dot(p.astype(x.dtype), x, precision=prec) for a, x in zip(acc, v))
    return acc, m_new, l


def merge_splits(out, lse, dtype):
    """A decode kernel's context splits combined: out [B, S, H, D] (each split's normalised partial), lse [B, S, H]
    (base 2; an empty split carries NEG_BIG and weighs 0); weights 2^(lse_s - max lse). Written split by split (S is
    static), so XLA makes it one elementwise kernel; a reduction over S would be two, the max and the weighted sum."""
    splits = range(out.shape[1])
    top = functools.reduce(jnp.maximum, [lse[:, s] for s in splits])                       # [B, H]
    w = [jnp.exp2(lse[:, s] - top) for s in splits]
    num = functools.reduce(jnp.add, [w[s][..., None] * out[:, s].astype(jnp.float32) for s in splits])
    return (num / functools.reduce(jnp.add, w)[..., None]).astype(dtype)


def acc_zeros(rows: int, head_dim: int, v_dtype) -> tuple:
    """The running output's parts, zeros: one [rows, D], or two [rows, D/2] for V pages in pairs."""
    parts = 2 if is_pairs(v_dtype) else 1
    return tuple(jnp.zeros((rows, head_dim // parts), jnp.float32) for _ in range(parts))


def out_columns(head_dim: int, parts: int) -> tuple:
    """The output columns each part of the running output fills: (all D,), or (even, odd) for pairs."""
    if parts == 1:
        return (jnp.arange(head_dim),)
    half = jnp.arange(head_dim // 2)
    return 2 * half, 2 * half + 1


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def prev_pow2(n: int) -> int:
    return 1 << max(0, int(n).bit_length() - 1)


def is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def padded_head_dim(q, k_cache, v_cache):
    """(q, k_cache, v_cache) of a head_dim D that is not a power of two, zero-padded to the next one (the kernels tile
    D; zero columns change no score and no output column: the caller keeps 1/sqrt(D) and cuts the output), or None
    when D is one already, or the shapes disagree (the checks then name them). V pages in pairs pad to half."""
    D = q.shape[-1]
    if is_pow2(D) or k_cache.shape[-1] != D:
        return None
    Dp = next_pow2(D)
    pad = lambda x, n: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n - x.shape[-1])])
    return pad(q, Dp), pad(k_cache, Dp), pad(v_cache, Dp // 2 if is_pairs(v_cache.dtype) else Dp)


def check_cu_seqlens(name: str, cu_seqlens_q, batch: int) -> None:
    """cu_seqlens_q of a varlen prefill: int32 [batch + 1]."""
    if cu_seqlens_q.shape != (batch + 1,) or cu_seqlens_q.dtype != jnp.int32:
        raise ValueError(f"{name}: cu_seqlens_q must be int32 of shape ({batch + 1},), got "
                         f"{cu_seqlens_q.dtype}{list(cu_seqlens_q.shape)}")


def check_paged_inputs(name: str, q_heads: int, head_dim: int, q_dtype, k_cache, v_cache,
                       block_tables, seq_lens, batch: int, pairs: bool = False) -> None:
    """Validates the paged-cache arguments shared by decode and prefill; raises ValueError naming the bad value.
    pairs: the kernel also reads fp8 V pages in pairs (quant.py: uint16 [P, bs, K, D/2] beside fp8 K pages)."""
    if not jnp.issubdtype(q_dtype, jnp.floating):
        raise ValueError(f"{name}: q must be floating point, got dtype {q_dtype}")
    if k_cache.ndim != 4:
        raise ValueError(f"{name}: k_cache must be [num_blocks, block_size, K, D], got shape {k_cache.shape}")
    if is_pairs(v_cache.dtype):
        if not pairs:
            raise ValueError(f"{name}: v_cache in pairs (uint16) is read only by the Pallas kernels; give float8_e4m3fn "
                             f"pages of k_cache's shape")
        want = (*k_cache.shape[:-1], k_cache.shape[-1] // 2)
        if not is_fp8(k_cache.dtype) or v_cache.shape != want:
            raise ValueError(f"{name}: v_cache in pairs (uint16) must have shape {want} beside a float8_e4m3fn "
                             f"k_cache, got v_cache {v_cache.shape} and k_cache {k_cache.dtype}{list(k_cache.shape)}")
    elif v_cache.shape != k_cache.shape:
        raise ValueError(f"{name}: v_cache shape {v_cache.shape} != k_cache shape {k_cache.shape}")
    elif k_cache.dtype != v_cache.dtype or (k_cache.dtype != q_dtype and not is_fp8(k_cache.dtype)):
        raise ValueError(f"{name}: k_cache and v_cache must share q's dtype or be float8_e4m3fn, got q {q_dtype}, "
                         f"k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    _, block_size, kv_heads, kd = k_cache.shape
    if kd != head_dim:
        raise ValueError(f"{name}: head_dim of q ({head_dim}) != head_dim of k_cache ({kd})")
    if not is_pow2(head_dim):
        raise ValueError(f"{name}: head_dim must be a power of two, got {head_dim}")
    if not is_pow2(block_size):
        raise ValueError(f"{name}: block_size must be a power of two, got {block_size}")
    if kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"{name}: number of q heads ({q_heads}) must be a multiple of kv heads ({kv_heads})")
    if block_tables.ndim != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"{name}: block_tables must be [B={batch}, max_blocks_per_seq], got {block_tables.shape}")
    if block_tables.dtype != jnp.int32:
        raise ValueError(f"{name}: block_tables must be int32, got {block_tables.dtype}")
    if seq_lens.shape != (batch,):
        raise ValueError(f"{name}: seq_lens must have shape ({batch},), got {seq_lens.shape}")
    if seq_lens.dtype != jnp.int32:
        raise ValueError(f"{name}: seq_lens must be int32, got {seq_lens.dtype}")


def context_total_operand(name: str, context_total):
    """A decode kernel's context_total (balanced splits) -> int32 [1], or None; ValueError unless one int >= 0."""
    if context_total is None:
        return None
    if isinstance(context_total, bool) or (isinstance(context_total, int) and context_total < 0):
        raise ValueError(f"{name}: context_total must be an int >= 0 or an int32 array, got {context_total!r}")
    total = jnp.asarray(context_total)
    if total.dtype != jnp.int32 or total.size != 1:
        raise ValueError(f"{name}: context_total must be one int32 value, got {total.dtype} {total.shape}")
    return total.reshape(1)


def load_kv_tile(k_ref, v_ref, bt_ref, b, kh, tok, block_size: int, dtype, page_offset: int = 0):
    """Gathers K and V rows of context positions `tok` ([N] int32, all < seq_len) of sequence b, kv head kh.

    Each row is read straight from its page through the block table: no gathered copy in HBM. fp8 pages are
    converted to `dtype` in registers (their scales are applied by the caller, once per program).
    page_offset: added to every page id (a layer's pages in a cache stacked over the layers).
    Returns k [N, D] and v's parts: ([N, D],), or for V pages in pairs (quant.py) its even and odd dimensions
    ([N, D/2], [N, D/2]), all in `dtype`.
    """
    page = bt_ref[b, tok // block_size] + page_offset  # [N] physical block ids (each repeated block_size times)
    slot = tok % block_size  # [N]
    v = v_ref[page, slot, kh, :]
    v = pair_halves(v, dtype) if is_pairs(v_ref.dtype) else (v.astype(dtype),)
    return k_ref[page, slot, kh, :].astype(dtype), v


def dot_precision(dtype):
    """fp32 inputs get true fp32 matmuls (the tests compare at 1e-5); bf16/fp16 use the tensor-core default."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def paged_attention_reference(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                              seq_lens: jax.Array, *, scale: float | None = None, k_scale: jax.Array | None = None,
                              v_scale: jax.Array | None = None, layer: int | jax.Array = 0, interpret: bool = False,
                              **tile_options) -> jax.Array:
    """Plain jnp decode attention: gathers each sequence's pages, masks positions >= seq_len, fp32 softmax.
    fp8 caches are dequantised to fp32 first (scales as in paged_attention). `interpret` and paged_attention's tile
    options are taken (the kernel's contract) and mean nothing here."""
    k_cache, v_cache = dequantize_cache(k_cache, v_cache, k_scale, v_scale, layer, "paged_attention_reference")
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    scale = head_dim ** -0.5 if scale is None else scale
    k = k_cache[block_tables].reshape(batch, -1, kv_heads, head_dim)  # [B, S, K, D]
    v = v_cache[block_tables].reshape(batch, -1, kv_heads, head_dim)
    qg = q.reshape(batch, kv_heads, heads // kv_heads, head_dim)  # [B, K, G, D]
    s = jnp.einsum("bkgd,bskd->bkgs", qg, k, precision=jax.lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32) * scale  # [B, K, G, S]
    valid = jnp.arange(k.shape[1])[None, :] < seq_lens[:, None]  # [B, S]
    s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
    p = jnp.exp(s - jnp.maximum(s.max(axis=-1, keepdims=True), -1e30))  # all-masked rows -> p = 0
    p = p / jnp.maximum(p.sum(axis=-1, keepdims=True), 1e-30)
    out = jnp.einsum("bkgs,bskd->bkgd", p, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return out.reshape(batch, heads, head_dim).astype(q.dtype)
