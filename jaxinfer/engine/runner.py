"""Owns the weights and the paged KV cache; compiles one step per bucket at start-up and runs them.

Every bucket (kind, T tokens, B rows, W block-table width) is compiled ahead of time, so serving never
compiles; `compilations` counts every XLA compilation in the process (a JAX monitoring listener), so a
stray one after warm-up shows up in `LLM.stats()`.
"""
from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.model.qwen3 import unstack_layers
from jaxinfer.step import batch_layout, jit_step, make_step

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# Compiled steps, shared by every runner in the process with the same shapes (params are arguments,
# so an executable serves any weights of the same shapes: a second LLM of the same size starts at once).
_EXECUTABLES: dict[tuple, object] = {}
_compile_count = 0
_lock = threading.Lock()


def _on_event(event: str, *args, **kwargs) -> None:
    global _compile_count
    if event == _COMPILE_EVENT:
        with _lock:
            _compile_count += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def compilation_count() -> int:
    """XLA compilations in this process so far."""
    return _compile_count


def kv_bytes_per_block(model: ModelConfig, block_size: int, dtype) -> int:
    return 2 * model.num_hidden_layers * block_size * model.num_key_value_heads * model.head_dim * \
        jnp.dtype(dtype).itemsize


_HEADROOM = 2 * 2**30   # activations / logits of the largest bucket


def _cuda_memory() -> tuple[int, int] | None:
    """(bytes JAX may allocate, bytes in use) of GPU 0 from the CUDA driver, or None. For allocators that keep
    no stats (with XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_TEMP, XLA's VMM allocator returns
    none). JAX may allocate XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.75) of the total: the VMM allocator
    enforces it (a pool sized from the whole GPU failed with 'Not enough PA budget' on the H200)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(dev), 0) or \
                cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev):
            return None
        try:     # the primary context is the one XLA uses
            if cuda.cuCtxPushCurrent_v2(ctx):
                return None
            ok = cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0
            cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        finally:
            cuda.cuDevicePrimaryCtxRelease_v2(dev)
        fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
        return (int(total.value * fraction), total.value - free.value) if ok else None
    except (OSError, AttributeError):
        return None


def device_memory() -> tuple[int, int] | None:
    """(bytes the device may use, bytes in use) on a GPU; None on the CPU or when the GPU cannot tell."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))
    return _cuda_memory() if jax.devices()[0].platform == "gpu" else None


