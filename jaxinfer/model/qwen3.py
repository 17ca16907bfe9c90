"""The Qwen3 decoder in Flax, parameters stacked per layer.

Parameter names follow HF transformers' Qwen3 (embed_tokens, layers.*, norm, lm_head), with two fusions
that vLLM also makes: q/k/v projections are one `qkv_proj` matrix and gate/up are one `gate_up_proj`, so a
layer runs 4 matmuls instead of 7. Per-layer weights are stacked into `[L, ...]` arrays: a jitted step then
takes ~12 arrays instead of ~300 (dispatch cost), and a Python loop over layers inside jit indexes them.

The forward is pure: `hidden, kv_caches = model.apply({"params": p}, token_ids, positions, attn, kv_caches)`.
`attn(layer, q, k, v, cache) -> (out, cache)` decides how attention sees the context: dense causal for the
reference path (`dense_attention`), paged over the KV cache for the engine (model/attention.py). An `attn`
that is a `LayerAttention` with a fused `from_qkv(layer, qkv, q_norm, k_norm, row, cos, sin, eps, cache)`
path gets the raw qkv projection instead and applies the q/k RMSNorm and RoPE itself (the Pallas decode kernel does, in its prologue); it gets
the stacked [L, D] norm weights and the row to use, so no per-layer slice has to be copied out for it.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec as P

from jaxinfer.config import ModelConfig
from jaxinfer.model.attention import LayerAttention
from jaxinfer.model.layers import apply_rope, rms_norm, swiglu
from jaxinfer.model.rope import rope_cos_sin
from jaxinfer.parallel import kv_heads, shard_map

INIT_STD = 0.02   # HF's initializer_range; keeps random-weight logits O(1), finite in bf16


def layer_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of one layer's weights (the stacked arrays are [L, *shape])."""
    E, D, I = c.hidden_size, c.head_dim, c.intermediate_size
    return {
        "input_layernorm": (E,),
        "qkv_proj": (E, c.q_size + 2 * c.kv_size),   # x @ W: [E] -> [q | k | v]
        "q_norm": (D,),
        "k_norm": (D,),
        "o_proj": (c.q_size, E),
        "post_attention_layernorm": (E,),
        "gate_up_proj": (E, 2 * I),                   # x @ W: [E] -> [gate | up]
        "down_proj": (I, E),
    }


class Qwen3DecoderLayers(nn.Module):
    """All L decoder layers' weights, stacked [L, ...]."""
    config: ModelConfig
    dtype: Any = jnp.bfloat16

    def setup(self):
        L = self.config.num_hidden_layers
        init = {True: nn.initializers.ones, False: nn.initializers.normal(INIT_STD)}
        self.weights = {name: self.param(name, init[len(shape) == 1], (L, *shape), self.dtype)
                        for name, shape in layer_shapes(self.config).items()}



