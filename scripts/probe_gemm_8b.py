"""Qwen3-8B's decode GEMMs at 64-256 rows under XLA's GEMM choices: cuBLAS (the engine's steps), XLA's Triton
GEMMs (autotuned tiles, split-K), cuBLASLt, and the product computed transposed (W^T x^T, so cuBLAS sees the
weight's width as its M). docs/performance.md: at 256 rows the 8B qkv and o_proj GEMMs ran at ~356 TFLOP/s on
cuBLAS' 128x64 tiles against gate_up's 667.

    python scripts/probe_gemm_8b.py [JSON]        # H200: ~2 min; CPU: 2 layers at small sizes, a check of the script

Each GEMM runs L times in one program (each layer its own weights), us per GEMM and TFLOP/s.
"""
import json
import os
import statistics
import sys
import time

if sys.argv[1:2] in (["-h"], ["--help"]):       # the docstring is the usage
    sys.exit(print(__doc__))

import jax
import jax.numpy as jnp

GPU = jax.devices()[0].platform == "gpu"
L = 8 if GPU else 2
SHAPES = {"qkv": (4096, 6144), "o_proj": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096)}
if not GPU:
    SHAPES = {n: (E // 64, N // 64) for n, (E, N) in SHAPES.items()}
OPTIONS = {"cublas": {"xla_gpu_enable_triton_gemm": False},
           "triton": {"xla_gpu_enable_triton_gemm": True},
           "cublaslt": {"xla_gpu_enable_triton_gemm": False, "xla_gpu_enable_cublaslt": True}}


def chain(x, W, transposed):
    for l in range(L):
        if transposed:
            y = jnp.einsum("en,me->nm", W[l], x, preferred_element_type=jnp.float32).T.astype(x.dtype)
        else:
            y = jnp.dot(x, W[l], preferred_element_type=jnp.float32).astype(x.dtype)
        x = (x + jnp.tile(y, (1, -(-x.shape[1] // y.shape[1])))[:, :x.shape[1]] * 0.01).astype(x.dtype)
    return x


def time_exe(exe, x, W, n=20, repeats=5):
    x = jax.block_until_ready(exe(x, W))
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            x = exe(x, W)
        jax.block_until_ready(x)
        out.append((time.perf_counter() - t0) / n)
    return statistics.median(out)


def main():
    key = jax.random.PRNGKey(0)
    rows = []
    for name, (E, N) in SHAPES.items():
        W = jax.random.normal(jax.random.fold_in(key, E + N), (L, E, N), jnp.bfloat16) * 0.02
        for M in ((256, 128, 64) if GPU else (8,)):
            x = jax.random.normal(key, (M, E), jnp.bfloat16)
            for opt, options in OPTIONS.items():
                if not GPU and opt != "cublas":
                    continue
                for transposed in (False, True):
                    f = jax.jit(lambda x, W, t=transposed: chain(x, W, t))
                    exe = f.lower(x, W).compile(compiler_options=options if GPU else {})
                    s = time_exe(exe, x, W) / L
                    rows.append(dict(gemm=name, M=M, options=opt, transposed=transposed, us=s * 1e6,
                                     tflops=2 * M * E * N / s / 1e12, tbps=E * N * 2 / s / 1e12))
                    print(rows[-1], flush=True)
        del W
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
