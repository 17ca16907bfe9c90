"""Decode paged attention: the Pallas kernel (interpret mode on CPU) vs the jnp reference vs dense numpy."""
import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from helpers import assert_lowers_to_triton, make_paged

from jaxinfer.model.layers import apply_rope, rms_norm
from jaxinfer.model.rope import rope_cos_sin
from pallas_kernels.paged_attention import (choose_num_splits, paged_attention, paged_attention_qkv,
                                            paged_attention_reference)
from pallas_kernels.quant import is_pairs, quantize, unpack_pairs

TOL = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def dense_decode(q, k_cache, v_cache, tables, lens):
    """Naive per-sequence, per-head numpy attention (float64)."""
    q, k_cache, v_cache = (np.asarray(x, np.float64) for x in (q, k_cache, v_cache))
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    out = np.zeros_like(q)
    for b in range(batch):
        n = int(lens[b])
        if n == 0:
            continue
        k = k_cache[np.asarray(tables[b])].reshape(-1, kv_heads, head_dim)[:n]
        v = v_cache[np.asarray(tables[b])].reshape(-1, kv_heads, head_dim)[:n]
        for h in range(heads):
            kh = h // (heads // kv_heads)
            s = k[:, kh] @ q[b, h] / np.sqrt(head_dim)
            w = np.exp(s - s.max())
            out[b, h] = (w / w.sum()) @ v[:, kh]
    return out


# (lens, block_size, heads, kv_heads, head_dim): ragged lengths incl. 1, exact block multiples, padding rows (0).
CASES = [
    ([1, 8, 13, 0], 4, 4, 2, 16),
    ([5, 1, 32], 1, 2, 2, 16),  # block size 1, no GQA
    ([16, 47, 1, 33], 16, 8, 2, 32),  # GQA 4
    ([9, 3, 0, 17], 4, 6, 3, 16),  # heads and kv heads not powers of two
    ([7, 20, 0, 3], 4, 6, 2, 48),  # head_dim not a power of two: the kernel pads it to 64 (_common.padded_head_dim)
]


