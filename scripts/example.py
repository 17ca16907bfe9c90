"""The Python API on a real checkpoint directory (Hugging Face layout, e.g. a download of Qwen/Qwen3-0.6B).

    huggingface-cli download Qwen/Qwen3-0.6B --local-dir ~/models/Qwen3-0.6B
    python scripts/example.py ~/models/Qwen3-0.6B [--attn-backend pallas]

Any Qwen3 checkpoint directory works, e.g. one from `python scripts/make_tiny_model.py /tmp/tiny`.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxinfer import LLM, SamplingParams  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=os.path.expanduser("~/models/Qwen3-0.6B"))
    ap.add_argument("--attn-backend", default="xla", choices=["xla", "pallas"])
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args(argv)

    llm = LLM(a.model, attn_backend=a.attn_backend, max_num_seqs=8, max_model_len=1024,
              max_num_batched_tokens=1024, warmup=False)
    prompts = ["Introduce yourself in one sentence.", "List three prime numbers:"]
    greedy = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)
    for out in llm.generate(prompts, greedy):
        print(f"--- {out.prompt!r} ({out.finish_reason}, {len(out.token_ids)} tokens)\n{out.text}")

    # Chat with the tokenizer's template; Qwen3's enable_thinking passes through.
    sampled = SamplingParams(temperature=0.6, top_p=0.95, top_k=20, max_tokens=a.max_tokens, seed=0)
    reply = llm.chat([{"role": "user", "content": "What is paged attention?"}], sampled,
                     chat_template_kwargs={"enable_thinking": False})[0]
    print(f"--- chat\n{reply.text}")
    print(llm.stats())


if __name__ == "__main__":
    main()
