"""The "cudnn" attention backend: JAX's cuDNN fused attention over the paged KV cache, in the kernels' contract.

Not a hand kernel: the vendor library, as JAX exposes it, for the comparison (docs/kernels.md, "cuDNN").

- Decode (`cudnn_paged_decode`): cuDNN's paged attention reads the pages through the block table itself, as
  our kernels do. `jax.nn.dot_product_attention` has no page tables; JAX's private
  `jax._src.cudnn.fused_attention_stablehlo.paged_attention` has, but its shape check wants a pool of exactly
  B x W pages (one private set per row), while the engine's pool is shared. cuDNN itself takes any pool (its
  K container is `[num_blocks, K, block_size, D]`, independent of the batch), so `mode="pool"` calls the
  function underneath that check (`_dot_product_attention`) with the engine's whole cache (a JAX whose private
  signature differs gets a warning and the gather path). `mode="gather"` is the public-API fallback: gather
  each row's pages into a dense [B, S, K, D] copy and run `jax.nn.dot_product_attention(...,
  implementation="cudnn")` with the rows' lengths (one copy of the pages).
- Prefill (`cudnn_prefill`): JAX exposes only top-left-aligned causal masks, and a chunk after a cached prefix
  needs bottom-right alignment. So the new tokens are cut into query tiles of one sequence (the Pallas
  kernel's `tile_metadata`), each tile gathers its row's pages and attends with
  `jax.nn.dot_product_attention(implementation="cudnn")` under an explicit causal-offset mask (cuDNN turns
  it into a bias), and key lengths cut each tile at its last position.

What cuDNN cannot take raises a ValueError saying so: no CPU (it is a CUDA library; use attn_backend="xla"
or "pallas"), no fp8 cache (its paged API refuses fp8), only fp16/bf16, head_dim a multiple of 8 and <= 256.
Shapes: T tokens, B rows, W table width, S = W * block_size, H q heads, K kv heads, D head dim, C tile rows.
"""
from __future__ import annotations

import inspect
import warnings

import jax
import jax.numpy as jnp

from pallas_kernels._common import check_cu_seqlens, check_paged_inputs
from pallas_kernels.flash_attention import tile_metadata

DEFAULT_DECODE_MODE = "pool"      # "pool": cuDNN reads the engine's pool; "gather": dense copy of the pages
DEFAULT_BLOCK_Q = 128             # prefill query tile (tensor-core rows)
GATHER_BUDGET_BYTES = 2**30       # prefill tiles whose gathered pages exceed this run in sequential groups
# jax.nn.dot_product_attention's implementation: tests set "xla" to check this file's tiling and masks on a CPU
# (mode="gather" and prefill; the pool path is cuDNN's alone)
IMPLEMENTATION = "cudnn"
_PRIVATE_ARGS = ("query", "key", "value", "bias", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets",
                 "page_table_k", "page_table_v", "scale", "seed", "dropout_rate", "variadic_args", "mask_type",
                 "layout", "sliding_window_length", "cudnn_version", "return_residual")


def check_cudnn(name: str, q, k_cache, k_scale=None) -> None:
    """ValueError naming what cuDNN cannot take: no GPU, an fp8 cache, fp32, head dims."""
    if jax.default_backend() != "gpu" and IMPLEMENTATION == "cudnn":
        raise ValueError(f"{name}: attn_backend='cudnn' needs a CUDA GPU (cuDNN), JAX's backend here is "
                         f"{jax.default_backend()!r}: use attn_backend='xla' or 'pallas'")
    if k_scale is not None or jnp.dtype(k_cache.dtype).itemsize == 1:
        raise ValueError(f"{name}: cuDNN's paged attention does not read an fp8 KV cache ({k_cache.dtype}): use "
                         f"attn_backend='pallas' or 'xla' with kv_cache_dtype='fp8'")
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"{name}: cuDNN attention takes bfloat16 or float16, got {q.dtype} (dtype='bfloat16')")
    D = q.shape[-1]
    if D % 8 or D > 256:
        raise ValueError(f"{name}: cuDNN attention needs head_dim a multiple of 8 and <= 256, got {D}")


def _fa():
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa
    except ImportError as e:   # the module moved: say which JAX lacks it
        raise ValueError(f"attn_backend='cudnn': JAX {jax.__version__} has no jax._src.cudnn.fused_attention_"
                         f"stablehlo ({e})") from None
    return fa


def _paged_pool(q4, k_cache, v_cache, tables, q_lens, kv_lens, scale):
    """cuDNN paged attention over the whole pool: q4 [B, T, H, D], tables [B, W] -> [B, T, H, D].
    The public wrapper's only objection is the pool size (see the module doc); this is its body without it."""
    fa = _fa()
    B, W = tables.shape
    pt = tables.reshape(B, 1, W, 1)
    if k_cache.shape[0] == B * W:   # the pool the public wrapper accepts
        return fa.paged_attention(q4, k_cache, v_cache, q_lens, kv_lens, pt, pt, scale=scale,
                                  mask_type=fa.MaskType.PADDING)
    params = tuple(inspect.signature(fa._dot_product_attention).parameters)
    if params != _PRIVATE_ARGS:   # another JAX: take the public route rather than guess its arguments
        warnings.warn(f"cudnn_paged_decode: JAX {jax.__version__}'s private cuDNN call takes {params}, not the "
                      f"arguments this file knows; decoding with mode='gather' (a dense copy of the pages)")
        return None
    none = jnp.zeros(0, q4.dtype)
    return fa._dot_product_attention(q4, k_cache, v_cache, none, q_lens, kv_lens, none, none, pt, pt, scale, 42,
                                     0.0, (False, False), fa.MaskType.PADDING, fa.AttentionLayout.BTNH.value, None,
                                     fa.check_cudnn_version(), False)


