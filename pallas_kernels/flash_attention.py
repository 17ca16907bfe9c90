"""Causal varlen prefill attention over a paged KV cache (Pallas, Triton backend).

q holds the new tokens of all sequences packed back to back ([T, H, D], offsets cu_seqlens_q); their K/V are
already written to the cache, so every key (cached prefix or new token) is read from the pages, gathered
through the block table inside the kernel.

Work split: the new tokens of each sequence are cut into q tiles of `block_q` rows that never straddle two
sequences. A small jnp pass turns cu_seqlens_q into per-tile metadata (sequence id, first and end row), sorted
heaviest first so the long causal tiles start early. Tiles past the packed tokens write zeros to the padding
rows. grid = (H q heads, tiles); q heads sharing a kv head run next to each other, so their K/V hits L2.
Per tile: key tiles fully below the causal diagonal run unmasked; the (few) crossing it run masked; key tiles
above the diagonal and other sequences' keys are never visited.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._common import (LOG2E, NEG_BIG, acc_zeros, check_cu_seqlens, check_paged_inputs, dot_precision,
                                    load_kv_tile, online_softmax_update, out_columns, padded_head_dim)
from pallas_kernels.quant import compute_dtype, dequantize_cache, kv_scales, load_scales

DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 64
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 3


def tile_metadata(cu_seqlens_q: jax.Array, seq_lens: jax.Array, num_tokens: int, block_q: int):
    """Per-q-tile metadata, heaviest tile first: (seq id, first row, end row), each [num_tiles] int32.

    seq id B marks the padding zone [cu[-1], T) (zeros written); B + 1 marks an unused tile.
    """
    batch = seq_lens.shape[0]
    num_tiles = pl.cdiv(num_tokens, block_q) + batch  # static bound: each sequence adds <= 1 partial tile
    cu = jnp.concatenate([jnp.clip(cu_seqlens_q, 0, num_tokens), jnp.array([num_tokens], jnp.int32)])  # [B + 2]
    n_new = jnp.maximum(cu[1:] - cu[:-1], 0)  # [B + 1]; entry B = padding rows
    tiles_per_seq = pl.cdiv(n_new, block_q)
    tile_end = jnp.cumsum(tiles_per_seq)
    i = jnp.arange(num_tiles, dtype=jnp.int32)
    # compare_all: one [NT, B + 1] comparison. The default method is a while loop, whose condition goes
    # through the host on a GPU: a whole 8 x 1024 prefill call took 174-201 us with it and 137-141 us
    # without (H200, same process).
    seq = jnp.searchsorted(tile_end, i, side="right", method="compare_all").astype(jnp.int32)  # [NT] in [0, B + 1]
    seq_c = jnp.minimum(seq, batch)
    first = cu[seq_c] + (i - (tile_end[seq_c] - tiles_per_seq[seq_c])) * block_q
    end = jnp.minimum(first + block_q, cu[seq_c + 1])
    # Work of a tile ~ number of keys its last row sees; padding/unused tiles are cheapest.
    ctx_start = jnp.concatenate([seq_lens, jnp.zeros((1,), jnp.int32)])[seq_c] - n_new[seq_c]
    work = jnp.where(seq < batch, ctx_start + end - cu[seq_c], -1)
    order = jnp.argsort(-work, stable=True)
    return seq[order], first[order].astype(jnp.int32), end[order].astype(jnp.int32)


def _prefill_kernel(tile_seq_ref, tile_first_ref, tile_end_ref, cu_ref, seq_lens_ref, bt_ref, q_ref, k_ref,
                    v_ref, *refs, scale: float, block_size: int, group: int, block_q: int, block_k: int,
                    batch: int):
    # refs: [k_scale [L, C], v_scale [L, C], layer [1] for fp8 pages] o
    scale_refs, (o_ref,) = (refs[:3], refs[3:]) if len(refs) == 4 else (None, refs)
    h, tile = pl.program_id(0), pl.program_id(1)
    head_dim = q_ref.shape[-1]
    seq, first, end = tile_seq_ref[tile], tile_first_ref[tile], tile_end_ref[tile]
    # Rows past the tile's end repeat its last row: identical values, so the unmasked store stays correct.
    rows = jnp.minimum(first + jnp.arange(block_q), end - 1)  # [BQ] packed token index
    dcol = jnp.arange(head_dim)

    @pl.when(seq == batch)
    def _padding_rows():
        o_ref[rows[:, None], h, dcol[None, :]] = jnp.zeros((block_q, head_dim), o_ref.dtype)

    @pl.when(seq < batch)
    def _attend():
        b = seq
        kh = h // group
        length = seq_lens_ref[b]
        q_start = cu_ref[b]
        ctx_start = length - (cu_ref[b + 1] - q_start)  # absolute position of the first new token
        pos = ctx_start + rows - q_start  # [BQ] absolute position of each query row
        first_pos = ctx_start + first - q_start
        cdtype = compute_dtype(q_ref.dtype, k_ref.dtype)   # fp8 pages are converted to this in registers
        q = q_ref[rows[:, None], h, dcol[None, :]].astype(cdtype)  # [BQ, D]
        prec = dot_precision(cdtype)
        k_scale, v_scale = load_scales(scale_refs, kh)   # fp8 dequantisation scales of this kv head (else 1)
        qk_scale = scale * LOG2E * k_scale

        def body(j, carry, masked: bool):
            acc, m, l = carry
            t = j * block_k + jnp.arange(block_k)  # [BK] key positions
            k, v = load_kv_tile(k_ref, v_ref, bt_ref, b, kh, jnp.minimum(t, length - 1), block_size, cdtype)
            s = plt.dot(q, k, trans_b=True, precision=prec) * qk_scale  # [BQ, BK] fp32
            if masked:
                s = jnp.where(t[None, :] <= pos[:, None], s, -jnp.inf)
            return online_softmax_update(acc, m, l, s, v, prec)

        carry = (acc_zeros(block_q, head_dim, v_ref.dtype), jnp.full((block_q,), NEG_BIG, jnp.float32),
                 jnp.zeros((block_q,), jnp.float32))
        num_full = (first_pos + 1) // block_k  # key tiles every row of this q tile sees entirely
        last_pos = ctx_start + jnp.minimum(first + block_q, end) - 1 - q_start
        num_all = pl.cdiv(jnp.minimum(length, last_pos + 1), block_k)
        carry = jax.lax.fori_loop(0, num_full, functools.partial(body, masked=False), carry)
        acc, m, l = jax.lax.fori_loop(num_full, num_all, functools.partial(body, masked=True), carry)
        norm = jnp.where(l > 0, l, 1.0)
        for cols, part in zip(out_columns(head_dim, len(acc)), acc):     # V pages in pairs: two halves
            out = part * (v_scale / norm)[:, None] if scale_refs is not None else part / norm[:, None]
            o_ref[rows[:, None], h, cols[None, :]] = out.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_q", "block_k", "num_warps",
                                             "num_stages"))
def _flash_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scales=None, *, scale, interpret,
                     block_q, block_k, num_warps, num_stages):
    num_tokens, heads, head_dim = q.shape  # [T, H, D]
    _, block_size, kv_heads, _ = k_cache.shape
    batch = seq_lens.shape[0]
    seq_lens = jnp.clip(seq_lens, 0, block_tables.shape[1] * block_size)
    tile_seq, tile_first, tile_end = tile_metadata(cu_seqlens_q, seq_lens, num_tokens, block_q)  # [NT] each
    kernel = functools.partial(_prefill_kernel, scale=scale, block_size=block_size, group=heads // kv_heads,
                               block_q=block_q, block_k=block_k, batch=batch)
    return pl.pallas_call(
        kernel,
        grid=(heads, tile_seq.shape[0]),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="flash_attention_prefill",
    )(tile_seq, tile_first, tile_end, cu_seqlens_q, seq_lens, block_tables, q, k_cache, v_cache, *(scales or ()))


def flash_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                    cu_seqlens_q: jax.Array, seq_lens: jax.Array, *, scale: float | None = None,
                    k_scale: jax.Array | None = None, v_scale: jax.Array | None = None, layer: int | jax.Array = 0,
                    interpret: bool = False, block_q: int = DEFAULT_BLOCK_Q, block_k: int = DEFAULT_BLOCK_K,
                    num_warps: int = DEFAULT_NUM_WARPS, num_stages: int = DEFAULT_NUM_STAGES) -> jax.Array:
    """Causal prefill attention of packed new tokens q [T, H, D] over the paged cache [P, block_size, K, D].

    Sequence b's new tokens are q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]] (cu_seqlens_q[0] == 0) at absolute
    positions seq_lens[b] - n_new .. seq_lens[b] - 1; each sees its own sequence's keys up to its position.
    Rows past cu_seqlens_q[-1] are padding and get zeros. float8_e4m3fn caches need k_scale / v_scale
    (pallas_kernels/quant.py: [] or [K], or [L, 1] / [L, K] with row `layer`); their V pages may also come in
    pairs (quant.py: uint16 [P, block_size, K, D/2], the engine's layout). Tile options: block_q, block_k
    (powers of two >= 16), num_warps, num_stages. Returns [T, H, D] in q's dtype.
    """
    if q.ndim != 3:
        raise ValueError(f"flash_attention: q must be [T, H, D], got shape {q.shape}")
    D, scale = q.shape[-1], float(q.shape[-1] ** -0.5 if scale is None else scale)
    if (padded := padded_head_dim(q, k_cache, v_cache)) is not None:     # D not a power of two (_common)
        q, k_cache, v_cache = padded
    num_tokens, heads, head_dim = q.shape
    batch = seq_lens.shape[0] if seq_lens.ndim == 1 else -1
    check_paged_inputs("flash_attention", heads, head_dim, q.dtype, k_cache, v_cache, block_tables, seq_lens,
                       batch, pairs=True)
    check_cu_seqlens("flash_attention", cu_seqlens_q, batch)
    for name, size in (("block_q", block_q), ("block_k", block_k)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"flash_attention: {name} must be a power of two >= 16, got {size}")
    scales = kv_scales("flash_attention", k_cache, k_scale, v_scale, layer)
    return _flash_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scales, scale=scale,
                            interpret=interpret, block_q=block_q, block_k=block_k, num_warps=num_warps,
                            num_stages=num_stages)[..., :D]


def flash_attention_reference(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                              cu_seqlens_q: jax.Array, seq_lens: jax.Array, *, scale: float | None = None,
                              k_scale: jax.Array | None = None, v_scale: jax.Array | None = None,
                              layer: int | jax.Array = 0, q_chunk: int = 64, interpret: bool = False,
                              **tile_options) -> jax.Array:
    """Plain jnp causal varlen attention over the paged cache (gathering pages), same contract as the kernel
    (`interpret` and the kernel's tile options are taken and mean nothing here).

    Tokens are taken in chunks of q_chunk consecutive rows of one sequence (the kernel's tiling), so memory
    stays ~ (T + B * q_chunk) * H * S scores instead of a per-token copy of the whole context. fp8 caches are
    dequantised to fp32 first.
    """
    k_cache, v_cache = dequantize_cache(k_cache, v_cache, k_scale, v_scale, layer, "flash_attention_reference")
    num_tokens, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    batch = seq_lens.shape[0]
    scale = head_dim ** -0.5 if scale is None else scale
    seq_lens = jnp.clip(seq_lens, 0, block_tables.shape[1] * block_size)
    tile_seq, first, end = tile_metadata(cu_seqlens_q, seq_lens, num_tokens, q_chunk)  # [NT]
    real = tile_seq < batch
    b = jnp.minimum(tile_seq, batch - 1)
    row = first[:, None] + jnp.arange(q_chunk)  # [NT, C] packed token index
    row_ok = (row < end[:, None]) & real[:, None]
    row_c = jnp.clip(row, 0, num_tokens - 1)
    pos = (seq_lens[b] - (cu_seqlens_q[b + 1] - cu_seqlens_q[b]) - cu_seqlens_q[b])[:, None] + row  # [NT, C]
    k = k_cache[block_tables[b]].reshape(b.shape[0], -1, kv_heads, head_dim)  # [NT, S, K, D]
    v = v_cache[block_tables[b]].reshape(b.shape[0], -1, kv_heads, head_dim)
    qt = q[row_c].reshape(*row.shape, kv_heads, heads // kv_heads, head_dim)  # [NT, C, K, G, D]
    s = jnp.einsum("nckgd,nskd->nkgcs", qt, k, precision=jax.lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32) * scale  # [NT, K, G, C, S]
    visible = jnp.arange(k.shape[1])[None, None, :] <= pos[:, :, None]  # [NT, C, S]
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    p = jnp.exp(s - jnp.maximum(s.max(axis=-1, keepdims=True), -1e30))
    p = p / jnp.maximum(p.sum(axis=-1, keepdims=True), 1e-30)
    out = jnp.einsum("nkgcs,nskd->nckgd", p, v.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)  # [NT, C, K, G, D]
    out = out.reshape(-1, heads, head_dim).astype(q.dtype)
    dest = jnp.where(row_ok, row, num_tokens).reshape(-1)  # rows not in a real tile are dropped
    return jnp.zeros_like(q).at[dest].set(out, mode="drop")