class Qwen3ForCausalLM(nn.Module):
    config: ModelConfig
    dtype: Any = jnp.bfloat16

    def setup(self):
        c = self.config
        self.embed_tokens = self.param("embed_tokens", nn.initializers.normal(INIT_STD),
                                       (c.vocab_size, c.hidden_size), self.dtype)
        self.layers = Qwen3DecoderLayers(c, self.dtype)
        self.norm = self.param("norm", nn.initializers.ones, (c.hidden_size,), self.dtype)
        if not c.tie_word_embeddings:
            self.lm_head = self.param("lm_head", nn.initializers.normal(INIT_STD),
                                      (c.hidden_size, c.vocab_size), self.dtype)

    def __call__(self, token_ids: jax.Array, positions: jax.Array, attn: Callable, kv_caches=None):
        """token_ids, positions [...] -> final hidden states [..., E] (normed) and the updated caches."""
        return forward(self.config, self._params(), token_ids, positions, attn, kv_caches)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., E] -> fp32 logits [..., V] (tied: the embedding matrix transposed)."""
        return compute_logits(self.config, self._params(), hidden)

    def _params(self) -> dict:
        p = {"embed_tokens": self.embed_tokens, "layers": self.layers.weights, "norm": self.norm}
        return p if self.config.tie_word_embeddings else {**p, "lm_head": self.lm_head}

    def declare(self):
        """Touch every parameter (used by `init_params`)."""
        return self._params()


# -- the forward as pure functions of the params pytree (what the jitted engine step calls) ---------------

def tp_size(mesh) -> int:
    return 1 if mesh is None else mesh.shape["tp"]


def forward(c: ModelConfig, params: dict, token_ids, positions, attn: Callable, kv_caches=None, mesh=None,
            matmul: Callable | None = None):
    """Pure forward; `params["layers"]` holds stacked [L, ...] arrays (one weight layout: per-layer arrays
    were measured 1.2% slower on the H200 and compiled 50% longer, and no faster on CPU tests). The layers are
    unrolled (a Python loop), or one `lax.scan` when `attn` reads caches stacked over the layers (_scan_layers).
    `mesh` (axis "tp"): params are in the tensor-parallel layout of parallel/layout.py (None: one device)."""
    layers, tp = params["layers"], tp_size(mesh)
    x = embed(params["embed_tokens"], token_ids, mesh)                         # [..., E]
    cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, c.rope_scaling_factor, c.rope_yarn)
    stacked = kv_caches is not None and getattr(attn, "stacked_layers", 0)
    if stacked and attn.scan and matmul is None:       # (a gemv `matmul` takes static rows: layers unrolled)
        x, caches = _scan_layers(c, layers, x, cos, sin, attn, kv_caches, tp)
        return rms_norm(x, params["norm"], c.rms_norm_eps), caches
    caches = list(kv_caches) if kv_caches is not None else [None] * c.num_hidden_layers
    for l in range(c.num_hidden_layers):
        w, qk_norms = {k: v[l] for k, v in layers.items()}, (layers["q_norm"], layers["k_norm"], l)
        mm = None if matmul is None else functools.partial(_project, matmul, layers, l, c.rms_norm_eps)
        i = 0 if stacked else l                                        # stacked: one pair, threaded through
        x, caches[i] = _decoder_layer(c, w, x, cos, sin, attn, l, caches[i], qk_norms, tp, mm)
    return rms_norm(x, params["norm"], c.rms_norm_eps), caches


def _scan_layers(c: ModelConfig, layers: dict, x, cos, sin, attn, kv_caches, tp: int):
    """The layers as one `lax.scan` over the stacked weights, for caches stacked over the layers (one [L * P, ...]
    pair: attention.stacked_cache; the xla steps and the pallas prefill steps). XLA compiles one layer body instead
    of L copies: the xla backend's steps, 20-30 fusions a layer, compiled in 12-28 s each unrolled on the H200 host.
    The scan's trip count is static, so the loop reads no predicate back to the host."""
    if len(kv_caches) != 1:
        raise ValueError(f"stacked caches are one (k, v) pair for all layers, got {len(kv_caches)} pairs")
    qk = (layers["q_norm"], layers["k_norm"])

    def body(carry, xs):
        x, cache = carry
        w, l = xs
        x, cache = _decoder_layer(c, w, x, cos, sin, attn, l, cache, (*qk, l), tp)
        return (x, cache), None

    (x, cache), _ = jax.lax.scan(body, (x, tuple(kv_caches[0])), (layers, jnp.arange(c.num_hidden_layers)))
    return x, [cache]


def _project(matmul: Callable, layers: dict, l: int, eps: float, x: jax.Array, name: str, norm: str | None = None,
             gated: bool = False) -> jax.Array:
    """[RMSNorm `norm`](x [..., E]) @ layer l's weight `name` [, then silu(gate) * up] through `matmul(x2d, w, row,
    norm=(weight, eps), gated=...)` (model/layers.py: decode_matmul), which gets the whole stacked [L, E, N] arrays
    and the row: a per-layer slice would be copied out before a kernel."""
    y = matmul(x.reshape(-1, x.shape[-1]), layers[name], l, norm=None if norm is None else (layers[norm], eps),
               gated=gated)
    return y.reshape(*x.shape[:-1], -1)


def embed(table: jax.Array, token_ids: jax.Array, mesh=None) -> jax.Array:
    """Rows of table [V, E] for token_ids [...]. Split by vocabulary over "tp": each device looks up the ids
    in its own rows (zeros elsewhere) and a psum adds the tp partial results (only one is non-zero: exact)."""
    if tp_size(mesh) == 1:
        return jnp.take(table, token_ids, axis=0)

    def local(rows, ids):                                     # rows [V/tp, E]: this device's vocabulary
        n = rows.shape[0]
        i = ids - jax.lax.axis_index("tp") * n
        mine = (i >= 0) & (i < n)
        x = jnp.take(rows, jnp.where(mine, i, 0), axis=0)
        return jax.lax.psum(jnp.where(mine[..., None], x, jnp.zeros((), x.dtype)), "tp")
    return shard_map(local, mesh, (P("tp", None), P()), P())(table, token_ids)


