"""ModelConfig (the Qwen3 architecture, read from config.json) and EngineConfig (how the engine runs).

This is the one place Hugging Face field names are read. Both configs are frozen and validated on
construction; every error message prints the offending value.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
           "fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}


def canonical_dtype(name: str) -> str:
    """'bf16' / 'torch.bfloat16' / 'bfloat16' -> 'bfloat16'; anything unknown is a ValueError."""
    key = str(name).replace("torch.", "").lower()
    if key not in _DTYPES:
        raise ValueError(f"dtype={name!r} is not supported; use one of 'float32', 'bfloat16', 'float16'")
    return _DTYPES[key]


@dataclass(frozen=True)
class ModelConfig:
    """Every Qwen3 field that changes the math. Names follow HF's Qwen3Config."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling_factor: float = 1.0       # "linear" rope scaling; 1.0 = none
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    torch_dtype: str = "bfloat16"
    eos_token_id: tuple[int, ...] = ()
    name: str = "qwen3"

    def __post_init__(self):
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelConfig.{f}={v!r} must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps!r} must be > 0")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta={self.rope_theta!r} must be > 0")
        object.__setattr__(self, "torch_dtype", canonical_dtype(self.torch_dtype))

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count as stored (tied embeddings counted once)."""
        E, I, L, V = self.hidden_size, self.intermediate_size, self.num_hidden_layers, self.vocab_size
        per_layer = E * (self.q_size + 2 * self.kv_size) + self.q_size * E + 3 * E * I + 2 * E + 2 * self.head_dim
        return V * E * (1 if self.tie_word_embeddings else 2) + L * per_layer + E

    @classmethod
    def from_dict(cls, d: dict, name: str = "qwen3") -> "ModelConfig":
        model_type = d.get("model_type")
        if model_type != "qwen3":
            raise ValueError(f"model_type={model_type!r} is not supported: jaxinfer runs Qwen3 dense models "
                             f"(model_type 'qwen3')")
        if d.get("attention_bias"):
            raise ValueError("attention_bias=True is not supported (Qwen3 checkpoints have none)")
        if d.get("use_sliding_window"):
            raise ValueError("use_sliding_window=True is not supported")
        # transformers < 5 writes rope_theta/rope_scaling; >= 5 writes rope_parameters.
        rope = dict(d.get("rope_parameters") or {})
        scaling = d.get("rope_scaling") or {}
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        kind = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        factor = 1.0
        if kind == "linear":
            factor = float(rope.get("factor", scaling.get("factor", 1.0)))
        elif kind != "default":
            raise ValueError(f"rope scaling type {kind!r} is not supported (only 'default' and 'linear')")
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads", heads),
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
            rope_scaling_factor=factor, tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=d.get("max_position_embeddings", 40960),
            torch_dtype=d.get("dtype") or d.get("torch_dtype") or "bfloat16", eos_token_id=eos, name=name)

    @classmethod
    def from_pretrained(cls, path: str) -> "ModelConfig":
        cfg = os.path.join(path, "config.json")
        if not os.path.isdir(path):
            raise FileNotFoundError(f"model directory {path!r} does not exist")
        if not os.path.isfile(cfg):
            raise FileNotFoundError(f"{cfg!r} is missing: a checkpoint directory needs config.json")
        try:
            with open(cfg) as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg!r} is not valid JSON: {e}") from None
        try:
            return cls.from_dict(d, name=os.path.basename(os.path.normpath(path)))
        except KeyError as e:
            raise ValueError(f"{cfg!r} lacks the field {e.args[0]!r}") from None


ATTN_BACKENDS = ("xla", "pallas")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs one model. Names follow vLLM / nano-vllm."""
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    max_model_len: int = 4096
    kvcache_block_size: int = 16
    num_kvcache_blocks: int | None = None   # None: size the pool from free device memory
    gpu_memory_utilization: float = 0.9
    dtype: str = "bfloat16"
    attn_backend: str = "xla"
    enable_prefix_caching: bool = True
    # Buckets: decode batch sizes and prefill token counts are padded up to one of these.
    decode_buckets: tuple[int, ...] | None = None
    prefill_buckets: tuple[int, ...] | None = None
    seed: int = 0
    # Pass each layer's weights as its own arrays (True) or as stacked [L, ...] arrays (False).
    # None: per-layer on CPU (measured faster), stacked on GPU (fewer arguments per call).
    unstack_weights: bool | None = None

    def __post_init__(self):
        def positive(name):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "kvcache_block_size"):
            positive(name)
        bs = self.kvcache_block_size
        if bs & (bs - 1):
            raise ValueError(f"kvcache_block_size={bs} must be a power of two")
        if self.num_kvcache_blocks is not None:
            positive("num_kvcache_blocks")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization!r} must be in (0, 1]")
        if self.attn_backend not in ATTN_BACKENDS:
            raise ValueError(f"attn_backend={self.attn_backend!r} is not one of {ATTN_BACKENDS}")
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        object.__setattr__(self, "decode_buckets", tuple(sorted(self.decode_buckets or _decode_buckets(self.max_num_seqs))))
        object.__setattr__(self, "prefill_buckets",
                           tuple(sorted(self.prefill_buckets or _prefill_buckets(self.max_num_batched_tokens))))
        if max(self.decode_buckets) < self.max_num_seqs:
            raise ValueError(f"decode_buckets={self.decode_buckets} do not reach max_num_seqs={self.max_num_seqs}")
        if max(self.prefill_buckets) < self.max_num_batched_tokens:
            raise ValueError(f"prefill_buckets={self.prefill_buckets} do not reach "
                             f"max_num_batched_tokens={self.max_num_batched_tokens}")

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.kvcache_block_size)

    def replace(self, **kw) -> "EngineConfig":
        return dataclasses.replace(self, **kw)


def _decode_buckets(n: int) -> list[int]:
    # 8, 32, 64, 128, 256, ...: few buckets (each is a compilation); padding a decode batch costs
    # little because padding rows have no context (attention skips them) and the weights dominate.
    # The smallest is 8: XLA pads a bf16 GEMM's rows to a multiple of 8 for cuBLAS, so a batch-2 step ran
    # 6 pad kernels a layer (0.19 ms of 1.57), and with one row it rewrites every matmul as multiply +
    # reduce. One request decoded at 1.41 ms a token with bucket 8 against 1.64 with bucket 2 (H200, same run).
    out, b = [8], 32
    while b < n:
        out.append(b)
        b *= 2
    return sorted(set(out + ([n] if n > 8 else [])))


def _prefill_buckets(n: int) -> list[int]:
    # Few buckets keep start-up compilation short: 4x steps from 64 tokens.
    out, b = [], 64
    while b < n:
        out.append(b)
        b *= 4
    return out + [n]
