"""Probe: a decode layer's whole MLP (RMSNorm, gate_up, silu(gate) * up, down) as ONE Pallas kernel, against XLA.

    python scripts/probe_fused_mlp.py [--rows 1,8,16] [--json PATH]      # H200: ~2-3 minutes with compiles
    python scripts/probe_fused_mlp.py --smoke                            # CPU: interpret mode, correctness only

Why: a batch-1 decode step runs ~290 kernels of which the MLP is four a layer (RMSNorm fusion, gate_up GEMM,
silu * up fusion, down GEMM + residual), ~14 us a layer for 19 MB of weights (~1.4 TB/s). Each kernel pays a
launch, a ramp-up and a tail; the kernels cannot stream their small weights faster one by one. This kernel does
the four in one launch: program p owns intermediate columns [p*T, (p+1)*T), computes them from the whole input
row (the RMSNorm folded in as (x * g) @ W times 1/rms at the end), and multiplies them by its T rows of down_proj,
writing an fp32 partial [P, M, E]; the partials are summed (with the residual) by the XLA fusion that follows.
So every weight byte is read once, by ~I/T programs at once, and the layer's MLP is two kernels instead of four.

Measured on the H200 (docs/performance.md, twenty-second run): 15.5 us a layer against XLA's 28.4 in this chain at
one row, yet wired into the engine's decode steps of up to 8 rows it made batch-1 TPOT 1.38 / 1.46 ms against
1.34 / 1.33 without it (batch 8: 1.58 / 1.56). This chain's XLA form runs more kernels than the model's, whose
MLP takes ~14 us of kernel time a layer; so the kernel is not in the engine.

Timed: a chain of L layers' MLPs (h = h + MLP_l(h)) in one jitted call dispatched back to back, XLA's form as the
model runs it against the fused kernel per tile choice; us per layer and GB/s of weights; max error against XLA.
`--layout blocked` also times weights pre-arranged so each program's gate / up columns are contiguous.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plt  # noqa: E402

HBM = 4.3e12


def _mlp_kernel(layer_ref, x_ref, g_ref, wgu_ref, wd_ref, o_ref, *, rows, T, block_k, block_e, inter, eps, blocked):
    p = pl.program_id(0)
    M, E = x_ref.shape
    layer = layer_ref[0]
    r = jnp.minimum(jnp.arange(rows), M - 1)             # padding rows repeat the last real row

    def w_cols(k0, gate):
        if blocked:    # wgu [L, P, E, 2T]: this program's gate | up columns, contiguous
            return wgu_ref[layer, p, pl.ds(k0, block_k), pl.ds(0 if gate else T, T)]
        return wgu_ref[layer, pl.ds(k0, block_k), pl.ds((0 if gate else inter) + p * T, T)]

    def body(i, carry):
        ag, au, ss = carry
        k0 = i * block_k
        x = x_ref[r[:, None], k0 + jnp.arange(block_k)[None, :]].astype(jnp.float32)   # [rows, BK]
        ss = ss + jnp.sum(x * x, axis=1)
        xg = (x * g_ref[layer, pl.ds(k0, block_k)].astype(jnp.float32)[None, :]).astype(wgu_ref.dtype)
        ag = ag + plt.dot(xg, w_cols(k0, True))
        au = au + plt.dot(xg, w_cols(k0, False))
        return ag, au, ss

    z = jnp.zeros((rows, T), jnp.float32)
    ag, au, ss = jax.lax.fori_loop(0, E // block_k, body, (z, z, jnp.zeros((rows,), jnp.float32)))
    inv = jax.lax.rsqrt(ss / E + eps)[:, None]
    ag, au = ag * inv, au * inv
    a = (ag / (1.0 + jnp.exp(-ag)) * au).astype(wd_ref.dtype)        # [rows, T] silu(gate) * up

    def down(j, _):
        e0 = j * block_e
        part = plt.dot(a, wd_ref[layer, pl.ds(p * T, T), pl.ds(e0, block_e)])     # [rows, BE] fp32
        o_ref[p, r[:, None], e0 + jnp.arange(block_e)[None, :]] = part
        return 0

    jax.lax.fori_loop(0, E // block_e, down, 0)


@functools.partial(jax.jit, static_argnames=("T", "block_k", "block_e", "num_warps", "num_stages", "eps", "blocked",
                                             "interpret"))
def fused_mlp_partials(x, layer, g, wgu, wd, *, T, block_k, block_e, num_warps, num_stages, eps, blocked, interpret):
    """x [M, E] -> fp32 partials [I / T, M, E] whose sum over axis 0 is down(silu(gate) * up)(RMSNorm(x))."""
    M, E = x.shape
    inter = wd.shape[1]
    P = inter // T
    kernel = functools.partial(_mlp_kernel, rows=max(16, 1 << (M - 1).bit_length()), T=T, block_k=block_k,
                               block_e=block_e, inter=inter, eps=eps, blocked=blocked)
    return pl.pallas_call(
        kernel, grid=(P,), out_shape=jax.ShapeDtypeStruct((P, M, E), jnp.float32),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="fused_mlp")(layer, x, g, wgu, wd)


def block_weights(wgu, T):
    """[L, E, 2I] -> [L, I/T, E, 2T]: program p's gate columns then its up columns, contiguous."""
    L, E, two_i = wgu.shape
    inter = two_i // 2
    gate = wgu[..., :inter].reshape(L, E, inter // T, T)
    up = wgu[..., inter:].reshape(L, E, inter // T, T)
    return jnp.concatenate([gate, up], axis=-1).transpose(0, 2, 1, 3)


def chain_xla(h, g, wgu, wd, eps):
    for l in range(wgu.shape[0]):
        x = h.astype(jnp.float32)
        x = (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * g[l].astype(jnp.float32))
        gu = jnp.dot(x.astype(h.dtype), wgu[l], preferred_element_type=jnp.float32)
        gate, up = jnp.split(gu, 2, axis=-1)
        a = (jax.nn.silu(gate) * up).astype(h.dtype)
        h = (h.astype(jnp.float32) + jnp.dot(a, wd[l], preferred_element_type=jnp.float32)).astype(h.dtype)
    return h


def chain_fused(h, g, wgu, wd, eps, tiles, interpret):
    for l in range(wd.shape[0]):
        parts = fused_mlp_partials(h, jnp.full((1,), l, jnp.int32), g, wgu, wd, eps=eps, interpret=interpret,
                                   **tiles)
        h = (h.astype(jnp.float32) + parts.sum(axis=0)).astype(h.dtype)
    return h


def write_json(path, res) -> None:
    from bench import write_json as write
    write(path, res)


def time_chain(fn, h, iters):
    from bench_small_batch import timed
    return timed(fn, (h,), iters, carry={0: None})


def sweep(a) -> list[dict]:
    out = [dict(T=T, block_k=bk, block_e=be, num_warps=w, num_stages=s, blocked=bl)
           for T in a.T for bk in (128, 256) for be in (256,) for w in (2, 4) for s in (3,)
           for bl in ((False, True) if a.layout == "both" else (a.layout == "blocked",))]
    return out[: a.max_tiles]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--T", type=lambda s: [int(v) for v in s.split(",")], default=[16, 32, 64])
    ap.add_argument("--layout", choices=("strided", "blocked", "both"), default="both")
    ap.add_argument("--max-tiles", type=int, default=200)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    interpret = a.smoke
    if a.smoke:
        a.layers, a.hidden, a.intermediate, a.rows, a.T, a.max_tiles = 2, 256, 512, "1,3", [32], 2
    L, E, inter, eps = a.layers, a.hidden, a.intermediate, 1e-6
    dt = jnp.float32 if a.smoke else jnp.bfloat16
    k = jax.random.split(jax.random.key(0), 4)
    g = (1 + 0.1 * jax.random.normal(k[0], (L, E))).astype(dt)
    wgu = (jax.random.normal(k[1], (L, E, 2 * inter)) * E ** -0.5).astype(dt)
    wd = (jax.random.normal(k[2], (L, inter, E)) * inter ** -0.5).astype(dt)
    wbytes = L * (wgu[0].size + wd[0].size) * jnp.dtype(dt).itemsize
    blocked = {T: block_weights(wgu, T) for T in a.T}
    res = dict(layers=L, hidden=E, intermediate=inter, device=str(jax.devices()[0]), rows={})
    for M in [int(v) for v in a.rows.split(",")]:
        h = jax.random.normal(k[3], (M, E)).astype(dt)
        ref_fn = jax.jit(lambda h: chain_xla(h, g, wgu, wd, eps))
        ref = ref_fn(h)
        rows = res["rows"][M] = dict(xla_us=None, fused=[])
        if not a.smoke:
            t = time_chain(ref_fn, h, a.iters)
            rows["xla_us"] = t / L * 1e6
            print(f"M={M}: xla {t / L * 1e6:.2f} us/layer ({wbytes / t / 1e9:.0f} GB/s, "
                  f"{wbytes / t / HBM:.0%} of 4.3 TB/s)", flush=True)
        best = None
        for tiles in sweep(a):
            w_in = blocked[tiles["T"]] if tiles["blocked"] else wgu
            fn = jax.jit(lambda h, w_in=w_in, tiles=tiles: chain_fused(h, g, w_in, wd, eps, tiles, interpret))
            try:
                y = fn(h)
                err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref.astype(jnp.float32))))
                t = None if a.smoke else time_chain(fn, h, a.iters)
            except Exception as e:     # a tile choice Triton cannot compile: recorded, not fatal
                rows["fused"].append(dict(tiles, error=str(e).split("\n")[0][:200]))
                continue
            row = dict(tiles, us=None if t is None else t / L * 1e6, max_err=err)
            rows["fused"].append(row)
            if t is not None and (best is None or t < best[0]):
                best = (t, tiles)
            print(f"M={M} {tiles}: " + (f"{t / L * 1e6:.2f} us/layer " if t else "") + f"max err {err:.3g}",
                  flush=True)
        if best:
            print(f"M={M}: best fused {best[0] / L * 1e6:.2f} us/layer ({wbytes / best[0] / 1e9:.0f} GB/s) "
                  f"against xla {rows['xla_us']:.2f}: {best[1]}", flush=True)
    write_json(a.json, res)
    return res


if __name__ == "__main__":
    main()
