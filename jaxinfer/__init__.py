"""jaxinfer: a small, fast LLM inference engine for Qwen3 in JAX.

Importing it changes nothing in the process: XLA options go to each compiled step (see xla_options.py), and
JAX itself (which sets a few variables of its own when imported) loads only when `LLM` or another name is
first used.
"""
import importlib

_EXPORTS = {"LLM": "jaxinfer.llm", "SamplingParams": "jaxinfer.sampling_params",
            "RequestOutput": "jaxinfer.outputs", "CompletionOutput": "jaxinfer.outputs",
            "TextPrompt": "jaxinfer.prompts", "TokensPrompt": "jaxinfer.prompts",
            "EngineConfig": "jaxinfer.config", "LLMEngine": "jaxinfer.engine_api", "EngineArgs": "jaxinfer.engine_api",
            "AsyncLLMEngine": "jaxinfer.async_engine", "AsyncEngineArgs": "jaxinfer.async_engine",
            "StructuredOutputsParams": "jaxinfer.sampling_params", "BeamSearchParams": "jaxinfer.beam_search",
            "RequestOutputKind": "jaxinfer.outputs"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name == "__version__":                   # (vLLM's vllm.__version__; the installed package's)
        try:
            return importlib.import_module("importlib.metadata").version("jaxinfer")
        except Exception:
            return "0+unknown"
    raise AttributeError(f"module 'jaxinfer' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__ + ["__version__"])
