"""XLA options the engine wants, without touching the user's process.

Two kinds:
- per compile (`step_compiler_options`): passed to each step's `.compile(compiler_options=...)`, so they
  reach our executables only, never a user's own JAX code;
- per process (`command_buffer_flags`): XLA's SKIP_TEMP command-buffer update mode. It is read from
  XLA_FLAGS when JAX starts its GPU client (it also changes the allocator), so no per-compile option can
  give it. The `jaxinfer` commands own their process and set it before JAX starts
  (`set_process_flags`); a Python user adds one line before importing jax, and `LLM()` says so once
  (`warn_if_slow_command_buffers`) when it runs without it.
The same programs, asked for attn_backend="triton", also put triton's own `ptxas` on PATH when there is none
(`use_triton_ptxas`): jaxlib runs it to load jax-triton kernels.
"""
from __future__ import annotations

import os
import warnings
from importlib.metadata import PackageNotFoundError, version

SKIP_TEMP = "--xla_gpu_command_buffer_update_mode=SKIP_TEMP"
ENABLE_LINE = f'os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " {SKIP_TEMP}"'
_warned = False


# XLA passes no step needs. "rematerialization" tries to fit a program in 75% of the GPU's memory by recomputing
# values. A step's operands include the KV pool, which the engine sizes to most of that memory (donated, updated
# in place), so the pass cannot succeed: on the H200 it printed "Can't reduce memory use below 109.72GiB ...; only
# reduced to 271.45GiB" 14 times at start-up, and W's warm-up took 22.3 s (141 s of compile time summed) against
# 19.7 s (112 s) without it, the same tokens/s (docs/performance.md, twentieth run).
DISABLED_PASSES = ("rematerialization",)
EXTRA_OPTIONS: dict = {}   # more per-compile options, for A/Bs (scripts/bench_with.py); none by default


def step_compiler_options(platform: str, num_devices: int = 1) -> dict:
    """Options for every compiled step.
    - XLA's Triton GEMM autotuning made start-up compile ~30 s per bucket on the H200; cuBLAS GEMMs compile in
      a fraction of that and ran as fast at W's batch sizes. In small decode programs they cut a batch-8 step's
      GPU time by 7%, yet batch-1 TPOT through `LLM()` was 1.70 ms against 1.37 with cuBLAS and warm-up 91 s
      against 21 s (docs/performance.md, seventeenth run), so they are off everywhere.
    - A tensor-parallel step: each all-reduce ends a CUDA graph, and XLA leaves runs shorter than 5 ops (the
      MLP between two all-reduces) outside any graph, launching them one by one. With every run in a graph,
      Qwen3-0.6B at tp=2 (128 rows) took 4.05 ms a step instead of 5.7 on 2 H200s (scripts/probe_dispatch.py,
      docs/performance.md)."""
    if platform != "gpu":
        return {}
    opts = {"xla_gpu_enable_triton_gemm": False}
    if DISABLED_PASSES:
        opts["xla_disable_hlo_passes"] = ",".join(DISABLED_PASSES)
    if num_devices > 1:
        opts["xla_gpu_graph_min_graph_size"] = 1
    return {**opts, **EXTRA_OPTIONS}


def jaxlib_minor() -> tuple[int, int]:
    """(major, minor) of the installed jaxlib, read without starting a JAX backend."""
    try:
        major, minor = version("jaxlib").split(".")[:2]
        return int(major), int(minor)
    except (PackageNotFoundError, ValueError):
        return 0, 0


def wants_skip_temp(env: dict | None = None) -> bool:
    """Whether the SKIP_TEMP mode should be added: on jaxlib 0.11.x (where it was measured: dispatch no longer
    waits for the previous step's CUDA graph, +4% on the benchmark; other versions name the modes
    differently) and not already chosen in XLA_FLAGS."""
    env = os.environ if env is None else env
    return jaxlib_minor() == (0, 11) and "command_buffer_update_mode" not in env.get("XLA_FLAGS", "")


def command_buffer_flags(env: dict | None = None) -> str:
    """XLA_FLAGS with the fast command-buffer mode added where it applies (unchanged otherwise)."""
    env = os.environ if env is None else env
    flags = env.get("XLA_FLAGS", "")
    return f"{flags} {SKIP_TEMP}".strip() if wants_skip_temp(env) else flags


def use_triton_ptxas(env: dict | None = None) -> str | None:
    """For programs that own their process and run attn_backend="triton": jaxlib loads jax-triton kernels by
    running a `ptxas` program; when none is on PATH, put the one triton ships (triton/backends/nvidia/bin) there.
    Returns the folder added, or None (one was there, or triton is not installed). Python users get a
    ValueError naming that folder from `LLM()` instead (pallas_kernels/_triton_ffi.check_ptxas)."""
    from pallas_kernels._triton_ffi import bundled_ptxas_dir
    env = os.environ if env is None else env
    path = env.get("PATH", "")
    if any(os.access(os.path.join(d, "ptxas"), os.X_OK) for d in path.split(os.pathsep) if d):
        return None
    bundled = bundled_ptxas_dir()
    if bundled is not None:
        env["PATH"] = bundled + (os.pathsep + path if path else "")
    return bundled


def set_process_flags() -> None:
    """For programs that own their process (the `jaxinfer` commands, a serving core): call before JAX starts.
    Also silences JAX's (once a process) note that the Pallas Triton backend is deprecated: it still runs through
    JAX 0.12, and docs/kernels.md says what replaces it; and transformers' advice, printed on import where torch is
    not installed, that its models are unavailable (jaxinfer uses only its tokenizers)."""
    os.environ["XLA_FLAGS"] = command_buffer_flags()
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    warnings.filterwarnings("ignore", message=".*Triton.*deprecated.*")


def warn_if_slow_command_buffers() -> None:
    """Say once per process that `LLM()` runs without the SKIP_TEMP mode, and the line that turns it on."""
    global _warned
    import jax
    if _warned or jax.default_backend() != "gpu" or not wants_skip_temp():
        return
    _warned = True
    warnings.warn("jaxinfer: XLA's SKIP_TEMP command-buffer mode is off, so each step's dispatch waits for the "
                  "previous one (about 4% slower on an H200). `jaxinfer` commands turn it on; in Python add, "
                  f"before importing jax:  import os; {ENABLE_LINE}", stacklevel=3)
