"""Calling a raw Triton kernel (`@triton.jit`) from jitted JAX: jax-triton's `triton_call`, and the same kernel
through XLA's typed-FFI Triton custom call, which is the one that stays inside XLA's CUDA graphs.

Why two paths. jax-triton 0.3.1 (the version for triton 3.6 / Python 3.11-3.12) lowers each call to the
custom call "triton_kernel_call" with the legacy API (api_version 2, an opaque string). On the H200 a jitted
program of 20 tiny triton_calls + 40 XLA ops took 1.6-2.0 ms against 35 us in pure XLA (docs/kernels.md,
"Triton through jax-triton"; scripts/probe_triton_call.py measures it). JAX's own Pallas-Triton lowering
(jaxlib > 0.10.2) hands the same kind of compiled kernel to "triton_kernel_call_ffi", a typed-FFI handler,
and those kernels are captured in the step's command buffer (measured on the H200). `triton_call(..., path="ffi")`
compiles the kernel with jax-triton's own compiler helper and emits that FFI custom call instead.

Importing this module needs only jax; triton and jax_triton are imported on first use, and their absence is
a ValueError that says what to install.
"""
from __future__ import annotations

import functools
import glob
import importlib.util
import os
import sys
import zlib

import jax
import numpy as np

INSTALL_HINT = ("attn_backend='triton' needs the triton and jax-triton packages on a CUDA machine: "
                "python -m pip install '.[triton]' (jax-triton==0.3.1 for triton 3.6; offline: python -m pip install "
                "--no-deps .whl/jax_triton-0.3.1-py3-none-any.whl; `python -m pip` installs into the Python that runs "
                "jaxinfer, a bare `pip` may belong to another one)")


def load_triton():
    """(triton, triton.language, jax_triton.triton_lib), or a ValueError saying what is missing."""
    try:
        import triton
        import triton.language as tl
    except ImportError as e:
        raise ValueError(f"{INSTALL_HINT}; import triton failed: {e}") from None
    try:
        from jax_triton import triton_lib
    except ImportError as e:
        raise ValueError(f"{INSTALL_HINT}; import jax_triton failed: {e}") from None
    return triton, tl, triton_lib


def ptxas_dirs() -> list[str]:
    """Folders where XLA looks for the `ptxas` binary that turns a jax-triton kernel's PTX into machine code
    (jaxlib runs it as a program; Pallas and XLA's own kernels do not need it): PATH, /usr/local/cuda/bin, the
    nvidia-cuda-nvcc wheel's bin."""
    dirs = os.environ.get("PATH", "").split(os.pathsep) + ["/usr/local/cuda/bin"]
    for site in sys.path:
        dirs += glob.glob(os.path.join(site, "nvidia", "cu*", "bin")) + glob.glob(
            os.path.join(site, "nvidia", "cuda_nvcc", "bin"))
    return [d for d in dirs if d]


def bundled_ptxas_dir() -> str | None:
    """The folder of the `ptxas` that triton ships (triton/backends/nvidia/bin), found without importing triton;
    None without triton or without that file."""
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.origin:
        return None
    bundled = os.path.join(os.path.dirname(spec.origin), "backends", "nvidia", "bin")
    return bundled if os.access(os.path.join(bundled, "ptxas"), os.X_OK) else None


def check_ptxas() -> None:
    """A ValueError naming the fix when no `ptxas` is where XLA looks: jaxlib would fail later, while compiling
    the step, with only "Failed to launch ptxas". triton ships one (triton/backends/nvidia/bin)."""
    if any(os.access(os.path.join(d, "ptxas"), os.X_OK) for d in ptxas_dirs()):
        return
    bundled = bundled_ptxas_dir() or "<site-packages>/triton/backends/nvidia/bin"
    raise ValueError("attn_backend='triton': no ptxas on PATH (nor /usr/local/cuda/bin); jaxlib runs it to "
                     "load each jax-triton kernel. triton ships one: before starting Python, "
                     f"export PATH={bundled}:$PATH")


