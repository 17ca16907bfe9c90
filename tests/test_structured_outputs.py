"""vLLM's structured outputs, the choice kind: the answer is one of the given strings, then EOS. Any tokenization of a
choice is allowed (as vLLM's grammar backends), checked against a brute force over the whole vocabulary; the step's
(id, condition) entries packed with the input token in flight equal those packed with it known; greedy decoding picks
what transformers' logits under that mask pick; sampled answers are always a choice; bad values are refused by name."""
import numpy as np
import pytest
from helpers import TINY_ENGINE, hf_greedy_edited, hf_model

from jaxinfer import LLM, SamplingParams
from jaxinfer import structured as so
from jaxinfer.sampling_params import GuidedDecodingParams, StructuredOutputsParams

PROMPTS = [[5, 7, 9, 11, 300, 2, 3, 17, 40, 41, 8], [100, 200, 300, 100, 200]]
CHOICES = [["yes", "no"], ["positive", "negative", "neutral"], ["the cat", "the dog", "a bird", "the"]]


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, **TINY_ENGINE)


def brute_allowed(tok, V, choices, text, eos) -> set[int]:
    """Every id whose text, decoded alone, keeps `text` a prefix of a choice (EOS ids once it is a whole choice)."""
    out = {e for e in eos if text in choices}
    for i in range(min(V, len(tok))):
        t = tok.decode([i], skip_special_tokens=False)
        if t and "\ufffd" not in t and i not in tok.all_special_ids and any(c.startswith(text + t) for c in choices):
            out.add(i)
    return out


def test_allowed_tokens_and_entries_in_flight(llm):
    """The ids allowed after each reachable text equal a brute force over the vocabulary; the entries packed with the
    last token still on the device, filtered by it as the step does, equal the ones packed with it known."""
    tok, V, eos = llm.get_tokenizer(), llm.model_config.vocab_size, {2}
    rng = np.random.default_rng(0)
    for choices in CHOICES:
        rule = so.ChoiceRule(choices, tok, V)
        for _ in range(4):                              # random walks through the allowed tokens
            outputs, text = [], ""
            while True:
                known = {i for i, c in rule.entries(outputs, 0, eos)}
                assert known == brute_allowed(tok, V, choices, text, eos), (choices, text)
                assert len(rule.entries(outputs, 1, eos) if outputs else ()) <= rule.width
                if outputs:
                    held = outputs[:-1] + [-1]
                    assert {i for i, c in rule.entries(held, 1, eos) if c in (so.NO_COND, outputs[-1])} == known
                nxt = int(rng.choice(sorted(known)))
                if nxt in eos:                          # in flight under ignore_eos: the same text, EOS again
                    assert {i for i, c in rule.entries(outputs + [-1], 1, eos) if c in (so.NO_COND, nxt)} == eos
                    assert rule.entries(outputs + [nxt], 0, eos) == [(nxt, so.NO_COND)]
                    break
                outputs.append(nxt)
                text += tok.decode([nxt])
            assert text in choices


