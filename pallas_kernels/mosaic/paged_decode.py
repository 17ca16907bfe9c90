"""Decode attention over a paged KV cache on Pallas' Mosaic GPU backend (Hopper: TMA, mbarriers, wgmma).

The contract is pallas_kernels/paged_attention.py's `paged_attention` (q [B, H, D], caches [P, block_size, K, D],
block tables, seq_lens counting the new token, optional `order`, float8_e4m3fn pages with their k_scale / v_scale).
`interpret=True` runs it in Mosaic GPU's interpreter on the CPU (simulated SMEM, TMA and mbarriers; the wgmmas
become dots of the loaded tiles there, and register layouts are not modelled).

Design (flash-decoding, one warpgroup = 128 threads per program, no warp specialisation):
  * grid = (K kv heads, S context splits, B sequences). A program computes the GQA group of its kv head, so each
    K/V byte is read from HBM once. wgmma's M is 64 rows, a group is G (2 for Qwen3): q is laid out as
    [B*K*G8, D], each group padded to G8 = G rounded up to 8 rows (a small XLA pad), and the program copies the
    64 rows that START at its group (TMA zero-fills rows past the end). The start is a multiple of 8, as a TMA
    copy into an 8-row-tiled SMEM tile needs (Mosaic runs it on GMEM viewed as 8-row tiles: a start inside a
    tile reads wrong rows; JAX 0.11's layout inference rejects it). Rows past G belong to other heads:
    computed, never stored. That costs a 16 KiB q read per program (D=128), ~3% of a 1024-token program's K/V
    bytes and mostly L2 hits; the padded math is free in a memory-bound kernel.
  * K/V: the split's context in tiles of `block_n` tokens. A tile is block_n / block_size TMA copies, one per
    page (the page id read from the block table in GMEM), into a swizzled SMEM ring of `num_stages`
    slots; all copies of a tile arrive on one mbarrier. Tiles i+1 .. i+stages-1 are in flight while tile i is
    computed; slot i is refilled with tile i+stages as soon as tile i's wgmmas are done.
  * Scores and P.V on wgmma (fp32 accumulators), online softmax in base 2. Tokens past the split's end are
    masked with -inf; pages past the sequence's last one are clamped to it (real, finite data).
  * fp8 pages: Hopper's wgmma has no fp8 x f16 form, so each fp8 tile is converted in registers to f16 (exact for
    e4m3; Mosaic has no e4m3 -> bf16 cast) into an f16 SMEM tile that the wgmma reads; q is f16 then (as in the
    Triton kernel). The kv head's scales fold into the softmax scale (k) and the final normalisation (v).
  * Each split writes its normalised rows [G, D] and a base-2 log-sum-exp per row; the Triton kernel's jnp
    combine merges splits.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import LOG2E, NEG_BIG, check_paged_inputs, merge_splits
from pallas_kernels.mosaic._common import (DTYPES, MAX_SMEM, _interpreter, _row_layout, _tiled,  # noqa: F401
                                           _to_f16_tile, available, check_runnable, compiler_params, plgpu,
                                           wgmma_iota)
from pallas_kernels.paged_attention import choose_num_splits, paged_attention_reference
from pallas_kernels.quant import is_fp8, kv_scales, load_scales

ROWS = 64  # wgmma's M (one warpgroup); a GQA group is padded to it with neighbouring q rows
DEFAULT_BLOCK_N = 64  # tokens per tile (4 pages of 16); untuned
# 2 slots: 64 KiB of K/V + 16 KiB q + 16 KiB bf16 output rows (one split) keeps 2 programs per SM (228 KiB);
# with splits the output rows are fp32 (32 KiB) and one fits. Untuned.
DEFAULT_NUM_STAGES = 2
# available, MAX_SMEM: re-exported (tests, scripts/bench_mosaic_decode.py); listed so pyflakes sees them used
__all__ = ["available", "paged_decode_attention", "paged_decode_attention_reference", "smem_bytes", "MAX_SMEM"]


def smem_bytes(head_dim: int, block_n: int, num_stages: int, num_splits: int, fp8: bool = False) -> int:
    """SMEM of a program: q, the K/V rings (+ f16 tiles for fp8 pages), output rows, lse, Mosaic's scratch."""
    out = 2 if num_splits == 1 else 4
    kv = 2 * num_stages * block_n * head_dim * (1 if fp8 else 2) + (2 * block_n * head_dim * 2 if fp8 else 0)
    return ROWS * head_dim * (2 + out) + kv + ROWS * 4 + 3072


