"""FP8 (e4m3) KV pages: quantise / dequantise round trip, both kernels (interpret mode) on fp8 pages against the
jnp reference on the same pages, and against the full-precision cache within a stated bound."""
import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from helpers import assert_lowers_to_triton, make_paged
from test_flash_attention import make_prefill
from test_paged_attention import CASES, check_qkv

from pallas_kernels.flash_attention import flash_attention, flash_attention_reference
from pallas_kernels.paged_attention import paged_attention, paged_attention_qkv, paged_attention_reference
from pallas_kernels.quant import (FP8_DTYPE, FP8_MAX, dequantize, kv_scales, quantize, relative_step,
                                  scale_for_amax)

# Same pages, same math: the kernel against the reference on the SAME fp8 cache (fp32 q: fp32 dots; bf16 q: the
# kernel's fp16 dots and bf16 output).
SAME = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# The quality bound: fp8 pages (scales from each head's amax) against the fp32 cache they came from, on
# standard-normal q/k/v with head_dim 16-32 (softmax temperature 1/sqrt(D)): half an fp8 step of the output
# (2^-4 relative: a length-1 row returns its one v, rounded) plus 0.15 for the scores' rounding (worst seen
# 0.13), and a mean |error| under 0.02 (seen: 0.008-0.011), on outputs of mean magnitude ~0.5.
FP8_VS_FULL = dict(atol=1.5e-1, rtol=2.0 ** -4)
FP8_VS_FULL_MEAN = 2e-2


def assert_close_to_full(out, full):
    np.testing.assert_allclose(out, full, **FP8_VS_FULL)
    err = np.abs(out - full)
    print(f"fp8 vs full-precision cache: max |err| {err.max():.4f}, mean {err.mean():.5f}")
    assert 0 < err.mean() < FP8_VS_FULL_MEAN, "fp8 pages must differ a little from the fp32 ones, not a lot"


def per_head_scales(k, v, per_head=True):
    """Dequantisation scales from the amax of each kv head (or of the whole cache)."""
    axes = (0, 1, 3) if per_head else None
    return scale_for_amax(jnp.abs(k).max(axes)), scale_for_amax(jnp.abs(v).max(axes))


def fp8_cache(k, v, per_head=True):
    ks, vs = per_head_scales(k, v, per_head)
    return quantize(k, ks), quantize(v, vs), ks, vs


# -- quantise / dequantise ------------------------------------------------------------------------------

def test_round_trip_within_half_a_step():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((64, 4, 2, 32)) * np.array([1.0, 30.0])[:, None], jnp.float32)
    scale = scale_for_amax(jnp.abs(x).max((0, 1, 3)))   # [K]
    q = quantize(x, scale)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape
    back = np.asarray(dequantize(q, scale))
    xs = np.asarray(x)
    # normals: half of a 3-bit mantissa step (2^-4 relative); subnormals (|x| < 2^-6 * scale): 2^-10 * scale
    bound = np.maximum(relative_step() * np.abs(xs), 2.0 ** -10 * np.asarray(scale)[:, None])
    assert (np.abs(back - xs) <= bound * (1 + 1e-6)).all()
    assert np.abs(back).max() <= np.abs(xs).max() * (1 + 1e-6)
    # values on the fp8 grid come back exactly
    np.testing.assert_array_equal(np.asarray(quantize(dequantize(q, scale), scale), np.float32),
                                  np.asarray(q, np.float32))


def test_quantize_clips_instead_of_nan():
    x = jnp.asarray([[[-1e6, -500.0, 0.0, 447.9, 1e9]]], jnp.float32)      # [1, K=1, D=5]
    q = np.asarray(quantize(x, jnp.float32(1.0)), np.float32)
    assert not np.isnan(q).any()
    np.testing.assert_array_equal(q, [[[-FP8_MAX, -FP8_MAX, 0.0, 448.0, FP8_MAX]]])
    assert float(scale_for_amax(0.0)) == 1.0 and float(scale_for_amax(448.0)) == 1.0


