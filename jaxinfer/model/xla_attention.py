"""The "xla" attention backend: plain jnp over the paged KV cache, written so that XLA can do its best.

It is the XLA-fusion side of the backend comparison, so it must be the best plain XLA can do, not a straw
man. What costs time here is memory traffic, and two choices decide it (docs/kernels.md, "What XLA fuses"):

- Decode (`paged_decode_xla`, one query per row) is in model/xla_decode.py: its default "chunks" form reads each
  row's context in chunks from a flat work list; the other forms read every page of a row's table width.
- Prefill (`prefill_xla`) gathers pages per query TILE, not per token: each sequence's new tokens are laid
  out in tiles of QUERY_TILE consecutive tokens of that one sequence, a tile gathers its sequence's pages
  once ([N, S, K, D]) and attends with einsum (tensor cores) under a causal offset mask. Gathering per token
  ([T, S, K, D]) read each page ~T times; per tile it is ~T / QUERY_TILE + rows times.

Shapes: T new tokens, B rows (sequences), W block-table width, S = W * block_size keys, H q heads, K kv heads
(G = H // K per kv head), D head dim, N query tiles of Q tokens. Block tables index the cache [P, bs, K, D].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.quant import BYTES_DTYPE, FP8_DTYPE, as_fp8

_NEG = -1e30
QUERY_TILE = 64        # most prefill queries per tile (see prefill_xla)
GATHER_BUDGET = 6 * 2**30   # bytes of gathered pages (+ prefill scores) one group of chunks / tiles may take
GATHER = "pages"       # how decode chunks and prefill tiles gather their pages: "pages" ([N, S, K, D], whole pages,
                       # which XLA writes out transposed for the GEMMs) | "rows" ([N, K, S, D], each (token, head) row
                       # of the cache on its own: already the GEMMs' layout; gather_rows; measured 1.04-1.08x slower
                       # on an H100, docs/performance.md, fifty-ninth run)


def layer_scales(k_scale, v_scale, layer):
    """(k, v) scales [C] of `layer` from stacked [L, C] ones (C = 1 per layer, or K per kv head); None for a
    full-precision cache."""
    return None if k_scale is None else (k_scale[layer], v_scale[layer])


def gathered_itemsize(cache, q) -> int:
    """Bytes a gathered page element may take in memory: fp8 pages are converted to q's dtype for the einsums, and
    both the fp8 gather and its converted copy may be written out (counted together)."""
    item = jnp.dtype(cache.dtype).itemsize
    return item + jnp.dtype(q.dtype).itemsize if jnp.dtype(cache.dtype) in (FP8_DTYPE, BYTES_DTYPE) else item


def gather_pages(cache, block_tables):
    """cache [P, bs, K, D], tables [N, W] -> [N, W*bs, K, D]."""
    g = as_fp8(cache[block_tables])                                       # (byte pages: viewed as fp8)
    return g.reshape(g.shape[0], -1, *g.shape[3:])


def gather_rows(cache, block_tables):
    """cache [P, bs, K, D], tables [N, W] -> [N, K, W*bs, D]: each (token, head) row of the cache gathered on its
    own from the flat [P * bs * K, D] view, so that the result is already in the batched GEMMs' layout."""
    P, bs, K, D = cache.shape
    tok = (block_tables[:, :, None] * bs + jnp.arange(bs)).reshape(block_tables.shape[0], -1)   # [N, S]
    return as_fp8(cache.reshape(P * bs * K, D)[tok[:, None, :] * K + jnp.arange(K)[None, :, None]])


def _scales(fp8, shape):
    """fp8 (k_scale, v_scale) [C] -> two [K, G] arrays (`shape`) for the scores and the outputs; ones without."""
    ones = jnp.ones(shape, jnp.float32)                      # XLA folds a multiply by ones away
    if fp8 is None:
        return ones, ones
    return tuple(s.astype(jnp.float32).reshape(-1, 1) * ones for s in fp8)     # [C, 1] * [K, G]


