"""Load a Hugging Face Qwen3 safetensors checkpoint (single file or sharded) into jaxinfer's params.

One name table (`_LAYER_TABLE`) maps each of our stacked, fused weights to the HF tensors it is built
from. safetensors files are parsed here directly (an 8-byte header size, a JSON header, raw bytes) and
memory-mapped, so bf16/fp16/fp32 checkpoints load without torch, and a truncated or corrupt file is
reported with the file and tensor it breaks.
"""
from __future__ import annotations

import functools
import glob
import json
import os
import struct
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.model.kv_scales import checkpoint_scales
from jaxinfer.model.qwen3 import INIT_STD, init_params, layer_shapes
from jaxinfer.model.rope import hf_rope_scaling
from jaxinfer.parallel.layout import map_params, spec, to_tp

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "F64": np.float64, "I64": np.int64, "I32": np.int32}

# ours -> HF tensors concatenated along the output axis; "T" = stored [out, in], we keep [in, out].
_LAYER_TABLE = {
    "input_layernorm": (["input_layernorm.weight"], False),
    "qkv_proj": (["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"], True),
    "q_norm": (["self_attn.q_norm.weight"], False),
    "k_norm": (["self_attn.k_norm.weight"], False),
    "o_proj": (["self_attn.o_proj.weight"], True),
    "post_attention_layernorm": (["post_attention_layernorm.weight"], False),
    "gate_up_proj": (["mlp.gate_proj.weight", "mlp.up_proj.weight"], True),
    "down_proj": (["mlp.down_proj.weight"], True),
}