def test_kv_scales_validation():
    fp8 = jnp.zeros((4, 4, 2, 16), FP8_DTYPE)
    bf16 = jnp.zeros((4, 4, 2, 16), jnp.bfloat16)
    assert kv_scales("f", bf16, None, None) is None
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        kv_scales("f", fp8, None, 1.0)
    with pytest.raises(ValueError, match="float8_e4m3fn caches"):
        kv_scales("f", bf16, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"k_scale must have shape"):
        kv_scales("f", fp8, jnp.ones(3), jnp.ones(3))
    with pytest.raises(ValueError, match="same layout"):
        kv_scales("f", fp8, jnp.ones(2), 1.0)
    with pytest.raises(ValueError, match="layer=3"):
        kv_scales("f", fp8, jnp.ones((3, 2)), jnp.ones((3, 2)), layer=3)
    ks, vs, layer = kv_scales("f", fp8, 0.5, 0.25)
    assert ks.shape == vs.shape == (1, 1) and layer.shape == (1,)
    q = jnp.zeros((2, 4, 16), jnp.float32)
    tables, lens = jnp.zeros((2, 3), jnp.int32), jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="needs k_scale"):
        paged_attention(q, fp8, fp8, tables, lens, interpret=True)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        paged_attention(q, fp8, jnp.zeros((4, 4, 2, 16), jnp.float32), tables, lens, interpret=True)


# -- decode kernel ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,case,num_splits,per_head", [
    (jnp.float32, 0, 1, True), (jnp.bfloat16, 0, 3, False), (jnp.float32, 2, 2, False), (jnp.bfloat16, 3, None, True)])
def test_decode_on_fp8_pages(dtype, case, num_splits, per_head):
    lens, block_size, heads, kv_heads, head_dim = CASES[case]
    rng = np.random.default_rng(12)
    k, v, tables, seq_lens = make_paged(rng, lens, block_size, kv_heads, head_dim, jnp.float32)
    kq, vq, ks, vs = fp8_cache(k, v, per_head)
    q = jnp.asarray(rng.standard_normal((len(lens), heads, head_dim)), dtype)
    out = paged_attention(q, kq, vq, tables, seq_lens, k_scale=ks, v_scale=vs, interpret=True, block_n=16,
                          num_splits=num_splits)
    assert out.dtype == q.dtype
    out = np.asarray(out, np.float32)
    same = paged_attention_reference(q, kq, vq, tables, seq_lens, k_scale=ks, v_scale=vs)
    np.testing.assert_allclose(out, np.asarray(same, np.float32), **SAME[dtype])
    full = paged_attention_reference(q.astype(jnp.float32), k, v, tables, seq_lens)
    assert_close_to_full(out, np.asarray(full))
    assert not out[np.asarray(lens) == 0].any(), "padding rows must be zeros"


@pytest.mark.parametrize("traced", [False, True])
def test_decode_stacked_scales_take_the_layer_row(traced):
    """[L, K] scales + a layer row (static or traced) == that row's [K] scales."""
    lens, block_size, heads, kv_heads, head_dim = CASES[2]
    rng = np.random.default_rng(13)
    k, v, tables, seq_lens = make_paged(rng, lens, block_size, kv_heads, head_dim, jnp.float32)
    kq, vq, ks, vs = fp8_cache(k, v)
    stack = lambda s: jnp.stack([s * 3, s, s * 0.5])                   # [3, K]: row 1 is the right one
    q = jnp.asarray(rng.standard_normal((len(lens), heads, head_dim)), jnp.float32)
    run = functools.partial(paged_attention, interpret=True, block_n=16, num_splits=2)
    if traced:
        got = jax.jit(lambda row: run(q, kq, vq, tables, seq_lens, k_scale=stack(ks), v_scale=stack(vs),
                                      layer=row))(jnp.int32(1))
    else:
        got = run(q, kq, vq, tables, seq_lens, k_scale=stack(ks), v_scale=stack(vs), layer=1)
    want = run(q, kq, vq, tables, seq_lens, k_scale=ks, v_scale=vs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6)


