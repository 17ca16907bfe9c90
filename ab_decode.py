"""A/B (untracked, for one GPU run): previous per-kv-head decode kernel vs the all-heads kernel, same process."""
import sys, jax, jax.numpy as jnp
sys.path.insert(0, "scripts")
from bench_kernels import paged_cache, time_loop, time_donated, H, K, D, PAGE, DTYPE
from pallas_kernels import old_paged_attention as old
from pallas_kernels import paged_attention as new

for B, ctx in ((1, 1024), (8, 2048), (32, 2048), (64, 1024), (128, 1024), (256, 1024), (256, 4096), (64, 4096)):
    k, v, tables = paged_cache(jax.random.PRNGKey(B + ctx), B, -(-ctx // PAGE))
    q = jax.random.normal(jax.random.PRNGKey(1), (B, H, D), DTYPE)
    lens = jnp.full((B,), ctx, jnp.int32)
    nbytes = B * ctx * K * D * 4
    est = nbytes / 3e12 + 5e-6
    row = {}
    row["old"] = time_loop(lambda q, k, v, t, l: old.paged_attention(q, k, v, t, l), q, k, v, tables, lens, est_s=est)
    row["new"] = time_loop(lambda q, k, v, t, l: new.paged_attention(q, k, v, t, l), q, k, v, tables, lens, est_s=est)
    qkv = jax.random.normal(jax.random.PRNGKey(3), (B, H + 2 * K, D), DTYPE)
    norm, cos = jnp.ones((D,), DTYPE), jnp.ones((B, D), jnp.float32)
    for name, mod in (("old_qkv", old), ("new_qkv", new)):
        def run(carry, norm, cos, t, l, mod=mod):
            x, kc, vc = carry
            o, kc, vc = mod.paged_attention_qkv(x, norm, norm, cos, cos, kc, vc, t, l, eps=1e-6)
            return x.at[:, :H].set(o), kc, vc
        kk, vv = k + 0, v + 0
        row[name] = time_donated(run, (qkv, kk, vv), norm, cos, tables, lens, est_s=est)
    print(f"B={B:4d} ctx={ctx:5d} " + "  ".join(f"{n} {t*1e6:8.1f}us {nbytes/t/1e12:5.2f}TB/s" for n, t in row.items()), flush=True)