def test_greedy_matches_the_masked_reference(llm, tiny_dir):
    """Greedy under each choice list, beside a plain row and a bad_words row in one batch, and alone (where K-step
    calls would run), equals transformers' greedy loop over the allowed ids; the answer is a choice, finish "stop"."""
    model, tok, V, eos = hf_model(tiny_dir), llm.get_tokenizer(), llm.model_config.vocab_size, {2}

    def masked(row, out, choices):
        ok = sorted(brute_allowed(tok, V, choices, "".join(tok.decode([t]) for t in out), eos))
        mask = np.full_like(row, -np.inf)
        mask[ok] = row[ok]
        return mask

    def greedy(prompt, choices, n=12):
        return hf_greedy_edited(model, prompt, n, lambda row, out: masked(row, out, choices), stop=eos)
    sps = [SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(choice=c))
           for c in CHOICES] + [SamplingParams(temperature=0, max_tokens=12), SamplingParams(
               temperature=0, max_tokens=12, bad_words=["x"], guided_decoding=GuidedDecodingParams(choice=CHOICES[0]))]
    outs = llm.generate([PROMPTS[0]] * len(sps), sps, use_tqdm=False)
    for out, c in zip(outs, CHOICES + [None, CHOICES[0]]):
        if c is not None:
            assert out.outputs[0].token_ids == greedy(PROMPTS[0], c), c
            assert out.outputs[0].text in c and out.outputs[0].finish_reason == "stop"
    [alone] = llm.generate(PROMPTS[1], sps[1], use_tqdm=False)
    assert alone.outputs[0].token_ids == greedy(PROMPTS[1], CHOICES[1])
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_sampled_answers_are_choices(llm):
    """Seeded samples at temperature 2 (n = 4, a dict of fields, streamed too) are always one of the choices; the
    same seed repeats them; with ignore_eos the answer stays the choice followed by EOS only."""
    sp = SamplingParams(temperature=2.0, seed=5, n=4, max_tokens=16, structured_outputs={"choice": CHOICES[2]})
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    texts = [c.text for o in outs for c in o.outputs]
    assert set(texts) <= set(CHOICES[2]) and len(set(texts)) > 1
    assert [c.text for o in llm.generate(PROMPTS, sp, use_tqdm=False) for c in o.outputs] == texts
    streamed = {}
    for d in llm.stream(PROMPTS[:1], sp):
        streamed[d.outputs[0].index] = streamed.get(d.outputs[0].index, "") + d.outputs[0].text
    assert [streamed[i] for i in range(4)] == texts[:4]
    [held] = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=1, max_tokens=10, ignore_eos=True,
                                                     structured_outputs={"choice": ["no"]}), use_tqdm=False)
    ids = held.outputs[0].token_ids
    assert held.outputs[0].text == "no" and len(ids) == 10 and set(ids[-8:]) == {2}
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_refusals(llm):
    for kw, match in ((dict(structured_outputs={"grammar": "root ::= 'a'"}), "grammar is not supported"),
                      (dict(structured_outputs=StructuredOutputsParams(structural_tag="x")), "structural_tag is not"),
                      (dict(structured_outputs={"choice": ["a"], "regex": "a"}), "needs one kind"),
                      (dict(structured_outputs={"choice": []}), "non-empty list"),
                      (dict(structured_outputs={"choice": ["a", ""]}), "non-empty strings"),
                      (dict(structured_outputs={"chioce": ["a"]}), "no field 'chioce'"),
                      (dict(structured_outputs={"choice": ["a"]}, guided_decoding={"choice": ["b"]}), "give one"),
                      (dict(structured_outputs=["a"]), "StructuredOutputsParams"),
                      (dict(structured_outputs={"choice": ["a" * 5000]}), "at most 4096")):
        with pytest.raises(ValueError, match=f"structured_outputs.*{match}"):
            SamplingParams(**kw)
    assert SamplingParams(structured_outputs={}).structured_outputs is None
    for choices in (["\u2603"], ["caf\u00e9", "na\u00efve", "a.b (c)|[d]$"]):   # (byte pieces: the regex path)
        sp = SamplingParams(temperature=1.0, seed=4, max_tokens=30, n=2, structured_outputs={"choice": choices})
        outs = llm.generate([PROMPTS[0]] * 3, sp, use_tqdm=False)
        assert all(c.text in choices and c.finish_reason == "stop" for o in outs for c in o.outputs), outs
    with pytest.raises(ValueError, match="needs a tokenizer"):
        so.ChoiceRule(["a"], None, 10)
    assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_params_take_one_kind_as_vllms():
    """StructuredOutputsParams refuses two kinds or none when built (json_object=False counts, as in vLLM);
    the older GuidedDecodingParams refuses two, takes `backend` and has from_optional."""
    for kw in ({}, dict(json={"type": "integer"}, regex="a"), dict(regex="a", json_object=False)):
        with pytest.raises(ValueError, match="needs one kind"):
            StructuredOutputsParams(**kw)
    with pytest.raises(ValueError, match="at most"):
        GuidedDecodingParams(choice=["a"], regex="a")
    assert GuidedDecodingParams.from_optional(json=None, backend="xgrammar") is None
    g = GuidedDecodingParams.from_optional(regex="ab?", backend="xgrammar")
    so = SamplingParams(guided_decoding=g).structured_outputs
    assert type(so) is StructuredOutputsParams and so.regex == "ab?"
    with pytest.raises(ValueError, match="guided_decoding.*needs one kind"):
        SamplingParams(guided_decoding=GuidedDecodingParams())


class FakeTokenizer:
    """A vocabulary of a few texts: " " alone leads nowhere for " \u201c" (no token is "\u201c" alone)."""
    all_special_ids = [0]
    VOCAB = ["<eos>", "a", "b", "ab", " ", " \u201c", "x"]

    def __len__(self):
        return len(self.VOCAB)

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.VOCAB[i] for i in ids)


def test_dead_ends_are_left_out_and_unspellable_choices_refused():
    """A token whose text leads where no choice can be finished is not allowed (" " before a "\u201c" that no token
    spells alone); a choice that no tokenization spells is refused even beside one that can be (vLLM's backends
    could spell it from bytes; these texts cannot); min_tokens > 1 is refused (a choice may end first)."""
    tok = FakeTokenizer()
    rule = so.ChoiceRule([" \u201c", "ab"], tok, 7)
    assert sorted(i for i, _ in rule.options("")[0]) == [1, 3, 5]          # "a", "ab", " \u201c"; not " "
    assert rule.entries([5], 0, {0}) == [(0, so.NO_COND)] and rule.entries([1], 0, {0}) == [(2, so.NO_COND)]
    for choices in ([" \u201cz"], ["ab\u201c", "ab"]):
        with pytest.raises(ValueError, match="cannot be spelled"):
            so.ChoiceRule(choices, tok, 7)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs={"choice": ["a"]})
    assert SamplingParams(min_tokens=1, structured_outputs={"choice": ["a"]}).min_tokens == 1


def test_a_choice_that_other_masks_leave_no_token_ends_with_eos(llm):
    """allowed_token_ids (or bad_words) that leave a choice's row no token end the answer with EOS: the argmax of an
    all -inf row (id 0, which no mask allowed) is never emitted."""
    tok = llm.get_tokenizer()
    choice_ids = set(tok.encode("yes")) | set(tok.encode("no"))
    allowed = [i for i in (10, 20, 30) if i not in choice_ids]
    sp = SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=allowed,
                        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    out = llm.generate(PROMPTS[0], sp, use_tqdm=False)[0].outputs[0]
    assert 0 not in out.token_ids and out.finish_reason == "stop", (out.token_ids, out.finish_reason)
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]
