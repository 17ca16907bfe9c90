"""vLLM's bad_words: tokenized as vLLM does (the word and its space-prefixed form), applied on the device as (id,
condition) bans that the host packs before it has read the step in flight; greedy decoding picks what transformers'
logits with vLLM's rule pick, beside plain and biased rows, alone (where K-step calls would run), and sampled
outputs never hold a banned sequence; bad values are refused by name."""
import itertools

import numpy as np
import pytest
from helpers import TINY_ENGINE, hf_greedy_edited, hf_model

from jaxinfer import LLM, SamplingParams
from jaxinfer import bad_words as bw

PROMPTS = [[5, 7, 9, 11, 300, 2, 3, 17, 40, 41, 8], [100, 200, 300, 100, 200]]
N = 14


def vllm_bans(sequences, outputs) -> set[int]:
    """vLLM's rule (v1 sample/ops/bad_words.py): the last id of each sequence whose prefix ends the outputs."""
    return {s[-1] for s in sequences if len(s) <= len(outputs) + 1 and
            (len(s) == 1 or outputs[len(outputs) - len(s) + 1:] == s[:-1])}


def test_entries_with_the_input_token_in_flight_equal_vllms_rule():
    """Packed with the last output unknown (pending 1: the condition is checked against the step's input token on
    the device) or known (pending 0), the bans are vLLM's, for sequences of 1-4 ids over every short history."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        seqs = [list(rng.integers(0, 4, rng.integers(1, 5))) for _ in range(rng.integers(1, 5))]
        outputs = list(rng.integers(0, 4, rng.integers(0, 7)))
        want = vllm_bans(seqs, outputs)
        known = {t for t, c in bw.entries(seqs, outputs, 0)}
        assert all(c == bw.NO_COND for _, c in bw.entries(seqs, outputs, 0)) and known == want, (seqs, outputs)
        tail = outputs[len(outputs) - min(len(outputs), max(map(len, seqs))):]     # (what the packer passes)
        assert bw.entries(seqs, tail, 0, len(outputs)) == bw.entries(seqs, outputs, 0)
        if outputs:
            hidden = outputs[:-1] + [-1]                 # the in-flight token is a placeholder on the host
            got = {t for t, c in bw.entries(seqs, hidden, 1) if c == bw.NO_COND or c == outputs[-1]}
            assert got == want, (seqs, outputs)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, **TINY_ENGINE)


@pytest.fixture(scope="module")
def greedy_ref(tiny_dir):
    model = hf_model(tiny_dir)

    def edit(row, out, sequences, logit_bias):
        for t, v in (logit_bias or {}).items():
            row[t] += v
        row[list(vllm_bans(sequences, out))] = -np.inf
        return row
    return lambda prompt, n, sequences=(), logit_bias=None: hf_greedy_edited(
        model, prompt, n, lambda row, out: edit(row, out, sequences, logit_bias))


def test_tokenized_as_vllm(llm):
    """Each word as written (left-stripped) and with a leading space when that starts with another token in as many
    tokens; a word that makes no token, too many sequences, ids past the vocabulary or no tokenizer are refused."""
    tok = llm.get_tokenizer()
    enc = lambda s: tok.encode(s, add_special_tokens=False)    # noqa: E731
    for word in ("the", "  hello", "token", "x", "a"):
        plain, spaced = enc(word.lstrip()), enc(" " + word.lstrip())
        want = [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])
        assert bw.token_ids(tok, [word], 400) == want, word
    for words, match in ((["", "a"], "at least one token"), (["   "], "at least one token"),
                         (["a"] * 65, "too many token sequences"), (["hello"], "out-of-vocab")):
        with pytest.raises(ValueError, match=match):
            bw.token_ids(tok, words, 3 if words == ["hello"] else 400)
    assert len(bw.token_ids(tok, ["a"] * 64, 400)) == bw.MAX_SEQUENCES     # ("a" and " a": two sequences each)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        bw.token_ids(None, ["a"], 400)
    for bad in ("word", [1], [None], ["a"] * 129):
        with pytest.raises(ValueError, match="bad_words"):
            SamplingParams(bad_words=bad)
    assert SamplingParams(bad_words=[]).bad_words is None and not SamplingParams(bad_words=[]).needs_extras
    with pytest.raises(ValueError, match="bad_words entries must tokenize"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, bad_words=[" "]), use_tqdm=False)
    assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def words_in(tok, out: list[int], length: int) -> list[str]:
    """Texts of `length` consecutive output tokens that tokenize back to exactly those tokens (no space first)."""
    found = []
    for i in range(len(out) - length + 1):
        text = tok.decode(out[i:i + length])
        if text and not text[0].isspace() and tok.encode(text, add_special_tokens=False) == out[i:i + length]:
            found.append(text)
    return found


def test_greedy_matches_vllms_rule_beside_other_rows(llm, greedy_ref):
    """One, two and three-token words banned in one batch with a plain row and a logit_bias row; then each word
    alone (a batch of one, where K-step calls would run); the plain row is unchanged and no KV block is lost."""
    tok = llm.get_tokenizer()
    sp = dict(temperature=0, max_tokens=N, ignore_eos=True)
    plain = greedy_ref(PROMPTS[0], N)
    words = [words_in(tok, plain, k)[0] for k in (1, 2, 3) if words_in(tok, plain, k)]
    assert len(words) >= 2, (plain, words)
    cases = [dict(bad_words=[w]) for w in words] + [{}, dict(bad_words=words, logit_bias={33: 2.0})]
    outs = llm.generate([PROMPTS[0]] * len(cases), [SamplingParams(**sp, **kw) for kw in cases], use_tqdm=False)
    for out, kw in zip(outs, cases):
        seqs = bw.token_ids(tok, kw.get("bad_words", []), 400)
        want = greedy_ref(PROMPTS[0], N, seqs, kw.get("logit_bias"))
        assert out.outputs[0].token_ids == want, kw
        assert (want == plain) == (not seqs), kw
    for w in words:
        [alone] = llm.generate(PROMPTS[1], SamplingParams(**sp, bad_words=[w]), use_tqdm=False)
        assert alone.outputs[0].token_ids == greedy_ref(PROMPTS[1], N, bw.token_ids(tok, [w], 400)), w
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_sampled_outputs_never_hold_a_banned_sequence(llm):
    """Seeded samples at a high temperature (n = 4, streamed too) with the two most frequent tokens of a plain run
    banned, alone and as a pair: no output holds a banned id or the banned pair."""
    tok = llm.get_tokenizer()
    sp = dict(max_tokens=24, ignore_eos=True, seed=7, temperature=1.5, n=4)
    runs = llm.generate(PROMPTS[1], SamplingParams(**sp), use_tqdm=False)[0].outputs
    counts = np.bincount([t for o in runs for t in o.token_ids])
    a, b = (int(t) for t in np.argsort(counts)[::-1][:2])
    single = next((w for w in (tok.decode([a]), tok.decode([b])) if w and not w[0].isspace() and
                   tok.encode(w, add_special_tokens=False) in ([a], [b])), None)
    pairs = [p for o in runs for p in itertools.pairwise(o.token_ids)]
    pair = next((tok.decode(list(p)) for p in pairs if tok.decode(list(p)) and not tok.decode(list(p))[0].isspace()
                 and tok.encode(tok.decode(list(p)), add_special_tokens=False) == list(p)), None)
    words = [w for w in (single, pair) if w]
    assert words
    seqs = bw.token_ids(tok, words, 400)
    outs = llm.generate(PROMPTS[1], SamplingParams(**sp, bad_words=words), use_tqdm=False)[0].outputs
    streamed = {}
    for out in llm.stream(PROMPTS[1], SamplingParams(**sp, bad_words=words)):
        for o in out.outputs:
            streamed[o.index] = streamed.get(o.index, []) + list(o.token_ids)    # (deltas)
    for ids in [o.token_ids for o in outs] + list(streamed.values()):
        assert len(ids) == 24
        for i in range(len(ids)):
            assert ids[i] not in vllm_bans(seqs, ids[:i]), (words, ids)
    assert [o.token_ids for o in outs] != [o.token_ids for o in runs]
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_warmup_extras_compiles_the_width_requests_use(llm):
    """`warmup_extras` tokenizes the words to pick the variant's width: nine words of one token each (width 16) run
    with nothing compiled after it."""
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, bad_words=["x"] * 9)
    assert llm.engine.warmup_extras(sp) > 0
    llm.generate(PROMPTS[0], sp, use_tqdm=False)
    assert llm.stats()["compilations"] == 0
