"""What the Mosaic GPU kernels share: the backend import, SMEM tile layouts, the fp8 -> f16 tile, and the checks
of where a kernel can run (a GPU, or Mosaic GPU's interpreter on the CPU)."""
from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp

try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # a jaxlib without Mosaic GPU
    plgpu = None

SWIZZLE = 128  # bytes; K/V/q tiles are 8 rows x 128 bytes (64 for fp8 rows of 64), the layout wgmma reads
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_SMEM = 232448  # bytes a Hopper block may use (227 KiB); Mosaic also reserves 2 KiB of reduction scratch
# Mosaic GPU lowering semantics of the kernels: "Lane" (env JAXINFER_MOSAIC_LOWERING=Warpgroup tries Mosaic's
# layout inference, "default" leaves JAX's choice). Either way a TMA copy into an 8-row-tiled SMEM tile must
# start at a row that is a multiple of 8 (Mosaic runs it on GMEM viewed as 8-row tiles): the kernels keep every
# q row start aligned for that, and say so with pl.multiple_of (what Warpgroup's inference checks).
LOWERING = os.environ.get("JAXINFER_MOSAIC_LOWERING", "Lane")


def available() -> bool:
    """Whether this JAX has Pallas' Mosaic GPU backend (the kernel still needs a Hopper GPU to run)."""
    return plgpu is not None


def _tiled(dtype, head_dim: int) -> tuple:
    """SMEM transforms of a [rows, head_dim] tile: 8-row tiles as wide as the swizzle (<= 128 bytes of a row)."""
    swizzle = min(SWIZZLE, head_dim * jnp.dtype(dtype).itemsize)
    return plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle)


def _to_f16_tile(src, dst):
    """An fp8 tile in SMEM -> f16 in `dst` (SMEM) through registers, visible to the wgmma of every thread."""
    dst[...] = src[...].astype(dst.dtype)
    plgpu.commit_smem()
    return dst


def compiler_params(**kwargs):
    """plgpu.CompilerParams with LOWERING's semantics. Lane by default: the model these kernels are written in
    (explicit SMEM transforms and register layouts) and JAX 0.10's default; JAX 0.11 made Warpgroup the default
    (commit "[Mosaic GPU] Turn WG on by default"), which adds Mosaic's layout/transform inference. The kernels
    lower both ways (CPU tests); `lowering_semantics` is a field in 0.10 and 0.11 (a feature check, no version)."""
    if LOWERING != "default" and "lowering_semantics" in {f.name for f in dataclasses.fields(plgpu.CompilerParams)}:
        if not hasattr(plgpu.LoweringSemantics, LOWERING):
            raise ValueError(f"JAXINFER_MOSAIC_LOWERING={LOWERING!r}: use Lane, Warpgroup or default")
        kwargs.setdefault("lowering_semantics", getattr(plgpu.LoweringSemantics, LOWERING))
    return plgpu.CompilerParams(**kwargs)


def _interpreter():
    """The params class of Mosaic GPU's interpreter (a private JAX module, in 0.10.2 and 0.11), or None."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError:
        return None
    return InterpretGPUParams


def check_runnable(name: str, interpret: bool, on_gpu: bool, reference: str, gpu_needed: str) -> None:
    """ValueErrors for the ways a Mosaic GPU kernel cannot run here: no Mosaic GPU in this JAX; interpret=True
    without its interpreter (use `reference`); on a CPU without interpret (`gpu_needed` says what instead)."""
    if plgpu is None:
        raise ValueError(f"{name}: this JAX has no Pallas Mosaic GPU backend (jax.experimental.pallas.mosaic_gpu)")
    if interpret and _interpreter() is None:
        raise ValueError(f"{name}: interpret=True needs Mosaic GPU's interpreter, which this JAX lacks; use "
                         f"{reference} on the CPU")
    if not interpret and not on_gpu:
        raise ValueError(f"{name}: {gpu_needed}")


def _row_layout():
    """Layout of a per-row vector of a wgmma accumulator (m, l): WGMMA.reduce(1) (0.10-0.11), WGMMA_ROW later."""
    return getattr(plgpu.Layout, "WGMMA_ROW", None) or plgpu.Layout.WGMMA.reduce(1)


def wgmma_iota(shape: tuple[int, int], dimension: int, interpret: bool):
    """int32 indices along `dimension` of a [rows, cols] tile, made in the WGMMA accumulator's register layout
    (plgpu.broadcasted_iota, as JAX's attention_mgpu). The interpreter has no layouts."""
    from jax import lax
    if interpret:
        return lax.broadcasted_iota(jnp.int32, shape, dimension)
    return plgpu.broadcasted_iota(jnp.int32, shape, dimension, layout=plgpu.Layout.WGMMA)
