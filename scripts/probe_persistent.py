"""Probe: a small-batch decode layer's matmuls as ONE persistent kernel with grid barriers, against XLA.

Why: at batch 1 a Qwen3-0.6B decode step is ~290 kernels (10.4 a layer) of a few microseconds each; its four
GEMMs a layer read their 31 MB at ~1.35 TB/s because each short kernel pays its launch, ramp-up and tail
(docs/performance.md, tenth and eleventh runs). This probe measures what one kernel that runs every layer's
matmul phases back to back (P programs, one per SM, a grid-wide barrier between phases) gets instead.

Per layer, the four phases (attention is left out: its stand-in is the q part of qkv, so only the matmuls and
their fused neighbours are timed; activations [M, ...], M <= 16 rows, fp32 residual):
  A  qkv  = RMSNorm(res[l]) @ Wqkv[l]                        (norm folded in)
  B  mid  = res[l] + qkv[:, :NQ] @ Wo[l]                     (residual in the epilogue)
  C  act  = silu(RMSNorm(mid) @ Wg[l]) * (RMSNorm(mid) @ Wu[l])
  D  res[l+1] = mid + act @ Wd[l]
Variants, each one jit over all layers:
  xla         the same math in jnp (XLA: cuBLAS GEMMs + fusions, as the engine's decode layers run)
  split       one pallas_call per phase (4 kernels a layer, norms / SwiGLU / residuals fused in)
  persistent  one pallas_call for everything, P programs, a grid barrier (atomic counter) between phases
  barriers    the persistent kernel's barriers alone (no work): what a barrier costs
  *_nk        split / persistent with the weights stored transposed ([L, N, K]: tiles of contiguous K)
The persistent kernel needs all P programs resident at once (P <= SMs); it deadlocks in interpret mode, so on
a CPU (--cpu, tiny sizes) it runs with one program.

Result on the H200 (docs/performance.md, twenty-eighth run), K tiles of 256 and 4 stages, us a layer at 1 / 8
rows: persistent 38.7 / 34.8, one kernel a phase 31.6 / 31.0 (~1 TB/s either way, weights [K, N] or [N, K]), a
barrier ~1.5 us: no faster than XLA's cuBLAS GEMMs and fusions (~29.5 us a layer in the engine at one row).

    python scripts/probe_persistent.py [--rows 1 8] [--json OUT]          (GPU)
    python scripts/probe_persistent.py --cpu                              (CPU check of the split kernels)
"""
from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

EPS = 1e-6


def _rows(M):
    return jnp.minimum(jnp.arange(16), M - 1)      # tensor-core dots take >= 16 rows: pad by repeating the last


def _load(ref, lead, M, cols):
    """[16, len(cols)] rows of ref[*lead] (clamped to M), bypassing L1: other programs wrote them."""
    return plt.load(ref.at[(*lead, _rows(M)[:, None], cols[None, :])]).astype(jnp.float32)


