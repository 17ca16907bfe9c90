"""A KeyboardInterrupt (Ctrl-C in a notebook) can land between any two bytecodes of a call: while requests are
queued, inside the block manager's allocate or free_seq, in a step's bookkeeping. Afterwards nothing may stay
queued, every KV block must be free with a reference count of 0, and the next call must give a fresh LLM's tokens
(a block freed twice was once handed to two sequences, silently corrupting both)."""
import threading

import pytest
from helpers import TINY_ENGINE, Interrupt

from jaxinfer import LLM, SamplingParams

KW = {**TINY_ENGINE, "num_kvcache_blocks": 24}      # small: preemption and free-list reuse of cached blocks
PROMPTS = [list(range(3, 40)), [5, 6, 7], list(range(3, 30)) + [9, 9], list(range(100, 121))]
PARAMS = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=7, max_tokens=16, n=2, ignore_eos=True),
          SamplingParams(temperature=0.9, seed=3, top_k=5, max_tokens=12, stop=["a"]),
          SamplingParams(temperature=0.7, seed=11, max_tokens=10, logprobs=2, ignore_eos=True)]


def tokens(llm, stream=False):
    if stream:
        got = {}
        for d in llm.stream(PROMPTS, PARAMS):
            for c in d.outputs:
                got.setdefault((d.request_id, c.index), []).extend(c.token_ids)
        return [[got[(i, j)] for j in range(p.n)] for i, p in enumerate(PARAMS)]
    return [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def assert_clean(llm, where):
    bm, st = llm.engine.block_manager, llm.stats()
    assert st["running"] == st["waiting"] == 0 and not llm.engine.has_unfinished(), where
    assert st["kv_blocks_free"] == st["kv_blocks_total"], where
    assert all(b.ref_count == 0 for b in bm.blocks), (where, [b.ref_count for b in bm.blocks])
    assert all(bm.blocks[bid].hash == h for h, bid in bm.cached.items()), where


def test_the_tracer_raises_where_a_real_ctrl_c_can_land():
    """Not at a `with` block's exit (before its __exit__ call, outside its handler): raising there left a lock
    held for good, and the engine's next step waited on it forever."""
    lock = threading.Lock()

    def locked_thrice():
        with lock:
            x = 1
        with lock:
            x += 1
        with lock:
            return x                # (its exit runs __exit__ before returning)
    where = []
    for n in range(1, 10):
        where.append(Interrupt(n, "locked_thrice").run(locked_thrice))
        assert not lock.locked(), where
    first = locked_thrice.__code__.co_firstlineno
    assert [w and int(w.split(":")[1]) - first for w in where] == [1, 2, 3, 3, 4, 5, 5, 6, None]


@pytest.fixture(scope="module")
def want(tiny_dir):
    return tokens(LLM(tiny_dir, **KW))


@pytest.mark.parametrize("stream", [False, True])
def test_an_interrupt_anywhere_leaves_no_request_queued_and_no_block_held(tiny_dir, want, stream):
    llm = LLM(tiny_dir, **KW)
    assert tokens(llm, stream) == want
    total = Interrupt(10**9)
    total.run(lambda: tokens(llm, stream))                       # lines a whole call executes
    points = sorted({1 + i * (total.count - 2) // 47 for i in range(48)})
    fired = 0
    for k, n in enumerate(points):
        where = Interrupt(n).run(lambda: tokens(llm, stream))    # (None: this call ran fewer lines, e.g. a step's
        fired += where is not None                               # timing let it poll less)
        assert_clean(llm, where)
        if k % 8 == 7:
            assert tokens(llm, stream) == want, where
    assert fired >= len(points) // 2, (fired, len(points))


@pytest.mark.parametrize("function", ["free_seq", "allocate", "_take_free", "add_request", "finish"])
def test_an_interrupt_inside_the_block_bookkeeping_neither_leaks_nor_double_frees(tiny_dir, want, function):
    """Every line of the function, at its first call and at a later one."""
    llm = LLM(tiny_dir, **KW)
    for first_call_lines in (range(1, 12), range(40, 400, 37)):
        for n in first_call_lines:
            where = Interrupt(n, function).run(lambda: tokens(llm))
            if where is None:
                break                                            # past the function's last line in this call
            assert_clean(llm, where)
    assert tokens(llm) == want


def test_an_interrupt_in_the_engine_apis_add_request_leaves_no_orphan(tiny_dir):
    """Interrupted, add_request either queued the request whole (its id is the API's) or left nothing queued."""
    llm = LLM(tiny_dir, **KW)
    api, sched = llm.llm_engine, llm.engine.scheduler
    for n in range(1, 40, 3):
        where = Interrupt(n, "add_request").run(lambda: api.add_request(f"r{n}", PROMPTS[0], PARAMS[1]))
        owned = {s.seq_id for r in api._requests.values() for s in r.seqs}
        assert {s.seq_id for s in [*sched.waiting, *sched.running]} <= owned, where
        while api.has_unfinished_requests():
            api.step()
        assert_clean(llm, where)


@pytest.mark.parametrize("function", ["_generate", "_streaming", "_stream"])
def test_an_interrupt_right_after_the_requests_are_queued_leaves_none(tiny_dir, want, function):
    """Every line of the call's own function: the first ones run after its requests are queued and before the
    call lists them (they were left queued: the next call ran them as orphans, holding blocks). (Python 3.12 inlines
    list comprehensions, and an exception that a tracer raises at a line event inside one skipped the enclosing
    `with` block's handler: those lines list their sequences with a generator expression. A real Ctrl-C does not
    skip it.)"""
    llm = LLM(tiny_dir, **KW)
    stream = function != "_generate"
    for n in range(1, 16):
        where = Interrupt(n, function).run(lambda: tokens(llm, stream))
        if where is None:
            break
        assert_clean(llm, where)
    assert tokens(llm, stream) == want


def api_tokens(llm, tag):
    api, got = llm.llm_engine, {}
    for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS)):
        api.add_request(f"{tag}{i}", p, sp)
    while api.has_unfinished_requests():
        for out in api.step():
            for c in out.outputs:                   # (cumulative outputs, vLLM's LLMEngine default)
                got[(out.request_id, c.index)] = list(c.token_ids)
    return [[got[(f"{tag}{i}", j)] for j in range(p.n)] for i, p in enumerate(PARAMS)]


@pytest.mark.parametrize("function, caller", [("__exit__", "engine_api.py"), ("recovering", None)])
def test_a_ctrl_c_as_the_engine_apis_calls_leave_their_with_blocks(tiny_dir, want, function, caller):
    """A real Ctrl-C can land in contextlib's exits of step()'s `with` blocks, after the step's outputs were made and
    finished requests dropped (their last outputs were lost: a loop that caught it and stepped on never saw them
    finish), and in add_request's (an exception there now always leaves nothing queued)."""
    llm = LLM(tiny_dir, **KW)
    api = llm.llm_engine
    for n in range(1, 7):
        where = Interrupt(n, function, caller).run(lambda: api.add_request(f"a{n}", PROMPTS[0], PARAMS[0]))
        assert where is None or not api.has_unfinished_requests(), (where, api.get_num_unfinished_requests())
        api.abort_request(f"a{n}")
        for kind in ("CUMULATIVE", "DELTA"):
            got, done = {}, set()
            for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS)):
                api.add_request(f"{kind}{n}.{i}", p, SamplingParams(**{**sp.__dict__, "output_kind": kind}))
            k = 0
            while api.has_unfinished_requests():
                k, outs = k + 1, []
                # (every other step of the first 40: an interrupted recovery starts its requests over)
                if k % 2 and k < 40:
                    Interrupt(n, function, caller).run(lambda: outs.extend(api.step()))
                else:
                    outs.extend(api.step())
                for out in outs:
                    done |= {out.request_id} if out.finished else set()
                    for c in out.outputs:
                        ids = got.setdefault((out.request_id, c.index), [])
                        ids[:] = ids + list(c.token_ids) if kind == "DELTA" else list(c.token_ids)
            assert done == {f"{kind}{n}.{i}" for i in range(len(PROMPTS))}, (function, n, kind)
            assert [[got[(f"{kind}{n}.{i}", j)] for j in range(p.n)] for i, p in enumerate(PARAMS)] == want
            assert_clean(llm, (function, n, kind))


