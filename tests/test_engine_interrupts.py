"""An exception (a notebook's Ctrl-C) out of the engine API's `step()` from inside the scheduler's block bookkeeping or
the output processor: its requests go on, and stepping until done gives every one a fresh LLM's outputs (ids, text,
finish reason), with every KV block back in the pool. A sequence taken from one queue before the call that raised
and not yet put in the other was lost (`while has_unfinished_requests(): step()` never ended), and an output
processor's update cut short lost its tokens from the request's output."""
import contextlib
import sys

import pytest
from helpers import TINY_ENGINE

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.llm_engine import LLMEngine

KW = {**TINY_ENGINE, "num_kvcache_blocks": 24}      # small: decode steps preempt
PROMPTS = [list(range(3, 40)), [5, 6, 7], list(range(3, 30)) + [9, 9], list(range(100, 121))]


def params(kind):
    return [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, output_kind=kind),
            SamplingParams(temperature=0.8, seed=7, max_tokens=16, n=2, ignore_eos=True, output_kind=kind),
            SamplingParams(temperature=0.9, seed=3, top_k=5, max_tokens=12, stop=["a"], output_kind=kind),
            SamplingParams(temperature=0.7, seed=11, max_tokens=10, logprobs=2, ignore_eos=True, output_kind=kind)]


def outputs(llm, tag, kind="CUMULATIVE"):
    """{(prompt, sample): (token ids, text, finish reason)} of the engine API's loop; a KeyboardInterrupt out of
    step() is caught and the loop goes on. Also checks that every block is back once it ends."""
    api, got, caught = llm.llm_engine, {}, 0
    for i, (p, sp) in enumerate(zip(PROMPTS, params(kind))):
        api.add_request(f"{tag}{i}", p, sp)
    for _ in range(300):
        if not api.has_unfinished_requests():
            break
        try:
            outs = api.step()
        except KeyboardInterrupt:
            caught += 1
            continue
        for out in outs:
            for c in out.outputs:
                key = (int(out.request_id[len(tag):]), c.index)
                ids, text, _ = got.get(key, ([], "", None)) if kind == "DELTA" else ([], "", None)
                got[key] = (ids + list(c.token_ids), text + c.text, c.finish_reason)
    else:
        raise AssertionError(f"the requests never finished: {llm.stats()}")
    st, bm = llm.stats(), llm.engine.block_manager
    assert st["kv_blocks_free"] == st["kv_blocks_total"] and all(b.ref_count == 0 for b in bm.blocks), st
    return got, caught


class Once:
    """sys.settrace: KeyboardInterrupt at the `line`-th line (1: before its first) of the first call of `function`
    for which when(frame) holds, `skip` such calls passed first."""

    def __init__(self, function, line=1, when=lambda frame: True, skip=0):
        self.function, self.line, self.when, self.skip, self.fired = function, line, when, skip, False

    def call(self, frame, event, arg):
        if self.fired or frame.f_code.co_name != self.function or not self.when(frame):
            return None
        self.skip -= 1
        if self.skip >= 0:
            return None
        lines = [0]

        def line(frame, event, arg):
            if event == "line" and not self.fired:
                lines[0] += 1
                if lines[0] == self.line:
                    self.fired = True
                    raise KeyboardInterrupt(f"{self.function}:{frame.f_lineno}")
            return line
        return line

    def __enter__(self):
        sys.settrace(self.call)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)
        assert self.fired, f"{self.function}: the interrupt did not fire"


def called_by(*names):
    return lambda frame: frame.f_back.f_code.co_name in names


@pytest.fixture(scope="module")
def want(tiny_dir):
    return {kind: outputs(LLM(tiny_dir, **KW), "w", kind)[0] for kind in ("CUMULATIVE", "DELTA")}


