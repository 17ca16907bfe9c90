"""fp8 V pages in pairs (pallas_kernels/quant.py: the bytes of fp8 [P, bs, K, D] viewed as uint16 [P, bs, K, D/2],
the engine's layout for the pallas backend): packing, and every Pallas kernel giving the same output on pairs as on
the plain fp8 pages they hold (interpret mode), the new token's write included; lowering for CUDA; clear errors."""
import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from helpers import make_paged
from test_flash_attention import CASES as PREFILL_CASES, make_prefill
from test_fp8_kernels import SAME, assert_kernels_lower, fp8_cache
from test_paged_attention import CASES, check_qkv

from pallas_kernels._common import check_paged_inputs
from pallas_kernels.flash_attention import flash_attention
from pallas_kernels.paged_attention import paged_attention, paged_attention_qkv
from pallas_kernels.quant import FP8_DTYPE, PAIRS_DTYPE, pack_pairs, pair_halves, quantize, unpack_pairs


def test_pack_unpack_round_trip_and_halves():
    x = quantize(jnp.asarray(np.random.default_rng(0).standard_normal((3, 4, 2, 16)) * 50, jnp.float32), 1.0)
    u = pack_pairs(x)
    assert u.dtype == PAIRS_DTYPE and u.shape == (3, 4, 2, 8)
    np.testing.assert_array_equal(np.asarray(unpack_pairs(u), np.float32), np.asarray(x, np.float32))
    # the same bytes: element j of a row is dimension 2j (low byte) and 2j + 1 (high byte)
    assert np.asarray(u).tobytes() == np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint8)).tobytes()
    even, odd = pair_halves(u, jnp.float32)
    np.testing.assert_array_equal(np.asarray(even), np.asarray(x[..., 0::2], np.float32))
    np.testing.assert_array_equal(np.asarray(odd), np.asarray(x[..., 1::2], np.float32))


@pytest.mark.parametrize("dtype,case,num_splits", [(jnp.float32, 0, 1), (jnp.bfloat16, 2, 3), (jnp.float32, 3, None),
                                                    (jnp.float32, 4, 2)])   # 4: head_dim 48, pairs padded to 32
def test_decode_pairs_equal_fp8_pages(dtype, case, num_splits):
    lens, block_size, heads, kv_heads, head_dim = CASES[case]
    rng = np.random.default_rng(21)
    k, v, tables, seq_lens = make_paged(rng, lens, block_size, kv_heads, head_dim, jnp.float32)
    kq, vq, ks, vs = fp8_cache(k, v)
    q = jnp.asarray(rng.standard_normal((len(lens), heads, head_dim)), dtype)
    run = functools.partial(paged_attention, k_scale=ks, v_scale=vs, interpret=True, block_n=16, num_splits=num_splits)
    got = np.asarray(run(q, kq, pack_pairs(vq), tables, seq_lens), np.float32)
    want = np.asarray(run(q, kq, vq, tables, seq_lens), np.float32)
    np.testing.assert_allclose(got, want, **({"atol": 1e-6, "rtol": 1e-6} if dtype == jnp.float32 else SAME[dtype]))
    assert np.abs(got).max() > 0.1


@pytest.mark.parametrize("dtype,case,num_splits", [(jnp.float32, 0, 1), (jnp.bfloat16, 2, 2), (jnp.float32, 3, 2)])
def test_qkv_kernel_on_pairs_writes_and_attends(dtype, case, num_splits):
    """The engine kernel on pairs: the new token's v is quantised, packed and stored in its slot (the other slots
    untouched), and the output matches the reference on the unpacked pages."""
    lens, block_size, heads, kv_heads, head_dim = CASES[case]
    rng = np.random.default_rng(22)
    k, v, tables, _ = make_paged(rng, lens, block_size, kv_heads, head_dim, jnp.float32)
    _, _, ks, vs = fp8_cache(k, v)
    ks, vs = ks * 1.5, vs * 1.5
    kq, vq = quantize(k, ks), quantize(v, vs)
    qkv = jnp.asarray(rng.standard_normal((len(lens), heads + 2 * kv_heads, head_dim)), dtype)
    norms = tuple(jnp.asarray(1 + 0.3 * rng.standard_normal(head_dim), dtype) for _ in range(2))
    fused = jax.jit(lambda *a: paged_attention_qkv(*a, eps=1e-6, k_scale=ks, v_scale=vs, interpret=True, block_n=16,
                                                   num_splits=num_splits))
    check_qkv(fused, qkv, norms, kq, pack_pairs(vq), tables, lens, SAME[dtype], scales=(ks, vs))


@pytest.mark.parametrize("dtype,case", [(jnp.float32, 0), (jnp.bfloat16, 2), (jnp.float32, 3)])
def test_prefill_pairs_equal_fp8_pages(dtype, case):
    n_new, ctx, block_size, heads, kv_heads, head_dim, pad = PREFILL_CASES[case]
    q, k, v, tables, cu, seq_lens = make_prefill(np.random.default_rng(23), n_new, ctx, block_size, heads, kv_heads,
                                                 head_dim, jnp.float32, pad)
    kq, vq, ks, vs = fp8_cache(k, v)
    q = q.astype(dtype)
    run = functools.partial(flash_attention, k_scale=ks, v_scale=vs, interpret=True, block_q=16, block_k=16)
    got = np.asarray(run(q, kq, pack_pairs(vq), tables, cu, seq_lens), np.float32)
    want = np.asarray(run(q, kq, vq, tables, cu, seq_lens), np.float32)
    np.testing.assert_allclose(got, want, **({"atol": 1e-6, "rtol": 1e-6} if dtype == jnp.float32 else SAME[dtype]))
    assert not got[int(cu[-1]):].any(), "padding tokens must be zeros"


