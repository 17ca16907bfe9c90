"""A small decode batch's matmuls between two attention calls as ONE persistent kernel (Pallas, Triton backend).

Why: at batch 1 a Qwen3-0.6B decode layer is ~10 kernels of a few microseconds each, and its four GEMMs read
their 31 MB at ~1.35 TB/s: each short kernel pays its launch, ramp-up and tail (docs/performance.md). Here
everything from one layer's attention output to the next layer's qkv runs in one kernel:

  B  mid = x + o @ Wo[l]                                 (the residual in the epilogue)
  C  act = silu(RMSNorm(mid) @ Wg[l]) * (RMSNorm(mid) @ Wu[l])
  D  x'  = mid + act @ Wd[l]
  A  qkv = RMSNorm(x') @ Wqkv[l + 1]                     (left out after the last layer)

Design:
  * grid = (P,) programs, P <= the SMs so that all are resident at once; each phase's column blocks are dealt
    round-robin over the programs, and a grid-wide barrier (an atomic counter, then a spin on it) separates the
    phases. Activations go through small global buffers, each written before it is read within a call.
  * Every phase streams W in [block_k, block_n] tiles of the engine's stacked [L, K, N] weights, x's rows padded
    to the 16 a tensor-core dot needs (padding rows repeat the last real row); fp32 accumulation. RMSNorm is
    folded in (each program computes the rows' 1/rms itself: E values a row).
  * The rounding points are the XLA layer's (model/qwen3.py): bf16 after every matmul, residual add, norm and
    silu, so the kernel and XLA's path differ only in summation order.
  * interpret=True (CPU tests): one program, which runs every phase's blocks in turn (its barriers pass at once).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

NUM_PROGRAMS = 128    # <= the H200's 132 SMs: every program must be resident (they wait for each other)
MAX_ROWS = 16
BLOCK_K = 128         # the largest K tile (a power of two dividing E, the q width and I is taken)
NUM_STAGES = 3
PHASES = ("B", "C", "D", "A")


def _tiles(E: int, NQ: int, I: int, NQKV: int):
    """(block_k, wide block_n for qkv / gate_up, narrow block_n for o_proj / down_proj), or None."""
    bk = next((b for b in (512, 256, 128, 64, 32, 16) if b <= BLOCK_K and E % b == 0 and NQ % b == 0
               and I % b == 0), None)
    wide = next((b for b in (32, 16) if NQKV % b == 0 and I % b == 0), None)
    narrow = 16 if E % 16 == 0 else None
    return None if None in (bk, wide, narrow) else (bk, wide, narrow)


def supported(rows: int, E: int, NQ: int, I: int, NQKV: int) -> bool:
    return 1 <= rows <= MAX_ROWS and _tiles(E, NQ, I, NQKV) is not None


def _rows(M):
    return jnp.minimum(jnp.arange(16), M - 1)


def _load(ref, M, cols):
    """[16, len(cols)] fp32: ref's rows (the last repeated). A plain load: within a call every buffer is written
    before it is read, so no SM can hold a stale L1 line of it. (JAX 0.10's Pallas cannot lower a ".cg" cache
    modifier: its lookup table lacks the dot.)"""
    return plt.load(ref.at[_rows(M)[:, None], cols[None, :]]).astype(jnp.float32)


def _store(ref, M, cols, val):
    ref[_rows(M)[:, None], cols[None, :]] = val.astype(ref.dtype)


def _bf16(x, dtype):
    return x.astype(dtype).astype(jnp.float32)


def _inv_rms(x_ref, M, E, BK, eps):
    def body(i, ss):
        x = _load(x_ref, M, i * BK + jnp.arange(BK))
        return ss + jnp.sum(x * x, axis=1)
    return jax.lax.rsqrt(jax.lax.fori_loop(0, E // BK, body, jnp.zeros((16,), jnp.float32)) / E + eps)


def _matmul(x_ref, w_ref, layer, cols0, BN, K, BK, M, norm=None):
    """([16, BN] fp32 for each start in cols0) = x_ref[:, :K] (RMSNorm'd with norm = (g_ref, inv)) @ W[layer]."""
    def body(i, accs):
        k0 = i * BK
        x = _load(x_ref, M, k0 + jnp.arange(BK))
        if norm is not None:                       # rms_norm: bf16(x / rms), then g * that in bf16
            g_ref, inv = norm
            g = g_ref[layer, pl.ds(k0, BK)].astype(jnp.float32)
            x = g[None, :] * _bf16(x * inv[:, None], w_ref.dtype)
        x = x.astype(w_ref.dtype)
        return tuple(a + plt.dot(x, w_ref[layer, pl.ds(k0, BK), pl.ds(c0, BN)]) for a, c0 in zip(accs, cols0))
    z = jnp.zeros((16, BN), jnp.float32)
    return jax.lax.fori_loop(0, K // BK, body, tuple(z for _ in cols0))


def _phase(name, item, layer, refs, dims, eps):
    (x, o, g_in, g_post, wqkv, wo, wgu, wd, mid, act, x_out, qkv) = refs
    M, E, NQ, I, NQKV, BK, WIDE, NARROW = dims
    dt = wo.dtype
    if name == "B":
        cols = item * NARROW + jnp.arange(NARROW)
        acc, = _matmul(o, wo, layer, (item * NARROW,), NARROW, NQ, BK, M)
        _store(mid, M, cols, _load(x, M, cols) + _bf16(acc, dt))
    elif name == "C":
        inv = _inv_rms(mid, M, E, BK, eps)
        gate, up = _matmul(mid, wgu, layer, (item * WIDE, I + item * WIDE), WIDE, E, BK, M, (g_post, inv))
        gate, up = _bf16(gate, dt), _bf16(up, dt)
        _store(act, M, item * WIDE + jnp.arange(WIDE), _bf16(gate / (1.0 + jnp.exp(-gate)), dt) * up)
    elif name == "D":
        cols = item * NARROW + jnp.arange(NARROW)
        acc, = _matmul(act, wd, layer, (item * NARROW,), NARROW, I, BK, M)
        _store(x_out, M, cols, _load(mid, M, cols) + _bf16(acc, dt))
    else:                                          # "A": the next layer's qkv from x_out
        inv = _inv_rms(x_out, M, E, BK, eps)
        acc, = _matmul(x_out, wqkv, layer, (item * WIDE,), WIDE, E, BK, M, (g_in, inv))
        _store(qkv, M, item * WIDE + jnp.arange(WIDE), acc)


def _n_items(name, dims):
    M, E, NQ, I, NQKV, BK, WIDE, NARROW = dims
    return {"B": E // NARROW, "C": I // WIDE, "D": E // NARROW, "A": NQKV // WIDE}[name]


def _barrier(cnt_ref, target, gpu: bool):
    if gpu:
        plt.debug_barrier()                                  # this program's stores are issued
    plt.atomic_add(cnt_ref, (jnp.int32(0),), jnp.int32(1))   # arrive (acq_rel, gpu scope)
    jax.lax.while_loop(lambda v: v < target, lambda v: plt.load(cnt_ref.at[0], volatile=True), jnp.int32(0))
    plt.atomic_add(cnt_ref, (jnp.int32(0),), jnp.int32(0))   # acquire: the others' stores are visible
    if gpu:
        plt.debug_barrier()


def _kernel(layer_ref, x, o, g_in, g_post, wqkv, wo, wgu, wd, cnt_in, mid_in, act_in, xo_in, qkv_in,
            mid, act, x_out, qkv, cnt, *, dims, phases, programs, eps, gpu):
    del cnt_in, mid_in, act_in, xo_in, qkv_in                 # aliased to the outputs
    pid = pl.program_id(0)
    refs = (x, o, g_in, g_post, wqkv, wo, wgu, wd, mid, act, x_out, qkv)
    for k, name in enumerate(phases):
        layer = layer_ref[0] + (1 if name == "A" and phases != ("A",) else 0)
        n = _n_items(name, dims)

        def body(j, c, name=name, layer=layer):
            _phase(name, pid + j * programs, layer, refs, dims, eps)
            return c
        jax.lax.fori_loop(0, (n - pid + programs - 1) // programs, body, 0)
        if k + 1 < len(phases):
            _barrier(cnt, (k + 1) * programs, gpu)


@functools.partial(jax.jit, static_argnames=("phases", "eps", "programs", "num_warps", "num_stages", "block_k",
                                             "interpret"))
def _call(layer, x, o, g_in, g_post, wqkv, wo, wgu, wd, *, phases, eps, programs, num_warps, num_stages, block_k,
          interpret):
    del block_k                                   # (part of the cache key: _tiles reads BLOCK_K)
    M, E = x.shape
    NQ, I, NQKV = wo.shape[1], wd.shape[1], wqkv.shape[2]
    dims = (M, E, NQ, I, NQKV, *_tiles(E, NQ, I, NQKV))
    bufs = (jnp.zeros((M, E), x.dtype), jnp.zeros((M, I), x.dtype), x if phases == ("A",) else jnp.zeros_like(x),
            jnp.zeros((M, NQKV), x.dtype))
    kernel = functools.partial(_kernel, dims=dims, phases=phases, programs=programs, eps=eps, gpu=not interpret)
    out = pl.pallas_call(
        kernel, grid=(programs,),
        out_shape=tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in bufs) + (
            jax.ShapeDtypeStruct((1,), jnp.int32),),
        input_output_aliases={10: 0, 11: 1, 12: 2, 13: 3, 9: 4},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="decode_block",
    )(layer, x, o, g_in, g_post, wqkv, wo, wgu, wd, jnp.zeros((1,), jnp.int32), *bufs)
    return out[2], out[3]


def _args(layers: dict):
    return (layers["input_layernorm"], layers["post_attention_layernorm"], layers["qkv_proj"], layers["o_proj"],
            layers["gate_up_proj"], layers["down_proj"])


def decode_block(x: jax.Array, o: jax.Array, layers: dict, layer, *, eps: float, next_qkv: bool = True,
                 interpret: bool = False, programs: int | None = None, num_warps: int = 4,
                 num_stages: int | None = None):
    """x [M, E] (the layer's input residual), o [M, NQ] (its attention output) -> (x' [M, E] the layer's output,
    qkv [M, NQKV] = layer l + 1's RMSNorm(x') @ Wqkv, or None with next_qkv=False). `layers`: the model's stacked
    [L, ...] weights (model/qwen3.py layer_shapes); `layer`: int or int32 array, the layer l."""
    phases = PHASES if next_qkv else PHASES[:3]
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    p = 1 if interpret else (programs or NUM_PROGRAMS)
    x_new, qkv = _call(layer, x, o, *_args(layers), phases=phases, eps=float(eps), programs=p,
                       num_warps=num_warps, num_stages=num_stages or NUM_STAGES, block_k=BLOCK_K,
                       interpret=interpret)
    return x_new, (qkv if next_qkv else None)


def decode_qkv(x: jax.Array, layers: dict, layer, *, eps: float, interpret: bool = False,
               programs: int | None = None, num_warps: int = 4, num_stages: int | None = None) -> jax.Array:
    """RMSNorm(x) @ Wqkv[layer] for the first layer (phase A alone)."""
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    o = jnp.zeros((x.shape[0], layers["o_proj"].shape[1]), x.dtype)
    p = 1 if interpret else (programs or NUM_PROGRAMS)
    return _call(layer, x, o, *_args(layers), phases=("A",), eps=float(eps), programs=p, num_warps=num_warps,
                 num_stages=num_stages or NUM_STAGES, block_k=BLOCK_K, interpret=interpret)[1]