def _matmul(a, b_ref, shape, interpret: bool, transpose_b: bool = False):
    """a @ b (or b^T) -> fp32 [M, N] on wgmma; a: q's SMEM ref (with transpose_b) or p in registers, b: a SMEM
    ref. Reading the fresh accumulator back waits for the wgmma. (A fresh accumulator, added in registers, not
    run_state on the running one, and in interpret mode a dot of the loaded values: Mosaic GPU's interpreter has
    no run_state and its wgmma takes neither a transposed nor a register operand.)"""
    if interpret:
        a = a[...] if transpose_b else a
        dims = (((1,), (1,)), ((), ())) if transpose_b else (((1,), (0,)), ((), ()))
        return lax.dot_general(a, b_ref[...], dims, preferred_element_type=jnp.float32)

    def mma(acc_ref):
        plgpu.wgmma(acc_ref, a, plgpu.transpose_ref(b_ref, (1, 0)) if transpose_b else b_ref)
        return acc_ref[...]
    return pl.run_scoped(mma, plgpu.ACC(shape, jnp.float32))


def _on_gpu() -> bool:
    """Where the kernel can run (the CPU tests replace this to lower it for CUDA on a machine without a GPU)."""
    return jax.default_backend() == "gpu"


def _decode_kernel(lens_ref, bt_ref, q_ref, k_ref, v_ref, *refs, scale: float, block_size: int, group: int,
                   kv_heads: int, block_n: int, num_stages: int, num_splits: int, ordered: bool, quantized: bool,
                   interpret: bool):
    # refs: [k_scale [L, C], v_scale [L, C], layer [1] if quantized] [order if ordered] o [B, S, H, D],
    # lse [B, S, K, ROWS], then the scratch: q_smem [ROWS, D], k_smem / v_smem [stages, N, D], o_smem [ROWS, D],
    # lse_smem [ROWS], barriers q, k [stages], v [stages], [f16 tiles k16 / v16 [N, D] if quantized]
    scale_refs = None
    if quantized:
        scale_refs, refs = refs[:3], refs[3:]
    if ordered:
        order_ref, refs = refs[0], refs[1:]
    o_ref, lse_ref, q_smem, k_smem, v_smem, o_smem, lse_smem, q_bar, k_bar, v_bar, *f16_tiles = refs
    kh, split, b = lax.axis_index("kv_head"), lax.axis_index("split"), lax.axis_index("row")
    if ordered:  # program slot b runs row order[b]
        b = order_ref[b]
    head_dim = q_smem.shape[-1]
    length = lens_ref[b]
    # This split's token range (as in the Triton kernel: splits follow the real length, tiles of block_n).
    chunk = pl.cdiv(pl.cdiv(length, num_splits), block_n) * block_n
    start = split * chunk
    end = jnp.minimum(start + chunk, length)
    num_tiles = jnp.maximum(pl.cdiv(end - start, block_n), 0)
    last_page = jnp.maximum(pl.cdiv(length, block_size) - 1, 0)
    copies = max(1, block_n // block_size)  # TMA copies per tile (one per page, or one slice of a big page)
    rows = min(block_n, block_size)  # tokens per copy

    def page_ids(i):
        """Tile i's page ids (clamped to the row's pages), read together: one load latency, not one per page."""
        page0 = lax.div(start + i * block_n, block_size)
        return [bt_ref[b, jnp.minimum(page0 + j, last_page)] for j in range(copies)]

    def issue(i, slot, pages):
        """Starts the copies of tile i (K and V, on `pages`) into ring slot `slot`."""
        tok0 = start + i * block_n
        # A tile inside a bigger page starts at a multiple of block_n (chunks and tiles are whole tiles).
        src_rows = (pl.ds(pl.multiple_of(lax.rem(tok0, block_size), block_n), rows) if block_size > block_n
                    else pl.ds(0, rows))
        for j, page in enumerate(pages):
            dst = pl.ds(j * rows, rows)
            plgpu.copy_gmem_to_smem(k_ref.at[page, src_rows, kh], k_smem.at[slot, dst], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[page, src_rows, kh], v_smem.at[slot, dst], v_bar.at[slot])

    g8 = -(-group // 8) * 8  # rows of a group in q_ref [B*K*G8, D]
    plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(pl.multiple_of((b * kv_heads + kh) * g8, 8), ROWS)], q_smem, q_bar)
    for s in range(num_stages):
        pl.when(s < num_tiles)(lambda s=s: issue(s, s, page_ids(s)))
    plgpu.barrier_wait(q_bar)

    # Register layouts of the loop carry (wgmma's accumulator and its rows); the interpreter has no layouts.
    cast = (lambda x, layout: x) if interpret else plgpu.layout_cast
    acc = cast(jnp.full((ROWS, head_dim), 0, jnp.float32), plgpu.Layout.WGMMA)
    m = cast(jnp.full((ROWS,), NEG_BIG, jnp.float32), _row_layout())
    l = cast(jnp.full((ROWS,), 0, jnp.float32), _row_layout())
    k_scale, v_scale = load_scales(scale_refs, kh)  # fp8 dequantisation scales of this kv head (else 1.0)
    qk_scale = scale * LOG2E * k_scale  # softmax in base 2; k's scale folded in

    def body(i, carry):
        acc, m, l = carry
        slot = lax.rem(i, num_stages)
        pages = page_ids(i + num_stages)  # the refill's pages, read now: their latency hides behind this tile
        plgpu.barrier_wait(k_bar.at[slot])
        k_tile = _to_f16_tile(k_smem.at[slot], f16_tiles[0]) if quantized else k_smem.at[slot]
        s = _matmul(q_smem, k_tile, (ROWS, block_n), interpret, transpose_b=True) * qk_scale  # [ROWS, N]
        col = wgmma_iota((ROWS, block_n), 1, interpret)
        s = jnp.where(col < end - start - i * block_n, s, -jnp.inf)  # every tile holds >= 1 valid token
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
        l = l * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        p = p.astype(q_smem.dtype)
        plgpu.barrier_wait(v_bar.at[slot])
        v_tile = _to_f16_tile(v_smem.at[slot], f16_tiles[1]) if quantized else v_smem.at[slot]
        acc = acc + _matmul(p, v_tile, (ROWS, head_dim), interpret)  # waited for: the ring slot is free again
        pl.when(i + num_stages < num_tiles)(lambda: issue(i + num_stages, slot, pages))
        return acc, m_new, l

    acc, m, l = lax.fori_loop(0, num_tiles, body, (acc, m, l))
    nonempty = l > 0
    norm = jnp.where(nonempty, l, 1.0)  # an empty split (or a padding row, seq_len 0) gives zeros
    out = acc / lax.broadcast_in_dim(norm, acc.shape, [0])
    o_smem[...] = (out * v_scale if quantized else out).astype(o_smem.dtype)
    lse_smem[...] = jnp.where(nonempty, m + jnp.log(norm) * (1 / math.log(2)), NEG_BIG)  # base-2 log-sum-exp
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, group)], o_ref.at[b, split, pl.ds(kh * group, group)])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, split, kh])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("scale", "block_n", "num_splits", "num_stages", "interpret"))
def _paged_decode(q, k_cache, v_cache, block_tables, seq_lens, order=None, scales=None, *, scale, block_n,
                  num_splits, num_stages, interpret=False):
    """scales: (k_scale [L, C], v_scale [L, C], layer [1]) of fp8 caches (quant.kv_scales), else None."""
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    # Lengths past the block table are impossible; clamping keeps every page id read inside the table.
    seq_lens = jnp.clip(seq_lens, 0, block_tables.shape[1] * block_size)
    quantized = scales is not None
    cdtype = jnp.dtype(jnp.float16) if quantized else q.dtype  # what the wgmmas read
    g8 = -(-group // 8) * 8  # a group's rows padded to whole 8-row tiles: every group starts at a multiple of 8
    q_rows = q.reshape(batch, kv_heads, group, head_dim).astype(cdtype)
    if g8 != group:
        q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, g8 - group), (0, 0)))
    q_rows = q_rows.reshape(batch * kv_heads * g8, head_dim)  # [B*K*G8, D]: ROWS rows from each group's first
    # The last groups' copies run past the array: TMA zero-fills those rows, but a slice of ROWS rows needs that
    # many in the array, and the interpreter's copies must stay in bounds, so pad (one small XLA op) when needed.
    pad = ROWS - g8 if interpret else max(0, ROWS - batch * kv_heads * g8)
    if pad:
        q_rows = jnp.pad(q_rows, ((0, pad), (0, 0)))
    part_dtype = q.dtype if num_splits == 1 else jnp.float32
    tiled, ring = _tiled(cdtype, head_dim), _tiled(k_cache.dtype, head_dim)
    copies = max(1, block_n // block_size)
    scratch = [plgpu.SMEM((ROWS, head_dim), cdtype, transforms=tiled),  # q_smem
               plgpu.SMEM((num_stages, block_n, head_dim), k_cache.dtype, transforms=ring),  # k ring
               plgpu.SMEM((num_stages, block_n, head_dim), k_cache.dtype, transforms=ring),  # v ring
               plgpu.SMEM((ROWS, head_dim), part_dtype),  # o_smem
               plgpu.SMEM((ROWS,), jnp.float32),  # lse_smem
               plgpu.Barrier(num_arrivals=1),  # q
               *[plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages)] * 2]  # k, v: one per ring slot
    if quantized:  # the f16 tiles the wgmmas read
        scratch += [plgpu.SMEM((block_n, head_dim), cdtype, transforms=tiled)] * 2
    body = functools.partial(_decode_kernel, scale=scale, block_size=block_size, group=group, kv_heads=kv_heads,
                             block_n=block_n, num_stages=num_stages, num_splits=num_splits, ordered=order is not None,
                             quantized=quantized, interpret=interpret)
    args = (seq_lens, block_tables, q_rows, k_cache, v_cache) + (tuple(scales) if quantized else ())
    args += () if order is None else (order,)
    # plgpu.kernel: Mosaic GPU's pallas_call over a grid with named axes (every operand in GMEM, the scratch
    # allocated in the kernel); its interpreter reads the named axes (its program_id is always 0).
    out, lse = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((batch, num_splits, heads, head_dim), part_dtype),  # [B, S, H, D]
                  jax.ShapeDtypeStruct((batch, num_splits, kv_heads, ROWS), jnp.float32)),  # [B, S, K, 64]
        scratch_types=scratch,
        grid=(kv_heads, num_splits, batch),
        grid_names=("kv_head", "split", "row"),
        compiler_params=compiler_params(approx_math=True),
        interpret=_interpreter()() if interpret else None,
        kernel_name="mosaic_paged_decode",
    )(*args)
    if num_splits == 1:
        return out[:, 0].astype(q.dtype)
    lse = lse[..., :group].reshape(batch, num_splits, heads)  # row r of kv head k is q head k*G + r
    return merge_splits(out, lse, q.dtype)


