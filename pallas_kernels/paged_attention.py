"""Decode attention over a paged KV cache (Pallas, Triton backend): one new query token per sequence.

Design (flash-decoding):
  * grid = (K kv heads, S context splits, B sequences). One program handles ALL q heads that share its kv head
    (GQA group, padded to >= 16 rows for the tensor-core dot), so every K/V byte is read from HBM once.
  * The program walks its share of the context in tiles of `block_n` tokens; each row is gathered from its
    page through the block table inside the kernel (several pages per tile, no gathered copy in HBM).
  * Online softmax in fp32. With S > 1 each split writes a normalised partial output and its log-sum-exp; a
    tiny jnp combine merges them. S is static (from B and the max context); splits follow each row's length.
  * `order` (optional, [B]): row order[i] is the i-th sequence whose programs start. Longest contexts first
    (the engine passes rows by decreasing length) shortens the tail where a few long programs run alone: on
    the H200, the benchmark's real lengths at batch 59-256 took 2-7% less time than in arrival order.
  * `paged_attention_qkv` (the engine's decode kernel) is the same kernel fed the raw qkv projection: its
    prologue applies Qwen3's q/k RMSNorm and RoPE and writes the new token's K/V into the (aliased) cache,
    and after the context loop it folds that token into the softmax from registers.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import _common
from pallas_kernels._common import (LOG2E, NEG_BIG, acc_zeros, check_paged_inputs, context_total_operand,
                                    dot_precision, load_kv_tile, merge_splits, next_pow2, online_softmax_update,
                                    out_columns, padded_head_dim, prev_pow2)
from pallas_kernels._qkv_prologue import attend_new_token, check_qkv_inputs, new_token, norm_rope
from pallas_kernels.quant import compute_dtype, is_fp8, kv_scales, load_scales

paged_attention_reference = _common.paged_attention_reference    # plain jnp, the same contract (kept in _common)
NUM_SMS = 132  # H200; only used to pick the number of context splits.
DEFAULT_BLOCK_N = 64  # tokens per tile (4 pages of 16)
# fp8 pages (bench_kernels.py's sweep times the fp8 engine kernel at each tile choice)
DEFAULT_BLOCK_N_FP8 = 64
DEFAULT_NUM_WARPS_FP8 = 2
DEFAULT_NUM_STAGES_FP8 = 3
# 2 warps, not 4: W ran 25,556 against 24,549 tok/s on one H200; 4 stages the same as 3 but with 128 KiB of shared
# memory (docs/kernels.md).
DEFAULT_NUM_WARPS = 2
DEFAULT_NUM_STAGES = 3
MIN_TOKENS_PER_SPLIT = 512
PROGRAMS_PER_SM = 4
# Balanced splits (`context_total`): up to this many programs per SM, each row getting the splits its share of the
# batch's context needs, PROGRAMS_PER_SM per SM in all (docs/kernels.md, "Balanced splits").
BALANCED_PROGRAMS_PER_SM = 8


def choose_num_splits(batch: int, kv_heads: int, max_context: int, block_n: int = DEFAULT_BLOCK_N,
                      programs_per_sm: int | None = None) -> int:
    """Static split count: at most about `programs_per_sm` (default PROGRAMS_PER_SM) programs per SM, rounded DOWN
    to a power of two, and no split shorter than 512 tokens of the table's width (over-splitting was slower on the
    H200: docs/kernels.md)."""
    programs = batch * kv_heads
    want = max(1, (programs_per_sm or PROGRAMS_PER_SM) * NUM_SMS // programs)
    most = max(1, max_context // max(MIN_TOKENS_PER_SPLIT, block_n))
    return min(prev_pow2(want), next_pow2(most))


def _decode_kernel(seq_lens_ref, bt_ref, q_ref, k_ref, v_ref, *refs,
                   scale: float, block_size: int, group: int, rows: int, block_n: int, num_splits: int,
                   fused: bool, quantized: bool, ordered: bool, balanced: bool, eps: float):
    # refs: [6 prologue inputs if fused] [3 fp8 scale inputs if quantized] [order if ordered]
    #       [context_total if balanced] o, lse [k_out, v_out if fused]
    page_offset = 0   # fused: the layer's first page in a cache stacked over the layers (an operand)
    if fused:   # q_ref holds the raw qkv projection [B, H + 2K, D]; the caches are also (aliased) outputs
        (qw_ref, kw_ref, layer_ref, cos_ref, sin_ref, first_ref), refs = refs[:6], refs[6:]
        page_offset = first_ref[0]
    scale_refs = None
    if quantized:   # fp8 pages: k_scale [L, C], v_scale [L, C], layer [1]
        scale_refs, refs = refs[:3], refs[3:]
    kh, split, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    if ordered:   # program slot b runs row order[b]
        b, refs = refs[0][b], refs[1:]
    total_ref = None
    if balanced:
        total_ref, refs = refs[0], refs[1:]
    o_ref, lse_ref, *caches = refs
    if fused:
        k_out_ref, v_out_ref = caches
    head_dim = q_ref.shape[-1]
    seq_len = seq_lens_ref[b]
    # fused: the cache holds only the first seq_len - 1 positions; the last one is computed here
    length = jnp.maximum(seq_len - 1, 0) if fused else seq_len
    # This split's token range; splits follow the real length so the work is balanced for every sequence.
    splits = num_splits
    if balanced:   # as many splits as this row's share of the batch's context needs (the rest are empty)
        per = pl.cdiv(pl.cdiv(total_ref[0], max(1, PROGRAMS_PER_SM * NUM_SMS // k_ref.shape[2])), block_n) * block_n
        per = jnp.maximum(per, block_n)
        splits = jnp.clip(pl.cdiv(length, per), 1, num_splits)
    chunk = pl.cdiv(pl.cdiv(length, splits), block_n) * block_n
    start = split * chunk
    end = jnp.minimum(start + chunk, length)
    num_tiles = jnp.maximum(pl.cdiv(end - start, block_n), 0)

    g = jnp.arange(rows)
    head = kh * group + jnp.minimum(g, group - 1)  # [rows] padding rows repeat the last real head
    dcol = jnp.arange(head_dim)
    if fused:
        heads, kv_heads = o_ref.shape[2], k_out_ref.shape[2]
        rope = (layer_ref[0], cos_ref, sin_ref, b, eps)
        q = norm_rope(q_ref, b, head, qw_ref, *rope)  # [rows, D]
    else:
        q = q_ref[b, head[:, None], dcol[None, :]]  # [rows, D]
    cdtype = compute_dtype(q.dtype, k_ref.dtype)   # fp8 pages are converted to this in registers
    q = q.astype(cdtype)
    prec = dot_precision(cdtype)
    k_scale, v_scale = load_scales(scale_refs, kh)   # fp8 dequantisation scales of this kv head (else 1)
    qk_scale = scale * LOG2E * k_scale  # softmax in base 2; k's scale folded in

    def body(i, carry):
        acc, m, l = carry
        tok = start + i * block_n + jnp.arange(block_n)  # [N]
        valid = tok < end
        # Positions past the end read the last real row (in bounds, finite) and are masked below.
        k, v = load_kv_tile(k_ref, v_ref, bt_ref, b, kh, jnp.minimum(tok, length - 1), block_size, cdtype,
                            page_offset)
        s = plt.dot(q, k, trans_b=True, precision=prec) * qk_scale  # [rows, N] fp32
        s = jnp.where(valid[None, :], s, -jnp.inf)
        return online_softmax_update(acc, m, l, s, v, prec)

    if fused:
        # The new token's k/v are made and stored BEFORE the context loop, so their loads and store overlap
        # the q prologue's instead of adding a second wait after the loop: on the H200 256 x 1024 took 295.8
        # instead of 322.6 us, and the whole benchmark ran 25,768 against 25,147 tok/s (same machine).
        kn, vn, active = new_token(q_ref, k_out_ref, v_out_ref, kw_ref, rope, bt_ref, b, kh, heads, kv_heads, dcol,
                                   split, seq_len, block_size, (k_scale, v_scale) if quantized else None,
                                   page_offset)
    acc = acc_zeros(rows, head_dim, v_ref.dtype)   # V pages in pairs: two halves (quant.py)
    m = jnp.full((rows,), NEG_BIG, jnp.float32)
    l = jnp.zeros((rows,), jnp.float32)
    acc, m, l = jax.lax.fori_loop(0, num_tiles, body, (acc, m, l))
    if fused:
        acc, m, l = attend_new_token(acc, m, l, q, kn, vn, qk_scale, active)

    nonempty = l > 0
    norm = jnp.where(nonempty, l, 1.0)  # empty split / padding row -> zeros
    lse = jnp.where(nonempty, m + jnp.log2(jnp.where(nonempty, l, 1.0)), NEG_BIG)  # base-2 log-sum-exp
    # Padding rows hold exact copies of the last real head's row, so their (duplicate) stores write the same
    # values to the same place: no mask needed.
    for cols, part in zip(out_columns(head_dim, len(acc)), acc):
        out = part * (v_scale / norm)[:, None] if quantized else part / norm[:, None]
        o_ref[b, split, head[:, None], cols[None, :]] = out.astype(o_ref.dtype)
    lse_ref[b, split, head] = lse


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_n", "num_splits", "num_warps",
                                             "num_stages", "eps"))
def _paged_attention(q, k_cache, v_cache, block_tables, seq_lens, prologue=None, order=None, scales=None, total=None, *,
                     scale, interpret, block_n, num_splits, num_warps, num_stages, eps=0.0):
    """q [B, H, D], or with `prologue` = (q_norm [L, D], k_norm [L, D], layer [1], cos, sin, page_offset [1]) the
    raw qkv projection [B, H + 2K, D]. order [B] int32: the row each program index runs (None: row = index).
    scales: (k_scale [L, C], v_scale [L, C], layer [1]) of fp8 caches (quant.kv_scales), else None.
    total: the batch's context_total [1] int32 (balanced splits), else None."""
    _, block_size, kv_heads, head_dim = k_cache.shape
    fused = prologue is not None
    batch = q.shape[0]
    heads = q.shape[1] - 2 * kv_heads if fused else q.shape[1]
    group = heads // kv_heads
    rows = max(16, next_pow2(group))  # tensor-core dots need >= 16 rows
    # Lengths past the block table are impossible; clamping keeps every read inside the table.
    seq_lens = jnp.clip(seq_lens, 0, block_tables.shape[1] * block_size)
    part_dtype = q.dtype if num_splits == 1 else jnp.float32
    kernel = functools.partial(_decode_kernel, scale=scale, block_size=block_size, group=group, rows=rows,
                               block_n=block_n, num_splits=num_splits, fused=fused, quantized=scales is not None,
                               ordered=order is not None, balanced=total is not None, eps=eps)
    out_shape = (jax.ShapeDtypeStruct((batch, num_splits, heads, head_dim), part_dtype),  # [B, S, H, D]
                 jax.ShapeDtypeStruct((batch, num_splits, heads), jnp.float32))  # [B, S, H]
    args = (seq_lens, block_tables, q, k_cache, v_cache)
    if fused:   # the caches come back as outputs 2 and 3, in the same memory as inputs 3 and 4
        out_shape += (jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                      jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype))
        args += tuple(prologue)
    if scales is not None:
        args += tuple(scales)
    if order is not None:
        args += (order,)
    if total is not None:
        args += (total,)
    res = pl.pallas_call(
        kernel,
        grid=(kv_heads, num_splits, batch),
        out_shape=out_shape,
        input_output_aliases={3: 2, 4: 3} if fused else {},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_attention_decode",
    )(*args)
    out, lse = res[:2]
    if num_splits == 1:
        out = out[:, 0].astype(q.dtype)
    else:
        out = merge_splits(out, lse, q.dtype)
    return (out, *res[2:]) if fused else out


def paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                    seq_lens: jax.Array, *, order: jax.Array | None = None, scale: float | None = None,
                    k_scale: jax.Array | None = None, v_scale: jax.Array | None = None, layer: int | jax.Array = 0,
                    interpret: bool = False, block_n: int | None = None, num_splits: int | None = None,
                    num_warps: int | None = None, num_stages: int | None = None,
                    context_total: jax.Array | int | None = None) -> jax.Array:
    """Decode attention: q [B, H, D] (one token per sequence) over the paged cache [P, block_size, K, D].

    seq_lens[b] counts the context including the new token (already written); 0 marks a padding row (zeros out).
    order [B] int32, optional: a permutation of the rows, the order their programs start in (longest
    context first shortens the tail; rows left out of it are not computed). float8_e4m3fn caches need
    k_scale / v_scale (see quant.py: [] or [K], or [L, 1] / [L, K] with row `layer`); their V pages may come in
    pairs (quant.py: uint16 [P, block_size, K, D/2], the engine's layout, read faster: docs/fp8_kv_cache.md).
    Tile options: block_n (tokens per tile, power of two >= 16; None: the cache dtype's default), num_splits
    (context splits, None = auto), num_warps, num_stages (None: the cache dtype's defaults). Returns [B, H, D] in
    q's dtype.
    context_total (optional; int or int32 [] / [1]): the sum of seq_lens, for balanced splits: each row's context
    is then cut into as many splits as its share of the batch's work needs (up to num_splits, whose default is
    then larger), so that long and short rows' programs take about the same time. Without it every row is cut
    into num_splits equal parts. Any value gives the same result; only the speed depends on it.
    """
    if q.ndim != 3:
        raise ValueError(f"paged_attention: q must be [B, H, D], got shape {q.shape}")
    D, scale = q.shape[-1], _scale(scale, q)
    if (padded := padded_head_dim(q, k_cache, v_cache)) is not None:     # D not a power of two (_common)
        q, k_cache, v_cache = padded
    total = context_total_operand("paged_attention", context_total)
    tiles = _tiles("paged_attention", q, q.shape[1], k_cache, v_cache, block_tables, seq_lens, block_n, num_splits,
                   order, num_warps, num_stages, total is not None)
    scales = kv_scales("paged_attention", k_cache, k_scale, v_scale, layer)
    return _paged_attention(q, k_cache, v_cache, block_tables, seq_lens, order=order, scales=scales, total=total,
                            scale=scale, interpret=interpret, **tiles)[..., :D]


