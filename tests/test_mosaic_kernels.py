"""Mosaic GPU paged decode (pallas_kernels/mosaic/paged_decode.py).

On the CPU the kernel is checked two ways: LOWERED for CUDA (Pallas' Mosaic lowering runs in Python and catches
API, register-layout, SMEM-transform and shared-memory-size errors), and RUN in Mosaic GPU's interpreter (JAX's
private GPU interpret mode: simulated SMEM, TMA copies and mbarriers, against the jnp reference; there the
wgmmas are dots of the loaded tiles). The gpu-marked tests run the compiled kernel on the device
(PYTHONPATH=. python -m pytest -q -m gpu tests/test_mosaic_kernels.py).
"""
import os

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from helpers import make_paged

from pallas_kernels.mosaic import _common, paged_decode
from pallas_kernels.mosaic.paged_decode import paged_decode_attention, paged_decode_attention_reference

needs_mosaic = pytest.mark.skipif(not paged_decode.available(), reason="this JAX has no Pallas Mosaic GPU backend")
needs_interpreter = pytest.mark.skipif(not paged_decode.available() or paged_decode._interpreter() is None,
                                       reason="this JAX has no Mosaic GPU interpreter")
sd = jax.ShapeDtypeStruct


@pytest.fixture
def lowering_only(monkeypatch):
    """Lets the entry point trace on the CPU: the tests lower for CUDA, they never run the kernel here."""
    monkeypatch.setattr(paged_decode, "_on_gpu", lambda: True)