@pytest.mark.parametrize("function", ["on_dispatch", "launch", "finish_dispatch", "_apply", "postprocess"])
def test_requests_that_outlive_an_interrupted_step_get_a_fresh_llms_tokens(tiny_dir, want, function):
    """The engine API keeps its requests across an interrupted `step()` (a notebook's Ctrl-C), and a stream keeps its
    own across an interrupted generate nested in its loop: the step's bookkeeping was half done (ids launched but
    not recorded, placeholders not filled), which gave wrong tokens or an engine that refused every later step.
    They now compute their KV again and go on with the same tokens."""
    llm = LLM(tiny_dir, **KW)
    assert api_tokens(llm, "a") == want
    for n in (1, 3, 6):
        api, got = llm.llm_engine, {}
        for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS)):
            api.add_request(f"b{n}.{i}", p, sp)
        k = 0
        while api.has_unfinished_requests():
            k += 1
            outs = Interrupt(n, function).run(api.step) if k == 3 else api.step()
            assert k != 3 or isinstance(outs, str), "the interrupt fired"
            for out in outs if isinstance(outs, list) else []:
                for c in out.outputs:
                    got[(out.request_id, c.index)] = list(c.token_ids)
        assert [[got[(f"b{n}.{i}", j)] for j in range(p.n)] for i, p in enumerate(PARAMS)] == want, (function, n)
        assert_clean(llm, (function, n))
        assert api_tokens(llm, f"c{n}") == want, (function, n)
    for n in (1, 4):                                    # a generate nested in a stream's loop, interrupted
        got, nested = {}, False
        for d in llm.stream(PROMPTS, PARAMS):
            for c in d.outputs:
                got.setdefault((d.request_id, c.index), []).extend(c.token_ids)
            if not nested and len(got) >= 2:
                nested = True
                Interrupt(n, function).run(lambda: llm.generate([[9, 8, 7]], PARAMS[0], use_tqdm=False))
        assert [[got[(i, j)] for j in range(p.n)] for i, p in enumerate(PARAMS)] == want, (function, n)
        assert_clean(llm, (function, n))
