"""`shard_map` across JAX versions: `jax.shard_map` (0.7+, `check_vma`) or the older
`jax.experimental.shard_map.shard_map` (`check_rep`). Both are called with the check off: Pallas calls and
our explicit psum / all_gather are correct per device, and the replication checker does not know pallas_call."""
from __future__ import annotations

import jax


def shard_map(f, mesh, in_specs, out_specs):
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map as _shard_map    # JAX < 0.7
    return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)
