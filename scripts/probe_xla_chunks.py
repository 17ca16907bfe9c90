"""Where the xla backend's chunked decode ("chunks" form, model/xla_decode.py) spends its time, against the
einsum form, at one shape (every row's context the same, tight tables: both read exactly the rows' tokens):

    PYTHONPATH=. python scripts/probe_xla_chunks.py [--batch 256] [--context 1024] [--chunk 256] [--json PATH]
                                                    [--hlo-dir DIR]

Variants (us a call, one layer's attention; back-to-back dispatch):
  einsum        each row's pages gathered ([B, S, K, D]), two batched GEMMs, softmax over S
  chunks        the flat work list (decode_work_list, materialised), per-chunk softmax, merged per row by scatter
                (the engine's form)
  chunks_given  `chunks` with the work list made outside the call (as the engine makes it once a step)
  chunks_sorted / chunks_onehot  `chunks` with the other merges (xla_decode.merge_chunks)
  chunks_fixed  the same chunks, but each row's chunks taken straight from its [B, W] table (no work list, no
                merge: per-chunk partials combined by a reshape): the cost of the chunk-shaped GEMMs alone
  chunks_fused  `chunks` with the work list left for XLA to fuse into the page gathers (2x slower on the H200:
                it is recomputed per gathered element)
  chunks_nomerge  `chunks` without the merge (the partial outputs summed): the cost of the scatters
  chunks_reduce   `chunks` with each chunk attended by multiply + reduce, one pair of reductions per q head of
                the GQA group and K / V never broadcast: XLA may fuse the page gathers into the reductions and
                merge the group's sibling reductions (one read of each chunk, nothing written), where the
                GEMMs need the gathered chunks written out and read back (3x their bytes)
  chunks_reduce_group  `chunks_reduce` with the GQA group in one multiply + reduce (K / V broadcast over it)
  chunks_hybrid_qk / _pv  q.K (or p.V) as a multiply + reduce, the other half a batched GEMM: which half the
                reduce forms lose in
  chunks_rows[_k]  chunks_given with the chunks gathered head-major ([N, K, C, D], one row of the cache per
                (token, head), xla_attention.GATHER = "rows"; `_k`: K only, V as whole pages): the GEMMs' layout,
                so that XLA writes a plain gather instead of a gather + transpose
On the H200 both reduce forms were 15-42% slower than chunks_given (docs/performance.md, thirtieth run); on an
H100 each hybrid was too (q.K reduced: +8% at 256 rows, +32% at 64; fifty-fifth run).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402


def variants(chunk: int):
    import jax
    import jax.numpy as jnp

    from jaxinfer.model import xla_attention as xa
    from jaxinfer.model import xla_decode as xd

    def chunks_fixed(q, k_cache, v_cache, tables, lens):
        B, H, D = q.shape
        _, bs, K, _ = k_cache.shape
        cp = chunk // bs
        n = tables.shape[1] // cp
        pages = tables.reshape(B * n, cp)
        row = jnp.repeat(jnp.arange(B), n)
        tok = (jnp.arange(B * n) % n)[:, None] * chunk + jnp.arange(chunk)
        visible = tok < lens[row][:, None]
        m, l, o = xd.attend_chunk(q[row], xa.gather_pages(k_cache, pages), xa.gather_pages(v_cache, pages), visible,
                                  D ** -0.5)
        m, l, o = m.reshape(B, n, K, -1), l.reshape(B, n, K, -1), o.reshape(B, n, K, H // K, D)
        w = jnp.exp(m - m.max(axis=1, keepdims=True))
        return ((o * w[..., None]).sum(1) / (l * w).sum(1)[..., None]).reshape(B, H, D).astype(q.dtype)

    def attend_chunk_reduce(q, k, v, visible, scale):
        """xd.attend_chunk's (m, l [N, K, G], o [N, K, G, D]) as per-group multiply + reduce (bf16 pages)."""
        N, H, D = q.shape
        K = k.shape[2]
        qg = q.reshape(N, K, H // K, D).astype(jnp.float32)
        ms, ls, os_ = [], [], []
        for g in range(H // K):
            s = jnp.sum(qg[:, None, :, g] * k, axis=-1, dtype=jnp.float32) * scale    # [N, C, K]
            s = jnp.where(visible[:, :, None], s, xd._NEG)
            m = s.max(axis=1)                                                         # [N, K]
            p = jnp.where(visible[:, :, None], jnp.exp(s - m[:, None]), 0.0)
            ms.append(m), ls.append(p.sum(axis=1))
            os_.append(jnp.sum(p[..., None] * v, axis=1, dtype=jnp.float32))         # [N, K, D]
        return jnp.stack(ms, -1), jnp.stack(ls, -1), jnp.stack(os_, 2)

    def attend_chunk_reduce_group(q, k, v, visible, scale):
        """attend_chunk_reduce with the whole GQA group in one multiply + reduce (K / V broadcast over it)."""
        N, H, D = q.shape
        K = k.shape[2]
        qg = q.reshape(N, 1, K, H // K, D).astype(jnp.float32)
        s = jnp.sum(qg * k[:, :, :, None], axis=-1, dtype=jnp.float32) * scale        # [N, C, K, G]
        vis = visible[:, :, None, None]
        s = jnp.where(vis, s, xd._NEG)
        m = s.max(axis=1)                                                             # [N, K, G]
        p = jnp.where(vis, jnp.exp(s - m[:, None]), 0.0)
        o = jnp.sum(p[..., None] * v[:, :, :, None], axis=1, dtype=jnp.float32)       # [N, K, G, D]
        return m, p.sum(axis=1), o

    def attend_chunk_hybrid(reduce_qk: bool):
        """xd.attend_chunk with one of its two GEMMs as a multiply + reduce over the group-broadcast pages (a
        gather XLA may fuse into the reduction: that half reads its pages once), the other a batched GEMM."""
        def attend(q, k, v, visible, scale):
            N, H, D = q.shape
            K = k.shape[2]
            qg = q.reshape(N, K, H // K, D)
            if reduce_qk:
                s = jnp.sum(qg[:, None].astype(jnp.float32) * k[:, :, :, None], axis=-1, dtype=jnp.float32)
                s = s.transpose(0, 2, 3, 1)                                               # [N, K, G, C]
            else:
                s = jnp.einsum("nkgd,nckd->nkgc", qg, k, preferred_element_type=jnp.float32)
            s = jnp.where(visible[:, None, None, :], s * scale, xd._NEG)
            m = s.max(axis=-1)
            p = jnp.where(visible[:, None, None, :], jnp.exp(s - m[..., None]), 0.0)
            if reduce_qk:
                o = jnp.einsum("nkgc,nckd->nkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
            else:
                o = jnp.sum(p.transpose(0, 3, 1, 2)[..., None] * v[:, :, :, None], axis=1, dtype=jnp.float32)
            return m, p.sum(axis=-1), o
        return attend

    def chunks_split(barrier: bool, merge: bool, attend=xd.attend_chunk):
        def fn(q, k_cache, v_cache, tables, lens):
            B, H, D = q.shape
            bs = k_cache.shape[1]
            cp = chunk // bs
            flat = tables.reshape(-1)
            start = jnp.arange(B, dtype=jnp.int32) * tables.shape[1]
            row, pages, visible = xd.chunk_items(lens, start, B * (tables.shape[1] // cp), cp, flat.shape[0], bs)
            ids = flat[pages]
            if barrier:
                row, ids, visible = jax.lax.optimization_barrier((row, ids, visible))
            qi = q[row]
            m, l, o = attend(qi, xa.gather_pages(k_cache, ids), xa.gather_pages(v_cache, ids), visible, D ** -0.5)
            if not merge:
                return (o.sum(0) / l.sum(0)[..., None]).reshape(1, H, D).astype(q.dtype) + jnp.zeros_like(q)
            return xd.merge_chunks(row, m, l, o, B, "scatter").reshape(B, H, D).astype(q.dtype)
        return fn

    def chunks_rows_k(q, k_cache, v_cache, tables, lens):
        """K gathered head-major ([N, K, C, D], xla_attention.gather_rows), V as whole pages."""
        B, H, D = q.shape
        bs, K = k_cache.shape[1], k_cache.shape[2]
        cp = chunk // bs
        flat = tables.reshape(-1)
        start = jnp.arange(B, dtype=jnp.int32) * tables.shape[1]
        row, pages, visible = xd.chunk_items(lens, start, B * (tables.shape[1] // cp), cp, flat.shape[0], bs)
        row, ids, visible = jax.lax.optimization_barrier((row, flat[pages], visible))
        qg = q[row].reshape(-1, K, H // K, D)
        s = jnp.einsum("nkgd,nkcd->nkgc", qg, xa.gather_rows(k_cache, ids), preferred_element_type=jnp.float32)
        s = jnp.where(visible[:, None, None, :], s * D ** -0.5, xd._NEG)
        m = s.max(axis=-1)
        p = jnp.where(visible[:, None, None, :], jnp.exp(s - m[..., None]), 0.0)
        o = jnp.einsum("nkgc,nckd->nkgd", p.astype(q.dtype), xa.gather_pages(v_cache, ids),
                       preferred_element_type=jnp.float32)
        return xd.merge_chunks(row, m, p.sum(axis=-1), o, B, "scatter").reshape(B, H, D).astype(q.dtype)

    work = {}

    def chunks_given(gather):     # the work list made once outside the call, as the engine does a step
        def fn(q, k, v, t, s):
            if "w" not in work:
                work["w"] = jax.tree.map(np.asarray, xd.decode_work_list(t, s, None, k.shape[1], chunk))
            return xd.paged_decode_xla(q, k, v, t, s, form="chunks", work=tuple(map(jnp.asarray, work["w"])),
                                       gather=gather)
        return fn

    return {
        "einsum": lambda q, k, v, t, s: xd.paged_decode_xla(q, k, v, t, s, form="einsum"),
        "chunks": lambda q, k, v, t, s: xd.paged_decode_xla(q, k, v, t, s, form="chunks", chunk=chunk),
        "chunks_given": chunks_given("pages"),
        "chunks_rows": chunks_given("rows"),
        "chunks_sorted": lambda q, k, v, t, s: xd.paged_decode_xla(q, k, v, t, s, form="chunks", chunk=chunk,
                                                                   merge="sorted"),
        "chunks_onehot": lambda q, k, v, t, s: xd.paged_decode_xla(q, k, v, t, s, form="chunks", chunk=chunk,
                                                                   merge="onehot"),
        "chunks_fixed": chunks_fixed,
        "chunks_fused": chunks_split(False, True),
        "chunks_nomerge": chunks_split(True, False),
        "chunks_reduce": chunks_split(True, True, attend_chunk_reduce),
        "chunks_reduce_group": chunks_split(True, True, attend_chunk_reduce_group),
        "chunks_hybrid_qk": chunks_split(True, True, attend_chunk_hybrid(True)),
        "chunks_hybrid_pv": chunks_split(True, True, attend_chunk_hybrid(False)),
        "chunks_rows_k": chunks_rows_k,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--pool-tokens", type=int, default=800_000)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU check of the script)")
    ap.add_argument("--hlo-dir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--variants", nargs="+", default=None, help="the variants to time (default: all)")
    a = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp

    from bench import write_json
    from timing import time_loop
    H, K, D = 16, 8, 128
    if a.smoke:
        a.batch, a.context, a.chunk, a.block_size, a.pool_tokens, H, K, D = 4, 64, 32, 8, 1024, 4, 2, 16
    bs, B = a.block_size, a.batch
    n = a.context // bs
    blocks = max(B * n + 1, a.pool_tokens // bs)
    cache = jax.random.normal(jax.random.PRNGKey(0), (blocks, bs, K, D), jnp.float32).astype(jnp.bfloat16)
    rng = np.random.default_rng(0)
    tables = jnp.asarray(1 + rng.permutation(B * n).reshape(B, n), jnp.int32)
    lens = jnp.full((B,), a.context, jnp.int32)
    q = jnp.asarray(rng.standard_normal((B, H, D)), jnp.bfloat16)
    need = 2 * B * a.context * K * D * 2
    fns = variants(a.chunk)
    ref = np.asarray(fns["einsum"](q, cache, cache, tables, lens), np.float32)
    rows = {}
    for name, fn in fns.items():
        if a.variants and name not in a.variants:
            continue
        if a.hlo_dir and name not in ("chunks_given", "chunks_rows"):     # (work list made on the host: not jittable)
            os.makedirs(a.hlo_dir, exist_ok=True)
            text = jax.jit(fn).lower(q, cache, cache, tables, lens).compile().as_text()
            with open(os.path.join(a.hlo_dir, f"{name}.txt"), "w") as f:
                f.write(text)
        err = float(np.abs(np.asarray(fn(q, cache, cache, tables, lens), np.float32) - ref).max())
        s = time_loop(lambda q, *rest: fn(q, *rest), q, cache, cache, tables, lens, est_s=1e-3)
        rows[name] = dict(us=s * 1e6, gbps=need / s / 1e9, max_abs_diff_vs_einsum=err)
        print(f"{name:16s} {s * 1e6:9.1f} us  {need / s / 1e9:6.0f} GB/s of the rows' K/V  (|diff| {err:.1e})")
    out = dict(batch=B, context=a.context, chunk=a.chunk, device=jax.devices()[0].device_kind, variants=rows)
    write_json(a.json, out)
    return out


if __name__ == "__main__":
    main()
