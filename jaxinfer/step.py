"""The pure, jitted prefill / decode step: `step(params, kv_caches, state) -> (kv_caches, state)`.

All per-step inputs travel as ONE int32 array (one host->device copy), which `stage` copies into the
device-resident `state`; `batch_layout` says where each field lives, and `unpack` slices it apart inside
the step. Float sampling parameters ride along as their
int32 bit patterns. Sampling happens in the step, so logits never leave the device.

Shapes are static per bucket: T tokens, B rows (sequences), W block-table width.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.model.attention import paged_attention_layer
from jaxinfer.model.qwen3 import compute_logits, forward
from jaxinfer.sampling import sample

_INT_FIELDS = ("token_ids", "positions", "slot_mapping", "prev_row")           # [T]
_ROW_FIELDS = ("seq_lens", "sample_idx", "top_k", "seeds", "counters",
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


def make_step(config: ModelConfig, kind: str, T: int, B: int, W: int, backend: str,
              interpret: bool = False, max_rows: int | None = None, filtered: bool = False,
              ids_offset: int | None = None):
    """The step function for one bucket (not yet jitted): `step(params, kv_caches, state) -> (kv_caches, state)`.

    `state` [ids_offset + max_rows] int32 is the step's input and output on the device: the packed batch
    from offset 0 (put there by `stage`) and, at `ids_offset`, the previous step's sampled ids. A token
    whose `prev_row` >= 0 is taken from those (async scheduling: the host never waited for it); the step
    then writes its own sampled ids there (padded to max_rows), where `read_ids` finds them.
    The state and the KV caches are donated and come back in the same memory, so every buffer the step
    touches keeps its address from step to step: XLA then replays its CUDA graph as recorded. A new
    address (a fresh input or output array) makes XLA re-record the graph, which measured 2x slower
    steps on the H200. `filtered`: the variant whose sampling applies top-k / top-p / min-p."""
    max_rows = max_rows or B
    ids_offset = batch_layout(T, B, W)["_size"][0] if ids_offset is None else ids_offset

    def step(params, kv_caches, state):
        b = unpack(state, T, B, W)
        prev_ids = state[ids_offset:ids_offset + max_rows]
        prev = b["prev_row"]
        token_ids = jnp.where(prev >= 0, prev_ids[jnp.maximum(prev, 0)], b["token_ids"])
        attn = paged_attention_layer(kind, backend, b, interpret)
        hidden, kv_caches = forward(config, params, token_ids, b["positions"], attn, kv_caches)
        rows = hidden[b["sample_idx"]]                                             # [B, E]
        logits = compute_logits(config, params, rows)                              # [B, V] fp32
        ids = sample(logits, b["temperature"], b["top_k"], b["top_p"], b["min_p"], b["seeds"], b["counters"],
                     filtered)
        return kv_caches, state.at[ids_offset:ids_offset + max_rows].set(jnp.pad(ids, (0, max_rows - B)))

    return step


def jit_step(step):
    return jax.jit(step, donate_argnums=(1, 2))


def stage(state: jax.Array, packed: jax.Array) -> jax.Array:
    """Copy a freshly transferred packed batch into the front of the (donated) state."""
    return jax.lax.dynamic_update_slice(state, packed, (0,))


def read_ids(state: jax.Array, ids_offset: int, max_rows: int) -> jax.Array:
    """The sampled ids of the last step: a small new array the host can read while the state moves on."""
    return state[ids_offset:ids_offset + max_rows]
