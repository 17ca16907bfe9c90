"""Logprobs, prompt logprobs and n samples (vLLM semantics) against transformers' fp32 log_softmax; the
engine-core output path carries them through msgpack; LLM.abort ends a streamed request."""
import os
import time

import numpy as np
import pytest
from helpers import TINY_ENGINE, hf_logits, hf_model

from jaxinfer import LLM, SamplingParams
from jaxinfer.outputs import Logprob, LogprobsList, logprob_dict

PROMPTS = [[5, 7, 9, 11, 300, 2, 3, 17, 40, 41, 8], [100, 200, 300], list(range(1, 16))]


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, **TINY_ENGINE)


@pytest.fixture(scope="module")
def ref(tiny_dir):
    """prompt + output ids -> fp32 log_softmax [len, V] of the HF model."""
    import torch
    model = hf_model(tiny_dir)
    return lambda ids: torch.log_softmax(torch.tensor(hf_logits(model, ids)), -1).numpy()


def _free(llm):
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"], st


def _check_entries(entries, lp_row, token, n):
    """One token's {id: Logprob} against a reference log_softmax row: values, ranks, the top n."""
    assert token in entries and len(entries) in (n, n + 1)
    np.testing.assert_allclose(entries[token].logprob, lp_row[token], atol=2e-3)
    assert entries[token].rank == 1 + int(np.sum(lp_row > lp_row[token] + 1e-5))
    top = sorted((e for t, e in entries.items() if e.rank <= n), key=lambda e: e.rank)
    assert [e.rank for e in top] == list(range(1, n + 1))
    assert all(a.logprob >= b.logprob for a, b in zip(top, top[1:]))             # best first
    np.testing.assert_allclose([e.logprob for e in top], np.sort(lp_row)[::-1][:n], atol=2e-3)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_match_transformers(llm, ref, temperature):
    sp = SamplingParams(temperature=temperature, max_tokens=6, logprobs=3, prompt_logprobs=2, seed=3, ignore_eos=True)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        c = o.outputs[0]
        lp = ref(p + c.token_ids)
        assert len(c.logprobs) == len(c.token_ids) == 6
        for k, t in enumerate(c.token_ids):
            _check_entries(c.logprobs[k], lp[len(p) - 1 + k], t, 3)
            assert all(d.decoded_token is not None for d in c.logprobs[k].values())
        np.testing.assert_allclose(c.cumulative_logprob, sum(lp[len(p) - 1 + k, t] for k, t in enumerate(c.token_ids)),
                                   atol=1e-2)
        assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(p)
        for k in range(1, len(p)):
            _check_entries(o.prompt_logprobs[k], lp[k - 1], p[k], 2)
    _free(llm)


def test_without_logprobs_nothing_is_computed(llm):
    before = llm.stats()["compiled_extras"]
    o = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert o.outputs[0].logprobs is None and o.outputs[0].cumulative_logprob is None and o.prompt_logprobs is None
    assert llm.stats()["compiled_extras"] == before          # the plain step ran: no variant compiled
    assert llm.llm_engine.stats() == llm.engine.stats()        # (vLLM's engine API passes the rest on)


def test_neighbours_asking_logprobs_do_not_change_tokens(llm):
    """A seeded request draws the same tokens in a batch that runs the logprobs variant."""
    plain = SamplingParams(temperature=0.9, max_tokens=5, seed=11, ignore_eos=True)
    alone = llm.generate(PROMPTS[:1], plain, use_tqdm=False)[0].token_ids
    mixed = llm.generate(PROMPTS[:2], [plain, SamplingParams(max_tokens=5, logprobs=1)], use_tqdm=False)
    assert mixed[0].token_ids == alone and mixed[0].outputs[0].logprobs is None
    assert len(mixed[1].outputs[0].logprobs) == 5


