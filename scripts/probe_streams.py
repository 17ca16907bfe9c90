"""Can a decode step overlap its memory-bound attention with its GEMMs on two GPU streams (NanoFlow-style)?

    PYTHONPATH=. python scripts/probe_streams.py [--batch 256] [--context 1024] [--layers 28] [--json PATH]

A W decode step at 256 rows spends ~3.5 ms in the attention kernel (DRAM-bound) and ~1.0 ms in cuBLAS GEMMs
(bound by their per-kernel cost, few waves): run one after the other, they add up. Cut the batch into two halves
whose layers are independent, and one half's GEMMs could run while the other half's attention reads its pages, if
XLA puts them on two streams. JAX marks a call for another stream with `compute_on2(..., compute_type="gpu_stream:1")`
(XLA: `xla_gpu_experimental_stream_annotation`). A model-like chain at Qwen3-0.6B's shapes (RMSNorm, qkv GEMM, the
Pallas decode kernel over a paged cache, o_proj + residual, RMSNorm, gate_up, SwiGLU, down + residual), random
weights, every row `context` tokens; GPU ms a chain (28 layers), dispatched back to back:
  whole      the batch as one
  halves     two halves, layer by layer, one stream (what halving costs)
  streams    the same with the second half's layers on stream 1 (stream annotation on)
  streams_nocb  `streams` with XLA's command buffers off
On the H200 (docs/performance.md, thirtieth run) `streams` was slower than `halves`, itself slower than `whole`.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

HID, H, K, D, INTER = 1024, 16, 8, 128, 3072


def build(batch: int, context: int, layers: int, bs: int = 16, interpret: bool = False):
    import jax
    import jax.numpy as jnp

    from pallas_kernels.paged_attention import paged_attention
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 8))

    def w(*shape):
        return (jax.random.normal(next(keys), shape, jnp.float32) * shape[-2] ** -0.5).astype(jnp.bfloat16)

    params = dict(qkv=w(layers, HID, (H + 2 * K) * D), o=w(layers, H * D, HID), gu=w(layers, HID, 2 * INTER),
                  down=w(layers, INTER, HID))
    n = -(-context // bs)
    pages = batch * n + 1
    k_cache = jax.random.normal(next(keys), (pages, bs, K, D), jnp.float32).astype(jnp.bfloat16)
    v_cache = jax.random.normal(next(keys), (pages, bs, K, D), jnp.float32).astype(jnp.bfloat16)
    rng = np.random.default_rng(0)
    tables = jnp.asarray(1 + rng.permutation(batch * n).reshape(batch, n), jnp.int32)
    lens = jnp.full((batch,), context, jnp.int32)
    x = jax.random.normal(next(keys), (batch, HID), jnp.float32).astype(jnp.bfloat16)

    def norm(x):
        xf = x.astype(jnp.float32)
        return (xf * jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + 1e-6)).astype(x.dtype)

    def layer(p, l, x, tables, lens):
        qkv = norm(x) @ p["qkv"][l]
        q = qkv[:, :H * D].reshape(x.shape[0], H, D)
        o = paged_attention(q, k_cache, v_cache, tables, lens, interpret=interpret, context_total=lens.sum())
        x = x + o.reshape(x.shape[0], H * D) @ p["o"][l]
        gu = norm(x) @ p["gu"][l]
        return x + (jax.nn.silu(gu[:, :INTER]) * gu[:, INTER:]) @ p["down"][l]

    def whole(p, x):
        for l in range(layers):
            x = layer(p, l, x, tables, lens)
        return x

    def inlined(f):
        """f with every nested jit call inlined: XLA's stream annotation fails on a call inside the annotated call
        ("No ExecutionStreamId found for call-start"), and jax.nn.silu or the kernel's wrapper are jitted."""
        from jax.extend import core as jcore

        def run(jaxpr, consts, *args):
            env = {}
            read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]
            for v, a in zip(jaxpr.constvars, consts):
                env[v] = a
            for v, a in zip(jaxpr.invars, args):
                env[v] = a
            for eqn in jaxpr.eqns:
                ins = [read(v) for v in eqn.invars]
                if eqn.primitive.name in ("pjit", "jit", "closed_call"):
                    inner = eqn.params.get("jaxpr") or eqn.params["call_jaxpr"]
                    outs = run(inner.jaxpr, inner.consts, *ins)
                else:
                    bp = eqn.primitive.get_bind_params(eqn.params)     # older JAX: (subfuns, params)
                    subfuns, bp = bp if isinstance(bp, tuple) else ((), bp)
                    outs = eqn.primitive.bind(*subfuns, *ins, **bp)
                    outs = outs if eqn.primitive.multiple_results else [outs]
                for v, o in zip(eqn.outvars, outs):
                    env[v] = o
            return [read(v) for v in jaxpr.outvars]

        def g(*args):
            closed, shape = jax.make_jaxpr(f, return_shape=True)(*args)
            flat = run(closed.jaxpr, closed.consts, *jax.tree.leaves(args))
            return jax.tree.unflatten(jax.tree.structure(shape), flat)
        return g

    def on_stream(f):
        """f as a call XLA runs on stream 1 (compute_on2 where JAX has it; else a jitted call under compute_on)."""
        import inspect

        from jax.experimental import compute_on as co
        f = inlined(f)
        kw = dict(compute_type="gpu_stream:1", out_memory_spaces=jax.memory.Space.Device)
        if hasattr(co, "compute_on2"):       # JAX 0.10
            return co.compute_on2(f, **kw)
        if "out_memory_spaces" in inspect.signature(co.compute_on).parameters:   # JAX 0.11: the same, renamed
            return co.compute_on(f, **kw)
        jf = jax.jit(f)

        def g(*args):
            with co.compute_on("gpu_stream:1"):
                return jf(*args)
        return g

    def halves(stream: bool):
        h = batch // 2

        def fn(p, x):
            xa, xb = x[:h], x[h:]
            ta, tb, la, lb = tables[:h], tables[h:], lens[:h], lens[h:]
            for l in range(layers):
                xa = layer(p, l, xa, ta, la)
                fb = lambda p, xb, l=l: layer(p, l, xb, tb, lb)
                if stream:
                    fb = on_stream(fb)
                xb = fb(p, xb)
            return jnp.concatenate([xa, xb])
        return fn

    variants = {"whole": (whole, {}), "halves": (halves(False), {}),
                "streams": (halves(True), {"xla_gpu_experimental_stream_annotation": True}),
                "streams_nocb": (halves(True), {"xla_gpu_experimental_stream_annotation": True,
                                                "xla_gpu_enable_command_buffer": ""})}
    kv_bytes = 2 * batch * context * K * D * 2 * layers
    return params, x, variants, kv_bytes


