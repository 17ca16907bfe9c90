"""Why the decode kernel reads fp8 pages slower than bf16 ones (docs/fp8_kv_cache.md, "GPU").

    python scripts/probe_fp8_decode.py layout [--json PATH]     # H200: ~1 min; CPU: a small interpret-mode check
    python scripts/probe_fp8_decode.py forms [--json PATH]      # H200: ~2 min; CPU: a small interpret-mode check
    XLA_FLAGS=--xla_gpu_enable_command_buffer= ncu --kernel-name regex:paged_attention --launch-skip 2 \
        --launch-count 1 --clock-control none --set full -o FILE python scripts/probe_fp8_decode.py ncu fp8|bf16 [B CTX]

layout: a stripped decode kernel (no context splits, no prologue; Qwen3-0.6B heads, 16-token pages) timed with
V pages as the engine stores them ([P, bs, K, D]) and token-minor ([P, K, D, bs], so that the P.V dot's
operand pairs are adjacent bytes), on fp8 and bf16 pages; TB/s of the bytes read.
forms: the same stripped kernel with the dots replaced by broadcast multiplies and sums over the GQA group's
rows only (no tensor cores, so no 16-row padding and no transposed 8-bit operand), P.V summed in fp32 or fp16,
against the dot form at several tile choices.
ncu: four calls of the engine's kernel (paged_attention_qkv) on fp8 or bf16 pages, for Nsight Compute.
"""
import argparse
import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plt  # noqa: E402

from pallas_kernels.paged_attention import paged_attention_reference  # noqa: E402
from timing import time_loop  # noqa: E402

interp = jax.devices()[0].platform == "cpu"
H, K, D, BS = 16, 8, 128, 16
LOG2E = 1.4426950408889634


