"""One engine thread serving every HTTP request with continuous batching.

`LLMEngine` is not thread-safe, so exactly one thread touches it. Request handlers (asyncio, on uvicorn's
event loop) hand work over through a thread-safe inbox: ("add", request), ("abort", request) or
("stats", request). Between two steps the engine thread drains the inbox, so new requests join the running
batch at the next step. After each step it detokenizes the sequences that got a token and posts a `Delta`
to each request's asyncio queue (`loop.call_soon_threadsafe`). A handler whose client disconnects posts
("abort", request): the engine thread finishes that sequence, which frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from jaxinfer.engine.llm_engine import is_finished
from jaxinfer.sampling_params import SamplingParams

log = logging.getLogger("jaxinfer.server")


@dataclass
class Delta:
    """What one request gained in one step."""
    index: int                    # which prompt of the HTTP request
    text: str
    token_ids: list[int]
    finish_reason: str | None     # set on the request's last delta
    num_prompt_tokens: int
    num_output_tokens: int


class _Request:
    def __init__(self, items: list[tuple[list[int], SamplingParams]], loop: asyncio.AbstractEventLoop):
        self.items, self.loop = items, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.seqs: list = []
        self.cancelled = False

    def post(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:      # the event loop is gone (server shutting down)
            self.cancelled = True


class AsyncEngine:
    def __init__(self, llm):
        self.llm = llm
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._active: dict[int, tuple[_Request, int]] = {}      # seq_id -> (request, prompt index)
        self._thread = threading.Thread(target=self._run, name="jaxinfer-engine", daemon=True)
        # HF fast tokenizers may raise "Already borrowed" when one is used from two threads at once:
        # handlers encode on the event loop while this thread decodes, so both take this lock.
        self.tokenizer_lock = threading.Lock()

    # -- asyncio side -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def _submit(self, msg) -> None:
        self._inbox.put(msg)
        self._wake.set()

    async def generate(self, items: list[tuple[list[int], SamplingParams]]) -> AsyncIterator[Delta]:
        """Run the prompts (already validated) and yield their deltas as produced, until all finish.
        Closing the iterator early (client gone, task cancelled) aborts what is still running."""
        if not self.alive:
            raise RuntimeError("the engine thread is not running")
        req = _Request(items, asyncio.get_running_loop())
        self._submit(("add", req))
        left = len(items)
        try:
            while left:
                item = await req.queue.get()
                if isinstance(item, BaseException):
                    raise item
                left -= item.finish_reason is not None
                yield item
        finally:
            if left:
                self._submit(("abort", req))

    async def stats(self) -> dict:
        """Engine stats, read on the engine thread (between steps, so they are consistent)."""
        req = _Request([], asyncio.get_running_loop())
        self._submit(("stats", req))
        return await asyncio.wait_for(req.queue.get(), timeout=60)

    # -- engine thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.llm.engine
        while not self._stopping:
            if not engine.has_unfinished():
                self._wake.wait()
            self._wake.clear()
            self._drain()
            if self._stopping or not engine.has_unfinished():
                continue
            try:
                updated = engine.step()
            except Exception as e:       # keep serving: fail the requests in flight, free their blocks
                log.exception("engine step failed")
                self._fail_all(e)
                continue
            for seq in updated:
                entry = self._active.get(seq.seq_id)
                if entry is None:
                    continue
                req, index = entry
                with self.tokenizer_lock:
                    text, ids = self.llm._text_delta(seq)
                done = is_finished(seq)
                if text or ids or done:
                    req.post(Delta(index, text, ids, seq.finish_reason if done else None,
                                   seq.num_prompt_tokens, seq.num_output_tokens))
                if done:
                    del self._active[seq.seq_id]
        self._fail_all(RuntimeError("the server is shutting down"))

    def _drain(self) -> None:
        engine = self.llm.engine
        while True:
            try:
                kind, req = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "stats":
                req.post(engine.stats())
            elif kind == "add" and not req.cancelled:
                try:
                    for ids, params in req.items:
                        engine.check_request(ids, params)
                except ValueError as e:
                    req.post(e)
                    continue
                for index, (ids, params) in enumerate(req.items):
                    seq = engine.add_request(ids, params)
                    req.seqs.append(seq)
                    self._active[seq.seq_id] = (req, index)
            elif kind == "abort":
                req.cancelled = True
                self._abort(req)

    def _abort(self, req: _Request) -> None:
        for seq in req.seqs:
            self._active.pop(seq.seq_id, None)
            if not is_finished(seq):
                self.llm.engine.abort(seq)

    def _fail_all(self, error: BaseException) -> None:
        reqs = {id(r): r for r, _ in self._active.values()}
        for req in reqs.values():
            self._abort(req)
            req.post(error)
