"""FP8 KV cache accuracy: the fp8 cache against the full-precision one (the model dtype), on held-out text.

  PYTHONPATH=. python scripts/fp8_accuracy.py                       # the demo model if shipped, else qwen3-0.6b
  PYTHONPATH=. python scripts/fp8_accuracy.py qwen3-0.6b --tokens 2048 --json scripts/results/fp8_acc.json
  PYTHONPATH=. python scripts/fp8_accuracy.py --smoke               # CPU, a tiny random model: checks the script

Measured, for each kind of scales (`bound`: the engine's default, from the weights; `calibrated`: max |k|,
|v| of this very text, i.e. the tightest possible per-layer scales; `calibrated_per_head`: the same per kv
head (the kernels take [L, K] scales; the engine keeps per-layer ones); and the checkpoint's when it has them):
  * teacher-forced logits over the text, run in chunks through the paged cache exactly as the engine's prefill
    runs (each chunk writes its K/V, quantised, then attends over every earlier token read back from the
    pages): max and mean |logit error|, relative to the logits' RMS; mean KL(full || fp8) of the next-token
    distributions; top-1 agreement; perplexity of both caches and the difference;
  * how loose the bound is: R = bound / calibrated amax per layer (see jaxinfer/model/kv_scales.py);
  * greedy generation through `LLM.generate` with kv_cache_dtype="auto" and "fp8": the fraction of identical
    output tokens and of requests identical to the end.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxinfer.model.attention import paged_attention_layer, v_pages  # noqa: E402
from jaxinfer.model.kv_scales import BOUND_MARGIN, bound_amax, calibrated_amax, with_kv_scales  # noqa: E402
from jaxinfer.model.qwen3 import compute_logits, forward  # noqa: E402
from jaxinfer.step import kv_scales  # noqa: E402
from pallas_kernels.quant import FP8_DTYPE, FP8_MAX  # noqa: E402

BLOCK = 16


def paged_logits(config, params, ids, kv_dtype, backend: str, chunk: int = 256, scales=None) -> np.ndarray:
    """Teacher-forced fp32 logits [S, V] of ids [S], prefilling `chunk` tokens at a time into a paged cache of
    `kv_dtype`. scales: (k_scale, v_scale) [L, 1] or [L, K] for an fp8 cache (None: `with_kv_scales`' choice)."""
    S, L = len(ids), config.num_hidden_layers
    params = with_kv_scales(config, params, kv_dtype)
    if scales is not None:
        params = {**params, "k_scale": jnp.asarray(scales[0]), "v_scale": jnp.asarray(scales[1])}
    pages = -(-S // BLOCK) + 1
    shape = (pages, BLOCK, config.num_key_value_heads, config.head_dim)
    v_shape, v_dtype = v_pages(backend, shape, kv_dtype)         # the engine's layout (pallas fp8: V in pairs)
    caches = [(jnp.zeros(shape, kv_dtype), jnp.zeros(v_shape, v_dtype)) for _ in range(L)]
    step = _prefill_step(config, backend, chunk, pages, jax.devices()[0].platform != "gpu")
    out = []
    for start in range(0, S, chunk):
        n = min(chunk, S - start)
        tokens = jnp.asarray(np.pad(ids[start:start + n], (0, chunk - n)), jnp.int32)
        logits, caches = step(params, caches, tokens, jnp.int32(start), jnp.int32(n))
        out.append(np.asarray(logits[:n], np.float32))
    return np.concatenate(out)


@functools.lru_cache(maxsize=None)
def _prefill_step(config, backend: str, chunk: int, pages: int, interpret: bool):
    """One jitted prefill chunk over a one-sequence paged cache (compiled once per cache dtype and scale shape;
    the scales travel in params, as in the engine)."""
    def step(params, caches, tokens, start, n):
        t = jnp.arange(chunk)
        meta = dict(slot_mapping=jnp.where(t < n, start + t, pages * BLOCK).astype(jnp.int32),  # padding: dropped
                    block_tables=jnp.arange(pages, dtype=jnp.int32)[None], seq_lens=(start + n)[None],
                    cu_seqlens=jnp.stack([jnp.int32(0), n]))
        attn = paged_attention_layer("prefill", backend, meta, interpret, None, kv_scales(params))
        hidden, caches = forward(config, params, tokens, start + t, attn, caches)
        return compute_logits(config, params, hidden), caches
    return jax.jit(step, donate_argnums=1)


def compare(ref, got, ids) -> dict:
    """Logit error, KL, top-1 agreement and perplexities of next-token predictions. ref, got: logits [S, V] of
    ids [S], or lists of them (windows evaluated separately: each window's last position predicts nothing)."""
    if isinstance(ref, np.ndarray):
        ref, got, ids = [ref], [got], [ids]
    nxt = np.concatenate([np.asarray(i[1:]) for i in ids])
    ref, got = np.concatenate([r[:-1] for r in ref]), np.concatenate([g[:-1] for g in got])
    err = np.abs(got - ref)
    rms = float(np.sqrt(np.mean(ref ** 2)))
    lp_ref = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
    lp_got = got - np.logaddexp.reduce(got, axis=-1, keepdims=True)
    kl = np.sum(np.exp(lp_ref) * (lp_ref - lp_got), axis=-1)
    nll_ref = -lp_ref[np.arange(len(nxt)), nxt].mean()
    nll_got = -lp_got[np.arange(len(nxt)), nxt].mean()
    return dict(max_abs_logit_err=float(err.max()), mean_abs_logit_err=float(err.mean()), logit_rms=rms,
                rel_max_err=float(err.max()) / rms, rel_mean_err=float(err.mean()) / rms,
                mean_kl=float(kl.mean()), max_kl=float(kl.max()),
                top1_agreement=float(np.mean(ref.argmax(-1) == got.argmax(-1))),
                ppl_full=float(np.exp(nll_ref)), ppl_fp8=float(np.exp(nll_got)),
                ppl_rel_diff=float(np.exp(nll_got - nll_ref) - 1))


def greedy_agreement(model: str, prompts: list[list[int]], max_tokens: int, engine: dict) -> dict:
    """Greedy outputs of LLM.generate with the full-precision and the fp8 cache, token by token."""
    from jaxinfer import LLM, SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = {}
    for kv in ("auto", "fp8"):
        llm = LLM(model, kv_cache_dtype=kv, **engine)
        outs[kv] = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        st = llm.stats()
        assert st["kv_blocks_free"] == st["kv_blocks_total"], "every KV block must return"
        outs[kv + "_stats"] = dict(kv_cache_dtype=st["kv_cache_dtype"], kv_blocks_total=st["kv_blocks_total"])
        del llm
    same = [np.asarray(a) == np.asarray(b) for a, b in zip(outs["auto"], outs["fp8"])]
    first = [int(np.argmin(s)) if not s.all() else len(s) for s in same]
    return dict(token_agreement=float(np.mean(np.concatenate(same))),
                identical_requests=float(np.mean([s.all() for s in same])),
                mean_tokens_before_first_difference=float(np.mean(first)), requests=len(prompts),
                max_tokens=max_tokens, pools={k[:-6]: v for k, v in outs.items() if k.endswith("_stats")})


def load(model: str, dtype: str):
    from jaxinfer.hub import load_model
    config, params, tok = load_model(model, dtype)
    return config, params, tok


def heldout_ids(tok, model: str, n: int) -> np.ndarray:
    """n tokens of held-out text: the demo model's heldout.txt (never trained on) when the model has one, else
    the project's docs (random-weight presets: text only gives realistic positions and repeats)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cands = [os.path.join(model, "heldout.txt")] if os.path.isdir(model) else []
    cands += [os.path.join(root, "docs", f) for f in ("design.md", "kernels.md", "performance.md")]
    cands += [os.path.join(root, "README.md")]
    text = "\n".join(open(p).read() for p in cands if os.path.isfile(p))
    ids = list(tok.encode(text, add_special_tokens=False))
    while len(ids) < n:
        ids += ids
    return np.asarray(ids[:n], np.int32)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="checkpoint dir or preset (default: the demo model if "
                                                          "shipped, else qwen3-0.6b)")
    ap.add_argument("--tokens", type=int, default=1024, help="held-out tokens (teacher-forced), in windows of at "
                                                            "most --window tokens (each a fresh sequence)")
    ap.add_argument("--window", type=int, default=1024, help="tokens per sequence (capped by the model's limit)")
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk")
    ap.add_argument("--backend", default=None, choices=("xla", "pallas"), help="default: pallas on GPU, xla on CPU")
    ap.add_argument("--dtype", default=None, help="model dtype (default: bfloat16 on GPU, float32 on CPU)")
    ap.add_argument("--greedy-prompts", type=int, default=16)
    ap.add_argument("--greedy-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="a tiny random checkpoint on the CPU")
    args = ap.parse_args()
    gpu = jax.devices()[0].platform == "gpu"
    backend = args.backend or ("pallas" if gpu else "xla")
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    model = args.model
    if args.smoke:
        import tempfile
        from scripts.make_tiny_model import make_tiny_model
        model = make_tiny_model(tempfile.mkdtemp(), num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                hidden_size=64)
        args.tokens, args.chunk, args.greedy_prompts, args.greedy_tokens = 96, 32, 3, 12
    elif model is None:
        try:
            from jaxinfer.assets import demo_model_path
            model = demo_model_path()
        except FileNotFoundError:
            model = "qwen3-0.6b"
    else:           # a name LLM() takes ("qwen3-pydoc", a hub id): its folder, so that heldout.txt is found
        from jaxinfer.hub import model_config_for
        model = model_config_for(model)[0]
    config, params, tok = load(model, dtype)
    ids = heldout_ids(tok, model, args.tokens)
    window = min(args.window, config.max_position_embeddings, len(ids))
    windows = [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)]     # [n, window]
    logits = lambda kv, sc=None: [paged_logits(config, params, w, kv, backend, args.chunk, sc)  # noqa: E731
                                  for w in windows]
    print(f"{model} | {config.num_hidden_layers} layers | {dtype} weights | backend {backend} | {len(windows)} "
          f"windows of {window} tokens")
    ref = logits(jnp.dtype(dtype))
    k_b, v_b = (np.asarray(a) for a in bound_amax(config, params))
    k_h, v_h = calibrated_amax(config, params, np.stack(windows), per_head=True)      # [L, K]
    k_c, v_c = k_h.max(axis=1), v_h.max(axis=1)                                        # [L]
    scale = lambda a: jnp.asarray(a * BOUND_MARGIN / FP8_MAX, jnp.float32).reshape(a.shape[0], -1)  # noqa: E731
    kinds = {"bound": (scale(k_b), scale(v_b)), "calibrated": (scale(k_c), scale(v_c)),   # (None: the checkpoint's)
             "calibrated_per_head": (scale(k_h), scale(v_h))}
    if "k_scale" in params:
        kinds["checkpoint"] = tuple(jnp.asarray(params[k]).reshape(-1, 1) for k in ("k_scale", "v_scale"))
    result = dict(model=model, dtype=dtype, backend=backend, tokens=len(windows) * window, window=window,
                  device=jax.devices()[0].device_kind,
                  bound_over_amax=dict(k=(k_b / k_c).tolist(), v=(v_b / v_c).tolist()),
                  amax=dict(k=k_c.tolist(), v=v_c.tolist()), scales={})
    print(f"bound / calibrated amax per layer: k {np.min(k_b / k_c):.1f}-{np.max(k_b / k_c):.1f}, "
          f"v {np.min(v_b / v_c):.1f}-{np.max(v_b / v_c):.1f}")
    for name, sc in kinds.items():
        r = result["scales"][name] = compare(ref, logits(FP8_DTYPE, sc), windows)
        print(f"fp8 ({name} scales): logit err max {r['max_abs_logit_err']:.4f} mean {r['mean_abs_logit_err']:.5f} "
              f"(logit RMS {r['logit_rms']:.3f}); KL mean {r['mean_kl']:.2e} max {r['max_kl']:.2e}; top-1 agree "
              f"{100 * r['top1_agreement']:.2f}%; ppl {r['ppl_full']:.4f} -> {r['ppl_fp8']:.4f} "
              f"({100 * r['ppl_rel_diff']:+.3f}%)")
    if args.greedy_prompts:
        n = max(8, min(len(ids) // max(1, args.greedy_prompts), window - args.greedy_tokens - BLOCK))
        prompts = [ids[i * n:(i + 1) * n].tolist() for i in range(args.greedy_prompts) if (i + 1) * n <= len(ids)]
        engine = dict(dtype=dtype, attn_backend=backend, max_num_seqs=max(8, len(prompts)), warmup=False,
                      max_model_len=n + args.greedy_tokens + BLOCK)
        g = result["greedy"] = greedy_agreement(model, prompts, args.greedy_tokens, engine)
        print(f"greedy ({g['requests']} requests x {g['max_tokens']} tokens): {100 * g['token_agreement']:.1f}% of "
              f"tokens identical, {100 * g['identical_requests']:.0f}% of requests identical to the end, "
              f"{g['mean_tokens_before_first_difference']:.1f} tokens before the first difference; pools {g['pools']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
