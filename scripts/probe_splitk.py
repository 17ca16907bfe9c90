"""Qwen3-0.6B's decode GEMMs at 64-256 rows: XLA's dot against the inner dimension cut into s slices (a batched
dot whose fp32 partial sums are added in the next fusion; tried in the engine for o_proj / down_proj at 64-256
rows and not kept: docs/performance.md, eleventh run).

    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python scripts/probe_splitk.py [JSON]    # H200: ~40 s
    python scripts/probe_splitk.py                          # CPU: 2 layers, a check of the script only

one: each GEMM alone, 28 layers of it (each layer its own weights), us per GEMM, for s = 1, 2, 4, 8.
layer: a layer's chain (qkv, o_proj, gate_up + SwiGLU, down_proj, residuals) with per-GEMM split counts
(qkv, o_proj, gate_up, down), us per layer. (The engine's steps compile without XLA's Triton GEMMs, hence the flag.)
"""
import functools
import json
import os
import sys

if sys.argv[1:2] in (["-h"], ["--help"]):       # the docstring is the usage
    sys.exit(print(__doc__))

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import time_loop  # noqa: E402

L = 28 if jax.devices()[0].platform == "gpu" else 2
EST = 3e-5 if L == 28 else 1.0     # seconds a call, as time_loop's estimate: 100 calls a round on a GPU
SHAPES = {"qkv": (1024, 4096), "o_proj": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024)}


def mm(x, w, s):
    E, N = w.shape
    if s == 1:
        return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    parts = jnp.einsum("mse,sen->smn", x.reshape(x.shape[0], s, E // s), w.reshape(s, E // s, N),
                       preferred_element_type=jnp.float32)
    return jnp.sum(parts, axis=0).astype(x.dtype)


def chain_one(x, W, s):       # one GEMM shape, L times (each its own weights), output folded back to x's width
    for l in range(L):
        y = mm(x, W[l], s)
        x = (x + y[:, :x.shape[1]] * 0.01).astype(x.dtype) if y.shape[1] >= x.shape[1] else \
            (x + jnp.tile(y, (1, x.shape[1] // y.shape[1])) * 0.01).astype(x.dtype)
    return x


def layer_chain(x, Ws, ss):
    wqkv, wo, wgu, wd = Ws
    for l in range(L):
        qkv = mm(x, wqkv[l], ss[0])
        x = x + mm(qkv[:, :2048], wo[l], ss[1])
        h = mm(x, wgu[l], ss[2])
        x = x + mm(jax.nn.silu(h[:, :3072]) * h[:, 3072:], wd[l], ss[3])
    return x


key = jax.random.PRNGKey(0)
Ws = {n: jax.random.normal(jax.random.fold_in(key, i), (L, E, N), jnp.bfloat16) * 0.02
      for i, (n, (E, N)) in enumerate(SHAPES.items())}
res = {"one": [], "layer": []}
for M in (256, 128, 64):
    x0 = {n: jax.random.normal(key, (M, E), jnp.bfloat16) for n, (E, N) in SHAPES.items()}
    for n, (E, N) in SHAPES.items():
        for s in (1, 2, 4, 8):
            us = time_loop(functools.partial(chain_one, s=s), x0[n], Ws[n], est_s=EST, repeats=5) * 1e6 / L
            res["one"].append(dict(M=M, gemm=n, s=s, us=us, tflops=2 * M * E * N / us / 1e6, tbps=E * N * 2 / us / 1e6))
            print(res["one"][-1], flush=True)
    xl = jax.random.normal(key, (M, 1024), jnp.bfloat16)
    for ss in ((1, 1, 1, 1), (2, 8, 1, 8), (1, 4, 1, 4), (2, 4, 2, 4), (1, 8, 1, 8)):
        us = time_loop(functools.partial(layer_chain, ss=ss), xl, tuple(Ws.values()), est_s=EST, repeats=5) * 1e6 / L
        res["layer"].append(dict(M=M, splits=ss, us_per_layer=us))
        print(res["layer"][-1], flush=True)
if len(sys.argv) > 1:
    json.dump(res, open(sys.argv[1], "w"), indent=1)
