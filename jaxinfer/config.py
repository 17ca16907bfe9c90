"""ModelConfig (the Qwen3 architecture, read from config.json) and EngineConfig (how the engine runs). This is the
one place Hugging Face field names are read. Both configs are frozen and validated on construction; every error
message prints the offending value."""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass, field, fields

from jaxinfer.model.rope import flag, hf_rope_scaling, number, rope_fields, with_overrides
from jaxinfer.model.supported import check_platform, check_supported

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "fp32": "float32", "bf16": "bfloat16",
           "fp16": "float16", "half": "float16", "float": "float32"}
_DTYPE_NAMES = ("float32", "bfloat16", "float16")


def canonical_dtype(name: str, stored: bool = False) -> str:
    """'bf16' / 'torch.bfloat16' / 'bfloat16' -> 'bfloat16'; anything unknown is a ValueError. stored: a checkpoint's
    dtype, where float64 (weights cast on loading) runs as float32, the widest the engine computes in."""
    key = str(name).replace("torch.", "").lower()
    key = "float32" if stored and key in ("float64", "double", "fp64") else key
    if key not in _DTYPES:
        what, auto = ("the checkpoint's dtype", "") if stored else ("dtype", "'auto', ")
        raise ValueError(f"{what}={name!r} is not supported: use one of {auto}'float32', 'bfloat16', 'float16'")
    return _DTYPES[key]


QWEN3_DEFAULTS = dict(head_dim=128, max_position_embeddings=32768)   # transformers' Qwen3Config's (so vLLM's)


def config_json(path: str) -> str:
    """A checkpoint directory's config.json path; a missing directory or file is a FileNotFoundError naming it."""
    if not os.path.isfile(cfg := os.path.join(path, "config.json")):
        raise FileNotFoundError(f"model directory {path!r} does not exist" if not os.path.isdir(path) else
                                f"{cfg!r} is missing: a checkpoint directory needs config.json")
    return cfg


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
    rope_scaling_factor: float = 1.0       # "linear" or "yarn" rope scaling factor; 1.0 = none
    rope_yarn: tuple = ()                  # YaRN: (original_max_position_embeddings, beta_fast, beta_slow,
                                           # attention_factor, truncate); () = not YaRN (model/rope.py)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = QWEN3_DEFAULTS["max_position_embeddings"]
    torch_dtype: str = "bfloat16"
    eos_token_id: tuple[int, ...] = ()
    name: str = "qwen3"

    def __post_init__(self):
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if not isinstance(v := getattr(self, f), int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ModelConfig.{f}={v!r} must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        for f in ("rms_norm_eps", "rope_theta", "rope_scaling_factor"):
            if not getattr(self, f) > 0:
                raise ValueError(f"{f}={getattr(self, f)!r} must be > 0")
        object.__setattr__(self, "torch_dtype", canonical_dtype(self.torch_dtype, stored=True))

    q_size = property(lambda self: self.num_attention_heads * self.head_dim)
    max_length = property(lambda self: int((self.rope_yarn[0] if self.rope_yarn else self.max_position_embeddings)
                                           * self.rope_scaling_factor))   # the longest context, as vLLM derives it
    kv_size = property(lambda self: self.num_key_value_heads * self.head_dim)
    rope_scaling = property(hf_rope_scaling)    # HF's rope_scaling dict ("linear" / "yarn"); None: plain RoPE

    def num_params(self) -> int:
        """Parameter count as stored (tied embeddings counted once)."""
        E, I, L, V = self.hidden_size, self.intermediate_size, self.num_hidden_layers, self.vocab_size
        per_layer = E * (self.q_size + 2 * self.kv_size) + self.q_size * E + 3 * E * I + 2 * E + 2 * self.head_dim
        return V * E * (1 if self.tie_word_embeddings else 2) + L * per_layer + E

    @classmethod
    def from_dict(cls, d: dict, name: str = "qwen3") -> "ModelConfig":
        check_supported(d)
        d = {**QWEN3_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}       # (rope_fields reads them too)
        heads, seq = d["num_attention_heads"], lambda v: v if isinstance(v, (list, tuple)) else [v]
        eos = tuple(dict.fromkeys(number({"eos_token_id": t}, "eos_token_id", 0, int)
                                  for v in seq(d.get("eos_token_id")) for t in seq(v) if t is not None))
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads", heads), head_dim=d["head_dim"],
            rms_norm_eps=number(d, "rms_norm_eps", 1e-6), **rope_fields(d),
            tie_word_embeddings=flag(d, "tie_word_embeddings", False), max_position_embeddings=d["max_position_embeddings"],
            torch_dtype=d.get("dtype") or d.get("torch_dtype") or "bfloat16", eos_token_id=eos, name=name)

    @classmethod
    def from_pretrained(cls, path: str, hf_overrides: dict | None = None) -> "ModelConfig":
        """From path/config.json (EOS ids: generation_config.json's, if any), with vLLM's `hf_overrides` applied."""
        cfg = config_json(path)
        d, gen = with_overrides(read_json(cfg), hf_overrides), os.path.join(path, "generation_config.json")
        g = read_json(gen, broken={}) if os.path.isfile(gen) else {}    # (broken: LLM's sampling defaults name it)
        if (ids := g.get("eos_token_id")) is not None:    # its EOS ids replace config.json's (HF's generate, vLLM;
            own = "eos_token_id" in (hf_overrides if isinstance(hf_overrides, dict) else {})   # Qwen3 lists
            d = {**d, "eos_token_id": [d["eos_token_id"] if own else None, ids]}   # <|endoftext|>), an override's stay
        try:
            return cls.from_dict(d, name=os.path.basename(os.path.normpath(path)))
        except KeyError as e:
            raise ValueError(f"{cfg!r} lacks the field {e.args[0]!r}") from None


