"""(untracked) Does bench_kernels' fori_loop timing understate short kernels? Same kernel, two timers."""
import sys, time, statistics, jax, jax.numpy as jnp
sys.path.insert(0, "scripts")
from bench_kernels import paged_cache, time_loop, time_donated, qkv_decode, H, K, D, PAGE, DTYPE
from pallas_kernels.paged_attention import paged_attention

def time_python(fn, q, *args, n=100, repeats=5):
    f = jax.jit(fn)
    q = jax.block_until_ready(f(q, *args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            q = f(q, *args)
        jax.block_until_ready(q)
        ts.append((time.perf_counter() - t0) / n)
    return statistics.median(ts)

for B, ctx in ((64, 1024), (128, 1024), (256, 1024), (64, 4096), (256, 4096)):
    k, v, tables = paged_cache(jax.random.PRNGKey(B + ctx), B, -(-ctx // PAGE))
    q = jax.random.normal(jax.random.PRNGKey(1), (B, H, D), DTYPE)
    lens = jnp.full((B,), ctx, jnp.int32)
    nbytes = B * ctx * K * D * 4
    fn = lambda q, k, v, t, l: paged_attention(q, k, v, t, l)
    a = time_loop(fn, q, k, v, tables, lens, est_s=nbytes / 3e12)
    b = time_python(fn, q, k, v, tables, lens)
    qkv = jax.random.normal(jax.random.PRNGKey(3), (B, H + 2 * K, D), DTYPE)
    c = time_donated(qkv_decode({}, False), (qkv, k, v), jnp.ones((D,), DTYPE), jnp.ones((B, D), jnp.float32), tables, lens, est_s=nbytes / 3e12)
    print(f"AB B={B} ctx={ctx}: fori_loop {nbytes/a/1e12:.2f} TB/s ({a*1e6:.1f} us), python loop {nbytes/b/1e12:.2f} TB/s ({b*1e6:.1f} us), engine kernel (donated python loop) {nbytes/c/1e12:.2f} TB/s ({c*1e6:.1f} us)", flush=True)