def time_chain(compiled, params, x, iters: int) -> float:
    import jax
    y = jax.block_until_ready(compiled(params, x))
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(iters):
            y = compiled(params, x)
        jax.block_until_ready(y)
        best = min(best, (time.perf_counter() - t) / iters)
    return best


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--variants", nargs="+", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (a CPU check of the script)")
    ap.add_argument("--hlo-dir", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import jax

    from bench import write_json
    if a.smoke:
        a.batch, a.context, a.layers, a.iters = 4, 64, 2, 1
    params, x, variants, kv_bytes = build(a.batch, a.context, a.layers, interpret=a.smoke)
    rows, ref = {}, None
    for name, (fn, opts) in variants.items():
        if a.variants and name not in a.variants:
            continue
        if a.smoke:
            opts = {}     # the CPU takes neither option
        t = time.perf_counter()
        try:
            compiled = jax.jit(fn).lower(params, x).compile(compiler_options=opts or None)
            print(f"{name}: compiled in {time.perf_counter() - t:.1f} s", flush=True)
        except Exception as e:   # noqa: BLE001  (a probe: report and go on)
            rows[name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
            print(f"{name:14s} failed to compile: {rows[name]['error']}")
            continue
        if a.hlo_dir:
            os.makedirs(a.hlo_dir, exist_ok=True)
            with open(os.path.join(a.hlo_dir, f"{name}.txt"), "w") as f:
                f.write(compiled.as_text())
        out = np.asarray(compiled(params, x), np.float32)
        ref = out if ref is None else ref
        s = time_chain(compiled, params, x, a.iters)
        rows[name] = dict(ms=s * 1e3, kv_TBps=kv_bytes / s / 1e12, max_abs_diff=float(np.abs(out - ref).max()))
        print(f"{name:14s} {s * 1e3:8.3f} ms a chain  ({kv_bytes / s / 1e12:.2f} TB/s of K/V counted over the "
              f"chain; |diff| vs first {rows[name]['max_abs_diff']:.1e})")
    out = dict(batch=a.batch, context=a.context, layers=a.layers, device=jax.devices()[0].device_kind, variants=rows)
    write_json(a.json, out)
    return out


if __name__ == "__main__":
    main()