def lowered_text(fn, args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


# (batch, heads, kv_heads, head_dim, block_size, table width, dtype, tile options)
LOWER_CASES = [
    (8, 16, 8, 128, 16, 8, jnp.bfloat16, {}),  # Qwen3-0.6B: GQA group 2, one split
    (2, 16, 8, 128, 16, 64, jnp.bfloat16, dict(num_splits=4)),  # long context, split-K combine
    (3, 4, 1, 128, 16, 5, jnp.bfloat16, {}),  # MQA: one kv head, group 4
    (5, 6, 2, 64, 16, 7, jnp.float16, dict(num_splits=2)),  # odd group (3), head_dim 64, fp16
    (2, 5, 5, 128, 8, 20, jnp.bfloat16, dict(num_stages=3)),  # no GQA, 8-token pages (8 copies a tile)
    (4, 16, 8, 128, 128, 2, jnp.bfloat16, dict(num_splits=2)),  # pages bigger than a tile
    (4, 32, 4, 256, 32, 4, jnp.bfloat16, dict(block_n=128, num_stages=1)),  # group 8, head_dim 256
]


@needs_mosaic
@pytest.mark.parametrize("batch,heads,kv_heads,head_dim,block_size,width,dtype,opts", LOWER_CASES)
def test_lowers_for_cuda(lowering_only, batch, heads, kv_heads, head_dim, block_size, width, dtype, opts):
    cache = sd((40, block_size, kv_heads, head_dim), dtype)
    args = (sd((batch, heads, head_dim), dtype), cache, cache, sd((batch, width), jnp.int32),
            sd((batch,), jnp.int32))
    text = lowered_text(lambda *a: paged_decode_attention(*a, **opts), args)
    assert "mosaic_gpu" in text and "triton" not in text


FP8 = jnp.float8_e4m3fn


@needs_mosaic
@pytest.mark.parametrize("batch,heads,kv_heads,head_dim,block_size,scales,opts", [
    (8, 16, 8, 128, 16, dict(k_scale=jnp.ones((28, 8)), v_scale=jnp.ones((28, 8)), layer=27), {}),  # per kv head
    (2, 16, 8, 128, 16, dict(k_scale=jnp.ones((28, 1)), v_scale=jnp.ones((28, 1)), layer=3), dict(num_splits=4)),
    (3, 4, 1, 64, 32, dict(k_scale=jnp.ones(()), v_scale=jnp.ones(())), dict(num_stages=3)),  # 64-byte fp8 rows
])
def test_lowers_for_cuda_fp8(lowering_only, batch, heads, kv_heads, head_dim, block_size, scales, opts):
    """float8_e4m3fn pages with per-layer / per-kv-head scales (converted to f16 tiles in the kernel)."""
    cache = sd((40, block_size, kv_heads, head_dim), FP8)
    args = (sd((batch, heads, head_dim), jnp.bfloat16), cache, cache, sd((batch, 8), jnp.int32),
            sd((batch,), jnp.int32))
    assert "mosaic_gpu" in lowered_text(lambda *a: paged_decode_attention(*a, **scales, **opts), args)


@needs_mosaic
def test_lowers_with_order_inside_a_jit(lowering_only):
    """`order` (rows longest first) and traced lengths, as the engine calls it."""
    cache = sd((64, 16, 8, 128), jnp.bfloat16)
    args = (sd((6, 16, 128), jnp.bfloat16), cache, cache, sd((6, 9), jnp.int32), sd((6,), jnp.int32),
            sd((6,), jnp.int32))
    fn = lambda q, k, v, t, lens, order: paged_decode_attention(q, k, v, t, lens, order=order, scale=0.1)
    assert "mosaic_gpu" in lowered_text(fn, args)


@pytest.fixture
def warpgroup_lowering(monkeypatch):
    """Mosaic's Warpgroup lowering (JAX 0.11's default), with fresh traces: the kernel's jit caches by shapes."""
    monkeypatch.setattr(_common, "LOWERING", "Warpgroup")
    jax.clear_caches()
    yield
    jax.clear_caches()


@needs_mosaic
@pytest.mark.parametrize("batch,heads,kv_heads,head_dim,block_size,width,dtype,opts",
                         [LOWER_CASES[0], LOWER_CASES[3], LOWER_CASES[5]])
def test_lowers_with_layout_inference(lowering_only, warpgroup_lowering, batch, heads, kv_heads, head_dim,
                                      block_size, width, dtype, opts):
    """Warpgroup lowering runs Mosaic's layout inference, which checks every TMA copy's start against the SMEM
    tile's 8-row tiling (Lane lowering does not: there a start inside a tile reads wrong rows, and the
    interpreter does not model tiles). q groups start at multiples of 8: GQA 2, an odd group (3), a tile inside
    a bigger page. (A group's first row at b*H + k*G made this unsatisfiable, the jax 0.11.2 failure.)"""
    cache = sd((40, block_size, kv_heads, head_dim), dtype)
    args = (sd((batch, heads, head_dim), dtype), cache, cache, sd((batch, width), jnp.int32),
            sd((batch,), jnp.int32))
    assert "mosaic_gpu" in lowered_text(lambda *a: paged_decode_attention(*a, **opts), args)


def test_bad_lowering_switch_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(_common, "LOWERING", "lanes")
    with pytest.raises(ValueError, match="JAXINFER_MOSAIC_LOWERING='lanes'"):
        _common.compiler_params(approx_math=True)


# (lens, block_size, heads, kv_heads, head_dim, fp8 scales, options): ragged lengths with 1, a block boundary and
# a padding row (0); each case a few seconds in the interpreter
INTERPRET_CASES = [
    ([1, 17, 64, 0, 100], 16, 4, 2, 64, None, dict(num_splits=3)),  # GQA 2, 3 splits of 64-token tiles
    ([5, 130, 33], 8, 3, 1, 64, None, dict(num_stages=3)),  # MQA, group 3, 8-token pages (8 copies a tile)
    ([40, 1, 0, 200], 128, 2, 2, 64, None, dict(num_splits=2)),  # no GQA, pages bigger than a tile
    ([1, 17, 64, 0, 100], 16, 4, 2, 64, "head", dict(num_splits=2)),  # fp8 pages, per-kv-head scales
    ([3, 90], 32, 8, 1, 64, "layer", {}),  # fp8 pages, one scale per layer, group 8
]


@needs_interpreter
@pytest.mark.parametrize("lens,block_size,heads,kv_heads,head_dim,fp8,opts", INTERPRET_CASES)
def test_interpreter_matches_reference(lens, block_size, heads, kv_heads, head_dim, fp8, opts):
    """The kernel run in Mosaic GPU's interpreter (permuted block tables, garbage past each row's pages; rows run
    longest first) against the jnp reference, in bf16."""
    from pallas_kernels.quant import quantize, scale_for_amax
    rng = np.random.default_rng(2)
    k, v, tables, seq_lens = make_paged(rng, lens, block_size, kv_heads, head_dim,
                                        jnp.float32 if fp8 else jnp.bfloat16)
    scales = {}
    if fp8:  # stacked [L=2, C] scales, row 1 this layer's
        ks, vs = (scale_for_amax(jnp.abs(x).max((0, 1, 3)) if fp8 == "head" else jnp.abs(x).max()) for x in (k, v))
        k, v = quantize(k, ks), quantize(v, vs)
        scales = dict(k_scale=jnp.stack([ks * 0.5, ks]).reshape(2, -1),
                      v_scale=jnp.stack([vs * 0.5, vs]).reshape(2, -1), layer=1)
    q = jnp.asarray(rng.standard_normal((len(lens), heads, head_dim)), jnp.bfloat16)
    order = jnp.asarray(np.argsort(-np.asarray(lens), kind="stable"), jnp.int32)
    out = paged_decode_attention(q, k, v, tables, seq_lens, order=order, interpret=True, **scales, **opts)
    ref = paged_decode_attention_reference(q, k, v, tables, seq_lens, **scales)
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=1e-2, rtol=1e-2)
    assert not np.asarray(out, np.float32)[np.asarray(lens) == 0].any(), "padding rows must be zeros"


