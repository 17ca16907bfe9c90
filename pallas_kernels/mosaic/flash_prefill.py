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
Argument checks and SMEM sizing: prefill_checks.py.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import LOG2E, NEG_BIG
from pallas_kernels.flash_attention import flash_attention_reference
from pallas_kernels.mosaic._common import (MAX_SMEM, _interpreter, _row_layout, _tiled, _to_f16_tile, available,
                                           compiler_params, plgpu, wgmma_iota)
from pallas_kernels.mosaic.prefill_checks import (DEFAULT_BLOCK_KV, DEFAULT_NUM_STAGES, ROWS, check_prefill_args,
                                                  smem_bytes)
from pallas_kernels.mosaic.prefill_tiles import aligned_tiles, store_rows
from pallas_kernels.quant import load_scales

# Re-exported (tests, scripts/bench_mosaic_prefill.py): available is paged_decode's; MAX_SMEM, smem_bytes and the
# defaults live with the argument checks (prefill_checks.py).
__all__ = ["available", "flash_prefill", "flash_prefill_reference", "smem_bytes", "MAX_SMEM", "DEFAULT_BLOCK_KV"]


def _on_gpu() -> bool:
    """Where the kernel can run (the CPU tests replace this to lower it for CUDA on a machine without a GPU)."""
    return jax.default_backend() == "gpu"


