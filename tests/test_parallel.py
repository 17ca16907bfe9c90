"""Runs tests/parallel_cases.py (tensor / data parallelism on 8 CPU devices) in a separate pytest process:
the device count is fixed when JAX starts (XLA_FLAGS=--xla_force_host_platform_device_count=8), and the rest
of the suite must keep one device."""
import json
import os
import socket
import subprocess
import sys

import pytest
from helpers import hf_greedy, hf_model

from jaxinfer import LLM, SamplingParams

HERE = os.path.dirname(os.path.abspath(__file__))


def test_parallel_cases_on_eight_cpu_devices():
    env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") +
                                       " --xla_force_host_platform_device_count=8").strip(),
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           os.path.join(HERE, "parallel_cases.py")],
                          cwd=os.path.dirname(HERE), env=env, capture_output=True, text=True, timeout=900)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "failed" not in proc.stdout, tail


def test_two_processes_one_mesh(tmp_path, tiny_dir):
    """Several hosts, on one machine: two processes joined by jax.distributed (gloo CPU collectives), a tp=2
    mesh spanning both. Both read back the same tokens, equal to HF transformers (greedy, and top_k=1 through the
    resample program) and the same draws without a seed; each holds half the vocab; dp = 2 is refused."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    prompts = [[1, 2, 3, 4, 5], list(range(7, 40))]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.path.dirname(HERE)}
    env.pop("XLA_FLAGS", None)
    worker = os.path.join(HERE, "parallel_multihost_worker.py")
    procs = [subprocess.Popen([sys.executable, worker, str(i), str(port), tiny_dir, str(tmp_path / f"{i}.json"),
                               json.dumps(prompts)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    got = [json.load(open(tmp_path / f"{i}.json")) for i in range(2)]
    ref = hf_model(tiny_dir)
    want = [hf_greedy(ref, p, 6) for p in prompts]
    assert got[0]["drawn"] == got[1]["drawn"]       # seed=None: process 0's engine seed on both
    one = LLM(tiny_dir, dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, prefill_buckets=(64,),
              max_model_len=64, block_size=8, num_kvcache_blocks=64, warmup=False)
    sp = [SamplingParams(temperature=1.0, top_p=0.8, seed=3, max_tokens=6, ignore_eos=True),        # (the worker's)
          SamplingParams(temperature=0.7, seed=4, max_tokens=6, ignore_eos=True, logprobs=2, presence_penalty=1.0)]
    top_p, extras = ([o.token_ids for o in one.generate(prompts, s, use_tqdm=False)] for s in sp)
    for g in got:
        assert g["tokens"] == want and g["top1"] == want
        assert g["top_p"] == top_p and g["extras"] == extras          # (tp=1's tokens)
        assert "replica 0 would run on devices [0] of process(es) [0] only" in g["refused"], g["refused"]
        assert "LLM.generate / stream differs between process" in g["mismatch"] and "prompt 1" in g["mismatch"]
        assert g["empty"] == []
        assert g["local_shards"] == [g["vocab"] // 2] and g["blocks_returned"]


DP_WITH_CACHE = """
import json, sys
from jaxinfer import LLM, SamplingParams
llm = LLM(sys.argv[1], data_parallel_size=2, dtype="float32", max_num_seqs=4, max_model_len=64, block_size=4,
          num_kvcache_blocks=64, warmup=False)
outs = llm.generate([[1, 2, 3, 4, 5], list(range(7, 30)), [9, 8, 7], [3] * 12], SamplingParams(temperature=0,
                    max_tokens=6, ignore_eos=True), use_tqdm=False)
print(json.dumps([o.outputs[0].token_ids for o in outs]))
"""


def test_data_parallel_with_jaxs_compilation_cache(tmp_path, tiny_dir):
    """dp=2 with JAX's persistent compilation cache on, in two processes: a replica's copy of a program the cache
    loaded (parallel/relocate.py) loaded without an error but failed when run ("Function wrapped_iota not found"),
    every step of that replica after it too. Both runs give the same tokens as one device."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "PYTHONPATH": os.path.dirname(HERE),
           "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()}
    runs = [subprocess.run([sys.executable, "-c", DP_WITH_CACHE, tiny_dir], env=env, capture_output=True, text=True,
                           timeout=600) for _ in range(2)]
    for proc in runs:
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    llm = LLM(tiny_dir, dtype="float32", max_num_seqs=4, max_model_len=64, block_size=4, num_kvcache_blocks=64,
              warmup=False)
    want = [o.outputs[0].token_ids for o in llm.generate([[1, 2, 3, 4, 5], list(range(7, 30)), [9, 8, 7], [3] * 12],
                                                         SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                                                         use_tqdm=False)]
    assert [json.loads(p.stdout.strip().splitlines()[-1]) for p in runs] == [want, want]


@pytest.mark.gpu
def test_two_gpus_tp2_and_dp2_tokens_equal_tp1():
    """On a machine with 2+ GPUs: compiled Pallas kernels per device, NCCL collectives (scripts/check_parallel.py)."""
    import jax
    if len(jax.devices()) < 2:
        pytest.skip(f"needs 2 GPUs, found {len(jax.devices())}")
    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(HERE), "scripts", "check_parallel.py"),
                           "--backends", "pallas"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "ALL OK" in proc.stdout, (proc.stdout + proc.stderr)[-4000:]