@pytest.mark.parametrize("lens,block_size,heads,kv_heads,head_dim", CASES)
def test_reference_matches_dense(lens, block_size, heads, kv_heads, head_dim):
    rng = np.random.default_rng(1)
    k, v, tables, seq_lens = make_paged(rng, lens, block_size, kv_heads, head_dim, jnp.float32)
    q = jnp.asarray(rng.standard_normal((len(lens), heads, head_dim)), jnp.float32)
    ref = paged_attention_reference(q, k, v, tables, seq_lens)
    np.testing.assert_allclose(np.asarray(ref), dense_decode(q, k, v, tables, lens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case,num_splits", [(0, 1), (0, 3), (1, 2), (2, None), (3, 2), (4, 2)])
def test_kernel_matches_reference(dtype, case, num_splits):
    lens, block_size, heads, kv_heads, head_dim = CASES[case]
    rng = np.random.default_rng(2)
    k, v, tables, seq_lens = make_paged(rng, lens, block_size, kv_heads, head_dim, dtype)
    q = jnp.asarray(rng.standard_normal((len(lens), heads, head_dim)), dtype)
    kw = dict(interpret=True, block_n=16, num_splits=num_splits)
    out = paged_attention(q, k, v, tables, seq_lens, **kw)
    ref = paged_attention_reference(q, k, v, tables, seq_lens, **kw)    # the same contract: the options mean nothing
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not np.isnan(np.asarray(out, np.float32)).any()
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **TOL[dtype])
    padding = np.asarray(lens) == 0
    assert not np.asarray(out, np.float32)[padding].any(), "padding rows must be zeros"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case,num_splits", [(0, 1), (0, 3), (2, 2), (3, 1)])
def test_qkv_kernel_matches_norm_rope_write_then_attend(dtype, case, num_splits):
    """The kernel that starts from the raw qkv projection (q/k RMSNorm + RoPE, K/V write, attention) gives the
    output and caches of the model's own norm/rope, a scatter write, then the reference attention."""
    lens, block_size, heads, kv_heads, head_dim = CASES[case]
    rng = np.random.default_rng(5)
    k, v, tables, _ = make_paged(rng, lens, block_size, kv_heads, head_dim, dtype)
    qkv = jnp.asarray(rng.standard_normal((len(lens), heads + 2 * kv_heads, head_dim)), dtype)
    norms = tuple(jnp.asarray(1 + 0.3 * rng.standard_normal(head_dim), dtype) for _ in range(2))
    fused = jax.jit(lambda *a: paged_attention_qkv(*a, eps=1e-6, interpret=True, block_n=16, num_splits=num_splits))
    check_qkv(fused, qkv, norms, k, v, tables, lens, TOL[dtype])


@pytest.mark.parametrize("traced", [False, True])
def test_qkv_kernel_takes_stacked_norm_weights(traced):
    """Stacked [L, D] norm weights plus a layer row (a Python int, or traced as in a jitted model) give the
    same result as that row's [D] weights."""
    lens, block_size, heads, kv_heads, head_dim = CASES[0]
    rng = np.random.default_rng(8)
    k, v, tables, _ = make_paged(rng, lens, block_size, kv_heads, head_dim, jnp.float32)
    qkv = jnp.asarray(rng.standard_normal((len(lens), heads + 2 * kv_heads, head_dim)), jnp.float32)
    stacked = [jnp.asarray(1 + 0.3 * rng.standard_normal((3, head_dim)), jnp.float32) for _ in range(2)]
    norms = tuple(w[2] for w in stacked)

    def fused(qkv, q_norm, k_norm, *rest):   # check_qkv passes row 2's weights; the kernel gets all 3 rows
        if traced:
            return jax.jit(lambda row, *a: paged_attention_qkv(*a, eps=1e-6, layer=row, interpret=True, block_n=16))(
                jnp.int32(2), qkv, *stacked, *rest)
        return paged_attention_qkv(qkv, *stacked, *rest, eps=1e-6, layer=2, interpret=True, block_n=16)
    check_qkv(fused, qkv, norms, k, v, tables, lens, TOL[jnp.float32])


def check_stacked_layer(qkv, norms, k, v, tables, lens, tol, interpret: bool, theta=10_000.0):
    """The fused kernel on layer 1 of a cache stacked over two layers ([2P, ...], layer 1's pages from P:
    page_offset=P) gives what it gives on that layer's own cache, and leaves layer 0's pages as they were."""
    other_k, other_v = k[::-1] * 0.5, v[::-1] * 0.5                      # layer 0: any other values
    P = k.shape[0]

    def fused(qkv, qn, kn, cos, sin, k, v, tables, seq_lens):
        out, k2, v2 = paged_attention_qkv(qkv, qn, kn, cos, sin, jnp.concatenate([other_k, k]),
                                          jnp.concatenate([other_v, v]), tables, seq_lens, eps=1e-6, page_offset=P,
                                          interpret=interpret, block_n=16 if interpret else None)
        np.testing.assert_array_equal(np.asarray(k2[:P]), np.asarray(other_k))
        np.testing.assert_array_equal(np.asarray(v2[:P]), np.asarray(other_v))
        return out, k2[P:], v2[P:]
    check_qkv(fused, qkv, norms, k, v, tables, lens, tol, theta=theta)


def test_qkv_kernel_reads_one_layer_of_a_stacked_cache():
    lens, block_size, heads, kv_heads, head_dim = CASES[0]
    rng = np.random.default_rng(9)
    k, v, tables, _ = make_paged(rng, lens, block_size, kv_heads, head_dim, jnp.float32)
    qkv = jnp.asarray(rng.standard_normal((len(lens), heads + 2 * kv_heads, head_dim)), jnp.float32)
    norms = tuple(jnp.asarray(1 + 0.3 * rng.standard_normal(head_dim), jnp.float32) for _ in range(2))
    check_stacked_layer(qkv, norms, k, v, tables, lens, TOL[jnp.float32], interpret=True)
    with pytest.raises(ValueError, match="page_offset"):
        paged_attention_qkv(qkv, *norms, jnp.zeros((len(lens), head_dim)), jnp.zeros((len(lens), head_dim)), k, v,
                            tables, jnp.asarray(lens, jnp.int32), eps=1e-6, page_offset=-1, interpret=True)


def check_qkv(fused, qkv, norms, k, v, tables, lens, tol, theta=10_000.0, eps=1e-6, scales=None):
    """fused(qkv, q_norm, k_norm, cos, sin, k, v, tables, seq_lens) == norm + rope (model/layers.py), writing
    k/v at position len-1, then the reference attention. scales = (k_scale, v_scale) of fp8 caches: the new
    k/v are written quantised (tests/test_fp8_kernels.py)."""
    block_size, K = k.shape[1], k.shape[2]
    H = qkv.shape[1] - 2 * K
    pairs = is_pairs(v.dtype)               # fp8 V pages in pairs (pallas_kernels/quant.py): compared unpacked
    v_in, v = v, unpack_pairs(v) if pairs else v
    pos = np.maximum(np.asarray(lens) - 1, 0)
    cos, sin = rope_cos_sin(jnp.asarray(pos), qkv.shape[-1], theta)
    q = apply_rope(rms_norm(qkv[:, :H], norms[0], eps), cos, sin)
    kn = apply_rope(rms_norm(qkv[:, H:H + K], norms[1], eps), cos, sin)
    vn = qkv[:, H + K:]
    pages = np.asarray(tables)[np.arange(len(lens)), pos // block_size]
    real = np.asarray(lens) > 0
    if scales is not None:
        kn, vn = quantize(kn, scales[0]), quantize(vn, scales[1])
    k_ref = k.at[pages[real], pos[real] % block_size].set(kn[real])
    v_ref = v.at[pages[real], pos[real] % block_size].set(vn[real])
    seq_lens = jnp.asarray(lens, jnp.int32)
    out, k2, v2 = fused(qkv, *norms, cos, sin, k, v_in, tables, seq_lens)
    if pairs:
        assert is_pairs(v2.dtype) and v2.shape == v_in.shape
        v2 = unpack_pairs(v2)
    exact = qkv.dtype == jnp.float32 and jax.default_backend() == "cpu"
    if scales is None:
        cache_tol = dict(atol=1e-6, rtol=1e-6) if qkv.dtype == jnp.float32 else dict(atol=1e-2, rtol=1e-2)
    else:   # fp8 values: exact on the CPU in fp32; else one fp8 step (bf16 norm/rope, Triton's fp32 division)
        cache_tol = dict(atol=0, rtol=0) if exact else dict(atol=2.0 ** -9, rtol=2.0 ** -3)
    np.testing.assert_allclose(np.asarray(k2, np.float32), np.asarray(k_ref, np.float32), **cache_tol)
    if scales is None or exact:
        np.testing.assert_array_equal(np.asarray(v2, np.float32), np.asarray(v_ref, np.float32))
    else:
        np.testing.assert_allclose(np.asarray(v2, np.float32), np.asarray(v_ref, np.float32), **cache_tol)
    fp8 = {} if scales is None else dict(k_scale=scales[0], v_scale=scales[1])
    ref = paged_attention_reference(q, k_ref, v_ref, tables, seq_lens, **fp8)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **tol)
    assert not np.asarray(out, np.float32)[~real].any(), "padding rows must be zeros"


@pytest.mark.parametrize("bad,match", [
    (dict(qkv=jnp.zeros((2, 4, 16))), "H \\+ 2K"), (dict(q_norm=jnp.zeros((8,))), "q_norm"),
    (dict(cos=jnp.zeros((3, 16))), "cos"), (dict(k_norm=jnp.zeros((2, 16))), "k_norm"),
    (dict(q_norm=jnp.zeros((2, 16)), k_norm=jnp.zeros((2, 16)), layer=2), "layer=2"),
])
def test_qkv_kernel_validation(bad, match):
    z = jnp.zeros
    args = dict(qkv=z((2, 8, 16)), q_norm=z((16,)), k_norm=z((16,)), cos=z((2, 16)), sin=z((2, 16)),
                k_cache=z((4, 4, 2, 16)), v_cache=z((4, 4, 2, 16)), block_tables=z((2, 3), jnp.int32),
                seq_lens=z((2,), jnp.int32))
    args.update(bad)
    layer = args.pop("layer", 0)
    with pytest.raises(ValueError, match=match):
        paged_attention_qkv(**args, eps=1e-6, layer=layer, interpret=True)


def test_kernel_inside_jit_with_scale():
    """Traceable under an outer jit with dynamic lengths; custom scale honoured."""
    rng = np.random.default_rng(3)
    k, v, tables, _ = make_paged(rng, [20, 7], 4, 2, 16, jnp.float32)
    q = jnp.asarray(rng.standard_normal((2, 4, 16)), jnp.float32)
    step = jax.jit(lambda q, lens: paged_attention(q, k, v, tables, lens, scale=0.3, interpret=True, block_n=16))
    for lens in ([20, 7], [3, 1]):
        lens = jnp.asarray(lens, jnp.int32)
        np.testing.assert_allclose(np.asarray(step(q, lens)),
                                   np.asarray(paged_attention_reference(q, k, v, tables, lens, scale=0.3)),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", [False, True])
def test_program_order_changes_no_result(fused):
    """`order` only changes which row's programs start first: any permutation gives the same bits."""
    lens, block_size, heads, kv_heads, head_dim = CASES[2]
    rng = np.random.default_rng(9)
    k, v, tables, seq_lens = make_paged(rng, lens, block_size, kv_heads, head_dim, jnp.float32)
    longest_first = jnp.asarray(np.argsort(-np.asarray(lens), kind="stable"), jnp.int32)
    if fused:
        qkv = jnp.asarray(rng.standard_normal((len(lens), heads + 2 * kv_heads, head_dim)), jnp.float32)
        norm, cos = jnp.ones((head_dim,), jnp.float32), jnp.ones((len(lens), head_dim), jnp.float32)
        run = lambda order: paged_attention_qkv(qkv, norm, norm, cos, cos, k, v, tables, seq_lens, eps=1e-6,
                                                order=order, interpret=True, block_n=16, num_splits=2)
    else:
        q = jnp.asarray(rng.standard_normal((len(lens), heads, head_dim)), jnp.float32)
        run = lambda order: (paged_attention(q, k, v, tables, seq_lens, order=order, interpret=True, block_n=16,
                                             num_splits=2),)
    base, ordered = run(None), run(longest_first)
    assert np.asarray(base[0]).any()
    for a, b in zip(base, ordered):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="order must be int32"):
        run(longest_first[:2])


@pytest.mark.parametrize("fused", [False, True])
def test_balanced_splits_change_no_result(fused):
    """context_total only changes how rows' contexts are cut into splits (a row of n tokens gets min(num_splits,
    ceil(n / per)) of them, the rest empty): any total, traced or not, gives the reference's result."""
    lens, block_size, heads, kv_heads, head_dim = [40, 3, 0, 17, 64, 1], 4, 4, 2, 16
    rng = np.random.default_rng(12)
    k, v, tables, seq_lens = make_paged(rng, lens, block_size, kv_heads, head_dim, jnp.float32)
    opts = dict(interpret=True, block_n=16, num_splits=4)
    if fused:
        qkv = jnp.asarray(rng.standard_normal((len(lens), heads + 2 * kv_heads, head_dim)), jnp.float32)
        norm, cos = jnp.ones((head_dim,), jnp.float32), jnp.ones((len(lens), head_dim), jnp.float32)
        run = jax.jit(lambda total: paged_attention_qkv(qkv, norm, norm, cos, cos, k, v, tables, seq_lens, eps=1e-6,
                                                        context_total=total, **opts))
    else:
        q = jnp.asarray(rng.standard_normal((len(lens), heads, head_dim)), jnp.float32)
        run = jax.jit(lambda total: (paged_attention(q, k, v, tables, seq_lens, context_total=total, **opts),))
    base = run(None)
    # 0: every row splits as far as it can; 125: the real total; 10**6: one split each
    for total in (0, sum(lens), 10**6, jnp.int32(sum(lens))):
        for a, b in zip(base, run(total)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
    if not fused:
        ref = paged_attention_reference(q, k, v, tables, seq_lens)
        np.testing.assert_allclose(np.asarray(run(0)[0]), np.asarray(ref), atol=1e-5, rtol=1e-5)
    for bad in (-1, True, jnp.float32(3), jnp.zeros((2,), jnp.int32)):
        with pytest.raises(ValueError, match="context_total"):
            paged_attention(jnp.zeros((len(lens), heads, head_dim), jnp.float32), k, v, tables, seq_lens,
                            context_total=bad, interpret=True)


def test_choose_num_splits():
    assert choose_num_splits(batch=256, kv_heads=8, max_context=4096) == 1
    assert choose_num_splits(batch=1, kv_heads=8, max_context=4096) == 8
    assert choose_num_splits(batch=64, kv_heads=8, max_context=1024) == 1
    assert choose_num_splits(batch=1, kv_heads=8, max_context=128) == 1
    # ~4 programs per SM rounded down: over-splitting a moderate batch was slower on the H200
    assert choose_num_splits(batch=32, kv_heads=8, max_context=4096) == 2
    assert choose_num_splits(batch=8, kv_heads=8, max_context=4096) == 8
    # balanced splits (context_total) allow twice the programs: short rows leave theirs empty
    assert choose_num_splits(batch=64, kv_heads=8, max_context=4096, programs_per_sm=8) == 2
    assert choose_num_splits(batch=32, kv_heads=8, max_context=4096, programs_per_sm=8) == 4


@pytest.mark.parametrize("bad,match", [
    (dict(q=jnp.zeros((2, 4), jnp.float32)), "q must be"),
    (dict(k_cache=jnp.zeros((4, 4, 3, 16), jnp.float32), v_cache=jnp.zeros((4, 4, 3, 16), jnp.float32)),
     "multiple of kv heads"),
    (dict(v_cache=jnp.zeros((4, 4, 2, 16), jnp.bfloat16)), "dtype"),
    (dict(block_tables=jnp.zeros((2, 3), jnp.int64 if jax.config.x64_enabled else jnp.uint32)), "int32"),
    (dict(seq_lens=jnp.zeros((3,), jnp.int32)), "seq_lens"),
    (dict(k_cache=jnp.zeros((4, 3, 2, 16), jnp.float32), v_cache=jnp.zeros((4, 3, 2, 16), jnp.float32)),
     "block_size"),
])
def test_validation(bad, match):
    args = dict(q=jnp.zeros((2, 4, 16), jnp.float32), k_cache=jnp.zeros((4, 4, 2, 16), jnp.float32),
                v_cache=jnp.zeros((4, 4, 2, 16), jnp.float32), block_tables=jnp.zeros((2, 3), jnp.int32),
                seq_lens=jnp.zeros((2,), jnp.int32))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        paged_attention(**args, interpret=True)


def test_lowers_to_triton():
    """The kernel lowers to Triton IR for CUDA (no GPU needed): catches unsupported ops before a GPU run."""
    sd = jax.ShapeDtypeStruct
    args = (sd((8, 16, 128), jnp.bfloat16), sd((64, 16, 8, 128), jnp.bfloat16), sd((64, 16, 8, 128), jnp.bfloat16),
            sd((8, 8), jnp.int32), sd((8,), jnp.int32))
    assert_lowers_to_triton(paged_attention, args)
    assert_lowers_to_triton(functools.partial(paged_attention, context_total=1000), args)
    vec, rope = sd((128,), jnp.bfloat16), sd((8, 128), jnp.float32)
    assert_lowers_to_triton(functools.partial(paged_attention_qkv, eps=1e-6),
                            (sd((8, 32, 128), jnp.bfloat16), vec, vec, rope, rope, *args[1:]))
    stacked = sd((28, 128), jnp.bfloat16)     # a model's stacked weights, one row per layer
    assert_lowers_to_triton(functools.partial(paged_attention_qkv, eps=1e-6, layer=27),
                            (sd((8, 32, 128), jnp.bfloat16), stacked, stacked, rope, rope, *args[1:]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,batch,max_len,block_size", [
    (jnp.bfloat16, 64, 2048, 16), (jnp.bfloat16, 3, 4096, 16), (jnp.bfloat16, 17, 300, 32),
    (jnp.float32, 5, 200, 16),
])
def test_gpu_compiled(dtype, batch, max_len, block_size):
    rng = np.random.default_rng(4)
    lens = rng.integers(1, max_len + 1, batch)
    lens[0], lens[-1] = 1, max_len
    if batch > 4:
        lens[1], lens[2] = 0, 2 * block_size
    k, v, tables, seq_lens = make_paged(rng, lens, block_size, 8, 128, dtype)
    q = jnp.asarray(rng.standard_normal((batch, 16, 128)), dtype)
    out = jax.jit(paged_attention)(q, k, v, tables, seq_lens)
    ref = paged_attention_reference(q, k, v, tables, seq_lens)
    tol = TOL[dtype] if dtype == jnp.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **tol)
    qkv = jnp.asarray(rng.standard_normal((batch, 32, 128)), dtype)
    norms = tuple(jnp.asarray(1 + 0.3 * rng.standard_normal(128), dtype) for _ in range(2))
    check_qkv(jax.jit(functools.partial(paged_attention_qkv, eps=1e-6)), qkv, norms, k, v, tables, lens, tol,
              theta=1e6)
    stacked = [jnp.stack([w * 0.5, w]) for w in norms]       # as the engine calls it: [L, D] weights, row 1,
    order = jnp.asarray(np.argsort(-lens, kind="stable"), jnp.int32)     # rows longest first
    check_qkv(jax.jit(lambda qkv, qn, kn, *a: paged_attention_qkv(qkv, *stacked, *a, eps=1e-6, layer=1, order=order)),
              qkv, norms, k, v, tables, lens, tol, theta=1e6)
    total = jnp.int32(int(lens.sum()))                                   # balanced splits, as the engine runs them
    check_qkv(jax.jit(lambda qkv, qn, kn, *a: paged_attention_qkv(qkv, *stacked, *a, eps=1e-6, layer=1, order=order,
                                                                  context_total=total)),
              qkv, norms, k, v, tables, lens, tol, theta=1e6)
    out = jax.jit(functools.partial(paged_attention, context_total=total))(q, k, v, tables, seq_lens)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **tol)
    check_stacked_layer(qkv, norms, k, v, tables, lens, tol, interpret=False, theta=1e6)   # the engine's cache