@pytest.mark.parametrize("caller", ["preempt", "finish"])
@pytest.mark.parametrize("line", [1, 4, 9])
def test_an_exception_in_free_seq_loses_no_sequence(tiny_dir, want, caller, line):
    """Scheduler.preempt took the sequence off `running` and freed its blocks before queuing it, Scheduler.finish
    took it off its queue and freed its blocks before marking it finished: an exception in free_seq left it in no
    queue, unfinished (line 1: at its start; 4 and 9: some of its blocks freed)."""
    llm = LLM(tiny_dir, **KW)
    with Once("free_seq", line, called_by(caller)):
        got, caught = outputs(llm, "a")
    assert caught == 1 and llm.stats()["preemptions"] > 0
    assert got == want["CUMULATIVE"]


@pytest.mark.parametrize("function, line", [("allocate", 1), ("allocate", 6), ("_cached_prefix", 1),
                                            ("_take_free", 1), ("_take_free", 3)])
def test_an_exception_while_admitting_loses_no_sequence(tiny_dir, want, function, line):
    """Scheduler._schedule_prefill took the sequence off `waiting` and allocated its blocks before listing it as
    running: an exception in allocate (or in the _cached_prefix / _take_free calls it makes) left it in no queue,
    its blocks taken. The third such call, at its start or further in."""
    llm = LLM(tiny_dir, **KW)
    when = called_by("_schedule_prefill") if function == "allocate" else called_by("allocate", "<listcomp>")
    with Once(function, line, when, skip=2):
        got, caught = outputs(llm, "a")
    assert caught == 1
    assert got == want["CUMULATIVE"]


def test_an_exception_after_preempting_a_sequence_whose_step_is_in_flight(tiny_dir, want, monkeypatch):
    """A sequence preempted while its decode step was still on the device keeps that step's placeholder until the
    step is read; an exception before that (here at launch, in the same step()) dropped the step, and recompute_all
    cleared the placeholders of running sequences only: the engine then refused every step ("found no work")."""
    llm, launch, fired = LLM(tiny_dir, **KW), LLMEngine.launch, []

    def interrupted(self, plan):
        if not fired and any(s.num_pending for s in self.scheduler.waiting):
            fired.append(1)
            raise KeyboardInterrupt("launch")
        return launch(self, plan)
    monkeypatch.setattr(LLMEngine, "launch", interrupted)
    got, caught = outputs(llm, "a")
    assert fired and caught == 1
    assert got == want["CUMULATIVE"]


@pytest.mark.parametrize("kind", ["CUMULATIVE", "DELTA"])
@pytest.mark.parametrize("line, skip", [(2, 0), (2, 4), (2, 11), (5, 7), (2, 25)])
def test_an_exception_in_the_output_processor_loses_no_output(tiny_dir, want, kind, line, skip):
    """OutputProcessor._update records the ids first (line 1: `self.token_ids += new`), then the text: cut short
    after that (line 2 or later) the request's output lost those ids, and their text (a stop string was missed).
    At the `skip`-th update that carries ids."""
    llm = LLM(tiny_dir, **KW)
    with Once("_update", line, lambda frame: bool(frame.f_locals["new"]), skip):
        got, caught = outputs(llm, "a", kind)
    assert caught == 1
    assert got == want[kind]


@pytest.mark.parametrize("kind", ["CUMULATIVE", "DELTA"])
def test_an_exception_in_the_output_processor_after_a_sample_finished_loses_no_output(tiny_dir, want, kind):
    """The outputs that step() had made before the update that raised were never returned: at the start of the
    update that comes right after a sample's last one in the same step(), the finished sample's last output was lost
    (its request was deleted, or its processor, already finished, gave nothing more)."""
    llm, last = LLM(tiny_dir, **KW), [None]

    def after_a_finish(frame):
        step, hit = llm._one_thread.steps, bool(frame.f_locals["new"]) and last[0] == llm._one_thread.steps
        last[0] = step if frame.f_locals["finish_reason"] is not None else last[0]
        return hit
    with Once("_update", 1, after_a_finish):
        got, caught = outputs(llm, "a", kind)
    assert caught == 1
    assert got == want[kind]


