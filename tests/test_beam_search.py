"""vLLM's `LLM.beam_search`: the beams equal a search by vLLM's rules over transformers' logprobs (EOS beams complete,
length penalty over prompt + output, ignore_eos), one prompt at a time or all at once; max_model_len ends beams;
every KV block comes back; bad parameters are refused by name."""
import pytest
from helpers import TINY_ENGINE, hf_beam_search, hf_model

from jaxinfer import LLM
from jaxinfer.beam_search import BeamSearchOutput, get_beam_search_score
from jaxinfer.sampling_params import BeamSearchParams

EOS_PROMPT = [45, 147, 254, 307, 154, 12, 290, 203]     # (on the tiny checkpoint, an EOS beam is among its best 3)
PROMPTS = [EOS_PROMPT, [5, 7, 9, 11, 300, 2, 3], [100, 200, 300, 100, 200, 17]]


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, **TINY_ENGINE)


@pytest.fixture(scope="module")
def reference(tiny_dir, llm):
    model, eos = hf_model(tiny_dir), llm.get_tokenizer().eos_token_id
    return lambda prompt, bw, n, lp=1.0, ignore_eos=False: hf_beam_search(model, prompt, bw, n, eos, lp, ignore_eos)


def check(out: BeamSearchOutput, want, eos, ignore_eos=False):
    assert [s.tokens for s in out.sequences] == [w[0] for w in want]
    for s, (toks, cum) in zip(out.sequences, want):
        assert s.cum_logprob == pytest.approx(cum, abs=1e-3 * len(s.logprobs))   # (GPU fp32 dots: ~3e-4 a token)
        assert s.finish_reason == ("stop" if toks[-1] == eos and not ignore_eos else "length")
        assert sum(d[t].logprob for d, t in zip(s.logprobs, s.tokens[-len(s.logprobs):])) == pytest.approx(
            s.cum_logprob, abs=1e-4)


@pytest.mark.parametrize("length_penalty,ignore_eos", [(1.0, False), (0.5, False), (1.0, True)])
def test_beams_equal_vllms_search_over_transformers(llm, reference, length_penalty, ignore_eos):
    eos = llm.get_tokenizer().eos_token_id
    params = BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=length_penalty, ignore_eos=ignore_eos)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    wants = [reference(p, 3, 8, length_penalty, ignore_eos) for p in PROMPTS]
    for out, want in zip(outs, wants):
        check(out, want, eos, ignore_eos)
    ended = [s.tokens[-1] == eos for o in outs for s in o.sequences]
    assert any(ended) != ignore_eos                       # (the EOS rule was exercised, or rightly not applied)
    assert outs[0].sequences[0].text == llm.get_tokenizer().decode(outs[0].sequences[0].tokens)  # prompt's text too
    tok = llm.get_tokenizer()                  # each step's candidates carry their text (vLLM's decoded_token)
    assert all(lp.decoded_token == tok.decode([t]) for s in outs[0].sequences for d in s.logprobs for t, lp in d.items())
    one_at_a_time = llm.beam_search(PROMPTS, params, concurrency_limit=1)
    assert [[s.tokens for s in o.sequences] for o in one_at_a_time] == [[s.tokens for s in o.sequences] for o in outs]
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["running"] == stats["waiting"] == 0


def test_every_eos_id_ends_a_beam(tiny_dir, llm):
    """The model's config EOS ids end a beam as the tokenizer's does (the ids generate stops at; vLLM's search checks
    the tokenizer's alone and runs past the others, e.g. Qwen3's <|endoftext|>)."""
    eos = llm.get_tokenizer().eos_token_id
    other = LLM(tiny_dir, hf_overrides={"eos_token_id": [eos, 395]}, **TINY_ENGINE)
    out, = other.beam_search([PROMPTS[1]], BeamSearchParams(beam_width=3, max_tokens=8))
    want = hf_beam_search(hf_model(tiny_dir), PROMPTS[1], 3, 8, {eos, 395})
    assert [s.tokens for s in out.sequences] == [w[0] for w in want]
    assert any(s.tokens[-1] == 395 and s.finish_reason == "stop" for s in out.sequences)


def test_max_model_len_ends_beams_and_sampling_runs(llm):
    prompt = list(range(3, 3 + llm.config.max_model_len - 3))
    out, = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=10, ignore_eos=True))
    assert [len(s.tokens) for s in out.sequences] == [llm.config.max_model_len] * 2
    assert all(s.finish_reason == "length" for s in out.sequences)
    outs = llm.beam_search(["hello there", "x"], BeamSearchParams(beam_width=4, max_tokens=5, temperature=1.0))
    for o in outs:
        scores = [get_beam_search_score(s.tokens, s.cum_logprob, llm.get_tokenizer().eos_token_id) for s in o.sequences]
        assert len(o.sequences) == 4 and scores == sorted(scores, reverse=True)


@pytest.mark.parametrize("kw,match", [
    (dict(beam_width=0, max_tokens=4), "beam_width"), (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2.0, max_tokens=4), "beam_width"), (dict(beam_width=2, max_tokens=4, temperature=-1), "temperature"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty")])
def test_bad_params_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**kw)


def test_bad_calls_are_refused_and_the_engine_stays_usable(llm):
    for call, match in [(lambda: llm.beam_search([[1, 2]], BeamSearchParams(beam_width=11, max_tokens=2)), "beam_width=11"),
                        (lambda: llm.beam_search([[1, 2]], {"beam_width": 2}), "BeamSearchParams"),
                        (lambda: llm.beam_search([[1, 2]], BeamSearchParams(2, 2), concurrency_limit=0), "concurrency"),
                        (lambda: llm.beam_search([[1, 2], [10**9]], BeamSearchParams(2, 2)), "prompt 1"),
                        (lambda: llm.beam_search([[1, 2]], BeamSearchParams(2, 2), lora_request=object()), "lora")]:
        with pytest.raises(ValueError, match=match):
            call()
    assert len(llm.beam_search([[1, 2]], BeamSearchParams(2, 2))[0].sequences) == 2
    for field, value in [("beam_width", 0), ("max_tokens", -2), ("length_penalty", float("nan"))]:
        params = BeamSearchParams(2, 2)
        setattr(params, field, value)                  # (a field set after construction is checked too)
        with pytest.raises(ValueError, match=field):
            llm.beam_search([[1, 2]], params)


def test_score_is_vllms():
    assert get_beam_search_score([1, 2, 3, 9], -3.0, eos_token_id=9) == -1.0           # a final EOS not counted
    assert get_beam_search_score([1, 2, 3, 9], -3.0, eos_token_id=8) == -0.75
    assert get_beam_search_score([1, 2, 3, 4], -4.0, eos_token_id=9, length_penalty=0.5) == -2.0
