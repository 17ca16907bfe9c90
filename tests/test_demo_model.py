"""The shipped demo model (jaxinfer/assets/qwen3-pydoc, made by scripts/train_demo.py), on the CPU in fp32:
both backends' greedy tokens equal transformers', held-out perplexity from jaxinfer's forward equals
transformers', and its text reads as English. On the GPU, bf16 xla vs pallas: next-token agreement on held-out
text (teacher-forced), and free-running greedy agreement until the outputs first split."""
import gc
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import hf_model

from jaxinfer import LLM, SamplingParams
from jaxinfer.assets import demo_model_path
from jaxinfer.config import ModelConfig
from jaxinfer.model.attention import paged_attention_layer
from jaxinfer.model.loader import load_params
from jaxinfer.model.qwen3 import compute_logits, dense_logits, forward

ENGINE = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=128, max_model_len=256, block_size=16,
              num_kvcache_blocks=96, warmup=False)
PROMPTS = ["Return the number of", "class collections.OrderedDict", "The json module"]
COMMON = {"the", "a", "an", "of", "to", "is", "and", "in", "for", "if", "be", "this", "that", "with", "it", "or",
          "by", "as", "are", "not", "return", "returns", "object", "from", "on"}


@pytest.fixture(scope="module")
def demo():
    return demo_model_path()


@pytest.fixture(scope="module")
def tokenizer(demo):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(demo)


@pytest.fixture(scope="module")
def reference(demo):
    return hf_model(demo)


def test_package_files_and_tokenizer(demo, tokenizer):
    """A flat folder that fits the package; Qwen3's special tokens; the ChatML template; both EOS ids."""
    files = sorted(os.listdir(demo))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "heldout.txt",
            "training.json"} <= set(files), files
    assert sum(os.path.getsize(os.path.join(demo, f)) for f in files) <= 20 * 2**20
    cfg = ModelConfig.from_pretrained(demo)
    assert 5e6 <= cfg.num_params() <= 15e6 and 4000 <= cfg.vocab_size <= 8192
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>",
                                                           "<think>", "</think>")}
    assert len(set(ids.values())) == 5 and max(ids.values()) < cfg.vocab_size
    assert set(cfg.eos_token_id) == {ids["<|im_end|>"], ids["<|endoftext|>"]}
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.encode(chat, add_special_tokens=False)[0] == ids["<|im_start|>"]


@pytest.fixture(scope="module")
def xla_llm(demo):
    return LLM(demo, attn_backend="xla", **ENGINE)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_greedy_equals_transformers(demo, backend, tokenizer, reference, xla_llm):
    llm = xla_llm if backend == "xla" else LLM(demo, attn_backend=backend, **ENGINE)
    ps = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS[:2]]
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    for p, o in zip(ps, outs):
        assert o.token_ids == hf_greedy_no_eos(reference, p, 10), tokenizer.decode(p)


