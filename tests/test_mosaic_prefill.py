"""Mosaic GPU varlen causal prefill (pallas_kernels/mosaic/flash_prefill.py), its program-per-q-tile kernel
(persistent=False; the persistent one, flash_prefill's default, in test_mosaic_persistent.py).

On the CPU the kernel is LOWERED for CUDA (Pallas' Mosaic lowering runs in Python: API, register-layout,
SMEM-transform, TMA-shape and shared-memory-size errors show up here) and RUN in Mosaic GPU's interpreter on one
small case (threads, SMEM, TMA copies and mbarriers simulated; the wgmmas are dots there). The gpu-marked tests
run the compiled kernel on the device against the jnp reference:
    PYTHONPATH=. python -m pytest -q -m gpu tests/test_mosaic_prefill.py
"""
import numpy as np
import jax
import jax.numpy as jnp
import pytest
from helpers import make_paged

from pallas_kernels.mosaic import _common, flash_prefill as fp
from pallas_kernels.mosaic.prefill_tiles import aligned_tiles
from pallas_kernels.mosaic.flash_prefill import flash_prefill, flash_prefill_reference

needs_mosaic = pytest.mark.skipif(not fp.available(), reason="this JAX has no Pallas Mosaic GPU backend")
needs_interpreter = pytest.mark.skipif(not fp.available() or fp._interpreter() is None,
                                       reason="this JAX has no Mosaic GPU interpreter")
sd = jax.ShapeDtypeStruct
FP8 = jnp.float8_e4m3fn


@pytest.fixture
def lowering_only(monkeypatch):
    """Lets the entry point trace on the CPU: these tests lower for CUDA, they never run the kernel here."""
    monkeypatch.setattr(fp, "_on_gpu", lambda: True)


def lowered_text(fn, args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def prefill_args(tokens, heads, kv_heads, head_dim, block_size, batch, width, dtype=jnp.bfloat16, cache_dtype=None):
    cache = sd((64, block_size, kv_heads, head_dim), cache_dtype or dtype)
    return (sd((tokens, heads, head_dim), dtype), cache, cache, sd((batch, width), jnp.int32),
            sd((batch + 1,), jnp.int32), sd((batch,), jnp.int32))


# (tokens, heads, kv_heads, head_dim, block_size, batch, table width, dtype, options). Lengths, prefixes and
# ragged splits are runtime values: the shapes decide what is lowered (two heads per program when the group is
# even, two 64-row halves of one head otherwise; copies per tile; padding of q).
LOWER_CASES = [
    (8192, 16, 8, 128, 16, 8, 64, jnp.bfloat16, {}),  # Qwen3-0.6B: GQA 2, 8 x 1024 (or 1 x 8192)
    (300, 4, 1, 128, 16, 3, 8, jnp.bfloat16, {}),  # MQA (group 4), T not a multiple of 8 (q padded)
    (512, 8, 8, 64, 16, 4, 16, jnp.bfloat16, {}),  # no GQA: 128-row tiles of one head, head_dim 64
    (200, 6, 2, 64, 32, 2, 8, jnp.float16, dict(block_kv=64)),  # odd group 3, fp16, 2 pages a tile
    (40, 8, 4, 128, 8, 2, 10, jnp.bfloat16, {}),  # T < 64, 8-token pages (16 copies a tile)
    (512, 16, 8, 128, 128, 4, 4, jnp.bfloat16, dict(block_kv=64)),  # pages bigger than a tile
    (1024, 16, 8, 128, 16, 4, 32, jnp.bfloat16, dict(block_kv=64, num_stages=3)),
    (256, 4, 2, 64, 16, 2, 16, jnp.bfloat16, dict(block_kv=256, num_stages=2)),
    (1024, 16, 8, 128, 16, 4, 32, jnp.bfloat16, dict(pair_heads=False)),  # GQA 2 in FA3's layout
]


@needs_mosaic
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim,block_size,batch,width,dtype,opts", LOWER_CASES)
def test_lowers_for_cuda(lowering_only, tokens, heads, kv_heads, head_dim, block_size, batch, width, dtype, opts):
    args = prefill_args(tokens, heads, kv_heads, head_dim, block_size, batch, width, dtype)
    text = lowered_text(lambda *a: flash_prefill(*a, **opts, persistent=False), args)
    assert "mosaic_gpu" in text and "triton" not in text


@needs_mosaic
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,scales,opts", [
    (16, 8, 128, 16, dict(k_scale=jnp.ones((28, 8)), v_scale=jnp.ones((28, 8)), layer=27), {}),  # block_kv 64
    (4, 1, 64, 32, dict(k_scale=jnp.ones(()), v_scale=jnp.ones(())), {}),  # 64-byte fp8 rows, one scale
    (4, 4, 64, 16, dict(k_scale=jnp.ones((2, 1)), v_scale=jnp.ones((2, 1)), layer=1), dict(num_stages=3)),
])
def test_lowers_for_cuda_fp8(lowering_only, heads, kv_heads, head_dim, block_size, scales, opts):
    """float8_e4m3fn pages, per-layer / per-kv-head scales (each compute warpgroup converts to f16 tiles)."""
    args = prefill_args(512, heads, kv_heads, head_dim, block_size, 4, 16, cache_dtype=FP8)
    assert "mosaic_gpu" in lowered_text(lambda *a: flash_prefill(*a, **scales, **opts, persistent=False), args)


