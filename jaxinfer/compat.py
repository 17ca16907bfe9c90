"""vLLM `LLM(...)` options that a ported script passes and that mean nothing here, accepted so the script runs:
- trust_remote_code: Qwen3 is built in (no model code is loaded from a checkpoint);
- enforce_eager: vLLM's switch off CUDA graphs; every jaxinfer step is one compiled XLA program;
- disable_log_stats: the engine logs no stats (`llm.stats()` reports them on request);
- swap_space: preempted requests recompute their KV (no CPU swap space).
`tokenizer` (a folder) is used: the tokenizer is loaded from it instead of the model's folder.
"""
from __future__ import annotations

import os

IGNORED = {"trust_remote_code": bool, "enforce_eager": bool, "disable_log_stats": bool, "swap_space": (int, float)}


def pop_vllm_options(kwargs: dict) -> str | None:
    """Remove the options above from `kwargs` (checking their types); returns the `tokenizer` folder or None."""
    for name, typ in IGNORED.items():
        if name in kwargs:
            v = kwargs.pop(name)
            if not isinstance(v, typ) or (typ is not bool and isinstance(v, bool)):
                raise ValueError(f"{name}={v!r} must be a {getattr(typ, '__name__', 'number')}")
    tok = kwargs.pop("tokenizer", None)
    if tok is not None and not (isinstance(tok, str) and os.path.isdir(tok)):
        raise ValueError(f"tokenizer={tok!r} must be a folder holding a Hugging Face tokenizer")
    return tok