class SafetensorsFile:
    """Lazy view of one .safetensors file: `names()`, `get(name) -> np.ndarray` (memory-mapped)."""

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError(f"{path!r} is truncated or not a safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8 or n > 100_000_000:
                raise ValueError(f"{path!r} is corrupt: header size {n} does not fit a {size}-byte file")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{path!r} is corrupt: its header is not valid JSON ({e})") from None
        if not isinstance(header, dict) or not all(isinstance(v, dict) for v in header.values()):
            raise ValueError(f"{path!r} is corrupt: its header is not a JSON object of tensor entries")
        header.pop("__metadata__", None)
        self.header, self.data_start, self.size = header, 8 + n, size
        self._mmap = None

    def names(self) -> list[str]:
        return list(self.header)

    def get(self, name: str) -> np.ndarray:
        info = self.header.get(name)
        if info is None:            # a sharded index that names the wrong shard
            raise ValueError(f"tensor {name!r} is not in {self.path!r}, the file the checkpoint's index names for it")
        dtype = _ST_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ValueError(f"tensor {name!r} in {self.path!r} has unsupported dtype {info.get('dtype')!r}")
        if not isinstance(info.get("data_offsets"), list) or len(info["data_offsets"]) != 2 or \
                not isinstance(info.get("shape"), list):
            raise ValueError(f"tensor {name!r} in {self.path!r} is corrupt: no shape or data_offsets in its header")
        start, end = info["data_offsets"]
        count = int(np.prod(info["shape"], dtype=np.int64))
        if end - start != count * np.dtype(dtype).itemsize or start > end:
            raise ValueError(f"tensor {name!r} in {self.path!r} is corrupt: offsets {start}..{end} "
                             f"do not match shape {info['shape']} of {info['dtype']}")
        if self.data_start + end > self.size:
            raise ValueError(f"{self.path!r} is truncated: tensor {name!r} ends at byte {self.data_start + end} "
                             f"but the file has {self.size} bytes")
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._mmap[self.data_start + start:self.data_start + end]
        return raw.view(dtype).reshape(info["shape"])


def _open_checkpoint(path: str) -> dict[str, SafetensorsFile]:
    """tensor name -> the file holding it, for single-file and sharded checkpoints."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{index!r} is not valid JSON: {e}") from None
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index!r} has no 'weight_map' (tensor name -> file name): not a safetensors index")
        files = {}
        for fname in sorted(set(weight_map.values())):
            fpath = os.path.join(path, fname)
            if not os.path.isfile(fpath):
                some = next(t for t, v in weight_map.items() if v == fname)
                raise FileNotFoundError(f"shard {fpath!r} (holding e.g. tensor {some!r}) is missing")
            files[fname] = SafetensorsFile(fpath)
        return {t: files[f] for t, f in weight_map.items()}
    paths = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not paths:
        other = sorted(os.path.basename(p) for e in ("*.bin", "*.pt", "*.pth", "*.gguf")
                       for p in glob.glob(os.path.join(path, e)))
        raise FileNotFoundError(f"no *.safetensors weights in {path!r}" + (
            f" (found {', '.join(other[:3])}: jaxinfer reads safetensors only; convert them, e.g. with transformers' "
            f"from_pretrained(...).save_pretrained(dir))" if other else ""))
    table = {}
    for p in paths:
        st = SafetensorsFile(p)
        table.update({name: st for name in st.names()})
    return table


def load_params(path: str, config: ModelConfig | None = None, dtype=jnp.bfloat16, placement=None,
                kv_scales: bool = True) -> dict:
    """Read a checkpoint directory into the params pytree of `Qwen3ForCausalLM`, cast to `dtype`.
    kv_scales: also read its fp8 KV cache scales, if any (False: an "auto" cache, which ignores them, as vLLM).

    placement (parallel.Placement): put the weights on its devices in the tensor-parallel layout, each device
    receiving only its own slices; None: the default device, checkpoint layout."""
    config = config or ModelConfig.from_pretrained(path)
    if placement is not None:
        placement.check(config)           # a size that does not divide the heads fails before any reading
        return placement.place_host_params(config, read_params(path, config, dtype, kv_scales))
    return jax.tree.map(jax.device_put, read_params(path, config, dtype, kv_scales))


def read_params(path: str, config: ModelConfig, dtype=jnp.bfloat16, kv_scales: bool = True) -> dict:
    """The params pytree as host numpy arrays (checkpoint layout; stacked [L, ...] layers)."""
    tensors = _open_checkpoint(path)
    np_dtype = np.dtype(jnp.dtype(dtype))

    def fetch(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"checkpoint {path!r} lacks tensor {name!r}")
        a = tensors[name].get(name)
        if tuple(a.shape) != tuple(shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(a.shape)}, expected {tuple(shape)} "
                             f"from config.json")
        return a

    c = config
    E, D, I = c.hidden_size, c.head_dim, c.intermediate_size
    hf_shapes = {"input_layernorm.weight": (E,), "post_attention_layernorm.weight": (E,),
                 "self_attn.q_proj.weight": (c.q_size, E), "self_attn.k_proj.weight": (c.kv_size, E),
                 "self_attn.v_proj.weight": (c.kv_size, E), "self_attn.o_proj.weight": (E, c.q_size),
                 "self_attn.q_norm.weight": (D,), "self_attn.k_norm.weight": (D,),
                 "mlp.gate_proj.weight": (I, E), "mlp.up_proj.weight": (I, E), "mlp.down_proj.weight": (E, I)}
    layers = {}
    for ours, (hf_names, transposed) in _LAYER_TABLE.items():
        stacked = np.empty((c.num_hidden_layers, *layer_shapes(c)[ours]), np_dtype)
        for l in range(c.num_hidden_layers):
            parts = [fetch(f"model.layers.{l}.{n}", hf_shapes[n]) for n in hf_names]
            parts = [p.T if transposed else p for p in parts]
            stacked[l] = np.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
        layers[ours] = stacked
    params = {
        "embed_tokens": fetch("model.embed_tokens.weight", (c.vocab_size, E)).astype(np_dtype),
        "layers": layers,
        "norm": fetch("model.norm.weight", (E,)).astype(np_dtype),
    }
    if not c.tie_word_embeddings:
        params["lm_head"] = np.ascontiguousarray(fetch("lm_head.weight", (c.vocab_size, E)).T.astype(np_dtype))
    # fp8 KV cache scales of vLLM's checkpoints (model.layers.N.self_attn.k_scale / v_scale), float32 [L]; the
    # engine keeps them only for an fp8 cache (model/kv_scales.py)
    params.update((checkpoint_scales(tensors, c.num_hidden_layers) if kv_scales else None) or {})
    return params


def random_params(config: ModelConfig, dtype=jnp.bfloat16, seed: int = 0, placement=None) -> dict:
    """A preset's random weights, made on the device(s): normal(INIT_STD), norms 1. Each weight is drawn in the
    checkpoint layout from a key of (seed, its name, its layer) and then laid out for tensor parallelism as a
    checkpoint's weight is (`to_tp`), so one seed gives the same model at every tp (kv heads replicated past
    num_key_value_heads are exact copies). Stacked weights are drawn one layer at a time into a donated buffer,
    sharded, so a device holds only its own slices plus one layer's temporaries (one jitted `init_params` kept
    ~5x the model in temporaries when compiled for the CPU; at 32B that cannot fit a GPU)."""
    dtype = jnp.dtype(dtype)
    tp = 1 if placement is None else placement.tp
    if placement is not None:
        placement.check(config)
    logical = jax.eval_shape(lambda: init_params(config, dtype))                  # the checkpoint layout
    shapes = jax.eval_shape(lambda: map_params(lambda n, w: to_tp(n, w, config, tp, jnp), init_params(config, dtype)))
    key = jax.random.key(seed % 2**63, impl="threefry2x32")         # (not the user's default PRNG; any int seed)

    def one(name, s):
        sharding = None if placement is None else placement.sharding(spec(name, len(s.shape)))
        std = 0.0 if name.endswith("norm") else INIT_STD
        k = jax.random.fold_in(key, zlib.crc32(name.encode()))
        if name in _LAYER_TABLE:      # stacked [L, ...]: layer by layer
            buf = jax.jit(lambda: jnp.zeros(s.shape, s.dtype), out_shardings=sharding)()
            for l in range(s.shape[0]):
                buf = _draw_layer(buf, jnp.int32(l), jax.random.fold_in(k, l), std, name, config, tp)
            return buf
        shape = logical[name].shape
        return jax.jit(lambda: to_tp(name, _draw(k, shape, s.dtype, std), config, tp, jnp), out_shardings=sharding)()
    return map_params(one, shapes)


def _draw(key, shape, dtype, std: float):
    if std == 0.0:
        return jnp.ones(shape, dtype)
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


@functools.partial(jax.jit, donate_argnums=0, static_argnums=(3, 4, 5, 6))
def _draw_layer(buf, l, key, std: float, name: str, config: ModelConfig, tp: int):
    """buf [L, ...] (donated, sharded, tp layout) with layer l drawn in place: in the checkpoint layout, then
    laid out for tp."""
    w = to_tp(name, _draw(key, layer_shapes(config)[name], buf.dtype, std), config, tp, jnp)
    return jax.lax.dynamic_update_index_in_dim(buf, w, l, 0)


def hf_config(c: ModelConfig, dtype: str | None = None) -> dict:
    """The config.json of a Hugging Face Qwen3 checkpoint for c (ModelConfig.from_dict's inverse)."""
    dtype = dtype or c.torch_dtype
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta, "rope_parameters": rope_parameters(c),
            "tie_word_embeddings": c.tie_word_embeddings, "max_position_embeddings": c.max_position_embeddings,
            "hidden_act": "silu", "attention_bias": False, "torch_dtype": dtype, "dtype": dtype,
            "eos_token_id": list(c.eos_token_id) or None}


