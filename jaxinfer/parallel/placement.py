"""Which devices one engine replica runs on, and how its arrays are placed there.

A `Placement` is a 1-D `Mesh` with axis "tp" over the replica's devices. With tp = 1 it is one device and
every sharding is that device: the single-GPU engine is the tp = 1 case of the same code.
`make_placements(tp, dp)` splits the first tp * dp devices into dp replicas of tp devices each.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer.parallel.layout import KV_SPEC, check_tp, kv_heads, map_params, param_specs, spec, to_tp


def available_devices() -> list:
    """This process's devices; with several processes (jax.distributed) the global list, so a mesh may
    span hosts."""
    return jax.devices() if jax.process_count() > 1 else jax.local_devices()


def make_placements(tensor_parallel_size: int = 1, data_parallel_size: int = 1, devices=None) -> list["Placement"]:
    """dp placements of tp devices each, from the first tp * dp devices (one device: the user's
    `jax.default_device` when set, as for any JAX computation). ValueError naming the numbers when a size is
    below 1 or there are too few devices."""
    tp, dp = tensor_parallel_size, data_parallel_size
    for name, v in (("tensor_parallel_size", tp), ("data_parallel_size", dp)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}={v!r} must be an integer >= 1")
    default = jax.config.jax_default_device
    if devices is None and tp * dp == 1 and isinstance(default, jax.Device):
        devices = [default]
    devices = list(devices if devices is not None else available_devices())
    if tp * dp > len(devices):
        n, platform = len(devices), devices[0].platform
        hint = ("; on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N set before JAX starts gives N devices"
                if platform == "cpu" else "")
        raise ValueError(f"tensor_parallel_size={tp} x data_parallel_size={dp} needs {tp * dp} devices but only "
                         f"{n} {'is' if n == 1 else 'are'} available ({platform}){hint}")
    placements = [Placement(Mesh(np.array(devices[r * tp:(r + 1) * tp]), ("tp",))) for r in range(dp)]
    for r, p in enumerate(placements if jax.process_count() > 1 else []):
        hosts = sorted({d.process_index for d in p.devices})
        if len(hosts) < jax.process_count():      # every process runs every replica: each needs a device there
            raise ValueError(
                f"tensor_parallel_size={tp} x data_parallel_size={dp} over {jax.process_count()} processes "
                f"({len(devices)} devices): replica {r} would run on devices {[d.id for d in p.devices]} of "
                f"process(es) {hosts} only, but under jax.distributed every process runs every replica; make each "
                f"replica span every process (tensor_parallel_size = all {len(devices)} devices), or for data "
                "parallelism across hosts run one LLM per host without jax.distributed")
    return placements


def shared_seed(seed: int | None) -> int | None:
    """The engine seed every process uses: under jax.distributed a seed=None engine's draw is process 0's, so
    requests without a seed sample the same tokens on every host (they feed one replicated batch)."""
    if seed is not None or jax.process_count() == 1:
        return seed
    from jax.experimental import multihost_utils
    mine = np.random.default_rng().integers(0, 2**31 - 1, dtype=np.int64)
    return int(multihost_utils.broadcast_one_to_all(mine))


@dataclasses.dataclass(frozen=True)
class Placement:
    mesh: Mesh

    @property
    def tp(self) -> int:
        return self.mesh.shape["tp"]

    @property
    def devices(self) -> list:
        return list(self.mesh.devices.flat)

    @property
    def local_device(self):
        """This process's first device of the replica: where its free memory is read."""
        return next(d for d in self.devices if d.process_index == jax.process_index())

    def sharding(self, spec: P = P()) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    @functools.cached_property
    def replicated(self) -> NamedSharding:       # made once: `put` uses it every step
        return self.sharding(P())

    # -- params ---------------------------------------------------------------------------------------
    def check(self, model) -> None:
        check_tp(model, self.tp)

    def param_shardings(self, params) -> dict:
        return jax.tree.map(self.sharding, param_specs(params), is_leaf=lambda x: isinstance(x, P))

    def place_host_params(self, model, host: dict) -> dict:
        """Checkpoint-layout numpy params -> tp-layout device arrays. Each device receives only its own
        slices (make_array_from_callback), so no device ever holds the whole model."""
        self.check(model)

        def place(name, w):
            w = to_tp(name, w, model, self.tp, np)
            sharding = self.sharding(spec(name, w.ndim))
            return jax.make_array_from_callback(w.shape, sharding, lambda idx: np.ascontiguousarray(w[idx]))
        return map_params(place, host)

    def shard_params(self, model, params: dict) -> dict:
        """Checkpoint-layout params (device or host arrays, e.g. `init_params`' output) -> tp layout, placed.
        Runs as one jitted program whose outputs are sharded, so random presets are made on their devices."""
        self.check(model)
        laid = jax.eval_shape(lambda p: map_params(lambda n, w: to_tp(n, w, model, self.tp, jnp), p), params)
        fn = jax.jit(lambda p: map_params(lambda n, w: to_tp(n, w, model, self.tp, jnp), p),
                     out_shardings=self.param_shardings(laid))
        return fn(params)

    # -- KV cache and per-step inputs -------------------------------------------------------------------
    def kv_view(self, model):
        """The model config as one device's KV cache sees it (num_key_value_heads = K' / tp): for sizing
        the pool from one device's free memory."""
        return dataclasses.replace(model, num_key_value_heads=kv_heads(model, self.tp) // self.tp)

    def zeros_kv(self, shape: tuple[int, ...], dtype, count: int) -> list:
        """`count` [P, bs, K', D] cache arrays, allocated shard by shard on their devices, by one compiled program
        (a jit per array compiled 2 x layers trivial programs: ~0.1 s each on a GPU host)."""
        zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=self.sharding(KV_SPEC))
        return [zeros() for _ in range(count)]

    def put(self, x: np.ndarray, spec: P | None = None) -> jax.Array:
        """One host array to the devices of the replica: replicated (the packed batch), or split as `spec` says."""
        sharding = self.replicated if spec is None else self.sharding(spec)
        if jax.process_count() > 1:    # a global mesh: each process supplies its own devices' slices
            return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])
        return jax.device_put(x, sharding)
