"""Causal varlen prefill attention over the paged KV cache on Pallas' Mosaic GPU backend (Hopper: TMA, wgmma).

The contract is flash_attention.py's `flash_attention` (packed q [T, H, D] with cu_seqlens_q, caches
[P, block_size, K, D] through block tables, seq_lens counting the cached prefix, padding rows zero, float8_e4m3fn
pages with k_scale / v_scale / layer); its jnp reference is reused, and its tile metadata (q tiles of one sequence,
heaviest first) with each window starting at a multiple of 8 rows (prefill_tiles.py says why). Design: JAX's
FA3-style attention_mgpu made paged and varlen; three warpgroups per program.
  * Two compute warpgroups, each 64 q rows (wgmma's M) of one head. Even GQA group (Qwen3: 2): two q heads of one
    kv head on the same rows, so both read each K/V tile from SMEM with the same causal work; otherwise the two
    64-row halves of a 128-row tile of one head. grid = (head units, q tiles): Mosaic runs the last axis fastest,
    so the programs in flight are mostly one kv head's q tiles, heaviest first, sharing its K/V in L2.
  * One memory warpgroup: TMA copies of K/V tiles of `block_kv` tokens, one per page (id from the block table),
    into a swizzled SMEM ring of `num_stages` slots, each refilled once both compute warpgroups released it.
  * QK^T and P.V on wgmma (fp32 accumulators), online softmax in base 2; key tiles below the diagonal unmasked,
    the ones crossing it masked with the cached-prefix offset; a schedule barrier alternates the two warpgroups'
    softmax and wgmma phases (FA3's ping-pong). A warpgroup needing fewer tiles still releases the rest.
  * A tile may start or end mid-way (its window starts up to 7 rows before its sequence; the sequence ends):
    rows go out by TMA in power-of-two pieces (64, 32, ..., 1) covering exactly the tile's rows.
  * fp8 pages: each compute warpgroup converts the tile to its own f16 SMEM tile (no fp8 x f16 wgmma) and frees
    the slot at once; q is f16, scales fold into the softmax scale and the normalisation (as in paged_decode).
  * persistent (the default, PERSISTENT): one program an SM looping over the (unit, q tile) items instead
    (prefill_persistent.py), so the next tile's K/V and q copies overlap the current tile's last key tiles and
    epilogue; on an H100 it ran 8 x 1024 6% and a mixed batch with cached prefixes 15% faster (docs/kernels.md).
The work of one tile (both kernels): prefill_body.py. Argument checks and SMEM sizing: prefill_checks.py.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.flash_attention import flash_attention_reference
from pallas_kernels.mosaic._common import MAX_SMEM, _interpreter, available, compiler_params, plgpu
from pallas_kernels.mosaic.prefill_body import (Config, Refs, Smem, attend, issue, item_rows, page_ids, smem_specs,
                                                store_out, tile_item)
from pallas_kernels.mosaic.prefill_checks import (DEFAULT_BLOCK_KV, DEFAULT_NUM_STAGES, ROWS, check_prefill_args,
                                                  smem_bytes)
from pallas_kernels.mosaic.prefill_persistent import persistent_kernel
from pallas_kernels.mosaic.prefill_tiles import aligned_tiles

PERSISTENT = True  # flash_prefill's default kernel: the persistent one (read at each call)

# Re-exported (tests, scripts/bench_mosaic_prefill.py): available is paged_decode's; MAX_SMEM, smem_bytes and the
# defaults live with the argument checks (prefill_checks.py).
__all__ = ["available", "flash_prefill", "flash_prefill_reference", "smem_bytes", "MAX_SMEM", "DEFAULT_BLOCK_KV"]


def _on_gpu() -> bool:
    """Where the kernel can run (the CPU tests replace this to lower it for CUDA on a machine without a GPU)."""
    return jax.default_backend() == "gpu"


def _prefill_kernel(tile_seq_ref, tile_first_ref, tile_end_ref, cu_ref, lens_ref, bt_ref, q_ref, k_ref, v_ref,
                    *refs, cfg: Config):
    """One program per (unit, q tile); the tile's work is prefill_body.py's."""
    # refs: [k_scale [L, C], v_scale [L, C], layer [1] if quantized] o [T, H, D], then the scratch (run_scoped).
    scale_refs, o_ref = (refs[:3], refs[3]) if cfg.quantized else (None, refs[0])
    gm = Refs(tile_seq_ref, tile_first_ref, tile_end_ref, cu_ref, lens_ref, bt_ref, q_ref, k_ref, v_ref, o_ref,
              scale_refs)
    wg = lax.axis_index("wg")
    it = tile_item(cfg, gm, lax.axis_index("tile"), lax.axis_index("unit"))
    num_stages, num_steps = cfg.num_stages, it.num_steps

    def scoped(*scratch):
        sm = Smem(*scratch[:10], f16=tuple(scratch[10:]))

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            rw = item_rows(cfg, it, wg)
            q_smem, o_smem = sm.q.at[wg], sm.o.at[wg]

            @pl.when(it.real & (rw.n > 0))
            def _load_q():
                plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(rw.row0, ROWS), rw.head], q_smem, sm.q_bars.at[wg])
                plgpu.barrier_wait(sm.q_bars.at[wg])
            acc, l, v_scale = attend(cfg, gm, sm, it, rw, wg, q_smem)
            store_out(cfg, gm, rw, acc, l, v_scale, o_smem)
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")
            for s in range(num_stages):
                pl.when(s < num_steps)(lambda s=s: issue(cfg, gm, sm, it, s, s, page_ids(cfg, gm, it, s)))

            @pl.loop(num_stages, jnp.maximum(num_steps, num_stages))
            def _refill(i):
                slot = lax.rem(i, num_stages)
                pages = page_ids(cfg, gm, it, i)  # read while the slot is still in use
                plgpu.barrier_wait(sm.k_free.at[slot])  # both compute warpgroups are done with tile i - stages
                plgpu.barrier_wait(sm.v_free.at[slot])
                issue(cfg, gm, sm, it, i, slot, pages)

            @pl.loop(jnp.maximum(num_steps, num_stages), num_steps + num_stages)
            def _last(i):  # the last tiles' slots: observe their release too (barrier phases stay in step)
                slot = lax.rem(i, num_stages)
                plgpu.barrier_wait(sm.k_free.at[slot])
                plgpu.barrier_wait(sm.v_free.at[slot])

    pl.run_scoped(scoped, *smem_specs(cfg, gm), collective_axes="wg")


@functools.partial(jax.jit, static_argnames=("scale", "block_kv", "num_stages", "pair_heads", "interpret",
                                             "persistent", "num_programs"))
def _flash_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scales=None, *, scale, block_kv,
                   num_stages, pair_heads=True, interpret=False, persistent=False, num_programs=132):
    """scales: (k_scale [L, C], v_scale [L, C], layer [1]) of fp8 caches (quant.kv_scales), else None.
    persistent: min(units x q tiles, num_programs) programs looping over the tiles (prefill_persistent.py)."""
    num_tokens, heads, head_dim = q.shape  # [T, H, D]
    _, block_size, kv_heads, _ = k_cache.shape
    batch, group = seq_lens.shape[0], heads // kv_heads
    seq_lens = jnp.clip(seq_lens, 0, block_tables.shape[1] * block_size)  # page ids stay inside the table
    heads_per_program = 2 if pair_heads and group % 2 == 0 else 1
    tile_rows = ROWS * (2 // heads_per_program)
    tile_seq, tile_first, tile_end = aligned_tiles(cu_seqlens_q, seq_lens, num_tokens, tile_rows)  # [NT] each
    quantized = scales is not None
    q_in = q.astype(jnp.float16) if quantized else q  # what the wgmmas read
    # A q copy of ROWS rows needs that many in the array (rows past T are zero-filled) and, with the SMEM tile's
    # 8-row tiling, Mosaic's TMA wants a whole number of 8-row tiles in q: pad (an XLA copy) only when not.
    # The interpreter's copies must stay inside the array: ROWS more rows there.
    padded = num_tokens + ROWS if interpret else max(ROWS, -(-num_tokens // 8) * 8)
    if padded != num_tokens:
        q_in = jnp.pad(q_in, ((0, padded - num_tokens), (0, 0), (0, 0)))
    cfg = Config(scale, block_size, group, heads_per_program, block_kv, num_stages, batch, quantized, interpret)
    kernel = functools.partial(_prefill_kernel, cfg=cfg)
    grid, grid_names, name = (heads // heads_per_program, tile_seq.shape[0]), ("unit", "tile"), "mosaic_flash_prefill"
    if persistent:
        units, num_items = grid[0], grid[0] * grid[1]
        programs = min(num_items, num_programs)
        # Two q tiles per compute warpgroup (item r + 2's q copied once item r's QK^Ts are done) when they fit.
        q_buffers = 2 if smem_bytes(head_dim, block_kv, num_stages, quantized, q_buffers=2) <= MAX_SMEM else 1
        kernel = functools.partial(persistent_kernel, cfg=cfg, units=units, num_items=num_items, programs=programs,
                                   q_buffers=q_buffers)
        grid, grid_names, name = (programs,), ("program",), name + "_persistent"
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),  # [T, H, D]; every row is stored by one program
        grid=grid,
        grid_names=grid_names,
        num_threads=3,  # two compute warpgroups, one memory warpgroup
        thread_name="wg",
        compiler_params=compiler_params(approx_math=True),
        interpret=_interpreter()() if interpret else None,
        kernel_name=name,
    )(tile_seq, tile_first, tile_end, cu_seqlens_q, seq_lens, block_tables, q_in, k_cache, v_cache,
      *(scales or ()))


def flash_prefill(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                  cu_seqlens_q: jax.Array, seq_lens: jax.Array, *, scale: float | None = None,
                  k_scale: jax.Array | None = None, v_scale: jax.Array | None = None, layer: int | jax.Array = 0,
                  interpret: bool = False, block_kv: int | None = None,
                  num_stages: int = DEFAULT_NUM_STAGES, pair_heads: bool = True, persistent: bool | None = None,
                  num_programs: int | None = None) -> jax.Array:
    """Causal prefill (flash_attention's contract) on Mosaic GPU: q [T, H, D], caches [P, block_size, K, D].

    Needs bf16/fp16 q, head_dim 64 or 128, block_size >= 8. float8_e4m3fn caches need k_scale / v_scale
    (and `layer` for stacked [L, C] scales). block_kv: key tokens per tile (64, 128, 256; None: 128, 64 for fp8
    pages); num_stages: tiles in flight (>= 2); pair_heads: two q heads of a kv head per program when the GQA
    group is even (False: FA3's two 64-row halves of one head). interpret: Mosaic GPU's interpreter on the CPU
    (threads, SMEM, TMA and mbarriers simulated; the wgmmas become dots). persistent (None: PERSISTENT, on):
    num_programs programs (None: one per SM, default_programs) each looping over q tiles (prefill_persistent.py);
    False: a program per q tile. Returns [T, H, D] in q's dtype.
    """
    scales, block_kv = check_prefill_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                                          k_scale=k_scale, v_scale=v_scale, layer=layer, block_kv=block_kv,
                                          num_stages=num_stages, interpret=interpret, on_gpu=_on_gpu())
    persistent = PERSISTENT if persistent is None else persistent
    programs = int(default_programs() if num_programs is None else num_programs) if persistent else 132
    if programs < 1:
        raise ValueError(f"flash_prefill: num_programs must be >= 1, got {num_programs}")
    head_dim = q.shape[-1]
    scale = float(head_dim ** -0.5 if scale is None else scale)
    return _flash_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scales, scale=scale,
                          block_kv=block_kv, num_stages=num_stages, pair_heads=bool(pair_heads),
                          interpret=bool(interpret), persistent=bool(persistent), num_programs=programs)


def default_programs() -> int:
    """The persistent kernel's programs: one per SM of the GPU (a program's SMEM fills an SM), else H100/H200's 132."""
    device = jax.devices()[0]
    return int(getattr(device, "core_count", 0) or 132) if device.platform == "gpu" else 132


# The plain jnp reference: the Triton kernel's (same contract), not a copy.
flash_prefill_reference = flash_attention_reference
