"""Probe: why does a jitted program of tiny jax-triton `triton_call`s cost ~80-100 us per call on the H200?

Known (measured on the H200, issue 20): 20 tiny triton_calls + 40 XLA ops in one jit took 1.6-2.0 ms; the same math in pure
XLA 35 us. Suspects: (a) the command buffer (CUDA graph) is split at each call, because jax-triton 0.3.1 lowers
to a legacy custom call ("triton_kernel_call", api_version 2) that XLA cannot capture, so each call is an
eager launch between graph pieces; (b) host work per launch in that legacy handler. This script times, in one
process, each variant with XLA's default command buffers and with them off, for both call paths:

  jax_triton  the package's triton_call (legacy custom call)
  ffi         the same compiled kernel through XLA's typed-FFI Triton call (pallas_kernels/_triton_ffi.py),
              the route JAX's own Pallas-Triton kernels take on jaxlib > 0.10.2

and programs: N calls chained (no XLA ops between), N calls + 2N XLA ops interleaved (the reported case),
2N XLA ops alone, one call alone. Per program: device time per call (n back-to-back dispatches), the host
time of a dispatch (time until the call returns, not waiting for the GPU), and with --trace DIR a profiler
trace of the interleaved programs summarised by scripts/trace_summary.py (kernel busy time vs gaps).

  PYTHONPATH=. python scripts/probe_triton_call.py [--n 20] [--json out.json] [--trace DIR]

What to read: if ffi + command buffers is near pure XLA while jax_triton is ~80 us/call with command buffers
and about the same without them, the cost is the graph split + legacy launch path, and the ffi route fixes it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels._triton_ffi import load_triton, triton_call  # noqa: E402

SIZE = 1024   # elements per tiny kernel
CB_OFF = {"xla_gpu_enable_command_buffer": ""}     # XLA's command buffers (CUDA graphs) off for this compile


try:   # a @triton.jit kernel must be a module-level function (Triton does not read closures)
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, o_ptr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(o_ptr + i, tl.load(x_ptr + i) + 1.0)
except ImportError:
    add_one = None


def programs(kernel, n: int) -> dict:
    """name -> f(x) -> x: the probe's programs (x [SIZE] fp32)."""
    def call(x, path):
        return triton_call(x, kernel=kernel, out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)], grid=(SIZE // 256,),
                           num_warps=1, num_stages=1, path=path, name="add_one", BLOCK=256)[0]

    def chained(path):
        def f(x):
            for _ in range(n):
                x = call(x, path)
            return x
        return f

    def interleaved(path):
        def f(x):
            for _ in range(n):
                x = jnp.sin(call(x, path)) * 1.0001     # two XLA ops a call; XLA may fuse them into one kernel
                x = jnp.cumsum(x) * 1e-3                 # a second kernel that cannot fuse with the first
            return x
        return f

    def xla_only(x):
        for _ in range(n):
            x = jnp.sin(x + 1.0) * 1.0001
            x = jnp.cumsum(x) * 1e-3
        return x

    out = {"xla_only": xla_only}
    for path in ("ffi", "jax_triton"):
        out[f"{path}_one"] = lambda x, p=path: call(x, p)
        out[f"{path}_chained"] = chained(path)
        out[f"{path}_interleaved"] = interleaved(path)
    return out


def time_program(compiled, x, reps: int = 7, n: int = 100) -> dict:
    """Device seconds per call (n back-to-back dispatches, median of reps) and host seconds per dispatch."""
    jax.block_until_ready(compiled(x))
    dev, host = [], []
    for _ in range(reps):
        y = x
        t0 = time.perf_counter()
        for _ in range(n):
            y = compiled(y)
        t1 = time.perf_counter()
        jax.block_until_ready(y)
        t2 = time.perf_counter()
        host.append((t1 - t0) / n)
        dev.append((t2 - t0) / n)
    return {"call_s": statistics.median(dev), "dispatch_s": statistics.median(host)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20, help="triton calls per program")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--trace", help="write profiler traces of the interleaved programs under this directory")
    args = ap.parse_args()
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    if jax.default_backend() != "gpu":
        raise SystemExit("probe_triton_call needs a CUDA GPU")
    load_triton()   # says what is missing
    import jax_triton
    print(f"triton {triton.__version__}, jax-triton {jax_triton.__version__}, n = {args.n} calls a program")
    x = jnp.zeros((SIZE,), jnp.float32)
    results = {}
    for name, f in programs(add_one, args.n).items():
        for cb, opts in (("cb_on", None), ("cb_off", CB_OFF)):
            key = f"{name}/{cb}"
            try:
                compiled = jax.jit(f).lower(x).compile(compiler_options=opts)
                r = time_program(compiled, x)
                calls = 1 if name.endswith("_one") else args.n
                r["per_call_us"] = r["call_s"] / calls * 1e6
                results[key] = r
                print(f"  {key:32s} {r['call_s'] * 1e6:9.1f} us a program  {r['per_call_us']:7.1f} us per triton "
                      f"call  (host dispatch {r['dispatch_s'] * 1e6:7.1f} us)", flush=True)
            except Exception as err:  # noqa: BLE001
                results[key] = {"error": f"{type(err).__name__}: {str(err)[:400]}"}
                print(f"  {key:32s} FAILED {results[key]['error']}", flush=True)
            if args.trace and name.endswith("interleaved") and "error" not in results[key]:
                d = os.path.join(args.trace, key.replace("/", "_"))
                with jax.profiler.trace(d):
                    y = x
                    for _ in range(5):
                        y = compiled(y)
                    jax.block_until_ready(y)
                try:
                    from trace_summary import print_summary, summarize
                    s = summarize(d, top=6)
                    results[key]["trace"] = s
                    print(f"  trace of {key}:")
                    print_summary(s)
                except Exception as err:  # noqa: BLE001
                    print(f"  trace summary of {key} failed: {type(err).__name__}: {err}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "n": args.n,
                       "results": results}, fh, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