def test_qkv_kernel_scale_layer():
    """The engine kernel with one layer's norm weights (row 0) and stacked scales picks row `scale_layer`."""
    lens, block_size, heads, kv_heads, head_dim = CASES[0]
    rng = np.random.default_rng(17)
    k, v, tables, seq_lens = make_paged(rng, lens, block_size, kv_heads, head_dim, jnp.float32)
    kq, vq, ks, vs = fp8_cache(k, v, per_head=False)
    qkv = jnp.asarray(rng.standard_normal((len(lens), heads + 2 * kv_heads, head_dim)), jnp.float32)
    norm, cos = jnp.ones((head_dim,), jnp.float32), jnp.ones((len(lens), head_dim), jnp.float32)
    run = lambda **kw: paged_attention_qkv(qkv, norm, norm, cos, cos, kq, vq, tables, seq_lens, eps=1e-6,
                                           interpret=True, block_n=16, **kw)
    stack = lambda s: jnp.stack([s * 3, s]).reshape(2, 1)               # [L=2, 1]: row 1 is the right one
    got = run(k_scale=stack(ks), v_scale=stack(vs), scale_layer=1)
    want = run(k_scale=ks, v_scale=vs)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("dtype,case,num_splits", [(jnp.float32, 0, 1), (jnp.bfloat16, 2, 2), (jnp.float32, 3, 2)])
def test_qkv_kernel_quantises_the_new_token(dtype, case, num_splits):
    """The engine kernel on fp8 pages writes quantise(norm/rope(k)) and quantise(v) into the new slot (the same
    bits as `quantize` on the CPU) and attends over the cache as stored, the new token included."""
    lens, block_size, heads, kv_heads, head_dim = CASES[case]
    rng = np.random.default_rng(14)
    k, v, tables, _ = make_paged(rng, lens, block_size, kv_heads, head_dim, jnp.float32)
    kq, vq, ks, vs = fp8_cache(k, v)
    ks, vs = ks * 1.5, vs * 1.5             # room for the new token's values
    kq, vq = quantize(k, ks), quantize(v, vs)
    qkv = jnp.asarray(rng.standard_normal((len(lens), heads + 2 * kv_heads, head_dim)), dtype)
    norms = tuple(jnp.asarray(1 + 0.3 * rng.standard_normal(head_dim), dtype) for _ in range(2))
    fused = jax.jit(lambda *a: paged_attention_qkv(*a, eps=1e-6, k_scale=ks, v_scale=vs, interpret=True, block_n=16,
                                                   num_splits=num_splits))
    check_qkv(fused, qkv, norms, kq, vq, tables, lens, SAME[dtype], scales=(ks, vs))


# -- prefill kernel ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,case,per_head", [(jnp.float32, 0, True), (jnp.bfloat16, 2, False)])
def test_prefill_on_fp8_pages(dtype, case, per_head):
    from test_flash_attention import CASES as PREFILL_CASES
    n_new, ctx, block_size, heads, kv_heads, head_dim, pad = PREFILL_CASES[case]
    q, k, v, tables, cu, seq_lens = make_prefill(np.random.default_rng(15), n_new, ctx, block_size, heads, kv_heads,
                                                 head_dim, jnp.float32, pad)
    kq, vq, ks, vs = fp8_cache(k, v, per_head)
    q = q.astype(dtype)
    out = flash_attention(q, kq, vq, tables, cu, seq_lens, k_scale=ks, v_scale=vs, interpret=True, block_q=16,
                          block_k=16)
    assert out.dtype == q.dtype
    out = np.asarray(out, np.float32)
    same = flash_attention_reference(q, kq, vq, tables, cu, seq_lens, k_scale=ks, v_scale=vs)
    np.testing.assert_allclose(out, np.asarray(same, np.float32), **SAME[dtype])
    full = flash_attention_reference(q.astype(jnp.float32), k, v, tables, cu, seq_lens)
    assert_close_to_full(out, np.asarray(full))
    assert not out[int(cu[-1]):].any(), "padding tokens must be zeros"