@pytest.mark.parametrize("kind", ["CUMULATIVE", "DELTA"])
@pytest.mark.parametrize("function", ["finish", "free_seq"])
def test_an_exception_as_a_stop_string_ends_a_request_loses_no_output(tiny_dir, want, kind, function):
    """Once its processor matched a stop string, _process_text ends the request in the engine (Scheduler.finish):
    an exception there (at finish's start, or in the free_seq it calls once the request is finished) lost the delta
    that matched. (A processor rebuilt from the request's ids must not be told the engine's finish reason "stop" of
    a stop string: it would take the last id for a stop token, hiding its text.)"""
    llm = LLM(tiny_dir, **KW)
    in_process_text = called_by("_process_text")
    when = in_process_text if function == "finish" else lambda f: called_by("finish")(f) and in_process_text(f.f_back)
    with Once(function, 1, when):
        got, caught = outputs(llm, "a", kind)
    assert caught == 1
    assert got == want[kind]


def engine_steps(llm, interrupt=None):
    """Token ids of a greedy, a seeded and a regex request stepped through `llm.engine.step()` itself (no LLM or
    engine API around it to recover); a KeyboardInterrupt out of step() is caught and stepping goes on."""
    eng, caught = llm.engine, 0
    sps = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
           SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True),
           SamplingParams(temperature=0, max_tokens=20, structured_outputs={"regex": r"(cat|dog)s? [0-9]{1,3}!"})]
    seqs = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, sps)]
    with interrupt or contextlib.nullcontext():
        for _ in range(100):
            if not eng.has_unfinished():
                break
            try:
                eng.step()
            except KeyboardInterrupt:
                caught += 1
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"] and not eng.has_unfinished(), st
    return [list(s.output_token_ids) for s in seqs], caught


@pytest.mark.parametrize("function, line, skip", [("finish_dispatch", 1, 2), ("finish_dispatch", 3, 4),
                                                  ("_apply", 1, 2), ("_apply", 2, 5), ("launch", 2, 3)])
def test_engine_step_itself_recovers_from_an_interrupt(tiny_dir, function, line, skip):
    """An interrupt after a step's device call ran but before the engine recorded it (finish_dispatch) or applied
    it (_apply) replayed the step on the wrong input ids when the loop called `engine.step()` directly: wrong tokens
    (a regex row broke its pattern) or a failed check at the next step. step() now recovers (its sequences compute
    their KV again)."""
    want, _ = engine_steps(LLM(tiny_dir, **KW))
    got, caught = engine_steps(LLM(tiny_dir, **KW), Once(function, line, skip=skip))
    assert caught == 1
    assert got == want


class FailedOnDevice:
    """Stands for a device array whose call failed while it ran (its error comes out when it is used or waited
    for), as a step's outputs are when its executable fails on the device."""
    def __init__(self, like):
        self.shape, self.dtype = like.shape, like.dtype

    def is_deleted(self):
        return False

    def block_until_ready(self):
        raise RuntimeError("INTERNAL: the step failed on the device")

    def delete(self):
        pass


@pytest.mark.parametrize("which", ["last_ids", "kv"])
def test_a_step_that_failed_on_the_device_leaves_the_engine_usable(tiny_dir, which):
    """A step whose outputs carry a device error fails; its outputs (the KV pages, the last ids) went to the
    runner, and every later step failed on them (the server answered 500s, /health ok). After the failure the
    engine makes that state again: the next generate gives a fresh engine's tokens and every block is back."""
    llm = LLM(tiny_dir, **TINY_ENGINE)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    r = llm.engine.runner
    if which == "last_ids":
        r.last_ids = FailedOnDevice(r.last_ids)
    else:
        r.kv_caches[0] = (FailedOnDevice(r.kv_caches[0][0]), r.kv_caches[0][1])
    with pytest.raises(Exception):
        llm.generate(PROMPTS, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)] == want
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]
