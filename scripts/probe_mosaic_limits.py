"""Issue 21's limiting factors: JAX's own FA3 kernel as the Mosaic prefill's ceiling, and Nsight Compute targets.

    python scripts/probe_mosaic_limits.py fa3 [--json PATH]      # GPU: ~1 min
    XLA_FLAGS=--xla_gpu_enable_command_buffer= ncu --launch-count 12 --section SpeedOfLight --section Occupancy \
        --section WarpStateStats ... --csv --page details python scripts/probe_mosaic_limits.py ncu KERNEL CASE

fa3: on bench_kernels' uniform prefill cases (Qwen3-0.6B heads: H=16, K=8, D=128, bf16, page 16), the time and
TFLOP/s (visible causal scores, as bench_kernels counts them) of our Mosaic prefill (paged), the Pallas-Triton flash
kernel (paged), JAX's Mosaic FA3 kernel (`jax.experimental.pallas.ops.gpu.attention_mgpu`, causal, on the same K/V
gathered into dense [B, n, K, D] arrays) at block_kv 64 / 128 / 256, and cuDNN on the same dense arrays. Every
output is checked against the paged jnp reference. FA3 has no pages and no cached prefixes: it bounds what a
Mosaic kernel of that design reaches on this machine, the number our kernel's page gathers are measured against.
ncu: two calls of one kernel (inputs made on the host, so few other kernels run), for Nsight Compute.
KERNEL: mosaic_decode, triton_decode (CASE rows x context, e.g. 64x1024), mosaic_prefill, triton_prefill,
jax_fa3 (CASE 1x8192 or 8x1024).
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore", message=".*Triton.*deprecated.*")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.flash_attention import flash_attention, flash_attention_reference  # noqa: E402
from pallas_kernels.mosaic.flash_prefill import flash_prefill  # noqa: E402
from pallas_kernels.mosaic.paged_decode import paged_decode_attention  # noqa: E402
from pallas_kernels.paged_attention import paged_attention  # noqa: E402

H, K, D, PAGE, DTYPE = 16, 8, 128, 16, jnp.bfloat16
CASES = ("1x8192", "8x1024")


def fa3(block_kv: int):
    """JAX's FA3 kernel on dense [B, n, ., D] inputs, causal; None where this JAX has none. Its SMEM tiles are
    float16 (JAX 0.11), so it is given float16 inputs, and it applies no softmax scale (nor does its own
    reference), so q is scaled by D^-0.5 first, as our kernels' contract does."""
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu as mg
    except ImportError:
        return None
    cfg = mg.TuningConfig(block_q=64, block_kv=block_kv, max_concurrent_steps=2, causal=True)
    return lambda q, k, v: mg.attention((q * q.shape[-1] ** -0.5).astype(jnp.float16), k.astype(jnp.float16),
                                        v.astype(jnp.float16), cfg)


