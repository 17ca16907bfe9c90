"""The pallas backend's prefill choice (jaxinfer/model/pallas_prefill.py): Mosaic GPU's prefill on a Hopper GPU for
bf16 / fp16 pages of head_dim 64 or 128, flash_attention otherwise. On the CPU: the choice, and what each choice
lowers to for CUDA. The gpu-marked test runs both through LLM() on the device:
    PYTHONPATH=. python -m pytest -q -m gpu tests/test_pallas_prefill.py
"""
import functools

import jax
import jax.numpy as jnp
import pytest

from jaxinfer.model import attention, pallas_prefill as pp
from pallas_kernels.flash_attention import flash_attention
from pallas_kernels.mosaic import flash_prefill as fp

sd = jax.ShapeDtypeStruct


def args(head_dim=128, block_size=16, dtype=jnp.bfloat16, cache_dtype=None):
    cache = sd((64, block_size, 2, head_dim), cache_dtype or dtype)
    return (sd((256, 4, head_dim), dtype), cache, cache, sd((2, 16), jnp.int32), sd((3,), jnp.int32),
            sd((2,), jnp.int32))


def test_off_a_hopper_gpu_the_prefill_is_flash_attention():
    assert not pp.mosaic_runs_here()                   # (the CPU)
    for interpret in (True, False):
        fn = attention.attention_fns("pallas", interpret)[0]
        assert isinstance(fn, functools.partial) and fn.func is flash_attention and fn.keywords == {
            "interpret": interpret}


@pytest.mark.parametrize("case,mosaic", [
    (dict(), True), (dict(head_dim=64, dtype=jnp.float16), True), (dict(block_size=8), True),
    (dict(cache_dtype=jnp.float8_e4m3fn), False),     # fp8 pages (the pallas backend's bytes and V pairs)
    (dict(head_dim=256), False), (dict(head_dim=96), False), (dict(block_size=4), False),
    (dict(dtype=jnp.float32), False),
])
def test_which_kernel_takes_the_prefill(case, mosaic):
    assert pp.mosaic_takes(*args(**case)[:3]) is mosaic


@pytest.mark.skipif(not fp.available(), reason="this JAX has no Pallas Mosaic GPU backend")
@pytest.mark.parametrize("case,kernel", [(dict(), "mosaic_gpu"), (dict(head_dim=96), "triton"),
                                         (dict(block_size=4), "triton")])
def test_on_hopper_each_case_lowers_to_its_kernel(monkeypatch, case, kernel):
    """With a Hopper GPU (patched in), the pallas backend's prefill lowers for CUDA to Mosaic GPU's kernel where it
    takes the case, else to the Pallas/Triton flash kernel; tensor-parallel steps and MOSAIC_PREFILL = False
    keep the flash kernel."""
    monkeypatch.setattr(pp, "mosaic_runs_here", lambda: True)
    monkeypatch.setattr(fp, "_on_gpu", lambda: True)
    a = args(**case)

    def lowered():
        fn = attention.attention_fns("pallas", False)[0]
        return jax.jit(fn).trace(*a).lower(lowering_platforms=("cuda",)).as_text()
    text = lowered()
    assert kernel in text and ("triton" if kernel == "mosaic_gpu" else "mosaic_gpu") not in text
    assert attention.attention_fns("pallas", False, sharded=True)[0].func is flash_attention   # (tensor parallel)
    monkeypatch.setattr(pp, "MOSAIC_PREFILL", False)
    assert "mosaic_gpu" not in lowered()


@pytest.mark.gpu
def test_gpu_llm_prefills_with_mosaic_like_flash(tmp_path, monkeypatch):
    """On a Hopper GPU: LLM(attn_backend="pallas") prefills through the Mosaic kernel (head_dim 64, bf16) and gives
    flash_attention's greedy tokens (bf16 near-ties aside: counted up to each output's first difference)."""
    if not pp.mosaic_runs_here():
        pytest.skip("not a Hopper GPU with Mosaic GPU (or an older ptxas first on PATH)")
    from jaxinfer import LLM, SamplingParams
    from scripts.make_tiny_model import make_tiny_model
    path = make_tiny_model(str(tmp_path / "m"), num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                           hidden_size=128, intermediate_size=256)
    prompts = [[1 + i, 7, 30 + i, 2, 9] * (20 + 30 * i) for i in range(4)]     # 100-550 tokens: several q tiles
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    opts = dict(dtype="bfloat16", max_num_seqs=8, num_kvcache_blocks=256, block_size=16)
    called = []
    real = fp.flash_prefill
    monkeypatch.setattr(fp, "flash_prefill", lambda *a, **k: called.append(1) or real(*a, **k))
    outs, calls = [], []
    for on, max_model_len in ((True, 1024), (False, 2048)):      # (other shapes: programs of their own)
        monkeypatch.setattr(pp, "MOSAIC_PREFILL", on)
        llm = LLM(path, **opts, max_model_len=max_model_len)
        outs.append([o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)])
        calls.append(len(called))
    assert calls[0] > 0 and calls[1] == calls[0]
    agree = [next((i for i, (a, c) in enumerate(zip(x, y)) if a != c), len(x)) for x, y in zip(*outs)]
    assert sum(a >= 2 for a in agree) >= len(prompts) - 1 and sum(agree) >= 0.5 * 16 * len(prompts), agree
