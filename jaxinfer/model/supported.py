"""What config.json may ask for: Qwen3 dense causal LMs whose every layer attends in full, with unquantized
weights. Anything else is a ValueError naming the field (ModelConfig.from_dict calls `check_supported`). Also what
an engine configuration can run on a platform (`check_platform`)."""


def check_supported(d: dict) -> None:
    model_type, arch = d.get("model_type"), d.get("architectures") or ["Qwen3ForCausalLM"]   # (absent: fine)
    if model_type != "qwen3" or "Qwen3ForCausalLM" not in arch:
        raise ValueError(f"model_type={model_type!r} architectures={arch!r} is not supported: jaxinfer runs "
                         f"Qwen3 dense causal LMs (model_type 'qwen3', Qwen3ForCausalLM)")
    for key, ok, why in (("attention_bias", False, " (Qwen3 checkpoints have none)"),
                         ("hidden_act", "silu", ": Qwen3's MLP is SwiGLU")):
        if d.get(key, ok) not in (ok, None):
            raise ValueError(f"{key}={d[key]!r} is not supported{why}")
    if sliding := sliding_layers(d):
        raise ValueError(f"sliding-window attention (use_sliding_window={d.get('use_sliding_window')!r}, "
                         f"sliding_window={d.get('sliding_window', 4096)!r}, layers {sliding}) is not supported")
    if quantized_weights(q := d.get("quantization_config")):
        method = q.get("quant_method") if isinstance(q, dict) else q
        raise ValueError(f"quantization_config (quant_method={method!r}) is not supported: jaxinfer runs bf16 / fp16 / "
                         f"fp32 weights (an fp8 KV cache is kv_cache_dtype='fp8')")


def sliding_layers(d: dict) -> list[int]:
    """The layers transformers' Qwen3 runs with a sliding window: none unless use_sliding_window is set and
    sliding_window is not null (absent: Qwen3Config's default, 4096); then those layer_types marks
    "sliding_attention", or (without layer_types) those from max_window_layers on (Qwen3Config's default: 28). A
    checkpoint whose flag is set but no layer slides is plain full attention."""
    if not d.get("use_sliding_window") or d.get("sliding_window", 4096) is None:
        return []
    if isinstance(types := d.get("layer_types"), list):
        return [i for i, t in enumerate(types) if t == "sliding_attention"]
    first = d.get("max_window_layers")
    return list(range(28 if first is None else first, d.get("num_hidden_layers") or 0))


def quantized_weights(q) -> bool:
    """A quantization_config that changes the weights (AWQ, GPTQ, FP8, bitsandbytes, ...). llm-compressor's
    compressed-tensors config with no weight groups only calibrates the KV cache (k_proj / v_proj output_scale,
    which model/kv_scales.py reads): its weights are plain."""
    if not q:
        return False
    return not (isinstance(q, dict) and q.get("quant_method") == "compressed-tensors" and not q.get("config_groups"))


def check_platform(c, platform: str, ready: bool = False) -> None:
    """An EngineConfig's checks that need no model: a GPU-only backend off a GPU, or with what it cannot read (and,
    `ready`, triton's packages and ptxas). LLM() runs them before it resolves (and maybe downloads) the model."""
    from jaxinfer.config import GPU_ONLY_BACKENDS
    if c.attn_backend in GPU_ONLY_BACKENDS:
        what = GPU_ONLY_BACKENDS[c.attn_backend]
        if platform != "gpu":
            raise ValueError(f"attn_backend={c.attn_backend!r} needs a CUDA GPU (the engine runs {what} only "
                             f"on a GPU); JAX's platform here is {platform!r}: use 'xla' or 'pallas'")
        if c.kv_cache_dtype.startswith("fp8"):
            raise ValueError(f"attn_backend={c.attn_backend!r} does not read an fp8 KV cache "
                             f"(kv_cache_dtype={c.kv_cache_dtype!r}): use 'pallas' or 'xla' for fp8")
        if c.attn_backend == "mosaic" and c.block_size < 8:   # (its kernels' whole 8-row SMEM tiles)
            raise ValueError(f"attn_backend='mosaic' needs block_size >= 8, got block_size={c.block_size}")
        if ready and c.attn_backend == "triton":
            from pallas_kernels._triton_ffi import check_ready
            check_ready()