def prefill_inputs(case: str):
    """q [T, H, D], paged caches, tables, cu_seqlens, lens, and the same K/V dense [B, n, K, D]; visible FLOPs."""
    b, n = map(int, case.split("x"))
    blocks = n // PAGE
    rng = np.random.default_rng(b * 31 + n)
    pages = b * blocks + 16
    k = rng.standard_normal((pages, PAGE, K, D), np.float32)
    v = rng.standard_normal((pages, PAGE, K, D), np.float32)
    tables = rng.permutation(pages)[:b * blocks].astype(np.int32).reshape(b, blocks)
    q = rng.standard_normal((b * n, H, D), np.float32)
    kd, vd = (x[tables].reshape(b, n, K, D) for x in (k, v))
    cu = np.arange(b + 1, dtype=np.int32) * n
    lens = np.full((b,), n, np.int32)
    dev = [jnp.asarray(x, DTYPE) for x in (q, k, v, kd, vd)] + [jnp.asarray(x) for x in (tables, cu, lens)]
    q, k, v, kd, vd, tables, cu, lens = dev
    flops = b * 4 * D * H * (n * (n + 1) // 2)
    return (q, k, v, tables, cu, lens), (q.reshape(b, n, H, D), kd, vd), flops


def timed(name, fn, args, ref, flops, to_paged=None) -> dict:
    from timing import time_loop
    try:
        out = jax.jit(fn)(*args)
        out = (to_paged(out) if to_paged else out).astype(jnp.float32)
        err = float(jnp.abs(out - ref).max())
        s = time_loop(fn, *args, est_s=flops / 3e14 + 1e-5)
    except Exception as e:  # noqa: BLE001 - record why an implementation fails and go on
        print(f"  {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        return {"name": name, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    tflops = flops / s / 1e12
    print(f"  {name:<24} {s * 1e6:9.1f} us {tflops:7.1f} TFLOP/s  max err {err:.2e}", flush=True)
    return {"name": name, "us": s * 1e6, "tflops": tflops, "max_abs_err": err}


def run_fa3(json_path: str | None):
    from bench import write_json
    rows = []
    for case in CASES:
        paged, dense, flops = prefill_inputs(case)
        ref = jax.jit(flash_attention_reference)(*paged).astype(jnp.float32)
        flat = lambda o, shape=paged[0].shape: o.reshape(shape)
        print(f"prefill {case} ({flops / 1e9:.0f} GFLOP visible):", flush=True)
        half = (paged[0].astype(jnp.float16), *(x.astype(jnp.float16) for x in paged[1:3]), *paged[3:])
        res = [timed("mosaic prefill (paged)", flash_prefill, paged, ref, flops),
               timed("mosaic prefill fp16", flash_prefill, half, ref, flops),
               timed("pallas flash (paged)", flash_attention, paged, ref, flops)]
        for bkv in (64, 128, 256):
            fn = fa3(bkv)
            if fn is not None:
                res.append(timed(f"jax fa3 kv{bkv} (dense)", fn, dense, ref, flops, flat))
        cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        res.append(timed("cudnn (dense)", cudnn, dense, ref, flops, flat))
        rows.append({"case": case, "flops": flops, "results": res})
    write_json(json_path, {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "prefill": rows})


def run_ncu(kernel: str, case: str):
    """Two calls of one kernel, inputs made on the host."""
    b, n = map(int, case.split("x"))
    if kernel in ("mosaic_decode", "triton_decode"):
        rng = np.random.default_rng(b + n)
        blocks = n // PAGE
        pages = b * blocks + 16
        k, v = (jnp.asarray(rng.standard_normal((pages, PAGE, K, D), np.float32), DTYPE) for _ in range(2))
        tables = jnp.asarray(rng.permutation(pages)[:b * blocks].astype(np.int32).reshape(b, blocks))
        q = jnp.asarray(rng.standard_normal((b, H, D), np.float32), DTYPE)
        args = (q, k, v, tables, jnp.full((b,), n, jnp.int32))
        fn = paged_decode_attention if kernel == "mosaic_decode" else paged_attention
    else:
        paged, dense, _ = prefill_inputs(case)
        dense = tuple(x.astype(jnp.float16) for x in dense)      # FA3's own dtype: the cast is not profiled
        fn, args = {"mosaic_prefill": (flash_prefill, paged), "triton_prefill": (flash_attention, paged),
                    "jax_fa3": (fa3(128), dense)}[kernel]
    step = jax.jit(fn)
    for _ in range(2):
        jax.block_until_ready(step(*args))
    print(f"{kernel} {case}: ran twice")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["fa3", "ncu"])
    ap.add_argument("kernel", nargs="?", default="mosaic_prefill")
    ap.add_argument("case", nargs="?", default="1x8192")
    ap.add_argument("--json")
    a = ap.parse_args()
    if jax.default_backend() != "gpu":
        raise SystemExit("probe_mosaic_limits needs a CUDA GPU (Mosaic GPU kernels do not run on the CPU)")
    run_fa3(a.json) if a.what == "fa3" else run_ncu(a.kernel, a.case)


if __name__ == "__main__":
    main()
