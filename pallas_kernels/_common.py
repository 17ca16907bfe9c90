"""Helpers shared by the Pallas (Triton backend) attention kernels: validation, page gathers, constants."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels.quant import is_fp8

# JAX >= 0.11 warns (once) that the Pallas Triton backend is deprecated; it still works through 0.12. The
# `jaxinfer` commands silence it in their own process (xla_options.set_process_flags); an importer's process keeps
# its own warning filters.

LOG2E = math.log2(math.e)
# Finite "minus infinity" for running maxima: keeps exp2(m_old - m_new) finite when a whole row is masked.
NEG_BIG = -1e30


def online_softmax_update(acc, m, l, s, v, prec):
    """One flash-attention step over a key tile. s [R, N] are log2-scaled scores (fp32; masked ones -inf),
    v [N, D]; (acc [R, D], m [R], l [R]) are the running output, max and normaliser."""
    from jax.experimental.pallas import triton as plt
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    l = l * alpha + p.sum(axis=1)
    acc = acc * alpha[:, None] + plt.dot(p.astype(v.dtype), v, precision=prec)
    return acc, m_new, l


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def prev_pow2(n: int) -> int:
    return 1 << max(0, int(n).bit_length() - 1)


def is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def check_cu_seqlens(name: str, cu_seqlens_q, batch: int) -> None:
    """cu_seqlens_q of a varlen prefill: int32 [batch + 1]."""
    if cu_seqlens_q.shape != (batch + 1,) or cu_seqlens_q.dtype != jnp.int32:
        raise ValueError(f"{name}: cu_seqlens_q must be int32 of shape ({batch + 1},), got "
                         f"{cu_seqlens_q.dtype}{list(cu_seqlens_q.shape)}")


def check_paged_inputs(name: str, q_heads: int, head_dim: int, q_dtype, k_cache, v_cache,
                       block_tables, seq_lens, batch: int) -> None:
    """Validates the paged-cache arguments shared by decode and prefill; raises ValueError naming the bad value."""
    if not jnp.issubdtype(q_dtype, jnp.floating):
        raise ValueError(f"{name}: q must be floating point, got dtype {q_dtype}")
    if k_cache.ndim != 4:
        raise ValueError(f"{name}: k_cache must be [num_blocks, block_size, K, D], got shape {k_cache.shape}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"{name}: v_cache shape {v_cache.shape} != k_cache shape {k_cache.shape}")
    if k_cache.dtype != v_cache.dtype or (k_cache.dtype != q_dtype and not is_fp8(k_cache.dtype)):
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


def load_kv_tile(k_ref, v_ref, bt_ref, b, kh, tok, block_size: int, dtype, page_offset: int = 0):
    """Gathers K and V rows of context positions `tok` ([N] int32, all < seq_len) of sequence b, kv head kh.

    Each row is read straight from its page through the block table: no gathered copy in HBM. fp8 pages are
    converted to `dtype` in registers (their scales are applied by the caller, once per program).
    page_offset: added to every page id (a layer's pages in a cache stacked over the layers).
    Returns k, v: [N, D] in `dtype`.
    """
    page = bt_ref[b, tok // block_size] + page_offset  # [N] physical block ids (each repeated block_size times)
    slot = tok % block_size  # [N]
    return k_ref[page, slot, kh, :].astype(dtype), v_ref[page, slot, kh, :].astype(dtype)


def dot_precision(dtype):
    """fp32 inputs get true fp32 matmuls (the tests compare at 1e-5); bf16/fp16 use the tensor-core default."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None