def compute_logits(c: ModelConfig, params: dict, hidden: jax.Array, matmul: Callable | None = None) -> jax.Array:
    """hidden [..., E] -> fp32 logits [..., V']. V' > V when the vocabulary was padded for tensor
    parallelism: the padding is -inf, so it is never sampled. Split by vocabulary when the weights are.
    `matmul`: as in `forward` (small decode batches: the gemv kernel reads the embedding rows directly)."""
    if matmul is not None:
        tied = c.tie_word_embeddings
        logits = matmul(hidden.reshape(-1, hidden.shape[-1]), params["embed_tokens" if tied else "lm_head"], None,
                        transpose_w=tied, out_dtype=jnp.float32).reshape(*hidden.shape[:-1], -1)
    elif c.tie_word_embeddings:
        logits = jnp.einsum("...e,ve->...v", hidden, params["embed_tokens"], preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("...e,ev->...v", hidden, params["lm_head"], preferred_element_type=jnp.float32)
    if logits.shape[-1] > c.vocab_size:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < c.vocab_size, logits, -jnp.inf)
    return logits


def _decoder_layer(c: ModelConfig, w, x, cos, sin, attn, l, cache, qk_norms, tp: int = 1, mm=None):
    """qk_norms = (q_norm, k_norm, row): the q/k norm weights as given to `attn.from_qkv` ([D], row 0, or the
    stacked [L, D] and row l). tp > 1: the fused weights hold each device's heads adjacent (parallel/layout.py);
    the [..., tp, per device] reshapes below read them back, and are no-ops for tp = 1."""
    H, D = c.num_attention_heads, c.head_dim
    K = kv_heads(c, tp) if tp > 1 else c.num_key_value_heads                     # K' (replicated up to tp)
    Hl, Kl = H // tp, K // tp
    lead = x.shape[:-1]
    if mm is None:   # mm(x, name, norm, gated) = [RMSNorm `norm`](x) @ this layer's `name` [then swiglu]
        def mm(x, name, norm=None, gated=False):
            y = (rms_norm(x, w[norm], c.rms_norm_eps) if norm else x) @ w[name]
            return swiglu(y.reshape(*y.shape[:-1], tp, -1)).reshape(*y.shape[:-1], -1) if gated else y
    qkv = mm(x, "qkv_proj", "input_layernorm")                                    # [..., tp (Hl+2Kl) D]
    from_qkv = attn.from_qkv if isinstance(attn, LayerAttention) else None
    if from_qkv is not None:     # the kernel normalises and rotates q/k itself (3 fewer kernels a layer)
        qkv = qkv.reshape(*lead, tp * (Hl + 2 * Kl), D)
        o, cache = from_qkv(l, qkv, *qk_norms, cos, sin, c.rms_norm_eps, cache)
    else:
        qkv = qkv.reshape(*lead, tp, Hl + 2 * Kl, D)
        q = qkv[..., :Hl, :].reshape(*lead, H, D)
        k = qkv[..., Hl:Hl + Kl, :].reshape(*lead, K, D)
        v = qkv[..., Hl + Kl:, :].reshape(*lead, K, D)
        q = apply_rope(rms_norm(q, w["q_norm"], c.rms_norm_eps), cos, sin)
        k = apply_rope(rms_norm(k, w["k_norm"], c.rms_norm_eps), cos, sin)
        o, cache = attn(l, q, k, v, cache)                                        # [..., H, D]
    x = x + mm(o.reshape(*lead, H * D), "o_proj")        # split by input for tp: XLA adds the all-reduce
    act = mm(x, "gate_up_proj", "post_attention_layernorm", gated=True)         # [..., I]: silu(gate) * up
    return x + mm(act, "down_proj"), cache


def dense_attention(l, q, k, v, cache):
    """Causal attention within each row of a dense batch: q [B, S, H, D], k/v [B, S, K, D]. No cache."""
    B, S, H, D = q.shape
    G = H // k.shape[2]
    k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / (D ** 0.5)
    causal = jnp.tril(jnp.ones((S, S), bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v), cache


def init_params(config: ModelConfig, dtype=jnp.bfloat16, seed: int = 0):
    """Random weights (normal(0.02), norms 1). Wrap in jax.eval_shape to get shapes without allocating."""
    model = Qwen3ForCausalLM(config, dtype)
    key = jax.random.key(seed % 2**63, impl="threefry2x32")   # (not the user's default PRNG; any int seed)
    return model.init(key, method=Qwen3ForCausalLM.declare)["params"]


def dense_logits(config: ModelConfig, params, token_ids: jax.Array) -> jax.Array:
    """Reference forward: token_ids [B, S] -> fp32 logits [B, S, V], no KV cache."""
    model = Qwen3ForCausalLM(config, params["embed_tokens"].dtype)
    positions = jnp.broadcast_to(jnp.arange(token_ids.shape[-1]), token_ids.shape)
    hidden, _ = model.apply({"params": params}, token_ids, positions, dense_attention)
    return model.apply({"params": params}, hidden, method=Qwen3ForCausalLM.logits)
