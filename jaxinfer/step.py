"""The pure, jitted prefill / decode step: `step(params, kv_caches, packed, prev_ids) -> (token_ids, kv_caches)`.

All per-step inputs travel as ONE int32 array (one host->device copy); `batch_layout` says where each
field lives, and `unpack` slices it apart inside the step. Float sampling parameters ride along as their
int32 bit patterns. Sampling happens in the step, so logits never leave the device.

Shapes are static per bucket: T tokens, B rows (sequences), W block-table width.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.model.attention import paged_attention_layer
from jaxinfer.model.layers import decode_matmul
from jaxinfer.model.qwen3 import compute_logits, forward, tp_size
from jaxinfer.sampling import sample, sample_sharded

_INT_FIELDS = ("token_ids", "positions", "slot_mapping", "prev_row")           # [T]
_ROW_FIELDS = ("seq_lens", "attn_order", "sample_idx", "top_k", "seeds", "counters",
               "temperature", "top_p", "min_p")                                 # [B]
FLOAT_FIELDS = ("temperature", "top_p", "min_p")


def batch_layout(T: int, B: int, W: int) -> dict[str, tuple[int, int]]:
    """field -> (offset, length) in the packed int32 array; block_tables is [B, W] row-major."""
    layout, off = {}, 0
    for name, n in [*((f, T) for f in _INT_FIELDS), ("cu_seqlens", B + 1),
                    *((f, B) for f in _ROW_FIELDS), ("block_tables", B * W)]:
        layout[name] = (off, n)
        off += n
    layout["_size"] = (off, 0)
    return layout


def unpack(packed: jax.Array, T: int, B: int, W: int) -> dict[str, jax.Array]:
    out = {}
    for name, (off, n) in batch_layout(T, B, W).items():
        if name == "_size":
            continue
        x = packed[off:off + n]
        if name in FLOAT_FIELDS:
            x = jax.lax.bitcast_convert_type(x, jnp.float32)
        out[name] = x.reshape(B, W) if name == "block_tables" else x
    return out


def kv_scales(params: dict):
    """(k_scale, v_scale) [L, 1] of an fp8 KV cache (model/kv_scales.py), carried in params; None without."""
    return (params["k_scale"], params["v_scale"]) if "k_scale" in params else None


def make_step(config: ModelConfig, kind: str, T: int, B: int, W: int, backend: str,
              interpret: bool = False, max_rows: int | None = None, filtered: bool = False, mesh=None):
    """The step function for one bucket (not yet jitted). kind: 'prefill' | 'decode'.

    `prev_ids` [max_rows] are the previous step's sampled ids, still on the device: a token whose
    `prev_row` >= 0 is taken from there (async scheduling: the host never waited for it). The result is
    padded to [max_rows] so it can feed any next step. `filtered`: the variant whose sampling applies
    top-k / top-p / min-p (see sampling.py). `mesh`: a Mesh with axis "tp" when params and caches are split
    over several devices (parallel/); the step is still one program, partitioned by XLA."""
    max_rows = max_rows or B
    mm = decode_matmul(B, interpret, tp_size(mesh)) if kind == "decode" else None    # small batches: gemv kernel

    def step(params, kv_caches, packed, prev_ids):
        b = unpack(packed, T, B, W)
        prev = b["prev_row"]
        token_ids = jnp.where(prev >= 0, prev_ids[jnp.maximum(prev, 0)], b["token_ids"])
        attn = paged_attention_layer(kind, backend, b, interpret, mesh, kv_scales(params))
        hidden, kv_caches = forward(config, params, token_ids, b["positions"], attn, kv_caches, mesh, mm)
        rows = hidden[b["sample_idx"]]                                             # [B, E]
        logits = compute_logits(config, params, rows, mm)                          # [B, V'] fp32
        args = (logits, b["temperature"], b["top_k"], b["top_p"], b["min_p"], b["seeds"], b["counters"], filtered)
        if tp_size(mesh) > 1:
            ids = sample_sharded(*args, mesh, config.vocab_size)
        else:
            ids = sample(*args)
        return jnp.pad(ids, (0, max_rows - B)), kv_caches

    return step


def jit_step(step, out_shardings=None):
    """out_shardings (ids, kv_caches): keeps the donated caches' sharding from step to step."""
    if out_shardings is None:
        return jax.jit(step, donate_argnums=(1,))
    return jax.jit(step, donate_argnums=(1,), out_shardings=out_shardings)


def idle_batch(size: int, T: int, B: int, W: int, num_slots: int) -> np.ndarray:
    """A packed batch of `size` int32 (>= the layout's: a K-step batch's extra fields stay 0) in which every
    token and row is padding: it writes no KV and samples nothing that matters. Warm-up runs each compiled
    step once on it (a step's first execution loads its kernels and builds its CUDA graphs)."""
    buf = np.zeros(size, np.int32)
    f = {name: buf[off:off + n] for name, (off, n) in batch_layout(T, B, W).items() if name != "_size"}
    f["slot_mapping"][:] = num_slots
    f["prev_row"][:] = -1
    f["attn_order"][:] = np.arange(B)
    f["top_p"].view(np.float32)[:] = 1.0
    return buf