def test_small_top_k_with_logprobs_skips_the_sort_with_the_same_tokens(tiny_dir):
    """Qwen3's sampling (top_k 20, top_p 0.95) with logprobs runs the logprobs variant's no-sort draw: the same
    tokens as without logprobs (the resample program) and beside a top_p-only row (the sort); warmup_extras
    compiles that variant, so nothing compiles afterwards."""
    llm = LLM(tiny_dir, **TINY_ENGINE)
    qwen = SamplingParams(temperature=1.3, top_k=20, top_p=0.95, seed=5, max_tokens=8, ignore_eos=True)
    with_lp = SamplingParams(**{**qwen.__dict__, "logprobs": 2})
    assert llm.engine.warmup_extras(with_lp) > 0
    before = llm.stats()["compilations"]
    a = llm.generate(PROMPTS[:1], with_lp, use_tqdm=False)[0]
    assert llm.stats()["compilations"] == before
    assert {key[4] for key, part in llm.engine.extras.compiled} == {"top_k"}
    assert a.token_ids == llm.generate(PROMPTS[:1], qwen, use_tqdm=False)[0].token_ids
    other = SamplingParams(temperature=1.0, top_p=0.8, seed=1, max_tokens=8, logprobs=1)
    assert llm.generate(PROMPTS[:2], [with_lp, other], use_tqdm=False)[0].token_ids == a.token_ids
    _free(llm)


def test_prompt_logprobs_chunked_and_after_a_prefix_cache_hit(tiny_dir, ref):
    """Chunked prefill (8-token budget) computes every prompt token's logprob; a prompt cached by an earlier
    request is computed again (no prefix reuse) so none is missing."""
    llm = LLM(tiny_dir, **{**TINY_ENGINE, "max_num_batched_tokens": 8, "prefill_buckets": (8,)})
    p = PROMPTS[2]
    llm.generate([p], SamplingParams(max_tokens=2), use_tqdm=False)                    # caches p's blocks
    o = llm.generate([p], SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)[0]
    assert o.num_cached_tokens == 0
    lp = ref(p)
    assert o.prompt_logprobs[0] is None
    for k in range(1, len(p)):
        _check_entries(o.prompt_logprobs[k], lp[k - 1], p[k], 1)
    assert llm.stats()["prefill_steps"] > 2
    _free(llm)


def test_n_samples_differ_and_repeat_with_the_seed(llm):
    sp = SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=5, ignore_eos=True, logprobs=0)
    assert llm.reset_prefix_cache() is True                  # vLLM's return value
    hits = llm.stats()["prefix_cache_hit_tokens"]
    a = llm.generate(PROMPTS[:2], sp, use_tqdm=False)
    # samples 1 and 2 reuse sample 0's prompt blocks: 2 full 4-token blocks of the 11-token prompt each
    assert llm.stats()["prefix_cache_hit_tokens"] - hits == 2 * 8
    b = llm.generate(PROMPTS[:2], sp, use_tqdm=False)
    for x, y in zip(a, b):
        assert [c.index for c in x.outputs] == [0, 1, 2]
        ids = [tuple(c.token_ids) for c in x.outputs]
        assert len(set(ids)) == 3, ids                                            # they differ
        assert ids == [tuple(c.token_ids) for c in y.outputs]                     # and repeat
        assert x.token_ids == x.outputs[0].token_ids and x.text == x.outputs[0].text
        assert all(len(c.logprobs[0]) == 1 for c in x.outputs)                    # logprobs=0: the token only
    one = llm.generate(PROMPTS[:1], SamplingParams(temperature=1.0, max_tokens=8, seed=5, ignore_eos=True),
                       use_tqdm=False)[0]
    assert one.token_ids == a[0].outputs[0].token_ids                            # sample 0 = the n=1 request
    _free(llm)


