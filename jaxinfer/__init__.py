"""jaxinfer: a small, fast LLM inference engine for Qwen3 in JAX."""
import os as _os

# XLA's Triton GEMM autotuning made start-up compile ~30 s per bucket on the H200; cuBLAS GEMMs compile in
# a fraction of that. Set XLA_FLAGS yourself (with xla_gpu_enable_triton_gemm) to choose otherwise.
if "xla_gpu_enable_triton_gemm" not in _os.environ.get("XLA_FLAGS", ""):
    _os.environ["XLA_FLAGS"] = (_os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_triton_gemm=false").strip()
from jaxinfer.llm import LLM
from jaxinfer.outputs import RequestOutput
from jaxinfer.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
