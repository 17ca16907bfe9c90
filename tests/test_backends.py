"""Every attention backend against the same kernel contract (decode and prefill over the paged cache), and the
errors of the GPU-only ones (cudnn, triton) on a CPU.

On a CPU: xla and pallas (interpret mode) run the contract cases; cudnn's own tiling and masks run with
jax.nn.dot_product_attention's XLA implementation in place of cuDNN (cudnn_attention.IMPLEMENTATION); the
cuDNN pool path and Triton need the GPU (`pytest -m gpu tests/test_backends.py` on the GPU machine).
"""
import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from helpers import TINY_ENGINE, make_paged

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.model.attention import attention_fns
from pallas_kernels import cudnn_attention
from pallas_kernels.flash_attention import flash_attention_reference
from pallas_kernels.paged_attention import paged_attention_reference

TOL = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=3e-2, rtol=3e-2)}
# (lens, block_size, heads, kv_heads, head_dim): ragged lengths incl. 1, block multiples, a padding row (0)
DECODE_CASES = [([1, 8, 13, 0], 8, 4, 2, 16), ([16, 47, 1, 33], 16, 8, 2, 32), ([130, 5, 64], 16, 4, 1, 32)]
# (new tokens per row, cached prefix per row, block_size): chunks after prefixes, one-token rows, padding
PREFILL_CASES = [([5, 30, 1], [0, 20, 95], 16), ([9, 3, 17], [4, 0, 11], 8)]
# the Mosaic GPU kernels tile head_dim in 128-byte swizzled rows (64 or 128) and pages of >= 8 tokens
MOSAIC_DECODE_CASES = [([1, 8, 13, 0], 8, 4, 2, 64), ([16, 47, 1, 33], 16, 8, 2, 128), ([130, 5, 64], 16, 4, 1, 64)]


def decode_case(case, dtype, seed=0):
    lens, bs, H, K, D = case
    rng = np.random.default_rng(seed)
    k, v, tables, seq_lens = make_paged(rng, lens, bs, K, D, dtype)
    q = jnp.asarray(rng.standard_normal((len(lens), H, D)), dtype)
    return q, k, v, tables, seq_lens


def prefill_case(case, dtype, H=4, K=2, D=32, pad=5, seed=0):
    n_new, prefix, bs = case
    rng = np.random.default_rng(seed)
    ctx = [n + p for n, p in zip(n_new, prefix)]
    k, v, tables, seq_lens = make_paged(rng, ctx, bs, K, D, dtype)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(n_new)]), jnp.int32)
    q = jnp.asarray(rng.standard_normal((sum(n_new) + pad, H, D)), dtype)    # pad rows past cu[-1]: zeros out
    return q, k, v, tables, cu, seq_lens


def check_decode(decode_fn, dtype, cases=DECODE_CASES):
    for case in cases:
        q, k, v, tables, lens = decode_case(case, dtype)
        out = jax.jit(decode_fn)(q, k, v, tables, lens)     # one compiled program: eager ops are slow here
        ref = jax.jit(paged_attention_reference)(q, k, v, tables, lens)
        assert out.shape == q.shape and out.dtype == q.dtype
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **TOL[dtype])
        assert not np.asarray(out[np.asarray(lens) == 0], np.float32).any(), "padding rows must be zeros"


def check_prefill(prefill_fn, dtype, cases=PREFILL_CASES, D=32):
    for case in cases:
        q, k, v, tables, cu, lens = prefill_case(case, dtype, D=D)
        out = jax.jit(prefill_fn)(q, k, v, tables, cu, lens)
        ref = jax.jit(flash_attention_reference)(q, k, v, tables, cu, lens)
        assert out.shape == q.shape and out.dtype == q.dtype
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **TOL[dtype])
        assert not np.asarray(out[int(cu[-1]):], np.float32).any(), "padding tokens must be zeros"


# ---- CPU: the contract for the backends that run here, cudnn's tiling through XLA, the errors ----

@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_cpu_backends_meet_the_contract(backend):
    prefill_fn, decode_fn = attention_fns(backend, interpret=True)
    check_decode(decode_fn, jnp.float32, DECODE_CASES[:1] if backend == "pallas" else DECODE_CASES)
    check_prefill(prefill_fn, jnp.float32, PREFILL_CASES[:1] if backend == "pallas" else PREFILL_CASES)


def test_mosaic_decode_meets_the_contract_in_its_interpreter():
    """The mosaic backend's paged decode through Mosaic GPU's interpreter (bf16: wgmma's inputs); its prefill
    takes ~40 s a case there, so the contract runs it on the GPU (test_gpu_backend_meets_the_contract)."""
    from pallas_kernels.mosaic import paged_decode
    if not paged_decode.available() or paged_decode._interpreter() is None:
        pytest.skip("this JAX has no Mosaic GPU interpreter")
    fn = functools.partial(paged_decode.paged_decode_attention, interpret=True)
    check_decode(fn, jnp.bfloat16, MOSAIC_DECODE_CASES[:1] + MOSAIC_DECODE_CASES[2:])