def paged_attention_qkv(qkv: jax.Array, q_norm: jax.Array, k_norm: jax.Array, cos: jax.Array, sin: jax.Array,
                        k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array, seq_lens: jax.Array, *,
                        eps: float, layer: int | jax.Array = 0, order: jax.Array | None = None,
                        scale: float | None = None, k_scale: jax.Array | None = None, v_scale: jax.Array | None = None,
                        scale_layer: int | jax.Array | None = None, page_offset: int = 0, interpret: bool = False,
                        block_n: int | None = None, num_splits: int | None = None, num_warps: int | None = None,
                        num_stages: int | None = None, context_total: jax.Array | int | None = None
                        ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A Qwen3 decode layer's attention, from the qkv projection to the attention output, in ONE kernel.

    qkv [B, H + 2K, D]: the new token's q heads, then k heads, then v heads (not yet normalised or rotated).
    q_norm, k_norm [D]: the per-head RMSNorm weights (epsilon `eps`), or [L, D] for all layers, of which row
    `layer` is used: a model's stacked weights go in whole, so XLA copies no per-layer slice out for the
    kernel (two copy kernels a layer otherwise). cos, sin [B, D]: RoPE tables of each row's
    position (rotate-half convention, see jaxinfer/model/layers.py). The kernel normalises and rotates q and k,
    writes k and v at position seq_lens[b] - 1 (padding rows, seq_len 0, write nothing), and attends over the
    cache plus the new token. `order`: as in paged_attention. fp8 caches: k_scale / v_scale as in paged_attention
    (row `scale_layer`, default `layer`: per-layer norm weights may come one layer at a time while the scales
    stay stacked); the new token's k/v are quantised in the kernel, and attended as stored (quantised), so this
    step sees the token as every later step will. page_offset (an int >= 0): added to every block-table entry, for
    caches that hold several layers' pages (the engine's cache stacked over the layers: layer l's pages start at
    l * P). It is an operand, not a constant of the kernel, so every layer runs the same compiled kernel.
    context_total: balanced splits, as in paged_attention.
    Returns (out [B, H, D], k_cache, v_cache); donate the caches to update in place.
    """
    K = k_cache.shape[2]
    check_qkv_inputs(qkv, q_norm, k_norm, cos, sin, K, layer, page_offset)
    heads = qkv.shape[1] - 2 * K
    total = context_total_operand("paged_attention_qkv", context_total)
    tiles = _tiles("paged_attention_qkv", qkv, heads, k_cache, v_cache, block_tables, seq_lens, block_n, num_splits,
                   order, num_warps, num_stages, total is not None)
    scales = kv_scales("paged_attention_qkv", k_cache, k_scale, v_scale, layer if scale_layer is None else scale_layer)
    q_norm, k_norm = (jnp.atleast_2d(w).astype(qkv.dtype) for w in (q_norm, k_norm))   # [L, D]
    layer = jnp.asarray(layer, jnp.int32).reshape(1)                              # a constant: no kernel
    first = jnp.asarray(page_offset, jnp.int32).reshape(1)
    norms = (q_norm, k_norm, layer, cos.astype(jnp.float32), sin.astype(jnp.float32), first)
    return _paged_attention(qkv, k_cache, v_cache, block_tables, seq_lens, norms, order, scales, total,
                            scale=_scale(scale, qkv), interpret=interpret, eps=float(eps), **tiles)


def _scale(scale, q) -> float:
    return float(q.shape[-1] ** -0.5 if scale is None else scale)


def _tiles(name, q, heads, k_cache, v_cache, block_tables, seq_lens, block_n, num_splits, order, num_warps=None,
           num_stages=None, balanced: bool = False) -> dict:
    """Validation shared by both entry points; returns the static tile choices (None: the cache dtype's default)."""
    check_paged_inputs(name, heads, q.shape[-1], q.dtype, k_cache, v_cache, block_tables, seq_lens, q.shape[0],
                       pairs=True)
    if order is not None and (order.shape != seq_lens.shape or order.dtype != jnp.int32):
        raise ValueError(f"{name}: order must be int32 of shape {seq_lens.shape} like seq_lens, got "
                         f"{order.dtype} {order.shape}")
    fp8 = is_fp8(k_cache.dtype)
    block_n = (DEFAULT_BLOCK_N_FP8 if fp8 else DEFAULT_BLOCK_N) if block_n is None else block_n
    num_warps = (DEFAULT_NUM_WARPS_FP8 if fp8 else DEFAULT_NUM_WARPS) if num_warps is None else num_warps
    num_stages = (DEFAULT_NUM_STAGES_FP8 if fp8 else DEFAULT_NUM_STAGES) if num_stages is None else num_stages
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"{name}: block_n must be a power of two >= 16, got {block_n}")
    if num_splits is None:
        num_splits = choose_num_splits(q.shape[0], k_cache.shape[2], block_tables.shape[1] * k_cache.shape[1],
                                       block_n, BALANCED_PROGRAMS_PER_SM if balanced else None)
    if num_splits < 1:
        raise ValueError(f"{name}: num_splits must be >= 1, got {num_splits}")
    return dict(block_n=block_n, num_splits=num_splits, num_warps=num_warps, num_stages=num_stages)