def test_interpret_without_the_interpreter_is_a_clear_error(monkeypatch):
    from pallas_kernels.mosaic import _common
    monkeypatch.setattr(_common, "_interpreter", lambda: None)        # where check_runnable looks
    z = jnp.zeros
    with pytest.raises(ValueError, match="interpret=True needs Mosaic GPU's interpreter"):
        paged_decode_attention(z((2, 4, 64), jnp.bfloat16), z((6, 16, 2, 64), jnp.bfloat16),
                               z((6, 16, 2, 64), jnp.bfloat16), z((2, 3), jnp.int32), z((2,), jnp.int32),
                               interpret=True)


@pytest.mark.parametrize("bad,match", [
    (dict(q=jnp.zeros((2, 4, 64), jnp.float32), k_cache=jnp.zeros((6, 16, 2, 64), jnp.float32),
          v_cache=jnp.zeros((6, 16, 2, 64), jnp.float32)), "bfloat16 or float16"),
    (dict(k_cache=jnp.zeros((6, 16, 2, 64), jnp.float8_e4m3fn), v_cache=jnp.zeros((6, 16, 2, 64), jnp.float8_e4m3fn)),
     "needs k_scale and v_scale"),
    (dict(k_scale=jnp.float32(1), v_scale=jnp.float32(1)), "for float8_e4m3fn caches"),
    (dict(q=jnp.zeros((2, 4, 32), jnp.bfloat16), k_cache=jnp.zeros((6, 16, 2, 32), jnp.bfloat16),
          v_cache=jnp.zeros((6, 16, 2, 32), jnp.bfloat16)), "head_dim"),
    (dict(k_cache=jnp.zeros((6, 4, 2, 64), jnp.bfloat16), v_cache=jnp.zeros((6, 4, 2, 64), jnp.bfloat16)),
     "block_size must be >= 8"),
    (dict(block_n=32), "block_n"),
    (dict(num_stages=0), "num_stages"),
    (dict(num_splits=0), "num_splits"),
    (dict(order=jnp.zeros((3,), jnp.int32)), "order"),
    (dict(q=jnp.zeros((2, 8, 256), jnp.bfloat16), k_cache=jnp.zeros((6, 16, 2, 256), jnp.bfloat16),
          v_cache=jnp.zeros((6, 16, 2, 256), jnp.bfloat16), block_n=256, num_stages=2), "shared memory"),
    (dict(seq_lens=jnp.zeros((3,), jnp.int32)), "seq_lens"),
])
@needs_mosaic
def test_validation(lowering_only, bad, match):
    args = dict(q=jnp.zeros((2, 4, 64), jnp.bfloat16), k_cache=jnp.zeros((6, 16, 2, 64), jnp.bfloat16),
                v_cache=jnp.zeros((6, 16, 2, 64), jnp.bfloat16), block_tables=jnp.zeros((2, 3), jnp.int32),
                seq_lens=jnp.zeros((2,), jnp.int32))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(**args)


