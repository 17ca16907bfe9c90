"""The peer for bench.py: Hugging Face transformers' continuous batching (`generate_batch`), run on the
same weights and the same requests, in the same process as our engine.

    python scripts/bench.py --peer hf [--peer-num-seqs 64 --peer-max-tokens 256]

transformers' `generate_batch` takes one max_new_tokens for a whole batch, so the peer subset is the first
`--peer-num-seqs` prompts of the workload, each generating exactly `--peer-max-tokens` tokens (ignore_eos,
temperature 0.6); jaxinfer runs the identical subset right after it.
"""
from __future__ import annotations

import os
import tempfile
import time


def checkpoint_for(llm, model: str) -> str:
    """A directory transformers can load with the weights `llm` runs (presets are exported)."""
    if os.path.isdir(model):
        return model
    from jaxinfer.model.loader import save_checkpoint
    path = os.path.join(tempfile.mkdtemp(prefix="jaxinfer-peer-"), "ckpt")
    return save_checkpoint(llm.engine.runner.params, llm.model_config, path, dtype=llm.config.dtype)


def run_hf(path: str, prompts: list[list[int]], max_new_tokens: int, temperature: float) -> dict:
    """Generate with transformers' continuous batching; returns output token count and wall time."""
    import torch
    from transformers import GenerationConfig, Qwen3ForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = Qwen3ForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=temperature > 0, temperature=temperature,
                           eos_token_id=None, pad_token_id=0)
    kw = {}
    if device == "cpu":    # (tests) a KV cache for this workload, not a share of the host's memory (17 s to fill)
        from transformers import ContinuousBatchingConfig
        kw["continuous_batching_config"] = ContinuousBatchingConfig(
            num_blocks=sum(len(p) + max_new_tokens for p in prompts) // 16 + 2 * len(prompts))
    model.generate_batch(prompts[:2], generation_config=cfg, progress_bar=False, **kw)         # warm-up
    t = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=cfg, progress_bar=False, **kw)
    wall = time.perf_counter() - t
    tokens = sum(len(o.generated_tokens) for o in out.values())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return dict(output_tokens=tokens, wall_s=wall, output_tok_s=tokens / wall, device=device)


def compare(llm, model: str, prompts: list[list[int]], num_seqs: int, max_tokens: int) -> dict:
    """Run the peer, then jaxinfer, on the same subset; print and return both and our speed-up."""
    from jaxinfer import SamplingParams
    subset = prompts[:num_seqs]
    peer = run_hf(checkpoint_for(llm, model), subset, max_tokens, 0.6)
    sp = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_tokens)
    t = time.perf_counter()
    outs = llm.generate(subset, sp, use_tqdm=False)
    wall = time.perf_counter() - t
    ours = sum(len(o.token_ids) for o in outs)
    r = dict(peer="hf-transformers-continuous-batching", num_seqs=len(subset), max_tokens=max_tokens,
             peer_tok_s=peer["output_tok_s"], peer_output_tokens=peer["output_tokens"], peer_wall_s=peer["wall_s"],
             ours_tok_s=ours / wall, ours_output_tokens=ours, ours_wall_s=wall,
             speedup=(ours / wall) / peer["output_tok_s"])
    print(f"peer (HF transformers generate_batch, {peer['device']}) on {len(subset)} requests x {max_tokens} tokens: "
          f"{r['peer_tok_s']:,.0f} tok/s; jaxinfer on the same: {r['ours_tok_s']:,.0f} tok/s -> "
          f"{r['speedup']:.1f}x")
    return r
