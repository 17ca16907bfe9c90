"""Attention over the paged KV cache: write this step's K/V into their slots, then attend.

KV cache layout, per layer, used for both writing and reading: k and v each [num_blocks, block_size, K, D].
Token t of a step goes to flat slot `slot_mapping[t]` = block_id * block_size + offset; padding tokens
point one past the last slot and their writes are dropped.

Backends take the same arguments (the contracts of pallas_kernels/):
- "xla": plain jnp (model/xla_attention.py, model/xla_decode.py): decode as einsums over a flat list of context
  chunks (the rows' tables packed one after another, from `table_start`), prefill per query tile of one sequence
  with einsum and a causal offset mask: the readable reference, and the "XLA fusion" side of the kernel comparison.
- "pallas": the hand-written kernels (flash_attention for prefill, paged_attention for decode). In a decode
  step one kernel (paged_attention_qkv) takes the raw qkv projection, applies q/k RMSNorm and RoPE, writes the
  new token's K/V and attends: no norm, rope, slice or scatter kernels around it.

Stacked caches (`stacked_cache(backend)`: xla and pallas): the engine holds ONE k and ONE v array for all layers,
[L * P, bs, K, D], layer l's pages being rows l * P .. l * P + P - 1. Attention adds l * P to the page ids and
l * P * bs to the slots it is given, which stay per layer ([0, P) and [0, P * bs); anything past that is padding and
dropped). The xla steps and the pallas prefill steps then run the layers as one `lax.scan` (one compiled layer body
instead of L unrolled copies: warm-up 44 against 96 s for xla, 21-25 against 33 s for pallas on the H200); the
pallas decode keeps its layers unrolled, its kernel given the layer's first page as an operand.

FP8 cache (kv_cache_dtype="fp8"): the caches are float8_e4m3fn and `kv_scales` = (k_scale, v_scale) [L, 1]
(model/kv_scales.py). Writes quantise (write_kv here; the decode kernel in its own body), reads dequantise:
both backends take the stacked scales and the layer row (`k_scale=, v_scale=, layer=`) and fold them into the
scores and the output instead of converting whole pages.
"""
from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxinfer.model import xla_decode
from jaxinfer.model.xla_attention import layer_scales, prefill_xla  # noqa: F401 (re-exported)
from jaxinfer.model.xla_decode import paged_decode_xla  # noqa: F401 (re-exported)
from jaxinfer.parallel import shard_map
from jaxinfer.parallel.layout import KV_SPEC
from pallas_kernels.quant import BYTES_DTYPE, FP8_DTYPE, PAIRS_DTYPE, is_fp8, is_pairs, pack_pairs, quantize


def write_kv(k_cache, v_cache, k, v, slot_mapping, k_scale=None, v_scale=None):
    """k/v [T, K, D] into caches [P, bs, K, D] at flat slots [T]; out-of-range slots are dropped. fp8 caches:
    k / k_scale and v / v_scale ([] or [1] or [K]) are quantised first; V pages in pairs (uint16 [P, bs, K, D/2],
    `v_pages`) get each token's fp8 values packed, byte pages (uint8, `cache_dtypes`) the fp8 values' bytes."""
    if k_scale is not None:
        dtype = FP8_DTYPE if k_cache.dtype == BYTES_DTYPE else k_cache.dtype
        k, v = quantize(k, k_scale, dtype), quantize(v, v_scale, dtype)
    if is_pairs(v_cache.dtype):
        v = pack_pairs(v)
    k, v = (jax.lax.bitcast_convert_type(x, BYTES_DTYPE) if c.dtype == BYTES_DTYPE else x
            for x, c in ((k, k_cache), (v, v_cache)))
    P, bs, K, D = k_cache.shape
    Dv = v_cache.shape[-1]
    k_cache = k_cache.reshape(P * bs, K, D).at[slot_mapping].set(k, mode="drop", unique_indices=True)
    v_cache = v_cache.reshape(P * bs, K, Dv).at[slot_mapping].set(v, mode="drop", unique_indices=True)
    return k_cache.reshape(P, bs, K, D), v_cache.reshape(P, bs, K, Dv)


