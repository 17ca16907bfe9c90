"""Varlen causal prefill over the paged cache: the Pallas kernel (interpret mode) vs the jnp reference vs numpy."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest
from helpers import assert_lowers_to_triton, make_paged

from pallas_kernels.flash_attention import flash_attention, flash_attention_reference, tile_metadata

TOL = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def make_prefill(rng, n_new, ctx, block_size, heads, kv_heads, head_dim, dtype, pad_tokens=0):
    """Packed q for n_new new tokens per sequence (context ctx incl. them); pages scattered over a permuted pool."""
    k, v, tables, lens = make_paged(rng, ctx, block_size, kv_heads, head_dim, dtype)
    cu = np.concatenate([[0], np.cumsum(n_new)]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((int(cu[-1]) + pad_tokens, heads, head_dim)), dtype)
    return q, k, v, tables, jnp.asarray(cu), lens


def dense_prefill(q, k_cache, v_cache, tables, cu, ctx):
    """Naive per-token, per-head numpy causal attention (float64); padding tokens stay zero."""
    q, k_cache, v_cache = (np.asarray(x, np.float64) for x in (q, k_cache, v_cache))
    heads, head_dim = q.shape[1:]
    kv_heads = k_cache.shape[2]
    out = np.zeros_like(q)
    for b in range(len(ctx)):
        n_new, length = int(cu[b + 1] - cu[b]), int(ctx[b])
        k = k_cache[np.asarray(tables[b])].reshape(-1, kv_heads, head_dim)
        v = v_cache[np.asarray(tables[b])].reshape(-1, kv_heads, head_dim)
        for i in range(n_new):
            pos = length - n_new + i
            for h in range(heads):
                kh = h // (heads // kv_heads)
                s = k[:pos + 1, kh] @ q[cu[b] + i, h] / np.sqrt(head_dim)
                w = np.exp(s - s.max())
                out[cu[b] + i, h] = (w / w.sum()) @ v[:pos + 1, kh]
    return out


# (n_new, ctx, block_size, heads, kv_heads, head_dim, pad_tokens)
CASES = [
    ([5, 16, 1, 9], [5, 20, 30, 9], 4, 4, 2, 16, 3),  # full prompts, prefix hits, a 1-token chunk, padding
    ([3, 0, 17], [19, 0, 17], 1, 2, 2, 16, 0),  # block size 1, no GQA, an empty padding sequence
    ([32, 7, 16], [48, 40, 16], 16, 8, 2, 32, 5),  # GQA 4, chunked-prefill continuations, exact multiples
    ([6, 11], [6, 25], 4, 6, 2, 48, 2),  # head_dim not a power of two: padded to 64 (_common.padded_head_dim)
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_reference_matches_dense(case):
    n_new, ctx, block_size, heads, kv_heads, head_dim, pad = CASES[case]
    q, k, v, tables, cu, seq_lens = make_prefill(np.random.default_rng(1), n_new, ctx, block_size, heads, kv_heads,
                                                 head_dim, jnp.float32, pad)
    ref = flash_attention_reference(q, k, v, tables, cu, seq_lens, q_chunk=4)  # chunks straddle tokens unevenly
    np.testing.assert_allclose(np.asarray(ref), dense_prefill(q, k, v, tables, cu, seq_lens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case,block_q,block_k", [(0, 16, 16), (1, 16, 32), (2, 32, 16), (3, 16, 16)])
def test_kernel_matches_reference(dtype, case, block_q, block_k):
    n_new, ctx, block_size, heads, kv_heads, head_dim, pad = CASES[case]
    q, k, v, tables, cu, seq_lens = make_prefill(np.random.default_rng(2), n_new, ctx, block_size, heads, kv_heads,
                                                 head_dim, dtype, pad)
    kw = dict(interpret=True, block_q=block_q, block_k=block_k)
    out = flash_attention(q, k, v, tables, cu, seq_lens, **kw)
    ref = flash_attention_reference(q, k, v, tables, cu, seq_lens, **kw)   # the same contract: the options mean nothing
    assert out.shape == q.shape and out.dtype == q.dtype
    out = np.asarray(out, np.float32)
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out, np.asarray(ref, np.float32), **TOL[dtype])
    assert not out[int(cu[-1]):].any(), "padding tokens must be zeros"


def test_tile_metadata_covers_every_token_once():
    cu = jnp.asarray([0, 5, 5, 40, 41], jnp.int32)
    seq_lens = jnp.asarray([5, 0, 60, 41], jnp.int32)
    seq, first, end = (np.asarray(x) for x in tile_metadata(cu, seq_lens, 50, 16))
    covered = np.zeros(50, int)
    for s, f, e in zip(seq, first, end):
        if s <= 4:  # real sequences and the padding zone (seq id B)
            covered[f:e] += 1
            assert s == 4 or cu[s] <= f < e <= cu[s + 1]
    assert (covered == 1).all()
    assert seq[0] == 2, "heaviest tile (longest context) first"


def test_validation():
    q = jnp.zeros((6, 4, 16), jnp.float32)
    cache = jnp.zeros((4, 4, 2, 16), jnp.float32)
    tables, lens = jnp.zeros((2, 3), jnp.int32), jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        flash_attention(q, cache, cache, tables, jnp.zeros((2,), jnp.int32), lens, interpret=True)
    with pytest.raises(ValueError, match="block_q"):
        flash_attention(q, cache, cache, tables, jnp.zeros((3,), jnp.int32), lens, interpret=True, block_q=24)
    with pytest.raises(ValueError, match="head_dim"):
        flash_attention(jnp.zeros((6, 4, 8), jnp.float32), cache, cache, tables, jnp.zeros((3,), jnp.int32), lens)


def test_lowers_to_triton():
    """The kernel lowers to Triton IR for CUDA (no GPU needed): catches unsupported ops before a GPU run."""
    sd = jax.ShapeDtypeStruct
    args = (sd((512, 16, 128), jnp.bfloat16), sd((64, 16, 8, 128), jnp.bfloat16), sd((64, 16, 8, 128), jnp.bfloat16),
            sd((4, 16), jnp.int32), sd((5,), jnp.int32), sd((4,), jnp.int32))
    assert_lowers_to_triton(flash_attention, args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,n_new,prefix,block_size", [
    (jnp.bfloat16, [512, 1024, 1, 300], [0, 0, 700, 1000], 16),  # fresh prompts, a decode-like chunk, hits
    (jnp.bfloat16, [2048], [0], 16),
    (jnp.bfloat16, [77, 128, 200], [16, 128, 33], 32),
    (jnp.float32, [100, 37], [20, 0], 16),
])
def test_gpu_compiled(dtype, n_new, prefix, block_size):
    rng = np.random.default_rng(4)
    ctx = [n + p for n, p in zip(n_new, prefix)]
    q, k, v, tables, cu, seq_lens = make_prefill(rng, n_new, ctx, block_size, 16, 8, 128, dtype, pad_tokens=64)
    out = jax.jit(flash_attention)(q, k, v, tables, cu, seq_lens)
    ref = flash_attention_reference(q, k, v, tables, cu, seq_lens)
    tol = TOL[dtype] if dtype == jnp.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **tol)
    assert not np.asarray(out, np.float32)[int(cu[-1]):].any()
