"""vLLM's `LLM.start_profile()` / `LLM.stop_profile()`: JAX's profiler records what runs in between (the XLA fusions,
the Pallas kernels, the host's calls) into a folder for TensorBoard's profile plugin / xprof or Perfetto (the
`*.trace.json.gz` beside the `*.xplane.pb`): how a step's time splits between XLA's fusions and the hand kernels.

The folder is $JAXINFER_PROFILER_DIR, or vLLM's $VLLM_TORCH_PROFILER_DIR (read when the profile starts; neither set:
a RuntimeError, as vLLM's "profiler is not enabled"); `profile_prefix` names a subfolder. A trace under way while
another starts is JAX's RuntimeError. (A profiled run is slower: XLA launches kernels one by one instead of as
CUDA graphs while a profiler is attached; time kernels from it, not the wall.)
"""
from __future__ import annotations

import os

ENV = ("JAXINFER_PROFILER_DIR", "VLLM_TORCH_PROFILER_DIR")


def start_profile(llm, profile_prefix: str | None = None) -> str:
    """Start JAX's trace; returns the folder it is written to."""
    import jax
    root = next((os.environ[k] for k in ENV if os.environ.get(k)), None)
    if root is None:
        raise RuntimeError(f"the profiler is not enabled: set {ENV[0]} (or vLLM's {ENV[1]}) to the folder for the "
                           f"trace before start_profile()")
    if profile_prefix is not None and (not isinstance(profile_prefix, str) or os.sep in profile_prefix
                                       or profile_prefix in ("", ".", "..")):
        raise ValueError(f"profile_prefix must be a plain folder name, got {profile_prefix!r:.80}")
    folder = os.path.join(os.path.expanduser(root), profile_prefix or "")
    jax.profiler.start_trace(folder)
    return folder


def stop_profile(llm) -> None:
    """End the trace started by start_profile and write it."""
    import jax
    jax.profiler.stop_trace()
