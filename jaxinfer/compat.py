"""vLLM `LLM(...)` options that a ported script passes and that mean nothing here, accepted so the script runs:
- trust_remote_code: Qwen3 is built in (no model code is loaded from a checkpoint);
- enforce_eager: vLLM's switch off CUDA graphs; every jaxinfer step is one compiled XLA program;
- disable_log_stats: the engine logs no stats (`llm.stats()` reports them on request);
- swap_space: preempted requests recompute their KV (no CPU swap space).
- max_seq_len_to_capture: vLLM's CUDA-graph capture limit; every jaxinfer step is compiled whole.
Others are accepted with the value that describes what jaxinfer does (FIXED), and refused by name otherwise:
chunked prefill is always on, 20 logprobs at most, Hugging Face tokenizers and safetensors weights only, no
quantisation, text generation only, no pipeline parallelism (tensor and data parallelism instead).
`tokenizer` (a folder) is used: the tokenizer is loaded from it instead of the model's folder.
"""
from __future__ import annotations

import numbers
import os

IGNORED = {"trust_remote_code": bool, "enforce_eager": bool, "disable_log_stats": bool, "swap_space": (int, float),
           "max_seq_len_to_capture": int}
FIXED = {"enable_chunked_prefill": (True, None), "max_logprobs": (20, None), "tokenizer_mode": ("auto", "hf", None),
         "load_format": ("auto", "safetensors", None), "quantization": (None,), "skip_tokenizer_init": (False, None),
         "task": ("auto", "generate", None), "pipeline_parallel_size": (1, None)}


def pop_vllm_options(kwargs: dict) -> str | None:
    """Remove the options above from `kwargs` (checking their types); returns the `tokenizer` folder or None."""
    for name, typ in IGNORED.items():
        if name in kwargs:
            v = kwargs.pop(name)
            if not isinstance(v, typ) or (typ is not bool and isinstance(v, bool)):
                raise ValueError(f"{name}={v!r} must be a {getattr(typ, '__name__', 'number')}")
    for name, ok in FIXED.items():
        if name in kwargs:
            v = kwargs.pop(name)
            if not any(v == o and type(v) is type(o) for o in ok):
                took = " or ".join(repr(o) for o in ok if o is not None)
                raise ValueError(f"{name}={v!r:.80} is not supported: jaxinfer takes " +
                                 (f"{name}={took} (or leave it out)" if took else f"no {name} (leave it out)"))
    tok = kwargs.pop("tokenizer", None)
    tok = os.path.expanduser(tok) if isinstance(tok, str) else tok
    if tok is not None and not (isinstance(tok, str) and os.path.isdir(tok)):
        raise ValueError(f"tokenizer={tok!r} must be a folder holding a Hugging Face tokenizer")
    return tok


def python_numbers(kwargs: dict) -> dict:
    """Engine options with numpy integers / floats (np.int64(8), np.float32(0.5)) as Python's."""
    def plain(v):
        if isinstance(v, bool) or isinstance(v, (int, float)) and type(v) in (int, float):
            return v
        return int(v) if isinstance(v, numbers.Integral) else float(v) if isinstance(v, numbers.Real) else v
    return {k: plain(v) for k, v in kwargs.items()}