def _dot(a, b, transpose_b: bool = False):
    """a @ b (or b^T) in fp32: the interpreter's wgmma (which reads neither a transposed nor a register operand)."""
    dims = (((1,), (1,)), ((), ())) if transpose_b else (((1,), (0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _prefill_kernel(tile_seq_ref, tile_first_ref, tile_end_ref, cu_ref, lens_ref, bt_ref, q_ref, k_ref, v_ref,
                    *refs, scale: float, block_size: int, group: int, heads_per_program: int, block_kv: int,
                    num_stages: int, batch: int, quantized: bool, interpret: bool):
    # refs: [k_scale [L, C], v_scale [L, C], layer [1] if quantized] o [T, H, D], then the scratch (run_scoped).
    scale_refs, o_ref = (refs[:3], refs[3]) if quantized else (None, refs[0])
    wg = lax.axis_index("wg")
    cast = (lambda x, layout: x) if interpret else plgpu.layout_cast  # the interpreter has no register layouts
    tile, unit = lax.axis_index("tile"), lax.axis_index("unit")
    seq, first, end = tile_seq_ref[tile], tile_first_ref[tile], tile_end_ref[tile]
    real = seq < batch  # seq == batch: the padding zone (zeros); seq > batch: an unused tile (end <= first)
    b = jnp.minimum(seq, batch - 1)
    length = jnp.where(real, lens_ref[b], 0)
    q_start = cu_ref[b]
    ctx_start = length - (cu_ref[b + 1] - q_start)  # absolute position of the sequence's first new token
    head0 = unit * heads_per_program
    kh = lax.div(head0, group)
    tile_last = ctx_start + end - 1 - q_start  # position of the tile's last row
    num_steps = jnp.where(real & (end > first), pl.cdiv(jnp.clip(jnp.minimum(length, tile_last + 1), 0), block_kv), 0)
    last_page = jnp.maximum(pl.cdiv(length, block_size) - 1, 0)
    copies, rows = max(1, block_kv // block_size), min(block_kv, block_size)  # TMA copies per tile, tokens each

    def scoped(q_smem2, o_smem2, k_smem, v_smem, q_bars, k_bars, v_bars, k_free, v_free, sched, *f16_tiles):
        def ping_pong():
            plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(sched)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            # Unit of this warpgroup: another head on the same rows (heads_per_program 2) or the next 64 rows.
            head = head0 + wg if heads_per_program == 2 else head0
            # SMEM row 0 is q row `row0`, a multiple of 8 (the q copy's TMA needs it: prefill_tiles.py).
            window = lax.bitwise_and(first, jnp.int32(-8))
            row0 = pl.multiple_of(window if heads_per_program == 2 else window + wg * ROWS, 8)
            lo = jnp.maximum(first, row0)  # this unit's rows of the tile: [lo, lo + n), SMEM rows from lo - row0
            n = jnp.clip(jnp.minimum(end, row0 + ROWS) - lo, 0, ROWS)
            first_pos = ctx_start + row0 - q_start  # position of SMEM row 0 (rows before `first`: never stored)
            last_pos = jnp.minimum(first_pos + ROWS - 1, tile_last)
            steps = jnp.where(real & (n > 0), pl.cdiv(jnp.clip(jnp.minimum(length, last_pos + 1), 0), block_kv), 0)
            full = jnp.minimum(jnp.maximum(first_pos + 1, 0) // block_kv, steps)  # tiles seen by every row
            q_smem, o_smem = q_smem2.at[wg], o_smem2.at[wg]

            @pl.when(real & (n > 0))
            def _load_q():
                plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(row0, ROWS), head], q_smem, q_bars.at[wg])
                plgpu.barrier_wait(q_bars.at[wg])
            k_scale, v_scale = load_scales(scale_refs, kh)  # fp8 dequantisation scales (else 1.0)
            qk_scale = scale * LOG2E * k_scale
            acc = cast(jnp.full((ROWS, q_smem.shape[-1]), 0, jnp.float32), plgpu.Layout.WGMMA)
            m = cast(jnp.full((ROWS,), NEG_BIG, jnp.float32), _row_layout())
            l = cast(jnp.full((ROWS,), 0, jnp.float32), _row_layout())
            pl.when(steps > 0)(lambda: plgpu.barrier_wait(k_bars.at[0]))
            pl.when(wg == 1)(ping_pong)

            def step(i, carry, masked: bool):
                acc, m, l = carry
                slot = lax.rem(i, num_stages)
                k_tile = k_smem.at[slot]
                if quantized:
                    k_tile = _to_f16_tile(k_tile, f16_tiles[0].at[wg])
                    plgpu.barrier_arrive(k_free.at[slot])

                def qk(acc_ref):  # (acc_ref None: the interpreter)
                    if acc_ref is not None:
                        plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_tile, (1, 0)))
                    ping_pong()
                    return _dot(q_smem[...], k_tile[...], transpose_b=True) if acc_ref is None else acc_ref[...]
                s = qk(None) if interpret else pl.run_scoped(qk, plgpu.ACC((ROWS, block_kv), jnp.float32))
                s = s * qk_scale  # [ROWS, BKV] fp32, base-2 logits
                if not quantized:
                    plgpu.barrier_arrive(k_free.at[slot])
                if masked:  # key position <= query position (the cached prefix shifts the diagonal)
                    r, c = wgmma_iota(s.shape, 0, interpret), wgmma_iota(s.shape, 1, interpret)
                    s = jnp.where(c + i * block_kv <= r + first_pos, s, -jnp.inf)
                m_new = jnp.maximum(m, s.max(axis=1))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l = l * alpha + p.sum(axis=1)
                p16 = p.astype(q_smem.dtype)
                acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
                plgpu.barrier_arrive(sched)  # softmax done
                plgpu.barrier_wait(v_bars.at[slot])
                plgpu.barrier_wait(sched)  # the tensor cores are ours
                v_tile = v_smem.at[slot]
                if quantized:
                    v_tile = _to_f16_tile(v_tile, f16_tiles[1].at[wg])
                    plgpu.barrier_arrive(v_free.at[slot])

                def pv(acc_ref):  # (acc_ref None: the interpreter)
                    if acc_ref is not None:
                        plgpu.wgmma(acc_ref, p16, v_tile)
                    nxt = i + 1  # wait for the next K tile while this wgmma runs
                    pl.when(nxt < steps)(lambda: plgpu.barrier_wait(k_bars.at[lax.rem(nxt, num_stages)]))
                if interpret:
                    pv(None)
                    acc = acc + _dot(p16, v_tile[...])
                else:
                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                if not quantized:
                    plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l

            def drain(i, _):  # tiles this warpgroup does not need: free their slots, keep the ping-pong in step
                slot = lax.rem(i, num_stages)
                plgpu.barrier_wait(k_bars.at[slot])  # (every phase of a barrier is observed by its waiters)
                plgpu.barrier_wait(v_bars.at[slot])
                plgpu.barrier_arrive(k_free.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                ping_pong()
                ping_pong()

            carry = lax.fori_loop(0, full, functools.partial(step, masked=False), (acc, m, l))
            acc, m, l = lax.fori_loop(full, steps, functools.partial(step, masked=True), carry)
            lax.fori_loop(steps, num_steps, drain, None)
            pl.when(wg == 0)(ping_pong)
            norm = jnp.where(l > 0, l, 1.0)  # padding tiles (no keys) give zeros
            out = acc / lax.broadcast_in_dim(norm, acc.shape, [0])
            o_smem[...] = (out * v_scale if quantized else out).astype(o_smem.dtype)
            plgpu.commit_smem()
            store_rows(o_smem, o_ref, jnp.clip(lo - row0, 0, ROWS - n), lo, n, head, ROWS)
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def page_ids(i):  # tile i's pages, clamped (real, finite data); read together, so one load latency
                page0 = lax.div(i * block_kv, block_size)
                return [bt_ref[b, jnp.minimum(page0 + j, last_page)] for j in range(copies)]

            def issue(i, slot, pages):
                tok0 = i * block_kv
                src = (pl.ds(pl.multiple_of(lax.rem(tok0, block_size), block_kv), rows) if block_size > block_kv
                       else pl.ds(0, rows))  # a tile inside a bigger page starts at a multiple of block_kv
                for j, page in enumerate(pages):
                    dst = pl.ds(j * rows, rows)
                    plgpu.copy_gmem_to_smem(k_ref.at[page, src, kh], k_smem.at[slot, dst], k_bars.at[slot])
                    plgpu.copy_gmem_to_smem(v_ref.at[page, src, kh], v_smem.at[slot, dst], v_bars.at[slot])

            for s in range(num_stages):
                pl.when(s < num_steps)(lambda s=s: issue(s, s, page_ids(s)))

            @pl.loop(num_stages, jnp.maximum(num_steps, num_stages))
            def _refill(i):
                slot = lax.rem(i, num_stages)
                pages = page_ids(i)  # read while the slot is still in use
                plgpu.barrier_wait(k_free.at[slot])  # both compute warpgroups are done with tile i - stages
                plgpu.barrier_wait(v_free.at[slot])
                issue(i, slot, pages)

            @pl.loop(jnp.maximum(num_steps, num_stages), num_steps + num_stages)
            def _last(i):  # the last tiles' slots: observe their release too (barrier phases stay in step)
                slot = lax.rem(i, num_stages)
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])

    head_dim, cdtype = q_ref.shape[-1], q_ref.dtype
    tiled, ring = _tiled(cdtype, head_dim), _tiled(k_ref.dtype, head_dim)
    f16 = [plgpu.SMEM((2, block_kv, head_dim), cdtype, transforms=tiled)] * 2 if quantized else []
    pl.run_scoped(
        scoped,
        plgpu.SMEM((2, ROWS, head_dim), cdtype, transforms=tiled),  # q of each compute warpgroup
        plgpu.SMEM((2, ROWS, head_dim), o_ref.dtype),  # output rows (plain rows: stored in pieces)
        plgpu.SMEM((num_stages, block_kv, head_dim), k_ref.dtype, transforms=ring),  # k ring
        plgpu.SMEM((num_stages, block_kv, head_dim), k_ref.dtype, transforms=ring),  # v ring
        plgpu.Barrier(num_barriers=2),  # q, per compute warpgroup
        *[plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages)] * 2,  # k, v tile arrived
        *[plgpu.Barrier(num_arrivals=2, num_barriers=num_stages)] * 2,  # k, v slot consumed by both
        plgpu.Barrier(num_arrivals=2),  # the ping-pong schedule
        *f16,
        collective_axes="wg",
    )


