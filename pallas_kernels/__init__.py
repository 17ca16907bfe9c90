"""Hand-written Pallas (Triton backend) attention kernels over a paged KV cache. Imports only jax."""
