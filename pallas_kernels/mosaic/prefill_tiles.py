"""q tiles of the Mosaic GPU prefill (flash_prefill.py): flash_attention.tile_metadata's tiles, each sequence's
windows shifted to start at a multiple of 8 rows, and the store that writes exactly a tile's rows of its window.

Why: the kernel copies a tile's q rows by TMA into an 8-row-tiled SMEM tile, and Mosaic GPU runs that copy on
GMEM viewed as 8-row tiles (TileTransform.transform_index splits a row r into r // 8, r % 8), so the first row
must be a multiple of 8: a start inside a tile reads wrong rows (Lane lowering) or makes JAX 0.11's layout
inference unsatisfiable (Warpgroup lowering). Packed sequences start anywhere (cu_seqlens_q), so a sequence's
windows of `tile_rows` rows start at its first row rounded down to 8; the up to 7 rows before it (the previous
sequence's) are computed and never stored.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.mosaic._common import plgpu


def aligned_tiles(cu_seqlens_q: jax.Array, seq_lens: jax.Array, num_tokens: int, tile_rows: int):
    """Per-q-tile (seq id, first row, end row), each [num_tiles] int32, heaviest tile first.

    The tile's window starts at first & ~7 (a multiple of 8) and spans tile_rows rows; the tile's own rows are
    [first, end). seq id B marks the padding zone [cu[-1], T) (zeros written); B + 1 marks an unused tile
    (end <= first). Same meaning as flash_attention.tile_metadata, whose windows start at the sequence's row.
    """
    batch = seq_lens.shape[0]
    # Static bound: each of the B + 1 zones adds <= 7 rows of alignment and <= 1 partial tile.
    num_tiles = pl.cdiv(num_tokens + 7 * (batch + 1), tile_rows) + batch
    cu = jnp.concatenate([jnp.clip(cu_seqlens_q, 0, num_tokens), jnp.array([num_tokens], jnp.int32)])  # [B + 2]
    start, stop = cu[:-1], cu[1:]  # [B + 1]; entry B = padding rows
    n_new = jnp.maximum(stop - start, 0)
    base = start // 8 * 8  # the zone's first window
    tiles_per_seq = jnp.where(n_new > 0, pl.cdiv(stop - base, tile_rows), 0)
    tile_end = jnp.cumsum(tiles_per_seq)
    i = jnp.arange(num_tiles, dtype=jnp.int32)
    # compare_all: one [NT, B + 1] comparison, no while loop (as tile_metadata: its condition goes through the host)
    seq = jnp.searchsorted(tile_end, i, side="right", method="compare_all").astype(jnp.int32)  # [NT] in [0, B + 1]
    seq_c = jnp.minimum(seq, batch)
    window = base[seq_c] + (i - (tile_end[seq_c] - tiles_per_seq[seq_c])) * tile_rows  # multiple of 8
    first = jnp.maximum(window, start[seq_c])  # > window only in a zone's first tile, whose window is base
    end = jnp.minimum(window + tile_rows, stop[seq_c])
    # Work of a tile ~ number of keys its last row sees; padding/unused tiles are cheapest.
    ctx_start = jnp.concatenate([seq_lens, jnp.zeros((1,), jnp.int32)])[seq_c] - n_new[seq_c]
    work = jnp.where(seq < batch, ctx_start + end - start[seq_c], -1)
    order = jnp.argsort(-work, stable=True)
    return seq[order], first[order].astype(jnp.int32), end[order].astype(jnp.int32)


def store_rows(o_smem, o_ref, skip, row0, n, head, rows: int):
    """TMA-stores rows [skip, skip + n) of o_smem [rows, D] (untiled) to o_ref[row0 + i, head], skip + n <= rows
    (rows a power of two): one copy per set bit of n (static sizes, dynamic offsets), so no row outside the tile
    is written (a tile starts or ends mid-window: the rows before `first`, the end of its sequence)."""
    size = rows
    while size:
        off = lax.bitwise_and(n, ~(2 * size - 1))  # rows covered by the larger pieces

        @pl.when(lax.bitwise_and(n, size) != 0)
        def _(off=off, size=size):
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(skip + off, size)], o_ref.at[pl.ds(row0 + off, size), head])
        size //= 2
