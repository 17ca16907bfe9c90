"""Decode attention over a paged KV cache (Pallas, Triton backend): one new query token per sequence.

Design (flash-decoding):
  * grid = (K kv heads, S context splits, B sequences). One program handles ALL q heads that share its kv head
    (GQA group, padded to >= 16 rows for the tensor-core dot), so every K/V byte is read from HBM once.
  * The program walks its share of the context in tiles of `block_n` tokens; each row is gathered from its
    page through the block table inside the kernel (several pages per tile, no gathered copy in HBM).
  * Online softmax in fp32. With S > 1 each split writes a normalised partial output and its log-sum-exp;
    a tiny jnp combine (inside the same jit) merges them. S is static, chosen from B and the max context so
    small batches with long contexts still fill the GPU; each sequence's split size follows its real length.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._common import (LOG2E, NEG_BIG, check_paged_inputs, dot_precision, load_kv_tile, next_pow2,
                                    online_softmax_update)

NUM_SMS = 132  # H200; only used to pick the number of context splits.
DEFAULT_BLOCK_N = 64  # tokens per tile (4 pages of 16)
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 3
MIN_TOKENS_PER_SPLIT = 512


def choose_num_splits(batch: int, kv_heads: int, max_context: int, block_n: int = DEFAULT_BLOCK_N) -> int:
    """Static split count: >= ~8 programs per SM (small tail wave), but no split shorter than 512 tokens."""
    programs = batch * kv_heads
    want = max(1, -(-8 * NUM_SMS // programs))
    most = max(1, max_context // max(MIN_TOKENS_PER_SPLIT, block_n))
    return min(next_pow2(want), next_pow2(most))


def _decode_kernel(seq_lens_ref, bt_ref, q_ref, k_ref, v_ref, *refs,
                   scale: float, block_size: int, group: int, rows: int, block_n: int, num_splits: int,
                   fused: bool):
    if fused:   # the new token's K/V come as inputs; the caches are also (aliased) outputs
        kn_ref, vn_ref, o_ref, lse_ref, k_out_ref, v_out_ref = refs
    else:
        o_ref, lse_ref = refs
    kh, split, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    head_dim = q_ref.shape[-1]
    seq_len = seq_lens_ref[b]
    # fused: the cache holds only the first seq_len - 1 positions; the last one comes from kn/vn
    length = jnp.maximum(seq_len - 1, 0) if fused else seq_len
    # This split's token range; splits follow the real length so the work is balanced for every sequence.
    chunk = pl.cdiv(pl.cdiv(length, num_splits), block_n) * block_n
    start = split * chunk
    end = jnp.minimum(start + chunk, length)
    num_tiles = jnp.maximum(pl.cdiv(end - start, block_n), 0)

    g = jnp.arange(rows)
    head = kh * group + jnp.minimum(g, group - 1)  # [rows] padding rows repeat the last real head
    dcol = jnp.arange(head_dim)
    q = q_ref[b, head[:, None], dcol[None, :]]  # [rows, D]
    prec = dot_precision(q.dtype)
    qk_scale = scale * LOG2E  # softmax in base 2

    def body(i, carry):
        acc, m, l = carry
        tok = start + i * block_n + jnp.arange(block_n)  # [N]
        valid = tok < end
        # Positions past the end read the last real row (in bounds, finite) and are masked below.
        k, v = load_kv_tile(k_ref, v_ref, bt_ref, b, kh, jnp.minimum(tok, length - 1), block_size)
        s = plt.dot(q, k, trans_b=True, precision=prec) * qk_scale  # [rows, N] fp32
        s = jnp.where(valid[None, :], s, -jnp.inf)
        return online_softmax_update(acc, m, l, s, v, prec)

    acc = jnp.zeros((rows, head_dim), jnp.float32)
    m = jnp.full((rows,), NEG_BIG, jnp.float32)
    l = jnp.zeros((rows,), jnp.float32)
    acc, m, l = jax.lax.fori_loop(0, num_tiles, body, (acc, m, l))
    if fused:
        acc, m, l = _attend_new_token(acc, m, l, q, kn_ref, vn_ref, b, kh, dcol, qk_scale,
                                      (split == 0) & (seq_len > 0))
        _write_new_token(kn_ref, vn_ref, k_out_ref, v_out_ref, bt_ref, b, kh, dcol, seq_len - 1, block_size,
                         (split == 0) & (seq_len > 0))

    nonempty = l > 0
    out = acc / jnp.where(nonempty, l, 1.0)[:, None]  # empty split / padding row -> zeros
    lse = jnp.where(nonempty, m + jnp.log2(jnp.where(nonempty, l, 1.0)), NEG_BIG)  # base-2 log-sum-exp
    # Padding rows hold exact copies of the last real head's row, so their (duplicate) stores write the same
    # values to the same place: no mask needed.
    o_ref[b, split, head[:, None], dcol[None, :]] = out.astype(o_ref.dtype)
    lse_ref[b, split, head] = lse


def _attend_new_token(acc, m, l, q, kn_ref, vn_ref, b, kh, dcol, qk_scale, active):
    """Fold the new token (one key, from registers) into the online softmax state when `active`."""
    kn = kn_ref[b, kh, dcol].astype(jnp.float32)  # [D]
    vn = vn_ref[b, kh, dcol].astype(jnp.float32)
    s = jnp.sum(q.astype(jnp.float32) * kn[None, :], axis=1) * qk_scale  # [rows]
    m_new = jnp.maximum(m, s)
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new)
    acc2 = acc * alpha[:, None] + p[:, None] * vn[None, :]
    return (jnp.where(active, acc2, acc), jnp.where(active, m_new, m), jnp.where(active, l * alpha + p, l))


def _write_new_token(kn_ref, vn_ref, k_out_ref, v_out_ref, bt_ref, b, kh, dcol, pos, block_size, active):
    """Store the new token's K/V of kv head kh into its slot: page bt[b, pos // block_size], row pos % block_size."""
    @pl.when(active)
    def _():
        p = jnp.maximum(pos, 0)
        page, slot = bt_ref[b, p // block_size], p % block_size
        k_out_ref[page, slot, kh, dcol] = kn_ref[b, kh, dcol]
        v_out_ref[page, slot, kh, dcol] = vn_ref[b, kh, dcol]


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_n", "num_splits", "num_warps",
                                             "num_stages"))
