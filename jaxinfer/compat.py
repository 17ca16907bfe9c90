"""vLLM `LLM(...)` options that a ported script passes and that mean nothing here, accepted so the script runs:
- trust_remote_code: Qwen3 is built in (no model code is loaded from a checkpoint);
- enforce_eager: vLLM's switch off CUDA graphs; every jaxinfer step is one compiled XLA program;
- disable_log_stats: the engine logs no stats (`llm.stats()` reports them on request);
- swap_space: preempted requests recompute their KV (no CPU swap space).
- max_seq_len_to_capture: vLLM's CUDA-graph capture limit; every jaxinfer step is compiled whole.
- compilation_config: vLLM's torch.compile / CUDA-graph settings; XLA compiles every step, with its own options.
- disable_custom_all_reduce: tensor parallelism's all-reduces are XLA's (NCCL), never a custom kernel.
- served_model_name: the name the server answers to (`jaxinfer serve --served-model-name`); offline it names nothing.
Others are accepted with the value that describes what jaxinfer does (FIXED), and refused by name otherwise:
chunked prefill is always on, 20 logprobs at most, Hugging Face tokenizers and safetensors weights only, no
quantisation, text generation only, no pipeline parallelism (tensor and data parallelism instead), logprobs
of the raw logits (vLLM's raw_logprobs), no CPU offload, the tokenizer of the model's revision, first come first
served, and every device driven from this one process (distributed_executor_backend "mp", "uni" or
"external_launcher" are taken to mean that: no Ray); vLLM features jaxinfer lacks (speculative decoding, KV
transfer, sleep mode, multimodal inputs, LoRA, ...) are accepted at their off values. (calculate_kv_scales is an
engine option: EngineConfig.)
`tokenizer` (a folder) is used: the tokenizer is loaded from it instead of the model's folder; and
`skip_tokenizer_init=True`: no tokenizer (tokenizer.NoTokenizer: token-id prompts, outputs without text).
"""
from __future__ import annotations

import numbers
import os

import numpy as np

IGNORED = {"trust_remote_code": bool, "enforce_eager": bool, "disable_log_stats": bool, "swap_space": (int, float),
           "max_seq_len_to_capture": int, "compilation_config": (int, dict), "disable_custom_all_reduce": bool,
           "max_lora_rank": int, "max_loras": int,          # (LoRA's sizes: no LoRA here, enable_lora=False)
           "served_model_name": (str, list), "disable_cascade_attn": bool, "disable_async_output_proc": bool,
           "use_v2_block_manager": bool, "max_context_len_to_capture": int, "guided_decoding_backend": str}
FIXED = {"enable_chunked_prefill": (True, None), "tokenizer_mode": ("auto", "hf", None),
         "load_format": ("auto", "safetensors", None), "quantization": (None,), "task": ("auto", "generate", None),
         "skip_tokenizer_init": (False, True, None), "pipeline_parallel_size": (1, None),
         "runner": ("auto", "generate", None), "convert": ("auto", "none", None),      # (vLLM's names for task)
         "cpu_offload_gb": (0, 0.0, None), "tokenizer_revision": (None,), "logprobs_mode": ("raw_logprobs", None),
         "enable_lora": (False, None), "scheduling_policy": ("fcfs", None),
         "distributed_executor_backend": ("mp", "uni", "external_launcher", None),
         # vLLM EngineArgs a ported script may pass at their defaults (features jaxinfer does not have: any other
         # value is refused by name)
         **{name: (None,) for name in ("speculative_config", "kv_transfer_config", "kv_events_config",
                                       "limit_mm_per_prompt", "mm_processor_kwargs", "kv_cache_memory_bytes",
                                       "logits_processors", "code_revision", "cuda_graph_sizes",
                                       "structured_outputs_config", "max_cpu_loras", "rope_scaling", "rope_theta",
                                       "tokenizer_pool_size")},
         **{name: (False, None) for name in ("enable_sleep_mode", "enable_prompt_embeds", "disable_sliding_window",
                                             "enable_expert_parallel", "fully_sharded_loras",
                                             "kv_sharing_fast_prefill")},
         "model_impl": ("auto", None), "config_format": ("auto", "hf", None), "max_num_partial_prefills": (1, None),
         "long_prefill_token_threshold": (0, None), "allowed_local_media_path": ("", None),
         "num_lookahead_slots": (0, None), "preemption_mode": ("recompute", None)}


