"""vLLM's AsyncLLMEngine over an LLM: concurrent requests from one event loop give generate's outputs (cumulative,
delta and final-only kinds, n samples, stop strings); leaving a generator early or abort() ends a request and frees
its blocks (abort: a last "abort" output); bad input is a ValueError naming it and the engine goes on; a failed step
or shutdown() ends the running requests and later calls with EngineDeadError."""
import asyncio

import pytest
from helpers import TINY_ENGINE

from jaxinfer import LLM, AsyncEngineArgs, AsyncLLMEngine, SamplingParams
from jaxinfer.async_engine import EngineDeadError
from jaxinfer.sampling_params import RequestOutputKind

PROMPTS = [[5, 7, 9, 11], [100, 200, 300], "Hello there", [40, 41, 8, 2, 3]]
PARAMS = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=7, ignore_eos=True, logprobs=1),
          SamplingParams(temperature=0, max_tokens=12, stop=["e"], output_kind=RequestOutputKind.DELTA),
          SamplingParams(temperature=0, max_tokens=5, output_kind=2)]


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, **TINY_ENGINE)


def _free(llm):
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"] and st["running"] == st["waiting"] == 0, st


def _settled(engine, timeout_s: float = 30.0) -> None:
    """Wait until the engine's thread has taken up every drop (no request of the API left, none running)."""
    import time
    end = time.monotonic() + timeout_s
    while engine._api.has_unfinished_requests() and time.monotonic() < end:
        time.sleep(0.02)


async def _collect(engine, prompt, params, rid):
    return [out async for out in engine.generate(prompt, params, rid)]


def test_concurrent_requests_give_generates_outputs(llm):
    want = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    engine = AsyncLLMEngine(llm)
    try:
        async def every():
            return await asyncio.gather(*[_collect(engine, p, sp, f"r{i}") for i, (p, sp) in
                                          enumerate(zip(PROMPTS, PARAMS))])
        got = asyncio.run(asyncio.wait_for(every(), 120))
        for outs, w, sp in zip(got, want, PARAMS):
            assert outs[-1].finished and not any(o.finished for o in outs[:-1])
            assert {o.request_id for o in outs} == {outs[0].request_id}
            if sp.output_kind == RequestOutputKind.DELTA:     # the pieces join to generate's text and ids
                assert "".join(o.outputs[0].text for o in outs) == w.outputs[0].text
                assert sum((o.outputs[0].token_ids for o in outs), []) == w.outputs[0].token_ids
            else:                                      # CUMULATIVE / FINAL_ONLY: the last holds all of it
                assert len(outs) == 1 if sp.output_kind == 2 else len(outs) >= 1
                assert [(c.text, c.token_ids, c.finish_reason) for c in outs[-1].outputs] == \
                    [(c.text, c.token_ids, c.finish_reason) for c in w.outputs]
        assert got[1][-1].outputs[1].logprobs[0] == want[1].outputs[1].logprobs[0]
        _free(llm)
    finally:
        engine.shutdown()


def test_leaving_early_abort_and_bad_input(tiny_dir):
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=tiny_dir, **TINY_ENGINE))     # (vLLM's way)
    long = SamplingParams(max_tokens=100, ignore_eos=True)

    async def scenario():
        async for _ in engine.generate([1, 2, 3], long, "left"):
            break                                      # leaving the loop aborts it
        task = asyncio.create_task(_collect(engine, [1, 2, 3], SamplingParams(max_tokens=120, ignore_eos=True,
                                                                              output_kind=1), "ab"))
        await asyncio.sleep(0)                           # (its request is queued: the abort comes after it)
        await engine.abort("ab")
        twin = asyncio.create_task(_collect(engine, [1, 2], SamplingParams(max_tokens=120, ignore_eos=True), 9))
        await asyncio.sleep(0)
        await engine.abort("9")                          # (9 and "9" name one request)
        assert (await twin)[-1].outputs[0].finish_reason == "abort"
        outs = await task
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        assert sum(len(o.outputs[0].token_ids) for o in outs) < 120
        for bad, word in (([10**9], "out of vocabulary"), ([1], "max_tokens")):
            with pytest.raises(ValueError, match=word):
                await _collect(engine, bad, SamplingParams(max_tokens=0) if word == "max_tokens" else long, "bad")
        with pytest.raises(ValueError, match="request_id"):
            await _collect(engine, [1], long, None)
        running = engine.generate([1, 2], long, "dup")
        await running.__anext__()
        with pytest.raises(ValueError, match="already in the engine"):
            await _collect(engine, [1], long, "dup")
        await running.aclose()
        with pytest.raises(ValueError, match=r"data_parallel_rank=1 is out of range \[0, 1\)"):    # (one replica)
            async for _ in engine.generate([1], long, "rank", data_parallel_rank=1):
                pass
        async for out in engine.generate([5, 7], SamplingParams(temperature=0, max_tokens=2), "r0",
                                         data_parallel_rank=0):
            pass
        assert len(out.outputs[0].token_ids) == 2
        done = await _collect(engine, [5, 7], SamplingParams(temperature=0, max_tokens=3), "after")
        assert len(done[-1].outputs[0].token_ids) == 3       # (the engine went on)
        assert await engine.reset_prefix_cache()
    try:
        asyncio.run(asyncio.wait_for(scenario(), 120))
        _settled(engine)
        _free(engine._llm)
    finally:
        engine.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        asyncio.run(_collect(engine, [1], long, "late"))


