"""vLLM's structured outputs of the json, regex and json_object kinds (grammar.py, on outlines-core): greedy decoding
equals transformers' greedy loop over the ids a brute force allows (each id whose text keeps the output a prefix of
a match, by the `regex` module's partial matching; EOS once it is a whole match), in a batch with other kinds of rows
and alone; sampled outputs always match; a preempted row resumes its place; bad values are refused by name."""
import json
import threading
import time

import numpy as np
import pytest
import regex
from helpers import TINY_ENGINE, hf_greedy_edited, hf_model

from jaxinfer import LLM, SamplingParams, grammar
from jaxinfer.sampling_params import StructuredOutputsParams

PROMPTS = [[5, 7, 9, 11, 300, 2, 3, 17, 40, 41, 8], [100, 200, 300, 100, 200]]
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "the blue"]}, "n": {"type": "integer"},
                                           "ok": {"type": "boolean"}}, "required": ["color", "n", "ok"]}
REGEX = r"(cat|dog)s? [0-9]{1,3}(\.[0-9])?!"


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, **TINY_ENGINE)


def brute_allowed(tok, V, pattern, text, eos) -> list[int]:
    """Every id whose text, decoded alone, keeps `text` a prefix of a match of `pattern` (EOS ids once it matches)."""
    out = [e for e in eos if regex.fullmatch(pattern, text)]
    for i in range(min(V, len(tok))):
        t = tok.decode([i], skip_special_tokens=False)
        if t and "\ufffd" not in t and i not in tok.all_special_ids and regex.fullmatch(pattern, text + t,
                                                                                         partial=True):
            out.append(i)
    return sorted(out)


def test_greedy_matches_the_masked_reference(llm, tiny_dir):
    """Greedy under a JSON schema and a regex, beside a plain row, a choice row and a penalty row in one batch, and
    alone, equals transformers' greedy loop over the brute force's ids; finished outputs match (the JSON parses)."""
    model, tok, V, eos = hf_model(tiny_dir), llm.get_tokenizer(), llm.model_config.vocab_size, [2]
    pattern = grammar.regex_for(StructuredOutputsParams(json=SCHEMA))

    def greedy(prompt, pat, n=40):
        def masked(row, out):
            mask = np.full_like(row, -np.inf)
            ok = brute_allowed(tok, V, pat, tok.decode(out, skip_special_tokens=False), eos)
            mask[ok] = row[ok]
            return mask
        return hf_greedy_edited(model, prompt, n, masked, stop=eos)
    sps = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
           SamplingParams(temperature=0, max_tokens=40, structured_outputs={"regex": REGEX}),
           SamplingParams(temperature=0, max_tokens=12),
           SamplingParams(temperature=0, max_tokens=12, structured_outputs={"choice": ["yes", "no"]}),
           SamplingParams(temperature=0, max_tokens=40, guided_decoding={"json": json.dumps(SCHEMA)},
                          repetition_penalty=1.3)]
    outs = llm.generate([PROMPTS[0]] * len(sps), sps, use_tqdm=False)
    for out, pat in zip(outs[:2], (pattern, REGEX)):
        c = out.outputs[0]
        assert c.token_ids == greedy(PROMPTS[0], pat), pat
        assert c.finish_reason == "length" or regex.fullmatch(pat, c.text), c.text
    parsed = json.loads(outs[0].outputs[0].text)
    assert set(parsed) == {"color", "n", "ok"} and parsed["color"] in ("red", "green", "the blue")
    assert outs[3].outputs[0].text in ("yes", "no")
    assert json.loads(outs[4].outputs[0].text)["color"] in ("red", "green", "the blue")
    [alone] = llm.generate(PROMPTS[1], sps[1], use_tqdm=False)
    assert alone.outputs[0].token_ids == greedy(PROMPTS[1], REGEX)
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_sampled_outputs_match(llm, monkeypatch):
    """Seeded samples at temperature 1.5 (n = 4, streamed too) always match; the same seed repeats them; json_object
    gives a JSON object; with ignore_eos a finished match is followed by EOS only. The steps stay pipelined: a step's
    masks are written with the tokens of the step in flight, read as it ends (extras.in_flight_tokens)."""
    from jaxinfer.engine import extras
    real, peeks = extras.in_flight_tokens, []
    monkeypatch.setattr(extras, "in_flight_tokens", lambda f: peeks.append(1) or real(f))
    sp = SamplingParams(temperature=1.5, seed=3, n=4, max_tokens=30, structured_outputs={"regex": REGEX})
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    assert len(peeks) > 5
    texts = [c.text for o in outs for c in o.outputs]
    assert all(regex.fullmatch(REGEX, t) for t in texts) and len(set(texts)) > 1, texts
    assert [c.text for o in llm.generate(PROMPTS, sp, use_tqdm=False) for c in o.outputs] == texts
    streamed = {}
    for d in llm.stream(PROMPTS[:1], sp):
        streamed[d.outputs[0].index] = streamed.get(d.outputs[0].index, "") + d.outputs[0].text
    assert [streamed[i] for i in range(4)] == texts[:4]
    sp = SamplingParams(temperature=1.0, seed=1, max_tokens=60, structured_outputs={"json_object": True})
    for o in llm.generate(PROMPTS, sp, use_tqdm=False):
        if o.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(o.outputs[0].text), dict)
    [held] = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=1, max_tokens=30, ignore_eos=True,
                                                     structured_outputs={"regex": "ab?"}), use_tqdm=False)
    ids, tok = held.outputs[0].token_ids, llm.get_tokenizer()
    end = ids.index(2)
    assert regex.fullmatch("ab?", tok.decode(ids[:end])) and len(ids) == 30 and set(ids[end:]) == {2}
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_preempted_rows_resume(tiny_dir):
    """With a pool too small for all rows, preempted json rows are recomputed and give the tokens of a roomy run."""
    sp = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json": SCHEMA})
    prompts = [[i + 3, 7, 9, 11, 300, 2, 3, 17] for i in range(6)]
    roomy = [o.outputs[0].token_ids for o in LLM(tiny_dir, **TINY_ENGINE).generate(prompts, sp, use_tqdm=False)]
    small = LLM(tiny_dir, **{**TINY_ENGINE, "num_kvcache_blocks": 40})
    assert [o.outputs[0].token_ids for o in small.generate(prompts, sp, use_tqdm=False)] == roomy
    assert small.stats()["preemptions"] > 0
    assert small.stats()["kv_blocks_free"] == small.stats()["kv_blocks_total"]


