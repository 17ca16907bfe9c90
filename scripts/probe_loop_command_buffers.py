"""Probe: are K-step decode calls faster with their loop inside a CUDA graph? One process per variant:

    python scripts/probe_loop_command_buffers.py while auto out.json     # + WHILE, CONDITIONAL command buffers
    python scripts/probe_loop_command_buffers.py default auto out.json   # XLA's default command buffers

Prints TTFT / TPOT at batch 1, 8 and 32 (1024-token prompts, 256 tokens). The `while` variant swaps the
engine's per-compile options for this process only; it is an experiment, not an engine setting (it measured
slower on the H200: docs/performance.md).
"""
import json
import os
import sys
import time

if sys.argv[1:2] in (["-h"], ["--help"]) or len(sys.argv) < 4:   # the docstring is the usage
    sys.exit(print(__doc__) if sys.argv[1:2] in (["-h"], ["--help"]) else __doc__)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jaxinfer.engine.runner as runner  # noqa: E402

CB = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"


def main():
    variant, steps, out = sys.argv[1], sys.argv[2], sys.argv[3]
    if variant == "while":
        base = runner.step_compiler_options
        runner.step_compiler_options = lambda p: {**base(p), "xla_gpu_enable_command_buffer": CB}
    from bench_multistep import latency
    from jaxinfer import LLM
    t = time.time()
    llm = LLM("qwen3-0.6b", max_num_seqs=32, decode_buckets=(8, 32), prefill_buckets=(1024, 4096),
              max_model_len=4096, max_num_batched_tokens=4096,
              num_scheduler_steps=None if steps == "auto" else int(steps))
    res = {"variant": variant, "steps": steps, "warmup_s": time.time() - t}
    for b in (1, 8, 32):
        r, _ = latency(llm, b, repeats=2)
        res[f"b{b}"] = r
        print(variant, steps, b, {k: round(v, 3) for k, v in r.items()}, flush=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
