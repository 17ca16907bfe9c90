"""Attention kernel bench on Qwen3-0.6B shapes (H=16, K=8, D=128, bf16, page 16): every attention backend.

Columns are the engine's backends, called as the engine calls them (jaxinfer.model.attention.attention_fns):
xla (plain jnp), pallas (our kernels; "engine" = the fused decode kernel), cudnn (JAX's cuDNN attention over
the paged cache), triton (raw Triton decode; its prefill is pallas's), mosaic (the Mosaic GPU kernels, Hopper);
"triton jt" is the same Triton kernel through jax-triton's own triton_call, "cuDNN dense" cuDNN on contiguous
equal-length inputs (no pages). A backend this machine cannot run (cudnn, triton, mosaic on a CPU; mosaic
before Hopper; triton without jax-triton) is skipped with the reason. `--impls` keeps some columns only.

Decode: effective TB/s = bytes of K and V the batch really needs / time, next to the copy bandwidth measured in
the same run; the fp8 columns run both decode kernels on float8_e4m3fn pages (per-kv-head scales), whose TB/s
counts the bytes actually read (half of bf16's). Prefill: causal TFLOP/s (only the visible half of each score
matrix counted), next to the bf16 matmul rate measured in the same run. Each time is the median of several
timed runs of `n` back-to-back dispatches of the jitted kernel (each output fed back as the next query);
dispatch is asynchronous, so it hides behind kernels longer than ~20-40 us (batch-1 decode rows: dispatch-bound).

  PYTHONPATH=. python scripts/bench_kernels.py [--quick] [--sweep] [--impls pallas,mosaic,...] [--json PATH]
  PYTHONPATH=. python scripts/bench_kernels.py --smoke   # interpret mode, tiny shapes (what a CPU always runs)
"""
from __future__ import annotations

import argparse
import functools
import warnings

warnings.filterwarnings("ignore", message=".*Triton.*deprecated.*")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxinfer.model.attention import attention_fns  # noqa: E402
from pallas_kernels.flash_attention import flash_attention  # noqa: E402
from pallas_kernels.paged_attention import paged_attention, paged_attention_qkv  # noqa: E402
from pallas_kernels.quant import pack_pairs, quantize, scale_for_amax  # noqa: E402

from bench import write_json  # noqa: E402
from kernel_tables import print_decode, print_prefill  # noqa: E402
import timing  # noqa: E402
from jaxinfer.cli_types import head_counts  # noqa: E402
from timing import copy_bandwidth, time_loop  # noqa: E402

H, K, D, PAGE, DTYPE = 16, 8, 128, 16, jnp.bfloat16


def machine_ceilings(smoke: bool) -> dict:
    """Copy bandwidth (read + write bytes of a 2 GiB array) and bf16 matmul rate (8192^3), measured now."""
    copy, m = copy_bandwidth(1 << (14 if smoke else 30)), 256 if smoke else 8192
    a = jnp.ones((m, m), DTYPE) * 0.001
    mm_s = time_loop(lambda x: jnp.dot(x, a), a, est_s=1.5e-3)
    return {"copy_tbps": copy / 1e12, "matmul_tflops": 2 * m ** 3 / mm_s / 1e12}


def set_heads(h: int, k: int) -> None:
    """Another model's head counts for every column (and for kernel_sweep, which imports this module)."""
    import bench_kernels
    global H, K
    H, K = bench_kernels.H, bench_kernels.K = h, k


def paged_cache(key, batch, max_blocks):
    """batch * max_blocks + 16 pages (more than the tables use, as in the engine: cuDNN reads the shared pool),
    each row's pages scattered by a permutation."""
    kk, kv, kp = jax.random.split(key, 3)
    pages = batch * max_blocks + 16
    k = jax.random.normal(kk, (pages, PAGE, K, D), DTYPE)
    v = jax.random.normal(kv, (pages, PAGE, K, D), DTYPE)
    tables = jax.random.permutation(kp, pages)[:batch * max_blocks].astype(jnp.int32).reshape(batch, max_blocks)
    return k, v, tables


def unavailable(backend: str, smoke: bool = False) -> str | None:
    """Why this machine cannot time `backend` (None: it can)."""
    if backend in ("cudnn", "triton", "mosaic") and jax.default_backend() != "gpu":
        return f"{backend} needs a CUDA GPU (JAX backend here: {jax.default_backend()})"
    if backend == "mosaic" and float(getattr(jax.devices()[0], "compute_capability", 0) or 0) < 9.0:
        return f"mosaic needs a Hopper GPU (compute capability 9.0+), not {jax.devices()[0].device_kind}"
    if backend == "triton":
        from pallas_kernels._triton_ffi import check_ready
        try:
            check_ready()                 # the packages, and the ptxas jaxlib runs to load the kernels
        except ValueError as e:
            return str(e)
    return None