def attend_einsum(q, k, v, visible, scale, fp8=None, heads_major: bool = False):
    """Q queries per row as two batched GEMMs: q [N, Q, H, D]; k/v [N, S, K, D] ([N, K, S, D] if heads_major);
    visible [N, Q, S] -> [N, Q, H, D]. GQA without repeating K/V: q is viewed as [N, Q, K, G, D]. fp8 k/v are
    converted to q's dtype (fused into the gather) and the scales applied to the scores and the output."""
    N, Q, H, D = q.shape
    K = k.shape[1 if heads_major else 2]
    kv = "nksd" if heads_major else "nskd"
    ks, vs = _scales(fp8, (K, H // K))
    if fp8 is not None:
        k, v = k.astype(q.dtype), v.astype(q.dtype)
    qg = q.reshape(N, Q, K, H // K, D)
    s = jnp.einsum(f"nqkgd,{kv}->nqkgs", qg, k, preferred_element_type=jnp.float32)  # [N, Q, K, G, S]
    s = jnp.where(visible[:, :, None, None, :], s * (scale * ks)[..., None], _NEG)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    out = jnp.einsum(f"nqkgs,{kv}->nqkgd", p, v, preferred_element_type=jnp.float32)  # [N, Q, K, G, D]
    return (out * vs[..., None]).reshape(N, Q, H, D).astype(q.dtype)


def in_groups(fn, args: tuple, fills: tuple, per_item: int, budget: int):
    """fn(*args) over the leading axis of args, in sequential groups (lax.map) of as many items as `budget`
    bytes hold at `per_item` bytes each; one call when all fit. The last group is padded with `fills`. fn may
    return a tuple of arrays (each over the same leading axis)."""
    N = args[0].shape[0]
    n = min(N, max(1, budget // per_item))
    if n == N:
        return fn(*args)
    groups = -(-N // n)
    pad = lambda x, v: jnp.concatenate([x, jnp.full((groups * n - N, *x.shape[1:]), v, x.dtype)])  # noqa: E731
    out = jax.lax.map(lambda a: fn(*a), tuple(pad(x, v).reshape(groups, n, *x.shape[1:]) for x, v in zip(args, fills)))
    return jax.tree.map(lambda o: o.reshape(groups * n, *o.shape[2:])[:N], out)


def query_tiles(cu_seqlens, seq_lens, T: int, Q: int):
    """Lay each row's new tokens out in tiles of Q consecutive tokens of that row alone.

    cu_seqlens [B+1] (padding rows repeat the end), seq_lens [B] (context incl. the new tokens). Rows need
    sum(ceil(c / Q)) <= (T + B (Q-1)) // Q = N tiles. Returns
      slot [T]     each token's place in the flat [N*Q] tile layout (N*Q for padding tokens: dropped)
      row [N]      each tile's row (clipped; unused tiles are masked by `pos` < 0)
      pos [N, Q]   each query's absolute position in its sequence, -1 for an empty place."""
    B = seq_lens.shape[0]
    N = (T + B * (Q - 1)) // Q
    count = cu_seqlens[1:] - cu_seqlens[:-1]                                     # [B] new tokens per row
    tiles = (count + Q - 1) // Q                                                 # [B]
    first = jnp.cumsum(tiles) - tiles                                            # [B] a row's first tile
    t = jnp.arange(T)
    tok_row = jnp.clip(jnp.searchsorted(cu_seqlens[1:], t, side="right"), 0, B - 1)
    j = t - cu_seqlens[tok_row]                                                  # index in its row's chunk
    slot = jnp.where(t < cu_seqlens[-1], (first[tok_row] + j // Q) * Q + j % Q, N * Q)
    row = jnp.searchsorted(jnp.cumsum(tiles), jnp.arange(N), side="right")      # [N]; B: an unused tile
    used = row < B
    row = jnp.minimum(row, B - 1)
    i = (jnp.arange(N) - first[row])[:, None] * Q + jnp.arange(Q)[None, :]      # [N, Q] index in the chunk
    pos = seq_lens[row][:, None] - count[row][:, None] + i                      # causal offset: prefix + i
    return slot, row, jnp.where(used[:, None] & (i < count[row][:, None]), pos, -1)


def prefill_xla(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, *, scale=None, k_scale=None,
                v_scale=None, layer=0, gather_budget_bytes: int = GATHER_BUDGET, tile: int | None = None,
                gather: str | None = None):
    """q [T, H, D] packed new tokens (row b's are q[cu[b]:cu[b+1]], its last at position seq_lens[b] - 1);
    each sees its own sequence's context up to its position (prefix-cache hits and earlier chunks included:
    they are in the cache, and this step's K/V were written before). -> [T, H, D], zeros for padding.

    Tokens go into query tiles (`query_tiles`); a tile gathers its row's W pages once and attends with a
    causal offset mask. Padding tiles (the layout's room for ragged rows) gather block 0's pages. When the
    gathered pages and scores of all tiles would exceed `gather_budget_bytes`, tiles run in sequential
    groups (lax.map) that fit it.

    Tile size Q (`tile`, default: the rows' mean chunk T / B as a power of two, at most QUERY_TILE): the
    layout has N = (T + B (Q-1)) // Q tiles; each gathers S keys (4 KiB a key for bf16 Qwen3-0.6B) and
    computes Q * H fp32 score rows of S (written, then read by the softmax). Q = T / B balances the two: Q = 1 is the per-token gather (right
    when rows have a token or two), Q = 64 at 16384 tokens / 256 rows gathers ~1/30 of what it would."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    T, H, D = q.shape
    B = seq_lens.shape[0]
    Q = min(T, tile or min(QUERY_TILE, 1 << (-(-T // B) - 1).bit_length()))
    slot, row, pos = query_tiles(cu_seqlens_q, seq_lens, T, Q)
    N = row.shape[0]
    S = block_tables.shape[1] * k_cache.shape[1]
    fp8 = layer_scales(k_scale, v_scale, layer)
    qt = jnp.zeros((N * Q, H, D), q.dtype).at[slot].set(q, mode="drop").reshape(N, Q, H, D)
    rows = (gather or GATHER) == "rows"
    take = gather_rows if rows else gather_pages

    def tiles(qt, tables, pos):                                                  # [n, Q, H, D], [n, W], [n, Q]
        visible = jnp.arange(S)[None, None, :] <= pos[:, :, None]               # [n, Q, S]; pos -1: none
        k, v = take(k_cache, tables), take(v_cache, tables)                     # [n, S, K, D] / [n, K, S, D]
        return attend_einsum(qt, k, v, visible, scale, fp8, heads_major=rows)

    per_tile = 2 * S * k_cache.shape[2] * D * gathered_itemsize(k_cache, q) + Q * H * S * 8   # pages; scores + exp
    out = in_groups(tiles, (qt, block_tables[row], pos), (0, 0, -1), per_tile, gather_budget_bytes)   # [N, Q, H, D]
    out = jnp.take(out.reshape(N * Q, H, D), slot, axis=0, mode="fill", fill_value=0)   # back to [T, H, D]
    return out.astype(q.dtype)