@needs_mosaic
@pytest.mark.parametrize("case", [LOWER_CASES[1], LOWER_CASES[3], LOWER_CASES[5]])
def test_lowers_with_layout_inference(lowering_only, monkeypatch, case):
    """Warpgroup lowering (JAX 0.11's default) runs Mosaic's layout inference, which checks each TMA copy's start
    against the SMEM tile's 8-row tiling: q windows start at multiples of 8 (a tile's first row, anywhere in the
    packed q, made it unsatisfiable on jax 0.11.2). MQA halves, an odd group, a tile inside a bigger page."""
    tokens, heads, kv_heads, head_dim, block_size, batch, width, dtype, opts = case
    monkeypatch.setattr(_common, "LOWERING", "Warpgroup")
    jax.clear_caches()  # the kernel's jit caches traces by shapes
    try:
        args = prefill_args(tokens, heads, kv_heads, head_dim, block_size, batch, width, dtype)
        assert "mosaic_gpu" in lowered_text(lambda *a: flash_prefill(*a, **opts, persistent=False), args)
    finally:
        jax.clear_caches()


@pytest.mark.parametrize("tile_rows", [64, 128])
def test_aligned_tiles_cover_every_row_once(tile_rows):
    """Each row of [0, T) belongs to exactly one tile, of the right zone (sequence, B: padding); every window
    (first & ~7, tile_rows rows) starts at a multiple of 8 and holds its tile's rows; heaviest tiles first."""
    n_new = np.array([70, 1, 0, 9, 200, 64, 3])
    num_tokens = int(n_new.sum()) + 13  # 13 padding rows
    cu = np.concatenate([[0], np.cumsum(n_new)]).astype(np.int32)
    seq, first, end = map(np.asarray, aligned_tiles(jnp.asarray(cu), jnp.asarray(n_new + 5, jnp.int32), num_tokens,
                                                    tile_rows))
    owner = np.full(num_tokens, -1)
    for s, f, e in zip(seq, first, end):
        if e <= f:
            continue
        assert (owner[f:e] == -1).all(), "a row in two tiles"
        owner[f:e] = s
        window = f // 8 * 8
        assert e - window <= tile_rows and s <= len(n_new)
    zone = np.searchsorted(cu[1:], np.arange(num_tokens), side="right")  # the row's sequence, B for padding
    np.testing.assert_array_equal(owner, zone)
    real = seq < len(n_new)  # work: keys seen by the tile's last row (cached prefix 5), padding/unused last
    work = np.where(real, 5 + end - cu[np.minimum(seq, len(n_new))], -1)
    assert (np.diff(work) <= 0).all() and real.sum() == sum(-(-(n + c % 8) // tile_rows) for n, c in
                                                            zip(n_new, cu[:-1]) if n)


def make_prefill(rng, n_new, prefix, block_size, heads, kv_heads, head_dim, pad_tokens=0, fp8=False):
    """Packed q for n_new new tokens per sequence after a cached prefix; pages scattered over a permuted pool."""
    ctx = [n + p for n, p in zip(n_new, prefix)]
    k, v, tables, lens = make_paged(rng, ctx, block_size, kv_heads, head_dim, jnp.float32 if fp8 else jnp.bfloat16)
    scales = {}
    if fp8:  # stacked [L=2, K] scales per kv head, row 1 this layer's
        from pallas_kernels.quant import quantize, scale_for_amax
        ks, vs = (scale_for_amax(jnp.abs(x).max((0, 1, 3))) for x in (k, v))
        k, v = quantize(k, ks), quantize(v, vs)
        scales = dict(k_scale=jnp.stack([ks * 0.5, ks]), v_scale=jnp.stack([vs * 0.5, vs]), layer=1)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(n_new)]).astype(np.int32))
    q = jnp.asarray(rng.standard_normal((int(cu[-1]) + pad_tokens, heads, head_dim)), jnp.bfloat16)
    return (q, k, v, tables, cu, lens), scales


