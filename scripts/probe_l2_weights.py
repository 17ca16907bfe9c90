"""Do a decode layer's small GEMMs run faster with their weights in L2, and can a kernel in attention's place put
them there? (docs/performance.md, batch-1 step.)

    python scripts/probe_l2_weights.py [JSON]        # H200: ~1 min; CPU: 2 layers in interpret mode

Qwen3-0.6B shapes, 8 rows (the engine's smallest decode bucket), 28 layers of qkv, o_proj, gate_up (+ SwiGLU),
down_proj with residuals, timed per step (microseconds, calls dispatched back to back):
  cold      each layer its own weights (31 MB a layer: as the engine runs)
  warm      every layer layer 0's weights (in L2 after the first)
  prefetch_N  a Pallas kernel of N programs in attention's place reads the layer's o_proj, gate_up and
            down_proj weights (22 MB) before they are used; prefetch_only_N: that kernel alone
  prefetch_next_256  it also reads the next layer's qkv
"""
import functools
import json
import os
import sys

if sys.argv[1:2] in (["-h"], ["--help"]):       # the docstring is the usage
    sys.exit(print(__doc__))

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import time_loop  # noqa: E402

L, E, QKV, Q, I, M = 28, 1024, 4096, 2048, 3072, 8
interp = jax.devices()[0].platform == "cpu"
if interp:
    L = 2


def prefetch_kernel(layer_ref, a_ref, *refs, n_prog, tile, nw):
    w_refs, (a_out, dummy) = refs[:nw], refs[nw:]
    pid = pl.program_id(0)

    @pl.when(pid == 0)
    def _():
        a_out[...] = a_ref[...]
    layer = layer_ref[0]
    acc = jnp.zeros((tile, E), jnp.bfloat16)
    for w in w_refs:
        ntiles = w.shape[1] // tile
        per = -(-ntiles // n_prog)

        def body(i, acc, w=w, ntiles=ntiles, per=per):
            t = jnp.minimum(pid * per + i, ntiles - 1)
            return jnp.maximum(acc, w[layer, pl.ds(t * tile, tile), :])
        acc = jax.lax.fori_loop(0, per, body, acc)
    dummy[pid] = jnp.max(acc.astype(jnp.float32))


def prefetch(a, ws, layer, n_prog=256, tile=8, warps=4):
    return pl.pallas_call(
        functools.partial(prefetch_kernel, n_prog=n_prog, tile=tile, nw=len(ws)), grid=(n_prog,),
        out_shape=(jax.ShapeDtypeStruct(a.shape, a.dtype), jax.ShapeDtypeStruct((n_prog,), jnp.float32)),
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=2), interpret=interp,
        name="l2_prefetch")(jnp.asarray([layer], jnp.int32), a, *ws)


def layer_fn(x, W, l, mode, n_prog=256):
    wqkv, wo, wgu, wd = W
    li = 0 if mode == "warm" else l
    qkv = x @ wqkv[li]
    a = qkv[:, :Q]
    if mode.startswith("prefetch"):
        ws = [wo, wgu.reshape(wgu.shape[0], -1, E), wd]
        if mode == "prefetch_next" and l + 1 < L:
            ws.append(wqkv.reshape(wqkv.shape[0], -1, E)[l + 1:l + 2])  # next layer's qkv (a slice: may copy)
        a, _ = prefetch(a, ws, l, n_prog)
    x = x + a @ wo[li]
    h = x @ wgu[li]
    act = jax.nn.silu(h[:, :I]) * h[:, I:]
    return x + act @ wd[li]


def chain(x, W, mode, n_prog=256):
    for l in range(L):
        x = layer_fn(x, W, l, mode, n_prog)
    return x.astype(jnp.bfloat16) * 0.5


def prefetch_only(x, W, n_prog=256):
    wqkv, wo, wgu, wd = W
    a = jnp.zeros((M, Q), jnp.bfloat16) + x[:, :1]
    for l in range(L):
        a, _ = prefetch(a, [wo, wgu.reshape(wgu.shape[0], -1, E), wd], l, n_prog)
    return (x + a[:, :E] * 0.001).astype(jnp.bfloat16)


k = jax.random.split(jax.random.PRNGKey(0), 5)
W = tuple(jax.random.normal(kk, (L, a, b), jnp.bfloat16) * 0.02 for kk, (a, b) in
          zip(k, [(E, QKV), (Q, E), (E, 2 * I), (I, E)]))
x = jax.random.normal(k[4], (M, E), jnp.bfloat16)
res = {}
for name, fn in [("cold", functools.partial(chain, mode="cold")), ("warm", functools.partial(chain, mode="warm")),
                 ("prefetch_256", functools.partial(chain, mode="prefetch")),
                 ("prefetch_528", functools.partial(chain, mode="prefetch", n_prog=528)),
                 ("prefetch_132", functools.partial(chain, mode="prefetch", n_prog=132)),
                 ("prefetch_only_256", prefetch_only),
                 ("prefetch_only_528", functools.partial(prefetch_only, n_prog=528)),
                 ("prefetch_next_256", functools.partial(chain, mode="prefetch_next"))]:
    try:
        us = time_loop(fn, x, W, est_s=1.0 if interp else 1.5e-5, repeats=5) * 1e6   # 200 calls a round on a GPU
        res[name] = {"us_per_step": us, "us_per_layer": us / L}
    except Exception as e:  # noqa
        res[name] = {"error": repr(e)[:400]}
    print(name, res[name], flush=True)
wb = sum(w[0].size * 2 for w in W)
print("weights per layer MB", wb / 1e6, "at 4.3 TB/s us", wb / 4.3e12 * 1e6)
if len(sys.argv) > 1:
    json.dump(res, open(sys.argv[1], "w"), indent=1)