def free_memory_bytes() -> int | None:
    """Memory the KV pool may take: free device memory (GPU; None if unknown), or available host memory (CPU)."""
    mem = device_memory()
    if mem is not None:
        return mem[0] - mem[1]
    if jax.devices()[0].platform == "gpu":
        return None
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def num_blocks_for_memory(model: ModelConfig, engine: EngineConfig, dtype) -> int:
    """Size the KV pool from free device memory (GPU), or to fit max_num_seqs full sequences (CPU)."""
    per_block = kv_bytes_per_block(model, engine.kvcache_block_size, dtype)
    mem = device_memory()
    if mem is not None:
        free = mem[0] * engine.gpu_memory_utilization - mem[1]
        blocks = int((free - _HEADROOM) // per_block)
        if blocks < engine.max_blocks_per_seq:
            raise ValueError(f"after the weights, gpu_memory_utilization={engine.gpu_memory_utilization} leaves room "
                             f"for {max(blocks, 0)} KV blocks, fewer than one max_model_len={engine.max_model_len} "
                             f"sequence needs ({engine.max_blocks_per_seq}); lower max_model_len or raise "
                             f"gpu_memory_utilization")
        return blocks
    if jax.devices()[0].platform == "gpu":
        raise ValueError("cannot tell how much GPU memory is free (the allocator keeps no stats and the CUDA driver "
                         "did not answer): give num_kvcache_blocks explicitly")
    want = engine.max_num_seqs * engine.max_blocks_per_seq
    return max(1, min(want, int(2 * 2**30 // per_block)))


def check_pool_fits(model: ModelConfig, engine: EngineConfig, num_blocks: int) -> None:
    """A KV pool larger than free memory fails here, with the numbers, not deep inside XLA."""
    need = num_blocks * kv_bytes_per_block(model, engine.kvcache_block_size, engine.dtype)
    free = free_memory_bytes()
    if free is not None and need > free:        # None: a GPU that cannot tell; XLA will fail if it is too big
        raise ValueError(f"num_kvcache_blocks={num_blocks} needs {need / 2**30:.1f} GiB of KV cache but only "
                         f"{free / 2**30:.1f} GiB is free; lower num_kvcache_blocks (or leave it None to size "
                         f"the pool from free memory)")


class ModelRunner:
    def __init__(self, model: ModelConfig, engine: EngineConfig, params, num_blocks: int):
        self.model, self.engine = model, engine
        self.dtype = jnp.dtype(engine.dtype)
        self.interpret = jax.devices()[0].platform != "gpu"
        # Per-layer weight arrays avoid XLA copying each layer out of the [L, ...] stack every step (3x
        # faster layers on CPU); on GPU stacked stays the default until benchmarked (few arguments).
        unstack = engine.unstack_weights if engine.unstack_weights is not None else self.interpret
        self.params = unstack_layers(params) if unstack else params
        self.num_blocks = num_blocks
        self.num_slots = num_blocks * engine.kvcache_block_size
        shape = (num_blocks, engine.kvcache_block_size, model.num_key_value_heads, model.head_dim)
        self.kv_caches = [(jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype))
                          for _ in range(model.num_hidden_layers)]
        W = engine.max_blocks_per_seq
        # xla gathers W pages per row: offer narrower tables so short contexts gather less
        self.widths = tuple(sorted({max(1, W // 16), max(1, W // 4), W})) if engine.attn_backend == "xla" else (W,)
        self.compiled: dict[tuple[str, int, int, int, bool], object] = {}
        self.max_rows = max(engine.max_num_seqs, *engine.decode_buckets)   # a bucket may exceed max_num_seqs
        self.last_ids = jnp.zeros((self.max_rows,), jnp.int32)     # previous step's sampled ids

    def buckets(self) -> list[tuple[str, int, int, int, bool]]:
        """(kind, T, B, W, filtered) of every step to compile; `filtered` is the sampling variant with
        top-k / top-p / min-p (a static choice: see sampling.py)."""
        e = self.engine
        out = [("prefill", T, min(e.max_num_seqs, T), W) for T in e.prefill_buckets for W in self.widths]
        out += [("decode", B, B, W) for B in e.decode_buckets for W in self.widths]
        return [k + (f,) for f in (False, True) for k in out]

    def compile(self, key: tuple[str, int, int, int, bool]):
        if key not in self.compiled:
            kind, T, B, W, filtered = key
            shared = (self.model, self.engine.attn_backend, str(self.dtype), self.num_blocks,
                      self.engine.kvcache_block_size, self.interpret, self.max_rows,
                      isinstance(self.params["layers"], tuple), key)
            if shared not in _EXECUTABLES:
                step = make_step(self.model, kind, T, B, W, self.engine.attn_backend, self.interpret, self.max_rows,
                                 filtered)
                packed = jax.ShapeDtypeStruct((batch_layout(T, B, W)["_size"][0],), jnp.int32)
                _EXECUTABLES[shared] = jit_step(step).lower(self.params, self.kv_caches, packed,
                                                            self.last_ids).compile()
            self.compiled[key] = _EXECUTABLES[shared]
        return self.compiled[key]

    def warmup(self, progress=None, threads: int = min(8, os.cpu_count() or 1)) -> None:
        """Compile every bucket (in parallel threads: XLA compiles outside the GIL)."""
        keys = [k for k in self.buckets() if k not in self.compiled]
        with ThreadPoolExecutor(max(1, threads)) as pool:
            for _ in pool.map(self.compile, keys):
                if progress is not None:
                    progress.update(1)

    def put(self, packed: np.ndarray) -> jax.Array:
        """Send a step's packed batch to the device (one host -> device copy)."""
        return jax.device_put(packed)

    def run(self, key: tuple[str, int, int, int, bool], packed: jax.Array) -> jax.Array:
        """Dispatch one step (asynchronous); returns the device array of sampled ids [max_rows]. `packed`: the
        step's batch, already sent with `put`."""
        self.last_ids, self.kv_caches = self.compile(key)(self.params, self.kv_caches, packed, self.last_ids)
        return self.last_ids