def check(out, args, scales, tol=2e-2):
    q, cu = args[0], args[4]
    ref = flash_prefill_reference(*args, **scales)
    assert out.shape == q.shape and out.dtype == q.dtype
    out = np.asarray(out, np.float32)
    np.testing.assert_allclose(out, np.asarray(ref, np.float32), atol=tol, rtol=tol)
    assert not out[int(cu[-1]):].any(), "padding tokens must be zeros"


@needs_interpreter
@pytest.mark.parametrize("n_new,prefix,block_size,heads,fp8", [
    # no GQA (two 64-row halves of a tile, the second with one row), fp8 pages, 8 copies a tile, a 1-token chunk
    ([65, 1], [10, 4], 8, 1, True),
])
def test_interpreter_matches_reference(n_new, prefix, block_size, heads, fp8):
    """Mosaic GPU's interpreter (the warpgroups as threads, TMA, mbarriers, every barrier phase observed; wgmma
    as dots), permuted block tables, cached prefixes, padding rows. ~20 s on 2 cores. (One case, for CI time:
    the paired-heads layout, the GPU default, is lowered here and run compiled by the GPU-marked tests.)"""
    args, scales = make_prefill(np.random.default_rng(3), n_new, prefix, block_size, heads, 1, 64, pad_tokens=3,
                                fp8=fp8)
    check(flash_prefill(*args, interpret=True, block_kv=64, persistent=False, **scales), args, scales)


@needs_mosaic
@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CPU's error: this machine has a GPU")
def test_cpu_call_is_a_clear_error():
    args, _ = make_prefill(np.random.default_rng(0), [5], [0], 16, 2, 1, 64)
    with pytest.raises(ValueError, match="needs a CUDA GPU.*flash_attention"):
        flash_prefill(*args)


@pytest.mark.parametrize("bad,match", [
    (dict(q=jnp.zeros((6, 4, 64), jnp.float32), k_cache=jnp.zeros((6, 16, 2, 64), jnp.float32),
          v_cache=jnp.zeros((6, 16, 2, 64), jnp.float32)), "bfloat16 or float16"),
    (dict(k_cache=jnp.zeros((6, 16, 2, 64), FP8), v_cache=jnp.zeros((6, 16, 2, 64), FP8)),
     "needs k_scale and v_scale"),
    (dict(k_scale=jnp.float32(1), v_scale=jnp.float32(1)), "for float8_e4m3fn caches"),
    (dict(q=jnp.zeros((6, 4, 256), jnp.bfloat16), k_cache=jnp.zeros((6, 16, 2, 256), jnp.bfloat16),
          v_cache=jnp.zeros((6, 16, 2, 256), jnp.bfloat16)), "head_dim must be 64 or 128"),
    (dict(k_cache=jnp.zeros((6, 4, 2, 64), jnp.bfloat16), v_cache=jnp.zeros((6, 4, 2, 64), jnp.bfloat16)),
     "block_size must be >= 8"),
    (dict(block_kv=32), "block_kv"),
    (dict(num_stages=1), "num_stages"),
    (dict(q=jnp.zeros((6, 4, 128), jnp.bfloat16), k_cache=jnp.zeros((6, 16, 2, 128), jnp.bfloat16),
          v_cache=jnp.zeros((6, 16, 2, 128), jnp.bfloat16), block_kv=256, num_stages=3), "shared memory"),
    (dict(cu_seqlens_q=jnp.zeros((2,), jnp.int32)), "cu_seqlens_q"),
    (dict(seq_lens=jnp.zeros((2,), jnp.float32)), "seq_lens must be int32"),
    (dict(q=jnp.zeros((6, 64), jnp.bfloat16)), r"q must be \[T, H, D\]"),
])
@needs_mosaic
def test_validation(lowering_only, bad, match):
    args = dict(q=jnp.zeros((6, 4, 64), jnp.bfloat16), k_cache=jnp.zeros((6, 16, 2, 64), jnp.bfloat16),
                v_cache=jnp.zeros((6, 16, 2, 64), jnp.bfloat16), block_tables=jnp.zeros((2, 3), jnp.int32),
                cu_seqlens_q=jnp.zeros((3,), jnp.int32), seq_lens=jnp.zeros((2,), jnp.int32))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        flash_prefill(**args)


