"""What a tensor-parallel decode step's all-reduces cost: a chain of L x 2 all-reduces of [rows, hidden] inside
one jitted program over a 2-device "tp" mesh, each behind a small matmul (as o_proj / down_proj), against the
same chain without the all-reduces.

    python scripts/probe_allreduce.py --rows 256 --hidden 4096 --layers 36 --json out.json   # Qwen3-8B's shape
    NCCL_PROTO=LL128 python scripts/probe_allreduce.py ...      # NCCL's knobs are read when its comms start

Prints us per all-reduce = (chain with all-reduces - chain without) / (2 L). The XLA one-shot all-reduce kernel
is one more variant (`--one-shot`: a per-compile option, xla_gpu_unsupported_use_all_reduce_one_shot_kernel).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench import write_json  # noqa: E402


def build(rows: int, hidden: int, layers: int, reduce: bool, mesh, options: dict):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxinfer.parallel.compat import shard_map

    def chain(x, w):                               # x [rows, hidden / tp], w [L, hidden / tp, hidden] per device
        for l in range(2 * layers):
            y = jnp.dot(x, w[l % layers], preferred_element_type=jnp.bfloat16)     # [rows, hidden] partial
            y = jax.lax.psum(y, "tp") if reduce else y
            x = (y[:, :x.shape[1]] * 0.5).astype(x.dtype)                            # the next layer's input
        return x

    f = shard_map(chain, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp", None)), out_specs=P(None, "tp"))
    x = jax.ShapeDtypeStruct((rows, hidden), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "tp")))
    w = jax.ShapeDtypeStruct((layers, hidden, hidden), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "tp", None)))
    return jax.jit(f).lower(x, w).compile(compiler_options=options)


def time_it(exe, x, w, n: int) -> float:
    import jax
    out = exe(x, w)
    jax.block_until_ready(out)
    t = time.perf_counter()
    for _ in range(n):
        out = exe(x, w)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / n


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--one-shot", action="store_true", help="XLA's one-shot all-reduce kernel (per compile)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxinfer.xla_options import step_compiler_options
    devices = jax.devices()[:a.tp]
    if len(devices) < a.tp:
        raise SystemExit(f"needs {a.tp} devices, found {len(devices)}")
    mesh = Mesh(np.array(devices), ("tp",))
    options = step_compiler_options(devices[0].platform, a.tp)
    if a.one_shot:
        options["xla_gpu_unsupported_use_all_reduce_one_shot_kernel"] = True
    x = jax.device_put(jnp.ones((a.rows, a.hidden), jnp.bfloat16), NamedSharding(mesh, P(None, "tp")))
    w = jax.device_put(jnp.full((a.layers, a.hidden, a.hidden), 0.01, jnp.bfloat16),
                       NamedSharding(mesh, P(None, "tp", None)))
    with_ar = time_it(build(a.rows, a.hidden, a.layers, True, mesh, options), x, w, a.iters)
    without = time_it(build(a.rows, a.hidden, a.layers, False, mesh, options), x, w, a.iters)
    n = 2 * a.layers
    msg = a.rows * a.hidden * 2
    per = (with_ar - without) / n
    out = dict(rows=a.rows, hidden=a.hidden, layers=a.layers, tp=a.tp, one_shot=a.one_shot, message_bytes=msg,
               step_ms_with_all_reduce=with_ar * 1e3, step_ms_without=without * 1e3, us_per_all_reduce=per * 1e6,
               bus_GBs=2 * (a.tp - 1) / a.tp * msg / per / 1e9 if per > 0 else None,
               nccl_env={k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
               xla_flags=os.environ.get("XLA_FLAGS", ""))
    print(json.dumps(out, indent=1))
    write_json(a.json, out)
    return out


if __name__ == "__main__":
    main()
