"""fp8 V pages read as 16-bit operands (docs/fp8_kv_cache.md, "V pages in pairs"): stripped decode kernels (no
context splits, no prologue; Qwen3-0.6B heads, 16-token pages), TB/s of the fp8 bytes read, against today's fp8 and
bf16 kernels (probe_fp8_decode.py's):
  pairs_cvt  pairs of tokens per head dimension, a new layout ([P, bs/2, K, D] uint16: token 2i in the low byte),
             each dot over the tile's even or odd tokens;
  dpairs     pairs of head dimensions: the SAME bytes as the fp8 pages viewed as uint16 [P, bs, K, D/2] (the
             engine's layout), each dot over the even or odd dimensions, the output halves stored interleaved;
  dquads     the same with four dimensions per uint32 element, four dots.
  dpairs_f8qk  dpairs with q quantised per row to e4m3, so Q.K^T is an fp8 x fp8 dot (no K conversion).
  e5m2_kcvt / e5m2_kpairs  float8_e5m2 pages: V's pairs become fp16 with a shift and a mask (an e5m2 byte is the
             top byte of an fp16), no cvt; K by cvt, or as pairs too (Q.K^T as two dots over even / odd dims).

    python scripts/probe_fp8_pairs.py [--json PATH]      # H200: ~2.5 min; CPU: a small interpret-mode check
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
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plt  # noqa: E402

from pallas_kernels.paged_attention import paged_attention_reference  # noqa: E402
from probe_fp8_decode import BS, D, H, K, LOG2E, case, decode, interp  # noqa: E402
from timing import time_loop  # noqa: E402


def kernel_pairs(lens_ref, bt_ref, q_ref, k_ref, v_ref, o_ref, *, block_n, rows, group, conv):
    """V as uint16 token pairs [P, bs/2, K, D]; K as stored [P, bs, K, D] fp8. Even and odd tokens of a tile are
    scored and multiplied separately, so each P.V dot takes one byte of every pair, converted to fp16."""
    kh, b = pl.program_id(0), pl.program_id(1)
    head = kh * group + jnp.minimum(jnp.arange(rows), group - 1)
    dcol = jnp.arange(D)
    q = q_ref[b, head[:, None], dcol[None, :]].astype(jnp.float16)
    n = lens_ref[b]
    half = block_n // 2
    qk = D ** -0.5 * LOG2E

    def half16(u, hi):          # [N/2, D] uint16 -> one byte of each pair as fp16 (x 2^-8 for "bits")
        if conv == "bits":
            x = (((u & 0x7F00) >> 1) | (u & 0x8000)) if hi else (((u & 0x7F) << 7) | ((u & 0x80) << 8))
            return jax.lax.bitcast_convert_type(x, jnp.float16)
        byte = (u >> 8 if hi else u & 0xFF).astype(jnp.uint8)
        return jax.lax.bitcast_convert_type(byte, jnp.float8_e4m3fn).astype(jnp.float16)

    def body(i, carry):
        acc, m, l = carry
        tok = i * block_n + 2 * jnp.arange(half)                    # even tokens; odd = tok + 1
        te, to = jnp.minimum(tok, n - 1), jnp.minimum(tok + 1, n - 1)
        pe, po = bt_ref[b, te // BS], bt_ref[b, to // BS]
        ke, ko = k_ref[pe, te % BS, kh, :].astype(jnp.float16), k_ref[po, to % BS, kh, :].astype(jnp.float16)
        se = jnp.where((tok < n)[None, :], plt.dot(q, ke, trans_b=True) * qk, -jnp.inf)
        so = jnp.where((tok + 1 < n)[None, :], plt.dot(q, ko, trans_b=True) * qk, -jnp.inf)
        m_new = jnp.maximum(m, jnp.maximum(se.max(axis=1), so.max(axis=1)))
        alpha = jnp.exp2(m - m_new)
        p_e, p_o = jnp.exp2(se - m_new[:, None]), jnp.exp2(so - m_new[:, None])
        u = v_ref[pe, (te % BS) // 2, kh, :]                        # [N/2, D] uint16
        pv = plt.dot(p_e.astype(jnp.float16), half16(u, False)) + plt.dot(p_o.astype(jnp.float16), half16(u, True))
        return acc * alpha[:, None] + pv, m_new, l * alpha + p_e.sum(axis=1) + p_o.sum(axis=1)

    init = (jnp.zeros((rows, D), jnp.float32), jnp.full((rows,), -1e30, jnp.float32), jnp.zeros((rows,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(0, pl.cdiv(n, block_n), body, init)
    out = acc * ((256.0 if conv == "bits" else 1.0) / jnp.where(l > 0, l, 1.0))[:, None]
    o_ref[b, head[:, None], dcol[None, :]] = out.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("conv", "block_n", "warps", "stages"))
def decode_pairs(q, kc, vp, bt, lens, conv="cvt", block_n=64, warps=2, stages=3):
    B = q.shape[0]
    return pl.pallas_call(
        functools.partial(kernel_pairs, block_n=block_n, rows=16, group=H // K, conv=conv),
        grid=(K, B), out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages), interpret=interp,
        name="pairs_probe")(lens, bt, q, kc, vp)


def kernel_dpairs(lens_ref, bt_ref, q_ref, k_ref, v_ref, o_ref, *, block_n, rows, group, parts=2, f8qk=False):
    """V as stored, viewed as uint16 [P, bs, K, D/2] (head dimensions 2j and 2j+1 of a token in one element; parts=4:
    uint32, four dimensions): the P.V dot is `parts` dots, one over each byte of the elements (dimensions
    parts * h + j)."""
    kh, b = pl.program_id(0), pl.program_id(1)
    head = kh * group + jnp.minimum(jnp.arange(rows), group - 1)
    dcol, hcol = jnp.arange(D), jnp.arange(D // parts)
    q = q_ref[b, head[:, None], dcol[None, :]].astype(jnp.float16)
    n = lens_ref[b]
    qk = D ** -0.5 * LOG2E

    if f8qk:      # q quantised per row to e4m3 (as FA3's fp8 mode and vLLM do), so Q.K^T is an fp8 x fp8 dot
        qs = jnp.maximum(jnp.max(jnp.abs(q.astype(jnp.float32)), axis=1), 1e-20) / 448.0            # [rows]
        q = (q.astype(jnp.float32) / qs[:, None]).astype(jnp.float8_e4m3fn)
        qk = qk * qs[:, None]

    def part16(u, j):                                                 # byte j of each element, as fp16
        byte = ((u >> (8 * j)) & 0xFF).astype(jnp.uint8)
        return jax.lax.bitcast_convert_type(byte, jnp.float8_e4m3fn).astype(jnp.float16)

    def body(i, carry):
        accs, m, l = carry
        tok = i * block_n + jnp.arange(block_n)
        t = jnp.minimum(tok, n - 1)
        page, slot = bt_ref[b, t // BS], t % BS
        k = k_ref[page, slot, kh, :]
        k = k if f8qk else k.astype(jnp.float16)
        s = jnp.where((tok < n)[None, :], plt.dot(q, k, trans_b=True) * qk, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        u = v_ref[page, slot, kh, :]                                  # [N, D/parts] uint16 / uint32
        p16 = p.astype(jnp.float16)
        accs = tuple(a * alpha[:, None] + plt.dot(p16, part16(u, j)) for j, a in enumerate(accs))
        return accs, m_new, l * alpha + p.sum(axis=1)

    z = jnp.zeros((rows, D // parts), jnp.float32)
    accs, m, l = jax.lax.fori_loop(0, pl.cdiv(n, block_n), body, ((z,) * parts, jnp.full((rows,), -1e30, jnp.float32),
                                                                  jnp.zeros((rows,), jnp.float32)))
    inv = (1.0 / jnp.where(l > 0, l, 1.0))[:, None]
    for j, a in enumerate(accs):                                      # dimension parts * h + j
        o_ref[b, head[:, None], parts * hcol[None, :] + j] = (a * inv).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_n", "warps", "stages", "f8qk"))
def decode_dpairs(q, kc, vd, bt, lens, block_n=64, warps=2, stages=3, f8qk=False):
    B = q.shape[0]
    return pl.pallas_call(
        functools.partial(kernel_dpairs, block_n=block_n, rows=16, group=H // K, parts=4 if vd.dtype == jnp.uint32 else 2,
                          f8qk=f8qk),
        grid=(K, B), out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages), interpret=interp,
        name="dpairs_probe")(lens, bt, q, kc, vd)


def kernel_e5m2(lens_ref, bt_ref, q_ref, k_ref, v_ref, o_ref, *, block_n, rows, group, k_pairs):
    """float8_e5m2 pages: an e5m2 byte is the top byte of an fp16 of the same value (same exponent bias), so a uint16
    pair of them gives two fp16 values with a shift and a mask, no cvt. V as uint16 pairs [P, bs, K, D/2] (two dots,
    as dpairs); K as e5m2 bytes converted by cvt, or (k_pairs) as pairs too, Q.K^T then two dots over the even and
    odd dimensions."""
    kh, b = pl.program_id(0), pl.program_id(1)
    head = kh * group + jnp.minimum(jnp.arange(rows), group - 1)
    dcol, hcol = jnp.arange(D), jnp.arange(D // 2)
    if k_pairs:
        qe, qo = (q_ref[b, head[:, None], 2 * hcol[None, :] + j].astype(jnp.float16) for j in (0, 1))
    else:
        q = q_ref[b, head[:, None], dcol[None, :]].astype(jnp.float16)
    n = lens_ref[b]
    qk = D ** -0.5 * LOG2E

    def halves(u):                                                     # uint16 [N, D/2] -> even, odd dims as fp16
        return (jax.lax.bitcast_convert_type(u << 8, jnp.float16),
                jax.lax.bitcast_convert_type(u & 0xFF00, jnp.float16))

    def body(i, carry):
        accs, m, l = carry
        tok = i * block_n + jnp.arange(block_n)
        t = jnp.minimum(tok, n - 1)
        page, slot = bt_ref[b, t // BS], t % BS
        if k_pairs:
            ke, ko = halves(k_ref[page, slot, kh, :])
            s = plt.dot(qe, ke, trans_b=True) + plt.dot(qo, ko, trans_b=True)
        else:
            s = plt.dot(q, k_ref[page, slot, kh, :].astype(jnp.float16), trans_b=True)
        s = jnp.where((tok < n)[None, :], s * qk, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        p16 = p.astype(jnp.float16)
        accs = tuple(a * alpha[:, None] + plt.dot(p16, x) for a, x in zip(accs, halves(v_ref[page, slot, kh, :])))
        return accs, m_new, l * alpha + p.sum(axis=1)

    z = jnp.zeros((rows, D // 2), jnp.float32)
    accs, m, l = jax.lax.fori_loop(0, pl.cdiv(n, block_n), body, ((z, z), jnp.full((rows,), -1e30, jnp.float32),
                                                                  jnp.zeros((rows,), jnp.float32)))
    inv = (1.0 / jnp.where(l > 0, l, 1.0))[:, None]
    for j, a in enumerate(accs):
        o_ref[b, head[:, None], 2 * hcol[None, :] + j] = (a * inv).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_n", "warps", "stages"))
def decode_e5m2(q, kc, vd, bt, lens, block_n=64, warps=2, stages=3):
    """kc: float8_e5m2 [P, bs, K, D], or its uint16 pairs [P, bs, K, D/2]; vd: uint16 pairs of e5m2 values."""
    B = q.shape[0]
    return pl.pallas_call(
        functools.partial(kernel_e5m2, block_n=block_n, rows=16, group=H // K, k_pairs=kc.dtype == jnp.uint16),
        grid=(K, B), out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages), interpret=interp,
        name="e5m2_probe")(lens, bt, q, kc, vd)


def to_dquads(vc):
    """fp8 [P, bs, K, D] -> the same bytes as uint32 [P, bs, K, D/4] (dimension 4j + i in byte i)."""
    u8 = jax.lax.bitcast_convert_type(vc, jnp.uint8).astype(jnp.uint32)
    return u8[..., 0::4] | (u8[..., 1::4] << 8) | (u8[..., 2::4] << 16) | (u8[..., 3::4] << 24)


def to_dpairs(vc):
    """fp8 [P, bs, K, D] -> the same bytes as uint16 [P, bs, K, D/2]."""
    u8 = jax.lax.bitcast_convert_type(vc, jnp.uint8).astype(jnp.uint16)
    return u8[..., 0::2] | (u8[..., 1::2] << 8)


def to_pairs(vc):
    """fp8 [P, bs, K, D] -> uint16 [P, bs/2, K, D]: token 2i in the low byte, 2i+1 in the high one."""
    P = vc.shape[0]
    u8 = jax.lax.bitcast_convert_type(vc, jnp.uint8).reshape(P, BS // 2, 2, K, D).astype(jnp.uint16)
    return u8[:, :, 0] | (u8[:, :, 1] << 8)


def pairs(json_path, forms=None):
    rows = []
    shapes = [(4, 100)] if interp else [(256, 1024), (128, 1024), (64, 1024), (64, 4096), (32, 2048)]
    tiles = [dict(block_n=64, warps=2, stages=3)]
    if not interp:
        tiles += [dict(block_n=128, warps=2, stages=2), dict(block_n=128, warps=4, stages=2),
                  dict(block_n=128, warps=2, stages=3)]
    for B, ctx in shapes:
        q, kc, vc, bt, lens = case(B, ctx, "fp8")
        r0 = paged_attention_reference(q.astype(jnp.float32), kc, vc, bt, lens, k_scale=1.0, v_scale=1.0)
        vp = to_pairs(vc)
        nbytes = B * ctx * K * D * 2
        variants = [("today_fp8", decode, vc, {}), ("today_bf16", decode, None, {})]
        variants += [(f"pairs_{c}", functools.partial(decode_pairs, conv=c), vp, t) for c in ("cvt",)
                     for t in tiles[:1]]
        variants += [("dpairs", decode_dpairs, to_dpairs(vc), t) for t in tiles]
        variants += [("dquads", decode_dpairs, to_dquads(vc), t) for t in tiles]
        variants += [("dpairs_f8qk", decode_dpairs, to_dpairs(vc), dict(t, f8qk=True)) for t in tiles]
        k5, v5 = (x.astype(jnp.float32).astype(jnp.float8_e5m2) for x in (kc, vc))
        r5 = paged_attention_reference(q.astype(jnp.float32), k5.astype(jnp.float32), v5.astype(jnp.float32), bt, lens)
        variants += [(f"e5m2_{kf}", decode_e5m2, (kin, to_dpairs(v5)), t)
                     for kf, kin in (("kcvt", k5), ("kpairs", to_dpairs(k5))) for t in tiles]
        for name, fn, v_in, kw in variants:
            if forms and name not in forms:
                continue
            qq, kk, vv, nb, ref = q, kc, v_in, nbytes, r0
            if v_in is None:        # bf16 pages of the same values
                kk, vv, nb = kc.astype(jnp.bfloat16), vc.astype(jnp.bfloat16), nbytes * 2
            elif isinstance(v_in, tuple):       # (k, v) pages of their own (e5m2), against their own reference
                (kk, vv), ref = v_in, r5
            f = functools.partial(fn, **kw)
            try:
                out = f(qq, kk, vv, bt, lens)
                err = float(jnp.abs(out.astype(jnp.float32) - ref).max())
                s = time_loop(f, qq, kk, vv, bt, lens, est_s=nb / 3e12)
                row = dict(us=s * 1e6, tbps=nb / s / 1e12, max_err=err)
            except Exception as e:
                row = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
            rows.append(dict(B=B, ctx=ctx, form=name, **kw, **row))
            print(rows[-1], flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)



if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--forms", default="", help="comma-separated form names to run (default: all)")
    a = ap.parse_args()
    pairs(a.json, [f for f in a.forms.split(",") if f])
