"""One q tile's work in the Mosaic GPU prefill, shared by its two kernels (flash_prefill.py: a program per tile;
prefill_persistent.py: a program loops over tiles): the tile's metadata, a compute warpgroup's attention over its
key tiles and its stores, the memory warpgroup's TMA copies of one key tile, and the SMEM a program allocates.

The K/V ring is indexed by the program's running count of streamed key tiles: a tile's local key tile i sits in
slot (g0 + i) % num_stages, g0 the key tiles of the program's earlier tiles (always 0 with a program per tile, and
then written as a Python 0 so that kernel's code is what it was before the persistent one existed).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import LOG2E, NEG_BIG
from pallas_kernels.mosaic._common import _row_layout, _tiled, _to_f16_tile, plgpu, wgmma_iota
from pallas_kernels.mosaic.prefill_checks import ROWS
from pallas_kernels.mosaic.prefill_tiles import store_rows
from pallas_kernels.quant import load_scales


class Config(NamedTuple):
    """The kernel's static choices (flash_prefill.py's _flash_prefill fills them in)."""
    scale: float
    block_size: int
    group: int  # q heads per kv head
    heads_per_program: int  # 2: two q heads of a kv head on the same rows; 1: two 64-row halves of one head
    block_kv: int
    num_stages: int
    batch: int
    quantized: bool
    interpret: bool

    @property
    def copies(self) -> int:  # TMA copies per key tile (one per page)
        return max(1, self.block_kv // self.block_size)

    @property
    def rows(self) -> int:  # tokens per copy
        return min(self.block_kv, self.block_size)


class Refs(NamedTuple):
    """GMEM: tile metadata [NT] x3, cu_seqlens_q [B + 1], seq_lens [B], block tables [B, W], q, caches, out, and
    the fp8 scales (k [L, C], v [L, C], layer [1]) or None."""
    tile_seq: object
    tile_first: object
    tile_end: object
    cu: object
    lens: object
    bt: object
    q: object
    k: object
    v: object
    o: object
    scales: tuple | None


class Smem(NamedTuple):
    """A program's SMEM (smem_specs): q tiles [2 * q_buffers, ROWS, D] (compute warpgroup wg's buffer j at
    wg * q_buffers + j), output tiles [2, ROWS, D], the K/V ring [num_stages, block_kv, D], their barriers."""
    q: object
    o: object
    k: object
    v: object
    q_bars: object
    k_bars: object  # tile arrived
    v_bars: object
    k_free: object  # slot consumed by both compute warpgroups
    v_free: object
    sched: object  # the ping-pong schedule
    f16: tuple  # fp8 pages: per compute warpgroup f16 K and V tiles


class Item(NamedTuple):
    """A q tile of one unit (a pair of q heads, or one head): its zone, rows [first, end), and key range."""
    real: jnp.ndarray  # a sequence's tile (else padding rows or an unused tile)
    b: jnp.ndarray  # its sequence (clamped)
    first: jnp.ndarray
    end: jnp.ndarray
    length: jnp.ndarray  # keys of the sequence (cached prefix included); 0 when not real
    q_start: jnp.ndarray  # the sequence's first q row
    ctx_start: jnp.ndarray  # absolute position of the sequence's first new token
    head0: jnp.ndarray  # the unit's first q head
    kh: jnp.ndarray
    tile_last: jnp.ndarray  # position of the tile's last row
    num_steps: jnp.ndarray  # key tiles streamed for the tile
    last_page: jnp.ndarray


class Rows(NamedTuple):
    """A compute warpgroup's 64 rows of an item (SMEM row 0 is q row row0, a multiple of 8: prefill_tiles.py)."""
    head: jnp.ndarray
    row0: jnp.ndarray
    lo: jnp.ndarray  # its rows of the tile: [lo, lo + n), SMEM rows from lo - row0
    n: jnp.ndarray
    first_pos: jnp.ndarray  # position of SMEM row 0 (rows before `first`: never stored)
    steps: jnp.ndarray  # key tiles it attends to
    full: jnp.ndarray  # of which seen by every row (unmasked)