_SAID: set[str] = set()


def backend_fns(smoke: bool, names=("xla", "pallas", "cudnn", "triton", "mosaic")) -> dict:
    """name -> (prefill_fn, decode_fn) for the backends this machine runs; prints why the others are skipped."""
    out = {}
    for name in names:
        why = unavailable(name, smoke)
        if why and why not in _SAID:
            _SAID.add(why)
            print(f"  skipping {name}: {why}")
        if why:
            continue
        out[name] = attention_fns(name, interpret=smoke)
    return out


def qkv_decode(opts, smoke, **fp8):
    """The engine's decode kernel (paged_attention_qkv: q/k RMSNorm + RoPE, K/V write, attention) as a step
    carrying (k_cache, v_cache), donated so they are updated in place as in the engine. (Feeding the output
    back into qkv, as this harness once did, added a copy kernel per call: 349 vs 288 us at 256 x 1024.)"""
    def run(carry, qkv, norm, cos, tables, lens):
        _, k, v = paged_attention_qkv(qkv, norm, norm, cos, cos, *carry, tables, lens, eps=1e-6, interpret=smoke,
                                      **opts, **fp8)
        return k, v
    return run


def fp8_pages(k, v):
    """k, v -> float8_e4m3fn pages and their per-kv-head dequantisation scales (from each head's amax)."""
    ks, vs = (scale_for_amax(jnp.abs(x).max((0, 1, 3))) for x in (k, v))
    return quantize(k, ks), quantize(v, vs), dict(k_scale=ks, v_scale=vs)


# fp8: paged_attention on fp8 pages; fp8_qkv: the engine kernel on the engine's fp8 layout (V in pairs); fp8_qkv_plain
# (only when named in --impls): the engine kernel with V as plain fp8 pages (the layout before pairs: the A/B)
DECODE_IMPLS = ("xla", "pallas", "pallas_qkv", "cudnn", "triton", "triton_jt", "mosaic", "fp8", "fp8_qkv")
EXTRA_DECODE_IMPLS = ("fp8_qkv_plain",)


