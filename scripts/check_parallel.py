"""Quick correctness check of tensor / data parallelism on real devices (run it first on a new machine):
greedy tokens at tp=2 and dp=2 equal tp=1, and seeded sampling at tp=2 equals tp=1, on a tiny float32
checkpoint (peaked next-token distributions, so float rounding does not decide a token), for each backend.

    python scripts/check_parallel.py --json out.json          # needs 2 devices
    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu python scripts/check_parallel.py

Exits 1 if any comparison fails.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="pallas,xla")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import jax
    from make_tiny_model import make_tiny_model

    from jaxinfer import LLM, SamplingParams
    path = make_tiny_model(os.path.join(tempfile.mkdtemp(), "tiny"), num_attention_heads=8, num_key_value_heads=2,
                           head_dim=64, hidden_size=256, intermediate_size=512, num_hidden_layers=3, vocab_size=509)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 509, n).tolist() for n in (5, 40, 130, 300)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = [SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=i) for i in range(len(prompts))]
    base = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=512, prefill_buckets=(512,),
                decode_buckets=(8,), max_model_len=512, num_kvcache_blocks=256, warmup=False)
    result = dict(devices=[str(d) for d in jax.devices()], checks={})
    ok = True
    for backend in args.backends.split(","):
        runs = {}
        for name, kw in (("tp1", {}), ("tp2", dict(tensor_parallel_size=2)), ("dp2", dict(data_parallel_size=2))):
            t = time.perf_counter()
            llm = LLM(path, attn_backend=backend, **base, **kw)
            runs[name] = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
            if name != "dp2":
                runs[name + "_seeded"] = [o.token_ids for o in llm.generate(prompts, seeded, use_tqdm=False)]
            st = llm.stats()
            assert st["kv_blocks_free"] == st["kv_blocks_total"], st
            print(f"{backend} {name}: {time.perf_counter() - t:.1f} s", flush=True)
            del llm
        for name in ("tp2", "dp2", "tp2_seeded"):
            ref = runs["tp1_seeded" if "seeded" in name else "tp1"]
            same = [a == b for a, b in zip(runs[name], ref)]
            result["checks"][f"{backend} {name} == tp1"] = all(same)
            ok &= all(same)
            print(f"{backend} {name} == tp1: {all(same)} (per prompt {same})", flush=True)
    result["ok"] = bool(ok)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print("ALL OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
