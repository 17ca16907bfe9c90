"""The pallas backend's prefill kernel: Mosaic GPU's persistent flash prefill where it measured faster than the
Pallas/Triton flash kernel, else `flash_attention`.

Where: a Hopper GPU (compute capability 9.x) with Pallas' Mosaic GPU backend and a ptxas that builds the kernel
right (pallas_kernels/mosaic/ptxas.py), bf16 / fp16 pages and q, head_dim 64 or 128, pages of >= 8 tokens. fp8 pages
stay with flash_attention: the pallas backend keeps them as bytes and V pairs (attention.v_pages), which the Mosaic
kernel does not read; so do tensor-parallel steps, where the Mosaic kernel has not run on GPUs yet. On an H100 the
Mosaic kernel ran 1 x 8192 tokens at 516 TFLOP/s against 410, 8 x 1024 at 287 against 258, a mixed batch with cached
prefixes at 413 against 342 (docs/kernels.md).
MOSAIC_PREFILL = False keeps flash_attention everywhere (the other side of an A/B: scripts/bench_with.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.flash_attention import flash_attention

MOSAIC_PREFILL = True


@functools.lru_cache(maxsize=None)
def mosaic_runs_here() -> bool:
    """Whether this process's first device is a Hopper GPU the Mosaic prefill runs well on."""
    device = jax.devices()[0]
    if device.platform != "gpu" or not str(getattr(device, "compute_capability", "")).startswith("9."):
        return False
    from pallas_kernels.mosaic._common import available
    from pallas_kernels.mosaic.ptxas import older_ptxas_on_path
    return available() and older_ptxas_on_path() is None


def mosaic_takes(q, k_cache, v_cache) -> bool:
    """Whether the Mosaic prefill takes these arrays (the rest of its contract is flash_attention's)."""
    dtypes = {q.dtype, k_cache.dtype, v_cache.dtype}
    return (len(dtypes) == 1 and dtypes <= {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)}
            and q.shape[-1] in (64, 128) and k_cache.shape[-1] == v_cache.shape[-1] == q.shape[-1]
            and k_cache.shape[1] >= 8)


def pallas_prefill(interpret: bool, sharded: bool = False):
    """The prefill function of the pallas backend (flash_attention's contract). sharded (tensor parallelism: the
    kernel runs per device in shard_map): flash_attention, the kernel measured there."""
    flash = functools.partial(flash_attention, interpret=interpret)
    if interpret or sharded or not MOSAIC_PREFILL or not mosaic_runs_here():
        return flash

    def prefill(q, k_cache, v_cache, *args, **kwargs):
        if mosaic_takes(q, k_cache, v_cache):
            from pallas_kernels.mosaic.flash_prefill import flash_prefill
            return flash_prefill(q, k_cache, v_cache, *args, **kwargs)
        return flash(q, k_cache, v_cache, *args, **kwargs)
    return prefill