def test_a_row_that_survives_an_interrupt_after_its_mask_resumes_in_place(llm, monkeypatch):
    """A KeyboardInterrupt once a step's masks were written with the token of the step in flight: the engine API's
    requests go on, recomputed (that token is dropped, then drawn again), and their guides replay the output read
    so far: the output is the uninterrupted one."""
    from jaxinfer.engine import extras
    sp = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"regex": REGEX})
    want = llm.generate(PROMPTS[0], sp, use_tqdm=False)[0].outputs[0].token_ids
    real, calls = extras.pack_extras, []

    def interrupted(*args, **kw):
        out = real(*args, **kw)
        calls.append(1)
        if len(calls) == 3:                     # (a decode step's: its mask went past the token in flight)
            raise KeyboardInterrupt
        return out
    monkeypatch.setattr(extras, "pack_extras", interrupted)
    api, final = llm.llm_engine, None
    api.add_request("r", PROMPTS[0], sp)
    while api.has_unfinished_requests():
        try:
            final = next((o for o in api.step() if o.finished), final)
        except KeyboardInterrupt:
            pass
    assert len(calls) > 3 and final.outputs[0].token_ids == want, final.outputs[0].text
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


@pytest.mark.parametrize("through", ["llm_engine", "engine"])
def test_an_interrupt_between_a_steps_model_part_and_its_draw(llm, monkeypatch, through):
    """A decode step with json / regex rows runs its model part, then writes the masks (reading the step in flight)
    and draws (ExtrasRunner split): a KeyboardInterrupt while the masks are written leaves a model part without its
    draw. The requests (a regex row with penalties and logprobs, a plain one whose frequency penalty would count the
    step's input tokens twice if the model part ran again as it was) go on, through the engine API (which recomputes
    them) and through the engine itself (ExtrasRunner.lost_buffers), with the uninterrupted outputs (and logprobs);
    every KV block comes back."""
    sps = [SamplingParams(temperature=0, max_tokens=30, structured_outputs={"regex": REGEX}, logprobs=2,
                          presence_penalty=0.5),
           SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, frequency_penalty=0.3)]
    want = llm.generate([PROMPTS[0], PROMPTS[1]], sps, use_tqdm=False)
    api, eng, final = llm.llm_engine, llm.engine, {}

    def counted(seqs):                  # each row's output tokens counted for its penalties, in all
        outs = np.asarray(eng.extras.counts[1])
        return [int(outs[eng.extras.slot_of[s.seq_id]].sum()) for s in seqs]
    seqs = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, sps)]
    while eng.has_unfinished():
        eng.step()
    want_counts = counted(seqs)
    real, calls = grammar.GrammarState.write, []

    def interrupted(self, *args, **kw):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(self, *args, **kw)
    monkeypatch.setattr(grammar.GrammarState, "write", interrupted)
    seqs = [api.add_request(f"x{i}", p, sp) if through == "llm_engine" else eng.add_request(p, sp)
            for i, (p, sp) in enumerate(zip(PROMPTS, sps))]
    while api.has_unfinished_requests() if through == "llm_engine" else eng.has_unfinished():
        try:
            if through == "llm_engine":
                final.update({o.request_id: o for o in api.step() if o.finished})
            else:
                eng.step()
        except KeyboardInterrupt:
            pass
    assert len(calls) > 4 and llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]
    for i, w in enumerate(want):
        if through == "engine":
            assert seqs[i].token_ids[seqs[i].num_prompt_tokens:] == w.outputs[0].token_ids, i
            assert counted(seqs) == want_counts         # (not twice for the step whose draw was interrupted)
            continue
        got = final[f"x{i}"].outputs[0]
        assert got.token_ids == w.outputs[0].token_ids, i
        if i == 0:
            assert [list(d) for d in got.logprobs] == [list(d) for d in w.outputs[0].logprobs]


