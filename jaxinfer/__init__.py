"""jaxinfer: a small, fast LLM inference engine for Qwen3 in JAX."""
from jaxinfer.llm import LLM
from jaxinfer.outputs import RequestOutput
from jaxinfer.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
