"""Attention kernels on Pallas' Mosaic GPU backend (Hopper: TMA async copies, mbarriers, wgmma).

The CPU tests lower the kernels for CUDA and run them in JAX's Mosaic GPU interpreter (threads, SMEM, TMA and
barriers simulated; wgmma as plain dots) against the jnp references; the gpu-marked tests compare them on the
device (docs/kernels.md).
"""
