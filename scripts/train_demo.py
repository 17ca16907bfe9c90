"""Train the small demo model that ships in jaxinfer/assets/: a Qwen3 of ~7M parameters that writes Python
documentation, from the English text every Python installation carries.

    python scripts/train_demo.py --out jaxinfer/assets/qwen3-pydoc      # the real run: ~1 min on one H200
    python scripts/train_demo.py --quick --out /tmp/demo                # a few CPU steps (smoke test)

1. Corpus: `pydoc_data.topics` (the language reference pages `help()` shows) and every docstring of the
   standard library's .py files, read with `ast` (files in sorted order, tests and site-packages skipped,
   exact duplicates dropped). A quarter of the docstrings, picked by hash, are written as ChatML exchanges
   ("What does json.dumps do?" -> its docstring) so `jaxinfer chat` has something to imitate.
2. Split by a seeded hash of each document: 2% validation (picks the step to keep), 2% held out (reported,
   and shipped as heldout.txt for perplexity checks), the rest trains.
3. Tokenizer: byte-level BPE (HF `tokenizers`, Qwen3's pre-tokenizer regex) of 4096 ids, Qwen3's special
   tokens after the BPE ids as in Qwen3, a ChatML chat template.
4. Model: jaxinfer's own Qwen3 forward (`jaxinfer.model.qwen3.forward` with dense causal attention) trained
   with optax AdamW, bf16 compute on GPU, fp32 master weights, dropout on the attention output.
5. Output, one flat folder: config.json, model.safetensors (bf16, via jaxinfer's `save_checkpoint`),
   tokenizer.json, tokenizer_config.json, chat_template.jinja, heldout.txt, training.json (the log).

Reproducible: fixed seeds, deterministic GPU reductions. The corpus is the running Python's own, so the model
depends on the Python version (recorded in training.json).
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import mmap
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from scripts.demo_corpus import build_corpus, token_stream, train_tokenizer  # noqa: E402  (steps 1-3)


def deterministic_gpu() -> bool:
    """Ask XLA for deterministic GPU ops (the embedding gradient is a scatter-add) before JAX starts; this
    script owns its process. Only if this jaxlib knows the flag: XLA aborts on an unknown one."""
    flag = "xla_gpu_deterministic_ops"
    root = os.path.dirname(importlib.util.find_spec("jaxlib").origin)
    for so in sorted(glob.glob(os.path.join(root, "**", "*.so"), recursive=True)):
        with open(so, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m.find(flag.encode()) >= 0:
                os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{flag}=true".strip()
                return True
    return False


# -- 3. model and training ----------------------------------------------------------------------------------
def model_config(a, vocab_size: int, eos: tuple[int, ...]):
    from jaxinfer.config import ModelConfig
    return ModelConfig(vocab_size=vocab_size, hidden_size=a.hidden, intermediate_size=a.intermediate,
                       num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                       head_dim=a.head_dim, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
                       max_position_embeddings=a.seq_len, torch_dtype="bfloat16", eos_token_id=eos,
                       name="qwen3-pydoc")


def make_fns(cfg, a, compute_dtype):
    """(train_step, eval_nll) jitted; both use jaxinfer's own forward, so training sees the served math."""
    import jax
    import jax.numpy as jnp
    import optax

    from jaxinfer.model.qwen3 import compute_logits, dense_attention, forward

    def nll(params, tokens, mask, rng=None):
        """tokens [B, T+1], mask [B, T] -> (sum of NLL over masked positions, count)."""
        p = jax.tree.map(lambda w: w.astype(compute_dtype), params)
        x, y = tokens[:, :-1], tokens[:, 1:]

        def attn(l, q, k, v, cache):                       # q [B, T, H, D]
            o, cache = dense_attention(l, q, k, v, cache)
            if rng is not None and a.dropout > 0:          # dropout on the attention output (regulariser)
                keep = jax.random.bernoulli(jax.random.fold_in(rng, l), 1 - a.dropout, o.shape)
                o = jnp.where(keep, o / (1 - a.dropout), 0).astype(o.dtype)
            return o, cache

        positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape)
        hidden, _ = forward(cfg, p, x, positions, attn)
        logits = compute_logits(cfg, p, hidden)                                    # [B, T, V] fp32
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return (losses * mask).sum(), mask.sum()

    sched = optax.warmup_cosine_decay_schedule(0.0, a.lr, a.warmup, a.steps, end_value=a.lr * 0.1)
    decay = lambda params: jax.tree_util.tree_map_with_path(lambda path, _: "norm" not in str(path), params)
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=a.weight_decay, mask=decay))

    @jax.jit
    def train_step(params, opt_state, tokens, rng):
        def loss(p):
            s, n = nll(p, tokens, jnp.ones(tokens[:, 1:].shape, jnp.float32), rng)
            return s / n
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return opt, train_step, jax.jit(nll)


