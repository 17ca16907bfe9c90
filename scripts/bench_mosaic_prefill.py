"""Mosaic GPU varlen causal prefill (pallas_kernels/mosaic/flash_prefill.py) against the Pallas-Triton flash kernel
and cuDNN, on bench_kernels.py's prefill cases (Qwen3-0.6B: H=16, K=8, D=128, bf16, page 16), GPU only.

For each case: the max |error| of each implementation against the jnp reference, then the time per call
(scripts/timing.time_loop: back-to-back dispatches, median of 7) and TFLOP/s counting only the visible (causal)
scores, as bench_kernels does, next to the bf16 matmul rate measured in the same run. "cudnn" is the cudnn
backend's paged prefill (query tiles gathering their pages); "cudnn_dense" is jax.nn.dot_product_attention on
contiguous equal-length inputs (uniform cases only), the number issue 21's targets are set against. A Mosaic tile
choice that fails to compile or run is recorded with its error and the run goes on. --persistent times each Mosaic
tile choice twice in the same run: a program per q tile, then the persistent kernel (one program an SM looping over
q tiles, prefill_persistent.py), in rows named "... persistent".
Targets (issue 21): >= 450 TFLOP/s at 1x8192, >= 320 at 8x1024.

  PYTHONPATH=. python scripts/bench_mosaic_prefill.py [--quick] [--persistent] [--json scripts/results/h200_x.json]
"""
from __future__ import annotations

import argparse
import traceback
import warnings

warnings.filterwarnings("ignore", message=".*Triton.*deprecated.*")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.flash_attention import flash_attention, flash_attention_reference  # noqa: E402
from pallas_kernels.mosaic import _common  # noqa: E402
from pallas_kernels.mosaic.flash_prefill import MAX_SMEM, default_programs, flash_prefill, smem_bytes  # noqa: E402

from bench import write_json  # noqa: E402
from bench_kernels import D, DTYPE, H, K, PREFILL_CASES, backend_fns, prefill_case  # noqa: E402
from timing import time_loop  # noqa: E402

CASES = ("1x8192", "8x1024", "mixed+prefix")
TARGETS = {"1x8192": 450.0, "8x1024": 320.0}  # TFLOP/s (issue 21)
# (block_kv, num_stages, pair_heads): Mosaic tile choices; the first is the kernel's default. pair_heads=False is
# FA3's layout (two 64-row halves of one head per program) instead of two heads of a kv head on the same rows.
TILES = [(128, 2, True), (128, 2, False), (64, 2, True), (64, 3, True), (64, 4, True), (64, 4, False)]


def measure(name, fn, args, ref, flops, est_s) -> dict:
    """Max |error| against ref (None: not comparable), seconds per call, TFLOP/s; an exception is recorded."""
    try:
        out = jax.jit(fn)(*args).astype(jnp.float32)
        err = None if ref is None else float(jnp.abs(out - ref).max())
        s = time_loop(fn, *args, est_s=est_s)
    except Exception as e:  # noqa: BLE001 - record why an implementation or tile choice fails and go on
        print(f"  {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        return {"name": name, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    tflops = flops / s / 1e12
    print(f"  {name:<30} {s * 1e6:9.1f} us {tflops:7.1f} TFLOP/s  max err "
          f"{'n/a (other K/V)' if err is None else f'{err:.2e}'}", flush=True)
    return {"name": name, "us": s * 1e6, "tflops": tflops, "max_abs_err": err}


def dense_cudnn(n_new):
    """cuDNN on contiguous [B, n, ., D] K/V (equal lengths, no prefix): q [T, H, D] -> [T, H, D]."""
    b, n = len(n_new), n_new[0]
    kd = jax.random.normal(jax.random.PRNGKey(5), (b, n, K, D), DTYPE)
    vd = jax.random.normal(jax.random.PRNGKey(6), (b, n, K, D), DTYPE)

    def fn(q, *_):
        out = jax.nn.dot_product_attention(q.reshape(b, n, H, D), kd, vd, is_causal=True, implementation="cudnn")
        return out.reshape(q.shape)
    return fn


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1x8192 and 8x1024; the default tiles, paired or not")
    ap.add_argument("--persistent", action="store_true",
                    help="also time each Mosaic tile choice as the persistent kernel (rows '... persistent')")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if jax.default_backend() != "gpu":
        raise SystemExit("bench_mosaic_prefill needs a CUDA GPU (Mosaic GPU kernels do not run on the CPU)")
    m = 8192
    a = jnp.ones((m, m), DTYPE) * 0.001
    matmul = 2 * m ** 3 / time_loop(lambda x: jnp.dot(x, a), a, est_s=1.5e-3) / 1e12
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, Mosaic lowering {_common.LOWERING}: "
          f"bf16 matmul {matmul:.0f} TFLOP/s")
    cudnn = backend_fns(False, ["cudnn"]).get("cudnn")
    rows = []
    for name in CASES[:2] if args.quick else CASES:
        n_new, prefix = PREFILL_CASES[name]
        q, k, v, tables, cu, lens, flops = prefill_case(n_new, prefix, jax.random.PRNGKey(len(n_new)))
        inputs = (q, k, v, tables, cu, lens)
        ref = jax.jit(flash_attention_reference)(*inputs).astype(jnp.float32)
        est = flops / 3e14 + 1e-5
        print(f"prefill {name} ({flops / 1e9:.0f} GFLOP visible; target {TARGETS.get(name, '-')} TFLOP/s):")
        res = [measure("pallas (triton)", flash_attention, inputs, ref, flops, est)]
        if cudnn is not None:
            res.append(measure("cudnn (paged)", cudnn[0], inputs, ref, flops, est))
        if len(set(n_new)) == 1 and not any(prefix):  # its own dense K/V: timing only
            res.append(measure("cudnn_dense", dense_cudnn(n_new), inputs, None, flops, est))
        for block_kv, stages, pair in TILES[:2] if args.quick else TILES:
            if smem_bytes(D, block_kv, stages) > MAX_SMEM:
                continue
            for persist in (False, True) if args.persistent else (False,):
                fn = lambda *x, bk=block_kv, st=stages, p=pair, ps=persist: flash_prefill(
                    *x, block_kv=bk, num_stages=st, pair_heads=p, persistent=ps)
                label = f"mosaic kv{block_kv} s{stages}" + ("" if pair else " fa3") + (" persistent" if persist else "")
                res.append(measure(label, fn, inputs, ref, flops, est))
        for kind in ("mosaic", "mosaic persistent") if args.persistent else ("mosaic",):
            best = max((r.get("tflops", 0.0) for r in res if r["name"].startswith("mosaic")
                        and r["name"].endswith("persistent") == kind.endswith("persistent")), default=0.0)
            if name in TARGETS:
                print(f"  best {kind} {best:.1f} TFLOP/s vs target {TARGETS[name]:.0f} "
                      f"({'met' if best >= TARGETS[name] else 'NOT met'}); {best / matmul:.0%} of the matmul rate")
        rows.append({"case": name, "tokens": sum(n_new), "flops": flops, "target_tflops": TARGETS.get(name),
                     "results": res})
    write_json(args.json, {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                           "mosaic_lowering": _common.LOWERING, "matmul_tflops": matmul, "prefill": rows,
                           "persistent_programs": default_programs() if args.persistent else None})


if __name__ == "__main__":
    main()