@needs_mosaic
@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CPU's error: this machine has a GPU")
def test_cpu_call_is_a_clear_error():
    z = jnp.zeros
    with pytest.raises(ValueError, match="attn_backend='mosaic' needs a CUDA GPU.*'xla' or 'pallas'"):
        paged_decode_attention(z((2, 4, 64), jnp.bfloat16), z((6, 16, 2, 64), jnp.bfloat16),
                               z((6, 16, 2, 64), jnp.bfloat16), z((2, 3), jnp.int32), z((2,), jnp.int32))


def test_the_engine_backend_checks_the_gpu_before_loading(monkeypatch):
    """attn_backend="mosaic" at LLM(): a GPU other than Hopper, or a head_dim its tiles do not take, is a ValueError
    naming it before any weight loads (not a compile error in warm-up)."""
    from types import SimpleNamespace

    from pallas_kernels.mosaic import check_hopper
    monkeypatch.setattr(_common, "available", lambda: True)
    for cc, kind in (("8.0", "NVIDIA A100-SXM4-80GB"), ("10.0", "NVIDIA B200"), (None, "cpu")):
        with pytest.raises(ValueError, match=f"needs a Hopper GPU .*{kind}"):
            check_hopper(SimpleNamespace(device_kind=kind, compute_capability=cc), 128)
    hopper = SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0")
    with pytest.raises(ValueError, match="head_dim 64 or 128, got 256"):
        check_hopper(hopper, 256)
    check_hopper(hopper, 64)
    monkeypatch.setattr(_common, "available", lambda: False)
    with pytest.raises(ValueError, match="no Pallas Mosaic GPU"):
        check_hopper(hopper, 128)


def test_smem_estimate_matches_the_limit_mosaic_reports():
    """Qwen3's shape fits with room for 2 programs per SM at one split; the 256-wide case above does not fit."""
    assert 2 * paged_decode.smem_bytes(128, 64, 2, 1) < 228 * 1024
    assert 2 * paged_decode.smem_bytes(128, 64, 2, 1, fp8=True) < 228 * 1024
    assert paged_decode.smem_bytes(256, 128, 2, 1) > paged_decode.MAX_SMEM


def test_reference_is_the_triton_files_reference():
    rng = np.random.default_rng(0)
    k, v, tables, lens = make_paged(rng, [5, 17, 0], 8, 2, 64, jnp.float32)
    q = jnp.asarray(rng.standard_normal((3, 4, 64)), jnp.float32)
    from pallas_kernels.paged_attention import paged_attention_reference
    out = paged_decode_attention_reference(q, k, v, tables, lens, scale=0.2)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(paged_attention_reference(q, k, v, tables, lens,
                                                                                        scale=0.2)))
    assert np.asarray(out)[:2].any() and not np.asarray(out)[2].any()


@pytest.mark.gpu
@pytest.mark.parametrize("batch,max_len,heads,kv_heads,block_size,opts", [
    (64, 2048, 16, 8, 16, {}),  # Qwen3-0.6B heads, one split
    (3, 4096, 16, 8, 16, {}),  # few rows, long context: auto split-K
    (17, 300, 16, 8, 32, dict(num_splits=3, num_stages=3)),  # ragged splits, 2 pages a tile
    (9, 700, 8, 1, 16, dict(block_n=128)),  # MQA, group 8
    (6, 520, 6, 2, 128, dict(num_splits=2)),  # odd group, pages bigger than a tile
    (5, 200, 4, 4, 8, {}),  # no GQA, 8-token pages
])
def test_gpu_matches_reference(batch, max_len, heads, kv_heads, block_size, opts):
    """Random paged caches with permuted block tables, ragged lengths, lengths 1 and at block boundaries,
    padding rows (0), rows run longest first."""
    rng = np.random.default_rng(4)
    lens = rng.integers(1, max_len + 1, batch)
    lens[0], lens[-1] = 1, max_len
    if batch > 4:
        lens[1], lens[2], lens[3] = 0, 2 * block_size, block_size + 1
    k, v, tables, seq_lens = make_paged(rng, lens, block_size, kv_heads, 128, jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((batch, heads, 128)), jnp.bfloat16)
    ref = np.asarray(paged_decode_attention_reference(q, k, v, tables, seq_lens), np.float32)
    out = jax.jit(lambda *a: paged_decode_attention(*a, **opts))(q, k, v, tables, seq_lens)
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=2e-2, rtol=2e-2)
    assert not np.asarray(out, np.float32)[lens == 0].any(), "padding rows must be zeros"
    order = jnp.asarray(np.argsort(-lens, kind="stable"), jnp.int32)
    ordered = jax.jit(lambda *a: paged_decode_attention(*a[:5], order=a[5], **opts))(q, k, v, tables, seq_lens,
                                                                                      order)
    np.testing.assert_array_equal(np.asarray(ordered, np.float32), np.asarray(out, np.float32))