def check_ready() -> None:
    """Before an engine loads anything for attn_backend="triton": the packages, and the ptxas jaxlib runs."""
    load_triton()
    check_ptxas()


@functools.cache
def _ffi_primitive():
    """A primitive like jax-triton's, lowered to XLA's typed-FFI Triton call (what Pallas-Triton emits)."""
    import jax.extend as jex
    from jax._src import core, dispatch
    from jax._src.interpreters import mlir
    from jax._src.lib import gpu_triton as lib
    from jax._src.lib.mlir import ir
    _, _, tlib = load_triton()

    p = jex.core.Primitive("triton_ffi_call")
    p.multiple_results = True
    p.def_impl(functools.partial(dispatch.apply_primitive, p))       # an un-jitted call compiles it alone
    p.def_abstract_eval(lambda *_, out_shapes, **__: [core.ShapedArray(s.shape, s.dtype) for s in out_shapes])

    def lowering(ctx, *operands, fn, out_shapes, grid, num_warps, num_stages, metaparams, aliases, name):
        avals = list(ctx.avals_in) + list(ctx.avals_out)            # array arguments only: inputs, then outputs
        dtypes = [tlib.get_triton_type(a) for a in avals]
        kernel, spec = tlib.get_or_create_triton_kernel(
            tlib.get_cuda_backend, ctx.module_context.platforms[0], fn, dtypes, [], num_warps=num_warps,
            num_stages=num_stages, num_ctas=1, compute_capability=None, enable_fp_fusion=True,
            metaparams=dict(metaparams), dump=False)
        params = [lib.create_array_parameter(0, 16 if ["tt.divisibility", 16] in spec[(i,)] else 0)
                  for i in range(len(avals))]
        call = lib.TritonKernelCall(kernel, *grid, params)
        layouts = lambda avs: [list(reversed(range(a.ndim))) for a in avs]  # noqa: E731 (row-major)
        return mlir.custom_call(
            "triton_kernel_call_ffi",
            result_types=[mlir.aval_to_ir_type(ctx.module_context, a) for a in ctx.avals_out],
            operands=list(operands),
            backend_config=dict(name=ir.StringAttr.get(name),
                                opaque=ir.StringAttr.get(zlib.compress(call.to_proto(name, b"")))),
            operand_layouts=layouts(ctx.avals_in), result_layouts=layouts(ctx.avals_out),
            operand_output_aliases=dict(aliases)).results

    mlir.register_lowering(p, lowering, platform="cuda")
    return p


def triton_call(*args: jax.Array, kernel, out_shape, grid: tuple[int, ...], num_warps: int = 4,
                num_stages: int = 3, path: str = "ffi", name: str = "triton_kernel", input_output_aliases=None,
                **metaparams):
    """Call `kernel` (@triton.jit) on array args; metaparams are its constexpr arguments. out_shape: a list of
    jax.ShapeDtypeStruct. path: "ffi" (XLA's typed-FFI Triton call, inside CUDA graphs) or "jax_triton" (the
    package's own triton_call, legacy custom call). Returns a list of outputs."""
    if any(not hasattr(a, "shape") for a in args):
        raise ValueError(f"{name}: pass scalars as constexpr metaparams, not positional args")
    _, _, tlib = load_triton()
    if jax.default_backend() == "gpu":
        check_ptxas()
    if path == "jax_triton":
        out = tlib.triton_call(*args, kernel=kernel, out_shape=list(out_shape), grid=grid, num_warps=num_warps,
                               num_stages=num_stages, name=name, input_output_aliases=input_output_aliases,
                               **metaparams)
        return list(out)
    if path != "ffi":
        raise ValueError(f"{name}: path={path!r} is not 'ffi' or 'jax_triton'")
    grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
    shapes = tuple(jax.ShapeDtypeStruct(s.shape, np.dtype(s.dtype)) for s in out_shape)
    return _ffi_primitive().bind(*args, fn=kernel, out_shapes=shapes, grid=grid, num_warps=num_warps,
                                 num_stages=num_stages, metaparams=tuple(sorted(metaparams.items())),
                                 aliases=tuple(sorted((input_output_aliases or {}).items())), name=name)