def softmax_loop(n, page_slot, k_of, rows, block_n, scores, pv):
    """The online-softmax loop over block_n-token tiles shared by the probe's kernels: page_slot(t) -> (page, slot);
    k_of(page, slot) -> the K tile; scores(k) -> [rows, N] log2-scaled; pv(p, page, slot) -> [rows, D]."""
    def body(i, carry):
        acc, m, l = carry
        tok = i * block_n + jnp.arange(block_n)
        page, slot = page_slot(jnp.minimum(tok, n - 1))
        s = jnp.where((tok < n)[None, :], scores(k_of(page, slot)), -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        return acc * alpha[:, None] + pv(p, page, slot), m_new, (l * alpha + p.sum(axis=1))

    init = (jnp.zeros((rows, D), jnp.float32), jnp.full((rows,), -1e30, jnp.float32), jnp.zeros((rows,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(0, pl.cdiv(n, block_n), body, init)
    return acc / jnp.where(l > 0, l, 1.0)[:, None]


def kernel(lens_ref, bt_ref, q_ref, k_ref, v_ref, o_ref, *, vt, block_n, rows, group, cdtype):
    kh, b = pl.program_id(0), pl.program_id(1)
    head = kh * group + jnp.minimum(jnp.arange(rows), group - 1)
    dcol = jnp.arange(D)
    q = q_ref[b, head[:, None], dcol[None, :]].astype(cdtype)

    def pv(p, page, slot):
        if vt:
            v = v_ref[page[None, :], kh, dcol[:, None], slot[None, :]].astype(cdtype)   # [D, N]
            return plt.dot(p.astype(cdtype), v, trans_b=True)
        return plt.dot(p.astype(cdtype), v_ref[page, slot, kh, :].astype(cdtype))       # V [N, D]

    out = softmax_loop(lens_ref[b], lambda t: (bt_ref[b, t // BS], t % BS), lambda pg, sl: k_ref[pg, sl, kh, :],
                       rows, block_n, lambda k: plt.dot(q, k.astype(cdtype), trans_b=True) * (D ** -0.5 * LOG2E), pv)
    o_ref[b, head[:, None], dcol[None, :]] = out.astype(o_ref.dtype)


def kernel_ew(lens_ref, bt_ref, q_ref, k_ref, v_ref, o_ref, *, block_n, group, pv16):
    """No dots: s[g, n] = sum_d q[g, d] k[n, d] and pv[g, d] = sum_n p[g, n] v[n, d] as broadcast multiplies
    and sums, over the group's own rows; pages converted in registers (fp32; P.V's product in fp16 if pv16)."""
    kh, b = pl.program_id(0), pl.program_id(1)
    head = kh * group + jnp.arange(group)
    dcol = jnp.arange(D)
    q = q_ref[b, head[:, None], dcol[None, :]].astype(jnp.float32) * (D ** -0.5 * LOG2E)    # [G, D]
    vdtype = jnp.float16 if pv16 else jnp.float32

    def pv(p, page, slot):                                                                  # [G, N] x [N, D]
        v = v_ref[page, slot, kh, :].astype(vdtype)
        return jnp.sum(p.astype(vdtype)[:, :, None] * v[None, :, :], axis=1).astype(jnp.float32)

    out = softmax_loop(lens_ref[b], lambda t: (bt_ref[b, t // BS], t % BS), lambda pg, sl: k_ref[pg, sl, kh, :],
                       group, block_n, lambda k: jnp.sum(q[:, None, :] * k.astype(jnp.float32)[None, :, :], axis=2),
                       pv)
    o_ref[b, head[:, None], dcol[None, :]] = out.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_n", "warps", "stages", "pv16"))
def decode_ew(q, kc, vc, bt, lens, block_n=32, warps=4, stages=3, pv16=False):
    B = q.shape[0]
    return pl.pallas_call(
        functools.partial(kernel_ew, block_n=block_n, group=H // K, pv16=pv16),
        grid=(K, B), out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages), interpret=interp,
        name="ew_probe")(lens, bt, q, kc, vc)


@functools.partial(jax.jit, static_argnames=("vt", "block_n", "warps", "stages"))
def decode(q, kc, vc, bt, lens, vt=False, block_n=64, warps=2, stages=3):
    B = q.shape[0]
    cdtype = jnp.float16 if kc.dtype == jnp.float8_e4m3fn else kc.dtype
    return pl.pallas_call(
        functools.partial(kernel, vt=vt, block_n=block_n, rows=16, group=H // K, cdtype=cdtype),
        grid=(K, B), out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages), interpret=interp,
        name="vt_probe")(lens, bt, q, kc, vc)


def case(B, ctx, dtype, seed=0):
    nb = -(-ctx // BS)
    P = B * nb + 1
    rng = np.random.default_rng(seed)
    kc = jnp.asarray(rng.standard_normal((P, BS, K, D)), jnp.float32)
    vc = jnp.asarray(rng.standard_normal((P, BS, K, D)), jnp.float32)
    if dtype == "fp8":
        kc, vc = (jnp.clip(x * 64, -448, 448).astype(jnp.float8_e4m3fn) for x in (kc, vc))
    else:
        kc, vc = kc.astype(jnp.bfloat16), vc.astype(jnp.bfloat16)
    bt = jnp.asarray(rng.permutation(P - 1)[:B * nb].reshape(B, nb) + 1, jnp.int32)
    q = jnp.asarray(rng.standard_normal((B, H, D)), jnp.bfloat16)
    return q, kc, vc, bt, jnp.full((B,), ctx, jnp.int32)


def layout(json_path):
    rows = []
    shapes = [(4, 100)] if interp else [(256, 1024), (128, 1024), (64, 1024), (64, 4096)]
    for B, ctx in shapes:
        for dtype in ("fp8", "bf16"):
            q, kc, vc, bt, lens = case(B, ctx, dtype)
            vct = jnp.transpose(vc, (0, 2, 3, 1))     # [P, K, D, bs]
            scales = dict(k_scale=1.0, v_scale=1.0) if dtype == "fp8" else {}     # the pages hold the values
            r0 = paged_attention_reference(q.astype(jnp.float32), kc, vc, bt, lens, **scales)
            for vt in (False, True):
                v_in = vct if vt else vc
                out = decode(q, kc, v_in, bt, lens, vt=vt)
                err = float(jnp.abs(out.astype(jnp.float32) - r0).max())
                nbytes = B * ctx * K * D * 2 * kc.dtype.itemsize
                s = time_loop(lambda q, kc, vv, bt, lens, vt=vt: decode(q, kc, vv, bt, lens, vt=vt), q, kc, v_in, bt,
                              lens, est_s=nbytes / 3e12)
                rows.append(dict(B=B, ctx=ctx, dtype=dtype, v_token_minor=vt, us=s * 1e6, tbps=nbytes / s / 1e12,
                                 max_err=err))
                print(rows[-1], flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)


def forms(json_path):
    """The dot form against the broadcast-sum form, fp8 and bf16 pages, TB/s of the bytes read."""
    rows = []
    shapes = [(4, 100)] if interp else [(256, 1024), (64, 1024), (64, 4096)]
    variants = [("dot", dict(block_n=64, warps=2, stages=3)), ("dot", dict(block_n=64, warps=2, stages=1))]
    variants += [(f, dict(block_n=n, warps=w, stages=3)) for f in ("ew", "ew16") for n in (32, 64) for w in (2, 4)]
    if interp:
        variants = [variants[0], ("ew", dict(block_n=32, warps=4, stages=3)), ("ew16", dict(block_n=32, warps=4,
                                                                                           stages=3))]
    for B, ctx in shapes:
        for dtype in ("fp8", "bf16"):
            q, kc, vc, bt, lens = case(B, ctx, dtype)
            scales = dict(k_scale=1.0, v_scale=1.0) if dtype == "fp8" else {}
            r0 = paged_attention_reference(q.astype(jnp.float32), kc, vc, bt, lens, **scales)
            nbytes = B * ctx * K * D * 2 * kc.dtype.itemsize
            for form, kw in variants:
                if form == "dot":
                    fn = functools.partial(decode, **kw)
                else:
                    fn = functools.partial(decode_ew, pv16=form == "ew16", **kw)
                try:
                    out = fn(q, kc, vc, bt, lens)
                    err = float(jnp.abs(out.astype(jnp.float32) - r0).max())
                    s = time_loop(fn, q, kc, vc, bt, lens, est_s=nbytes / 3e12)
                    row = dict(us=s * 1e6, tbps=nbytes / s / 1e12, max_err=err)
                except Exception as e:     # a tile that does not compile (registers, shared memory) is reported
                    row = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
                rows.append(dict(B=B, ctx=ctx, dtype=dtype, form=form, **kw, **row))
                print(rows[-1], flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)


def ncu_calls(dtype: str, B: int, ctx: int):
    """Four calls of the engine's decode kernel, for a profiler to pick one (pages made on the host: under ncu
    an XLA fp8 convert kernel crashed the process)."""
    import ml_dtypes
    import bench_kernels as bk
    k, v, tables = bk.paged_cache(jax.random.PRNGKey(1), B, -(-ctx // bk.PAGE))
    lens = jnp.full((B,), ctx, jnp.int32)
    qkv = jax.random.normal(jax.random.PRNGKey(3), (B, bk.H + 2 * bk.K, bk.D), bk.DTYPE)
    norm, cos = jnp.ones((bk.D,), bk.DTYPE), jnp.ones((B, bk.D), jnp.float32)
    fp8 = {}
    if dtype == "fp8":
        pages = []
        for x in (k, v):
            x = np.asarray(x, np.float32)
            s = np.abs(x).max((0, 1, 3)) / 448.0
            page = np.clip(x / s[None, None, :, None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
            pages.append((jax.device_put(page), jnp.asarray(s, jnp.float32)))
        (k, ks), (v, vs) = pages
        fp8 = dict(k_scale=ks, v_scale=vs)
    f = jax.jit(bk.qkv_decode({}, interp, **fp8), donate_argnums=0)
    carry = (k, v)
    for _ in range(4):
        carry = f(carry, qkv, norm, cos, tables, lens)
    jax.block_until_ready(carry)
    print("done", dtype, B, ctx)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["layout", "forms", "ncu"])
    ap.add_argument("dtype", nargs="?", default="fp8", choices=["fp8", "bf16"])
    ap.add_argument("batch", nargs="?", type=int, default=256)
    ap.add_argument("ctx", nargs="?", type=int, default=1024)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.what == "layout":
        layout(a.json)
    elif a.what == "forms":
        forms(a.json)
    else:
        ncu_calls(a.dtype, a.batch, a.ctx)
