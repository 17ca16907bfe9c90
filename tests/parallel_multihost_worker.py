"""One of two processes of tests/test_parallel.py's multi-host case: jax.distributed over gloo (CPU
collectives), one CPU device per process, a tp=2 mesh spanning both processes. Every process runs the same
program on the same requests; each writes the tokens it read back (a seed=None engine's draws included) and
the error a data-parallel size gets.

    python tests/parallel_multihost_worker.py PROCESS_ID PORT CHECKPOINT OUT_JSON
"""
import json
import sys

import jax

pid, port, path, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=pid)

from jaxinfer import LLM, SamplingParams  # noqa: E402  (after jax.distributed.initialize)

assert len(jax.devices()) == 2 and len(jax.local_devices()) == 1
llm = LLM(path, tensor_parallel_size=2, seed=None, dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
          prefill_buckets=(64,), max_model_len=64, block_size=8, num_kvcache_blocks=64, warmup=False)
shards = llm.engine.runner.params["embed_tokens"].addressable_shards
prompts = json.loads(sys.argv[5])
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
# filtered sampling (the step, then its resample program, across both processes): top_k=1 is greedy at any heat
top1 = llm.generate(prompts, SamplingParams(temperature=5.0, top_k=1, max_tokens=6, ignore_eos=True, seed=1),
                    use_tqdm=False)
# no request seed and seed=None: every process must draw the same seeds (process 0's engine seed)
drawn = llm.generate(prompts, SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_tokens=6, ignore_eos=True),
                     use_tqdm=False)
# top_p alone (each process draws its rows of an all-to-all), logprobs and penalties (per vocabulary shard)
TOP_P = SamplingParams(temperature=1.0, top_p=0.8, seed=3, max_tokens=6, ignore_eos=True)
EXTRAS = SamplingParams(temperature=0.7, seed=4, max_tokens=6, ignore_eos=True, logprobs=2, presence_penalty=1.0)
top_p = llm.generate(prompts, TOP_P, use_tqdm=False)
extras = llm.generate(prompts, EXTRAS, use_tqdm=False)
st = llm.stats()
empty = llm.generate([], SamplingParams(max_tokens=2), use_tqdm=False)    # (nothing to compare: no false mismatch)
try:      # process 1 queues another prompt 1: refused on both processes, naming it, before any step
    llm.generate([prompts[0], [9, 9, 9]] if pid else prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    mismatch = ""
except ValueError as e:
    mismatch = str(e)
try:      # dp = 2 would put a replica on one process only: refused on every process, before any collective
    LLM(path, data_parallel_size=2, dtype="float32", warmup=False)
    refused = ""
except ValueError as e:
    refused = str(e)
with open(out, "w") as f:
    json.dump(dict(tokens=[o.token_ids for o in outs], top1=[o.token_ids for o in top1], refused=refused,
                   mismatch=mismatch, empty=empty,
                   drawn=[o.token_ids for o in drawn], top_p=[o.token_ids for o in top_p],
                   extras=[o.token_ids for o in extras],
                   local_shards=[s.data.shape[0] for s in shards],
                   vocab=llm.engine.runner.params["embed_tokens"].shape[0],
                   blocks_returned=st["kv_blocks_free"] == st["kv_blocks_total"]), f)
