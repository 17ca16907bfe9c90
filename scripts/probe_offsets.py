"""Does the fused decode kernel read an fp8 page array correctly past element 2^31? Pallas' Triton lowering indexes
arrays of up to 2^32 bytes with 32-bit element offsets (docs/kernels.md, attention.cache_layout).

    PYTHONPATH=. python scripts/probe_offsets.py TOTAL_PAGES FIRST_PAGE

builds [TOTAL_PAGES, 16, 8, 128] fp8 caches (16 KiB a page), puts 256 pages of random K/V at FIRST_PAGE, and
compares the kernel reading them there (page_offset=FIRST_PAGE) with the kernel on those pages alone. Run each
case in its own process: an illegal address breaks the CUDA context."""
import sys
if sys.argv[1:2] in (["-h"], ["--help"]) or len(sys.argv) < 3:   # the docstring is the usage
    sys.exit(print(__doc__) if sys.argv[1:2] in (["-h"], ["--help"]) else __doc__)
import numpy as np
import jax
import jax.numpy as jnp
from pallas_kernels.paged_attention import paged_attention_qkv

B, H, K, D, bs, W = 4, 16, 8, 128, 16, 64
scales = dict(k_scale=jnp.float32(0.05), v_scale=jnp.float32(0.05))


def run(total_pages, offset):
    rng = np.random.default_rng(0)
    small_k = jnp.asarray(rng.standard_normal((W * B, bs, K, D)), jnp.float32).astype(jnp.float8_e4m3fn)
    small_v = jnp.asarray(rng.standard_normal((W * B, bs, K, D)), jnp.float32).astype(jnp.float8_e4m3fn)
    tables = jnp.arange(W * B, dtype=jnp.int32).reshape(B, W)
    lens = jnp.asarray([1000, 700, 1024, 5], jnp.int32)
    qkv = jnp.asarray(rng.standard_normal((B, H + 2 * K, D)), jnp.bfloat16)
    nw = jnp.ones((D,), jnp.bfloat16)
    cos = jnp.ones((B, D), jnp.float32)
    sin = jnp.zeros((B, D), jnp.float32)
    f = jax.jit(lambda k, v, off: paged_attention_qkv(qkv, nw, nw, cos, sin, k, v, tables, lens, eps=1e-6,
                                                       page_offset=off, interpret=jax.default_backend() != "gpu",
                                                       **scales), static_argnums=2)
    ref, _, _ = f(small_k, small_v, 0)
    big_k = jnp.zeros((total_pages, bs, K, D), jnp.float8_e4m3fn).at[offset:offset + W * B].set(small_k)
    big_v = jnp.zeros((total_pages, bs, K, D), jnp.float8_e4m3fn).at[offset:offset + W * B].set(small_v)
    out, _, _ = f(big_k, big_v, offset)
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
    print(f"array {total_pages * bs * K * D / 2**30:.2f} GiB, first element offset {offset * bs * K * D:.3e}: "
          f"max |out - ref| = {err}", flush=True)


run(int(sys.argv[1]), int(sys.argv[2]))
