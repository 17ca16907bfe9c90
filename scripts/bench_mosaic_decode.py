"""Mosaic GPU paged decode (pallas_kernels/mosaic/paged_decode.py) against the Pallas-Triton kernel, on
Qwen3-0.6B shapes (H=16, K=8, D=128, bf16, page 16), GPU only.

For each batch x context: first the error of each kernel against the jnp reference (max |diff|), then the time
per call (scripts/timing.time_loop: back-to-back dispatches, median of 7) and effective TB/s = K+V bytes the
batch needs / time, next to the copy bandwidth measured in the same run. The fp8 rows run both kernels on
float8_e4m3fn pages (per-kv-head scales); their TB/s counts the bytes actually read (half of bf16's). A Mosaic tile choice that fails to
compile or run is recorded with its error and the run goes on (the first runs on a new JAX are the test).

  PYTHONPATH=. python scripts/bench_mosaic_decode.py [--quick] [--json scripts/results/h200_mosaic_decode.json]

The kernels lower with Mosaic's Lane semantics; JAXINFER_MOSAIC_LOWERING=Warpgroup tries JAX 0.11's default
(layout inference), and MOSAIC_GPU_DUMP_CONSTRAINT_SYSTEM=1 (JAX's switch) then prints its constraint system.
"""
from __future__ import annotations

import argparse
import traceback
import warnings

warnings.filterwarnings("ignore", message=".*Triton.*deprecated.*")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.mosaic import _common  # noqa: E402
from pallas_kernels.mosaic.paged_decode import paged_decode_attention, smem_bytes, MAX_SMEM  # noqa: E402
from pallas_kernels.paged_attention import choose_num_splits, paged_attention, paged_attention_reference  # noqa: E402
from pallas_kernels.quant import quantize, scale_for_amax  # noqa: E402

from bench import write_json  # noqa: E402
from timing import copy_bandwidth, time_loop  # noqa: E402

H, K, D, PAGE, DTYPE = 16, 8, 128, 16, jnp.bfloat16
SHAPES = [(64, 1024), (64, 4096), (256, 1024), (256, 4096), (1, 4096), (8, 4096), (32, 2048)]
QUICK = [(64, 1024), (256, 4096), (8, 4096)]
# (block_n, num_stages): Mosaic tile choices; the first is the kernel's default
TILES = [(64, 2), (64, 3), (64, 4), (128, 2), (64, 1), (128, 1)]
SPLITS = [1, 2, 4, 8]     # context splits tried with the default tile (beside the automatic choice)


def case(batch, ctx):
    """A pool of pages scattered by a permutation (as the engine's), every row `ctx` long, and random q."""
    blocks = -(-ctx // PAGE)
    kk, kv, kp, kq = jax.random.split(jax.random.PRNGKey(batch * 7 + ctx), 4)
    pages = batch * blocks + 16
    k = jax.random.normal(kk, (pages, PAGE, K, D), DTYPE)
    v = jax.random.normal(kv, (pages, PAGE, K, D), DTYPE)
    tables = jax.random.permutation(kp, pages)[:batch * blocks].astype(jnp.int32).reshape(batch, blocks)
    q = jax.random.normal(kq, (batch, H, D), DTYPE)
    return q, k, v, tables, jnp.full((batch,), ctx, jnp.int32)


def measure(name, fn, q, k, v, tables, lens, ref, nbytes, copy_tbps) -> dict:
    try:
        err = float(jnp.abs(jax.jit(fn)(q, k, v, tables, lens).astype(jnp.float32) - ref).max())
        s = time_loop(fn, q, k, v, tables, lens, est_s=nbytes / 3e12 + 5e-6)
    except Exception as e:  # noqa: BLE001 - record why a tile choice fails and go on
        print(f"  {name}: FAILED {type(e).__name__}: {str(e)[:300]}")
        return {"name": name, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    tbps = nbytes / s / 1e12
    print(f"  {name:<24} {s * 1e6:9.1f} us {tbps:6.2f} TB/s ({tbps / copy_tbps:4.0%} of copy)  max err {err:.2e}")
    return {"name": name, "us": s * 1e6, "tbps": tbps, "max_abs_err": err}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 shapes, default tiles only")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if jax.default_backend() != "gpu":
        raise SystemExit("bench_mosaic_decode needs a CUDA GPU (Mosaic GPU kernels do not run on the CPU)")
    copy_tbps = copy_bandwidth(1 << 30) / 1e12
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, Mosaic lowering {_common.LOWERING}: "
          f"copy {copy_tbps:.2f} TB/s")
    rows = []
    for batch, ctx in QUICK if args.quick else SHAPES:
        q, k, v, tables, lens = case(batch, ctx)
        ref = paged_attention_reference(q, k, v, tables, lens).astype(jnp.float32)
        nbytes = batch * ctx * K * D * 2 * 2  # K and V rows really needed
        print(f"decode {batch} x {ctx}:")
        res = [measure("pallas (triton)", paged_attention, q, k, v, tables, lens, ref, nbytes, copy_tbps)]
        for block_n, stages in TILES[:1] if args.quick else TILES:
            if smem_bytes(D, block_n, stages, 2) > MAX_SMEM:
                continue
            fn = lambda *a, bn=block_n, st=stages: paged_decode_attention(*a, block_n=bn, num_stages=st)
            res.append(measure(f"mosaic n{block_n} s{stages}", fn, q, k, v, tables, lens, ref, nbytes, copy_tbps))
        auto = choose_num_splits(batch, K, tables.shape[1] * PAGE, TILES[0][0])
        for splits in [] if args.quick else [n for n in SPLITS if n != auto]:   # the default tile, other splits
            fn = lambda *a, ns=splits: paged_decode_attention(*a, num_splits=ns)
            res.append(measure(f"mosaic n{TILES[0][0]} s{TILES[0][1]} x{splits}", fn, q, k, v, tables, lens, ref,
                               nbytes, copy_tbps))
        ks, vs = (scale_for_amax(jnp.abs(x.astype(jnp.float32)).max((0, 1, 3))) for x in (k, v))
        kq, vq, fp8 = quantize(k, ks), quantize(v, vs), dict(k_scale=ks, v_scale=vs)
        ref8 = paged_attention_reference(q, kq, vq, tables, lens, **fp8).astype(jnp.float32)
        for name, kernel in (("pallas fp8", paged_attention), ("mosaic fp8 n64 s2", paged_decode_attention)):
            fn = lambda *a, kernel=kernel: kernel(*a, **fp8)
            res.append(measure(name, fn, q, kq, vq, tables, lens, ref8, nbytes // 2, copy_tbps))
        rows.append({"batch": batch, "ctx": ctx, "results": res})
    if args.json:
        write_json(args.json, {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                               "mosaic_lowering": _common.LOWERING,
                               "copy_tbps": copy_tbps, "decode": rows})


if __name__ == "__main__":
    main()
