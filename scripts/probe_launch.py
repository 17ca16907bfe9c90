"""What launching one step costs the host on 1 and 2 GPUs, for the shapes of a decode step (no engine).

    python scripts/probe_launch.py [--layers 28 --hidden 1024 --rows 128] [--json out.json]

A synthetic decode step (per layer: RMSNorm, 4 matmuls, SwiGLU, a KV-cache row write into two donated
per-layer arrays; a numpy "packed batch" sent with every call, as the engine does) is compiled four ways and
called back to back; for each, host ms per call (the Python call returning) and wall ms per call (to the last
result):
- `one`: on device 0;
- `two_alternating`: one copy per device, called in turn from one thread (what data-parallel replicas do
  today): ms per round of both;
- `two_threads`: the same two copies, each called from its own thread: ms per round;
- `dp_spmd`: one program over a 2-device mesh, rows and caches split over "dp", weights replicated, no
  collectives: one call per round;
- `tp_spmd`: one program over a 2-device mesh, weights split as tensor parallelism splits them, a psum after
  the second and fourth matmul (2 all-reduces a layer).
Run it under different XLA_FLAGS (e.g. `--xla_gpu_enable_command_buffer=+COLLECTIVES`) to compare launch
modes; the engine's SKIP_TEMP command-buffer mode is added unless --no-process-flags.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def build(jax, jnp, L, E, I, P):
    """step(ws, caches, x, packed) -> (x, caches): ws (w_qkv [L,E,3E], w_o [L,E,E], w_gu [L,E,2I], w_d [L,I,E])."""
    def rms(x):
        x32 = x.astype(jnp.float32)
        return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(x.dtype)

    def step(ws, caches, x, packed, psum=None):
        red = psum or (lambda y: y)
        pos = packed[0] % caches[0].shape[0]
        out = []
        for l in range(L):
            h = rms(x)
            qkv = h @ ws[0][l]
            q, k = jnp.tanh(qkv[:, :qkv.shape[1] // 3]), qkv[:, qkv.shape[1] // 3:2 * qkv.shape[1] // 3]
            kc = jax.lax.dynamic_update_slice(caches[2 * l], k[:1], (pos, 0))
            vc = jax.lax.dynamic_update_slice(caches[2 * l + 1], q[:1], (pos, 0))
            out += [kc, vc]
            x = x + red(q @ ws[1][l])
            gu = rms(x) @ ws[2][l]
            g, u = gu[:, :gu.shape[1] // 2], gu[:, gu.shape[1] // 2:]
            x = x + red((jax.nn.silu(g) * u) @ ws[3][l])
        return x, out
    return step


def timed(call, n):
    """(host ms per call, wall ms per call) over n back-to-back calls; call() returns something to wait on."""
    import jax
    jax.block_until_ready(call())
    t0 = time.perf_counter()
    host = 0.0
    for _ in range(n):
        h0 = time.perf_counter()
        out = call()
        host += time.perf_counter() - h0
    jax.block_until_ready(out)
    return dict(host_ms=round(1e3 * host / n, 3), wall_ms=round(1e3 * (time.perf_counter() - t0) / n, 3))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-process-flags", action="store_true")
    ap.add_argument("--only", nargs="*", default=None)
    a = ap.parse_args(argv)
    from jaxinfer.xla_options import set_process_flags, step_compiler_options
    if not a.no_process_flags:
        set_process_flags()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as Ps
    from jaxinfer.parallel import shard_map
    from bench import write_json

    devs = jax.devices()
    L, E, I, R, P = a.layers, a.hidden, a.intermediate, a.rows, 4096
    step = build(jax, jnp, L, E, I, P)
    opts1 = step_compiler_options(devs[0].platform, 1)
    opts2 = step_compiler_options(devs[0].platform, 2)
    shapes = [(L, E, 3 * E), (L, E, E), (L, E, 2 * I), (L, I, E)]
    keys = jax.random.split(jax.random.PRNGKey(0), 4)       # made on device 0 (8B-sized shapes: ~16 GB)
    ws0 = [(jax.random.normal(k, s, jnp.float32) * 0.02).astype(jnp.bfloat16) for k, s in zip(keys, shapes)]
    packed = np.arange(64, dtype=np.int32)
    out = dict(layers=L, hidden=E, rows=R, devices=str(devs), xla_flags=os.environ.get("XLA_FLAGS", ""))
    want = (lambda name: a.only is None or name in a.only)

    def single(dev):
        put = lambda x: jax.device_put(x, dev)
        ws = [put(w) for w in ws0]
        caches = [put(jnp.zeros((P, E), jnp.bfloat16)) for _ in range(2 * L)]
        x = put(jnp.ones((R, E), jnp.bfloat16))
        fn = jax.jit(step, donate_argnums=(1, 2)).lower(ws, caches, x, packed).compile(compiler_options=opts1)
        state = {"c": caches, "x": x}

        def call():
            state["x"], state["c"] = fn(ws, state["c"], state["x"], packed)
            return state["x"]
        return call

    if want("one"):
        out["one"] = timed(single(devs[0]), a.calls)
    if len(devs) >= 2:
        c0, c1 = single(devs[0]), single(devs[1])
        if want("two_alternating"):
            out["two_alternating"] = timed(lambda: (c0(), c1()), a.calls)
        if want("two_threads"):
            def run(c, n):
                for _ in range(n):
                    r = c()
                jax.block_until_ready(r)
            for c in (c0, c1):
                jax.block_until_ready(c())
            t0 = time.perf_counter()
            ts = [threading.Thread(target=run, args=(c, a.calls)) for c in (c0, c1)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            out["two_threads"] = dict(wall_ms=round(1e3 * (time.perf_counter() - t0) / a.calls, 3))
        mesh = Mesh(np.array(devs[:2]), ("d",))
        sh = lambda *spec: NamedSharding(mesh, Ps(*spec))
        for name in ("dp_spmd", "tp_spmd"):
            if not want(name):
                continue
            dp = name == "dp_spmd"
            if dp:
                w_specs = [Ps()] * 4
                body = lambda ws, cs, x, p: step(ws, cs, x, p[0])
                c_spec, x_spec, p_spec = Ps("d"), Ps("d"), Ps("d")
                xs, cs_shape, pk = (2 * R, E), (2 * P, E), np.stack([packed, packed])
            else:
                w_specs = [Ps(None, None, "d"), Ps(None, "d", None), Ps(None, None, "d"), Ps(None, "d", None)]
                body = lambda ws, cs, x, p: step(ws, cs, x, p, psum=lambda y: jax.lax.psum(y, "d"))
                c_spec, x_spec, p_spec = Ps(None, "d"), Ps(), Ps()
                xs, cs_shape, pk = (R, E), (P, E), packed
            ws = [jax.device_put(w, sh(*s)) for w, s in zip(ws0, w_specs)]
            caches = [jax.device_put(jnp.zeros(cs_shape, jnp.bfloat16), sh(*c_spec)) for _ in range(2 * L)]
            x = jax.device_put(jnp.ones(xs, jnp.bfloat16), sh(*x_spec))
            f = shard_map(body, mesh, (w_specs, [c_spec] * (2 * L), x_spec, p_spec), (x_spec, [c_spec] * (2 * L)))
            fn = jax.jit(f, donate_argnums=(1, 2)).lower(ws, caches, x, pk).compile(compiler_options=opts2)
            state = {"c": caches, "x": x}

            def call(fn=fn, ws=ws, state=state, pk=pk):
                state["x"], state["c"] = fn(ws, state["c"], state["x"], pk)
                return state["x"]
            out[name] = timed(call, a.calls)
    print(out)
    write_json(a.json, out)
    return out


if __name__ == "__main__":
    main()