def hf_greedy_no_eos(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens from transformers, never stopping at EOS (as ignore_eos=True)."""
    import torch
    with torch.no_grad():
        for _ in range(n):
            ids = ids + [int(model(torch.tensor([ids])).logits[0, -1].argmax())]
    return ids[-n:]


def engine_forward_nll(path: str, ids: list[int]) -> np.ndarray:
    """Per-token NLL [T-1] of ids [T] through the engine's model forward: jaxinfer's Qwen3 with the paged KV
    cache and the xla prefill attention, as one prefill chunk of one sequence."""
    cfg = ModelConfig.from_pretrained(path)
    params = load_params(path, cfg, jnp.float32)
    T, bs = len(ids), 16
    pages = -(-T // bs)
    meta = {"slot_mapping": jnp.arange(T), "block_tables": jnp.arange(pages)[None],
            "cu_seqlens": jnp.array([0, T]), "seq_lens": jnp.array([T])}
    shape = (pages, bs, cfg.num_key_value_heads, cfg.head_dim)                       # [P, bs, K, D]
    caches = [(jnp.zeros(shape), jnp.zeros(shape)) for _ in range(cfg.num_hidden_layers)]
    hidden, _ = forward(cfg, params, jnp.asarray(ids), jnp.arange(T), paged_attention_layer("prefill", "xla", meta),
                        caches)
    logp = np.asarray(jax.nn.log_softmax(compute_logits(cfg, params, hidden)))        # [T, V] fp32
    return -logp[np.arange(T - 1), ids[1:]]


def test_heldout_perplexity_jaxinfer_equals_transformers(demo, tokenizer, reference):
    """Held-out documents (never trained on): perplexity from jaxinfer's forward and from transformers."""
    import torch
    with open(os.path.join(demo, "heldout.txt"), encoding="utf-8") as f:
        ids = tokenizer.encode(f.read(), add_special_tokens=False)
    ids = ids[:256]                                    # within max_position_embeddings (512 or more)
    ours = engine_forward_nll(demo, ids)
    with torch.no_grad():
        logits = reference(torch.tensor([ids])).logits[0, :-1]
        theirs = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none").numpy()
    ppl_ours, ppl_hf = float(np.exp(ours.mean())), float(np.exp(theirs.mean()))
    with open(os.path.join(demo, "training.json")) as f:
        reported = json.load(f)["heldout_ppl"]
    print(f"\nheld-out perplexity (first {len(ids)} tokens): jaxinfer {ppl_ours:.4f}, transformers {ppl_hf:.4f}; "
          f"train_demo.py reported {reported} over the whole held-out split")
    assert abs(ppl_ours - ppl_hf) <= 1e-4 * ppl_hf
    assert ppl_ours < 300, "not trained: a unigram model of the training split scores ~950 here, uniform 4096"


def english_score(text: str) -> tuple[float, float, int]:
    """(ASCII share, share of words that are letters only, how many common English words appear)."""
    words = text.split()
    ascii_share = sum(c.isascii() for c in text) / max(1, len(text))
    letters = sum(bool(re.fullmatch(r"[A-Za-z]+[.,:;)]?", w)) for w in words) / max(1, len(words))
    return ascii_share, letters, len(COMMON & {w.lower().strip(".,:;()") for w in words})


def test_generated_text_reads_as_english(xla_llm):
    """Greedy continuations are words, mostly common English ones, not token placeholders or symbol soup."""
    outs = xla_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    text = " ".join(o.text for o in outs)
    print(f"\ngreedy demo text: {text!r}")
    ascii_share, letters, common = english_score(text)
    assert not re.search(r"<\d+>", text), text
    assert ascii_share > 0.95 and letters > 0.5 and common >= 3, (ascii_share, letters, common, text)


def test_train_demo_quick_smoke(tmp_path):
    """`train_demo.py --quick` (a tiny model, 4 CPU steps) writes a flat folder of <= 7 files, each < 16 MiB (what
    the GPU machine can send back), that jaxinfer and transformers both load to the same logits."""
    import torch

    from scripts.train_demo import main
    log = main(["--quick", "--out", str(tmp_path)])
    files = sorted(os.listdir(tmp_path))
    assert len(files) <= 7 and all((tmp_path / f).is_file() and (tmp_path / f).stat().st_size < 16 * 2**20
                                   for f in files), files
    assert log["heldout_loss"] < np.log(512) and log["documents"]["heldout"] > 0
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    ids = [list(range(3, 40))]
    ours = np.asarray(dense_logits(cfg, load_params(str(tmp_path), cfg, jnp.float32), jnp.asarray(ids)))
    with torch.no_grad():
        theirs = hf_model(str(tmp_path))(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_bf16_xla_and_pallas_agree_on_gpu(demo, tokenizer):
    """64 held-out document openings, 64 greedy tokens each, bf16: a token agrees while both backends' outputs
    are still identical (a near-tie split ends agreement for the rest of that output)."""
    with open(os.path.join(demo, "heldout.txt"), encoding="utf-8") as f:
        docs = [tokenizer.encode(d, add_special_tokens=False) for d in f.read().split("<|endoftext|>")]
    prompts = [d[:24] for d in docs if len(d) >= 24][:64]
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    outs = {}
    for backend in ("xla", "pallas"):
        llm = LLM(demo, dtype="bfloat16", attn_backend=backend, max_num_seqs=64, max_model_len=256,
                  num_kvcache_blocks=1280, warmup=False)
        outs[backend] = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        del llm
        gc.collect()
    agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(*outs.values())]
    share = sum(agree) / (len(prompts) * 64)
    print(f"\nbf16 xla vs pallas on the demo model: {share:.1%} of tokens agree, "
          f"{sum(a == 64 for a in agree)}/{len(prompts)} outputs identical")
    # Measured on the H200 (2026-11-30): 89.0%, 53/64 outputs identical. The goal is 95%; this guards against a
    # regression below what was measured, and the gap is a known open point (bf16 near-ties of a small model
    # whose greedy paths split early).
    assert share >= 0.85


@pytest.mark.gpu
def test_bf16_xla_and_pallas_next_token_agreement_on_gpu(demo, tokenizer):
    """Teacher-forced: both backends read the same 64 held-out documents (96 tokens each) and each position's
    most likely next token (rank 1 of prompt_logprobs) is compared. Unlike free-running generation, one near-tie
    does not change every later token, so this counts where the backends' numerics disagree."""
    with open(os.path.join(demo, "heldout.txt"), encoding="utf-8") as f:
        docs = [tokenizer.encode(d, add_special_tokens=False) for d in f.read().split("<|endoftext|>")]
    prompts = [d[:96] for d in docs if len(d) >= 96][:64]
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    top1 = {}
    for backend in ("xla", "pallas"):
        llm = LLM(demo, dtype="bfloat16", attn_backend=backend, max_num_seqs=64, max_model_len=256,
                  num_kvcache_blocks=1280, warmup=False)
        top1[backend] = [[next(t for t, lp in d.items() if lp.rank == 1) for d in o.prompt_logprobs[1:]]
                         for o in llm.generate(prompts, sp, use_tqdm=False)]
        del llm
        gc.collect()
    pairs = [(a, b) for x, y in zip(*top1.values()) for a, b in zip(x, y)]
    share = sum(a == b for a, b in pairs) / len(pairs)
    print(f"\nbf16 xla vs pallas on the demo model, teacher-forced: {share:.2%} of {len(pairs)} next tokens agree")
    assert share >= 0.95