def pop_vllm_options(kwargs: dict):
    """Remove the options above from `kwargs` (checking their types); returns the `tokenizer` folder, None, or a
    NoTokenizer with skip_tokenizer_init=True (vLLM's: no tokenizer, token-id prompts)."""
    skip = kwargs.get("skip_tokenizer_init") is True
    for name, typ in IGNORED.items():
        if name in kwargs:
            v = kwargs.pop(name)
            if v is not None and (not isinstance(v, typ) or (typ is not bool and isinstance(v, bool))):
                what = " or ".join(t.__name__ for t in typ) if isinstance(typ, tuple) else typ.__name__
                raise ValueError(f"{name}={v!r} must be a {what}")
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not v >= 0:    # (sizes: vLLM's too)
                raise ValueError(f"{name}={v!r} must be >= 0")
    for name, ok in FIXED.items():
        if name in kwargs:
            v = kwargs.pop(name)
            if not any(v == o and type(v) is type(o) for o in ok):
                took = " or ".join(repr(o) for o in ok if o is not None)
                raise ValueError(f"{name}={v!r:.80} is not supported: jaxinfer takes " +
                                 (f"{name}={took} (or leave it out)" if took else f"no {name} (leave it out)"))
    tok = kwargs.pop("tokenizer", None)
    if skip:
        from jaxinfer.tokenizer import NoTokenizer
        return NoTokenizer()
    tok = os.path.expanduser(tok) if isinstance(tok, str) else tok
    if tok is not None and not (isinstance(tok, str) and os.path.isdir(tok)):
        raise ValueError(f"tokenizer={tok!r} must be a folder holding a Hugging Face tokenizer")
    return tok


def python_numbers(kwargs: dict) -> dict:
    """Engine options with numpy integers / floats / bools (np.int64(8), np.float32(0.5), np.True_), also inside
    lists (bucket lists), as Python's."""
    def plain(v):
        if isinstance(v, bool) or isinstance(v, (int, float)) and type(v) in (int, float):
            return v
        if isinstance(v, np.bool_):
            return bool(v)
        if isinstance(v, (list, tuple)):
            return type(v)(plain(x) for x in v)
        return int(v) if isinstance(v, numbers.Integral) else float(v) if isinstance(v, numbers.Real) else v
    return {k: plain(v) for k, v in kwargs.items()}


# Other names of engine options -> ours: nano-vllm's block size, vLLM's num_gpu_blocks_override
ALIASES = {"kvcache_block_size": "block_size", "num_gpu_blocks_override": "num_kvcache_blocks"}
# Options whose None means their default (vLLM's EngineArgs types them `X | None = None`)
NONE_IS_DEFAULT = ("block_size", "enable_prefix_caching", "async_scheduling", "gpu_memory_utilization",
                   "kv_cache_dtype", "calculate_kv_scales", "tensor_parallel_size", "data_parallel_size",
                   "max_logprobs")


def engine_names(kwargs: dict) -> dict:
    """Engine options under our names: ALIASES renamed (both given: a ValueError), None dropped where it means
    the default, max_model_len -1 or "auto" (vLLM's and the CLI's "as long as the pool holds") as None."""
    kwargs = dict(kwargs)
    for old, new in ALIASES.items():
        if kwargs.get(old) is not None:
            if kwargs.get(new) is not None:
                raise ValueError(f"give {new}= or {old}=, not both")
            kwargs[new] = kwargs.pop(old)
        kwargs.pop(old, None)                         # (None: as not given)
    kwargs = {k: v for k, v in kwargs.items() if v is not None or k not in NONE_IS_DEFAULT}
    if kwargs.get("max_model_len") in (-1, "auto"):
        kwargs["max_model_len"] = None
    from jaxinfer.config import EngineConfig
    from jaxinfer.sampling_params import SamplingParams
    if per_request := sorted(set(kwargs) & set(SamplingParams.__dataclass_fields__) - set(
            EngineConfig.__dataclass_fields__)):         # (LLM(model, max_tokens=64): a sampling setting)
        raise ValueError(f"{per_request[0]}={kwargs[per_request[0]]!r:.80} is not an engine option but a sampling "
                         f"one: llm.generate(prompts, SamplingParams({per_request[0]}=...))")
    return kwargs



def _pooling(name: str):
    def refused(self, *args, **kwargs):
        raise ValueError(f"LLM.{name}() needs a pooling model (embedding, classification, scoring); jaxinfer runs "
                         "generative Qwen3 models only: use generate(), chat() or beam_search()")
    refused.__name__ = name
    return refused


class PoolingRefused:
    """vLLM's pooling methods on `LLM`: a generative model answers them with a ValueError (as vLLM's does)."""
    encode, embed, classify, score, reward = map(_pooling, ("encode", "embed", "classify", "score", "reward"))


def _engine_control(name: str, why: str):
    def refused(self, *args, **kwargs):
        raise NotImplementedError(f"LLM.{name}() is not supported by jaxinfer: {why}")
    refused.__name__ = name
    return refused


class EngineControlRefused:
    """vLLM `LLM` methods that drive its GPU workers or swap its parts: refused by name (not an AttributeError)."""
    sleep = _engine_control("sleep", "the weights and the KV pool stay on the device (reset_prefix_cache() forgets "
                                     "cached KV)")
    wake_up = _engine_control("wake_up", "there is no sleep mode")
    collective_rpc = _engine_control("collective_rpc", "one process drives every device; there are no workers")
    apply_model = _engine_control("apply_model", "the model is a JAX function, not a torch module on workers")
    set_tokenizer = _engine_control("set_tokenizer", "give LLM(model, tokenizer=FOLDER) instead")
    get_metrics = _engine_control("get_metrics", "llm.stats() gives the engine's numbers as a dict")