def test_masks_kept_by_state_equal_fresh_ones(llm, monkeypatch):
    """A row at a state seen before gets the mask kept for it (MASK_CACHE): along random allowed paths of the schema
    (EOS among them: ended rows), every mask equals the one outlines-core writes with nothing kept, hits happen, and
    an index keeps at most MASK_CACHE masks."""
    tok, V = llm.get_tokenizer(), llm.model_config.vocab_size
    rule = grammar.GrammarRule(grammar.regex_for(StructuredOutputsParams(json=SCHEMA)), tok, V, [2])
    class Kept(dict):                         # counts the masks written into the index's keep
        writes = 0

        def __setitem__(self, key, value):
            Kept.writes += 1
            super().__setitem__(key, value)
    rng, words = np.random.default_rng(0), -(-V // 32)
    monkeypatch.setattr(rule.build, "masks", Kept())
    for walk in range(6):        # two walks along the same path (the lowest allowed id), then random ones
        monkeypatch.setattr(grammar, "MASK_CACHE", 64 if walk < 2 else 8)
        if walk == 2:
            rule.build.masks.clear()
        kept, fresh, out, Kept.writes = rule.start(), rule.start(), [], 0
        for _ in range(30):
            a, b = np.zeros(words, np.int32), np.zeros(words, np.int32)
            kept.write(a, out, 0, 0)
            with monkeypatch.context() as m:
                m.setattr(grammar, "MASK_CACHE", 0)
                m.setattr(rule.build, "masks", {})
                fresh.write(b, out, 0, 0)
            assert (a == b).all() and len(rule.build.masks) <= grammar.MASK_CACHE
            allowed = np.flatnonzero(np.unpackbits(a.view(np.uint8), bitorder="little")[:V])
            out.append(int(allowed[0] if walk < 2 else rng.choice(allowed)))
        assert Kept.writes > 0 if walk != 1 else Kept.writes == 0, (walk, Kept.writes)


def test_slow_index_builds_are_refused(llm, monkeypatch):
    """An index that takes longer than BUILD_TIMEOUT_S to build is refused (and refused again at once), naming it;
    the engine stays usable."""
    monkeypatch.setattr(grammar, "BUILD_TIMEOUT_S", 0.0)
    sp = SamplingParams(max_tokens=4, structured_outputs={"json": {"type": "string", "maxLength": 12}})  # (~0.2 s)
    for _ in range(2):
        with pytest.raises(ValueError, match=r"structured_outputs regex '.*\{0,12\}.*' takes over 0 s to index"):
            llm.generate(PROMPTS[0], sp, use_tqdm=False)
    assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_a_build_past_its_limit_is_stopped(llm, monkeypatch):
    """A build past BUILD_TIMEOUT_S is killed with its worker process (index_worker.py), so its slot (one here) and
    its memory come back at once: the next new index builds now (`.{20000}` takes minutes and gigabytes; a build in
    a thread, which cannot be stopped, held its slot all that time)."""
    monkeypatch.setattr(grammar, "BUILD_TIMEOUT_S", 2.0)
    monkeypatch.setattr(grammar, "BUILD_SLOTS", threading.BoundedSemaphore(1))
    t = time.monotonic()
    with pytest.raises(ValueError, match=r"regex '\.\{20000\}' takes over 2 s to index"):
        llm.generate(PROMPTS[0], SamplingParams(structured_outputs={"regex": ".{20000}"}), use_tqdm=False)
    [out] = llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, structured_outputs={"regex": "[a-c]{3}!"}),
                         use_tqdm=False)
    assert regex.fullmatch("[a-c]{3}!", out.outputs[0].text) and time.monotonic() - t < 20