# ---- attn_backend="mosaic" in the engine: GPU only, decode through this kernel, prefill through Mosaic's prefill ----

@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CPU's error: this machine has a GPU")
def test_mosaic_backend_on_cpu_is_a_clear_error(tiny_dir):
    from helpers import TINY_ENGINE
    from jaxinfer import LLM
    with pytest.raises(ValueError, match=r"attn_backend='mosaic' needs a CUDA GPU.*'xla' or 'pallas'"):
        LLM(tiny_dir, attn_backend="mosaic", **TINY_ENGINE)


def test_mosaic_backend_dispatch_and_fp8_refusal(tiny_dir, monkeypatch):
    from jaxinfer.config import EngineConfig, ModelConfig
    from jaxinfer.model.attention import attention_fns
    from pallas_kernels.flash_attention import flash_attention
    from pallas_kernels.mosaic import ptxas
    from pallas_kernels.mosaic.flash_prefill import flash_prefill
    monkeypatch.setattr(ptxas, "older_ptxas_on_path", lambda: None)
    prefill_fn, decode_fn = attention_fns("mosaic", interpret=False)
    assert decode_fn is paged_decode_attention and prefill_fn is flash_prefill
    # an older ptxas first on PATH (triton's CUDA 12.8 one) miscompiles the Mosaic prefill: the Pallas one, said
    monkeypatch.setattr(ptxas, "older_ptxas_on_path", lambda: "/x/ptxas (CUDA 12.8, jaxlib is built for CUDA 13)")
    with pytest.warns(UserWarning, match=r"ptxas on PATH is /x/ptxas \(CUDA 12.8.*Pallas flash kernel"):
        prefill_fn, decode_fn = attention_fns("mosaic", interpret=False)
    assert decode_fn is paged_decode_attention and prefill_fn.func is flash_attention
    model = ModelConfig.from_pretrained(tiny_dir)
    assert EngineConfig(attn_backend="mosaic").resolve("gpu", model).attn_backend == "mosaic"
    with pytest.raises(ValueError, match=r"attn_backend='mosaic' does not read an fp8 KV cache"):
        EngineConfig(attn_backend="mosaic", kv_cache_dtype="fp8").resolve("gpu", model)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,max_len,per_head,opts", [(64, 2048, True, {}), (3, 4096, False, {}),
                                                        (17, 300, True, dict(num_splits=3, num_stages=3))])
