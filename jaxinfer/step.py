"""The pure, jitted prefill / decode step: `step(params, kv_caches, packed, prev_ids, rows_buf)` -> (token ids,
kv_caches, rows_buf) (the rows buffer: the sampled rows' hidden states, for the resample program).

All per-step inputs travel as ONE int32 array (one host->device copy); `batch_layout` says where each
field lives, and `unpack` slices it apart inside the step. Float sampling parameters ride along as their
int32 bit patterns. Sampling happens in the step, so logits never leave the device.

Shapes are static per bucket: T tokens, B rows (sequences), W block-table width.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.model.attention import paged_attention_layer
from jaxinfer.model.layers import decode_matmul
from jaxinfer.model.qwen3 import compute_logits, forward, tp_size
from jaxinfer.parallel.sample import sample_sharded
from jaxinfer.sampling import sample
from jaxinfer.sampling_params import TOP_K_CANDIDATES

_INT_FIELDS = ("token_ids", "positions", "slot_mapping", "prev_row")           # [T]
_ROW_FIELDS = ("seq_lens", "attn_order", "sample_idx", "top_k", "seeds", "counters", "table_start",
               "temperature", "top_p", "min_p")                                 # [B]
FLOAT_FIELDS = ("temperature", "top_p", "min_p")
# the extras variant's fields, after the base layout: per row, then per prompt-logprob token [Tp]
_EXTRA_ROW_FIELDS = ("pen_slot", "num_prompt", "repetition", "frequency", "presence")   # [B]
_EXTRA_TOKEN_FIELDS = ("plp_idx", "plp_target")                                          # [Tp]
_ALL_FLOATS = FLOAT_FIELDS + ("repetition", "frequency", "presence", "bias_vals")
# ids a row may ban (min_tokens: its stop_token_ids and EOS ids), the batch's widest row picks; BAN_PAD pads (dropped)
BAN_WIDTHS = (32, 1056)         # 16 stop ids or 1,024 (sampling_params.MAX_STOP_IDS_WITH_MIN_TOKENS), + 32 EOS ids
BAN_PAD = 2**30
BIAS_WIDTHS = (16, 128, 1024)   # logit_bias / allowed_token_ids entries a row holds (the smallest that fits)


class Extras(NamedTuple):
    """What a step computes beyond sampling (a static variant, compiled only when a batch needs it, so
    batches without penalties or logprobs run the plain step and pay nothing).
    penalties: presence / frequency / repetition penalties from the per-slot token counts (a device state
    updated in the step). logprobs: the sampled tokens' logprobs and ranks. top_n: top logprobs per token
    (a width of LOGPROB_WIDTHS). prompt_rows: prefill only: prompt tokens whose logprobs are computed.
    bans: per row up to this many token ids that cannot be sampled (min_tokens: EOS and stop ids until then); 0: none.
    bias: per row up to this many (token id, bias) entries added to its logits (logit_bias), and whether they are
    the only ids it may sample (allowed_token_ids); 0: none. bad_words: per row up to this many (token id,
    condition) bans (bad_words.py: an id is banned when its condition is -1 or the row's input token); 0: none.
    choice: per row up to this many (token id, condition) entries, the only ids a constrained row may sample
    (structured.py); 0: none. grammar: per row a bitmask of this many int32 words, the ids a json / regex row may
    sample (grammar.py; ceil(V / 32)); 0: none."""
    penalties: bool = False
    logprobs: bool = False
    top_n: int = 0
    prompt_rows: int = 0
    bans: int = 0
    bias: int = 0
    bad_words: int = 0
    choice: int = 0
    grammar: int = 0


ALIGN = 64   # int32s: every field starts at a multiple of 256 bytes of the packed array (Mosaic GPU kernels
#              refuse operands that are not 256-byte aligned, and XLA passes a field to a kernel as a slice of it)


def aligned(off: int) -> int:
    return -(-off // ALIGN) * ALIGN


def _place(layout: dict, off: int, fields) -> int:
    for name, n in fields:
        off = aligned(off)
        layout[name] = (off, n)
        off += n
    return off


def batch_layout(T: int, B: int, W: int) -> dict[str, tuple[int, int]]:
    """field -> (offset, length) in the packed int32 array; block_tables is [B, W] row-major, and row b's pages
    start at table_start[b] of it flattened: b * W, or (flat tables of the xla decode, engine/batch.py) the rows'
    tables one after another."""
    layout = {}
    off = _place(layout, 0, [*((f, T) for f in _INT_FIELDS), ("cu_seqlens", B + 1),
                             *((f, B) for f in _ROW_FIELDS), ("block_tables", B * W)])
    layout["_size"] = (off, 0)
    return layout


def extras_layout(T: int, B: int, W: int, extras: Extras) -> dict[str, tuple[int, int]]:
    """batch_layout plus the extras fields at its end (the plain step's layout is unchanged)."""
    layout = dict(batch_layout(T, B, W))
    e, bad, choice = extras, extras.bad_words, extras.choice
    off = _place(layout, layout.pop("_size")[0], [*((f, B) for f in _EXTRA_ROW_FIELDS),
                                                 *((f, e.prompt_rows) for f in _EXTRA_TOKEN_FIELDS),
                                                 *([("ban_ids", B * e.bans)] if e.bans else []),
                                                 *([("bias_ids", B * e.bias), ("bias_vals", B * e.bias),
                                                    ("bias_only", B)] if e.bias else []),
                                                 *([("bad_ids", B * bad), ("bad_cond", B * bad)] if bad else []),
                                                 *([("choice_ids", B * choice), ("choice_cond", B * choice),
                                                    ("choice_on", B)] if choice else []),
                                                 *([("grammar_mask", B * e.grammar), ("grammar_on", B)]
                                                   if e.grammar else [])])
    layout["_size"] = (off, 0)
    return layout


def unpack(packed: jax.Array, T: int, B: int, W: int, extras: Extras | None = None) -> dict[str, jax.Array]:
    out = {}
    layout = batch_layout(T, B, W) if extras is None else extras_layout(T, B, W, extras)
    for name, (off, n) in layout.items():
        if name == "_size":
            continue
        x = packed[off:off + n]
        if name in _ALL_FLOATS:
            x = jax.lax.bitcast_convert_type(x, jnp.float32)
        out[name] = x.reshape(B, W) if name == "block_tables" else x
    return out


def kv_scales(params: dict):
    """(k_scale, v_scale) [L, 1] of an fp8 KV cache (model/kv_scales.py), carried in params; None without."""
    return (params["k_scale"], params["v_scale"]) if "k_scale" in params else None


def make_step(config: ModelConfig, kind: str, T: int, B: int, W: int, backend: str,
              interpret: bool = False, max_rows: int | None = None, filtered: bool = False, mesh=None,
              extras: Extras | None = None, rows_out: bool = False):
    """The step function for one bucket (not yet jitted). kind: 'prefill' | 'decode'.

    `prev_ids` [max_rows] are the previous step's sampled ids, still on the device: a token whose
    `prev_row` >= 0 is taken from there (async scheduling: the host never waited for it). The result is
    padded to [max_rows] so it can feed any next step. `filtered`: the variant whose sampling applies
    top-k / top-p / min-p (see sampling.py). `mesh`: a Mesh with axis "tp" when params and caches are split
    over several devices (parallel/); the step is still one program, partitioned by XLA.
    `extras`: the variant with penalties / logprobs (`make_extras_step`). rows_out: the step takes one more
    argument, a [max_rows, E] buffer (donated), and returns it with the sampled rows' final hidden states in its
    first B rows, so that `make_resample` can draw them again with top-k / top-p / min-p (the engine's way to
    filtered sampling: one model program per bucket, not two). The buffer is updated in place: with a fresh
    [B, E] output every step dp=2 ran 8-11% below the build without rows on 2xH200 (docs/design.md)."""
    max_rows = max_rows or B
    mm = decode_matmul(B, interpret, tp_size(mesh)) if kind == "decode" else None    # small batches: gemv kernel
    if extras is not None:
        from jaxinfer.extras_step import make_extras_step
        return make_extras_step(config, kind, T, B, W, backend, interpret, max_rows, filtered, mesh, extras)

    def step(params, kv_caches, packed, prev_ids, rows_buf=None):
        b = unpack(packed, T, B, W)
        _, rows, kv_caches = forward_rows(config, kind, backend, interpret, mesh, params, kv_caches, b, prev_ids, mm)
        logits = compute_logits(config, params, rows, mm)                          # [B, V'] fp32
        args = (logits, b["temperature"], b["top_k"], b["top_p"], b["min_p"], b["seeds"], b["counters"], filtered)
        if tp_size(mesh) > 1:
            ids = sample_sharded(*args, mesh, config.vocab_size)
        else:
            ids = sample(*args)
        if rows_out:
            return jnp.pad(ids, (0, max_rows - B)), kv_caches, rows_buf.at[:B].set(rows.astype(rows_buf.dtype))
        return jnp.pad(ids, (0, max_rows - B)), kv_caches

    return step


RESAMPLE_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seeds", "counters")


def resample_fields(packed: np.ndarray, T: int, B: int, W: int) -> np.ndarray:
    """The sampling fields of a packed batch (bucket T, B, W) as `make_resample` takes them: [6 * B] int32."""
    layout = batch_layout(T, B, W)
    return np.concatenate([packed[layout[f][0]:layout[f][0] + B] for f in RESAMPLE_FIELDS])


def draws_from_candidates(fields: np.ndarray, B: int) -> bool:
    """Whether every row of a batch's sampling fields (`resample_fields`) is greedy or has 1 <= top_k <=
    TOP_K_CANDIDATES, so that sampling.sample's "top_k_only" draw serves all of them (padding rows are greedy)."""
    f = {name: fields[i * B:(i + 1) * B] for i, name in enumerate(RESAMPLE_FIELDS)}
    top_k = f["top_k"]
    return bool(np.all((f["temperature"].view(np.float32) <= 0) | ((top_k > 0) & (top_k <= TOP_K_CANDIDATES))))


def make_resample(config: ModelConfig, B: int, max_rows: int, mesh=None, filtered: bool | str = True):
    """`resample(params, rows, fields, ids) -> ids [max_rows]`: filtered sampling (top-k / top-p / min-p,
    sampling.py) of a step's sampled rows (the first B of `rows` [max_rows, E]: `make_step(..., rows_out=True)`),
    with the sampling fields [6 * B] of its batch (`resample_fields`) and the step's own ids [max_rows] (the
    "top_k" variant keeps them for the rows that do not filter). A small program per row count: the model's step
    is compiled once per bucket and the few batches that filter pay one more LM-head matmul and the sort. Same
    draws as sampling inside the step (same logits, same noise per (seed, counter, token id)). `filtered`: True
    (sort the vocabulary) or "top_k" (every filtering row has a small top_k: sampling.sample)."""
    def resample(params, rows, fields, step_ids):
        f = {name: fields[i * B:(i + 1) * B] for i, name in enumerate(RESAMPLE_FIELDS)}
        for name in FLOAT_FIELDS:
            f[name] = jax.lax.bitcast_convert_type(f[name], jnp.float32)
        logits = compute_logits(config, params, rows[:B])
        args = (logits, f["temperature"], f["top_k"], f["top_p"], f["min_p"], f["seeds"], f["counters"], filtered)
        plain = step_ids[:B] if filtered == "top_k" else None
        ids = sample_sharded(*args, mesh, config.vocab_size, plain) if tp_size(mesh) > 1 else \
            sample(*args, plain=plain)
        return jnp.pad(ids, (0, max_rows - B))
    return resample


def forward_rows(config, kind, backend, interpret, mesh, params, kv_caches, b, prev_ids, mm):
    """(token ids [T], the hidden states of the sampled rows [B, E], kv_caches) of one step. `mm`: the decode
    matmul chosen when the step was built (layers.decode_matmul; None: XLA's dot), not while it is traced."""
    prev = b["prev_row"]
    token_ids = jnp.where(prev >= 0, prev_ids[jnp.maximum(prev, 0)], b["token_ids"])
    attn = step_attention(config, kind, backend, b, interpret, mesh, params, kv_caches)
    hidden, kv_caches = forward(config, params, token_ids, b["positions"], attn, kv_caches, mesh, mm)
    b["hidden"] = hidden                                                           # [T, E]
    return token_ids, hidden[b["sample_idx"]], kv_caches


def step_attention(config, kind, backend, meta, interpret, mesh, params, kv_caches):
    """The step's attention (model/attention.py) for caches given as a (k, v) pair per layer, or as one pair stacked
    over the layers (the runner's layout for `attention.stacked_cache` backends; the model then scans its layers)."""
    L = config.num_hidden_layers
    stacked = L if len(kv_caches) == 1 and L > 1 else 0
    return paged_attention_layer(kind, backend, meta, interpret, mesh, kv_scales(params), stacked,
                                 kv_caches[0][0].shape[1], kv_caches[0][0].shape[-1] != config.head_dim)


def jit_step(step, out_shardings=None, donate=(1,)):
    """out_shardings (ids, kv_caches[, rows]): keeps the donated caches' sharding from step to step. donate: the
    caches, and the rows buffer of a rows_out step (1, 4)."""
    if out_shardings is None:
        return jax.jit(step, donate_argnums=donate)
    return jax.jit(step, donate_argnums=donate, out_shardings=out_shardings)


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
