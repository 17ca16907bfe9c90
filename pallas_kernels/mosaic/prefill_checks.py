"""Argument checks and SMEM sizing of the Mosaic GPU prefill (flash_prefill.py), apart from the kernel so that
file stays one concept: what flash_prefill accepts (bad input -> ValueError naming the value, before any tracing)
and how much shared memory a program of the kernel needs for a (head_dim, block_kv, num_stages) choice.
"""
from __future__ import annotations

import jax

from pallas_kernels._common import check_cu_seqlens, check_paged_inputs
from pallas_kernels.mosaic._common import DTYPES, MAX_SMEM, check_runnable
from pallas_kernels.quant import is_fp8, kv_scales

ROWS = 64  # wgmma's M: rows of one q head per compute warpgroup
DEFAULT_BLOCK_KV = 128  # key tokens per tile (8 pages of 16); untuned. fp8 pages: 64 (their f16 tiles need SMEM)
DEFAULT_NUM_STAGES = 2  # K/V tiles in flight
NAME = "flash_prefill"  # the entry point named in every error


def smem_bytes(head_dim: int, block_kv: int, num_stages: int, fp8: bool = False, q_buffers: int = 1) -> int:
    """SMEM of a program: q (q_buffers each: the persistent kernel's may be 2) and output tiles of both compute
    warpgroups, the K/V ring, fp8's f16 tiles, scratch."""
    ring = 2 * num_stages * block_kv * head_dim * (1 if fp8 else 2)
    f16_tiles = 2 * 2 * block_kv * head_dim * 2 if fp8 else 0  # k and v, per compute warpgroup
    return 2 * (q_buffers + 1) * ROWS * head_dim * 2 + ring + f16_tiles + 2048 + 256  # 2 KiB scratch, barriers


def check_prefill_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, *, k_scale, v_scale, layer,
                       block_kv: int | None, num_stages: int, interpret: bool, on_gpu: bool):
    """Validates flash_prefill's arguments (q [T, H, D], caches [P, block_size, K, D]); returns (scales, block_kv):
    scales as quant.kv_scales gives them (None for bf16/fp16 caches), block_kv with its default filled in.
    on_gpu: flash_prefill's _on_gpu() (looked up there: the CPU tests replace it)."""
    name = NAME
    check_runnable(name, interpret, on_gpu, "flash_prefill_reference or pallas_kernels.flash_attention",
                   f"needs a CUDA GPU (Mosaic GPU has no CPU mode); JAX's backend here is "
                   f"{jax.default_backend()!r}: use pallas_kernels.flash_attention")
    if q.ndim != 3:
        raise ValueError(f"{name}: q must be [T, H, D], got shape {q.shape}")
    _, heads, head_dim = q.shape
    batch = seq_lens.shape[0] if seq_lens.ndim == 1 else -1
    check_paged_inputs(name, heads, head_dim, q.dtype, k_cache, v_cache, block_tables, seq_lens, batch)
    check_cu_seqlens(name, cu_seqlens_q, batch)
    scales = kv_scales(name, k_cache, k_scale, v_scale, layer)
    if q.dtype not in DTYPES:
        raise ValueError(f"{name}: q must be bfloat16 or float16 (wgmma), got {q.dtype}")
    if head_dim not in (64, 128):
        raise ValueError(f"{name}: head_dim must be 64 or 128 (128-byte swizzled tiles; 256 does not fit in SMEM "
                         f"with two compute warpgroups), got {head_dim}")
    if k_cache.shape[1] < 8:
        raise ValueError(f"{name}: block_size must be >= 8 (whole 8-row SMEM tiles), got {k_cache.shape[1]}")
    block_kv = (64 if is_fp8(k_cache.dtype) else DEFAULT_BLOCK_KV) if block_kv is None else block_kv
    if block_kv not in (64, 128, 256):
        raise ValueError(f"{name}: block_kv must be 64, 128 or 256, got {block_kv}")
    if num_stages < 2:
        raise ValueError(f"{name}: num_stages must be >= 2 (one slot refilled while another is read), got {num_stages}")
    if (need := smem_bytes(head_dim, block_kv, num_stages, is_fp8(k_cache.dtype))) > MAX_SMEM:
        raise ValueError(f"{name}: block_kv={block_kv} x num_stages={num_stages} at head_dim {head_dim} needs "
                         f"{need} bytes of shared memory, more than {MAX_SMEM}: use fewer stages or a smaller block_kv")
    return scales, block_kv
