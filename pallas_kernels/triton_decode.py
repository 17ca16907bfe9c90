"""The "triton" attention backend's decode: raw Triton (`@triton.jit`), called from JAX through jax-triton's
compiler and XLA's Triton FFI call (pallas_kernels/_triton_ffi.py). Prefill of this backend is the Pallas
flash kernel (flash_attention.py) until the raw Triton one (triton_prefill.py) has run on a GPU.

The kernel is the Pallas decode kernel's design written by hand (paged_attention.py):
  * grid (B rows, K kv heads, S context splits); one program takes the G q heads of its kv head (padded to
    >= 16 rows for tl.dot), so each K/V byte is read once;
  * it walks its split of the context in tiles of BLOCK_N tokens, each token's page looked up in the block
    table inside the kernel (no gathered copy), online softmax in fp32;
  * with S > 1 each split writes a normalised partial output and its log-sum-exp, merged by a small jnp
    combine in the same jit (flash-decoding); S from `choose_num_splits`, as for the Pallas kernel.
Not here (the Pallas kernel has them): the fused q/k norm + RoPE + K/V write prologue, fp8 pages, row order.

Needs a CUDA GPU with triton and jax-triton (pip install '.[triton]'); otherwise a ValueError says so.
Shapes: B rows, H q heads, K kv heads, G = H // K, D head dim, P pages of BS tokens, W table width.
"""
import jax
import jax.numpy as jnp

from pallas_kernels._common import check_paged_inputs, next_pow2
from pallas_kernels._triton_ffi import load_triton, triton_call
from pallas_kernels.paged_attention import choose_num_splits

try:   # the kernel is defined only where triton is installed; the entry point says what is missing otherwise
    import triton
    import triton.language as tl
except ImportError:
    triton = None

DEFAULT_BLOCK_N = 64     # tokens per tile (4 pages of 16), as the Pallas kernel
DEFAULT_NUM_WARPS = 2    # the Pallas kernel's tuned values (docs/kernels.md); untuned for this kernel
DEFAULT_NUM_STAGES = 3
DEFAULT_PATH = "ffi"     # "ffi": XLA's typed-FFI Triton call (in CUDA graphs); "jax_triton": the package's call


if triton is not None:
    @triton.jit
    def _decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, o_ptr, lse_ptr,
                       SCALE: tl.constexpr, W: tl.constexpr, H: tl.constexpr, K: tl.constexpr, D: tl.constexpr,
                       G: tl.constexpr, GP: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
                       SPLITS: tl.constexpr, PREC: tl.constexpr):
        b, kh, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        length = tl.load(lens_ptr + b)
        # this split's token range follows the row's real length, so splits stay balanced
        chunk = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N
        start = sp * chunk
        end = tl.minimum(start + chunk, length)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        heads = kh * G + g                                                      # [GP] q heads of this kv head
        q = tl.load(q_ptr + (b * H + heads)[:, None] * D + d[None, :], mask=(g < G)[:, None], other=0.0)
        m = tl.full([GP], -1e30, tl.float32)
        l_sum = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        n = tl.arange(0, BLOCK_N)
        for t0 in range(start, end, BLOCK_N):
            tok = t0 + n
            valid = tok < end
            page = tl.load(bt_ptr + b * W + tok // BS, mask=valid, other=0).to(tl.int64)
            row = ((page * BS + tok % BS) * K + kh) * D                        # [BLOCK_N] element offsets
            k = tl.load(k_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)   # [BLOCK_N, D]
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * SCALE            # [GP, BLOCK_N] fp32
            s = tl.where(valid[None, :], s, -1e30)
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m = m_new
        out = acc / tl.maximum(l_sum, 1e-30)[:, None]                           # an empty split: zeros
        lse = tl.where(l_sum > 0, m + tl.log(tl.maximum(l_sum, 1e-30)), -1e30)
        base = (b * SPLITS + sp) * H + heads                                    # [GP] rows of [B, S, H]
        tl.store(o_ptr + base[:, None] * D + d[None, :], out, mask=(g < G)[:, None])
        tl.store(lse_ptr + base, lse, mask=g < G)


def triton_paged_decode(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                        seq_lens: jax.Array, *, scale: float | None = None, k_scale=None, v_scale=None, layer=0,
                        block_n: int = DEFAULT_BLOCK_N, num_splits: int | None = None,
                        num_warps: int = DEFAULT_NUM_WARPS, num_stages: int = DEFAULT_NUM_STAGES,
                        path: str = DEFAULT_PATH) -> jax.Array:
    """Decode attention (paged_attention's contract): q [B, H, D], one new token per row, over the cache
    [P, block_size, K, D]; seq_lens [B] include the new token (0: a padding row, zeros out) -> [B, H, D]."""
    if jax.default_backend() != "gpu":
        raise ValueError(f"triton_paged_decode: attn_backend='triton' needs a CUDA GPU (raw Triton has no "
                         f"interpret mode); JAX's backend here is {jax.default_backend()!r}: use 'xla' or 'pallas'")
    if k_scale is not None or jnp.dtype(k_cache.dtype).itemsize == 1:
        raise ValueError(f"triton_paged_decode: the Triton decode kernel does not read an fp8 KV cache "
                         f"({k_cache.dtype}): use attn_backend='pallas' or 'xla' with kv_cache_dtype='fp8'")
    load_triton()   # a ValueError naming the missing package
    B, H, D = q.shape
    check_paged_inputs("triton_paged_decode", H, D, q.dtype, k_cache, v_cache, block_tables, seq_lens, B)
    if D < 16 or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"triton_paged_decode: head_dim ({D}) and block_n ({block_n}) must be powers of two "
                         f">= 16 (tl.dot tiles)")
    _, bs, K, _ = k_cache.shape
    W = block_tables.shape[1]
    splits = num_splits or choose_num_splits(B, K, W * bs, block_n)
    o, lse = triton_call(
        q, k_cache, v_cache, block_tables, seq_lens, kernel=_decode_kernel,
        out_shape=[jax.ShapeDtypeStruct((B, splits, H, D), jnp.float32),
                   jax.ShapeDtypeStruct((B, splits, H), jnp.float32)],
        grid=(B, K, splits), num_warps=num_warps, num_stages=num_stages, path=path, name="triton_paged_decode",
        SCALE=float(D ** -0.5 if scale is None else scale), W=W, H=H, K=K, D=D, G=H // K,
        GP=max(16, next_pow2(H // K)), BS=bs, BLOCK_N=block_n, SPLITS=splits,
        PREC="ieee" if q.dtype == jnp.float32 else "tf32")
    if splits == 1:
        return o[:, 0].astype(q.dtype)
    w = jax.nn.softmax(lse, axis=1)                                             # [B, S, H] split weights
    return jnp.sum(o * w[..., None], axis=1).astype(q.dtype)
