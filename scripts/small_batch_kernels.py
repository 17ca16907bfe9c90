"""The kernel sections of scripts/bench_small_batch.py (run through it): each decode matmul of the model,
XLA's dot against pallas_kernels/gemv.py (auto tiles + a sweep), and the engine's decode attention kernel per
context split count."""
from __future__ import annotations

import time

import numpy as np

from bench_small_batch import HBM, timed


def matmul_shapes(cfg) -> dict[str, tuple[int, int, bool, bool, bool]]:
    """name -> (E, N, stacked, norm, gated) of the decode matmuls; "+norm" / "+swiglu": the fused forms the model
    uses with layers.GEMV_FUSE (XLA's side: the RMSNorm and swiglu ops around its dot)."""
    E, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * D
    return {"qkv+norm": (E, qkv, True, True, False), "o_proj": (cfg.num_attention_heads * D, E, True, False, False),
            "gate_up+norm+swiglu": (E, 2 * I, True, True, True), "down": (I, E, True, False, False),
            "lm_head": (E, cfg.vocab_size, False, False, False), "qkv": (E, qkv, True, False, False),
            "gate_up": (E, 2 * I, True, False, False)}        # in the order the sweep matters (the budget may cut it)


def sweep_tiles(M, E, N, full: bool, split: bool = True) -> list[dict]:
    """The automatic tiles, then (full) other warps / stages and other column-block x split-K shapes: <= 7.
    N: output columns; split=False: E is never split (the fused forms: narrower blocks give more programs)."""
    from pallas_kernels.gemv import choose_tiles
    auto = dict(choose_tiles(M, E, N, split=split), num_warps=4, num_stages=3)
    if not full:
        return [auto]
    out = [auto] + [dict(auto, num_warps=w, num_stages=st) for w, st in ((8, 3), (4, 5))]
    if E % (auto["split_k"] * 256) == 0:
        out.append(dict(auto, block_k=256))                 # 2x the bytes in flight per stage
    shapes = []
    for bn in (16, 32, 64, 128):
        for sk in (1, 2, 4, 8) if split else (1,):
            bk = 128 if E % (sk * 128) == 0 else 64
            t = dict(block_n=bn, block_k=bk, split_k=sk, num_warps=4, num_stages=3)
            if N % bn == 0 and E % (sk * bk) == 0 and t not in out:
                # closest to 2 programs per SM first; of equals, the widest blocks (longest contiguous reads)
                shapes.append((abs(np.log2(N // bn * sk / 264)), -bn, t))
    return out + [t for *_, t in sorted(shapes, key=lambda x: x[:2])][:3]


def bench_gemv(a, cfg, out: dict) -> None:
    import jax
    import jax.numpy as jnp
    from jaxinfer.model.layers import rms_norm, swiglu
    from pallas_kernels.gemv import gemv
    interpret = jax.devices()[0].platform != "gpu"
    L, rows = cfg.num_hidden_layers, []
    for M in sorted({next(b for b in a.buckets if b >= n) for n in a.batches}):
        for name, (E, N, stacked, norm, gated) in matmul_shapes(cfg).items():
            reps = L if stacked else 4
            key = jax.random.PRNGKey(0)
            w = (jax.random.normal(key, (L, E, N) if stacked else (N, E), jnp.float32) * 0.02).astype(a.dtype)
            g = jnp.ones((L, E), a.dtype) if norm else None
            x = jnp.ones((M, E), a.dtype)
            nbytes = reps * E * N * jnp.dtype(a.dtype).itemsize

            def xla(x, w, g):
                if not stacked:
                    return [jnp.einsum("me,ne->mn", x + i, w, preferred_element_type=jnp.float32) for i in range(reps)]
                ys = [(rms_norm(x, g[l], 1e-6) if norm else x) @ w[l] for l in range(L)]
                return [swiglu(y) for y in ys] if gated else ys

            def kern(x, w, g, t):
                if stacked:
                    return [gemv(x, w, l, norm_weight=g, swiglu=gated, interpret=interpret, **t) for l in range(L)]
                return [gemv(x + i, w, transpose_w=True, out_dtype=jnp.float32, interpret=interpret, **t)
                        for i in range(reps)]
            def reduce(x, w, g):              # the same matmuls as multiply + reduce: XLA's own reduction kernels
                if not stacked:
                    return [jnp.sum((x + i)[:, None, :].astype(jnp.float32) * w[None].astype(jnp.float32), axis=-1)
                            for i in range(reps)]
                ys = [jnp.sum((rms_norm(x, g[l], 1e-6) if norm else x)[:, :, None].astype(jnp.float32)
                              * w[l][None].astype(jnp.float32), axis=1).astype(x.dtype) for l in range(L)]
                return [swiglu(y) for y in ys] if gated else ys
            cands = [("xla", jax.jit(xla)), ("reduce", jax.jit(reduce))]
            full = a.sweep and M <= 16 and time.perf_counter() - a.t0 < a.budget
            for t in sweep_tiles(M, E, N // 2 if gated else N, full, split=not norm):
                cands.append((t, jax.jit(lambda x, w, g, t=t: kern(x, w, g, t))))
            ref = None
            for t, f in cands:
                try:
                    got = np.asarray(f(x, w, g)[-1], np.float32)     # the last layer's / repeat's result
                    ref = got if ref is None else ref
                    err = float(np.abs(got - ref).max() / (np.abs(ref).max() + 1e-30))
                    s = timed(f, (x, w, g), a.iters) / reps
                except Exception as err:      # a tile the GPU compiler refuses: report it, keep going
                    rows.append(dict(M=M, matmul=name, E=E, N=N, impl=str(t), error=str(err)[:300]))
                    print(f"  M={M} {name} {t}: FAILED {str(err)[:200]}", flush=True)
                    continue
                gbs = nbytes / reps / s / 1e9
                impl = t if isinstance(t, str) else "gemv"
                rows.append(dict(M=M, matmul=name, E=E, N=N, impl=impl, tiles=t,
                                 us=s * 1e6, GBs=gbs, pct_hbm=100 * gbs * 1e9 / HBM, rel_err_vs_xla=err))
                print(f"  M={M:3d} {name:>19} [{E}x{N}] {impl if impl != 'gemv' else _short(t)}: {s * 1e6:8.2f} us "
                      f"{gbs:7.0f} GB/s ({100 * gbs * 1e9 / HBM:4.1f}% of 4.3 TB/s)  err {err:.1e}", flush=True)
            del w
    out["gemv"] = rows


def _short(t: dict) -> str:
    return "gemv n{block_n} k{block_k} s{split_k} w{num_warps} st{num_stages}".format(**t)


def bench_attention(a, cfg, out: dict) -> None:
    import jax
    import jax.numpy as jnp
    from pallas_kernels.paged_attention import choose_num_splits, paged_attention_qkv
    interpret = jax.devices()[0].platform != "gpu"
    H, K, D, L, bs = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers, a.block_size
    per = -(-a.context // bs)
    rows = []
    for n in a.batches:
        B = next(b for b in a.buckets if b >= n)
        blocks = B * per + 1
        tables = jnp.asarray(np.pad(np.arange(n * per).reshape(n, per), ((0, B - n), (0, a.width - per))), jnp.int32)
        lens = jnp.asarray([a.context] * n + [0] * (B - n), jnp.int32)
        order = jnp.arange(B, dtype=jnp.int32)
        qkv = jnp.ones((B, H + 2 * K, D), a.dtype)
        norms, cos = jnp.ones((L, D), a.dtype), jnp.ones((B, D), jnp.float32)
        auto = choose_num_splits(B, K, a.width * bs)
        configs = [(S, None) for S in sorted({1, 2, 4, 8, 16, auto} if not a.quick else {1, 2, auto})]
        if B == a.buckets[0] and not a.quick:              # the smallest bucket: shorter tiles, more splits
            configs += [(16, 32), (32, 32)]
        for S, bn in configs:
            if S not in (1, auto) and time.perf_counter() - a.t0 > a.budget:
                continue                                    # over the time budget: the auto choice and 1 only

            def chain(carry, S=S, bn=bn):
                caches, acc = carry
                new = []
                for l in range(L):
                    o, kc, vc = paged_attention_qkv(qkv, norms, norms, cos, cos, *caches[l], tables, lens, eps=1e-6,
                                                    layer=l, order=order, num_splits=S, block_n=bn,
                                                    interpret=interpret)
                    new.append((kc, vc))
                    acc = acc + o
                return new, acc
            caches = [(jnp.zeros((blocks, bs, K, D), a.dtype), jnp.zeros((blocks, bs, K, D), a.dtype))
                      for _ in range(L)]
            f = jax.jit(chain, donate_argnums=0)
            try:
                s = timed(f, ((caches, jnp.zeros((B, H, D), a.dtype)),), a.iters, {0: None})
            except Exception as err:
                rows.append(dict(batch=n, bucket=B, splits=S, block_n=bn, error=str(err)[:300]))
                print(f"  attention batch {n} splits {S} block_n {bn}: FAILED {str(err)[:200]}", flush=True)
                continue
            kv_bytes = n * a.context * 2 * K * D * jnp.dtype(a.dtype).itemsize
            auto_cfg = S == auto and bn is None
            rows.append(dict(batch=n, bucket=B, splits=S, block_n=bn or 64, auto=auto_cfg, us_per_layer=s / L * 1e6,
                             GBs=kv_bytes / (s / L) / 1e9))
            print(f"  attention batch {n:3d} (bucket {B}) splits {S:2d} block_n {bn or 64:3d}"
                  f"{' (auto)' if auto_cfg else '       '}: "
                  f"{s / L * 1e6:7.2f} us/layer, {kv_bytes / (s / L) / 1e9:6.0f} GB/s of K/V", flush=True)
            del caches
    out["attention"] = rows