def read_json(path: str, broken: dict | None = None) -> dict:
    """path's JSON object; not valid JSON or not an object: a ValueError naming it (or `broken`, if given)."""
    try:
        with open(path) as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        d = e
    if not isinstance(d, dict) and broken is None:
        raise ValueError(f"{path!r} is not valid JSON: {d}" if isinstance(d, Exception) else
                         f"{path!r} must hold a JSON object, not {type(d).__name__}")
    return d if isinstance(d, dict) else broken


ATTN_BACKENDS = ("xla", "pallas", "cudnn", "triton", "mosaic")
GPU_ONLY_BACKENDS = {"cudnn": "cuDNN attention", "triton": "Triton kernels (jax-triton)",   # no CPU/interpret path
                     "mosaic": "Pallas Mosaic GPU kernels (Hopper)"}
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "bfloat16", "float16")   # vLLM's; fp8: e4m3 (model/kv_scales.py)
# Past any real use; refused at LLM(), not later (2**31 rows: a 2 TiB host buffer; 2**20-token blocks: no start-up)
UPPER_BOUNDS = dict(max_num_seqs=1 << 16, max_num_batched_tokens=1 << 20, block_size=1024)


def _opt(default, help: str, **meta):
    """A config field with its help text: LLM kwargs, CLI flags and bench options are derived from these."""
    return field(default=default, metadata={"help": help, **meta})


