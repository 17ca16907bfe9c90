"""How many kernels XLA emits around one `paged_attention` call with 1, 2 and 8 context splits (a GPU, no engine).

    python scripts/probe_merge_fusions.py [--json out.json]

Compiles the Pallas decode kernel at Qwen3-0.6B's heads (8 rows, 16 q heads, 8 kv heads, head_dim 128) and counts
the fusions and custom calls in the optimised program's entry: the kernel is one custom call; what else there is
is the splits' merge and the operands' preparation (docs/performance.md, fifty-sixth run).
"""
from __future__ import annotations

import argparse
import json
import re

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention import paged_attention


def count(num_splits: int, rows: int = 8, heads: int = 16, kv_heads: int = 8, head_dim: int = 128) -> dict:
    sd = jax.ShapeDtypeStruct
    q = sd((rows, heads, head_dim), jnp.bfloat16)
    cache = sd((2048, 16, kv_heads, head_dim), jnp.bfloat16)
    args = (q, cache, cache, sd((rows, 64), jnp.int32), sd((rows,), jnp.int32))
    text = jax.jit(lambda *a: paged_attention(*a, num_splits=num_splits)).lower(*args).compile().as_text()
    entry = text[text.rfind("ENTRY"):]
    return {"fusions": len(re.findall(r"= \S+ fusion\(", entry)),
            "custom_calls": len(re.findall(r"custom-call\(", entry))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the counts here")
    args = ap.parse_args()
    res = {"device": jax.devices()[0].device_kind, **{f"splits_{s}": count(s) for s in (1, 2, 8)}}
    print(json.dumps(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
