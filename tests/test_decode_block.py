"""pallas_kernels/decode_block.py: a decode layer's matmuls between two attention calls as one persistent kernel
(interpret mode: one program), against the XLA layer's math, and an engine whose small decode batches run through
it (layers.BLOCK_MAX_ROWS) against transformers."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY_ENGINE, assert_lowers_to_triton, hf_greedy, hf_model

import pallas_kernels.decode_block as block_mod
from jaxinfer.model import layers
from jaxinfer.model.layers import rms_norm, swiglu
from pallas_kernels.decode_block import decode_block, decode_qkv, supported


def _weights(L, E, NQ, NKV, I, dtype, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)

    def w(k, *s):
        return (jax.random.normal(k, s) / s[-2] ** 0.5).astype(dtype)
    return {"input_layernorm": (1 + 0.1 * jax.random.normal(ks[0], (L, E))).astype(dtype),
            "post_attention_layernorm": (1 + 0.1 * jax.random.normal(ks[1], (L, E))).astype(dtype),
            "qkv_proj": w(ks[2], L, E, NQ + 2 * NKV), "o_proj": w(ks[3], L, NQ, E),
            "gate_up_proj": w(ks[4], L, E, 2 * I), "down_proj": w(ks[5], L, I, E)}


def _reference(x, o, W, l, eps, next_qkv=True):
    """model/qwen3.py's layer after attention (XLA's path), then the next layer's qkv."""
    x = x + o @ W["o_proj"][l]
    x = x + swiglu(rms_norm(x, W["post_attention_layernorm"][l], eps) @ W["gate_up_proj"][l]) @ W["down_proj"][l]
    return x, (rms_norm(x, W["input_layernorm"][l + 1], eps) @ W["qkv_proj"][l + 1] if next_qkv else None)


def _close(a, b, dtype):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if dtype == jnp.float32:
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    else:           # the same bf16 rounding points, another summation order: within a bf16 step of the values
        assert np.max(np.abs(a - b)) <= 2 ** -6 * max(1.0, np.max(np.abs(b))), np.max(np.abs(a - b))


@pytest.mark.parametrize("E,NQ,NKV,I,M,dtype", [(64, 64, 32, 96, 1, jnp.bfloat16), (48, 192, 48, 128, 3, jnp.float32),
                                                 (128, 256, 64, 384, 8, jnp.bfloat16),
                                                 (64, 128, 64, 128, 16, jnp.float32)])
def test_block_matches_the_xla_layer(E, NQ, NKV, I, M, dtype):
    W = _weights(3, E, NQ, NKV, I, dtype)
    x = jax.random.normal(jax.random.PRNGKey(1), (M, E)).astype(dtype)
    o = jax.random.normal(jax.random.PRNGKey(2), (M, NQ)).astype(dtype)
    for l in (0, 1):
        got, ref = decode_block(x, o, W, l, eps=1e-6, interpret=True), _reference(x, o, W, l, 1e-6)
        _close(got[0], ref[0], dtype)
        _close(got[1], ref[1], dtype)
    last, none = decode_block(x, o, W, 2, eps=1e-6, next_qkv=False, interpret=True)
    assert none is None
    _close(last, _reference(x, o, W, 2, 1e-6, False)[0], dtype)
    _close(decode_qkv(x, W, 0, eps=1e-6, interpret=True),
           rms_norm(x, W["input_layernorm"][0], 1e-6) @ W["qkv_proj"][0], dtype)


def test_supported_shapes():
    assert supported(1, 1024, 2048, 3072, 4096) and supported(16, 4096, 4096, 12288, 6144)
    assert not supported(17, 1024, 2048, 3072, 4096)                # more rows than the padded tile
    assert not supported(1, 1000, 2048, 3072, 4096)                 # no 16-multiple tile of E


def test_lowers_to_triton():
    """The persistent form (atomics, the spin loop, L1-bypassing loads) lowers for CUDA (no GPU needed)."""
    W = _weights(2, 1024, 2048, 512, 3072, jnp.bfloat16)
    x, o = jnp.zeros((1, 1024), jnp.bfloat16), jnp.zeros((1, 2048), jnp.bfloat16)
    assert_lowers_to_triton(lambda x, o, W: decode_block(x, o, W, 0, eps=1e-6), (x, o, W))


@pytest.mark.parametrize("steps", [1, 4])
def test_engine_decode_through_the_block_equals_transformers(tiny_dirs, monkeypatch, steps):
    """Small decode batches (one step per call, and K per call) with every layer's matmuls in the kernel give HF's
    greedy tokens; the kernel really ran (counted when traced)."""
    from jaxinfer import LLM, SamplingParams
    calls = []
    real = block_mod._call
    monkeypatch.setattr(block_mod, "_call", lambda *a, **k: calls.append(k["phases"]) or real(*a, **k))
    monkeypatch.setattr(layers, "BLOCK_MAX_ROWS", 16)
    path = tiny_dirs["gqa4_wide_head"]
    # an engine setting no other test uses: no step compiled without the kernel is reused from the shared cache
    llm = LLM(path, **{**TINY_ENGINE, "block_size": 8, "num_kvcache_blocks": 124 + steps,
                       "num_scheduler_steps": steps})
    rng = np.random.default_rng(5)
    ps = [rng.integers(0, 512, n).tolist() for n in (3, 17, 9)]
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert ("A",) in calls and block_mod.PHASES in calls and block_mod.PHASES[:3] in calls, calls
    ref = hf_model(path)
    for p, o in zip(ps, outs):
        assert o.token_ids == hf_greedy(ref, p, 12), f"prompt of {len(p)} tokens"
    assert llm.llm_engine.block_manager.num_free_blocks == llm.llm_engine.block_manager.num_blocks


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8, 16])
def test_compiled_block_on_gpu(M):
    """Compiled (Triton, 128 resident programs and their barriers) on the GPU, Qwen3-0.6B's shapes."""
    W = _weights(3, 1024, 2048, 512, 3072, jnp.bfloat16, seed=M)
    x = jax.random.normal(jax.random.PRNGKey(1), (M, 1024)).astype(jnp.bfloat16)
    o = jax.random.normal(jax.random.PRNGKey(2), (M, 2048)).astype(jnp.bfloat16)
    for l in (0, 1):
        got, ref = decode_block(x, o, W, l, eps=1e-6), _reference(x, o, W, l, 1e-6)
        _close(got[0], ref[0], jnp.bfloat16)
        _close(got[1], ref[1], jnp.bfloat16)
