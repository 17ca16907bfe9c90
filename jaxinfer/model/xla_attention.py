"""The "xla" attention backend: plain jnp over the paged KV cache, written so that XLA can do its best.

It is the XLA-fusion side of the backend comparison, so it must be the best plain XLA can do, not a straw
man. What costs time here is memory traffic, and two choices decide it (docs/kernels.md, "What XLA fuses"):

- Decode (`paged_decode_xla`, one query per row) has several forms (DECODE_FORM). "einsum" gathers each row's
  W pages ([B, S, K, D] written, then read by cuBLAS: 3x the bytes). "reduce" (multiply + reduce) lets XLA fuse
  a gather into its reduction, and "reduce_per_group" avoids broadcasting K/V over the GQA group. On the H200
  XLA fused only one of the two gathers and wrote the other out in fp32, so einsum was the fastest at every
  W shape (1.8 against 2.3 and 3.6 ms a layer at 256 rows x 2048 tokens; scripts/xla_fusion_report.py --time).
  "chunks" (the default) is einsum over a flat work list: every row's context is cut into chunks of
  DECODE_CHUNK tokens, the step's chunks are numbered one after another, and each chunk attends on its own
  (max, sum, partial output), merged per row at the end. It reads the chunks the rows need, not B x W pages:
  with the engine's flat tables (engine/batch.py) the budget is the batch's total context, not its longest row.
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

_NEG = -1e30
QUERY_TILE = 64        # most prefill queries per tile (see prefill_xla)
# "chunks" (einsum over a flat list of DECODE_CHUNK-token chunks) | "einsum" (each row's W pages gathered and
# copied) | "reduce" (XLA may fuse the gather into the reductions) | "reduce_per_group" (no K/V broadcast over the
# GQA group) | "mixed" (reduce for the scores, einsum for the output). docs/kernels.md has their H200 times.
DECODE_FORM = "chunks"
DECODE_CHUNK = 256     # tokens a decode work item reads ("chunks" form): a multiple of the block size
MERGE = "scatter"      # how the "chunks" form merges a row's chunks (merge_chunks)
GATHER_BUDGET = 6 * 2**30   # bytes of gathered pages (+ prefill scores) one group of rows / tiles may take


def layer_scales(k_scale, v_scale, layer):
    """(k, v) scales [C] of `layer` from stacked [L, C] ones (C = 1 per layer, or K per kv head); None for a
    full-precision cache."""
    return None if k_scale is None else (k_scale[layer], v_scale[layer])


def gathered_itemsize(cache, q) -> int:
    """Bytes a gathered page element may take in memory: fp8 pages are converted to q's dtype for the einsums, and
    both the fp8 gather and its converted copy may be written out (counted together)."""
    item = jnp.dtype(cache.dtype).itemsize
    return item + jnp.dtype(q.dtype).itemsize if jnp.dtype(cache.dtype) == jnp.float8_e4m3fn else item


def gather_pages(cache, block_tables):
    """cache [P, bs, K, D], tables [N, W] -> [N, W*bs, K, D]."""
    g = cache[block_tables]
    return g.reshape(g.shape[0], -1, *g.shape[3:])


def _scales(fp8, shape):
    """fp8 (k_scale, v_scale) [C] -> two [K, G] arrays (`shape`) for the scores and the outputs; ones without."""
    ones = jnp.ones(shape, jnp.float32)                      # XLA folds a multiply by ones away
    if fp8 is None:
        return ones, ones
    return tuple(s.astype(jnp.float32).reshape(-1, 1) * ones for s in fp8)     # [C, 1] * [K, G]


def attend_reduce(q, k, v, visible, scale, fp8=None):
    """One query per row as multiply + reduce: q [N, H, D]; k/v [N, S, K, D] (gathered, still lazy: XLA fuses
    the gather into both reductions); visible [N, S] -> [N, H, D]. Math in fp32 (memory-bound: free)."""
    N, H, D = q.shape
    K = k.shape[2]
    qg = q.reshape(N, 1, K, H // K, D).astype(jnp.float32)                      # [N, 1, K, G, D]
    ks, vs = _scales(fp8, (K, H // K))
    s = jnp.sum(qg * k[:, :, :, None, :].astype(jnp.float32), axis=-1)        # [N, S, K, G]: reduce over D
    s = jnp.where(visible[:, :, None, None], s * (scale * ks), _NEG)
    p = jax.nn.softmax(s, axis=1)                                              # over S
    out = jnp.sum(p[..., None] * v[:, :, :, None, :].astype(jnp.float32), axis=1)  # [N, K, G, D]: reduce over S
    return (out * vs[..., None]).reshape(N, H, D).astype(q.dtype)


def attend_reduce_per_group(q, k, v, visible, scale, fp8=None):
    """attend_reduce with one pair of reductions per q head of a GQA group (G of them): K and V are never
    broadcast over the group (XLA GPU declines to fuse a broadcast whose output outgrows its operand, which
    may leave the gathered pages written out), at the price of reading them G times."""
    N, H, D = q.shape
    K = k.shape[2]
    G = H // K
    qg = q.reshape(N, K, G, D).astype(jnp.float32)
    ks, vs = _scales(fp8, (K, G))
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)                   # [N, S, K, D]
    outs = []
    for g in range(G):
        s = jnp.sum(qg[:, None, :, g] * kf, axis=-1)                          # [N, S, K]
        s = jnp.where(visible[:, :, None], s * (scale * ks[:, g]), _NEG)
        p = jax.nn.softmax(s, axis=1)
        outs.append(jnp.sum(p[..., None] * vf, axis=1) * vs[:, g, None])     # [N, K, D]
    return jnp.stack(outs, axis=2).reshape(N, H, D).astype(q.dtype)         # [N, K, G, D] -> [N, H, D]


def attend_mixed(q, k, v, visible, scale, fp8=None):
    """The scores as attend_reduce computes them (multiply + reduce over D, where XLA may fuse the K gather) and
    the output as attend_einsum's P.V GEMM over the gathered V (no fp32 copy of V): one gathered copy instead of
    two. q [N, H, D]; k/v [N, S, K, D]; visible [N, S] -> [N, H, D]."""
    N, H, D = q.shape
    K = k.shape[2]
    qg = q.reshape(N, 1, K, H // K, D).astype(jnp.float32)                      # [N, 1, K, G, D]
    ks, vs = _scales(fp8, (K, H // K))
    s = jnp.sum(qg * k[:, :, :, None, :].astype(jnp.float32), axis=-1)        # [N, S, K, G]
    s = jnp.where(visible[:, :, None, None], s * (scale * ks), _NEG)
    v = v.astype(q.dtype) if fp8 is not None else v
    p = jax.nn.softmax(s, axis=1).astype(v.dtype)                              # over S
    out = jnp.einsum("nskg,nskd->nkgd", p, v, preferred_element_type=jnp.float32)   # [N, K, G, D]
    return (out * vs[..., None]).reshape(N, H, D).astype(q.dtype)


_REDUCE_FORMS = {"reduce": attend_reduce, "reduce_per_group": attend_reduce_per_group, "mixed": attend_mixed}


def attend_einsum(q, k, v, visible, scale, fp8=None):
    """Q queries per row as two batched GEMMs: q [N, Q, H, D]; k/v [N, S, K, D]; visible [N, Q, S] ->
    [N, Q, H, D]. GQA without repeating K/V: q is viewed as [N, Q, K, G, D]. fp8 k/v are converted to q's
    dtype (fused into the gather) and the scales applied to the scores and the output."""
    N, Q, H, D = q.shape
    K = k.shape[2]
    ks, vs = _scales(fp8, (K, H // K))
    if fp8 is not None:
        k, v = k.astype(q.dtype), v.astype(q.dtype)
    qg = q.reshape(N, Q, K, H // K, D)
    s = jnp.einsum("nqkgd,nskd->nqkgs", qg, k, preferred_element_type=jnp.float32)   # [N, Q, K, G, S]
    s = jnp.where(visible[:, :, None, None, :], s * (scale * ks)[..., None], _NEG)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    out = jnp.einsum("nqkgs,nskd->nqkgd", p, v, preferred_element_type=jnp.float32)  # [N, Q, K, G, D]
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


def chunk_items(seq_lens, table_start, n_items: int, chunk_pages: int, n_pages: int, block_size: int):
    """The flat work list of a decode step: row b's context is ceil(seq_lens[b] / C) chunks of C = chunk_pages *
    block_size tokens, numbered one row after another. Returns per item
      row [N]          its row (clipped; unused items are masked by `visible`)
      pages [N, cp]    indices into the flat table (its row's pages start at table_start[row]), clipped to it
      visible [N, C]   which of its C tokens are in its row's context."""
    B = seq_lens.shape[0]
    C = chunk_pages * block_size
    count = (seq_lens + C - 1) // C                                               # [B] chunks per row
    ends = jnp.cumsum(count)
    n = jnp.arange(n_items)
    row = jnp.searchsorted(ends, n, side="right")                                 # [N]; B: an unused item
    used = row < B
    row = jnp.minimum(row, B - 1)
    j = n - (ends - count)[row]                                                   # chunk index in its row
    pages = jnp.clip(table_start[row][:, None] + j[:, None] * chunk_pages + jnp.arange(chunk_pages), 0, n_pages - 1)
    tok = j[:, None] * C + jnp.arange(C)[None, :]
    return row, pages, used[:, None] & (tok < seq_lens[row][:, None])


def attend_chunk(q, k, v, visible, scale, fp8=None):
    """One chunk per item: q [N, H, D] (its row's query); k/v [N, C, K, D]; visible [N, C] -> the chunk's softmax
    max m and sum l [N, K, G] and unnormalised output o [N, K, G, D], fp32 (two batched GEMMs, as attend_einsum)."""
    N, H, D = q.shape
    K = k.shape[2]
    ks, vs = _scales(fp8, (K, H // K))
    if fp8 is not None:
        k, v = k.astype(q.dtype), v.astype(q.dtype)
    s = jnp.einsum("nkgd,nckd->nkgc", q.reshape(N, K, H // K, D), k, preferred_element_type=jnp.float32)
    s = jnp.where(visible[:, None, None, :], s * (scale * ks)[..., None], _NEG)
    m = s.max(axis=-1)
    p = jnp.where(visible[:, None, None, :], jnp.exp(s - m[..., None]), 0.0)
    o = jnp.einsum("nkgc,nckd->nkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m, p.sum(axis=-1), o * vs[..., None]


def decode_work_list(block_tables, seq_lens, table_start, block_size: int, chunk: int | None = None):
    """The "chunks" form's work list for a step: (row [N], page ids [N, cp], visible [N, C]) of `chunk_items`, with the
    pages read from the flattened block_tables (row b's from table_start[b]). N = B * ceil(W / cp) items cover any
    rows whose tables fit (ordinary tables, or the engine's flat ones: engine/batch.py). The same for every layer:
    the engine computes it once a step. It is materialised (optimization_barrier): fused into each layer's page
    gathers instead, XLA recomputed it per gathered element, which made the call 2x slower on the H200
    (scripts/probe_xla_chunks.py)."""
    B, W = block_tables.shape
    cp = max(1, min((chunk or DECODE_CHUNK) // block_size, W))                   # pages a chunk
    flat = block_tables.reshape(-1)
    if table_start is None:
        table_start = jnp.arange(B, dtype=jnp.int32) * W
    row, pages, visible = chunk_items(seq_lens, table_start, B * -(-W // cp), cp, flat.shape[0], block_size)
    return jax.lax.optimization_barrier((row, flat[pages], visible))


def decode_chunks(q, k_cache, v_cache, work, scale, fp8, budget: int, merge: str | None = None):
    """The "chunks" decode form (see the module doc) over a step's work list (`decode_work_list`)."""
    B, H, D = q.shape
    _, bs, K, _ = k_cache.shape
    row, ids, visible = work

    def items(qi, ids, visible):                                                 # [n, H, D], [n, cp], [n, C]
        k, v = gather_pages(k_cache, ids), gather_pages(v_cache, ids)            # [n, C, K, D]
        return attend_chunk(qi, k, v, visible, scale, fp8)

    per_item = 2 * ids.shape[1] * bs * K * D * gathered_itemsize(k_cache, q)
    m, l, o = in_groups(items, (q[row], ids, visible), (0, 0, False), per_item, budget)
    return merge_chunks(row, m, l, o, B, merge or MERGE).reshape(B, H, D)


def merge_chunks(row, m, l, o, B: int, how: str):
    """Per-chunk (max m, sum l [N, K, G], output o [N, K, G, D]) -> each row's attention [B, K, G, D] (online
    softmax). Items are in row order, unused ones fully masked (m = _NEG, l = o = 0). "scatter": three scatters
    (max, add, add) by row; "sorted": the same, told the rows are sorted; "onehot": a [B, N] row-membership matrix,
    the max as a masked reduction and the sums as a GEMM."""
    if how == "onehot":
        member = row[None, :] == jnp.arange(B)[:, None]                          # [B, N]
        mx = jnp.where(member[:, :, None, None], m[None], _NEG).max(axis=1)       # [B, K, G]
        w = jnp.exp(m - mx[row])
        one = member.astype(jnp.float32)
        total = jnp.einsum("bn,nkg->bkg", one, l * w, preferred_element_type=jnp.float32)
        out = jnp.einsum("bn,nkgd->bkgd", one, o * w[..., None], preferred_element_type=jnp.float32)
    else:
        at = dict(indices_are_sorted=how == "sorted")
        mx = jnp.full((B, *m.shape[1:]), _NEG, jnp.float32).at[row].max(m, **at)
        w = jnp.exp(m - mx[row])
        total = jnp.zeros((B, *m.shape[1:]), jnp.float32).at[row].add(l * w, **at)
        out = jnp.zeros((B, *o.shape[1:]), jnp.float32).at[row].add(o * w[..., None], **at)
    return out / jnp.maximum(total, 1e-30)[..., None]


def paged_decode_xla(q, k_cache, v_cache, block_tables, seq_lens, *, scale=None, k_scale=None, v_scale=None,
                     layer=0, form: str | None = None, gather_budget_bytes: int = GATHER_BUDGET, table_start=None,
                     chunk: int | None = None, work=None, merge: str | None = None):
    """q [B, H, D], one new token per row; seq_lens [B] include it (0: a padding row, zeros out) -> [B, H, D].
    fp8 caches: stacked k_scale / v_scale [L, C] and the layer row, as the Pallas kernels take them.

    "chunks" (default) reads the chunks each row's context needs; table_start [B] (where each row's pages start
    in the flattened block_tables; default b * W) lets the engine pack rows' tables one after another, so that
    W is a budget per row on average, not the longest row's width. The other forms read all W pages of every
    row's table [B, W] (the engine then picks the narrowest width that holds the longest row). `chunk`: tokens a
    chunk (default DECODE_CHUNK, which the engine's flat tables are laid out for); `work`: the step's
    `decode_work_list`, computed here when not given (the engine gives it, computed once for all layers).

    XLA writes the gathered pages out when it cannot fuse the gather (its output larger than the cache, e.g.
    256 rows x a 40k-token width): rows (chunks) then run in groups whose copy fits `gather_budget_bytes`."""
    form = form or DECODE_FORM
    if form not in (*_REDUCE_FORMS, "einsum", "chunks"):
        raise ValueError(f"paged_decode_xla: form={form!r} is not one of {(*_REDUCE_FORMS, 'einsum', 'chunks')}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    S = block_tables.shape[1] * k_cache.shape[1]
    fp8 = layer_scales(k_scale, v_scale, layer)
    if form == "chunks":
        work = work if work is not None else decode_work_list(block_tables, seq_lens, table_start, k_cache.shape[1], chunk)
        out = decode_chunks(q, k_cache, v_cache, work, scale, fp8, gather_budget_bytes, merge)
        return jnp.where((seq_lens > 0)[:, None, None], out, 0).astype(q.dtype)

    def rows(q, tables, lens):
        visible = jnp.arange(S)[None, :] < lens[:, None]                          # [B, S]
        k, v = gather_pages(k_cache, tables), gather_pages(v_cache, tables)      # [B, S, K, D]
        if form == "einsum":
            return attend_einsum(q[:, None], k, v, visible[:, None], scale, fp8)[:, 0]
        return _REDUCE_FORMS[form](q, k, v, visible, scale, fp8)

    per_row = 2 * S * k_cache.shape[2] * k_cache.shape[3] * 4
    out = in_groups(rows, (q, block_tables, seq_lens), (0, 0, 0), per_row, gather_budget_bytes)
    return jnp.where((seq_lens > 0)[:, None, None], out, 0).astype(q.dtype)


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
                v_scale=None, layer=0, gather_budget_bytes: int = GATHER_BUDGET, tile: int | None = None):
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

    def tiles(qt, tables, pos):                                                  # [n, Q, H, D], [n, W], [n, Q]
        visible = jnp.arange(S)[None, None, :] <= pos[:, :, None]               # [n, Q, S]; pos -1: none
        k, v = gather_pages(k_cache, tables), gather_pages(v_cache, tables)     # [n, S, K, D]
        return attend_einsum(qt, k, v, visible, scale, fp8)

    per_tile = 2 * S * k_cache.shape[2] * D * gathered_itemsize(k_cache, q) + Q * H * S * 8   # pages; scores + exp
    out = in_groups(tiles, (qt, block_tables[row], pos), (0, 0, -1), per_tile, gather_budget_bytes)   # [N, Q, H, D]
    out = jnp.take(out.reshape(N * Q, H, D), slot, axis=0, mode="fill", fill_value=0)   # back to [T, H, D]
    return out.astype(q.dtype)
