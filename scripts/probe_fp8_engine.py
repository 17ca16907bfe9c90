"""Where the engine's fp8 decode kernel loses against the stripped one (docs/fp8_kv_cache.md, "GPU").

    python scripts/probe_fp8_engine.py time [--json PATH]     # H200: ~1.5 min; CPU: a tiny interpret-mode run
    python scripts/probe_fp8_engine.py splits [--json PATH]   # H200: ~2 min: context splits on W-like lengths
    XLA_FLAGS=--xla_gpu_enable_command_buffer= ncu --kernel-name regex:paged_attention --launch-skip 2 \
        --launch-count 1 --clock-control none --set full -o FILE python scripts/probe_fp8_engine.py ncu VARIANT [B CTX]

time: 28 calls chained in one jit (as a model step runs them: one program, no gaps between executables), per
variant and shape, in us a layer and TB/s of the K/V bytes read. Variants: the engine kernel (paged_attention_qkv:
q/k RMSNorm + RoPE, the new token's K/V written, V pages in pairs) against the same kernel without the prologue
(paged_attention on q), each on fp8 and bf16 pages, and the engine kernel with one context split. Shapes: uniform
lengths, and W-like ones (random lengths, rows longest first, as the engine orders them).
ncu: four calls of one variant, for Nsight Compute to pick one.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.paged_attention import paged_attention, paged_attention_qkv  # noqa: E402
from pallas_kernels.quant import pack_pairs, quantize, scale_for_amax  # noqa: E402
from timing import time_loop  # noqa: E402

interp = jax.devices()[0].platform == "cpu"
H, K, D, BS = 16, 8, 128, 16
LAYERS = 2 if interp else 28
VARIANTS = ("qkv_fp8", "plain_fp8", "qkv_bf16", "plain_bf16", "qkv_fp8_split1", "qkv_fp8_n128")


def case(B, lens, fp8: bool):
    """Caches holding every row's pages (scattered), tables, lens [B], the row order (longest first)."""
    width = -(-int(max(lens)) // BS)
    pages = B * width + 16
    kk, kv, kp = jax.random.split(jax.random.PRNGKey(B), 3)
    k = jax.random.normal(kk, (pages, BS, K, D), jnp.bfloat16)
    v = jax.random.normal(kv, (pages, BS, K, D), jnp.bfloat16)
    tables = jax.random.permutation(kp, pages)[:B * width].astype(jnp.int32).reshape(B, width)
    lens = jnp.asarray(lens, jnp.int32)
    order = jnp.argsort(-lens).astype(jnp.int32)
    scales = {}
    if fp8:
        ks, vs = (scale_for_amax(jnp.abs(x).max((0, 1, 3))) for x in (k, v))
        k, v = quantize(k, ks), pack_pairs(quantize(v, vs))
        scales = dict(k_scale=ks, v_scale=vs)
    return k, v, tables, lens, order, scales


def step_fn(variant: str, scales: dict, opts=None):
    """carry -> carry after LAYERS chained calls. qkv variants carry (k, v) (donated, written in place); plain ones
    carry q (each call's output is the next call's q). opts: the kernel's tile options (else the variant's)."""
    opts = dict(opts or (dict(num_splits=1) if variant.endswith("split1") else {}))
    if variant.endswith("n128"):
        opts = dict(block_n=128, num_warps=2, num_stages=3)
    if variant.startswith("qkv"):
        def run(carry, qkv, norm, cos, tables, lens, order):
            k, v = carry
            for _ in range(LAYERS):
                _, k, v = paged_attention_qkv(qkv, norm, norm, cos, cos, k, v, tables, lens, eps=1e-6, order=order,
                                              interpret=interp, **opts, **scales)
            return k, v
    else:
        def run(q, qkv, norm, cos, tables, lens, order, caches):
            for _ in range(LAYERS):
                q = paged_attention(q, *caches, tables, lens, order=order, interpret=interp, **opts, **scales)
            return q
    return run


def time_variant(variant, B, lens, opts=None):
    fp8 = "fp8" in variant
    k, v, tables, lens_a, order, scales = case(B, lens, fp8)
    qkv = jax.random.normal(jax.random.PRNGKey(3), (B, H + 2 * K, D), jnp.bfloat16)
    norm, cos = jnp.ones((D,), jnp.bfloat16), jnp.ones((B, D), jnp.float32)
    nbytes = LAYERS * int(np.sum(lens)) * K * D * 2 * (1 if fp8 else 2)
    est = nbytes / 3e12
    fn = step_fn(variant, scales, opts)
    if variant.startswith("qkv"):
        s = time_loop(fn, (k, v), qkv, norm, cos, tables, lens_a, order, est_s=est, donate=True, repeats=5)
    else:
        run = fn
        s = time_loop(lambda q, *a: run(q, *a), qkv[:, :H], qkv, norm, cos, tables, lens_a, order, (k, v),
                      est_s=est, repeats=5)
    return dict(variant=variant, B=B, **(opts or {}), tokens=int(np.sum(lens)), us_layer=s / LAYERS * 1e6, tbps=nbytes / s / 1e12)


def shapes():
    if interp:
        return [("uniform", 2, [40, 40])]
    rng = np.random.default_rng(0)
    out = [("uniform", 256, [1024] * 256), ("uniform", 64, [4096] * 64)]
    for B in (256, 128, 64, 32):       # W-like: prompts 100-1024 plus what was generated so far
        out.append(("w", B, list(rng.integers(100, 1024, B) + rng.integers(0, 1024, B))))
    return out


def record(rows: list, fn, **ident):
    """Append fn()'s row (or the error it raised, with ident) to rows, and print it."""
    try:
        r = fn()
    except Exception as e:  # noqa: BLE001
        r = dict(ident, error=f"{type(e).__name__}: {str(e)[:300]}")
    rows.append(r)
    print(r, flush=True)


def save(json_path, what: str, rows: list):
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(what=what, rows=rows), f, indent=1)


