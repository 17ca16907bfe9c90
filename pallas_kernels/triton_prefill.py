"""Raw Triton causal prefill over the paged KV cache (flash_attention's contract), for attn_backend="triton".

Same tiling as the Pallas kernel (flash_attention.py): the new tokens are cut into q tiles of BLOCK_M rows of
one sequence (`tile_metadata`, heaviest first); one program per (tile, q head) walks its sequence's keys up to
the tile's last position in BLOCK_N-token blocks, each key's page looked up in the block table inside the
kernel, with an online softmax in fp32 and the causal-offset mask (a key is visible to a query at or after it).
Tiles of the padding zone write zeros; unused tiles compute nothing.

The triton backend prefills with the Pallas kernel until this one has run correctly on a GPU (attention_fns).
Needs a CUDA GPU with triton and jax-triton; otherwise a ValueError says so.
"""
import jax
import jax.numpy as jnp

from pallas_kernels._common import check_cu_seqlens, check_paged_inputs
from pallas_kernels._triton_ffi import load_triton, triton_call
from pallas_kernels.flash_attention import tile_metadata

try:   # the kernel exists only where triton is installed (a module-level function: Triton reads no closures)
    import triton
    import triton.language as tl
except ImportError:
    triton = None

DEFAULT_BLOCK_M = 64
DEFAULT_BLOCK_N = 64
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 2


if triton is not None:
    @triton.jit
    def _prefill_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, lens_ptr, seq_ptr, first_ptr, end_ptr, o_ptr,
                        SCALE: tl.constexpr, B: tl.constexpr, W: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
                        D: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        PREC: tl.constexpr):
        t, h = tl.program_id(0), tl.program_id(1)
        seq = tl.load(seq_ptr + t)                         # B: the padding zone (zeros), B + 1: an unused tile
        first = tl.load(first_ptr + t)
        end = tl.load(end_ptr + t)
        s_c = tl.minimum(seq, B - 1)
        real = seq < B
        start_q = tl.load(cu_ptr + s_c)
        n_new = tl.load(cu_ptr + s_c + 1) - start_q
        prefix = tl.load(lens_ptr + s_c) - n_new           # tokens cached before this chunk
        m_i = tl.arange(0, BLOCK_M)
        rows = first + m_i
        row_ok = (rows < end) & (seq <= B)
        pos = prefix + rows - start_q                      # [BLOCK_M] absolute positions
        kh = h // (H // K)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + (rows[:, None] * H + h) * D + d[None, :], mask=row_ok[:, None] & real, other=0.0)
        m = tl.full([BLOCK_M], -1e30, tl.float32)
        l_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        last = tl.where(real, prefix + end - start_q, 0)   # keys [0, last) are visible to some row here
        n = tl.arange(0, BLOCK_N)
        for k0 in range(0, last, BLOCK_N):
            tok = k0 + n
            valid = tok < last
            page = tl.load(bt_ptr + s_c * W + tok // BS, mask=valid, other=0).to(tl.int64)
            off = ((page * BS + tok % BS) * K + kh) * D
            k = tl.load(k_ptr + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * SCALE            # [BLOCK_M, BLOCK_N]
            s = tl.where((tok[None, :] <= pos[:, None]) & valid[None, :], s, -1e30)
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m = m_new
        out = acc / tl.maximum(l_sum, 1e-30)[:, None]                           # padding rows: zeros
        tl.store(o_ptr + (rows[:, None] * H + h) * D + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None])


def triton_prefill(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                   cu_seqlens_q: jax.Array, seq_lens: jax.Array, *, scale: float | None = None, k_scale=None,
                   v_scale=None, layer=0, block_m: int = DEFAULT_BLOCK_M, block_n: int = DEFAULT_BLOCK_N,
                   num_warps: int = DEFAULT_NUM_WARPS, num_stages: int = DEFAULT_NUM_STAGES,
                   path: str = "ffi") -> jax.Array:
    """Causal prefill: q [T, H, D] packed new tokens (row b's are q[cu[b]:cu[b+1]], the last at position
    seq_lens[b] - 1) over the paged cache [P, block_size, K, D] -> [T, H, D]; rows past cu[-1] are zeros."""
    if jax.default_backend() != "gpu":
        raise ValueError(f"triton_prefill: attn_backend='triton' needs a CUDA GPU (raw Triton has no interpret "
                         f"mode); JAX's backend here is {jax.default_backend()!r}: use 'xla' or 'pallas'")
    if k_scale is not None or jnp.dtype(k_cache.dtype).itemsize == 1:
        raise ValueError(f"triton_prefill: the Triton prefill kernel does not read an fp8 KV cache "
                         f"({k_cache.dtype}): use attn_backend='pallas' or 'xla' with kv_cache_dtype='fp8'")
    load_triton()
    T, H, D = q.shape
    B = seq_lens.shape[0]
    check_paged_inputs("triton_prefill", H, D, q.dtype, k_cache, v_cache, block_tables, seq_lens, B)
    check_cu_seqlens("triton_prefill", cu_seqlens_q, B)
    _, bs, K, _ = k_cache.shape
    seq, first, end = tile_metadata(cu_seqlens_q, seq_lens, T, block_m)            # [NT] each
    (o,) = triton_call(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, seq, first, end, kernel=_prefill_kernel,
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)], grid=(seq.shape[0], H), num_warps=num_warps,
        num_stages=num_stages, path=path, name="triton_prefill",
        SCALE=float(D ** -0.5 if scale is None else scale), B=B, W=block_tables.shape[1], H=H, K=K, D=D, BS=bs,
        BLOCK_M=block_m, BLOCK_N=block_n, PREC="ieee" if q.dtype == jnp.float32 else "tf32")
    return o