def windows(stream: np.ndarray, T: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-overlapping windows for evaluation: tokens [N, T+1] (the last one padded), mask [N, T]."""
    n = -(-(len(stream) - 1) // T)
    idx = np.arange(n)[:, None] * T + np.arange(T + 1)                             # [N, T+1]
    tokens = np.pad(stream, (0, n * T + 1 - len(stream)))[idx]
    return tokens, (idx[:, 1:] < len(stream)).astype(np.float32)


def mean_nll(eval_nll, params, stream: np.ndarray, T: int, B: int) -> float:
    tokens, mask = windows(stream, T)
    total = count = 0.0
    for i in range(0, len(tokens), B):      # fixed batch shape: pad the last batch with masked rows
        t, m = tokens[i:i + B], mask[i:i + B]
        pad = B - len(t)
        t, m = np.pad(t, ((0, pad), (0, 0))), np.pad(m, ((0, pad), (0, 0)))
        s, n = eval_nll(params, t, m)
        total, count = total + float(s), count + float(n)
    return total / count


def train(a, cfg, streams, log) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxinfer.model.qwen3 import init_params

    on_gpu = jax.default_backend() == "gpu"
    opt, train_step, eval_nll = make_fns(cfg, a, jnp.bfloat16 if on_gpu else jnp.float32)
    params = init_params(cfg, jnp.float32, a.seed)
    opt_state = opt.init(params)
    rng, data = jax.random.PRNGKey(a.seed), np.random.default_rng(a.seed)
    train_ids, T, B = streams["train"], a.seq_len, a.batch_size
    best = (float("inf"), 0, params)
    t0 = time.perf_counter()
    for step in range(1, a.steps + 1):
        starts = data.integers(0, len(train_ids) - T - 1, size=B)
        tokens = np.stack([train_ids[s:s + T + 1] for s in starts])                 # [B, T+1]
        params, opt_state, loss = train_step(params, opt_state, tokens, jax.random.fold_in(rng, step))
        if step % a.eval_every == 0 or step == a.steps:
            valid = mean_nll(eval_nll, params, streams["valid"], T, B)
            entry = dict(step=step, train_loss=round(float(loss), 4), valid_loss=round(valid, 4),
                         epochs=round(step * B * T / len(train_ids), 2), seconds=round(time.perf_counter() - t0, 1))
            log["evals"].append(entry)
            print(json.dumps(entry), flush=True)
            if valid < best[0]:
                best = (valid, step, params)          # not donated: the arrays stay valid
    log["train_seconds"] = round(time.perf_counter() - t0, 1)
    log["best_step"], params = best[1], best[2]
    # What ships is bf16: report the held-out loss of those weights (computed in fp32).
    shipped = jax.tree.map(lambda w: w.astype(jnp.bfloat16).astype(jnp.float32), params)
    eval32 = make_fns(cfg, a, jnp.float32)[2] if on_gpu else eval_nll
    for split in ("valid", "heldout"):
        loss = mean_nll(eval32, shipped, streams[split], T, B)
        log[f"{split}_loss"], log[f"{split}_ppl"] = round(loss, 4), round(float(np.exp(loss)), 2)
    return params


# -- 4. main ------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder (flat: 7 files)")
    ap.add_argument("--quick", action="store_true", help="a tiny model, a few steps: a smoke test for the CPU")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=4096, help="tokenizer and model vocabulary, added tokens included")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=1024, help="training window = max_position_embeddings")
    ap.add_argument("--batch-size", type=int, default=16)
    # 600: the H200 run of 1500 steps was best on validation at step 500 (~14 epochs) and overfit after it, so
    # the cosine decay now ends about there; the best validation step is kept either way.
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--dropout", type=float, default=0.1)
    a = ap.parse_args(argv)
    if a.quick:
        a.vocab, a.hidden, a.intermediate, a.layers, a.heads, a.kv_heads, a.head_dim = 512, 64, 128, 2, 4, 2, 16
        a.seq_len, a.batch_size, a.steps, a.eval_every, a.warmup = 64, 4, 4, 2, 2
    return a


def main(argv=None) -> dict:
    a = parse_args(argv)
    if "jax" not in sys.modules:        # once JAX has started, XLA_FLAGS is read already
        deterministic_gpu()
    import jax
    t0 = time.perf_counter()
    docs = build_corpus(a.seed, max_files=60 if a.quick else None)   # quick: a smoke test, kept fast
    tokenizer = train_tokenizer(docs["train"], a.vocab)
    eos = tuple(tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))
    streams = {k: token_stream(tokenizer, v) for k, v in docs.items()}
    cfg = model_config(a, len(tokenizer), eos)
    log = {"args": vars(a), "python": platform.python_version(), "jax": jax.__version__,
           "device": jax.devices()[0].device_kind,
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "params": cfg.num_params(),
           "documents": {k: len(v) for k, v in docs.items()}, "tokens": {k: len(v) for k, v in streams.items()},
           "corpus_chars": sum(len(d) for v in docs.values() for d in v),
           "corpus_seconds": round(time.perf_counter() - t0, 1), "evals": []}
    print(json.dumps({k: v for k, v in log.items() if k != "evals"}), flush=True)
    params = train(a, cfg, streams, log)

    from jaxinfer.model.loader import save_checkpoint
    os.makedirs(a.out, exist_ok=True)
    save_checkpoint(params, cfg, a.out, dtype="bfloat16")
    tokenizer.save_pretrained(a.out)
    for extra in ("special_tokens_map.json", "added_tokens.json"):   # older transformers: all in tokenizer.json
        if os.path.exists(os.path.join(a.out, extra)):
            os.remove(os.path.join(a.out, extra))
    with open(os.path.join(a.out, "tokenizer_config.json")) as f:   # the class name every transformers knows
        tc = json.load(f)
    with open(os.path.join(a.out, "tokenizer_config.json"), "w") as f:
        f.write(json.dumps({**tc, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")
    with open(os.path.join(a.out, "heldout.txt"), "w", encoding="utf-8") as f:
        f.write("".join(d + "<|endoftext|>" for d in docs["heldout"]))
    log["total_seconds"] = round(time.perf_counter() - t0, 1)
    with open(os.path.join(a.out, "training.json"), "w") as f:
        json.dump(log, f, indent=1)
    print(f"held-out loss {log['heldout_loss']} (perplexity {log['heldout_ppl']}) at step {log['best_step']}, "
          f"{cfg.num_params() / 1e6:.2f}M params, {log['total_seconds']} s; wrote {a.out}", flush=True)
    return log


if __name__ == "__main__":
    main()
