"""Several devices through JAX's own SPMD: a `Mesh`, `NamedSharding`s, `shard_map` around the Pallas kernels.

Tensor parallelism (`tensor_parallel_size` = tp): one scheduler and one compiled step per bucket over a mesh
with axis "tp". Weights are split as `layout.py` says (heads for qkv / gate_up, their inputs for o_proj /
down_proj, vocabulary for the embedding and LM head); XLA inserts one all-reduce after o_proj and one after
down_proj. The KV cache is split by kv head (replicated when tp > num_key_value_heads). The packed batch is
replicated: still one host->device transfer per step. Sampling reduces each device's vocabulary shard to
(max, argmax) per row, then all-gathers those [tp, B] pairs; a small top_k gathers each shard's top candidates; the
extras variant edits and counts each shard's own columns and combines per-shard logprob statistics (vocab.py). The
sorted filters (top-p / min-p alone) need whole rows: one all-to-all gives each device B / tp of them. No [B, V]
logits are gathered.

Data parallelism (`data_parallel_size` = dp): dp independent engine replicas on disjoint devices in one
process (engine/dp_engine.py); each may itself be tensor-parallel. Replica 0 compiles the steps; the others
load those executables onto their own devices (relocate.py) instead of compiling them again.

Several hosts. Every host runs the same Python script, which first calls

    import jax
    jax.distributed.initialize(coordinator_address="host0:1234", num_processes=N, process_id=i)

(on Slurm / Open MPI / TPU pods, which JAX detects, plain `jax.distributed.initialize()`), then builds its `LLM`;
the CLI and the server do not call it. `jax.devices()` then lists every host's devices and `make_placements` builds
the mesh from that global list, so a tp group spans hosts (XLA uses NCCL across them). Every process runs every
replica, so each replica needs devices on every process (`make_placements` refuses sizes that would not; for dp
across hosts, run one LLM per host without jax.distributed). Each process runs the same scheduler on the same
requests, so every host packs the same batch and supplies it to its own devices (`Placement.put`); sampled ids are
replicated, so each host reads its local copy. Requests must therefore reach every process in the same order
(`LLM.generate` with the same prompts on every host does), and a seed=None engine takes process 0's seed
(`shared_seed`); `agree.py` checks that options and requests match (and sizes one KV pool for all). On CPUs,
`jax.config.update("jax_cpu_collectives_implementation", "gloo")` before `initialize` gives the collectives:
tests/parallel_multihost_worker.py runs a tp=2 mesh over two processes that way.
"""
from jaxinfer.parallel.compat import shard_map
from jaxinfer.parallel.layout import check_tp, kv_heads, padded_vocab
from jaxinfer.parallel.placement import Placement, available_devices, make_placements, shared_seed

__all__ = ["Placement", "available_devices", "check_tp", "kv_heads", "make_placements", "padded_vocab", "shard_map",
           "shared_seed"]
