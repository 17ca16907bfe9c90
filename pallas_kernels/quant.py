"""FP8 (e4m3) KV cache: quantise / dequantise, scale validation, and the in-kernel helpers both kernels share.

Convention (vLLM's): a cache value c (float8_e4m3fn) stands for c * scale, so `scale` is the DEquantisation
scale and a layer's k_scale = (largest |k| it must hold) / 448. Writing divides by the scale and clips to
+-448 first: a cast of an out-of-range value to e4m3fn gives NaN in XLA (the format has no infinity) but
saturates in Triton's cvt, so the explicit clip makes both agree, and one outlier costs one clipped value
instead of a NaN that would poison every later step of its sequence.

Scales are float32, either one per layer or one per kv head. The kernels take them as [L, 1] or [L, K] and a
`layer` row (a model's stacked per-layer scales go in whole: no per-layer slice copied out each step); a
single layer may give [] or [K]. A kernel program handles ONE kv head, so either kind is one scalar per
program, folded into the softmax scale (k) and the final normalisation (v): dequantising costs no multiply
per element, only the fp8 -> fp16/fp32 conversion of each loaded tile.

Pallas' Triton lowering loads float8_e4m3fn refs directly and converts with tt.fp_to_fp (Triton's cvt,
sm_89+; the lowering refuses compute capabilities below 8.9), so pages need no uint8 bitcast: lowered for
CUDA on jax 0.10.2 in tests/test_fp8_kernels.py; 0.11.2's lowering has the same rules (read in its source);
the compiled kernels are checked by the gpu-marked test there. On the GPU the dot runs in float16 (one
cvt.f16x2.e4m3x2 per two values; bf16 takes a second conversion): q and the softmax weights are fine in
fp16's range, and its 10-bit mantissa holds the e4m3 values exactly.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = 448.0    # largest finite float8_e4m3fn


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) == FP8_DTYPE


def _per_head(scale, x):
    """scale [] / [K] / [..., K] against x [..., K, D]: a trailing axis for D."""
    scale = jnp.asarray(scale, jnp.float32)
    return scale if scale.ndim == 0 else scale[..., None]


def quantize(x: jax.Array, scale, dtype=FP8_DTYPE) -> jax.Array:
    """x [..., K, D] -> fp8 values x / scale, clipped to the finite range. scale: [] (one for all heads) or
    [K] (per kv head). The division is IEEE in XLA; the Pallas decode kernel does the same division, so on
    the CPU (interpret mode) both give the same bits (on the GPU Triton's division may differ in the last
    fp32 bit, i.e. rarely by one fp8 step)."""
    y = x.astype(jnp.float32)
    if jnp.dtype(x.dtype).itemsize < 4:
        # Round to x's own precision explicitly: XLA may keep a bf16 value in fp32 inside a fusion (excess precision),
        # so without this the bytes written depended on where a fusion ended (e.g. tensor-parallel vs not).
        info = jnp.finfo(x.dtype)
        y = jax.lax.reduce_precision(y, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    return jnp.clip(y / _per_head(scale, x), -FP8_MAX, FP8_MAX).astype(dtype)


def dequantize(x: jax.Array, scale, dtype=jnp.float32) -> jax.Array:
    """fp8 x [..., K, D] -> x * scale in `dtype`."""
    return (x.astype(jnp.float32) * _per_head(scale, x)).astype(dtype)


def scale_for_amax(amax, margin: float = 1.0) -> jax.Array:
    """Dequantisation scale that maps |x| <= amax * margin onto the fp8 range (amax 0 -> scale 1)."""
    amax = jnp.asarray(amax, jnp.float32) * margin
    return jnp.where(amax > 0, amax / FP8_MAX, 1.0)


def relative_step() -> float:
    """Worst relative rounding error of a normal e4m3 value (half of one 3-bit-mantissa step: 2^-4)."""
    return 2.0 ** -4


def kv_scales(name: str, k_cache, k_scale, v_scale, layer=0):
    """Validates the scales of a cache and normalises them for the kernels.

    Returns None for an unquantised cache, else (k_scale [L, C], v_scale [L, C], layer [1] int32) with C 1 or K.
    Raises ValueError naming the bad value: an fp8 cache without scales, scales for a cache that is not fp8,
    shapes that are neither [], [K], [L, 1] nor [L, K], or a static layer outside [0, L)."""
    if not is_fp8(k_cache.dtype):
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"{name}: k_scale/v_scale are for float8_e4m3fn caches; this cache is {k_cache.dtype}")
        return None
    if k_scale is None or v_scale is None:
        raise ValueError(f"{name}: a float8_e4m3fn cache needs k_scale and v_scale (dequantisation scales)")
    K = k_cache.shape[2]
    out = []
    for which, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        s = jnp.asarray(s)
        if s.ndim == 0:
            s = s.reshape(1, 1)
        elif s.ndim == 1 and s.shape[0] == K:
            s = s.reshape(1, K)
        elif not (s.ndim == 2 and s.shape[1] in (1, K)):
            raise ValueError(f"{name}: {which} must have shape (), ({K},), (L, 1) or (L, {K}), got {s.shape}")
        out.append(s.astype(jnp.float32))
    if out[0].shape != out[1].shape:
        raise ValueError(f"{name}: k_scale {out[0].shape} and v_scale {out[1].shape} must have the same layout")
    if isinstance(layer, int) and not 0 <= layer < out[0].shape[0]:
        raise ValueError(f"{name}: layer={layer} is outside the {out[0].shape[0]} rows of k_scale/v_scale")
    return out[0], out[1], jnp.asarray(layer, jnp.int32).reshape(1)


def compute_dtype(q_dtype, cache_dtype):
    """The dtype K/V tiles are converted to for the dots: the cache's own when it is not fp8; for fp8, float32
    with fp32 queries (exact tests), else float16 (see the module docstring)."""
    if not is_fp8(cache_dtype):
        return jnp.dtype(cache_dtype)
    return jnp.dtype(jnp.float32) if jnp.dtype(q_dtype) == jnp.float32 else jnp.dtype(jnp.float16)


# -- inside kernels (values and refs) -----------------------------------------------------------------

def load_scales(scale_refs, kh):
    """(k_scale, v_scale) scalars of kv head kh from the refs (k [L, C], v [L, C], layer [1]); 1.0 without."""
    if scale_refs is None:
        return 1.0, 1.0
    ks_ref, vs_ref, layer_ref = scale_refs
    col = kh if ks_ref.shape[1] > 1 else 0
    layer = layer_ref[0]
    return ks_ref[layer, col], vs_ref[layer, col]


def quantize_in_kernel(x, scale):
    """x [R, D] -> fp8, as `quantize` does (fp32 divide, clip, round to nearest even)."""
    y = x.astype(jnp.float32) / scale
    return jnp.clip(y, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def dequantize_cache(k_cache, v_cache, k_scale=None, v_scale=None, layer=0, name: str = "reference"):
    """For the jnp references: (k, v) caches in float32 when they are fp8 (row `layer` of the scales), else
    unchanged. V pages in pairs (uint16) are unpacked first."""
    scales = kv_scales(name, k_cache, k_scale, v_scale, layer)
    if scales is None:
        return k_cache, v_cache
    ks, vs, row = scales
    v_cache = unpack_pairs(v_cache) if is_pairs(v_cache.dtype) else v_cache
    return dequantize(k_cache, ks[row[0]]), dequantize(v_cache, vs[row[0]])


# -- fp8 V pages in pairs ----------------------------------------------------------------------------
# The Pallas kernels' P.V dot takes V with its token axis as the contracted one, while a page stores each token's
# D values side by side. For bf16 pages Triton loads that operand transposed from shared memory (ldmatrix.trans);
# it has no 8-bit form, so fp8 pages were read one byte at a time (docs/fp8_kv_cache.md). The same bytes viewed
# as uint16 [P, bs, K, D/2] (head dimensions 2j and 2j+1 of a token in one element, 2j in the low byte) make the
# operand 16-bit: the kernels then do two dots, one over the even dimensions (low bytes) and one over the odd ones
# (high bytes), and store the two halves of the output interleaved. The engine keeps fp8 V pages of the pallas
# backend this way ("pairs"); K pages stay float8_e4m3fn [P, bs, K, D] (their dot needs no transpose).
PAIRS_DTYPE = jnp.dtype(jnp.uint16)


def is_pairs(dtype) -> bool:
    return jnp.dtype(dtype) == PAIRS_DTYPE


def pack_pairs(x: jax.Array) -> jax.Array:
    """fp8 [..., D] -> the same bytes as uint16 [..., D/2] (element j: dimension 2j low, 2j + 1 high)."""
    u = jax.lax.bitcast_convert_type(x.astype(FP8_DTYPE), jnp.uint8).astype(jnp.uint16)
    return u[..., 0::2] | (u[..., 1::2] << 8)


def unpack_pairs(u: jax.Array) -> jax.Array:
    """uint16 [..., D/2] -> fp8 [..., D] (pack_pairs undone)."""
    b = jnp.stack([(u & 0xFF).astype(jnp.uint8), (u >> 8).astype(jnp.uint8)], axis=-1)
    return jax.lax.bitcast_convert_type(b.reshape(*u.shape[:-1], 2 * u.shape[-1]), FP8_DTYPE)


def pair_halves(u, dtype):
    """Inside a kernel: a uint16 tile [..., D/2] -> (even dimensions, odd dimensions), each [..., D/2] in `dtype`."""
    return tuple(jax.lax.bitcast_convert_type(x.astype(jnp.uint8), FP8_DTYPE).astype(dtype) for x in (u & 0xFF, u >> 8))


def pack_in_kernel(even, odd):
    """Inside a kernel: fp8 values of the even and odd dimensions [..., D/2] -> their uint16 pairs."""
    lo, hi = (jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint16) for x in (even, odd))
    return lo | (hi << 8)


# fp8 pages stored as their bytes (uint8 [P, bs, K, D]): the xla backend's caches on the CPU. XLA:CPU has no fp8
# arithmetic and rewrote a whole float8 array for each scatter into it (a CPU decode step ~20-45x a float32 cache's);
# a uint8 array is written in place, and readers view the pages they gathered as fp8 (`as_fp8`).
BYTES_DTYPE = jnp.dtype(jnp.uint8)


def as_fp8(x: jax.Array) -> jax.Array:
    """Byte pages (BYTES_DTYPE) viewed as fp8; any other array unchanged."""
    return jax.lax.bitcast_convert_type(x, FP8_DTYPE) if x.dtype == BYTES_DTYPE else x