def rope_parameters(c: ModelConfig) -> dict:
    """config.json's rope_parameters (transformers >= 5) for c: the inverse of model/rope.rope_fields."""
    return {**(hf_rope_scaling(c) or {"rope_type": "default"}), "rope_theta": c.rope_theta}


def save_checkpoint(params: dict, config: ModelConfig, path: str, dtype: str = "bfloat16") -> str:
    """Write params as a Hugging Face Qwen3 checkpoint (config.json + model.safetensors), the inverse of
    `load_params` through the same name table: lets transformers run a preset's random weights."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    np_dtype = np.dtype(jnp.dtype(dtype))
    c = config
    tensors = {"model.embed_tokens.weight": np.asarray(params["embed_tokens"]).astype(np_dtype),
               "model.norm.weight": np.asarray(params["norm"]).astype(np_dtype)}
    if not c.tie_word_embeddings:
        tensors["lm_head.weight"] = np.ascontiguousarray(np.asarray(params["lm_head"]).T.astype(np_dtype))
    widths = {"self_attn.q_proj.weight": c.q_size, "self_attn.k_proj.weight": c.kv_size,
              "self_attn.v_proj.weight": c.kv_size, "mlp.gate_proj.weight": c.intermediate_size,
              "mlp.up_proj.weight": c.intermediate_size}
    layers = params["layers"]
    for ours, (hf_names, transposed) in _LAYER_TABLE.items():
        stacked = np.asarray(layers[ours]).astype(np_dtype)
        for l in range(c.num_hidden_layers):
            w, start = stacked[l], 0
            for n in hf_names:
                part = w[..., start:start + widths[n]] if len(hf_names) > 1 else w
                start += part.shape[-1]
                tensors[f"model.layers.{l}.{n}"] = np.ascontiguousarray(part.T if transposed else part)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    hf = hf_config(c, dtype)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    return path
