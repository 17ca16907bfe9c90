"""Skinny matmul for small decode batches (Pallas, Triton backend): out [M, N] = x [M, E] @ W [E, N], M <= ~32.

Why: at batch <= 16 a decode step's matmuls only have to stream the weights once (the floor for Qwen3-0.6B is
~0.28 ms at 4.3 TB/s); XLA's cuBLAS kernels for 8-row GEMMs read them at ~1.7 TB/s (profile at batch 2).

Design:
  * grid = (N / block_n column blocks, split_k slices of E). Each program streams a [E / split_k, block_n] strip
    of W in [block_k, block_n] tiles (pipelined by Triton) and keeps x's rows, padded to >= 16 for the tensor-core
    dot, in registers; fp32 accumulation. Padding rows re-read the last real row and store identical values to it.
  * split_k > 1 when N / block_n alone gives too few programs to fill the SMs (o_proj, down_proj: N = 1024):
    each slice writes an fp32 partial [S, M, N] and a jnp sum (inside the same jit, fused by XLA into its
    consumer where it can) adds them.
  * W may be a model's stacked [L, E, N] weights with `layer` ([1] int32 operand): XLA copies a slice of a
    stacked array into its own buffer before a custom call, which would double the bytes of every matmul.
  * `transpose_w`: W is [N, E] (a tied embedding used as the LM head: logits = x @ embed^T); its rows are read
    whole along E, which coalesces as well as the [E, N] case's column strips.
  * Fused forms, so a decode layer runs fewer kernels: `norm_weight` folds the RMSNorm in front of the matmul
    into it (RMSNorm(x) @ W = diag(1/rms(x)) (x * g) @ W: the dot takes x * g and each row is scaled by its
    1/rms at the end, one pass over x), and `swiglu` reads the gate and up column blocks of a [gate | up] W in
    the same program and writes silu(gate) * up. Both need whole sums over E: no split-K with them.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._common import dot_precision, is_pow2, next_pow2, prev_pow2

NUM_SMS = 132          # H200; only used to pick block_n / split_k
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 3
MAX_ROWS = 64          # x rows the kernel takes (registers: [rows, block_n] fp32 accumulator)


def choose_tiles(M: int, E: int, N: int, transpose_w: bool = False, split: bool = True) -> dict:
    """Static tile choice: the widest column block (<= 128, >= 32) that still gives >= NUM_SMS programs, else
    32-wide blocks and a power-of-two split of E up to ~NUM_SMS programs. Raises ValueError when E or N has no
    power-of-two tile >= 16 (the caller falls back to XLA: see `supported`). split=False: never split E."""
    block_n = next((b for b in (128, 64, 32) if N % b == 0 and N // b >= NUM_SMS), None)
    if block_n is None:
        block_n = next((b for b in (32, 16) if N % b == 0), None)
    block_k = next((b for b in (128, 64, 32, 16) if E % b == 0), None)
    if block_n is None or block_k is None:
        raise ValueError(f"gemv: E={E} and N={N} must be multiples of 16")
    split_k = 1
    if split and N // block_n < NUM_SMS:
        split_k = prev_pow2(max(1, NUM_SMS // (N // block_n)))
        while split_k > 1 and (E % (split_k * block_k) or E // split_k < block_k):
            split_k //= 2
    return dict(block_n=block_n, block_k=block_k, split_k=split_k)


def supported(M: int, E: int, N: int) -> bool:
    """Shapes the kernel takes with its automatic tiles (the model falls back to XLA otherwise)."""
    return 1 <= M <= MAX_ROWS and E % 16 == 0 and N % 16 == 0


def _gemv_kernel(layer_ref, x_ref, w_ref, *refs, rows: int, block_n: int, block_k: int, k_per_split: int,
                 transpose_w: bool, stacked: bool, split: bool, norm: bool, eps: float, half: int, precision):
    # refs: [norm weight if norm] out. half > 0: swiglu, W's columns are [gate (half) | up (half)]
    g_ref, o_ref = refs if norm else (None, refs[0])
    j, s = pl.program_id(0), pl.program_id(1)
    M, E = x_ref.shape
    r = jnp.minimum(jnp.arange(rows), M - 1)              # [rows] padding rows repeat the last real row
    n0 = j * block_n
    k_start = s * k_per_split
    layer = layer_ref[0] if stacked or (norm and g_ref.ndim == 2) else None

    def w_tile(k0, c0):
        # [block_k, block_n] (or [block_n, block_k] transposed) contiguous tile of this layer's W, columns c0..
        idx = (pl.ds(c0, block_n), pl.ds(k0, block_k)) if transpose_w else (pl.ds(k0, block_k), pl.ds(c0, block_n))
        return w_ref[(layer, *idx)] if stacked else w_ref[idx]

    def body(i, carry):
        acc, acc_up, ss = carry
        k0 = k_start + i * block_k
        x = x_ref[r[:, None], k0 + jnp.arange(block_k)[None, :]]        # [rows, BK]
        if norm:   # RMSNorm folded in: (x * g) @ W here, times each row's 1 / rms(x) at the end
            xf = x.astype(jnp.float32)
            ss = ss + jnp.sum(xf * xf, axis=1)
            g = g_ref[layer, pl.ds(k0, block_k)] if g_ref.ndim == 2 else g_ref[pl.ds(k0, block_k)]
            x = xf * g.astype(jnp.float32)[None, :]
        w = w_tile(k0, n0)
        x = x.astype(w.dtype)
        acc = acc + plt.dot(x, w, trans_b=transpose_w, precision=precision)   # [rows, BN] fp32
        if half:
            acc_up = acc_up + plt.dot(x, w_tile(k0, half + n0), precision=precision)
        return acc, acc_up, ss

    zeros = jnp.zeros((rows, block_n), jnp.float32)
    acc, acc_up, ss = jax.lax.fori_loop(0, k_per_split // block_k, body, (zeros, zeros, jnp.zeros((rows,), jnp.float32)))
    if norm:
        inv = jax.lax.rsqrt(ss / E + eps)[:, None]
        acc, acc_up = acc * inv, acc_up * inv
    if half:       # silu(gate) * up
        acc = acc / (1.0 + jnp.exp(-acc)) * acc_up
    n = n0 + jnp.arange(block_n)
    if split:
        o_ref[s, r[:, None], n[None, :]] = acc
    else:
        o_ref[r[:, None], n[None, :]] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("transpose_w", "swiglu", "eps", "out_dtype", "block_n", "block_k",
                                             "split_k", "num_warps", "num_stages", "interpret"))
def _gemv(x, w, layer, norm_weight, *, transpose_w, swiglu, eps, out_dtype, block_n, block_k, split_k, num_warps,
          num_stages, interpret):
    M, E = x.shape
    stacked = w.ndim == 3
    N = w.shape[-2] if transpose_w else w.shape[-1]
    n_out = N // 2 if swiglu else N
    rows = max(16, next_pow2(M))          # tensor-core dots need >= 16 rows
    kernel = functools.partial(_gemv_kernel, rows=rows, block_n=block_n, block_k=block_k,
                               k_per_split=E // split_k, transpose_w=transpose_w, stacked=stacked,
                               split=split_k > 1, norm=norm_weight is not None, eps=eps,
                               half=n_out if swiglu else 0, precision=dot_precision(w.dtype))
    shape = (split_k, M, n_out) if split_k > 1 else (M, n_out)     # fp32 partials per E slice, or the result
    args = (layer, x, w) + ((norm_weight,) if norm_weight is not None else ())
    out = pl.pallas_call(
        kernel,
        grid=(n_out // block_n, split_k),
        out_shape=jax.ShapeDtypeStruct(shape, jnp.float32 if split_k > 1 else out_dtype),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="gemv",
    )(*args)
    return out.sum(axis=0).astype(out_dtype) if split_k > 1 else out


def gemv(x: jax.Array, w: jax.Array, layer: int | jax.Array = 0, *, norm_weight: jax.Array | None = None,
         eps: float = 1e-6, swiglu: bool = False, transpose_w: bool = False, out_dtype=None, interpret: bool = False,
         block_n: int | None = None, block_k: int | None = None, split_k: int | None = None,
         num_warps: int = DEFAULT_NUM_WARPS, num_stages: int = DEFAULT_NUM_STAGES) -> jax.Array:
    """x [M, E] @ W -> [M, N] in out_dtype (default x's), fp32 accumulation.

    W: [E, N], or stacked [L, E, N] of which row `layer` (int or [1]/[] int32 array) is used; with
    transpose_w, [N, E] or [L, N, E] (x @ W^T). Fused options (one kernel instead of two or three):
    norm_weight [E] or stacked [L, E] (row `layer`): RMSNorm(x) @ W with epsilon `eps` (Qwen3's RMSNorm);
    swiglu: W's columns are [gate | up] and the result is silu(x @ gate) * (x @ up), [M, N / 2].
    Tiles (None: `choose_tiles`): block_n, block_k powers of two >= 16 dividing N and E; split_k a power of two
    with E / split_k a multiple of block_k (1 with norm_weight or swiglu: they need whole sums)."""
    if x.ndim != 2 or w.ndim not in (2, 3):
        raise ValueError(f"gemv: x must be [M, E] and w [E, N] or [L, E, N], got {x.shape} and {w.shape}")
    M, E = x.shape
    we, N = (w.shape[-1], w.shape[-2]) if transpose_w else (w.shape[-2], w.shape[-1])
    if we != E:
        raise ValueError(f"gemv: x {x.shape} and w {w.shape} (transpose_w={transpose_w}) disagree on E")
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"gemv: x has {M} rows; the kernel takes 1..{MAX_ROWS}")
    rows_w = max(w.shape[0] if w.ndim == 3 else 1, norm_weight.shape[0] if norm_weight is not None and
                 norm_weight.ndim == 2 else 1)
    if isinstance(layer, int) and not 0 <= layer < rows_w:
        raise ValueError(f"gemv: layer={layer} is outside w's {rows_w} rows")
    if norm_weight is not None and (norm_weight.shape[-1] != E or norm_weight.ndim not in (1, 2)):
        raise ValueError(f"gemv: norm_weight must be [E={E}] or [L, E], got {norm_weight.shape}")
    if swiglu and (transpose_w or N % 32):
        raise ValueError(f"gemv: swiglu needs W [E, 2I] (not transposed) with 2I={N} a multiple of 32")
    fused = norm_weight is not None or swiglu
    tiles = choose_tiles(M, E, N // 2 if swiglu else N, transpose_w, split=not fused)
    tiles.update({k: v for k, v in dict(block_n=block_n, block_k=block_k, split_k=split_k).items() if v is not None})
    for name, div in (("block_n", N // 2 if swiglu else N), ("block_k", E)):
        b = tiles[name]
        if not is_pow2(b) or b < 16 or div % b:
            raise ValueError(f"gemv: {name}={b} must be a power of two >= 16 dividing {div}")
    S = tiles["split_k"]
    if not is_pow2(S) or E % (S * tiles["block_k"]) or (fused and S > 1):
        raise ValueError(f"gemv: split_k={S} must be a power of two with E={E} a multiple of split_k * block_k="
                         f"{S * tiles['block_k']} (and 1 with norm_weight or swiglu)")
    layer = jnp.asarray(layer, jnp.int32).reshape(1)        # a constant operand: one kernel serves every layer
    return _gemv(x, w, layer, norm_weight, transpose_w=transpose_w, swiglu=swiglu, eps=float(eps),
                 out_dtype=jnp.dtype(out_dtype or x.dtype), num_warps=num_warps, num_stages=num_stages,
                 interpret=interpret, **tiles)


def gemv_reference(x: jax.Array, w: jax.Array, layer: int = 0, *, norm_weight: jax.Array | None = None,
                   eps: float = 1e-6, swiglu: bool = False, transpose_w: bool = False, out_dtype=None):
    """Plain jnp, fp32: RMSNorm(x) (if norm_weight) @ W[layer] (or W[layer]^T), then silu(gate) * up (if swiglu)."""
    w = w[layer] if w.ndim == 3 else w
    h = x.astype(jnp.float32)
    if norm_weight is not None:
        g = norm_weight[layer] if norm_weight.ndim == 2 else norm_weight
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps) * g.astype(jnp.float32)
    eq = "me,ne->mn" if transpose_w else "me,en->mn"
    out = jnp.einsum(eq, h, w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    if swiglu:
        gate, up = jnp.split(out, 2, axis=-1)
        out = jax.nn.silu(gate) * up
    return out.astype(out_dtype or x.dtype)