def cudnn_paged_decode(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                       seq_lens: jax.Array, *, scale: float | None = None, k_scale=None, v_scale=None, layer=0,
                       mode: str | None = None) -> jax.Array:
    """Decode attention (paged_attention's contract): q [B, H, D], one new token per row, over the cache
    [P, block_size, K, D]; seq_lens [B] include the new token (0: a padding row, zeros out) -> [B, H, D].
    mode: "pool" (cuDNN reads the pages through the table) or "gather" (public API on a dense copy)."""
    check_cudnn("cudnn_paged_decode", q, k_cache, k_scale)
    B, H, D = q.shape
    check_paged_inputs("cudnn_paged_decode", H, D, q.dtype, k_cache, v_cache, block_tables, seq_lens, B)
    scale = float(D ** -0.5 if scale is None else scale)
    kv_lens = jnp.maximum(seq_lens, 1)            # a padding row reads one key, and is zeroed below
    ones = jnp.ones((B,), jnp.int32)
    mode = mode or DEFAULT_DECODE_MODE
    if mode not in ("pool", "gather"):
        raise ValueError(f"cudnn_paged_decode: mode={mode!r} is not 'pool' or 'gather'")
    out = _paged_pool(q[:, None], k_cache, v_cache, block_tables, ones, kv_lens, scale) if mode == "pool" else None
    if out is not None:
        out = out[:, 0]
    else:
        k, v = (c[block_tables].reshape(B, -1, *c.shape[2:]) for c in (k_cache, v_cache))   # [B, S, K, D]
        out = jax.nn.dot_product_attention(q[:, None], k, v, scale=scale, query_seq_lengths=ones,
                                           key_value_seq_lengths=kv_lens, implementation=IMPLEMENTATION)[:, 0]
    return jnp.where((seq_lens > 0)[:, None, None], out, 0).astype(q.dtype)


def cudnn_prefill(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                  cu_seqlens_q: jax.Array, seq_lens: jax.Array, *, scale: float | None = None, k_scale=None,
                  v_scale=None, layer=0, block_q: int = DEFAULT_BLOCK_Q,
                  gather_budget_bytes: int = GATHER_BUDGET_BYTES) -> jax.Array:
    """Causal prefill (flash_attention's contract): packed new tokens q [T, H, D], row b's are
    q[cu[b]:cu[b+1]] at positions seq_lens[b] - n_new .. seq_lens[b] - 1, over the paged cache -> [T, H, D]
    (zeros for padding rows). Query tiles of block_q rows of one sequence, each on its row's gathered pages."""
    check_cudnn("cudnn_prefill", q, k_cache, k_scale)
    T, H, D = q.shape
    B = seq_lens.shape[0]
    check_paged_inputs("cudnn_prefill", H, D, q.dtype, k_cache, v_cache, block_tables, seq_lens, B)
    check_cu_seqlens("cudnn_prefill", cu_seqlens_q, B)
    scale = float(D ** -0.5 if scale is None else scale)
    C = min(block_q, 1 << max(T - 1, 0).bit_length())
    _, bs, K, _ = k_cache.shape
    S = block_tables.shape[1] * bs
    tile_seq, first, end = tile_metadata(cu_seqlens_q, seq_lens, T, C)              # [N] each
    b = jnp.minimum(tile_seq, B - 1)
    row = first[:, None] + jnp.arange(C)                                             # [N, C] token index
    ok = (row < end[:, None]) & (tile_seq < B)[:, None]
    pos = (seq_lens[b] - (cu_seqlens_q[b + 1] - cu_seqlens_q[b]) - cu_seqlens_q[b])[:, None] + row   # [N, C]
    pos = jnp.where(ok, pos, -1)
    qt = q[jnp.clip(row, 0, T - 1)]                                                  # [N, C, H, D]
    q_lens = jnp.maximum(jnp.sum(ok, axis=1), 1).astype(jnp.int32)                   # rows are a prefix of the tile
    kv_lens = jnp.clip(jnp.max(pos, axis=1) + 1, 1, S).astype(jnp.int32)             # keys past the tile's last

    def group(args):
        qt, tables, pos, q_lens, kv_lens = args
        n = tables.shape[0]
        k, v = (c[tables].reshape(n, S, K, D) for c in (k_cache, v_cache))         # [n, S, K, D]
        mask = (jnp.arange(S)[None, None, :] <= pos[:, :, None])[:, None]            # [n, 1, C, S]
        return jax.nn.dot_product_attention(qt, k, v, mask=mask, scale=scale, query_seq_lengths=q_lens,
                                            key_value_seq_lengths=kv_lens, implementation=IMPLEMENTATION)

    N = qt.shape[0]
    per_tile = 2 * S * K * D * q.dtype.itemsize + C * S * q.dtype.itemsize
    n = min(N, max(1, gather_budget_bytes // per_tile))
    groups = -(-N // n)
    args = (qt, block_tables[b], pos, q_lens, kv_lens)
    if groups == 1:
        out = group(args)
    else:   # whole groups: pad with empty tiles (no rows, one key), run them one after another
        fill = (0, 0, -1, 1, 1)
        args = tuple(jnp.concatenate([x, jnp.full((groups * n - N, *x.shape[1:]), f, x.dtype)])
                     .reshape(groups, n, *x.shape[1:]) for x, f in zip(args, fill))
        out = jax.lax.map(group, args).reshape(groups * n, C, H, D)[:N]
    dest = jnp.where(ok, row, T).reshape(-1)                                         # rows not in a tile: dropped
    return jnp.zeros_like(q).at[dest].set(out.reshape(-1, H, D), mode="drop")