def test_cudnn_tiling_and_masks_through_xla(monkeypatch):
    """cudnn_attention's query tiles, causal-offset masks, key lengths and sequential groups, with XLA's
    dot_product_attention standing in for cuDNN (same arguments), in bf16 as cuDNN takes."""
    monkeypatch.setattr(cudnn_attention, "IMPLEMENTATION", "xla")
    check_decode(functools.partial(cudnn_attention.cudnn_paged_decode, mode="gather"), jnp.bfloat16)
    check_prefill(cudnn_attention.cudnn_prefill, jnp.bfloat16)
    check_prefill(functools.partial(cudnn_attention.cudnn_prefill, block_q=16, gather_budget_bytes=1),
                  jnp.bfloat16)      # several tiles per row, one tile per group


def test_cudnn_backend_in_the_engine_through_xla(tiny_dir, monkeypatch):
    """The engine with attn_backend="cudnn" (prefill tiles, decode, padding rows, caching) gives the xla
    backend's greedy tokens, with XLA's dot_product_attention standing in for cuDNN in fp32."""
    import jaxinfer.config
    monkeypatch.setattr(jaxinfer.config, "GPU_ONLY_BACKENDS", {})
    monkeypatch.setattr(cudnn_attention, "IMPLEMENTATION", "xla")
    monkeypatch.setattr(cudnn_attention, "DEFAULT_DECODE_MODE", "gather")
    monkeypatch.setattr(cudnn_attention, "check_cudnn", lambda *a, **k: None)     # fp32 allowed through XLA
    prompts = [[1 + i, 7, 30 + i, 2, 9] * (1 + i) for i in range(5)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    opts = {**TINY_ENGINE, "block_size": 16, "num_kvcache_blocks": 64}
    outs = [[o.token_ids for o in LLM(tiny_dir, attn_backend=b, **opts).generate(prompts, sp, use_tqdm=False)]
            for b in ("xla", "cudnn")]
    assert outs[0] == outs[1] and all(len(t) == 8 for t in outs[1])


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CPU's error: this machine has a GPU")
@pytest.mark.parametrize("backend", ["cudnn", "triton", "mosaic"])
def test_gpu_only_backend_on_cpu_is_a_clear_error(tiny_dir, backend):
    with pytest.raises(ValueError, match=rf"attn_backend='{backend}' needs a CUDA GPU.*'xla' or 'pallas'"):
        LLM(tiny_dir, attn_backend=backend, **TINY_ENGINE)
    q, k, v, tables, lens = decode_case(DECODE_CASES[0], jnp.bfloat16)
    decode_fn = attention_fns(backend, interpret=True)[1]
    with pytest.raises(ValueError, match=rf"attn_backend='{backend}' needs a CUDA GPU"):
        decode_fn(q, k, v, tables, lens)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CPU's error: this machine has a GPU")
def test_gpu_only_backend_refused_before_the_model_is_resolved(monkeypatch):
    """A hub id is downloaded (weights included) when the model is resolved: the refusal comes first."""
    import jaxinfer.hub

    def no_download(*a, **k):
        raise AssertionError("resolved (maybe downloaded) the model before refusing the backend")
    monkeypatch.setattr(jaxinfer.hub, "resolve_model", no_download)
    with pytest.raises(ValueError, match="attn_backend='cudnn' needs a CUDA GPU"):
        LLM("Qwen/Qwen3-32B", attn_backend="cudnn")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CPU's error: this machine has a GPU")
def test_triton_prefill_on_cpu_is_a_clear_error():
    from pallas_kernels.triton_prefill import triton_prefill
    q, k, v, tables, cu, lens = prefill_case(PREFILL_CASES[0], jnp.bfloat16)
    with pytest.raises(ValueError, match="attn_backend='triton' needs a CUDA GPU"):
        triton_prefill(q, k, v, tables, cu, lens)


@pytest.mark.parametrize("backend", ["cudnn", "triton", "mosaic"])
def test_gpu_only_backend_refuses_fp8_cache(tiny_dir, backend):
    model = ModelConfig.from_pretrained(tiny_dir)
    with pytest.raises(ValueError, match=rf"attn_backend='{backend}' does not read an fp8 KV cache"):
        EngineConfig(attn_backend=backend, kv_cache_dtype="fp8").resolve("gpu", model)
    assert EngineConfig(attn_backend=backend).resolve("gpu", model).attn_backend == backend


def test_cudnn_refuses_what_cudnn_cannot_take(monkeypatch):
    monkeypatch.setattr(cudnn_attention, "IMPLEMENTATION", "xla")     # past the GPU check, to the others
    q, k, v, tables, lens = decode_case(DECODE_CASES[0], jnp.float32)
    with pytest.raises(ValueError, match="cuDNN attention takes bfloat16 or float16, got float32"):
        cudnn_attention.cudnn_paged_decode(q, k, v, tables, lens)
    with pytest.raises(ValueError, match="does not read an fp8 KV cache"):
        cudnn_attention.cudnn_paged_decode(q.astype(jnp.bfloat16), k.astype(jnp.float8_e4m3fn),
                                           v.astype(jnp.float8_e4m3fn), tables, lens)


def test_triton_missing_packages_is_a_clear_error():
    from pallas_kernels._triton_ffi import load_triton
    try:
        import jax_triton  # noqa: F401  (only whether it imports)
        import triton  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match=r"needs the triton and jax-triton packages.*\.\[triton\]"):
            load_triton()
    else:
        assert len(load_triton()) == 3


