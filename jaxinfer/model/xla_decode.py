"""The xla backend's decode (`paged_decode_xla`, one query per row): plain jnp over the paged KV cache.

Several forms (DECODE_FORM). "einsum" gathers each row's W pages ([B, S, K, D] written, then read by cuBLAS: 3x
the bytes). "reduce" (multiply + reduce) lets XLA fuse a gather into its reduction, and "reduce_per_group" avoids
broadcasting K/V over the GQA group. On the H200 XLA fused only one of the two gathers and wrote the other out in
fp32, so einsum was the fastest of these at every W shape (1.8 against 2.3 and 3.6 ms a layer at 256 rows x 2048
tokens; scripts/xla_fusion_report.py --time). "chunks" (the default) is einsum over a flat work list: every row's
context is cut into chunks of DECODE_CHUNK tokens, the step's chunks are numbered one after another, and each
chunk attends on its own (max, sum, partial output), merged per row at the end. It reads the chunks the rows
need, not B x W pages: with the engine's flat tables (engine/batch.py) the budget is the batch's total context,
not its longest row (docs/kernels.md, "What XLA fuses").

Shapes: B rows, W block-table width, S = W * block_size keys, H q heads, K kv heads (G = H // K), D head dim;
chunks of C = cp * block_size tokens, N work items. Block tables index the cache [P, bs, K, D].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.model import xla_attention as xa
from jaxinfer.model.xla_attention import (GATHER_BUDGET, _NEG, _scales, attend_einsum, gather_pages, gather_rows,
                                          gathered_itemsize, in_groups, layer_scales)

# "chunks" (einsum over a flat list of DECODE_CHUNK-token chunks) | "einsum" (each row's W pages gathered and
# copied) | "reduce" (XLA may fuse the gather into the reductions) | "reduce_per_group" (no K/V broadcast over the
# GQA group) | "mixed" (reduce for the scores, einsum for the output). docs/kernels.md has their H200 times.
DECODE_FORM = "chunks"
DECODE_CHUNK = 128     # tokens a decode work item reads ("chunks" form): a multiple of the block size; W on the H200:
                       # 6,214 tok/s with 128 against 6,092 with 256 (docs/performance.md, seventeenth run)
MERGE = "scatter"      # how the "chunks" form merges a row's chunks (merge_chunks)


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


def attend_chunk(q, k, v, visible, scale, fp8=None, heads_major: bool = False):
    """One chunk per item: q [N, H, D] (its row's query); k/v [N, C, K, D] ([N, K, C, D] if heads_major);
    visible [N, C] -> the chunk's softmax max m and sum l [N, K, G] and unnormalised output o [N, K, G, D], fp32
    (two batched GEMMs, as attend_einsum)."""
    N, H, D = q.shape
    K = k.shape[1 if heads_major else 2]
    kv = "nkcd" if heads_major else "nckd"
    ks, vs = _scales(fp8, (K, H // K))
    if fp8 is not None:
        k, v = k.astype(q.dtype), v.astype(q.dtype)
    s = jnp.einsum(f"nkgd,{kv}->nkgc", q.reshape(N, K, H // K, D), k, preferred_element_type=jnp.float32)
    s = jnp.where(visible[:, None, None, :], s * (scale * ks)[..., None], _NEG)
    m = s.max(axis=-1)
    p = jnp.where(visible[:, None, None, :], jnp.exp(s - m[..., None]), 0.0)
    o = jnp.einsum(f"nkgc,{kv}->nkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
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


def decode_chunks(q, k_cache, v_cache, work, scale, fp8, budget: int, merge: str | None = None,
                  gather: str | None = None):
    """The "chunks" decode form (see the module doc) over a step's work list (`decode_work_list`)."""
    B, H, D = q.shape
    _, bs, K, _ = k_cache.shape
    row, ids, visible = work
    rows = (gather or xa.GATHER) == "rows"
    take = gather_rows if rows else gather_pages

    def items(qi, ids, visible):                                                 # [n, H, D], [n, cp], [n, C]
        k, v = take(k_cache, ids), take(v_cache, ids)                            # [n, C, K, D] / [n, K, C, D]
        return attend_chunk(qi, k, v, visible, scale, fp8, heads_major=rows)

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
                     chunk: int | None = None, work=None, merge: str | None = None, gather: str | None = None):
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
        if work is None:
            work = decode_work_list(block_tables, seq_lens, table_start, k_cache.shape[1], chunk)
        out = decode_chunks(q, k_cache, v_cache, work, scale, fp8, gather_budget_bytes, merge, gather)
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