def test_a_failed_step_ends_every_request(llm):
    engine = AsyncLLMEngine(llm)
    real = engine._api.step
    calls = []

    def failing():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a broken step")
        return real()
    engine._api.step = failing

    async def scenario():
        results = await asyncio.gather(*[_collect(engine, [1, 2, i], SamplingParams(max_tokens=50, ignore_eos=True),
                                                  i) for i in range(3)], return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) and "a broken step" in str(r) for r in results), results
        assert engine.errored and not engine.is_running
        with pytest.raises(EngineDeadError):
            await _collect(engine, [1], SamplingParams(max_tokens=2), "next")
    try:
        asyncio.run(asyncio.wait_for(scenario(), 120))
    finally:
        engine.shutdown()
        del engine._api.step
    _free(llm)                                         # (the dead engine's requests were aborted: no block kept)


def test_one_running_engine_per_llm(llm):
    """A second AsyncLLMEngine on an LLM whose first one runs is refused at once (both stepping it killed the first
    and left the second's requests hanging); after shutdown() another one runs."""
    first = AsyncLLMEngine(llm)
    try:
        with pytest.raises(RuntimeError, match="already has a running AsyncLLMEngine"):
            AsyncLLMEngine(llm)
        out = asyncio.run(_collect(first, [1, 2], SamplingParams(max_tokens=3, ignore_eos=True), "a"))
        assert len(out[-1].outputs[0].token_ids) == 3
    finally:
        first.shutdown()
    second = AsyncLLMEngine(llm)
    try:
        assert len(asyncio.run(_collect(second, [1, 2], SamplingParams(max_tokens=2), "b"))[-1].outputs[0].token_ids)
    finally:
        second.shutdown()
    _free(llm)


def test_callers_that_leave_early_or_race_shutdown(llm):
    """A generator left with `break` in an asyncio.run that then ends (its loop closed before the drop reaches the
    engine), and a task cancelled before its first output, end their requests without harming the engine; a generate
    racing shutdown() gets EngineDeadError or its outputs, never a hang."""
    import threading
    engine = AsyncLLMEngine(llm)
    long = SamplingParams(max_tokens=100, ignore_eos=True)

    async def first_only(rid):
        async for _ in engine.generate([1, 2, 3], long, rid):
            break

    async def cancel_at_once():
        task = asyncio.create_task(_collect(engine, [1, 2, 3], long, "x"))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    try:
        for i in range(6):
            asyncio.run(asyncio.wait_for(first_only(f"left{i}"), 60))
        asyncio.run(asyncio.wait_for(cancel_at_once(), 60))
        _settled(engine)
        done = asyncio.run(asyncio.wait_for(_collect(engine, [5, 7], SamplingParams(max_tokens=2), "x"), 60))
        assert done[-1].finished and not engine.errored      # (the cancelled "x" was dropped: its id is free)
        _settled(engine)
        _free(llm)
    finally:
        engine.shutdown()
    for _ in range(3):
        engine, ended = AsyncLLMEngine(llm), []

        def caller():
            try:
                ended.append(asyncio.run(asyncio.wait_for(_collect(engine, [1, 2], long, "r"), 30))[-1].finished)
            except EngineDeadError:
                ended.append("dead")
        t = threading.Thread(target=caller)
        t.start()
        engine.shutdown()
        t.join(60)
        assert ended and ended[0] in ("dead", True), ended
    _free(llm)


def test_abort_takes_vllms_iterables_and_bad_ids_leave_the_engine_running(llm):
    engine = AsyncLLMEngine(llm)
    long = SamplingParams(max_tokens=100, ignore_eos=True)

    async def scenario():
        with pytest.raises(ValueError, match=r"\['l'\]"):
            await _collect(engine, [1, 2], long, ["l"])        # (an unhashable id: refused before it is queued)
        for bad in (None, ("x", ["y"]), 1.5):
            with pytest.raises(ValueError, match="request_id"):
                await engine.abort(bad)
        gen = engine.generate([1, 2, 3], long, "a")
        await gen.__anext__()
        await engine.abort(["a", "unknown"])                   # (vLLM's AsyncLLM.abort: str | Iterable[str])
        reused = await _collect(engine, [5, 7], SamplingParams(temperature=0, max_tokens=3), "a")   # free at once
        assert reused[-1].finished and len(reused[-1].outputs[0].token_ids) == 3
        rest = [out async for out in gen]
        assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    try:
        asyncio.run(asyncio.wait_for(scenario(), 120))
        assert not engine.errored
        _settled(engine)
        _free(llm)
    finally:
        engine.shutdown()
