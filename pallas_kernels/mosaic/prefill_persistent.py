"""The persistent Mosaic GPU prefill (flash_prefill's default, persistent=True): grid = (P,) programs, P = min(work
items, num_programs) (default: one per SM, all SMEM allows), each looping over its work items, (unit, q tile)
pairs, with the three warpgroups of the program-per-tile kernel (flash_prefill.py; a tile's work is
prefill_body.py's). What it buys: a program per tile starts cold (tile metadata, the sequence's length, page ids,
then the copies, before its first wgmma; ~4.5 key tiles of work a program at 8 x 1024). Here the memory warpgroup
streams the K/V tiles of all the program's items through one ring (slot = the program's running key tile count
% num_stages), so the next item's first tiles are in flight while the compute warpgroups finish the current
item's last tiles and its epilogue. Each compute warpgroup starts the q copy of its item r + q_buffers once item
r's last QK^T is done (two q tiles a warpgroup when SMEM allows, so a copy has a whole item to land; else one,
landing during the epilogue), reads the next item's metadata there too (carried into the next iteration, off the
next item's start), and waits for an output store only before it reuses the output tile.

Schedule (static): work item w is (q tile w // units, unit w % units): aligned_tiles orders the tiles heaviest
first and every unit of a tile has the same work, so w runs heaviest first over all units. Program p takes one
item per round, w = r * P + p in even rounds and r * P + P - 1 - p in odd ones (a snake: the program given the
heaviest item of one round gets the lightest of the next). At 8 x 1024 and 1 x 8192 (Qwen3-0.6B, 132 programs)
no program has more than 3% above the mean key tiles; round-robin over the program-per-tile grid's unit-major
order would hand program p tiles p, p + 2, ... of every unit, up to 69-92% above. The programs of a round start
together and sweep their sequences' keys from the first tile up at the same pace, so the K/V read at any moment
is a narrow band of each kv head's (and there, a layer's whole K/V is 32 MiB, within the 50 MB L2).
The ping-pong schedule barrier runs as in the program-per-tile kernel, item by item: warpgroup 1 arrives once at
each item's start, warpgroup 0 once at its end, so both make 1 + 2 x (key tiles) arrivals an item and stay in
step; warpgroup 1's epilogue then overlaps warpgroup 0's and its next QK^T.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.mosaic._common import plgpu
from pallas_kernels.mosaic.prefill_body import (Config, Refs, Smem, attend, issue, item_rows, page_ids, smem_specs,
                                                store_out, tile_item)
from pallas_kernels.mosaic.prefill_checks import ROWS


def item_counts(num_items: int, programs: int) -> list[int]:
    """Items of each program (the kernel's count): full rounds, plus one in the last round for the first
    num_items % programs places of that round's direction."""
    rounds, rem = divmod(num_items, programs)
    return [rounds + ((p if rounds % 2 == 0 else programs - 1 - p) < rem) for p in range(programs)]


def item_index(r, p, programs: int):
    """Work item of program p's r-th item (either Python ints or traced int32)."""
    if isinstance(r, int) and isinstance(p, int):
        return r * programs + (p if r % 2 == 0 else programs - 1 - p)
    return r * programs + jnp.where(lax.rem(r, 2) == 0, p, programs - 1 - p)


def persistent_kernel(tile_seq_ref, tile_first_ref, tile_end_ref, cu_ref, lens_ref, bt_ref, q_ref, k_ref, v_ref,
                      *refs, cfg: Config, units: int, num_items: int, programs: int, q_buffers: int):
    # refs: [k_scale [L, C], v_scale [L, C], layer [1] if quantized] o [T, H, D], then the scratch (run_scoped).
    scale_refs, o_ref = (refs[:3], refs[3]) if cfg.quantized else (None, refs[0])
    gm = Refs(tile_seq_ref, tile_first_ref, tile_end_ref, cu_ref, lens_ref, bt_ref, q_ref, k_ref, v_ref, o_ref,
              scale_refs)
    wg, p = lax.axis_index("wg"), lax.axis_index("program")
    num_stages, nq = cfg.num_stages, q_buffers
    rounds, rem = divmod(num_items, programs)
    count = rounds + ((p if rounds % 2 == 0 else programs - 1 - p) < rem).astype(jnp.int32)

    def item(r):  # program p's r-th item (r >= count: the last work item, not run; its metadata is in range)
        w = jnp.minimum(item_index(r, p, programs), num_items - 1)
        return tile_item(cfg, gm, lax.div(w, units), lax.rem(w, units))

    def scoped(*scratch):
        sm = Smem(*scratch[:10], f16=tuple(scratch[10:]))

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")

            def q_buffer(r):  # this warpgroup's q tile (and its barrier) for its r-th item
                return wg * nq + (lax.rem(r, nq) if nq > 1 else 0)

            def load_q(r, it):  # starts the copy of the r-th item's q rows (if it has any)
                rw, buf = item_rows(cfg, it, wg), q_buffer(r)

                @pl.when((r < count) & it.real & (rw.n > 0))
                def _copy():
                    plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(rw.row0, ROWS), rw.head], sm.q.at[buf], sm.q_bars.at[buf])

            first = item(0)
            for r in range(nq):
                load_q(r, first if r == 0 else item(r))

            def run_item(r, carry):  # g: key tiles the program streamed before this item
                g, it = carry
                rw, buf = item_rows(cfg, it, wg), q_buffer(r)
                pl.when(it.real & (rw.n > 0))(lambda: plgpu.barrier_wait(sm.q_bars.at[buf]))
                acc, l, v_scale = attend(cfg, gm, sm, it, rw, wg, sm.q.at[buf], g)
                # Its QK^Ts are done: the buffer takes item r + nq's q. The next item's metadata is read here, while
                # the other warpgroup's last wgmma runs, and carried (item r + nq's, when nq is 2, only for its q).
                nxt = item(r + 1)
                load_q(r + nq, nxt if nq == 1 else item(r + nq))
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous item's store has read o_smem
                store_out(cfg, gm, rw, acc, l, v_scale, sm.o.at[wg])
                return g + it.num_steps, nxt

            lax.fori_loop(0, count, run_item, (jnp.int32(0), first))
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def stream(r, g):  # the r-th item's key tiles: ring tiles g, g + 1, ...
                it = item(r)

                @pl.loop(0, it.num_steps)
                def _tile(i):
                    t = g + i
                    slot = lax.rem(t, num_stages)
                    pages = page_ids(cfg, gm, it, i)  # read while the slot may still be in use

                    @pl.when(t >= num_stages)
                    def _wait():  # both compute warpgroups are done with ring tile t - num_stages
                        plgpu.barrier_wait(sm.k_free.at[slot])
                        plgpu.barrier_wait(sm.v_free.at[slot])
                    issue(cfg, gm, sm, it, i, slot, pages)
                return g + it.num_steps

            total = lax.fori_loop(0, count, stream, jnp.int32(0))

            @pl.loop(jnp.maximum(total, num_stages), total + num_stages)
            def _last(t):  # the last tiles' slots: observe their release too (barrier phases stay in step)
                slot = lax.rem(t, num_stages)
                plgpu.barrier_wait(sm.k_free.at[slot])
                plgpu.barrier_wait(sm.v_free.at[slot])

    pl.run_scoped(scoped, *smem_specs(cfg, gm, q_buffers), collective_axes="wg")