# Decode over long contexts: block tables wider than LONG_DECODE_TOKENS (the wide decode programs) cut each row
# into the context splits its share of the batch's context needs (the kernel's balanced splits), up to
# LONG_DECODE_SPLITS, LONG_DECODE_GRID programs and PARTIALS_BUDGET bytes of fp32 partial outputs. Batch-1 TPOT at
# 32,000 tokens on the H200: 2.97 against 4.17 ms; a full 8-row bucket of such rows pays 5% (docs/performance.md).
LONG_DECODE_TOKENS = 4096
LONG_DECODE_SPLITS = 64
LONG_DECODE_GRID = 1024
PARTIALS_BUDGET = 16 << 20


def long_decode_tiles(width_tokens: int, rows: int, heads: int, kv_heads: int, head_dim: int, context_total) -> dict:
    """paged_attention_qkv's split options for a decode program whose tables hold `width_tokens` (none: narrow);
    context_total: the sum of the step's seq_lens."""
    if width_tokens <= LONG_DECODE_TOKENS:
        return {}
    fit = min(PARTIALS_BUDGET // (rows * heads * head_dim * 4), LONG_DECODE_GRID // (rows * kv_heads))
    splits = min(LONG_DECODE_SPLITS, 1 << (max(1, fit).bit_length() - 1))
    return dict(num_splits=splits, context_total=context_total)


PAIRS_MIN_HEAD_DIM = 32   # pairs only from this head_dim on: each half-dot keeps the 16 columns Triton's dots need


def cache_dtypes(backend: str, kv_dtype, shape: tuple[int, ...], on_gpu: bool):
    """(K pages' dtype, V pages' shape, V pages' dtype) of caches whose K pages have `shape` and hold `kv_dtype`:
    fp8 of the xla backend off the GPU as bytes (BYTES_DTYPE: pallas_kernels/quant.py), else `v_pages`."""
    if backend == "xla" and is_fp8(kv_dtype) and not on_gpu:
        return BYTES_DTYPE, tuple(shape), BYTES_DTYPE
    return (kv_dtype, *v_pages(backend, shape, kv_dtype))


def v_pages(backend: str, shape: tuple[int, ...], kv_dtype) -> tuple[tuple[int, ...], object]:
    """The V cache array (shape, dtype) beside K pages of `shape` [..., D] in `kv_dtype`. The pallas backend keeps
    fp8 V pages in pairs: the same bytes as uint16 [..., D/2] (pallas_kernels/quant.py), which its kernels read
    faster than plain fp8 pages (the P.V dot's operand becomes 16-bit; W +8% on the H200: docs/fp8_kv_cache.md)."""
    if backend == "pallas" and is_fp8(kv_dtype) and shape[-1] >= PAIRS_MIN_HEAD_DIM:
        return (*shape[:-1], shape[-1] // 2), PAIRS_DTYPE
    return tuple(shape), kv_dtype


def check_backend(backend: str, model) -> None:
    """ValueError, at LLM() rather than at the first request, when the backend's kernels cannot take the model:
    cudnn, triton and mosaic tile the head dimension and need a power of two (xla and pallas take any)."""
    D = model.head_dim
    if backend not in ("xla", "pallas") and D & (D - 1):
        raise ValueError(f"attn_backend={backend!r} needs a power-of-two head_dim; this model's head_dim={D} "
                         f"(attn_backend='xla' or 'pallas' takes any)")


STACKED_BACKENDS = ("xla", "pallas")


def stacked_cache(backend: str) -> bool:
    """Whether the engine keeps this backend's KV cache as one stacked [L * P, bs, K, D] pair (see the module doc).
    cudnn, triton and mosaic keep a pair per layer: their calls take one layer's pages."""
    return backend in STACKED_BACKENDS


def cache_layout(backend: str, layers: int, shape: tuple[int, ...], itemsize: int = 2,
                 shards: int = 1) -> tuple[tuple[int, ...], int]:
    """The engine's KV cache for a backend, from one layer's page array shape [P, bs, K, D] of `itemsize`-byte
    elements, split over `shards` devices: (the shape of each k and v array, how many (k, v) pairs). Stacked: one
    pair [L * P, bs, K, D]; else L pairs of `shape`. A stacked fp8 array of 2-4 GiB a device stays per layer on the
    kernels' backend: Pallas' Triton lowering indexes an array of up to 2^32 bytes with 32-bit element offsets,
    which overflow past 2^31 one-byte elements (wider elements, or larger arrays, get exact offsets)."""
    stacked = (layers * shape[0], *shape[1:])
    overflow = backend != "xla" and itemsize == 1 and 2**31 < math.prod(stacked) // shards <= 2**32
    if stacked_cache(backend) and not overflow:
        return stacked, 1
    return tuple(shape), layers


def layer_rows(cache, layers: int, l, slot_mapping):
    """A stacked cache's layer l: (slot_mapping moved into its rows, the page offset l * P to add to page ids). Slots
    past one layer's (padding) go past the whole cache, so they stay dropped."""
    per = cache.shape[0] // layers                        # pages of one layer
    slots = cache.shape[1] * per
    return jnp.where(slot_mapping < slots, slot_mapping + l * slots, layers * slots), l * per


def attention_fns(backend: str, interpret: bool, sharded: bool = False):
    """(prefill_fn, decode_fn) for a backend; both follow the pallas_kernels contracts (sharded: run per device)."""
    if backend == "xla":
        return prefill_xla, paged_decode_xla
    if backend == "pallas":
        from jaxinfer.model.pallas_prefill import pallas_prefill  # (Mosaic GPU's prefill on Hopper, bf16 pages)
        from pallas_kernels.paged_attention import paged_attention
        return pallas_prefill(interpret, sharded), functools.partial(paged_attention, interpret=interpret)
    if backend == "cudnn":   # GPU only (config.GPU_ONLY_BACKENDS): JAX's cuDNN attention over the same cache
        from pallas_kernels.cudnn_attention import cudnn_paged_decode, cudnn_prefill
        return cudnn_prefill, cudnn_paged_decode
    if backend == "triton":  # GPU only: raw Triton decode through jax-triton; prefill is the Pallas flash kernel
        from pallas_kernels.flash_attention import flash_attention
        from pallas_kernels.triton_decode import triton_paged_decode
        return functools.partial(flash_attention, interpret=interpret), triton_paged_decode
    if backend == "mosaic":  # GPU only (Hopper): the Mosaic GPU kernels, prefill and paged decode
        from pallas_kernels.mosaic.flash_prefill import flash_prefill
        from pallas_kernels.mosaic.paged_decode import paged_decode_attention
        from pallas_kernels.mosaic.ptxas import older_ptxas_on_path
        older = older_ptxas_on_path()
        if older is None:
            return flash_prefill, paged_decode_attention
        # assembled by an older ptxas the Mosaic prefill faults (pallas_kernels/mosaic/ptxas.py): the Pallas one
        warnings.warn(f"attn_backend='mosaic': the first ptxas on PATH is {older}; the Mosaic prefill kernel "
                      "faults when built by it, so prefill runs the Pallas flash kernel. Put the CUDA toolkit's "
                      "ptxas first on PATH to use it.", stacklevel=2)
        from pallas_kernels.flash_attention import flash_attention
        return functools.partial(flash_attention, interpret=interpret), paged_decode_attention
    raise ValueError(f"attn_backend={backend!r} is not one of ('xla', 'pallas', 'cudnn', 'triton', 'mosaic')")


@dataclass(frozen=True)
class LayerAttention:
    """What the model calls for attention, per layer (qwen3.forward takes this or a plain `attend` function).

    attend(l, q, k, v, cache) -> (out, cache): q/k already normed and rotated; writes k/v and attends.
    from_qkv(l, qkv, q_norm, k_norm, row, cos, sin, eps, cache) -> (out, cache), optional: a fused path that
    takes the raw qkv projection and does q/k RMSNorm, RoPE, the K/V write and attention in one kernel; the
    model uses it when present (3 fewer kernels a layer).
    stacked_layers: L when the caches are one stacked pair for all layers (`stacked_cache`), 0 for a pair per
    layer. scan: with stacked caches, the model runs its layers as a `lax.scan` (`l` is then traced); else it
    unrolls them and threads the one pair through (the pallas decode: one CUDA graph a step stays one, and its
    kernel takes the layer's first page as an operand)."""
    attend: Callable
    from_qkv: Callable | None = None
    stacked_layers: int = 0
    scan: bool = False

    def __call__(self, l, q, k, v, cache):
        return self.attend(l, q, k, v, cache)


def paged_attention_layer(kind: str, backend: str, meta: dict, interpret: bool = False, mesh=None,
                          kv_scales=None, stacked_layers: int = 0, block_size: int = 0, padded=False) -> LayerAttention:
    """The model's attention over the paged cache for one step: write K/V, then prefill or decode attention.

    A pallas decode step also gets the fused `from_qkv` path: one kernel takes the raw qkv projection,
    applies q/k RMSNorm and RoPE, writes the new K/V and attends (paged_attention_qkv).

    mesh (axis "tp" > 1): q / k / v and the caches are split by head. The Pallas kernels then run per device
    inside shard_map on the device's own heads (a kernel cannot be partitioned by XLA); the xla backend is plain
    jnp and is partitioned by XLA like the rest of the step (every op is per head).

    kv_scales: (k_scale, v_scale) [L, 1] of an fp8 cache, else None. They travel in `meta` (replicated).

    stacked_layers = L: the caches are one stacked pair ([L * P, bs, K, D], `stacked_cache`), block_size their bs
    (the xla decode's work list is made here, before the model's scan over layers).

    padded: the pages' head dimension is wider than the model's (engine/memory.cache_head_dim); decode then takes the
    unfused path (the fused kernel's RoPE pairs dimension j with j + D/2 of the model's D)."""
    prefill_fn, decode_fn = attention_fns(backend, interpret, mesh is not None and mesh.shape["tp"] > 1)
    if kv_scales is not None:
        meta = {**meta, "k_scale": kv_scales[0], "v_scale": kv_scales[1]}
    if stacked_layers and backend not in STACKED_BACKENDS:
        raise ValueError(f"attn_backend={backend!r} takes a KV cache per layer, not a stacked one")

    def fp8_kwargs(meta, l) -> dict:
        return {} if "k_scale" not in meta else dict(k_scale=meta["k_scale"], v_scale=meta["v_scale"], layer=l)

    memo = {}       # the xla decode's work list, made once a step (at the first layer, or here when stacked)
    chunks = kind == "decode" and backend == "xla" and xla_decode.DECODE_FORM == "chunks"

    def work_list(meta, block_size):
        if "work" not in memo:
            memo["work"] = xla_decode.decode_work_list(meta["block_tables"], meta["seq_lens"], meta.get("table_start"),
                                                       block_size)
        return memo["work"]

    if chunks and stacked_layers:           # outside the scan over layers (a tracer made inside it must not leak)
        work_list(meta, block_size)

    def attn_local(meta, l, q, k, v, cache):
        D = q.shape[-1]
        if cache[0].shape[-1] != D:     # pages of a padded head dimension (memory.cache_head_dim): zeros past D
            q, k, v = (jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, cache[0].shape[-1] - D)]) for x in (q, k, v))
            o, cache = attend_pages(meta, l, q, k, v, cache, scale=D ** -0.5)
            return o[..., :D], cache
        return attend_pages(meta, l, q, k, v, cache)

    def attend_pages(meta, l, q, k, v, cache, **scale):
        scales = fp8_kwargs(meta, l)
        write_scales = layer_scales(meta["k_scale"], meta["v_scale"], l) if scales else ()
        slots, tables, work = meta["slot_mapping"], meta["block_tables"], None
        if chunks:
            work = work_list(meta, cache[0].shape[1])
        if stacked_layers:                      # this layer's rows of the stacked caches
            slots, first = layer_rows(cache[0], stacked_layers, l, slots)
            tables = tables + first
            work = None if work is None else (work[0], work[1] + first, work[2])
        k_cache, v_cache = write_kv(*cache, k, v, slots, *write_scales)
        if kind == "decode" and backend == "xla":       # flat tables: rows' pages from table_start (engine/batch.py)
            o = decode_fn(q, k_cache, v_cache, tables, meta["seq_lens"], table_start=meta.get("table_start"),
                          work=work, **scales)
        elif kind == "decode":
            o = decode_fn(q, k_cache, v_cache, tables, meta["seq_lens"], **scales, **scale)
        else:
            o = prefill_fn(q, k_cache, v_cache, tables, meta["cu_seqlens"], meta["seq_lens"], **scales, **scale)
        return o, (k_cache, v_cache)

    per_device = mesh is not None and mesh.shape["tp"] > 1 and backend != "xla"    # kernels / custom calls
    heads, kv = P(None, "tp", None), (KV_SPEC, KV_SPEC)          # [T, H, D] by head; caches by kv head

    def attn(l, q, k, v, cache):
        if not per_device:
            return attn_local(meta, l, q, k, v, cache)
        # the layer goes in as an argument: under the scan it is traced, and shard_map must not close over it
        f = lambda m, l, q, k, v, c: attn_local(m, l, q, k, v, c)
        return shard_map(f, mesh, (P(), P(), heads, heads, heads, kv), (heads, kv))(meta, jnp.asarray(l), q, k, v,
                                                                                     cache)

    if kind == "decode" and backend == "pallas" and not padded:
        from pallas_kernels.paged_attention import paged_attention_qkv
        meta = {**meta, "context_total": jnp.sum(meta["seq_lens"]).reshape(1)}   # once a step (long_decode_tiles)

        def qkv_local(meta, l, row, qkv, q_norm, k_norm, cos, sin, eps, cache):   # row b's new token: seq_lens[b] - 1
            scales = {k: v for k, v in fp8_kwargs(meta, l).items() if k != "layer"}     # stacked scales: their row is l
            first = l * (cache[0].shape[0] // stacked_layers) if stacked_layers else 0   # the layer's first page
            tables, lens = meta["block_tables"], meta["seq_lens"]
            K = cache[0].shape[2]
            tiles = long_decode_tiles(tables.shape[1] * cache[0].shape[1], qkv.shape[0], qkv.shape[1] - 2 * K, K,
                                      qkv.shape[2], meta["context_total"])
            o, k_cache, v_cache = paged_attention_qkv(qkv, q_norm, k_norm, cos, sin, *cache, tables, lens, eps=eps,
                                                      layer=row, order=meta["attn_order"], interpret=interpret,
                                                      scale_layer=l, page_offset=first, **scales, **tiles)
            return o, (k_cache, v_cache)

        def from_qkv(l, qkv, q_norm, k_norm, row, cos, sin, eps, cache):
            if not per_device:
                return qkv_local(meta, l, row, qkv, q_norm, k_norm, cos, sin, eps, cache)
            # qkv [B, tp (Hl + 2Kl), D]: a contiguous split gives each device its own [q | k | v] heads
            f = lambda m, qkv, qn, kn, cos, sin, c: qkv_local(m, l, row, qkv, qn, kn, cos, sin, eps, c)
            return shard_map(f, mesh, (P(), heads, P(), P(), P(), P(), kv), (heads, kv))(
                meta, qkv, q_norm, k_norm, cos, sin, cache)
        return LayerAttention(attn, from_qkv, stacked_layers)      # layers unrolled, l a Python int
    return LayerAttention(attn, stacked_layers=stacked_layers, scan=bool(stacked_layers))
