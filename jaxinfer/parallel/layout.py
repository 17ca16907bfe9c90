"""Tensor-parallel layout of the params pytree: which axis of each weight is split over the "tp" mesh axis,
and how fused weights are reordered so that a contiguous split gives each device whole heads.

Our fused matrices concatenate along their output axis: qkv_proj = [q heads | k heads | v heads] and
gate_up_proj = [gate | up]. A plain split of that axis would give device 0 all of q and device 1 k and v.
So for tp > 1 the columns are regrouped per device, [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] and
[gate_0 up_0 | gate_1 up_1 | ...]; the model reads them back through a [..., tp, per-device] reshape
(qwen3.py), which with tp = 1 is the original layout, so one code path serves every size.

  weight              split axis      after the split (per device)
  embed_tokens [V, E] vocab           [V/tp, E]   (V padded to a multiple of tp; padding rows are zeros)
  lm_head [E, V]      vocab           [E, V/tp]
  qkv_proj [E, X]     output (heads)  [E, (H + 2K')/tp * D]
  gate_up_proj        output          [E, 2I/tp]
  o_proj [HD, E]      input           [HD/tp, E]  -> partial sums, one all-reduce (XLA inserts it)
  down_proj [I, E]    input           [I/tp, E]   -> one all-reduce
  norms               replicated

K' is the number of kv heads the devices hold together: K when tp divides K, else tp (each kv head is
replicated tp/K times, as vLLM does), so every device has the kv head its q heads use.
Everything here works on numpy (the loader, on the host) and on jax.numpy (random presets, inside jit).
"""
from __future__ import annotations

from jax.sharding import PartitionSpec as P


def check_tp(model, tp: int) -> None:
    """ValueError naming the numbers when `model` cannot be split over `tp` devices."""
    H, K, I = model.num_attention_heads, model.num_key_value_heads, model.intermediate_size
    if H % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide num_attention_heads={H}")
    if K % tp and tp % K:
        raise ValueError(f"tensor_parallel_size={tp} and num_key_value_heads={K}: one must divide the other "
                         f"(kv heads are split when tp divides them, replicated when they divide tp)")
    if I % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide intermediate_size={I}")


def kv_heads(model, tp: int) -> int:
    """K': kv heads over all devices (replicated up to tp when tp > K)."""
    return max(model.num_key_value_heads, tp)


def padded_vocab(vocab_size: int, tp: int) -> int:
    return -(-vocab_size // tp) * tp


def _regroup(parts, tp: int, xp):
    """parts: arrays [..., n_i] split along the last axis -> [..., tp * sum(n_i / tp)] with each device's
    slices of every part adjacent: [p0_0 p1_0 .. | p0_1 p1_1 .. | ...]."""
    lead = parts[0].shape[:-1]
    chunks = [p.reshape(*lead, tp, p.shape[-1] // tp) for p in parts]
    return xp.concatenate(chunks, axis=-1).reshape(*lead, -1)


def to_tp(name: str, w, model, tp: int, xp):
    """One weight (stacked [L, ...] or one layer's) from the checkpoint layout to the tp layout."""
    if tp == 1:
        return w
    V, Vp = model.vocab_size, padded_vocab(model.vocab_size, tp)
    if name == "embed_tokens" and Vp > V:
        return xp.pad(w, [(0, Vp - V), (0, 0)])
    if name == "lm_head" and Vp > V:
        return xp.pad(w, [(0, 0), (0, Vp - V)])
    if name == "qkv_proj":
        H, K, D = model.num_attention_heads, model.num_key_value_heads, model.head_dim
        q, k, v = w[..., :H * D], w[..., H * D:(H + K) * D], w[..., (H + K) * D:]
        if tp > K:   # replicate each kv head tp/K times: device i gets kv head i // (tp/K)
            rep = lambda x: xp.repeat(x.reshape(*x.shape[:-1], K, D), tp // K, axis=-2).reshape(*x.shape[:-1], -1)
            k, v = rep(k), rep(v)
        return _regroup([q, k, v], tp, xp)
    if name == "gate_up_proj":
        I = model.intermediate_size
        return _regroup([w[..., :I], w[..., I:]], tp, xp)
    return w


# weight name -> axis split over "tp", counted from the end (None: replicated)
_SPLIT_AXIS = {"embed_tokens": -2, "lm_head": -1, "qkv_proj": -1, "gate_up_proj": -1, "o_proj": -2,
               "down_proj": -2}


def spec(name: str, ndim: int) -> P:
    axis = _SPLIT_AXIS.get(name)
    if axis is None:
        return P()
    parts = [None] * ndim
    parts[ndim + axis] = "tp"
    return P(*parts)


def map_params(fn, params: dict):
    """fn(name, array) over the params pytree (layers stacked as a dict, or a tuple of per-layer dicts)."""
    out = {k: fn(k, v) for k, v in params.items() if k != "layers"}
    layers = params["layers"]
    if isinstance(layers, (tuple, list)):
        out["layers"] = tuple({k: fn(k, v) for k, v in d.items()} for d in layers)
    else:
        out["layers"] = {k: fn(k, v) for k, v in layers.items()}
    return out


def param_specs(params: dict) -> dict:
    """PartitionSpec of every weight (a pytree like params)."""
    return map_params(lambda name, w: spec(name, len(w.shape)), params)


# KV cache per layer: k and v [num_blocks, block_size, K', D], split by kv head
KV_SPEC = P(None, None, "tp", None)
