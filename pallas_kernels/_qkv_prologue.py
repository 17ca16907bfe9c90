"""The Qwen3-specific parts of the engine's decode kernel (`paged_attention_qkv`), on refs inside the kernel:
per-head q/k RMSNorm + RoPE from the raw qkv projection, and the new token's K/V (stored into the aliased
cache, then folded into the online softmax from registers)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import out_columns
from pallas_kernels.quant import is_pairs, pack_in_kernel, quantize_in_kernel


def new_token(qkv_ref, k_out_ref, v_out_ref, kw_ref, rope, bt_ref, b, kh, heads, kv_heads, dcol, split, seq_len,
              block_size, scales=None, page_offset: int = 0):
    """The new token's k (normalised, rotated) and v [1, D] of kv head kh, stored into the cache at position
    seq_len - 1 (split 0 of a real row only). The context loop never reads that position.
    scales = (k_scale, v_scale) for an fp8 cache: k/v are quantised before the store, and returned as stored
    (fp8 values in fp32, scales not applied: the caller folds them in as it does for the cached tokens).
    v comes back in the parts of the running output (acc_zeros): ([1, D],), or its even and odd dimensions
    ([1, D/2] each) for V pages in pairs, which are packed into uint16 for the store."""
    kn = norm_rope(qkv_ref, b, jnp.full((1,), heads + kh, jnp.int32), kw_ref, *rope)  # [1, D]
    parts = 2 if is_pairs(v_out_ref.dtype) else 1
    vn = tuple(qkv_ref[b, heads + kv_heads + kh, cols[None, :]] for cols in out_columns(dcol.shape[0], parts))
    active = (split == 0) & (seq_len > 0)
    if scales is not None:
        kn = quantize_in_kernel(kn, scales[0])    # [1, D] fp8
        vn = tuple(quantize_in_kernel(x, scales[1]) for x in vn)
    write_new_token(kn, vn, k_out_ref, v_out_ref, bt_ref, b, kh, dcol, seq_len - 1, block_size, active, page_offset)
    if scales is not None:
        kn, vn = kn.astype(jnp.float32), tuple(x.astype(jnp.float32) for x in vn)
    return kn, vn, active


def norm_rope(qkv_ref, b, heads, w_ref, layer, cos_ref, sin_ref, row, eps):
    """Rows `heads` of qkv[b] -> Qwen3's per-head RMSNorm with weights w_ref[layer] (HF order: normalise in
    fp32, cast, scale) then rotate-half RoPE. rotate_half(x)[j] = -x[j + D/2] (j < D/2), x[j - D/2]
    (j >= D/2): the rotated copy is loaded through a permuted column index instead of being shuffled in
    registers. -> [R, D] in qkv's dtype."""
    D = qkv_ref.shape[-1]
    dcol = jnp.arange(D)
    perm = (dcol + D // 2) % D
    x = qkv_ref[b, heads[:, None], dcol[None, :]]  # [R, D]
    xp = qkv_ref[b, heads[:, None], perm[None, :]]  # [R, D] = x[:, perm]
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.sum(xf * xf, axis=1) / D + eps)[:, None]  # [R, 1]
    xn = (xf * r).astype(dtype) * w_ref[layer, dcol][None, :]
    xpn = (xp.astype(jnp.float32) * r).astype(dtype) * w_ref[layer, perm][None, :]
    rotated = jnp.where(dcol[None, :] < D // 2, -xpn, xpn)
    cos = cos_ref[row, dcol][None, :].astype(dtype)
    sin = sin_ref[row, dcol][None, :].astype(dtype)
    return xn * cos + rotated * sin


def attend_new_token(acc, m, l, q, kn, vn, qk_scale, active):
    """Fold the new token (one key kn [1, D], value vn in the parts of acc, in registers) into the online softmax
    state."""
    s = jnp.sum(q.astype(jnp.float32) * kn.astype(jnp.float32), axis=1) * qk_scale  # [rows]
    m_new = jnp.maximum(m, s)
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new)
    acc = tuple(jnp.where(active, a * alpha[:, None] + p[:, None] * v.astype(jnp.float32), a) for a, v in zip(acc, vn))
    return acc, jnp.where(active, m_new, m), jnp.where(active, l * alpha + p, l)


def write_new_token(kn, vn, k_out_ref, v_out_ref, bt_ref, b, kh, dcol, pos, block_size, active, page_offset=0):
    """Store the new token's K [1, D] and V (its parts, new_token) of kv head kh into its slot: page
    bt[b, pos // bs] (+ page_offset), row pos % bs."""
    @pl.when(active)
    def _():
        p = jnp.maximum(pos, 0)
        page, slot = bt_ref[b, p // block_size] + page_offset, p % block_size
        k_out_ref[page, slot, kh, dcol[None, :]] = kn
        if len(vn) == 2:      # pairs: element j holds dimensions 2j (low byte) and 2j + 1
            v_out_ref[page, slot, kh, jnp.arange(dcol.shape[0] // 2)[None, :]] = pack_in_kernel(*vn)
        else:
            v_out_ref[page, slot, kh, dcol[None, :]] = vn[0]


def check_qkv_inputs(qkv, q_norm, k_norm, cos, sin, K: int, layer, page_offset) -> None:
    """paged_attention_qkv's own arguments (the paged ones are checked with paged_attention's): ValueError naming
    the one that does not fit."""
    if isinstance(page_offset, bool) or (isinstance(page_offset, int) and page_offset < 0):
        raise ValueError(f"paged_attention_qkv: page_offset must be an int >= 0, got {page_offset!r}")
    B, D = qkv.shape[0], qkv.shape[-1]
    if qkv.ndim != 3 or qkv.shape[1] <= 2 * K:
        raise ValueError(f"paged_attention_qkv: qkv must be [B, H + 2K, D] with K={K} kv heads, got {qkv.shape}")
    for name, x in (("q_norm", q_norm), ("k_norm", k_norm)):
        if x.shape[-1:] != (D,) or x.ndim not in (1, 2) or x.shape != q_norm.shape:
            raise ValueError(f"paged_attention_qkv: {name} must have shape ({D},) or (L, {D}) like q_norm, "
                             f"got {x.shape}")
    for name, x in (("cos", cos), ("sin", sin)):
        if x.shape != (B, D):
            raise ValueError(f"paged_attention_qkv: {name} must have shape {(B, D)}, got {x.shape}")
    rows = q_norm.shape[0] if q_norm.ndim == 2 else 1
    if isinstance(layer, int) and not 0 <= layer < rows:
        raise ValueError(f"paged_attention_qkv: layer={layer} is outside the {rows} rows of q_norm/k_norm")