def test_engine_layout_of_v_pages():
    """The engine keeps fp8 V pages in pairs on the pallas backend only, and only where each half-dot keeps the
    16 columns Triton's dots need (head_dim >= 32)."""
    from jaxinfer.model.attention import v_pages
    assert v_pages("pallas", (8, 16, 2, 128), FP8_DTYPE) == ((8, 16, 2, 64), PAIRS_DTYPE)
    assert v_pages("pallas", (8, 16, 2, 16), FP8_DTYPE) == ((8, 16, 2, 16), FP8_DTYPE)
    assert v_pages("xla", (8, 16, 2, 128), FP8_DTYPE) == ((8, 16, 2, 128), FP8_DTYPE)
    assert v_pages("pallas", (8, 16, 2, 128), jnp.bfloat16) == ((8, 16, 2, 128), jnp.bfloat16)


def test_pairs_errors_name_the_value():
    k8 = jnp.zeros((4, 4, 2, 16), FP8_DTYPE)
    u = jnp.zeros((4, 4, 2, 8), PAIRS_DTYPE)
    tables, lens = jnp.zeros((2, 3), jnp.int32), jnp.zeros((2,), jnp.int32)
    check_paged_inputs("f", 4, 16, jnp.bfloat16, k8, u, tables, lens, 2, pairs=True)      # fine
    with pytest.raises(ValueError, match="read only by the Pallas kernels"):
        check_paged_inputs("cudnn_paged_decode", 4, 16, jnp.bfloat16, k8, u, tables, lens, 2)
    with pytest.raises(ValueError, match=r"must have shape \(4, 4, 2, 8\)"):
        check_paged_inputs("f", 4, 16, jnp.bfloat16, k8, jnp.zeros((4, 4, 2, 16), PAIRS_DTYPE), tables, lens, 2,
                           pairs=True)
    with pytest.raises(ValueError, match="float8_e4m3fn k_cache"):
        check_paged_inputs("f", 4, 16, jnp.bfloat16, jnp.zeros((4, 4, 2, 16), jnp.bfloat16), u, tables, lens, 2,
                           pairs=True)


def test_pairs_lower_to_triton():
    sd = jax.ShapeDtypeStruct
    assert_kernels_lower(sd((64, 16, 8, 128), FP8_DTYPE), sd((64, 16, 8, 64), PAIRS_DTYPE),
                         dict(k_scale=jnp.ones((28, 1)), v_scale=jnp.ones((28, 1)), layer=3))


@pytest.mark.gpu
@pytest.mark.parametrize("batch,max_len", [(64, 2048), (17, 300)])
def test_gpu_compiled_pairs(batch, max_len):
    """Compiled on the GPU: the three kernels on pairs against the same kernels on the fp8 pages they hold."""
    rng = np.random.default_rng(24)
    lens = rng.integers(1, max_len + 1, batch)
    lens[0], lens[-1] = 1, max_len
    k, v, tables, seq_lens = make_paged(rng, lens, 16, 8, 128, jnp.float32)
    kq, vq, ks, vs = fp8_cache(k, v)
    q = jnp.asarray(rng.standard_normal((batch, 16, 128)), jnp.bfloat16)
    run = jax.jit(functools.partial(paged_attention, k_scale=ks, v_scale=vs))
    np.testing.assert_allclose(np.asarray(run(q, kq, pack_pairs(vq), tables, seq_lens), np.float32),
                               np.asarray(run(q, kq, vq, tables, seq_lens), np.float32), **SAME[jnp.bfloat16])
    qkv = jnp.asarray(rng.standard_normal((batch, 32, 128)), jnp.bfloat16)
    norms = tuple(jnp.asarray(1 + 0.3 * rng.standard_normal(128), jnp.bfloat16) for _ in range(2))
    fused = jax.jit(functools.partial(paged_attention_qkv, eps=1e-6, k_scale=ks * 1.5, v_scale=vs * 1.5))
    kq2, vq2 = quantize(k, ks * 1.5), quantize(v, vs * 1.5)
    check_qkv(fused, qkv, norms, kq2, pack_pairs(vq2), tables, lens, SAME[jnp.bfloat16], theta=1e6,
              scales=(ks * 1.5, vs * 1.5))
    n_new = [int(min(n, 300)) for n in lens[:4]]
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(n_new)]), jnp.int32)
    qp = jnp.asarray(rng.standard_normal((int(cu[-1]) + 16, 16, 128)), jnp.bfloat16)
    pre = jax.jit(functools.partial(flash_attention, k_scale=ks, v_scale=vs))
    np.testing.assert_allclose(np.asarray(pre(qp, kq, pack_pairs(vq), tables[:4], cu, seq_lens[:4]), np.float32),
                               np.asarray(pre(qp, kq, vq, tables[:4], cu, seq_lens[:4]), np.float32),
                               **SAME[jnp.bfloat16])
