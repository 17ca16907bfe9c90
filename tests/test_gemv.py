"""The small-batch matmul kernel (pallas_kernels/gemv.py, interpret mode on CPU) against jnp, and the model's
decode path through it (layers.GEMV_MAX_ROWS) against transformers."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest
from helpers import TINY_ENGINE, assert_lowers_to_triton, hf_greedy, hf_model

import pallas_kernels.gemv as gemv_mod
from jaxinfer.model import layers
from pallas_kernels.gemv import choose_tiles, gemv, gemv_reference

TOL = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# Qwen3-0.6B's decode matmuls (E, N): qkv, o_proj, gate_up, down, the tied LM head
SHAPES_06B = [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024), (1024, 151936)]


def _inputs(M, E, N, L, dtype, transpose_w, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M, E)), dtype)
    shape = (N, E) if transpose_w else (E, N)
    w = jnp.asarray(rng.standard_normal(((L,) if L else ()) + shape) / np.sqrt(E), dtype)
    return x, w


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("M,E,N,L,tiles", [
    (1, 64, 48, 0, {}),                                   # one row, N of three 16-column blocks
    (3, 128, 64, 3, dict(split_k=4, block_k=16)),         # stacked weights, split E
    (16, 64, 32, 2, dict(block_n=16, block_k=32)),        # a full 16-row tile
    (20, 96, 32, 0, dict(split_k=2, block_k=16)),         # 20 rows (padded to 32), E not a power of two
])
def test_kernel_matches_reference(dtype, M, E, N, L, tiles):
    x, w = _inputs(M, E, N, L, dtype, False)
    layer = L - 1 if L else 0
    out = gemv(x, w, layer, interpret=True, **tiles)
    assert out.shape == (M, N) and out.dtype == dtype
    ref = gemv_reference(x, w, layer)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **TOL[dtype])


@pytest.mark.parametrize("split_k", [1, 2])
def test_transposed_weights_fp32_out(split_k):
    """The tied LM head: x @ embed^T with an fp32 result from bf16 inputs."""
    x, w = _inputs(5, 64, 80, 0, jnp.bfloat16, True, seed=1)
    out = gemv(x, w, transpose_w=True, out_dtype=jnp.float32, interpret=True, split_k=split_k, block_k=16)
    assert out.dtype == jnp.float32
    ref = gemv_reference(x, w, transpose_w=True, out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("stacked_norm,swiglu", [(True, False), (False, True), (True, True)])
def test_fused_norm_and_swiglu(dtype, stacked_norm, swiglu):
    """RMSNorm folded into the dot, and silu(gate) * up on the [gate | up] columns, against jnp."""
    M, E, N, L = 5, 64, 96, 3
    x, w = _inputs(M, E, N, L, dtype, False, seed=5)
    rng = np.random.default_rng(6)
    g = jnp.asarray(1 + 0.1 * rng.standard_normal((L, E) if stacked_norm else (E,)), dtype)
    x = x * 3.0                                             # rms far from 1: the scaling matters
    out = gemv(x, w, 2, norm_weight=g, eps=1e-6, swiglu=swiglu, block_k=16, interpret=True)
    assert out.shape == (M, N // 2 if swiglu else N)
    ref = gemv_reference(x, w, 2, norm_weight=g, eps=1e-6, swiglu=swiglu)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **TOL[dtype])


def test_traced_layer_index():
    """The layer may be a traced value (one kernel serves every layer)."""
    x, w = _inputs(2, 32, 32, 4, jnp.float32, False, seed=2)
    f = jax.jit(lambda x, w, l: gemv(x, w, l, interpret=True))
    for l in (0, 3):
        np.testing.assert_allclose(np.asarray(f(x, w, jnp.int32(l))), np.asarray(gemv_reference(x, w, l)), **TOL[jnp.float32])


@pytest.mark.parametrize("E,N", SHAPES_06B)
def test_tiles_for_qwen3_shapes(E, N):
    """The automatic tiles divide the shapes and give the H200's 132 SMs about one program each or more."""
    t = choose_tiles(8, E, N)
    assert N % t["block_n"] == 0 and E % (t["split_k"] * t["block_k"]) == 0
    assert (N // t["block_n"]) * t["split_k"] >= 128, t


def test_bad_input_names_the_value():
    x, w = _inputs(4, 64, 32, 0, jnp.float32, False)
    with pytest.raises(ValueError, match="block_n=24"):
        gemv(x, w, block_n=24, interpret=True)
    with pytest.raises(ValueError, match="split_k=3"):
        gemv(x, w, split_k=3, interpret=True)
    with pytest.raises(ValueError, match="disagree on E"):
        gemv(x, w.T, interpret=True)
    with pytest.raises(ValueError, match="layer=2"):
        gemv(x, w[None], 2, interpret=True)
    with pytest.raises(ValueError, match="split_k=2"):
        gemv(x, w, norm_weight=jnp.ones((64,)), split_k=2, interpret=True)
    with pytest.raises(ValueError, match="norm_weight"):
        gemv(x, w, norm_weight=jnp.ones((32,)), interpret=True)


def test_lowers_to_triton():
    x = jnp.zeros((8, 1024), jnp.bfloat16)
    o_proj = (jnp.zeros((8, 2048), jnp.bfloat16), jnp.zeros((28, 2048, 1024), jnp.bfloat16))   # split_k 4
    assert_lowers_to_triton(lambda x, w: gemv(x, w, 5), o_proj)
    assert_lowers_to_triton(lambda x, w: gemv(x, w, transpose_w=True, out_dtype=jnp.float32),
                            (x, jnp.zeros((4096, 1024), jnp.bfloat16)))
    g = jnp.ones((28, 1024), jnp.bfloat16)
    assert_lowers_to_triton(lambda x, w: gemv(x, w, 3, norm_weight=g, swiglu=True),          # fused gate_up
                            (x, jnp.zeros((28, 1024, 6144), jnp.bfloat16)))


@pytest.mark.parametrize("fuse", [True, False])
def test_engine_decode_through_gemv_equals_transformers(tiny_dirs, monkeypatch, fuse):
    """Decode steps (one per call, and K per call) with every matmul and the LM head in the kernel (the RMSNorms
    and swiglu folded in, or not) give HF's greedy tokens; the kernel really ran (counted when traced)."""
    from jaxinfer import LLM, SamplingParams
    calls = []
    real = gemv_mod.gemv
    monkeypatch.setattr(gemv_mod, "gemv", lambda *a, **k: calls.append(k) or real(*a, **k))
    monkeypatch.setattr(layers, "GEMV_MAX_ROWS", 16)
    monkeypatch.setattr(layers, "GEMV_FUSE", fuse)
    path = tiny_dirs["gqa1_tied"]
    # an engine setting no other test uses (block_size 8, pool size per case): no step compiled without the
    # kernel, or with the other `fuse`, is reused from the shared executable cache
    llm = LLM(path, **{**TINY_ENGINE, "block_size": 8, "num_kvcache_blocks": 128 if fuse else 120})
    rng = np.random.default_rng(3)
    ps = [rng.integers(0, 512, n).tolist() for n in (4, 19)]
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert any(k.get("transpose_w") for k in calls), "the LM head did not use the gemv kernel"
    assert any(k.get("swiglu") for k in calls) == fuse and any(k.get("norm_weight") is not None for k in calls) == fuse
    ref = hf_model(path)
    for p, o in zip(ps, outs):
        assert o.token_ids == hf_greedy(ref, p, 10), f"prompt of {len(p)} tokens"


@pytest.mark.gpu
@pytest.mark.parametrize("E,N", SHAPES_06B)
@pytest.mark.parametrize("M", [1, 8, 32])
def test_compiled_kernel_on_gpu(E, N, M):
    """Compiled (Triton) on the GPU, Qwen3-0.6B's shapes: stacked layers, and the transposed LM head."""
    lm_head = N > 100_000
    x, w = _inputs(M, E, N, 0 if lm_head else 2, jnp.bfloat16, lm_head, seed=4)
    kw = dict(transpose_w=True, out_dtype=jnp.float32) if lm_head else {}
    out = gemv(x, w, 0 if lm_head else 1, **kw)
    ref = gemv_reference(x, w, 0 if lm_head else 1, **kw)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=3e-2, rtol=2e-2)
