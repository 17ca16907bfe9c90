"""The API side of the engine core: `CoreClient` talks to it (process.py starts it).

`CoreClient` lives on an API process's event loop:
- `submit(items)` sends the prompts' token ids and sampling params (commands are batched: one message per
  event-loop turn) and returns a `Collector` that the HTTP handler awaits;
- a receiver thread reads the core's per-step messages (one per step, all updated requests) and hands each
  to the event loop in one call; the loop appends new token ids to each request's collector;
- the receiver also watches the core process: if it dies, every collector fails with `EngineDeadError`
  and the `on_dead` callbacks run (the server reports 503 on /health and exits non-zero).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, fields, is_dataclass

import msgpack
import zmq

from jaxinfer.server.process import CoreInfo, pid_alive

log = logging.getLogger("jaxinfer.server")


class EngineDeadError(RuntimeError):
    """The engine core process is gone: nothing can be served any more."""


class RequestFailed(RuntimeError):
    """The core refused (status 400) or failed (500) one request; the message says why."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class Collector:
    """One HTTP request's engine requests (one per prompt): new token ids per prompt index, awaited by the
    handler. `eager=False` (no streaming, no stop strings) wakes the handler only when a prompt finishes."""

    def __init__(self, n: int, eager: bool):
        self.rids: list[int] = []
        self.eager = eager
        self.pending: dict[int, list] = {}        # index -> [new ids, finish reason, logprobs, prompt logprobs]
        self.error: BaseException | None = None
        self.event = asyncio.Event()
        self.unfinished = set(range(n))
        self.first: dict[int, float] = {}         # index -> when its first token arrived (TTFT without waking)
        self.cached: dict[int, int] = {}          # index -> its prompt tokens found in the prefix cache (if any)

    def put(self, index: int, ids: list[int], reason: str | None, message: str | None = None,
            logprobs: list | None = None, prompt_logprobs: list | None = None, cached: int = 0) -> None:
        """New ids of prompt `index` (with their logprobs, and the prompt's on its first output, if asked; `cached`:
        its prompt tokens found in the prefix cache, on its first output)."""
        if cached:
            self.cached[index] = cached
        if reason in ("error", "rejected"):
            self.error = RequestFailed(message or "the engine failed this request", 400 if reason == "rejected" else 500)
            self.event.set()
            return
        if ids and index not in self.first:
            self.first[index] = time.perf_counter()
        p = self.pending.get(index)
        if p is None:
            self.pending[index] = [ids, reason, logprobs, prompt_logprobs]
        else:                                     # the handler is behind: merge (one chunk for several tokens)
            p[0] = p[0] + ids
            p[1] = reason
            if logprobs is not None:
                p[2] = (p[2] or []) + logprobs
            p[3] = p[3] or prompt_logprobs
        if reason is not None:
            self.unfinished.discard(index)
        if self.eager or reason is not None:
            self.event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.event.set()

    async def get(self) -> list[tuple[int, list[int], str | None, list | None, list | None]]:
        """Wait for news; returns [(prompt index, new token ids, finish reason or None, their logprobs,
        the prompt's logprobs)] (logprobs None unless asked)."""
        while not self.pending and self.error is None:
            self.event.clear()
            await self.event.wait()
        if self.error is not None:
            raise self.error
        out = [(i, *p) for i, p in self.pending.items()]
        self.pending = {}
        return out


