"""Attention kernels on Pallas' Mosaic GPU backend (Hopper: TMA async copies, mbarriers, wgmma).

The CPU tests lower the kernels for CUDA and run them in JAX's Mosaic GPU interpreter (threads, SMEM, TMA and
barriers simulated; wgmma as plain dots) against the jnp references; the gpu-marked tests compare them on the
device (docs/kernels.md).
"""


def check_hopper(device, head_dim: int) -> None:
    """ValueError naming what is missing when attn_backend="mosaic" cannot run on `device`: no Mosaic GPU in this
    JAX, a GPU other than Hopper (compute capability 9.x), or a head_dim its tiles do not take."""
    from pallas_kernels.mosaic._common import available
    if not available():
        raise ValueError("attn_backend='mosaic': this JAX has no Pallas Mosaic GPU backend "
                         "(jax.experimental.pallas.mosaic_gpu); use 'pallas'")
    cc = float(getattr(device, "compute_capability", 0) or 0)
    if not 9.0 <= cc < 10.0:      # the kernels use wgmma, which only sm_90 has (Blackwell: tcgen05)
        raise ValueError(f"attn_backend='mosaic' needs a Hopper GPU (compute capability 9.x), not "
                         f"{device.device_kind} ({cc or 'unknown'}); use 'pallas'")
    if head_dim not in (64, 128):
        raise ValueError(f"attn_backend='mosaic' takes head_dim 64 or 128, got {head_dim}; use 'pallas'")