def _paged_attention(q, k_cache, v_cache, block_tables, seq_lens, k_new=None, v_new=None, *, scale, interpret,
                     block_n, num_splits, num_warps, num_stages):
    batch, heads, head_dim = q.shape  # [B, H, D]
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    rows = max(16, next_pow2(group))  # tensor-core dots need >= 16 rows
    # Lengths past the block table are impossible; clamping keeps every read inside the table.
    seq_lens = jnp.clip(seq_lens, 0, block_tables.shape[1] * block_size)
    part_dtype = q.dtype if num_splits == 1 else jnp.float32
    fused = k_new is not None
    kernel = functools.partial(_decode_kernel, scale=scale, block_size=block_size, group=group, rows=rows,
                               block_n=block_n, num_splits=num_splits, fused=fused)
    out_shape = (jax.ShapeDtypeStruct((batch, num_splits, heads, head_dim), part_dtype),  # [B, S, H, D]
                 jax.ShapeDtypeStruct((batch, num_splits, heads), jnp.float32))  # [B, S, H]
    args = (seq_lens, block_tables, q, k_cache, v_cache)
    if fused:   # the caches come back as outputs 2 and 3, in the same memory as inputs 3 and 4
        out_shape += (jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                      jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype))
        args += (k_new, v_new)
    res = pl.pallas_call(
        kernel,
        grid=(kv_heads, num_splits, batch),
        out_shape=out_shape,
        input_output_aliases={3: 2, 4: 3} if fused else {},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_attention_decode",
    )(*args)
    out, lse = res[:2]
    if num_splits == 1:
        out = out[:, 0]
    else:
        # Combine the splits: weights 2^(lse_s - max lse); empty splits carry NEG_BIG and weigh 0.
        w = jnp.exp2(lse - lse.max(axis=1, keepdims=True))  # [B, S, H]
        out = ((w[..., None] * out).sum(axis=1) / w.sum(axis=1)[..., None]).astype(q.dtype)
    return (out, *res[2:]) if fused else out


def paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                    seq_lens: jax.Array, *, scale: float | None = None, interpret: bool = False,
                    block_n: int = DEFAULT_BLOCK_N, num_splits: int | None = None,
                    num_warps: int = DEFAULT_NUM_WARPS, num_stages: int = DEFAULT_NUM_STAGES) -> jax.Array:
    """Decode attention: q [B, H, D] (one token per sequence) over the paged cache [P, block_size, K, D].

    seq_lens[b] counts the context including the new token (already written); 0 marks a padding row (zeros out).
    Tile options: block_n (tokens per tile, power of two >= 16), num_splits (context splits, None = auto),
    num_warps, num_stages. Returns [B, H, D] in q's dtype.
    """
    return _entry(q, k_cache, v_cache, block_tables, seq_lens, None, None, scale, interpret, block_n, num_splits,
                  num_warps, num_stages)


def paged_attention_and_write(q: jax.Array, k_new: jax.Array, v_new: jax.Array, k_cache: jax.Array,
                              v_cache: jax.Array, block_tables: jax.Array, seq_lens: jax.Array, *,
                              scale: float | None = None, interpret: bool = False, block_n: int = DEFAULT_BLOCK_N,
                              num_splits: int | None = None, num_warps: int = DEFAULT_NUM_WARPS,
                              num_stages: int = DEFAULT_NUM_STAGES) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`paged_attention` for a new token whose K/V [B, K, D] are NOT yet in the cache: the kernel writes them at
    position seq_lens[b] - 1 (padding rows, seq_len 0, write nothing) and attends to them.
    Returns (out [B, H, D], k_cache, v_cache); donate the caches to update them in place."""
    if k_new.shape != (q.shape[0], k_cache.shape[2], q.shape[-1]) or v_new.shape != k_new.shape:
        raise ValueError(f"paged_attention_and_write: k_new/v_new must be [B, K, D] = "
                         f"{(q.shape[0], k_cache.shape[2], q.shape[-1])}, got {k_new.shape} / {v_new.shape}")
    if not (k_new.dtype == v_new.dtype == k_cache.dtype):
        raise ValueError(f"paged_attention_and_write: k_new/v_new dtype {k_new.dtype}/{v_new.dtype} != cache "
                         f"dtype {k_cache.dtype}")
    return _entry(q, k_cache, v_cache, block_tables, seq_lens, k_new, v_new, scale, interpret, block_n, num_splits,
                  num_warps, num_stages)


def _entry(q, k_cache, v_cache, block_tables, seq_lens, k_new, v_new, scale, interpret, block_n, num_splits,
           num_warps, num_stages):
    """Validation and defaults shared by both entry points."""
    if q.ndim != 3:
        raise ValueError(f"paged_attention: q must be [B, H, D], got shape {q.shape}")
    batch, heads, head_dim = q.shape
    check_paged_inputs("paged_attention", heads, head_dim, q.dtype, k_cache, v_cache, block_tables, seq_lens, batch)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"paged_attention: block_n must be a power of two >= 16, got {block_n}")
    if num_splits is None:
        num_splits = choose_num_splits(batch, k_cache.shape[2], block_tables.shape[1] * k_cache.shape[1], block_n)
    if num_splits < 1:
        raise ValueError(f"paged_attention: num_splits must be >= 1, got {num_splits}")
    scale = float(head_dim ** -0.5 if scale is None else scale)
    return _paged_attention(q, k_cache, v_cache, block_tables, seq_lens, k_new, v_new, scale=scale,
                            interpret=interpret, block_n=block_n, num_splits=num_splits, num_warps=num_warps,
                            num_stages=num_stages)


def paged_attention_reference(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                              seq_lens: jax.Array, *, scale: float | None = None) -> jax.Array:
    """Plain jnp decode attention: gathers each sequence's pages, masks positions >= seq_len, fp32 softmax."""
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