class CoreClient:
    _closed = False                               # close() has closed the socket to the core

    def __init__(self, info: CoreInfo, api_index: int = 0, alive: Callable[[], bool] | None = None):
        self.info, self.api_index, self.api_count = info, api_index, len(info.out_addrs)
        self.alive = alive or (lambda: pid_alive(info.pid))
        self.dead: str | None = None              # why the core is gone, once it is
        self.on_dead: list[Callable[[str], None]] = []
        self._requests: dict[int, tuple[Collector, int]] = {}     # rid -> (collector, prompt index)
        self._ids = itertools.count()
        self._cmds: list = []
        self._stats: dict[int, asyncio.Future] = {}
        self._closing = False
        self.counters = dict(requests=0, aborts=0)    # prompts sent to the core; aborts sent (disconnects, stops)

    async def start(self, within_s: float = 30.0) -> None:
        """Connect to the core, and wait (up to `within_s`) until a message from it arrives here: ZMQ connects in the
        background, and the core drops what it sends to an API process not connected yet (a request or /stats sent
        at once after start-up waited forever, or 60 s)."""
        self._packb, self._unpackb = msgpack.packb, msgpack.unpackb
        self.loop = asyncio.get_running_loop()
        self._ctx = zmq.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.setsockopt(zmq.LINGER, 1000)
        self._push.connect(self.info.in_addr)
        self._thread = threading.Thread(target=self._receive, name="jaxinfer-core-receiver", daemon=True)
        self._thread.start()
        end = time.monotonic() + within_s
        while not self.dead and time.monotonic() < end:
            token = next(self._ids)
            fut = self._stats[token] = self.loop.create_future()
            self._command(["ping", self.api_index, token])
            try:
                return await asyncio.wait_for(asyncio.shield(fut), timeout=0.05)
            except asyncio.TimeoutError:
                self._stats.pop(token, None)
        log.warning("no answer from the engine core within %.0f s of start-up", within_s)

    def close(self) -> None:
        self._closing = True
        self._flush()
        self._thread.join(timeout=5)
        self._push.close()
        self._closed = True
        self._ctx.term()

    # -- requests (event loop) ----------------------------------------------------------------------
    def submit(self, items: list[tuple[list[int], object]], eager: bool, sources: list | None = None,
               cache_salt: str | None = None, rank: int | None = None) -> Collector:
        """Queue the prompts (token ids, SamplingParams); their outputs arrive in the returned Collector.
        sources[i]: the index of the item whose prompt KV item i waits for and reuses (sample 0 of n), or None.
        cache_salt: the request's (vLLM's; LLMEngine.add_request); rank: the data-parallel replica to run on."""
        if self.dead:
            raise EngineDeadError(self.dead)
        coll = Collector(len(items), eager)
        for index, (ids, params) in enumerate(items):
            rid = next(self._ids) * self.api_count + self.api_index
            self.counters["requests"] += 1
            coll.rids.append(rid)
            self._requests[rid] = (coll, index)
            cmd = ["add", rid, ids, {f.name: asdict(v) if is_dataclass(v := getattr(params, f.name)) else v
                                     for f in fields(params) if f.name not in ("stop", "output_kind")}]   # (stop: here)
            has_source = sources is not None and sources[index] is not None
            self._command(cmd + [coll.rids[sources[index]] if has_source else None, cache_salt,
                                 getattr(params, "_reasoning_end", None), rank])    # (app.py's chat route sets it)
        return coll

    def abort(self, coll: Collector, indices=None, kept: int | None = None) -> None:
        """Stop the collector's unfinished prompts in the core (their KV blocks return to the pool). `kept`: a stop
        string ended them after that many output tokens, a finish that the core's /metrics histograms count."""
        for i in (coll.unfinished if indices is None else indices):
            rid = coll.rids[i]
            if self._requests.pop(rid, None) is not None and not self.dead:
                self._command(["abort", rid] if kept is None else ["abort", rid, kept])
                self.counters["aborts"] += 1
        coll.unfinished.difference_update(range(len(coll.rids)) if indices is None else indices)

    @property
    def inflight(self) -> int:
        """Engine requests of this API process not finished yet."""
        return len(self._requests)

    def finish_all(self, reason: str = "abort") -> int:
        """End every engine request in flight here with `reason` (the drain's timeout): aborted in the core,
        their handlers see a normal end. Returns how many."""
        n = 0
        for rid, (coll, index) in list(self._requests.items()):
            del self._requests[rid]
            self._command(["abort", rid])
            coll.put(index, [], reason)
            n += 1
        return n

    async def stats(self) -> dict:
        if self.dead:
            raise EngineDeadError(self.dead)
        token = next(self._ids)
        fut = self._stats[token] = self.loop.create_future()
        self._command(["stats", self.api_index, token])
        return await asyncio.wait_for(fut, timeout=60)

    def _command(self, cmd: list) -> None:
        if not self._cmds:
            self.loop.call_soon(self._flush)      # one message per event-loop turn, however many commands
        self._cmds.append(cmd)

    def _flush(self) -> None:
        if self._cmds and self._closed:           # after close() (a second signal cancels handlers that abort):
            self._cmds = []                       # the core is shut down with everything it runs
        if self._cmds:
            cmds, self._cmds = self._cmds, []
            try:
                self._push.send(self._packb(cmds))
            except (OverflowError, TypeError, ValueError):    # one command msgpack cannot encode fails alone
                self._send_each(cmds)

    def _send_each(self, cmds: list) -> None:
        ok = []
        for cmd in cmds:
            try:
                self._packb([cmd])
                ok.append(cmd)
            except (OverflowError, TypeError, ValueError) as e:
                entry = self._requests.pop(cmd[1], None) if cmd[0] == "add" else None
                if entry is not None:
                    entry[0].put(entry[1], [], "rejected", f"the request cannot be sent to the engine: {e}")
                log.error("dropped an engine command that cannot be encoded (%s): %.200r", e, cmd)
        if ok:
            self._push.send(self._packb(ok))

    # -- outputs (event loop) -----------------------------------------------------------------------
    def _dispatch(self, msgs: list) -> None:
        for msg in msgs:
            if msg[0] == "out":
                for row in msg[1]:
                    entry = self._requests.get(row[0])
                    if entry is None:             # aborted here already
                        continue
                    if row[2] is not None:
                        del self._requests[row[0]]
                    extra = row[4] if len(row) > 4 else None      # logprobs, prefix-cache hits (core.py)
                    entry[0].put(entry[1], row[1], row[2], row[3] if len(row) > 3 else None,
                                 *((extra.get("logprobs"), extra.get("prompt_logprobs"), extra.get("cached", 0))
                                   if extra is not None else ()))
            elif msg[0] in ("stats", "pong"):
                fut = self._stats.pop(msg[1], None)
                if fut is not None and not fut.done():
                    fut.set_result(msg[2])

    def _core_gone(self, why: str) -> None:
        if self.dead:
            return
        self.dead = why
        log.error("%s", why)
        err = EngineDeadError(why)
        for coll, _ in list(self._requests.values()):
            coll.fail(err)
        self._requests.clear()
        for fut in self._stats.values():
            if not fut.done():
                fut.set_exception(err)
        for cb in self.on_dead:
            cb(why)

    # -- receiver thread ----------------------------------------------------------------------------
    def _receive(self) -> None:
        sock = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.info.out_addrs[self.api_index])
        why = None
        try:
            while not self._closing:
                if not sock.poll(100):
                    if not self.alive() and not sock.poll(200):   # read what it sent before it went
                        why = "the engine core process died"
                        break
                    continue
                msgs = []
                while True:
                    try:
                        msgs.append(self._unpackb(sock.recv(zmq.NOBLOCK)))
                    except zmq.Again:
                        break
                try:
                    self.loop.call_soon_threadsafe(self._dispatch, msgs)
                except RuntimeError:              # the event loop is closed (the server stopped without close())
                    break
                if any(m[0] == "bye" for m in msgs):
                    if not self._closing:
                        why = "the engine core process exited"
                    break
        finally:
            sock.close()
        if why and not self._closing:
            try:
                self.loop.call_soon_threadsafe(self._core_gone, why)
            except RuntimeError:                  # the event loop is closed
                pass