# Defaults that depend on where the engine runs, in one place. On a GPU: the benchmarked configuration. On a
# CPU: small enough that a tiny model starts in seconds (a 256-sequence GPU pool took 100 s to compile).
PLATFORM_DEFAULTS = {
    "gpu": dict(dtype="auto", attn_backend="pallas", max_num_seqs=256, max_num_batched_tokens=16384, warmup=True),
    "cpu": dict(dtype="float32", attn_backend="xla", max_num_seqs=8, max_num_batched_tokens=512, warmup=False),
}
# Per attention backend (docs/design.md, "Buckets"): context_buckets (widths beside max_model_len's), prefill_ladder /
# decode_ladder ((first, ratio): first * ratio^k), narrow_prefill, decode_context_buckets (xla decode's page budgets).
BACKEND_DEFAULTS = {
    "pallas": dict(context_buckets=(4096,), prefill_ladder=(64, 4), narrow_prefill=1024),
    "xla": dict(context_buckets=(1024, 2048, 8192), prefill_ladder=(256, 8), narrow_prefill=None,
                decode_context_buckets=(512, 640, 768, 1024, 1536, 2048, 8192), decode_ladder=(64, 8)),
}


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs one model. Names follow vLLM / nano-vllm. A None field takes its platform default
    (PLATFORM_DEFAULTS) when the engine starts: `resolve(platform, model)` returns the concrete config."""
    dtype: str | None = _opt(None, "weights and KV cache dtype: auto (the checkpoint's), float32, bfloat16, float16 "
                                   "(default: GPU auto, CPU float32)", choices=("auto", *_DTYPE_NAMES, "half", "float"))
    attn_backend: str | None = _opt(None, "attention implementation (GPU: pallas; CPU: xla)", choices=ATTN_BACKENDS)
    kv_cache_dtype: str = _opt("auto", "KV cache dtype: auto (the model's; bfloat16 / float16: the same, if that is "
                                       "it), fp8 / fp8_e4m3 (float8_e4m3fn, per-layer scales)", choices=KV_CACHE_DTYPES)
    calculate_kv_scales: bool = _opt(False, "fp8 KV cache: compute the scales (the weights' bound) even where the "
                                            "checkpoint has k_scale / v_scale (otherwise: only where it has none)")
    max_num_seqs: int | None = _opt(None, "most sequences in one step (GPU: 256; CPU: 8)")
    max_num_batched_tokens: int | None = _opt(None, "most prompt tokens in one prefill step (GPU: 16384; CPU: 512)")
    max_model_len: int | None = _opt(None, "longest prompt + output (default: the model's, capped by the KV pool)")
    block_size: int = _opt(16, "tokens per KV cache block (a power of two, <= 1024)", aliases=("--kvcache-block-size",))
    num_kvcache_blocks: int | None = _opt(None, "KV blocks (default GPU: memory left; CPU: seqs x len up to 2 GiB)")
    gpu_memory_utilization: float = _opt(0.9, "fraction of the GPU memory JAX may use that the engine takes")
    enable_prefix_caching: bool = _opt(True, "reuse the KV of cached prompt prefixes")
    decode_buckets: tuple[int, ...] | None = _opt(None, "decode batch sizes to compile (default: 8, 32, 2^k; xla 8^k)")
    prefill_buckets: tuple[int, ...] | None = _opt(None, "prefill token counts to compile (default: 64 x 4^k, "
                                                         "xla 256 x 8^k, up to max_num_batched_tokens)")
    context_buckets: tuple[int, ...] | None = _opt(None, "context lengths (tokens) with a narrower table width than "
                                                         "max_model_len's (default: pallas 4096; xla 1024, 2048, 8192)")
    decode_context_buckets: tuple[int, ...] | None = _opt(None, "decode steps' context buckets (default: xla 512, "
        "640, 768, 1024, 1536, 2048, 8192: mean tokens a row of its flat tables; other backends: context_buckets)")
    seed: int | None = _opt(0, "engine seed: draws the seeds of requests that give none")
    max_logprobs: int = _opt(20, "most logprobs / prompt_logprobs a request may ask for (vLLM's; -1: the vocabulary)")
    async_scheduling: bool = _opt(True, "schedule step N+1 while step N runs (sampled ids stay on the device)")
    num_scheduler_steps: int | None = _opt(None, "decode steps per device call (default: the engine picks 4 or 16 "
                                                 "for small batches when nothing waits, xla 16; 1: one step)")
    warmup: bool | None = _opt(None, "compile every step bucket at start-up (GPU: yes; CPU: no, compile lazily)")
    tensor_parallel_size: int = _opt(1, "devices each replica's weights and KV cache are split over (tensor "
                                        "parallelism; must divide the attention heads and intermediate_size, and divide "
                                        "or be a multiple of the kv heads)", aliases=("-tp",))
    data_parallel_size: int = _opt(1, "engine replicas, each on its own tensor_parallel_size devices; requests go "
                                      "to the least loaded", aliases=("-dp",))

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_kvcache_blocks",
                     "tensor_parallel_size", "data_parallel_size", "num_scheduler_steps", "seed", "max_logprobs"):
            v, least = getattr(self, name), {"seed": 0, "max_logprobs": -1}.get(name, 1)   # None: the default
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < least):   # (seed: a random one)
                raise ValueError(f"{name}={v!r} must be " + ("a positive integer", "a non-negative integer",
                                                             "an integer >= -1 (-1: the vocabulary)")[1 - least])
            if v is not None and v > UPPER_BOUNDS.get(name, v):
                raise ValueError(f"{name}={v} is more than {UPPER_BOUNDS[name]}, the most the engine takes")
        if (bs := self.block_size) is None or bs & (bs - 1):
            raise ValueError(f"block_size={bs} must be a power of two")
        if not isinstance(g := self.gpu_memory_utilization, (int, float)) or isinstance(g, bool) or not 0 < g <= 1:
            raise ValueError(f"gpu_memory_utilization={g!r} must be in (0, 1]")
        for name in ("enable_prefix_caching", "async_scheduling", "calculate_kv_scales", "warmup")[:3 + (
                self.warmup is not None)]:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.attn_backend is not None and self.attn_backend not in ATTN_BACKENDS:
            raise ValueError(f"attn_backend={self.attn_backend!r} is not one of {ATTN_BACKENDS}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}")
        if self.dtype is not None and self.dtype != "auto":
            object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        for name in ("decode_buckets", "prefill_buckets", "context_buckets", "decode_context_buckets"):
            if (v := getattr(self, name)) is None:
                continue
            if not isinstance(v, (list, tuple)) or not v or not all(
                    isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in v):
                raise ValueError(f"{name}={v!r} must be a non-empty list of positive integers")
            object.__setattr__(self, name, tuple(sorted(set(v))))
        if self.resolved:
            if (k := self.num_scheduler_steps) and k > self.max_model_len:   # (also after the KV pool capped it)
                raise ValueError(f"num_scheduler_steps={k} is more than max_model_len={self.max_model_len} (the KV "
                                 f"pool's blocks x block_size, if less): no request could use it")
            if max(self.decode_buckets) < self.max_num_seqs:
                raise ValueError(f"decode_buckets={self.decode_buckets} do not reach max_num_seqs={self.max_num_seqs}")
            if max(self.prefill_buckets) < self.max_num_batched_tokens:
                raise ValueError(f"prefill_buckets={self.prefill_buckets} do not reach "
                                 f"max_num_batched_tokens={self.max_num_batched_tokens}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """EngineConfig from LLM-style keyword arguments; an unknown one is a ValueError that names it."""
        from jaxinfer.compat import engine_names
        names, kwargs = {f.name for f in fields(cls)}, engine_names(kwargs)    # (other names, None as the default)
        if unknown := sorted(set(kwargs) - names):
            hint = difflib.get_close_matches(unknown[0], names, n=1)
            raise ValueError(f"unknown engine option {unknown[0]}={kwargs[unknown[0]]!r}"
                             + (f"; did you mean {hint[0]}?" if hint else f"; the options are {sorted(names)}"))
        return cls(**kwargs)

    resolved = property(lambda self: self.dtype != "auto" and None not in (
        self.dtype, self.attn_backend, self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len,
        self.decode_buckets, self.prefill_buckets, self.warmup))

    def resolve(self, platform: str, model: "ModelConfig") -> "EngineConfig":
        """Fill every None field for `platform` ("gpu" / "cpu") and `model` (max_model_len: the model's length)."""
        check_platform(self, platform)
        kw = {k: v for k, v in PLATFORM_DEFAULTS["gpu" if platform == "gpu" else "cpu"].items()
              if getattr(self, k) is None}
        if (self.dtype or kw.get("dtype")) == "auto":
            kw["dtype"] = model.torch_dtype
        if self.kv_cache_dtype in ("bfloat16", "float16"):      # a full-precision cache: the model's dtype here
            if canonical_dtype(dt := kw.get("dtype", self.dtype)) != self.kv_cache_dtype:
                raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} differs from dtype={dt!r}: use 'auto' or fp8")
            kw["kv_cache_dtype"] = "auto"
        kw["max_model_len"] = mml = self.max_model_len or model.max_length
        if mml > model.max_length:
            raise ValueError(f"max_model_len={mml} exceeds the model's longest context, {model.max_length} "
                             f"(max_position_embeddings; with rope scaling, the trained length times its factor)")
        seqs = self.max_num_seqs or kw["max_num_seqs"]
        tokens = self.max_num_batched_tokens or kw["max_num_batched_tokens"]
        backend = BACKEND_DEFAULTS.get(self.attn_backend or kw["attn_backend"], BACKEND_DEFAULTS["pallas"])
        kw["decode_buckets"] = self.decode_buckets or tuple(_decode_buckets(seqs, *backend.get("decode_ladder", ())))
        kw["prefill_buckets"] = self.prefill_buckets or tuple(_ladder(tokens, *backend["prefill_ladder"]))
        kw["context_buckets"] = self.context_buckets or backend["context_buckets"]
        return dataclasses.replace(self, **kw)

    max_blocks_per_seq = property(lambda self: -(-self.max_model_len // self.block_size))

    def block_table_widths(self, decode: bool = False) -> tuple[int, ...]:
        """Block-table widths (blocks) with compiled steps: the context buckets below max_model_len, and its own. A
        step takes the narrowest that holds it (engine/batch.py); `decode`: decode steps' (decode_context_buckets)."""
        own = BACKEND_DEFAULTS.get(self.attn_backend, BACKEND_DEFAULTS["pallas"])
        ctx = decode and (self.decode_context_buckets or own.get("decode_context_buckets"))
        ctx = ctx or self.context_buckets or own["context_buckets"]
        W = self.max_blocks_per_seq
        return tuple(sorted({min(W, -(-c // self.block_size)) for c in ctx} | {W}))

    def prefill_table_widths(self, T: int) -> tuple[int, ...]:
        """The widths prefill steps of T tokens are compiled for: all, or (kernels, large T) the full one alone."""
        most = BACKEND_DEFAULTS.get(self.attn_backend, BACKEND_DEFAULTS["pallas"])["narrow_prefill"]
        return self.block_table_widths() if most is None or T <= most else (self.max_blocks_per_seq,)

    replace = dataclasses.replace    # config.replace(**changes)


def _decode_buckets(n: int, first: int = 32, ratio: int = 2) -> list[int]:
    # 8, 32, 64, ..., n (or 8, first * ratio^k, n): few compilations, padding rows cost little; 8: XLA pads bf16
    return sorted({8, *(b for b in _ladder(n, first, ratio) if b > 8)})   # GEMM rows to 8 (1 row: 1.41 ms, 2: 1.64)


def _ladder(n: int, first: int, ratio: int) -> list[int]:
    # Few buckets keep start-up compilation short: ratio-x steps from `first` (BACKEND_DEFAULTS), then n.
    return [first * ratio ** i for i in range(64) if first * ratio ** i < n] + [n]