def test_a_dead_idle_worker_is_replaced(llm):
    """An idle index worker that died (killed by hand, or by the OOM killer) is replaced, not handed the next build."""
    from jaxinfer import index_worker
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, structured_outputs={"regex": "[d-f]{2}"}), use_tqdm=False)
    assert index_worker._IDLE
    for proc in index_worker._IDLE:
        proc.kill()
        proc.wait()
    [out] = llm.generate(PROMPTS[0], SamplingParams(max_tokens=6, structured_outputs={"regex": "[g-i]{2}!"}),
                         use_tqdm=False)
    assert regex.fullmatch("[g-i]{2}!", out.outputs[0].text)


def test_a_worker_that_died_mid_build_is_built_again(llm, monkeypatch):
    """A build whose worker died (the OOM killer, say) refuses its request but is not kept: the next one builds."""
    from jaxinfer import index_worker
    real, calls = index_worker.build, []

    def dies_once(*args):
        calls.append(args)
        if len(calls) == 1:
            raise index_worker.WorkerDied("the index builder process died (EOFError; exit code -9)")
        return real(*args)
    monkeypatch.setattr(index_worker, "build", dies_once)
    sp = SamplingParams(max_tokens=6, structured_outputs={"regex": "[j-l]{2}!"})
    with pytest.raises(ValueError, match="process died"):
        llm.generate(PROMPTS[0], sp, use_tqdm=False)
    assert regex.fullmatch("[j-l]{2}!", llm.generate(PROMPTS[0], sp, use_tqdm=False)[0].outputs[0].text)


def test_a_build_that_ran_out_of_time_is_tried_again_later(llm, monkeypatch):
    """A build that ran out of time (how long it takes depends on how busy the machine is) is refused again at once
    for TIMED_OUT_RETRY_S, then a new request builds it again."""
    from jaxinfer import index_worker
    real, calls = index_worker.build, []

    def slow_once(*args):
        calls.append(args)
        return None if len(calls) == 1 else real(*args)       # (None: not done within its limit)
    monkeypatch.setattr(index_worker, "build", slow_once)
    monkeypatch.setattr(grammar, "TIMED_OUT_RETRY_S", 1.0)
    sp = SamplingParams(max_tokens=6, structured_outputs={"regex": "[m-o]{2}!"})
    for _ in range(2):
        with pytest.raises(ValueError, match="takes over"):
            llm.generate(PROMPTS[0], sp, use_tqdm=False)
    assert len(calls) == 1
    time.sleep(1.1)
    assert regex.fullmatch("[m-o]{2}!", llm.generate(PROMPTS[0], sp, use_tqdm=False)[0].outputs[0].text)
    assert len(calls) == 2


def test_no_build_outlives_its_process(tmp_path):
    """A worker building when the process it builds for dies (killed, Ctrl-C) exits too: it sees its stdin end."""
    import os
    import signal
    import subprocess
    import sys
    script = ("import outlines_core as oc; from jaxinfer import index_worker\n"
              "index_worker.build('.{20000}', oc.Vocabulary(9, {b'a': [1], b'b': [2]}), None)\n")
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        for _ in range(300):
            kids = open(f"/proc/{parent.pid}/task/{parent.pid}/children").read().split()
            if kids:
                break
            time.sleep(0.05)
        worker = int(kids[0])
        time.sleep(0.5)                               # (building)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        for _ in range(100):
            try:
                if open(f"/proc/{worker}/stat").read().split()[2] == "Z":
                    break
            except FileNotFoundError:
                break
            time.sleep(0.05)
        else:
            os.kill(worker, signal.SIGKILL)
            raise AssertionError("the index worker outlived its process")
    finally:
        if parent.poll() is None:
            parent.kill()


