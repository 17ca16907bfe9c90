"""Attention kernels on Pallas' Mosaic GPU backend (Hopper: TMA async copies, mbarriers, wgmma).

GPU only: Mosaic GPU has no interpret mode here, so the CPU tests only check that the kernels lower for CUDA;
the gpu-marked tests compare them with the jnp references on the device (docs/kernels.md).
"""
