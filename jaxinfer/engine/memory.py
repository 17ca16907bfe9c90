"""How large a KV pool fits: free device memory (the allocator's stats, else NVML), less headroom for the
largest bucket's activations; or, on the CPU, enough for max_num_seqs full sequences (at most 2 GiB)."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.model.kv_scales import kv_cache_dtype


def cache_head_dim(backend: str, head_dim: int) -> int:
    """The head dimension of the KV pages: the model's, or for the pallas backend the next power of two (its kernels
    tile the head dimension). q, k and v are then padded with zeros, which changes no score and no output column;
    the softmax keeps the model's 1/sqrt(head_dim), and decode takes the unfused path (model/attention.py)."""
    if backend == "pallas" and head_dim & (head_dim - 1):
        return 1 << (head_dim - 1).bit_length()
    return head_dim


def size_text(n: float) -> str:
    """Bytes for an error message, in GiB, MiB or KiB."""
    unit = next(u for u in (3, 2, 1, 0) if n >= 2 ** (10 * u) or u == 0)
    return f"{n / 2 ** (10 * unit):.1f} {('bytes', 'KiB', 'MiB', 'GiB')[unit]}"


def padding_note(model: ModelConfig, engine: EngineConfig) -> str:
    D = cache_head_dim(engine.attn_backend, model.head_dim)
    return f" (pages of head_dim {D}: {engine.attn_backend} pads {model.head_dim})" if D != model.head_dim else ""


def kv_bytes_per_block(model: ModelConfig, block_size: int, dtype, backend: str = "") -> int:
    """A block's K and V bytes over all layers (`backend`: its pages' head dimension, cache_head_dim)."""
    return 2 * model.num_hidden_layers * block_size * model.num_key_value_heads * \
        cache_head_dim(backend, model.head_dim) * jnp.dtype(dtype).itemsize


_HEADROOM = 2 * 2**30   # activations / logits of the largest bucket


def headroom_bytes(engine: EngineConfig, model: ModelConfig | None = None) -> int:
    """Memory left beside the KV pool for a step's temporaries: 2 GiB for the largest bucket's activations; with
    `model` (one device's view), also twice its largest weight matrix and the largest decode bucket's float32
    logits, because XLA's GEMM autotuner copies a matmul's operands while the steps compile (Qwen3-8B's LM head,
    1.2 GB, found no room at warm-up on an 80 GB H100 with the 2 GiB alone); for the xla backend also the gathered
    pages it may write (bounded by xla_attention.GATHER_BUDGET per step)."""
    room = _HEADROOM
    if model is not None:
        E, I, V = model.hidden_size, model.intermediate_size, model.vocab_size
        itemsize = 4 if str(engine.dtype) == "float32" else 2
        room += 2 * itemsize * max(V * E, 2 * E * I, E * (model.q_size + 2 * model.kv_size))
        room += 4 * engine.max_num_seqs * V
    if engine.attn_backend == "xla":
        from jaxinfer.model.xla_attention import GATHER_BUDGET
        return room + GATHER_BUDGET
    return room