def test_anchors_and_byte_choices(llm):
    """A regex's leading ^ and trailing $ are dropped (the whole output matches anyway; xgrammar's rule), an escaped
    last $ kept; choices split over byte tokens take the regex path."""
    for pattern, full in (("^[0-9]{2}$", "[0-9]{2}"), ("^(yes|no)", "(yes|no)"), (r"a\$$", r"a\$")):
        sp = SamplingParams(temperature=1.0, seed=3, max_tokens=8, structured_outputs={"regex": pattern})
        assert regex.fullmatch(full, llm.generate(PROMPTS[1], sp, use_tqdm=False)[0].outputs[0].text), pattern
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=20, n=3, structured_outputs={"choice": ["\U0001f44d",
                                                                                                   "\u65e5\u672c"]})
    assert {c.text for c in llm.generate(PROMPTS[1], sp, use_tqdm=False)[0].outputs} <= {"\U0001f44d", "\u65e5\u672c"}


def test_background_index_builds(llm, monkeypatch):
    """With grammar_wait False (the server's engine core), a new index is built beside the steps, with no time limit
    (the API process applied it): a running plain request keeps decoding meanwhile and one queued behind is admitted
    and finishes, the constrained one is admitted once its index is ready and its answer matches; an engine with
    only such a request waits without error."""
    eng, tok = llm.engine, llm.get_tokenizer()
    schema = {"type": "string", "maxLength": 10}
    monkeypatch.setattr(grammar, "BUILD_TIMEOUT_S", 0.0)        # (past it at once: a background build ignores it)
    eng.grammar_wait = False
    monkeypatch.setattr(grammar, "IN_ENGINE_CORE", True)        # (the core's limit, BACKGROUND_TIMEOUT_S)
    try:
        plain = eng.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
        eng.step()
        seq = eng.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=40, structured_outputs={
            "json": schema}))
        build, built = seq.grammar.rule.build, threading.Event()     # (held "building" until the test lets it go)
        seq.grammar.rule.build = type("Held", (), {"result": lambda self, deadline=True: build.result(
            deadline) if built.is_set() else None, "masks": {}})()
        behind = eng.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        assert not seq.grammar.ready() and llm.stats()["waiting"] == 2
        for _ in range(200):
            if behind.finish_reason is not None:
                break
            eng.step()
        assert behind.finish_reason == "length" and not seq.grammar.ready()    # (not held up behind it)
        assert len(plain.token_ids) - plain.num_prompt_tokens > 1       # (it decoded while the index was built)
        build.thread.join()
        built.set()
        while eng.has_unfinished():
            eng.step()
        text = tok.decode(seq.token_ids[seq.num_prompt_tokens:], skip_special_tokens=True)
        assert seq.finish_reason == "length" or regex.fullmatch(grammar.regex_for(StructuredOutputsParams(
            json=schema)), text), text
        alone = eng.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, structured_outputs={
            "regex": "[a-z]{1,6}[0-9]{0,2}x"}))
        while eng.has_unfinished():
            eng.step()
        assert regex.fullmatch("[a-z]{1,6}[0-9]{0,2}x", tok.decode(alone.token_ids[alone.num_prompt_tokens:], True))
    finally:
        eng.grammar_wait = True
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_index_builds_share_a_few_slots(monkeypatch):
    """At most BUILD_SLOTS' worth of index builds run at once (each takes a core); the others wait their turn and
    then build."""
    monkeypatch.setattr(grammar, "BUILD_SLOTS", threading.BoundedSemaphore(2))
    gate, lock, running, most = threading.Event(), threading.Lock(), [0], [0]

    def index(regex, vocab, limit):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        gate.wait(30)
        with lock:
            running[0] -= 1
        return [regex]                                # (an index: not a string, which would be an error)
    builds = [grammar._Build(f"r{i}", None, None, make=index) for i in range(5)]
    for _ in range(100):
        if running[0] == 2:
            break
        threading.Event().wait(0.01)
    threading.Event().wait(0.1)
    assert running[0] == 2 and all(b.result(False) is None for b in builds)
    gate.set()
    for b in builds:
        b.thread.join(10)
    assert most[0] == 2 and [b.result(False) for b in builds] == [[f"r{i}"] for i in range(5)]