def _dot(a, b, transpose_b: bool = False):
    """a @ b (or b^T) in fp32: the interpreter's wgmma (which reads neither a transposed nor a register operand)."""
    dims = (((1,), (1,)), ((), ())) if transpose_b else (((1,), (0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def tile_item(cfg: Config, refs: Refs, tile, unit) -> Item:
    seq, first, end = refs.tile_seq[tile], refs.tile_first[tile], refs.tile_end[tile]
    real = seq < cfg.batch  # seq == batch: the padding zone (zeros); seq > batch: an unused tile (end <= first)
    b = jnp.minimum(seq, cfg.batch - 1)
    length = jnp.where(real, refs.lens[b], 0)
    q_start = refs.cu[b]
    ctx_start = length - (refs.cu[b + 1] - q_start)
    head0 = unit * cfg.heads_per_program
    kh = lax.div(head0, cfg.group)
    tile_last = ctx_start + end - 1 - q_start
    num_steps = jnp.where(real & (end > first),
                          pl.cdiv(jnp.clip(jnp.minimum(length, tile_last + 1), 0), cfg.block_kv), 0)
    last_page = jnp.maximum(pl.cdiv(length, cfg.block_size) - 1, 0)
    return Item(real, b, first, end, length, q_start, ctx_start, head0, kh, tile_last, num_steps, last_page)


def item_rows(cfg: Config, it: Item, wg) -> Rows:
    """Compute warpgroup wg's rows: another head on the same rows (heads_per_program 2) or the next 64 rows."""
    head = it.head0 + wg if cfg.heads_per_program == 2 else it.head0
    window = lax.bitwise_and(it.first, jnp.int32(-8))
    row0 = pl.multiple_of(window if cfg.heads_per_program == 2 else window + wg * ROWS, 8)
    lo = jnp.maximum(it.first, row0)
    n = jnp.clip(jnp.minimum(it.end, row0 + ROWS) - lo, 0, ROWS)
    first_pos = it.ctx_start + row0 - it.q_start
    last_pos = jnp.minimum(first_pos + ROWS - 1, it.tile_last)
    steps = jnp.where(it.real & (n > 0),
                      pl.cdiv(jnp.clip(jnp.minimum(it.length, last_pos + 1), 0), cfg.block_kv), 0)
    full = jnp.minimum(jnp.maximum(first_pos + 1, 0) // cfg.block_kv, steps)  # tiles seen by every row
    return Rows(head, row0, lo, n, first_pos, steps, full)


def attend(cfg: Config, refs: Refs, sm: Smem, it: Item, rw: Rows, wg, q_smem, g0=0):
    """Warpgroup wg's attention of its q rows (in q_smem) over the item's key tiles, from the ring's tile g0 on,
    with the ping-pong schedule of both compute warpgroups; tiles it does not need are waited for and released.
    Returns (acc [ROWS, D] fp32 unnormalised, l [ROWS] row sums, v_scale)."""
    cast = (lambda x, layout: x) if cfg.interpret else plgpu.layout_cast  # the interpreter has no layouts
    num_stages, block_kv, quantized, interpret = cfg.num_stages, cfg.block_kv, cfg.quantized, cfg.interpret
    static_ring = isinstance(g0, int) and g0 == 0

    def slot_of(i):
        return lax.rem(i if static_ring else g0 + i, num_stages)

    def ping_pong():
        plgpu.barrier_arrive(sm.sched)
        plgpu.barrier_wait(sm.sched)

    def operand(ring, f16, free, slot):
        """Ring slot `slot` of K or V as the wgmma reads it: fp8 pages converted into this warpgroup's f16 tile
        (the slot is then released at once), else the slot itself (released after its wgmma)."""
        if f16 is None:
            return ring.at[slot]
        tile = _to_f16_tile(ring.at[slot], f16.at[wg])
        plgpu.barrier_arrive(free.at[slot])
        return tile
    k_scale, v_scale = load_scales(refs.scales, it.kh)  # fp8 dequantisation scales (else 1.0)
    qk_scale = cfg.scale * LOG2E * k_scale
    acc = cast(jnp.full((ROWS, q_smem.shape[-1]), 0, jnp.float32), plgpu.Layout.WGMMA)
    m = cast(jnp.full((ROWS,), NEG_BIG, jnp.float32), _row_layout())
    l = cast(jnp.full((ROWS,), 0, jnp.float32), _row_layout())
    pl.when(rw.steps > 0)(lambda: plgpu.barrier_wait(sm.k_bars.at[0 if static_ring else lax.rem(g0, num_stages)]))
    pl.when(wg == 1)(ping_pong)

    def step(i, carry, masked: bool):
        acc, m, l = carry
        slot = slot_of(i)
        k_tile = operand(sm.k, sm.f16[0] if quantized else None, sm.k_free, slot)

        def qk(acc_ref):  # (acc_ref None: the interpreter)
            if acc_ref is not None:
                plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_tile, (1, 0)))
            ping_pong()
            return _dot(q_smem[...], k_tile[...], transpose_b=True) if acc_ref is None else acc_ref[...]
        s = qk(None) if interpret else pl.run_scoped(qk, plgpu.ACC((ROWS, block_kv), jnp.float32))
        s = s * qk_scale  # [ROWS, BKV] fp32, base-2 logits
        if not quantized:
            plgpu.barrier_arrive(sm.k_free.at[slot])
        if masked:  # key position <= query position (the cached prefix shifts the diagonal)
            r, c = wgmma_iota(s.shape, 0, interpret), wgmma_iota(s.shape, 1, interpret)
            s = jnp.where(c + i * block_kv <= r + rw.first_pos, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        l = l * alpha + p.sum(axis=1)
        p16 = p.astype(q_smem.dtype)
        acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
        plgpu.barrier_arrive(sm.sched)  # softmax done
        plgpu.barrier_wait(sm.v_bars.at[slot])
        plgpu.barrier_wait(sm.sched)  # the tensor cores are ours
        v_tile = operand(sm.v, sm.f16[1] if quantized else None, sm.v_free, slot)

        def pv(acc_ref):  # (acc_ref None: the interpreter)
            if acc_ref is not None:
                plgpu.wgmma(acc_ref, p16, v_tile)
            nxt = i + 1  # wait for the next K tile while this wgmma runs
            pl.when(nxt < rw.steps)(lambda: plgpu.barrier_wait(sm.k_bars.at[slot_of(nxt)]))
        if interpret:
            pv(None)
            acc = acc + _dot(p16, v_tile[...])
        else:
            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
        if not quantized:
            plgpu.barrier_arrive(sm.v_free.at[slot])
        return acc, m_new, l

    def drain(i, _):  # tiles this warpgroup does not need: free their slots, keep the ping-pong in step
        slot = slot_of(i)
        plgpu.barrier_wait(sm.k_bars.at[slot])  # (every phase of a barrier is observed by its waiters)
        plgpu.barrier_wait(sm.v_bars.at[slot])
        plgpu.barrier_arrive(sm.k_free.at[slot])
        plgpu.barrier_arrive(sm.v_free.at[slot])
        ping_pong()
        ping_pong()

    carry = lax.fori_loop(0, rw.full, functools.partial(step, masked=False), (acc, m, l))
    acc, m, l = lax.fori_loop(rw.full, rw.steps, functools.partial(step, masked=True), carry)
    lax.fori_loop(rw.steps, it.num_steps, drain, None)
    pl.when(wg == 0)(ping_pong)
    return acc, l, v_scale


def store_out(cfg: Config, refs: Refs, rw: Rows, acc, l, v_scale, o_smem):
    """Normalises and TMA-stores the warpgroup's rows of the tile (the caller waits for the store)."""
    norm = jnp.where(l > 0, l, 1.0)  # padding tiles (no keys) give zeros
    out = acc / lax.broadcast_in_dim(norm, acc.shape, [0])
    o_smem[...] = (out * v_scale if cfg.quantized else out).astype(o_smem.dtype)
    plgpu.commit_smem()
    store_rows(o_smem, refs.o, jnp.clip(rw.lo - rw.row0, 0, ROWS - rw.n), rw.lo, rw.n, rw.head, ROWS)


def page_ids(cfg: Config, refs: Refs, it: Item, i):
    """Key tile i's pages, clamped (real, finite data); read together, so one load latency."""
    page0 = lax.div(i * cfg.block_kv, cfg.block_size)
    return [refs.bt[it.b, jnp.minimum(page0 + j, it.last_page)] for j in range(cfg.copies)]


def issue(cfg: Config, refs: Refs, sm: Smem, it: Item, i, slot, pages):
    """TMA copies of key tile i (K and V, one per page) into ring slot `slot`."""
    tok0 = i * cfg.block_kv
    rows = cfg.rows
    src = (pl.ds(pl.multiple_of(lax.rem(tok0, cfg.block_size), cfg.block_kv), rows) if cfg.block_size > cfg.block_kv
           else pl.ds(0, rows))  # a tile inside a bigger page starts at a multiple of block_kv
    for j, page in enumerate(pages):
        dst = pl.ds(j * rows, rows)
        plgpu.copy_gmem_to_smem(refs.k.at[page, src, it.kh], sm.k.at[slot, dst], sm.k_bars.at[slot])
        plgpu.copy_gmem_to_smem(refs.v.at[page, src, it.kh], sm.v.at[slot, dst], sm.v_bars.at[slot])


def smem_specs(cfg: Config, refs: Refs, q_buffers: int = 1) -> list:
    """run_scoped's allocations, in Smem's order."""
    head_dim, cdtype = refs.q.shape[-1], refs.q.dtype
    tiled, ring = _tiled(cdtype, head_dim), _tiled(refs.k.dtype, head_dim)
    f16 = [plgpu.SMEM((2, cfg.block_kv, head_dim), cdtype, transforms=tiled)] * 2 if cfg.quantized else []
    return [
        plgpu.SMEM((2 * q_buffers, ROWS, head_dim), cdtype, transforms=tiled),  # q of each compute warpgroup
        plgpu.SMEM((2, ROWS, head_dim), refs.o.dtype),  # output rows (plain rows: stored in pieces)
        plgpu.SMEM((cfg.num_stages, cfg.block_kv, head_dim), refs.k.dtype, transforms=ring),  # k ring
        plgpu.SMEM((cfg.num_stages, cfg.block_kv, head_dim), refs.k.dtype, transforms=ring),  # v ring
        plgpu.Barrier(num_barriers=2 * q_buffers),  # q, per compute warpgroup (and buffer)
        *[plgpu.Barrier(num_arrivals=cfg.copies, num_barriers=cfg.num_stages)] * 2,  # k, v tile arrived
        *[plgpu.Barrier(num_arrivals=2, num_barriers=cfg.num_stages)] * 2,  # k, v slot consumed by both
        plgpu.Barrier(num_arrivals=2),  # the ping-pong schedule
        *f16,
    ]
