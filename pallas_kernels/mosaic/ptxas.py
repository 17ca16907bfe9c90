"""Which `ptxas` Mosaic GPU will run, and whether the Mosaic prefill kernel is safe to build with it.

Mosaic GPU turns a kernel's PTX into machine code with the first `ptxas` on PATH. Assembled by triton's bundled
ptxas (CUDA 12.8, triton/backends/nvidia/bin) instead of the CUDA 13.0 one of the H200 machines' toolkit, the
Mosaic prefill kernel made CUDA_ERROR_ILLEGAL_ADDRESS on its first call, every time; with CUDA 13.0's ptxas the
same tests pass (docs/kernels.md, "Mosaic GPU prefill: status"). The paged decode kernel ran correctly either way.
So the engine uses the Mosaic prefill only when the ptxas on PATH is not older than the CUDA jaxlib was built for.
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from importlib.metadata import PackageNotFoundError, version


def ptxas_release(ptxas: str) -> tuple[int, int] | None:
    """(major, minor) of a ptxas program's CUDA release, from `ptxas --version`; None if it does not say."""
    try:
        out = subprocess.run([ptxas, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"release (\d+)\.(\d+)", out)
    return (int(found[1]), int(found[2])) if found else None


def jaxlib_cuda_major() -> int | None:
    """The CUDA major version of the installed jaxlib GPU plugin (jax-cuda13-plugin -> 13); None without one."""
    for major in (13, 12):
        try:
            version(f"jax-cuda{major}-plugin")
            return major
        except PackageNotFoundError:
            pass
    return None


@functools.cache
def _older_ptxas(path: str, cuda_major: int | None) -> str | None:
    ptxas = shutil.which("ptxas", path=path)
    release = ptxas_release(ptxas) if ptxas and cuda_major else None
    if release is None or release[0] >= cuda_major:
        return None
    return f"{ptxas} (CUDA {release[0]}.{release[1]}, jaxlib is built for CUDA {cuda_major})"


def older_ptxas_on_path(env: dict | None = None, cuda_major: int | None = None) -> str | None:
    """'PATH (CUDA x.y, ...)' when the first ptxas on PATH is older than jaxlib's CUDA, else None (also when
    there is none on PATH: Mosaic then finds the toolkit's own)."""
    env = os.environ if env is None else env
    return _older_ptxas(env.get("PATH", ""), jaxlib_cuda_major() if cuda_major is None else cuda_major)