def paged_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                           seq_lens: jax.Array, *, order: jax.Array | None = None, scale: float | None = None,
                           k_scale: jax.Array | None = None, v_scale: jax.Array | None = None,
                           layer: int | jax.Array = 0, interpret: bool = False, block_n: int | None = None,
                           num_splits: int | None = None, num_stages: int = DEFAULT_NUM_STAGES) -> jax.Array:
    """Decode attention (paged_attention's contract) on Mosaic GPU: q [B, H, D], caches [P, block_size, K, D].

    seq_lens[b] counts the context including the new token; 0 marks a padding row (zeros out). order, k_scale /
    v_scale / layer (float8_e4m3fn caches): as in paged_attention. Needs bf16/fp16 q, head_dim 64, 128 or 256 and
    block_size >= 8. block_n: tokens per tile (64, 128, 256); num_splits: context splits (None: paged_attention's
    choice); num_stages: tiles in flight. interpret: Mosaic GPU's interpreter (CPU). Returns [B, H, D], q's dtype.
    """
    name = "paged_decode_attention"
    check_runnable(name, interpret, _on_gpu(),
                   "paged_decode_attention_reference or pallas_kernels.paged_attention",
                   f"attn_backend='mosaic' needs a CUDA GPU (Mosaic GPU has no CPU mode); JAX's backend here is "
                   f"{jax.default_backend()!r}: use 'xla' or 'pallas'")
    if q.ndim != 3:
        raise ValueError(f"{name}: q must be [B, H, D], got shape {q.shape}")
    check_paged_inputs(name, q.shape[1], q.shape[-1], q.dtype, k_cache, v_cache, block_tables, seq_lens,
                       q.shape[0])
    scales = kv_scales(name, k_cache, k_scale, v_scale, layer)
    if q.dtype not in DTYPES:
        raise ValueError(f"{name}: q must be bfloat16 or float16 (wgmma), got {q.dtype}")
    head_dim, block_size = q.shape[-1], k_cache.shape[1]
    if q.shape[1] // k_cache.shape[2] > ROWS:
        raise ValueError(f"{name}: a GQA group (q heads / kv heads = {q.shape[1] // k_cache.shape[2]}) must fit "
                         f"in one {ROWS}-row wgmma tile")
    if head_dim % 64 or head_dim > 256:
        raise ValueError(f"{name}: head_dim must be 64, 128 or 256 (128-byte swizzled tiles), got {head_dim}")
    if block_size < 8:
        raise ValueError(f"{name}: block_size must be >= 8 (a page is whole 8-row SMEM tiles), got {block_size}")
    block_n = DEFAULT_BLOCK_N if block_n is None else block_n
    if block_n not in (64, 128, 256):
        raise ValueError(f"{name}: block_n must be 64, 128 or 256, got {block_n}")
    if num_stages < 1:
        raise ValueError(f"{name}: num_stages must be >= 1, got {num_stages}")
    if order is not None and (order.shape != seq_lens.shape or order.dtype != jnp.int32):
        raise ValueError(f"{name}: order must be int32 of shape {seq_lens.shape} like seq_lens, got "
                         f"{order.dtype} {order.shape}")
    if num_splits is None:
        num_splits = choose_num_splits(q.shape[0], k_cache.shape[2], block_tables.shape[1] * block_size, block_n)
    if num_splits < 1:
        raise ValueError(f"{name}: num_splits must be >= 1, got {num_splits}")
    if (need := smem_bytes(head_dim, block_n, num_stages, num_splits, is_fp8(k_cache.dtype))) > MAX_SMEM:
        raise ValueError(f"{name}: block_n={block_n} x num_stages={num_stages} at head_dim {head_dim} needs {need} "
                         f"bytes of shared memory, more than {MAX_SMEM}: use fewer stages or a smaller block_n")
    scale = float(head_dim ** -0.5 if scale is None else scale)
    return _paged_decode(q, k_cache, v_cache, block_tables, seq_lens, order, scales, scale=scale, block_n=block_n,
                         num_splits=num_splits, num_stages=num_stages, interpret=bool(interpret))


def paged_decode_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, *, scale=None, k_scale=None,
                                     v_scale=None, layer=0) -> jax.Array:
    """Plain jnp decode attention (pallas_kernels.paged_attention.paged_attention_reference)."""
    return paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, scale=scale, k_scale=k_scale,
                                     v_scale=v_scale, layer=layer)