# ---- GPU: every backend compiled, the same cases; and through LLM() ----

GPU_BACKENDS = {
    "xla": lambda: attention_fns("xla", False),
    "pallas": lambda: attention_fns("pallas", False),
    "cudnn": lambda: attention_fns("cudnn", False),
    "cudnn_gather": lambda: (None, functools.partial(cudnn_attention.cudnn_paged_decode, mode="gather")),
    "triton": lambda: attention_fns("triton", False),
    "triton_jax_triton": lambda: (None, functools.partial(__import__(
        "pallas_kernels.triton_decode", fromlist=["x"]).triton_paged_decode, path="jax_triton")),
    # the raw Triton prefill kernel (the triton backend's prefill is still the Pallas kernel: docs/kernels.md)
    "triton_prefill": lambda: (__import__("pallas_kernels.triton_prefill", fromlist=["x"]).triton_prefill, None),
    "mosaic": lambda: attention_fns("mosaic", False),       # (its own cases: head_dim 64 / 128)
}


def _needs_packages(backend: str) -> None:
    """The triton backend's optional packages (`.[triton]`): skipped where they are not installed."""
    if backend.startswith("triton"):
        pytest.importorskip("jax_triton", reason="attn_backend='triton' needs pip install '.[triton]'")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", list(GPU_BACKENDS))
def test_gpu_backend_meets_the_contract(backend):
    _needs_packages(backend)
    prefill_fn, decode_fn = GPU_BACKENDS[backend]()
    mosaic = backend == "mosaic"
    if mosaic and not __import__("pallas_kernels.mosaic._common", fromlist=["x"]).available():
        pytest.skip("this JAX has no Pallas Mosaic GPU backend")
    if decode_fn is not None:
        check_decode(decode_fn, jnp.bfloat16, MOSAIC_DECODE_CASES if mosaic else DECODE_CASES)
    if prefill_fn is not None:
        check_prefill(prefill_fn, jnp.bfloat16, D=64 if mosaic else 32)


@pytest.mark.gpu
@pytest.mark.parametrize("name,backend", [("gqa2", "cudnn"), ("gqa2", "triton"), ("gqa2", "xla"),
                                          ("gqa4_wide_head", "xla")])
def test_gpu_backend_generates_like_pallas(tiny_dirs, name, backend, monkeypatch):
    """Greedy tokens through LLM() in bf16 agree with the pallas backend's (a bf16 near-tie may split a path:
    agreement is counted up to each output's first difference). xla: decode in 32-token chunks over flat tables,
    so rows span several chunks. gqa4_wide_head: head_dim 24, the pallas pages padded to 32 (unfused decode)."""
    _needs_packages(backend)
    tiny_dir = tiny_dirs[name]
    import jaxinfer.model.xla_decode as xd
    monkeypatch.setattr(xd, "DECODE_CHUNK", 32)
    prompts = [[1 + i, 7, 30 + i, 2, 9] * (1 + i) for i in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    opts = {**TINY_ENGINE, "dtype": "bfloat16", "block_size": 16, "num_kvcache_blocks": 64}   # the engine's page
    outs = {b: [o.token_ids for o in LLM(tiny_dir, attn_backend=b, **opts).generate(prompts, sp, use_tqdm=False)]
            for b in ("pallas", backend)}
    agree = [next((i for i, (a, c) in enumerate(zip(x, y)) if a != c), len(x)) for x, y in zip(*outs.values())]
    print(f"\n{backend} vs pallas: {sum(agree)}/{24 * len(prompts)} tokens agree, first differences at {agree}")
    assert all(len(o) == 24 for o in outs[backend])
    # bf16 on a tiny random model: greedy paths split at near-ties (on the CPU, cudnn's code through XLA split
    # from xla's at token 4 for 3 of 6 prompts in bf16 and matched all tokens in fp32); a broken backend
    # would not even agree on the first tokens
    assert sum(a >= 2 for a in agree) >= len(prompts) - 1 and sum(agree) >= 0.4 * 24 * len(prompts)


def test_triton_without_ptxas_is_a_clear_error(monkeypatch, tmp_path):
    """jaxlib runs `ptxas` to load a jax-triton kernel; without one the step's compile would fail with only
    "Failed to launch ptxas". check_ptxas says so first, naming the folder to put on PATH."""
    from pallas_kernels import _triton_ffi
    monkeypatch.setattr(_triton_ffi, "ptxas_dirs", lambda: [str(tmp_path)])
    with pytest.raises(ValueError, match=r"no ptxas on PATH.*export PATH=.*backends/nvidia/bin"):
        _triton_ffi.check_ptxas()
    tool = tmp_path / "ptxas"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    _triton_ffi.check_ptxas()                        # found: nothing to say
    monkeypatch.setenv("PATH", str(tmp_path))
    assert str(tmp_path) in _triton_ffi.ptxas_dirs()