def test_smem_estimate():
    """Qwen3's head_dim 128 fits with 128-token tiles and two stages (one program per SM), fp8 with 64-token tiles;
    the estimate is within 200 bytes above what Mosaic's lowering reported (264312 bytes at 128 x 3 stages)."""
    assert fp.smem_bytes(128, 128, 2) <= fp.MAX_SMEM < fp.smem_bytes(128, 128, 3)
    assert 0 <= fp.smem_bytes(128, 128, 3) - 264312 < 200
    assert fp.smem_bytes(128, 64, 5) <= fp.MAX_SMEM  # lowers (5 stages of 64 tokens)
    assert fp.smem_bytes(128, 64, 2, fp8=True) <= fp.MAX_SMEM < fp.smem_bytes(128, 128, 2, fp8=True)


@needs_mosaic
def test_lowering_refuses_what_does_not_fit(lowering_only):
    """Mosaic's own shared-memory check agrees with the entry point's: 3 stages of 128 tokens do not fit."""
    args = prefill_args(512, 16, 8, 128, 16, 4, 16)
    with pytest.raises(ValueError, match="shared memory"):
        lowered_text(lambda *a: fp._flash_prefill(*a, scale=0.1, block_kv=128, num_stages=3), args)


def test_reference_is_the_flash_attention_reference():
    from pallas_kernels.flash_attention import flash_attention_reference
    args, _ = make_prefill(np.random.default_rng(0), [5, 3], [2, 0], 8, 4, 2, 64, pad_tokens=2)
    out = np.asarray(flash_prefill_reference(*args, scale=0.2), np.float32)
    np.testing.assert_array_equal(out, np.asarray(flash_attention_reference(*args, scale=0.2), np.float32))
    assert out[:8].any() and not out[8:].any()


# ---- on the GPU (PYTHONPATH=. python -m pytest -q -m gpu tests/test_mosaic_prefill.py) ----

@pytest.mark.gpu
@pytest.mark.parametrize("n_new,prefix,block_size,heads,kv_heads,head_dim,opts", [
    ([512, 1024, 1, 300], [0, 0, 700, 1000], 16, 16, 8, 128, {}),  # Qwen3-0.6B: fresh prompts, a 1-token chunk
    ([2048], [0], 16, 16, 8, 128, dict(block_kv=64)),
    ([77, 128, 200, 63], [16, 128, 33, 0], 32, 16, 8, 128, dict(num_stages=3, block_kv=64)),  # ragged tiles
    ([300, 65], [40, 1000], 16, 4, 1, 128, {}),  # MQA
    ([129, 64, 1], [0, 7, 500], 8, 8, 8, 64, {}),  # no GQA (128-row tiles), head_dim 64, 8-token pages
    ([100, 37], [20, 0], 128, 6, 2, 64, dict(block_kv=64)),  # group 3, pages bigger than a tile
    ([512, 1024, 1, 300], [0, 0, 700, 1000], 16, 16, 8, 128, dict(pair_heads=False)),  # FA3's layout
])
def test_gpu_matches_reference(n_new, prefix, block_size, heads, kv_heads, head_dim, opts):
    """Permuted block tables, ragged lengths, cached prefixes, padding rows; bf16 against the jnp reference."""
    args, _ = make_prefill(np.random.default_rng(4), n_new, prefix, block_size, heads, kv_heads, head_dim,
                           pad_tokens=13)
    check(jax.jit(lambda *a: flash_prefill(*a, **opts, persistent=False))(*args), args, {})


@pytest.mark.gpu
def test_gpu_fp8_matches_reference():
    args, scales = make_prefill(np.random.default_rng(5), [700, 1, 90], [0, 300, 1000], 16, 16, 8, 128,
                                pad_tokens=5, fp8=True)
    check(jax.jit(lambda *a: flash_prefill(*a, **scales, block_kv=64, persistent=False))(*args), args, scales)