def test_refusals(llm):
    for kw, match in ((dict(structured_outputs={"grammar": "root ::= 'a'"}), "grammar is not supported"),
                      (dict(structured_outputs={"regex": "a", "json": {}}), "needs one kind"),
                      (dict(structured_outputs={"regex": 5}), "regex must be a string"),
                      (dict(structured_outputs={"json": 5}), "json must be a JSON schema"),
                      (dict(structured_outputs={"json_object": "yes"}), "json_object must be True"),
                      (dict(structured_outputs={"regex": "a"}, min_tokens=3), "min_tokens"),
                      (dict(structured_outputs={"json": {"type": "object", "properties": {"n": {"anyOf": [
                          {"type": "integer", "maximum": 9}]}}}}), "keyword 'maximum' at #/properties/n/anyOf/0"),
                      (dict(structured_outputs={"json": {"type": "object", "required": ["a"]}}), "'required' at #"),
                      (dict(structured_outputs={"json": {"type": "string", "pattern": "a+", "maxLength": 3}}),
                       "'maxLength beside pattern' at #"),
                      (dict(structured_outputs={"json": {"allOf": [{"type": "object"}, {"type": "object"}]}}),
                       "'allOf of more than one schema'"),
                      (dict(structured_outputs={"json": {"type": "object", "dependencies": {"a": ["b"]}}}),
                       "'dependencies'"),
                      (dict(structured_outputs={"json": {"type": "integer", "not": {"enum": [1, 2]}}}), "'not' at #"),
                      (dict(structured_outputs={"json": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                         "required": ["b"]}}), "required 'b' \\(not in properties"),
                      (dict(structured_outputs={"json": {"type": "array", "minItems": 3, "maxItems": 1}}),
                       "minItems=3 above maxItems=1: no value"),
                      (dict(structured_outputs={"json": {"type": "object", "properties": {"a": {
                          "type": "string", "minLength": 5, "maxLength": 2}}}}), "minLength=5 above maxLength=2")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kw)
    for so, match in (({"json": "{not json"}, "structured_outputs=.* json is not valid JSON"),
                      ({"regex": "a("}, "structured_outputs regex 'a\\(' cannot be followed"),
                      ({"json": {"type": "object", "properties": {"a": {"type": "bogus"}}}},
                       "structured_outputs=.* json schema is not supported")):
        with pytest.raises(ValueError, match=match):
            llm.generate(PROMPTS[0], SamplingParams(structured_outputs=so), use_tqdm=False)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        grammar.GrammarRule("a", None, 10, [2])
    assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


@pytest.mark.parametrize("string", [{"pattern": "^.{2,8}$"}, {"pattern": r"^[^@]+@\S+$"}, {"pattern": r'^a"\d\\'},
                                    {"pattern": r"^\x22\u005c\x0a?$"}, {"pattern": r'^["\\a-c]{3,8}$'},
                                    {"format": "date"}, {"format": "date-time"}, {"format": "time"},
                                    {"format": "email"}, {"format": "uri"}, {"format": "uuid"}])
def test_string_patterns_and_formats_give_json(llm, string):
    """A schema string's pattern or format holds only what JSON text may (outlines-core wrote `.` or `\\S` between the
    quotes as they are: a raw quote, backslash or control character, or a date in other scripts' digits): every
    finished sample parses, and its value matches the pattern (re.search, as JSON Schema) or is of its format."""
    import datetime
    import re
    import uuid
    tok = llm.get_tokenizer()
    bias = {tok.encode(c, add_special_tokens=False)[-1]: 3.0 for c in '"}@'} | {2: 30.0}     # (to end sooner)
    sp = SamplingParams(temperature=1.0, seed=0, n=8, max_tokens=64, logit_bias=bias,
                        structured_outputs={"json": {"type": "object", "properties": {"v": {"type": "string", **string}},
                                                     "required": ["v"]}})
    done = 0
    for c in llm.generate(["Hello"], sp, use_tqdm=False)[0].outputs:
        if c.finish_reason != "stop":
            continue
        done += 1
        v = json.loads(c.text)["v"]
        fmt = string.get("format")
        if fmt in ("date", "date-time", "time"):
            parse = {"date": datetime.date.fromisoformat, "date-time": datetime.datetime.fromisoformat,
                     "time": datetime.time.fromisoformat}[fmt]
            assert v.isascii() and parse(v) and (fmt == "date" or v.endswith("Z") or v[-6] in "+-"), v
        elif fmt == "uuid":
            assert str(uuid.UUID(v)) == v
        elif fmt:
            assert v.isascii() and v.isprintable() and ('@' in v if fmt == "email" else "://" in v), v
        else:
            assert re.search(string["pattern"], v), (string, v)
    assert done or string.get("format") in ("email", "uri")      # (random weights: these run past max_tokens)
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