def time_all(json_path):
    rows = []
    for kind, B, lens in shapes():
        for variant in VARIANTS:
            record(rows, lambda: dict(kind=kind, **time_variant(variant, B, lens)), kind=kind, variant=variant, B=B)
    save(json_path, "fp8 engine decode kernel: prologue, splits, tiles (28 calls chained in one jit)", rows)


def splits(json_path):
    """The engine kernel on W-like lengths at each context-split count (and 128-token tiles for fp8)."""
    rows = []
    rng = np.random.default_rng(1)
    cases = [(2, [40, 17])] if interp else [(B, list(rng.integers(100, 1024, B) + rng.integers(0, 1024, B)))
                                            for B in (256, 128, 64, 32, 16, 8)]
    for B, lens in cases:
        for variant in ("qkv_fp8", "qkv_bf16"):
            tiles = [{}] + ([dict(block_n=128, num_warps=2, num_stages=3)] if variant == "qkv_fp8" else [])
            for t in tiles:
                for n in (1, 2) if interp else (1, 2, 4, 8, 16):
                    record(rows, lambda: time_variant(variant, B, lens, dict(t, num_splits=n)), variant=variant, B=B,
                           num_splits=n)
    save(json_path, "engine decode kernel: context splits on W-like lengths (28 calls chained)", rows)


def ncu_calls(variant: str, B: int, ctx: int):
    """Four single calls of one variant (pages made on the host: under ncu an XLA fp8 convert kernel crashed)."""
    import ml_dtypes
    fp8 = "fp8" in variant
    k, v, tables, lens, order, _ = case(B, [ctx] * B, False)
    scales = {}
    if fp8:
        pages = []
        for x in (k, v):
            x = np.asarray(x, np.float32)
            s = np.abs(x).max((0, 1, 3)) / 448.0
            pages.append((np.clip(x / s[None, None, :, None], -448, 448).astype(ml_dtypes.float8_e4m3fn), s))
        (kq, ks), (vq, vs) = pages
        vb = vq.view(np.uint8).astype(np.uint16)
        k, v = jax.device_put(kq), jax.device_put(vb[..., 0::2] | (vb[..., 1::2] << 8))
        scales = dict(k_scale=jnp.asarray(ks), v_scale=jnp.asarray(vs))
    qkv = jax.random.normal(jax.random.PRNGKey(3), (B, H + 2 * K, D), jnp.bfloat16)
    norm, cos = jnp.ones((D,), jnp.bfloat16), jnp.ones((B, D), jnp.float32)
    global LAYERS
    LAYERS = 1
    fn = step_fn(variant, scales)
    if variant.startswith("qkv"):
        f = jax.jit(fn, donate_argnums=0)
        carry = (k, v)
        for _ in range(4):
            carry = f(carry, qkv, norm, cos, tables, lens, order)
    else:
        f = jax.jit(fn)
        carry = qkv[:, :H]
        for _ in range(4):
            carry = f(carry, qkv, norm, cos, tables, lens, order, (k, v))
    jax.block_until_ready(carry)
    print("done", variant, B, ctx)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["time", "splits", "ncu"])
    ap.add_argument("variant", nargs="?", default="qkv_fp8", choices=VARIANTS)
    ap.add_argument("batch", nargs="?", type=int, default=256)
    ap.add_argument("ctx", nargs="?", type=int, default=1024)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.what == "time":
        time_all(a.json)
    elif a.what == "splits":
        splits(a.json)
    else:
        ncu_calls(a.variant, a.batch, a.ctx)