def _inv_rms(x_ref, lead, M, E, BK):
    """[16] 1/rms of x_ref[*lead]'s rows, read in BK chunks."""
    def body(i, ss):
        x = _load(x_ref, lead, M, i * BK + jnp.arange(BK))
        return ss + jnp.sum(x * x, axis=1)
    ss = jax.lax.fori_loop(0, E // BK, body, jnp.zeros((16,), jnp.float32))
    return jax.lax.rsqrt(ss / E + EPS)


def _matmul(x_ref, lead, w_ref, layer, col0, BN, K, BK, M, *, g_ref=None, inv=None, w2_col0=None, nk=False):
    """acc [16, BN] = (RMSNorm'd) x_ref[*lead][:, :K] @ W[layer, :, col0 : col0 + BN] (and a second column
    block at w2_col0, for SwiGLU's up half)."""
    def body(i, carry):
        acc, acc2 = carry
        k0 = i * BK
        x = _load(x_ref, lead, M, k0 + jnp.arange(BK))
        if g_ref is not None:
            x = x * inv[:, None] * g_ref[layer, pl.ds(k0, BK)].astype(jnp.float32)[None, :]
        x = x.astype(w_ref.dtype)
        def tile(c0):      # nk: W stored [L, N, K], each tile's rows BK contiguous elements
            return w_ref[layer, pl.ds(c0, BN), pl.ds(k0, BK)] if nk else w_ref[layer, pl.ds(k0, BK), pl.ds(c0, BN)]
        acc = acc + plt.dot(x, tile(col0), trans_b=nk)
        if w2_col0 is not None:
            acc2 = acc2 + plt.dot(x, tile(w2_col0), trans_b=nk)
        return acc, acc2
    z = jnp.zeros((16, BN), jnp.float32)
    return jax.lax.fori_loop(0, K // BK, body, (z, z))


def _store_rows(o_ref, lead, cols, val, M):
    o_ref[(*lead, _rows(M)[:, None], cols[None, :])] = val.astype(o_ref.dtype)


def _phase(p, layer, item, refs, dims):
    """Item `item` of phase p (0..3) of layer `layer`."""
    (g1, g2, wqkv, wo, wgu, wd, res, mid, qkv, act) = refs
    M, E, NQ, NQKV, I, BN, BK, nk = dims
    mm = functools.partial(_matmul, nk=nk)
    if p == 0:
        inv = _inv_rms(res, (layer,), M, E, BK)
        acc, _ = mm(res, (layer,), wqkv, layer, item * BN, BN, E, BK, M, g_ref=g1, inv=inv)
        _store_rows(qkv, (), item * BN + jnp.arange(BN), acc, M)
    elif p == 1:
        bn = BN // 2
        acc, _ = mm(qkv, (), wo, layer, item * bn, bn, NQ, BK, M)
        cols = item * bn + jnp.arange(bn)
        _store_rows(mid, (layer,), cols, _load(res, (layer,), M, cols) + acc, M)
    elif p == 2:
        inv = _inv_rms(mid, (layer,), M, E, BK)
        g, u = mm(mid, (layer,), wgu, layer, item * BN, BN, E, BK, M, g_ref=g2, inv=inv,
                            w2_col0=I + item * BN)
        _store_rows(act, (), item * BN + jnp.arange(BN), g / (1.0 + jnp.exp(-g)) * u, M)
    else:
        bn = BN // 2
        acc, _ = mm(act, (), wd, layer, item * bn, bn, I, BK, M)
        cols = item * bn + jnp.arange(bn)
        _store_rows(res, (layer + 1,), cols, _load(mid, (layer,), M, cols) + acc, M)


def _items(dims):
    M, E, NQ, NQKV, I, BN, BK, nk = dims
    return (NQKV // BN, E // (BN // 2), I // BN, E // (BN // 2))


def _barrier(cnt_ref, target, gpu):
    if gpu:
        plt.debug_barrier()                                # this program's stores are issued
    plt.atomic_add(cnt_ref, (jnp.int32(0),), jnp.int32(1))            # arrive (acq_rel, gpu scope)
    seen = jax.lax.while_loop(lambda v: v < target,
                              lambda v: plt.load(cnt_ref.at[jnp.int32(0)], volatile=True), jnp.int32(0))
    # acquire what the others wrote; it also uses the spin's result: a loop whose result nothing uses is
    # dropped from the kernel's jaxpr (its volatile load has no effect), which is what the twenty-eighth run ran
    plt.atomic_add(cnt_ref, (jnp.int32(0),), seen * 0)
    if gpu:
        plt.debug_barrier()


def _persistent_kernel(layer_ref, x0, g1, g2, wqkv, wo, wgu, wd, cnt_in, res_in, mid_in, qkv_in, act_in,
                       res, mid, qkv, act, cnt, *, L, dims, P, work, gpu):
    del layer_ref, x0, cnt_in, res_in, mid_in, qkv_in, act_in    # aliased to the outputs
    pid = pl.program_id(0)
    refs = (g1, g2, wqkv, wo, wgu, wd, res, mid, qkv, act)
    n_items = _items(dims)

    def layer_body(layer, _):
        for p in range(4):
            if work:
                n = n_items[p]

                def item_body(j, c, p=p):
                    _phase(p, layer, pid + j * P, refs, dims)
                    return c
                jax.lax.fori_loop(0, (n - pid + P - 1) // P, item_body, 0)
            _barrier(cnt, (layer * 4 + p + 1) * P, gpu)
        return 0
    jax.lax.fori_loop(0, L, layer_body, 0)


def _split_kernel(layer_ref, x0, g1, g2, wqkv, wo, wgu, wd, res_in, mid_in, qkv_in, act_in,
                  res, mid, qkv, act, *, dims, p):
    del x0, res_in, mid_in, qkv_in, act_in
    _phase(p, layer_ref[0], pl.program_id(0), (g1, g2, wqkv, wo, wgu, wd, res, mid, qkv, act), dims)


def _buffers(x0, L, dims):
    M, E, NQ, NQKV, I, BN, BK, nk = dims
    res = jnp.zeros((L + 1, M, E), jnp.float32).at[0].set(x0)
    return (res, jnp.zeros((L, M, E), jnp.float32), jnp.zeros((M, NQKV), jnp.bfloat16),
            jnp.zeros((M, I), jnp.bfloat16))


def _out_shapes(bufs):
    return tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in bufs)


@functools.partial(jax.jit, static_argnames=("variant", "BN", "BK", "P", "num_warps", "num_stages", "interpret"))
def run(x0, params, *, variant, BN=32, BK=128, P=128, num_warps=4, num_stages=3, interpret=False):
    """Final residual [M, E] after all layers."""
    g1, g2, wqkv, wo, wgu, wd = params
    nk = variant.endswith("_nk")              # the weights come transposed: [L, N, K]
    variant = variant.removesuffix("_nk")
    L, E, NQKV = (wqkv.shape[0], wqkv.shape[2], wqkv.shape[1]) if nk else wqkv.shape
    NQ, I = (wo.shape[2], wd.shape[2]) if nk else (wo.shape[1], wd.shape[1])
    M = x0.shape[0]
    dims = (M, E, NQ, NQKV, I, BN, BK, nk)
    if variant == "xla":
        return _xla(x0, params)
    cp = plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    bufs = _buffers(x0, L, dims)
    layer0 = jnp.zeros((1,), jnp.int32)
    if variant in ("persistent", "barriers"):
        cnt = jnp.zeros((1,), jnp.int32)
        kern = functools.partial(_persistent_kernel, L=L, dims=dims, P=P, work=variant == "persistent",
                                 gpu=not interpret)
        outs = pl.pallas_call(kern, grid=(P,), out_shape=_out_shapes(bufs) + (jax.ShapeDtypeStruct((1,), jnp.int32),),
                              input_output_aliases={9: 0, 10: 1, 11: 2, 12: 3, 8: 4}, compiler_params=cp,
                              interpret=interpret, name="persistent_layers")(layer0, x0, g1, g2, wqkv, wo, wgu, wd,
                                                                             cnt, *bufs)
        return outs[0][L]
    for layer in range(L):
        lid = jnp.full((1,), layer, jnp.int32)
        for p, n in enumerate(_items(dims)):
            bufs = pl.pallas_call(functools.partial(_split_kernel, dims=dims, p=p), grid=(n,),
                                  out_shape=_out_shapes(bufs), input_output_aliases={8: 0, 9: 1, 10: 2, 11: 3},
                                  compiler_params=cp, interpret=interpret, name=f"phase{p}")(
                lid, x0, g1, g2, wqkv, wo, wgu, wd, *bufs)
    return bufs[0][L]


def _xla(x0, params):
    g1, g2, wqkv, wo, wgu, wd = params
    L, NQ, I = wqkv.shape[0], wo.shape[1], wd.shape[1]

    def norm(x, g):
        return (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS) * g.astype(jnp.float32)
                ).astype(jnp.bfloat16)

    def mm(x, w):
        return jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
    res = x0
    for layer in range(L):
        qkv = mm(norm(res, g1[layer]), wqkv[layer]).astype(jnp.bfloat16)
        mid = res + mm(qkv[:, :NQ], wo[layer])
        gu = mm(norm(mid, g2[layer]), wgu[layer])
        act = (jax.nn.silu(gu[:, :I]) * gu[:, I:]).astype(jnp.bfloat16)
        res = mid + mm(act, wd[layer])
    return res


def make(key, L, E, NQ, NKV, I, M):
    ks = jax.random.split(key, 7)

    def w(k, *shape):
        return (jax.random.normal(k, shape, jnp.float32) / shape[-2] ** 0.5).astype(jnp.bfloat16)
    params = ((1 + 0.1 * jax.random.normal(ks[0], (L, E))).astype(jnp.bfloat16),
              (1 + 0.1 * jax.random.normal(ks[1], (L, E))).astype(jnp.bfloat16),
              w(ks[2], L, E, NQ + 2 * NKV), w(ks[3], L, NQ, E), w(ks[4], L, E, 2 * I), w(ks[5], L, I, E))
    return jax.random.normal(ks[6], (M, E), jnp.float32), params


def time_call(f, n=30):
    f().block_until_ready()
    t = time.perf_counter()
    for _ in range(n):
        out = f()
    out.block_until_ready()
    return (time.perf_counter() - t) / n * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--programs", type=int, nargs="+", default=[128])
    ap.add_argument("--block-k", type=int, nargs="+", default=[128])
    ap.add_argument("--stages", type=int, nargs="+", default=[3])
    ap.add_argument("--variants", nargs="+", default=["xla", "split", "barriers", "persistent"])
    ap.add_argument("--cpu", action="store_true", help="tiny sizes, interpret mode, split kernels only")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.cpu:
        L, E, NQ, NKV, I = 2, 128, 128, 64, 128
        variants, interp = ["xla", "split", "persistent", "persistent_nk"], True
        a.programs = [1]                  # programs run one after another in interpret mode: one program only
    else:
        L, E, NQ, NKV, I = a.layers, 1024, 2048, 1024, 3072          # Qwen3-0.6B
        variants, interp = a.variants, False
    mb = L * 2 * (E * (NQ + 2 * NKV) + NQ * E + E * 2 * I + I * E) / 1e6
    results = []
    for M in a.rows:
        x0, params = make(jax.random.PRNGKey(M), L, E, NQ, NKV, I, M)
        ref = run(x0, params, variant="xla")
        params_nk = tuple(w if w.ndim == 2 else jnp.swapaxes(w, 1, 2) for w in params)
        for v in variants:
            for P in (a.programs if v.startswith(("persistent", "barriers")) else [0]):
                for BK in (a.block_k if v != "xla" else [0]):
                    for st in (a.stages if v != "xla" else [0]):
                        kw = dict(variant=v, interpret=interp)
                        if v != "xla":
                            kw.update(BK=BK, num_stages=st, **({"P": P} if P else {}))
                        row = dict(rows=M, variant=v, programs=P or None, block_k=BK or None, stages=st or None)
                        try:
                            w = params_nk if v.endswith("_nk") else params
                            out = run(x0, w, **kw)
                            row["max_err"] = float(jnp.max(jnp.abs(out - ref))) if v != "barriers" else None
                            row["ms"] = time_call(lambda: run(x0, w, **kw), n=3 if interp else 30)
                            row["us_per_layer"] = row["ms"] * 1e3 / L
                            row["TB/s"] = mb / 1e6 / (row["ms"] / 1e3) if v != "barriers" else None
                        except Exception as e:         # a probe: report and go on
                            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                        print(json.dumps(row), flush=True)
                        results.append(row)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, layers=L, weights_mb=mb,
                           results=results), f, indent=1)


if __name__ == "__main__":
    main()