@functools.partial(jax.jit, static_argnames=("scale", "block_kv", "num_stages", "pair_heads", "interpret"))
def _flash_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scales=None, *, scale, block_kv,
                   num_stages, pair_heads=True, interpret=False):
    """scales: (k_scale [L, C], v_scale [L, C], layer [1]) of fp8 caches (quant.kv_scales), else None."""
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
    kernel = functools.partial(_prefill_kernel, scale=scale, block_size=block_size, group=group,
                               heads_per_program=heads_per_program, block_kv=block_kv, num_stages=num_stages,
                               batch=batch, quantized=quantized, interpret=interpret)
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),  # [T, H, D]; every row is stored by one program
        grid=(heads // heads_per_program, tile_seq.shape[0]),
        grid_names=("unit", "tile"),
        num_threads=3,  # two compute warpgroups, one memory warpgroup
        thread_name="wg",
        compiler_params=compiler_params(approx_math=True),
        interpret=_interpreter()() if interpret else None,
        kernel_name="mosaic_flash_prefill",
    )(tile_seq, tile_first, tile_end, cu_seqlens_q, seq_lens, block_tables, q_in, k_cache, v_cache,
      *(scales or ()))


def flash_prefill(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                  cu_seqlens_q: jax.Array, seq_lens: jax.Array, *, scale: float | None = None,
                  k_scale: jax.Array | None = None, v_scale: jax.Array | None = None, layer: int | jax.Array = 0,
                  interpret: bool = False, block_kv: int | None = None,
                  num_stages: int = DEFAULT_NUM_STAGES, pair_heads: bool = True) -> jax.Array:
    """Causal prefill (flash_attention's contract) on Mosaic GPU: q [T, H, D], caches [P, block_size, K, D].

    Needs bf16/fp16 q, head_dim 64 or 128, block_size >= 8. float8_e4m3fn caches need k_scale / v_scale
    (and `layer` for stacked [L, C] scales). block_kv: key tokens per tile (64, 128, 256; None: 128, 64 for fp8
    pages); num_stages: tiles in flight (>= 2); pair_heads: two q heads of a kv head per program when the GQA
    group is even (False: FA3's two 64-row halves of one head). interpret: Mosaic GPU's interpreter on the CPU
    (threads, SMEM, TMA and mbarriers simulated; the wgmmas become dots). Returns [T, H, D] in q's dtype.
    """
    scales, block_kv = check_prefill_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                                          k_scale=k_scale, v_scale=v_scale, layer=layer, block_kv=block_kv,
                                          num_stages=num_stages, interpret=interpret, on_gpu=_on_gpu())
    head_dim = q.shape[-1]
    scale = float(head_dim ** -0.5 if scale is None else scale)
    return _flash_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scales, scale=scale,
                          block_kv=block_kv, num_stages=num_stages, pair_heads=bool(pair_heads),
                          interpret=bool(interpret))


# The plain jnp reference: the Triton kernel's (same contract), not a copy.
flash_prefill_reference = flash_attention_reference