@pytest.mark.parametrize("key", ['a"b', "a\\b", "a\nb", "tab\there", "caf\u00e9", "x|y"])
def test_property_names_are_written_as_json(llm, key):
    """A property name with a quote, backslash or control character is written escaped (outlines-core wrote it
    between the quotes as it is: text that did not parse, or another key): greedy output parses with that key."""
    schema = {"type": "object", "properties": {key: {"type": "boolean"}, "n": {"type": "integer"}},
              "required": [key]}
    out = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json": schema}),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and key in json.loads(out.text), (key, out.text)


def test_json_text_patterns():
    """json_strings.json_text: the JSON text of any value the pattern matches, only where JSON may hold it as it
    is; a regex kind's \\d is ASCII (xgrammar's reading), a pattern beside a known format refused."""
    from jaxinfer.json_strings import ascii_digits, json_text, json_text_schema, without_anchors
    for pattern, texts, not_texts in ((".{2}", ["ab", "\u00e9\u00e9"], ['a"', "a\\", "a\n"]),
                                      (r"a\"b\\c\nd", ['a\\"b\\\\c\\nd'], ['a"b\\c\nd']),
                                      (r"[^@]\S\d[\d.]\s", ["xy1. ", "xy1.\\t"], ["xy\u0661. ", '"y1. ', "x\\1. "]),
                                      (r"\p{L}[a-z\"]", ["\u00e9a"], ['\u00e9"']),
                                      (r"\x22\u005c\x{0a}\U00000001\x41" + "\t", ['\\"\\\\\\n\\u0001A\\t'],
                                       ['"\\\nA\t', '\\"\\\\\\n\x01A\\t']),
                                      # (? / {2}: whole escapes)
                                      ('a"?\\n{2}', ["a\\n\\n", 'a\\"\\n\\n'], ["a\\\\n\\n", "a\\n\\"]),
                                      (r'[ -~\n]+', ['a\\"b\\\\c\\n'], ['a"', "a\\", "a\n"]),   # (a class: its escapes)
                                      (r"[^@]\S.", ['\\"\\\\\\t', "\\nab"], ["a b", "ab\\n", "@ab"])):
        r = regex.compile(json_text(pattern), flags=regex.V1)
        assert all(r.fullmatch(t) for t in texts), (pattern, json_text(pattern))
        assert not any(r.fullmatch(t) for t in not_texts), (pattern, json_text(pattern))
    assert ascii_digits(r"^\d[\d.][^\d]\\d$") == r"^[0-9][0-9.][^\d]\\d$"
    assert ascii_digits(r"\]\]\d[a") == r"\]\]\d[a"            # (an unclosed class: outlines-core names it)
    assert without_anchors("^a$") == without_anchors("a") == "a" and without_anchors(r"^a\$") == r"a\$"
    for bad, frag in ((r"\p{L", "unclosed '\\p{'"), ("a[b", "unclosed '['"), (r"a\x4", r"bad escape '\\x4'"),
                      (r"\u{110000}", "bad escape")):
        with pytest.raises(ValueError, match=regex.escape(frag)):
            json_text(bad)
    with pytest.raises(ValueError, match="pattern beside format 'date'"):
        json_text_schema({"type": "string", "format": "date", "pattern": "x"})
    assert json_text_schema({"enum": ["."], "properties": {"pattern": {"type": "string", "pattern": "."}}}) == \
        {"enum": ["."], "properties": {"pattern": {"type": "string", "pattern": json_text(".")}}}