def assert_kernels_lower(k_cache, v_cache, scales=None):
    """The three Pallas kernels lower to Triton IR for CUDA on these page arrays (ShapeDtypeStructs)."""
    sd = jax.ShapeDtypeStruct
    scales = scales or dict(k_scale=jnp.ones((28, 8)), v_scale=jnp.ones((28, 8)), layer=27)
    tables, lens = sd((8, 8), jnp.int32), sd((8,), jnp.int32)
    assert_lowers_to_triton(functools.partial(paged_attention, **scales),
                            (sd((8, 16, 128), jnp.bfloat16), k_cache, v_cache, tables, lens))
    stacked, rope = sd((28, 128), jnp.bfloat16), sd((8, 128), jnp.float32)
    assert_lowers_to_triton(functools.partial(paged_attention_qkv, eps=1e-6, **scales),
                            (sd((8, 32, 128), jnp.bfloat16), stacked, stacked, rope, rope, k_cache, v_cache, tables,
                             lens))
    assert_lowers_to_triton(functools.partial(flash_attention, k_scale=jnp.ones(()), v_scale=jnp.ones(())),
                            (sd((512, 16, 128), jnp.bfloat16), k_cache, v_cache, sd((4, 16), jnp.int32),
                             sd((5,), jnp.int32), sd((4,), jnp.int32)))


def test_fp8_lowers_to_triton():
    """fp8 pages lower to Triton IR for CUDA (direct float8_e4m3fn loads, tt.fp_to_fp conversions)."""
    cache = jax.ShapeDtypeStruct((64, 16, 8, 128), FP8_DTYPE)
    assert_kernels_lower(cache, cache)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,max_len", [(64, 2048), (3, 4096), (17, 300)])
def test_gpu_compiled_fp8(batch, max_len):
    """Compiled on the GPU: both kernels on fp8 pages against the reference on the same pages (bf16 q), and
    the engine kernel's new-token write (Triton's fp32 division may round a value to the neighbouring fp8)."""
    rng = np.random.default_rng(16)
    lens = rng.integers(1, max_len + 1, batch)
    lens[0], lens[-1] = 1, max_len
    k, v, tables, seq_lens = make_paged(rng, lens, 16, 8, 128, jnp.float32)
    kq, vq, ks, vs = fp8_cache(k, v)
    ks, vs = ks * 1.5, vs * 1.5
    kq, vq = quantize(k, ks), quantize(v, vs)
    q = jnp.asarray(rng.standard_normal((batch, 16, 128)), jnp.bfloat16)
    out = jax.jit(functools.partial(paged_attention, k_scale=ks, v_scale=vs))(q, kq, vq, tables, seq_lens)
    ref = paged_attention_reference(q, kq, vq, tables, seq_lens, k_scale=ks, v_scale=vs)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **SAME[jnp.bfloat16])
    qkv = jnp.asarray(rng.standard_normal((batch, 32, 128)), jnp.bfloat16)
    norms = tuple(jnp.asarray(1 + 0.3 * rng.standard_normal(128), jnp.bfloat16) for _ in range(2))
    fused = jax.jit(functools.partial(paged_attention_qkv, eps=1e-6, k_scale=ks, v_scale=vs))
    check_qkv(fused, qkv, norms, kq, vq, tables, lens, SAME[jnp.bfloat16], theta=1e6, scales=(ks, vs))
    n_new = [int(min(n, 300)) for n in lens[:4]]
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(n_new)]), jnp.int32)
    qp = jnp.asarray(rng.standard_normal((int(cu[-1]) + 16, 16, 128)), jnp.bfloat16)
    t4, l4 = tables[:4], seq_lens[:4]
    out = jax.jit(functools.partial(flash_attention, k_scale=ks, v_scale=vs))(qp, kq, vq, t4, cu, l4)
    ref = flash_attention_reference(qp, kq, vq, t4, cu, l4, k_scale=ks, v_scale=vs)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **SAME[jnp.bfloat16])