def test_gpu_fp8_matches_reference(batch, max_len, per_head, opts):
    """fp8 pages (scales per kv head or one per layer, stacked [L, C] with a layer row) against the reference on
    the same pages."""
    from pallas_kernels.quant import quantize, scale_for_amax
    rng = np.random.default_rng(16)
    lens = rng.integers(1, max_len + 1, batch)
    lens[0], lens[-1] = 1, max_len
    k, v, tables, seq_lens = make_paged(rng, lens, 16, 8, 128, jnp.float32)
    ks, vs = (scale_for_amax(jnp.abs(x).max((0, 1, 3)) if per_head else jnp.abs(x).max()) * 1.5 for x in (k, v))
    kq, vq = quantize(k, ks), quantize(v, vs)
    stack = lambda s: jnp.stack([s * 0.5, s]).reshape(2, -1)  # [L=2, C]: row 1 is this layer's
    fp8 = dict(k_scale=stack(ks), v_scale=stack(vs), layer=1)
    q = jnp.asarray(rng.standard_normal((batch, 16, 128)), jnp.bfloat16)
    out = jax.jit(lambda *a: paged_decode_attention(*a, **fp8, **opts))(q, kq, vq, tables, seq_lens)
    ref = paged_decode_attention_reference(q, kq, vq, tables, seq_lens, **fp8)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_mosaic_backend_generates_like_pallas(tmp_path):
    """LLM(attn_backend="mosaic") in bf16 on a tiny model with head_dim 128 (the kernel's minimum is 64) gives the
    pallas backend's greedy tokens, counted up to each output's first difference (bf16 near-ties may split)."""
    from helpers import TINY_ENGINE, make_tiny_model
    from jaxinfer import LLM, SamplingParams
    path = make_tiny_model(str(tmp_path / "d128"), num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                           hidden_size=128)
    prompts = [[1 + i, 7, 30 + i, 2, 9] * (1 + i) for i in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    opts = {**TINY_ENGINE, "dtype": "bfloat16", "block_size": 16, "num_kvcache_blocks": 64}
    outs = {b: [o.token_ids for o in LLM(path, attn_backend=b, **opts).generate(prompts, sp, use_tqdm=False)]
            for b in ("pallas", "mosaic")}
    agree = [next((i for i, (a, c) in enumerate(zip(x, y)) if a != c), len(x)) for x, y in zip(*outs.values())]
    print(f"\nmosaic vs pallas: {sum(agree)}/{24 * len(prompts)} tokens agree, first differences at {agree}")
    assert all(len(o) == 24 for o in outs["mosaic"])
    assert sum(a >= 2 for a in agree) >= len(prompts) - 1 and sum(agree) >= 0.4 * 24 * len(prompts)


@needs_mosaic
def test_mosaic_backend_layer_lowers_for_cuda(monkeypatch):
    """The engine's attention layer with attn_backend="mosaic" (K/V write, then the Mosaic prefill or decode, with
    the engine's argument names) lowers for CUDA: the glue between the engine and both kernels, without a GPU."""
    from jaxinfer.model.attention import paged_attention_layer
    from pallas_kernels.mosaic import flash_prefill as fp
    from pallas_kernels.mosaic import ptxas
    monkeypatch.setattr(ptxas, "older_ptxas_on_path", lambda: None)
    monkeypatch.setattr(paged_decode, "_on_gpu", lambda: True)
    monkeypatch.setattr(fp, "_on_gpu", lambda: True)
    T, B, W, H, K, D, bs = 64, 4, 4, 16, 8, 128, 16
    caches = (jnp.zeros((32, bs, K, D), jnp.bfloat16),) * 2
    for kind, rows in (("prefill", T), ("decode", B)):
        meta = dict(slot_mapping=jnp.arange(rows, dtype=jnp.int32), block_tables=jnp.zeros((B, W), jnp.int32),
                    seq_lens=jnp.full((B,), 16, jnp.int32), cu_seqlens=jnp.array([0, 16, 32, 48, 64], jnp.int32))
        layer = paged_attention_layer(kind, "mosaic", meta)
        q, k, v = (jnp.zeros((rows, n, D), jnp.bfloat16) for n in (H, K, K))
        text = lowered_text(lambda q, k, v, c: layer(0, q, k, v, c), (q, k, v, caches))
        assert "mosaic_gpu" in text and "triton" not in text, kind


def test_older_ptxas_on_path(tmp_path):
    """Which ptxas Mosaic GPU would run: one older than jaxlib's CUDA is named (it miscompiles the Mosaic
    prefill); the same release or newer, an unreadable version, or none on PATH is not."""
    from pallas_kernels.mosaic.ptxas import older_ptxas_on_path, ptxas_release
    def tool(folder, release):
        (tmp_path / folder).mkdir()
        path = tmp_path / folder / "ptxas"
        path.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
        path.chmod(0o755)
        return str(tmp_path / folder)
    old, new = tool("old", "12.8"), tool("new", "13.0")
    assert ptxas_release(os.path.join(old, "ptxas")) == (12, 8)
    assert older_ptxas_on_path({"PATH": f"{old}:{new}"}, cuda_major=13) == \
        f"{old}/ptxas (CUDA 12.8, jaxlib is built for CUDA 13)"
    assert older_ptxas_on_path({"PATH": f"{new}:{old}"}, cuda_major=13) is None    # the first one counts
    assert older_ptxas_on_path({"PATH": old}, cuda_major=12) is None
    assert older_ptxas_on_path({"PATH": str(tmp_path / "none")}, cuda_major=13) is None
    assert older_ptxas_on_path({"PATH": old}, cuda_major=None) is None             # no CUDA jaxlib: no opinion
    assert ptxas_release(str(tmp_path / "missing")) is None
