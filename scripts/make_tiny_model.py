"""Write a tiny random Qwen3 checkpoint directory, made with HF transformers and torch (the `[test]` extra),
with no downloads: config.json, generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json
and chat_template.jinja (a Qwen3-style chat template).

    python scripts/make_tiny_model.py /tmp/tiny-qwen3 [--layers 2 --hidden 64 ...]

Tests build their checkpoints with `make_tiny_model(path, **overrides)`.
"""
from __future__ import annotations

import argparse
import os

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
THINK_TAGS = ("<think>", "</think>")     # ids 3 and 4, but not special: decoded text keeps them, as Qwen3's does

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}"
)

_CORPUS = """The quick brown fox jumps over the lazy dog. A language model predicts the next token.
Paged attention stores the key value cache in fixed size blocks. Continuous batching keeps the GPU busy.
Hello world! How are you today? I am fine, thank you. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.
def main():\n    print("hello")\n    return 0\n
你好，世界。今天天气很好。我们在学习推理引擎。 Ça va? naïve café. Emoji: 😀 🚀 ✨ 👍🏽
""" * 4


def build_tokenizer(vocab_size: int = 400):
    """A byte-level BPE trained on a small embedded corpus, wrapped as a transformers fast tokenizer. As Qwen3's,
    `<|im_start|>`, `<|im_end|>` and `<|endoftext|>` are special and the thinking tags are plain added tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TAGS])   # (as Qwen3's: kept in text)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(path: str, *, vocab_size: int = 512, hidden_size: int = 64, intermediate_size: int = 128,
                    num_hidden_layers: int = 2, num_attention_heads: int = 4, num_key_value_heads: int = 2,
                    head_dim: int = 32, rope_theta: float = 10000.0, tie_word_embeddings: bool = False,
                    max_position_embeddings: int = 2048, dtype: str = "float32", seed: int = 0,
                    max_shard_size: str | None = None, init_std: float = 0.1, norm_std: float = 0.2,
                    rope_parameters: dict | None = None) -> str:
    """Create the checkpoint directory and return its path. `init_std` > HF's 0.02 gives the random
    model peaked next-token distributions, so greedy decoding is not decided by float rounding. RMSNorm
    weights are 1 + N(0, norm_std) (HF initialises them to ones, which would hide a norm weight taken
    from the wrong layer or head)."""
    try:
        import torch
    except ImportError as e:
        raise SystemExit(f"make_tiny_model.py needs torch ({e}): pip install -e '.[test]'") from None
    from transformers import Qwen3Config, Qwen3ForCausalLM

    os.makedirs(path, exist_ok=True)
    tokenizer = build_tokenizer(min(400, vocab_size))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen3Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, head_dim=head_dim,
                         rope_parameters={"rope_type": "default", "rope_theta": rope_theta, **(rope_parameters or {})},
                         tie_word_embeddings=tie_word_embeddings, max_position_embeddings=max_position_embeddings,
                         eos_token_id=eos, bos_token_id=None, pad_token_id=tokenizer.pad_token_id,
                         initializer_range=init_std)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(getattr(torch, dtype)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(norm_std * torch.randn_like(p))
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kw)
    tokenizer.save_pretrained(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--tied", action="store_true")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    a = ap.parse_args()
    make_tiny_model(a.path, vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                    num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                    head_dim=a.head_dim, tie_word_embeddings=a.tied, dtype=a.dtype)
    print(f"wrote a tiny random Qwen3 checkpoint to {a.path}")


if __name__ == "__main__":
    main()
