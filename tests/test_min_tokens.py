"""min_tokens (vLLM's): EOS and stop_token_ids cannot be sampled before that many output tokens (the step's extras
variant bans them on the device), and stop strings count only after them. Checked against a transformers greedy
loop with the same ban, with a K-step engine, under preemption, and through the server's protocol."""
import numpy as np
import pytest
from helpers import TINY_ENGINE, hf_logits, hf_model

from jaxinfer import LLM, SamplingParams

PROMPT = [5, 7, 9, 11, 300, 2, 3, 17, 40, 41, 8]


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, **TINY_ENGINE)


@pytest.fixture(scope="module")
def banned_greedy(tiny_dir):
    model = hf_model(tiny_dir)

    def run(prompt, n, stop_ids, min_tokens):
        out = []
        for _ in range(n):
            row = hf_logits(model, prompt + out)[-1].astype(np.float64)
            if len(out) < min_tokens:
                row[list(stop_ids)] = -np.inf
            out.append(int(np.argmax(row)))
            if out[-1] in stop_ids and len(out) > min_tokens:
                break
        return out
    return run


def test_stop_ids_wait_for_min_tokens(llm, banned_greedy):
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    stop = [plain.token_ids[1]]                         # greedy would stop at its 2nd token
    early = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=stop),
                         use_tqdm=False)[0]
    assert len(early.token_ids) == 2 and early.finish_reason == "stop"
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=stop, min_tokens=6)
    got = llm.generate([PROMPT, PROMPT[:5]], sp, use_tqdm=False)
    want = banned_greedy(PROMPT, 12, stop, 6)
    assert got[0].token_ids == want and len(want) >= 6 and stop[0] not in want[:6]
    assert got[0].finish_reason == ("stop" if want[-1] in stop else "length")
    # an id past the vocabulary (past int32 too) is refused by name (current vLLM's), not packed into a step
    with pytest.raises(ValueError, match=f"out-of-vocab token id\\(s\\) \\[{2**31}\\]"):
        llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[
            2**31, *stop], min_tokens=6), use_tqdm=False)
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"]


def test_many_stop_ids_wait_for_min_tokens(llm, banned_greedy):
    """More stop ids than the narrow ban row holds (16) take the wide variant (vLLM has no bound; here 1,024), also
    beside a row with one stop id in the same batch."""
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    stop = sorted(set(plain.token_ids[:6]) | set(range(100, 140)))      # greedy's first tokens among 40 others
    sps = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=stop, min_tokens=5),
           SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=stop[:1], min_tokens=3)]
    got = llm.generate([PROMPT, PROMPT], sps, use_tqdm=False)
    want = banned_greedy(PROMPT, 12, stop, 5)
    assert got[0].token_ids == want and not set(want[:5]) & set(stop)
    assert got[0].finish_reason == ("stop" if want[-1] in stop else "length")
    assert got[1].token_ids == banned_greedy(PROMPT, 12, stop[:1], 3)
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"]


def test_eos_waits_for_min_tokens_also_in_k_step_and_crowded_engines(tiny_dir, llm, banned_greedy):
    """The model's EOS is banned like a stop id (also with ignore_eos, as vLLM); a K-step engine runs one step per call while
    a row bans, and a tiny pool (preemptions) gives the same tokens."""
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    eos = llm.engine.scheduler.eos
    llm.engine.scheduler.eos = frozenset({plain.token_ids[0]})          # greedy's first token ends it ...
    try:
        assert len(llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].token_ids) == 1
        sp = SamplingParams(temperature=0, max_tokens=10, min_tokens=4)     # ... unless min_tokens holds it off
        got = llm.generate([PROMPT], sp, use_tqdm=False)[0].token_ids
    finally:
        llm.engine.scheduler.eos = eos
    assert got == banned_greedy(PROMPT, 10, [plain.token_ids[0]], 4)
    # with ignore_eos too (vLLM bans all its stop ids until min_tokens), and EOS then does not end it
    llm.engine.scheduler.eos = frozenset({plain.token_ids[0]})
    try:
        sp = SamplingParams(temperature=0, max_tokens=10, min_tokens=4, ignore_eos=True)
        got = llm.generate([PROMPT], sp, use_tqdm=False)[0].token_ids
    finally:
        llm.engine.scheduler.eos = eos
    assert got[:4] == banned_greedy(PROMPT, 4, [plain.token_ids[0]], 4) and len(got) == 10
    stop = [plain.token_ids[2]]
    sps = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=stop, min_tokens=m)
           for m in (0, 3, 5, 9)]
    want = [o.token_ids for o in llm.generate([PROMPT] * 4, sps, use_tqdm=False)]
    for kw in (dict(num_scheduler_steps=4), dict(num_kvcache_blocks=14, max_num_batched_tokens=8,
                                                     prefill_buckets=(8,))):
        other = LLM(tiny_dir, **{**TINY_ENGINE, **kw})
        assert [o.token_ids for o in other.generate([PROMPT] * 4, sps, use_tqdm=False)] == want, kw


def test_stop_strings_count_after_min_tokens(llm):
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    text = plain.text
    stop = text[:max(1, len(text) // 3)]                 # matched inside the first tokens
    early = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=stop),
                         use_tqdm=False)[0]
    late = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=stop,
                                                 min_tokens=8), use_tqdm=False)[0]
    assert early.finish_reason == "stop" and len(early.token_ids) < 8
    assert late.token_ids == plain.token_ids and late.text == text


def test_min_tokens_past_the_room_left_ends_on_length(llm):
    """max_tokens None means "until max_model_len" (128): min_tokens beyond the room left does not make the request
    an error; it ends on "length" there, as it does with a max_tokens given (vLLM)."""
    for m in (None, 10):
        out = llm.generate([[5] * 126], SamplingParams(temperature=0, max_tokens=m, min_tokens=5), use_tqdm=False)[0]
        assert len(out.token_ids) == 2 and out.finish_reason == "length"


@pytest.mark.parametrize("kw, match", [
    (dict(min_tokens=-1), "min_tokens=-1"), (dict(min_tokens=5, max_tokens=4), "min_tokens=5"),
    (dict(min_tokens=1.5), "min_tokens=1.5"), (dict(min_tokens=1, stop_token_ids=list(range(1025))), "1025 ids")])
def test_bad_min_tokens(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_server_passes_min_tokens():
    pytest.importorskip("fastapi")
    from jaxinfer.server import protocol as P
    req = P.CompletionRequest(prompt="a", max_tokens=8, min_tokens=3)
    P.check_unsupported(req)
    assert P.sampling_params(req, 1, 128, 16).min_tokens == 3
    with pytest.raises(P.RequestError, match="min_tokens"):
        P.sampling_params(P.CompletionRequest(prompt="a", max_tokens=2, min_tokens=3), 1, 128, 16)