def _nvml_index(device) -> int | str:
    """NVML's name for a JAX GPU: NVML numbers every GPU of the host, CUDA only the visible ones."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    i = device.local_hardware_id or 0
    return visible[i] if i < len(visible) else i


def _nvml_memory(device) -> tuple[int, int] | None:
    """(bytes JAX may allocate, bytes in use) of a GPU from NVML (nvidia-ml-py), for allocators that keep no
    stats (XLA's VMM allocator under the SKIP_TEMP command-buffer mode). JAX may allocate
    XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.75) of the total: the VMM allocator enforces it (a pool
    sized from the whole H200 failed with 'Not enough PA budget')."""
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            name = _nvml_index(device)
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(name)) if str(name).isdigit() else \
                pynvml.nvmlDeviceGetHandleByUUID(str(name))
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        finally:
            pynvml.nvmlShutdown()
    except Exception:           # no NVML library, no such device: the caller asks for num_kvcache_blocks
        return None
    fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
    return int(info.total * fraction), int(info.total - info.free)


def device_memory(device=None) -> tuple[int, int] | None:
    """(bytes the device may use, bytes in use) on a GPU; None on the CPU or when the GPU cannot tell."""
    device = device or jax.devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))
    return _nvml_memory(device) if device.platform == "gpu" else None


def free_memory_bytes(device=None) -> int | None:
    """Memory the KV pool may take: free device memory (GPU; None if unknown), or available host memory (CPU)."""
    mem = device_memory(device)
    if mem is not None:
        return mem[0] - mem[1]
    if (device or jax.devices()[0]).platform == "gpu":
        return None
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


CPU_POOL_BYTES = 2 * 2**30     # the CPU pool's default cap


def num_blocks_for_memory(model: ModelConfig, engine: EngineConfig, dtype, strict: bool = True, device=None) -> int:
    """Size the KV pool from free device memory (GPU), or from the memory max_num_seqs full sequences take in
    the model's dtype (CPU, at most 2 GiB, or one max_model_len sequence when strict). strict (max_model_len was
    given): refuse a pool that cannot hold one max_model_len sequence (else the caller caps it)."""
    per_block = kv_bytes_per_block(model, engine.block_size, dtype, engine.attn_backend)
    mem = device_memory(device)
    if mem is not None:
        free = mem[0] * engine.gpu_memory_utilization - mem[1]
        from jaxinfer.parallel.agree import min_over_processes     # several hosts: one pool size, the smallest
        free = min_over_processes("KV pool sizing", int(free))
        blocks = int((free - headroom_bytes(engine, model)) // per_block)
        if blocks < (engine.max_blocks_per_seq if strict else 1):
            raise ValueError(f"after the weights, gpu_memory_utilization={engine.gpu_memory_utilization} leaves room "
                             f"for {max(blocks, 0)} KV blocks, fewer than one max_model_len={engine.max_model_len} "
                             f"sequence needs ({engine.max_blocks_per_seq}); lower max_model_len or raise "
                             f"gpu_memory_utilization")
        inexact = inexact_offsets(model, engine, dtype, blocks)
        return inexact[1] if inexact else blocks
    if (device or jax.devices()[0]).platform == "gpu":
        raise ValueError("cannot tell how much GPU memory is free (the allocator keeps no stats and NVML "
                         "(nvidia-ml-py) did not answer): give num_kvcache_blocks explicitly")
    # CPU: the bytes max_num_seqs full sequences take in the model's dtype (at most 2 GiB), so that an fp8 cache
    # holds more blocks in the same memory here too (twice bf16's, four times float32's)
    full = kv_bytes_per_block(model, engine.block_size, engine.dtype, engine.attn_backend)
    seqs = engine.max_num_seqs * engine.max_blocks_per_seq * full
    blocks = max(1, int(min(seqs, CPU_POOL_BYTES) // per_block))
    if strict and blocks < engine.max_blocks_per_seq:      # a max_model_len given: one such sequence fits, past 2 GiB
        blocks, free = engine.max_blocks_per_seq, free_memory_bytes(device)
        if free is not None and blocks * per_block > free:
            need = size_text(blocks * per_block)
            raise ValueError(f"one max_model_len={engine.max_model_len} sequence needs {need} of KV cache"
                             f"{padding_note(model, engine)}, more than the {size_text(free)} of memory available; "
                             f"lower max_model_len (or give num_kvcache_blocks)")
    return blocks


def inexact_offsets(model: ModelConfig, engine: EngineConfig, dtype, num_blocks: int) -> tuple[int, int, int] | None:
    """A one-layer model's fp8 pallas pool whose page array (one device's) has 2^31-2^32 one-byte elements: Pallas'
    Triton lowering would index it with 32-bit offsets that overflow (an illegal address on the H200, measured);
    `model` is one device's view. Returns (its elements, the most blocks under that range, the fewest past it), else
    None. Models of more layers stack their caches past that range or keep them per layer under it
    (attention.cache_layout)."""
    per_block = engine.block_size * model.num_key_value_heads * cache_head_dim(engine.attn_backend, model.head_dim)
    n = num_blocks * per_block
    if engine.attn_backend == "pallas" and jnp.dtype(dtype).itemsize == 1 and model.num_hidden_layers == 1 \
            and 2**31 < n <= 2**32:
        return n, 2**31 // per_block, 2**32 // per_block + 1
    return None


def check_pool_fits(model: ModelConfig, engine: EngineConfig, num_blocks: int, device=None) -> None:
    """A KV pool larger than free memory fails here, with the numbers, not deep inside XLA."""
    kv_dtype = kv_cache_dtype(engine.kv_cache_dtype, engine.dtype)
    inexact = inexact_offsets(model, engine, kv_dtype, num_blocks)
    if inexact:
        raise ValueError(f"num_kvcache_blocks={num_blocks} gives a one-layer fp8 page array of {inexact[0]} elements, "
                         f"which the Pallas kernels cannot index exactly (2^31 to 2^32); use at most {inexact[1]} "
                         f"blocks, or at least {inexact[2]} (docs/kernels.md)")
    need = num_blocks * kv_bytes_per_block(model, engine.block_size, kv_dtype, engine.attn_backend)
    free = free_memory_bytes(device)
    if free is not None and need > free:        # None: a GPU that cannot tell; XLA will fail if it is too big
        raise ValueError(f"num_kvcache_blocks={num_blocks} needs {size_text(need)} of KV cache"
                         f"{padding_note(model, engine)} but only {size_text(free)} is free; lower num_kvcache_blocks "
                         f"(or leave it None to size the pool from free memory)")
