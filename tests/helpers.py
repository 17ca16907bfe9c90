"""Test helpers: tiny checkpoints (cached per session) and the HF transformers reference."""
from __future__ import annotations

import dis
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from scripts.make_tiny_model import make_tiny_model  # noqa: E402, F401  (re-exported for tests)

# Three tiny configs that differ in GQA ratio, head_dim vs hidden/heads, tying and rope_theta.
TINY_CONFIGS = {
    "gqa1_tied": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16, hidden_size=64,
                      tie_word_embeddings=True, rope_theta=10000.0),
    "gqa2": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, hidden_size=64,
                 tie_word_embeddings=False, rope_theta=1_000_000.0),
    "gqa4_wide_head": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=24, hidden_size=48,
                           tie_word_embeddings=False, rope_theta=500.0, num_hidden_layers=3),
}


# The engine settings of the end-to-end tests (one dict, so the compiled steps are shared within a pytest process).
TINY_ENGINE = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
                   block_size=4, num_kvcache_blocks=256, warmup=False)


def hf_model(path: str):
    import torch
    from transformers import Qwen3ForCausalLM
    torch.manual_seed(0)
    return Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(model, token_ids: list[int]) -> np.ndarray:
    import torch
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].numpy()


def hf_greedy(model, token_ids: list[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
    """HF greedy generate; returns only the new tokens (stops at eos like ours)."""
    import torch
    with torch.no_grad():
        out = model.generate(torch.tensor([token_ids]), attention_mask=torch.ones(1, len(token_ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                             pad_token_id=eos if eos is not None else 0)
    return out[0, len(token_ids):].tolist()


def hf_greedy_edited(model, prompt: list[int], n: int, edit, stop=()) -> list[int]:
    """Greedy decoding over transformers' logits, each position's row (float64) changed by edit(row, outputs so far)
    first (a reference for logit_bias, bad_words, structured outputs); stops after a token in `stop`."""
    out: list[int] = []
    for _ in range(n):
        out.append(int(np.argmax(edit(hf_logits(model, prompt + out)[-1].astype(np.float64), out))))
        if out[-1] in stop:
            break
    return out


def hf_beam_search(model, prompt: list[int], width: int, steps: int, eos, length_penalty: float = 1.0,
                   ignore_eos: bool = False) -> list[tuple[list[int], float]]:
    """vLLM's beam search (LLM.beam_search) over transformers' float64 logprobs: the best `width` (prompt + output
    tokens, cumulative logprob), best first. eos: an id or a set of them."""
    eos = set(eos) if isinstance(eos, (set, frozenset, list, tuple)) else {eos}

    def score(b):                                       # (the prompt counted, a final EOS not)
        return b[1] / (len(b[0]) - (b[0][-1] in eos)) ** length_penalty
    beams, done = [(list(prompt), 0.0)], []
    for _ in range(steps):
        grown = []
        for toks, cum in beams:
            row = hf_logits(model, toks)[-1].astype(np.float64)
            lp = row - np.logaddexp.reduce(row)
            for t in np.argsort(-lp, kind="stable")[:2 * width]:
                (done if t in eos and not ignore_eos else grown).append((toks + [int(t)], cum + lp[t]))
        beams = sorted(grown, key=score, reverse=True)[:width]
    return sorted(done + beams, key=score, reverse=True)[:width]


def assert_lowers_to_triton(fn, args) -> None:
    """fn(*args) lowers to Triton IR for CUDA (no GPU needed): catches unsupported ops before a GPU run."""
    import jax
    import pytest
    try:
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    except (ImportError, RuntimeError, TypeError) as err:  # jaxlib without the Triton dialect / old API
        pytest.skip(f"cannot lower for CUDA here: {err}")
    assert "triton" in text


def make_paged(rng, lens, block_size, kv_heads, head_dim, dtype, extra_cols=1, extra_pages=3):
    """Random cache with each sequence's pages scattered over a permuted pool; unused table slots are garbage."""
    import jax.numpy as jnp
    pages = [-(-n // block_size) for n in lens]
    num_pages = sum(pages) + extra_pages
    width = max(pages) + extra_cols
    tables = rng.integers(0, num_pages, (len(lens), width)).astype(np.int32)  # garbage, but in range
    pool = rng.permutation(num_pages)
    used = 0
    for b, n in enumerate(pages):
        tables[b, :n] = pool[used:used + n]
        used += n
    shape = (num_pages, block_size, kv_heads, head_dim)
    k = jnp.asarray(rng.standard_normal(shape), dtype)
    v = jnp.asarray(rng.standard_normal(shape), dtype)
    return k, v, jnp.asarray(tables), jnp.asarray(np.asarray(lens, np.int32))


def interrupt_at_call(objs, at_call: int) -> None:
    """Make the step executables that each of `objs` (a ModelRunner, an ExtrasRunner) compiles raise
    KeyboardInterrupt right after their `at_call`-th call in all: the call ran (its donated inputs are gone) but
    its outputs are dropped, as when Ctrl-C lands before they are kept. `del obj.compile` undoes it."""
    calls = [0]

    def interrupting(real):
        def compile(*key):
            exe = real(*key)

            def call(*args):
                out = exe(*args)
                calls[0] += 1
                if calls[0] == at_call:
                    raise KeyboardInterrupt
                return out
            return call
        return compile
    for obj in objs:
        obj.compile = interrupting(obj.compile)


_EXITS: dict = {}


def with_exit(frame) -> bool:
    """Whether the line about to run is a `with` block's normal exit: its __exit__(None, None, None) call, which lies
    outside the block's exception handler. CPython delivers no signal before that call (its first check is after
    __exit__ returns), but a tracer raising there would skip __exit__ and leave, e.g., a lock held for good."""
    code = frame.f_code
    if code not in _EXITS:
        ins = [i for i in dis.get_instructions(code) if i.opname not in ("CACHE", "NOP")]
        _EXITS[code] = set()
        for k, first in enumerate(ins):         # ([SWAP 2: a `return` inside the block], None x3, __exit__'s call)
            rest = [i.opname for i in ins[k:k + 6] if i.opname != "PRECALL"]
            rest = rest[1:] if rest[:1] == ["SWAP"] else rest
            nones = all(i.argval is None for i in ins[k:k + 6] if i.opname == "LOAD_CONST")
            if rest[:4] == ["LOAD_CONST"] * 3 + ["CALL"] and nones:
                _EXITS[code].add(first.offset)
    return frame.f_lasti in _EXITS[code]


class Interrupt:
    """sys.settrace hook: KeyboardInterrupt at the n-th line executed in jaxinfer's engine and facade code (or, with
    `function`, in that function only, and with `caller`, only where a frame of that file calls it; at the first
    line from there that is not a `with` block's exit)."""

    def __init__(self, n: int, function: str | None = None, caller: str | None = None):
        self.n, self.function, self.caller, self.count, self.where = n, function, caller, 0, None

    def call(self, frame, event, arg):
        code = frame.f_code
        mine = code.co_name == self.function if self.function else \
            any(p in code.co_filename for p in ("jaxinfer/engine/", "jaxinfer/llm.py", "jaxinfer/output_processor"))
        if self.caller is not None:         # (only the calls from that file: e.g. its `with` blocks' __exit__)
            mine = mine and frame.f_back is not None and frame.f_back.f_code.co_filename.endswith(self.caller)
        return self.line if mine else None

    def line(self, frame, event, arg):
        if event == "line":
            self.count += 1
            if self.count >= self.n and not with_exit(frame):
                sys.settrace(None)
                self.where = f"{frame.f_code.co_name}:{frame.f_lineno}"
                raise KeyboardInterrupt
        return self.line

    def run(self, fn):
        sys.settrace(self.call)
        try:
            fn()
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        return self.where