def bench_decode(batch, ctx, ceil, opts, smoke, impls=DECODE_IMPLS):
    max_blocks = -(-ctx // PAGE)
    k, v, tables = paged_cache(jax.random.PRNGKey(batch * 7 + ctx), batch, max_blocks)
    q = jax.random.normal(jax.random.PRNGKey(1), (batch, H, D), DTYPE)
    lens = jnp.full((batch,), ctx, jnp.int32)
    nbytes = batch * ctx * K * D * 2 * 2  # K and V rows really needed
    est = nbytes / 2e12 + 5e-6
    wanted = [b for b in ("xla", "cudnn", "triton", "mosaic") if b in impls or b + "_jt" in impls]
    backends = backend_fns(smoke, wanted)
    fns = {name: fs[1] for name, fs in backends.items()}
    fns["pallas"] = lambda q, k, v, t, l: paged_attention(q, k, v, t, l, interpret=smoke, **opts)
    if "triton" in fns and "triton_jt" in impls:
        from pallas_kernels.triton_decode import triton_paged_decode
        fns["triton_jt"] = functools.partial(triton_paged_decode, path="jax_triton")
    row = {"batch": batch, "ctx": ctx, "bytes": nbytes}
    for name, fn in fns.items():
        if name not in impls:
            continue
        try:
            row[name + "_s"] = time_loop(fn, q, k, v, tables, lens, est_s=est * (6 if name == "xla" else 1))
        except Exception as err:  # noqa: BLE001
            row[name + "_s"] = None
            print(f"  decode {name} B={batch} ctx={ctx} failed: {type(err).__name__}: {str(err)[:300]}")
    qkv = jax.random.normal(jax.random.PRNGKey(3), (batch, H + 2 * K, D), DTYPE)
    norm, cos = jnp.ones((D,), DTYPE), jnp.ones((batch, D), jnp.float32)
    kq, vq, fp8 = fp8_pages(k, v) if {"fp8", "fp8_qkv", "fp8_qkv_plain"} & set(impls) else (None, None, {})
    runs = {"pallas_qkv": lambda: time_loop(qkv_decode(opts, smoke), (k, v), qkv, norm, cos, tables, lens,
                                            est_s=est, donate=True),
            "fp8": lambda: time_loop(lambda q, k, v, t, l: paged_attention(q, k, v, t, l, interpret=smoke, **opts,
                                                                           **fp8), q, kq, vq, tables, lens,
                                     est_s=est / 2),
            "fp8_qkv": lambda: time_loop(qkv_decode(opts, smoke, **fp8), (jnp.copy(kq), pack_pairs(vq)), qkv, norm,
                                         cos, tables, lens, est_s=est / 2, donate=True),
            "fp8_qkv_plain": lambda: time_loop(qkv_decode(opts, smoke, **fp8), (kq, vq), qkv, norm, cos, tables, lens,
                                               est_s=est / 2, donate=True)}
    for name, run in runs.items():
        if name in impls:
            try:
                row[name + "_s"] = run()
            except Exception as err:  # noqa: BLE001
                row[name + "_s"] = None
                print(f"  decode {name} B={batch} ctx={ctx} failed: {type(err).__name__}: {str(err)[:300]}")
    reads = {name: nbytes for name in ("xla", "pallas", "pallas_qkv", "cudnn", "triton", "triton_jt", "mosaic")}
    for name, read in {**reads, "fp8": nbytes // 2, "fp8_qkv": nbytes // 2, "fp8_qkv_plain": nbytes // 2}.items():
        if row.get(name + "_s"):      # bytes actually read: fp8 pages are half of bf16's
            row[name + "_tbps"] = read / row[name + "_s"] / 1e12
    if row.get("pallas_s"):
        row["pct_copy_bw"] = 100 * row["pallas_tbps"] / ceil["copy_tbps"]
    return row


def prefill_case(n_new, prefix, key):
    ctx = [n + p for n, p in zip(n_new, prefix)]
    batch, max_blocks = len(n_new), -(-max(ctx) // PAGE)
    k, v, tables = paged_cache(key, batch, max_blocks)
    cu = jnp.asarray([0] + list(jnp.cumsum(jnp.asarray(n_new))), jnp.int32)
    q = jax.random.normal(jax.random.PRNGKey(2), (sum(n_new), H, D), DTYPE)
    flops = sum(4 * D * H * (n * p + n * (n + 1) // 2) for n, p in zip(n_new, prefix))  # visible scores only
    return q, k, v, tables, cu, jnp.asarray(ctx, jnp.int32), flops


PREFILL_IMPLS = ("xla", "pallas", "cudnn", "triton", "mosaic", "cudnn_dense")


def bench_prefill(name, n_new, prefix, ceil, opts, smoke, impls=PREFILL_IMPLS):
    q, k, v, tables, cu, lens, flops = prefill_case(n_new, prefix, jax.random.PRNGKey(len(n_new)))
    est = flops / 2e14 + 1e-5
    wanted = [b for b in ("xla", "cudnn", "triton", "mosaic") if b in impls or b + "_dense" in impls]
    backends = backend_fns(smoke, wanted)
    fns = {name: fs[0] for name, fs in backends.items()}
    fns["pallas"] = lambda q, k, v, t, c, l: flash_attention(q, k, v, t, c, l, interpret=smoke, **opts)
    if "triton" in fns:   # the raw Triton prefill kernel (the triton backend itself prefills with Pallas)
        from pallas_kernels.triton_prefill import triton_prefill
        fns["triton"] = triton_prefill
    row = {"case": name, "tokens": sum(n_new), "flops": flops}
    for impl, fn in fns.items():
        if impl not in impls:
            continue
        try:
            row[impl + "_s"] = time_loop(fn, q, k, v, tables, cu, lens, est_s=est * (20 if impl == "xla" else 1))
        except Exception as err:  # noqa: BLE001
            row[impl + "_s"] = None
            print(f"  prefill {impl} {name} failed: {type(err).__name__}: {str(err)[:300]}")
    uniform = len(set(n_new)) == 1 and not any(prefix)
    if "cudnn_dense" in impls and "cudnn" in backends and uniform:  # [B, n, heads, D], contiguous K/V
        b, n = len(n_new), n_new[0]
        kd = jax.random.normal(jax.random.PRNGKey(5), (b, n, K, D), DTYPE)
        vd = jax.random.normal(jax.random.PRNGKey(6), (b, n, K, D), DTYPE)

        def dense(q, kd, vd):
            out = jax.nn.dot_product_attention(q.reshape(b, n, H, D), kd, vd, is_causal=True,
                                               implementation="cudnn")
            return out.reshape(q.shape)
        try:
            row["cudnn_dense_s"] = time_loop(dense, q, kd, vd, est_s=est)
        except Exception as err:  # noqa: BLE001
            row["cudnn_dense_s"] = None
            print(f"  prefill cudnn dense {name} failed: {type(err).__name__}: {str(err)[:300]}")
    for impl in ("xla", "pallas", "cudnn", "triton", "mosaic", "cudnn_dense"):
        if row.get(impl + "_s"):
            row[impl + "_tflops"] = flops / row[impl + "_s"] / 1e12
    if row.get("pallas_s"):
        row["pct_matmul_peak"] = 100 * row["pallas_tflops"] / ceil["matmul_tflops"]
    return row


PREFILL_CASES = {  # name: (new tokens per sequence, cached prefix per sequence)
    "1x512": ([512], [0]), "4x512": ([512] * 4, [0] * 4), "8x1024": ([1024] * 8, [0] * 8),
    "16x1024": ([1024] * 16, [0] * 16), "1x8192": ([8192], [0]),
    "mixed+prefix": ([2048, 1024, 1024, 512, 512, 1536, 1024, 512], [0, 2048, 0, 1024, 3072, 512, 0, 256]),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--sweep", action="store_true", help="also run a small tile-size sweep")
    ap.add_argument("--only-sweep", action="store_true", help="run only the tile-size sweep")
    ap.add_argument("--decode-only", action="store_true", help="with a sweep: no prefill tiles")
    ap.add_argument("--impls", default=None, help="comma-separated columns to time (default: all); decode: "
                    + ",".join(DECODE_IMPLS + EXTRA_DECODE_IMPLS) + "; prefill: " + ",".join(PREFILL_IMPLS))
    ap.add_argument("--json", help="write all results to this path")
    ap.add_argument("--smoke", action="store_true", help="CPU interpret mode, tiny shapes (checks the script)")
    ap.add_argument("--heads", type=head_counts, default=None, metavar="H,K",
                    help="q and kv heads (default 16,8: Qwen3-0.6B; 32,8 is Qwen3-8B's GQA group of 4)")
    args = ap.parse_args()
    if args.heads:
        set_heads(*args.heads)
    picked = None if args.impls is None else set(args.impls.split(","))
    unknown = (picked or set()) - set(DECODE_IMPLS + EXTRA_DECODE_IMPLS) - set(PREFILL_IMPLS)
    if unknown:
        raise SystemExit(f"--impls: unknown column(s) {sorted(unknown)}")
    dec_impls = DECODE_IMPLS if picked is None else tuple(i for i in DECODE_IMPLS + EXTRA_DECODE_IMPLS if i in picked)
    pre_impls = PREFILL_IMPLS if picked is None else tuple(i for i in PREFILL_IMPLS if i in picked)
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    if jax.default_backend() == "cpu" and not args.smoke:      # (the GPU's sizes would run for hours, interpreted)
        print("no GPU: running --smoke (interpret mode, tiny shapes)", flush=True)
        args.smoke = True
    timing.ONE_CALL = args.smoke
    ceil = machine_ceilings(args.smoke)
    print(f"measured ceilings: XLA elementwise copy {ceil['copy_tbps']:.2f} TB/s (read + write; a raw device copy "
          f"reaches ~4.3 TB/s on an H200), bf16 matmul {ceil['matmul_tflops']:.0f} TFLOP/s")
    from kernel_sweep import sweep
    if args.only_sweep:
        return write_json(args.json, {"ceilings": ceil, "sweep": sweep(ceil, args.smoke, prefill=not args.decode_only)})
    if args.smoke:
        batches, contexts, cases = (2,), (40,), {"2x24": ([24, 9], [0, 20])}
    elif args.quick:
        batches, contexts = (1, 64, 256), (1024, 4096)
        cases = {k: PREFILL_CASES[k] for k in ("1x512", "8x1024", "1x8192", "mixed+prefix")}
    else:
        batches, contexts, cases = (1, 16, 64, 256), (128, 512, 1024, 2048, 4096), PREFILL_CASES
    dec_opts, pre_opts = (dict(block_n=16), dict(block_q=16, block_k=16)) if args.smoke else ({}, {})
    decode, prefill = [], []
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "ceilings": ceil,
              "decode": decode, "prefill": prefill}
    for b in batches:
        for ctx in contexts:
            decode.append(bench_decode(b, ctx, ceil, dec_opts, args.smoke, impls=dec_impls))
            print(f"  decode B={b} ctx={ctx} done", flush=True)
            write_json(args.json, result)        # after each case: a run cut short keeps what it measured
    print_decode(decode)
    for name, (n_new, prefix) in cases.items():
        prefill.append(bench_prefill(name, n_new, prefix, ceil, pre_opts, args.smoke, impls=pre_impls))
        print(f"  prefill {name} done", flush=True)
        write_json(args.json, result)
    print_prefill(prefill)
    if args.sweep and not args.smoke:
        result["sweep"] = sweep(ceil, args.smoke, prefill=not args.decode_only)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