def test_stream_carries_logprobs_and_samples(llm):
    sp = SamplingParams(temperature=0.7, max_tokens=5, n=2, seed=9, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    full = llm.generate(PROMPTS[:1], sp, use_tqdm=False)[0]
    got, cum = {0: [], 1: []}, {}
    prompt_lps = []
    for d in llm.stream(PROMPTS[:1], sp):
        (c,) = d.outputs
        got[c.index] += c.logprobs
        cum[c.index] = c.cumulative_logprob
        if d.prompt_logprobs is not None:
            prompt_lps.append(d.prompt_logprobs)
    for j in (0, 1):
        want = full.outputs[j].logprobs
        assert [sorted(x) for x in got[j]] == [sorted(x) for x in want]
        assert [x[t].logprob for x, t in zip(got[j], full.outputs[j].token_ids)] == \
            [x[t].logprob for x, t in zip(want, full.outputs[j].token_ids)]
        np.testing.assert_allclose(cum[j], full.outputs[j].cumulative_logprob, rtol=1e-6)    # summed over deltas
    assert len(prompt_lps) == 1 and len(prompt_lps[0]) == len(PROMPTS[0])
    _free(llm)


def test_abort_ends_a_streamed_request(llm):
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    reasons, counts = {}, {0: 0, 1: 0}
    for d in llm.stream(PROMPTS[:2], sp):
        counts[d.request_id] += len(d.token_ids)
        if d.finish_reason:
            reasons[d.request_id] = d.finish_reason
        if counts[1] >= 2 and 1 not in reasons:
            llm.abort(1)
    assert reasons == {0: "length", 1: "abort"} and counts[0] == 20 and counts[1] < 20
    _free(llm)
    # aborted while the step that updated it is still being yielded (at request 0's first delta): its samples
    # end with one "abort" delta each, and nothing follows it
    for n in (1, 2):
        seen = []
        for d in llm.stream(PROMPTS[:2], SamplingParams(max_tokens=8, ignore_eos=True, n=n, seed=1, temperature=0.8)):
            seen.append((d.request_id, d.outputs[0].index, d.outputs[0].finish_reason))      # (the sample's own)
            if len(seen) == 1:
                llm.abort(1 - d.request_id)
        victim = 1 - seen[0][0]
        for j in range(n):
            ends = [r for i, k, r in seen if (i, k) == (victim, j)]
            assert ends[-1] == "abort" and ends.count("abort") == 1, seen
        _free(llm)
    # aborted before the stream's first delta is read (the stream's requests are added then); an abort issued
    # before a stream was created is not that stream's
    llm.abort(0)
    g = llm.stream(PROMPTS[:2], SamplingParams(max_tokens=6, ignore_eos=True))
    llm.abort(1)
    ends = {d.request_id: d.finish_reason for d in g if d.finish_reason}
    assert ends == {0: "length", 1: "abort"}, ends
    _free(llm)
    with pytest.raises(ValueError, match="request_id"):
        llm.abort("x")
    with pytest.raises(ValueError, match="empty"):          # bad input raises at the call, not at the first delta
        llm.stream([[]])
    # a prompt that takes several prefill chunks (64-token steps) yields nothing meanwhile: an abort still ends it
    # before its next step (before, every chunk ran and a token was sampled first)
    before = llm.stats()["prefill_steps"]
    g = llm.stream([list(range(1, 121))], SamplingParams(max_tokens=6, ignore_eos=True))
    llm.abort(0)
    assert [(d.token_ids, d.finish_reason) for d in g] == [([], "abort")]
    assert llm.stats()["prefill_steps"] == before
    _free(llm)


def test_engine_core_rows_survive_msgpack(llm, tmp_path):
    """The server core's output rows carry logprobs that rebuild the same {id: Logprob} as generate."""
    zmq = pytest.importorskip("zmq")
    msgpack = pytest.importorskip("msgpack")

    from jaxinfer.server.core import EngineCore
    sp = SamplingParams(max_tokens=4, logprobs=2, prompt_logprobs=1, ignore_eos=True, seed=4)
    want = llm.generate(PROMPTS[:1], sp, use_tqdm=False)[0]
    core = EngineCore(llm.engine, f"ipc://{tmp_path}/in", [f"ipc://{tmp_path}/out0"], os.getppid())
    sink = core.ctx.socket(zmq.PULL)
    sink.connect(f"ipc://{tmp_path}/out0")
    time.sleep(0.2)                   # the PUSH socket drops what it sends before the peer is connected
    try:
        core._command(["add", 7, PROMPTS[0], {"max_tokens": 4, "logprobs": 2, "prompt_logprobs": 1, "ignore_eos": True,
                                             "seed": 4}])
        rows = []
        while llm.engine.has_unfinished():
            core._send_outputs(llm.engine.step())
        core._command(["add", 8, PROMPTS[0], {"max_tokens": 4, "n": 2}])            # n > 1: refused (API expands)
        while sink.poll(200):
            rows += msgpack.unpackb(sink.recv())[1]
    finally:
        sink.close(linger=0)
        core.inbox.close(linger=0)
        for s in core.outs:
            s.close(linger=0)
        core.ctx.term()
    refused = [r for r in rows if r[0] == 8]
    assert refused[0][2] == "rejected" and "n=2" in refused[0][3]
    mine = [r for r in rows if r[0] == 7]
    ids = [t for r in mine for t in r[1]]
    lps = [logprob_dict(row, t, 2) for r in mine for row, t in zip(r[4]["logprobs"], r[1])]
    assert ids == want.token_ids
    assert [{t: e.logprob for t, e in d.items()} for d in lps] == \
        [{t: e.logprob for t, e in d.items()} for d in want.outputs[0].logprobs]
    plp = mine[0][4]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(PROMPTS[0])
    assert all("prompt_logprobs" not in r[4] for r in mine[1:])
    _free(llm)


def test_logprobs_list_reads_like_a_list():
    """Rows [logprob, rank, top ids x W, top logprobs x W] -> {id: Logprob}: the token itself + the top n."""
    rows = [None, [-0.5, 1, 3, 4, -0.5, -1.0], [-3.0, 5, 3, 4, -0.2, -1.5]]
    lst = LogprobsList(rows, [7, 3, 9], 2, decode=str)
    assert len(lst) == 3 and lst[0] is None
    assert lst[1] == {3: Logprob(-0.5, 1, "3"), 4: Logprob(-1.0, 2, "4")}                # in the top n: n entries
    assert lst[-1] == {9: Logprob(-3.0, 5, "9"), 3: Logprob(-0.2, 1, "3"), 4: Logprob(-1.5, 2, "4")}   # n + 1
    assert lst[1:] == [lst[1], lst[2]] and lst == [None, lst[1], lst[2]] and [None] + list(lst[1:]) == list(lst)
    assert LogprobsList(rows, [7, 3, 9], 1)[2] == {9: Logprob(-3.0, 5), 3: Logprob(-0.2, 1)}
    with pytest.raises(IndexError):
        lst[3]


def test_outputs_as_dicts_are_json(llm):
    """`dataclasses.asdict(output)` gives vLLM's nested dicts (its Logprob dataclasses as dicts), which json.dumps
    writes; the logprobs are made when first read (a run that never reads them makes none), plain lists after."""
    import dataclasses
    import json
    o = llm.generate([[5, 7, 9]], SamplingParams(max_tokens=3, logprobs=2, prompt_logprobs=1), use_tqdm=False)[0]
    assert type(o.outputs[0].__dict__["_logprobs"]) is LogprobsList        # (not made yet)
    d = json.loads(json.dumps(dataclasses.asdict(o)))
    assert d["prompt_logprobs"][0] is None and len(d["outputs"][0]["logprobs"]) == 3
    first = d["outputs"][0]["logprobs"][0]
    t = str(o.outputs[0].token_ids[0])
    assert first[t]["logprob"] == pytest.approx(o.outputs[0].logprobs[0][int(t)].logprob)
    assert type(o.outputs[0].logprobs) is list and type(o.prompt_logprobs) is list


def test_a_vocabulary_smaller_than_the_logprob_width(tmp_path):
    """A 7-token vocabulary: logprobs=6 gives 6 entries (the step's top-n width, 20, is cut to the vocabulary
    instead of failing inside it), logprobs=20 or -1 all 7, whose probabilities add up to 1; prompt logprobs too."""
    from helpers import make_tiny_model
    path = make_tiny_model(str(tmp_path / "v7"), vocab_size=7, num_hidden_layers=1, intermediate_size=32)
    llm = LLM(path, **TINY_ENGINE)
    for n, want in ((6, 6), (20, 7), (-1, 7)):                     # (logprobs=-1: all of it, vLLM's)
        o = llm.generate([[0, 1, 3]], SamplingParams(temperature=0, max_tokens=2, logprobs=n, prompt_logprobs=n),
                         use_tqdm=False)[0]
        for entries in [*o.outputs[0].logprobs, *o.prompt_logprobs[1:]]:
            assert len(entries) in (want, want + 1)               # (+1: the token itself, when not in the top n)
        if want == 7:
            assert abs(sum(np.exp(lp.logprob) for lp in o.outputs[0].logprobs[0].values()) - 1) < 1e-5
    _free(llm)
    from jaxinfer.engine.extras import warmup_keys                  # warm-up for logprobs=-1: the vocabulary's width
    e = llm.engine
    assert warmup_keys(e.config, e.runner.widths, e.extras, SamplingParams(prompt_logprobs=-1))[0][-1].top_n == 20
    with pytest.raises(ValueError, match="logprobs=8 is more than max_logprobs=7"):     # (-1: the vocabulary)
        LLM(path, **TINY_ENGINE, max_logprobs=-1).generate([[0, 1]], SamplingParams(logprobs=8), use_tqdm=False)


def test_a_cpu_engine_holds_few_extras_variants(tiny_dir, monkeypatch):
    """On a CPU an engine keeps only the extras variants it used last (each holds ~250 memory mappings; a process
    sending ever new mixes ran out of them): an evicted variant is compiled again and gives the same tokens."""
    from jaxinfer.engine import extras
    monkeypatch.setattr(extras, "CPU_VARIANTS", 2)
    llm = LLM(tiny_dir, **TINY_ENGINE)
    mixes = [dict(logprobs=1), dict(presence_penalty=0.5), dict(logprobs=1, min_tokens=2), dict(logprobs=1)]
    outs = [llm.generate([[5, 6, 7]], SamplingParams(temperature=0.8, seed=1, max_tokens=4, **kw), use_tqdm=False)
            for kw in mixes]
    assert len(llm.engine.extras.compiled) == 2                    # (three variants used: the oldest went)
    assert outs[3][0].outputs[0].token_ids == outs[0][0].outputs[0].token_ids       # (compiled again: the same)
    _free(llm)


def test_max_logprobs_is_the_engines_bound(tiny_dir, llm, ref):
    """vLLM's LLM(max_logprobs=...) (default 20): SamplingParams take any logprobs >= -1, the engine refuses more
    than its bound by name, before anything runs (the engine stays usable); a raised bound gives that many,
    against transformers."""
    sp = SamplingParams(temperature=0, max_tokens=3, logprobs=21)                 # (built: the engine decides)
    with pytest.raises(ValueError, match="logprobs=21 is more than max_logprobs=20"):
        llm.generate(PROMPTS[:1], sp, use_tqdm=False)
    with pytest.raises(ValueError, match=r"logprobs=-1 \(the vocabulary, \d+\) is more than max_logprobs=20"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1, logprobs=-1), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs=30 is more than max_logprobs=20"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1, prompt_logprobs=30), use_tqdm=False)
    _free(llm)
    assert LLM(tiny_dir, **TINY_ENGINE, max_logprobs=None).config.max_logprobs == 20       # (None: the default)
    for bad in (-2, True, 1.5):
        with pytest.raises(ValueError, match="max_logprobs="):
            LLM(tiny_dir, **TINY_ENGINE, max_logprobs=bad)
    wide = LLM(tiny_dir, **TINY_ENGINE, max_logprobs=40)
    o = wide.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3, logprobs=33, prompt_logprobs=25),
                      use_tqdm=False)[0]
    lp = ref(PROMPTS[0] + list(o.outputs[0].token_ids))
    n = len(PROMPTS[0])
    for i, (t, entries) in enumerate(zip(o.outputs[0].token_ids, o.outputs[0].logprobs)):
        _check_entries(entries, lp[n - 1 + i], t, 33)
    for i in range(1, n):
        _check_entries(o.prompt_logprobs[i], lp[i - 1], PROMPTS[0][i], 25)
    with pytest.raises(ValueError, match="logprobs=41 is more than max_logprobs=40"):
        wide.generate(PROMPTS[:1], SamplingParams(max_tokens=2, logprobs=41), use_tqdm=False)
    from jaxinfer import BeamSearchParams
    assert len(wide.beam_search([PROMPTS[1]], BeamSearchParams(beam_width=15, max_tokens=2))[0].sequences) == 15
    _free(wide)
