"""vLLM's AsyncLLMEngine, for asyncio code (a web framework's handlers, agents) that streams many requests at once:

    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model="path/to/Qwen3-0.6B"))
    async for out in engine.generate("Hello, my name is", SamplingParams(max_tokens=32), request_id="a"):
        print(out.outputs[0].text)                  # everything so far (vLLM's CUMULATIVE default); out.finished last

One thread of its own steps the engine (`llm.llm_engine`, engine_api.py) while requests run: `generate` hands its
request to that thread and yields the RequestOutputs the thread posts back to the caller's event loop, in the
request's `output_kind` (CUMULATIVE, DELTA or FINAL_ONLY, as LLMEngine's). Leaving the `async for` early (break,
an exception, the task cancelled) or `await engine.abort(request_id)` ends the request and frees its KV blocks (after
a `break`, once Python closes the generator: `aclose()` it, or when its event loop ends or it is collected). Bad
input is a ValueError from `generate`'s first step, naming the value; the engine stays usable. If a step fails,
the error reaches every running request and later calls (`engine.errored`, `engine.dead_error`). `shutdown()`
ends the thread (running requests end with the error saying so).
"""
from __future__ import annotations

import asyncio
import queue
import threading

from jaxinfer.engine_api import EngineArgs, ModelConfigView, check_id, request_ids


class EngineDeadError(RuntimeError):
    """The engine's thread stopped (a failed step, or shutdown()); vLLM's name."""


class AsyncEngineArgs(EngineArgs):
    """vLLM's AsyncEngineArgs: EngineArgs' fields (the model and LLM()'s keyword arguments)."""


class AsyncLLMEngine:
    """Made from an LLM (`AsyncLLMEngine(llm)`) or, as vLLM's, `AsyncLLMEngine.from_engine_args(AsyncEngineArgs(...))`.
    While it runs, its thread alone uses the LLM: other calls on that LLM raise (an LLM serves one thread), and so
    does a second AsyncLLMEngine on it until this one's shutdown()."""

    def __init__(self, llm):
        if (other := getattr(llm, "_async_engine", None)) is not None and other.is_running:
            raise RuntimeError("this LLM already has a running AsyncLLMEngine (its thread alone uses the LLM): "
                               "shutdown() that one first, or make another LLM")
        llm._async_engine = self
        self._llm, self._api = llm, llm.llm_engine
        self._commands: queue.Queue = queue.Queue()
        self._lock = threading.Lock()             # (a command is queued only while the thread still takes them)
        self._streams: dict = {}                  # request_id -> (event loop, asyncio.Queue)
        self.dead_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="jaxinfer-async-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **vllm_kwargs) -> "AsyncLLMEngine":
        """vLLM's: the engine of `LLM(engine_args.model, **engine_args.kwargs)` (usage_context, ... ignored)."""
        from jaxinfer.llm import LLM
        return cls(LLM(engine_args.model, **engine_args.kwargs))

    # -- the caller's side (its event loop) -----------------------------------------------------------
    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self.errored

    async def generate(self, prompt, sampling_params=None, request_id=None, *, lora_request=None,
                       tokenization_kwargs=None, trace_headers=None, priority: int = 0, prompt_text=None,
                       data_parallel_rank=None):
        """Yield RequestOutputs of one request until it finishes (vLLM's signature; `request_id` a string or int of
        the caller's, unique among running requests; trace_headers and prompt_text are taken and unused;
        data_parallel_rank: the replica that runs it, as vLLM's, else the least loaded). Leaving the loop early aborts
        it."""
        if request_id is None:
            raise ValueError("generate needs a request_id (a string or an int, unique among running requests)")
        check_id(request_id)                      # (before anything is queued: the engine's thread hashes it)
        size = self._llm.config.data_parallel_size
        if data_parallel_rank is not None and (not isinstance(data_parallel_rank, int) or
                                               isinstance(data_parallel_rank, bool) or
                                               not 0 <= data_parallel_rank < size):
            raise ValueError(f"data_parallel_rank={data_parallel_rank!r:.40} is out of range [0, {size}) "
                             f"(data_parallel_size={size})")
        loop, outputs = asyncio.get_running_loop(), asyncio.Queue()
        added = loop.create_future()
        self._send(("add", request_id, dict(prompt=prompt, params=sampling_params, lora_request=lora_request,
                                            tokenization_kwargs=tokenization_kwargs, priority=priority,
                                            data_parallel_rank=data_parallel_rank), (loop, outputs, added)))
        finished = False
        try:
            await added                           # (a bad request: its ValueError, raised here)
            while not finished:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:       # (break, an exception, cancelled, even before its first output): end it in the engine
            if not finished:                      # (only if it is still this call's: a refused id is another's)
                self._commands.put(("drop", request_id, outputs, None))

    async def abort(self, request_id) -> None:
        """End a running request, or several (an iterable of ids, as vLLM's): its KV blocks are freed, its id is free
        again, and its generator yields a last output, finish_reason "abort" for the samples that had not ended;
        unknown or finished ids are ignored (vLLM's)."""
        self._commands.put(("abort", request_ids(request_id), None, None))

    async def get_tokenizer(self, lora_request=None):
        return self._llm.get_tokenizer()

    async def get_model_config(self) -> ModelConfigView:
        return self._api.model_config

    async def check_health(self) -> None:
        self._check_alive()

    async def reset_prefix_cache(self, *args, **kwargs) -> bool:
        done = asyncio.get_running_loop().create_future()
        self._send(("reset", None, (args, kwargs), (asyncio.get_running_loop(), None, done)))
        return await done

    def shutdown(self) -> None:
        """Stop the engine's thread; running requests end with an EngineDeadError."""
        if self._thread.is_alive():
            self._commands.put(("stop", None, None, None))
            self._thread.join()

    def _check_alive(self) -> None:
        if self.dead_error is not None or not self._thread.is_alive():
            raise EngineDeadError(f"the engine is not running: {self.dead_error or 'shut down'}")

    def _send(self, command) -> None:
        with self._lock:
            self._check_alive()
            self._commands.put(command)

    # -- the engine's thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        api, batch = self._api, []
        try:
            while True:
                busy = api.has_unfinished_requests()
                try:
                    batch.append(self._commands.get(block=not busy))
                except queue.Empty:
                    pass
                while not self._commands.empty():
                    batch.append(self._commands.get_nowait())
                while batch:
                    if not self._do(*batch.pop(0)):
                        raise EngineDeadError("the engine was shut down (AsyncLLMEngine.shutdown)")
                if api.has_unfinished_requests():
                    for out in api.step():
                        self._post(out.request_id, out)
                        if out.finished:
                            self._streams.pop(out.request_id, None)
        except BaseException as e:                # (a failed step: every request and later call learns why)
            dead = e if isinstance(e, EngineDeadError) else EngineDeadError(f"the engine failed: {e!r}")
            with self._lock:
                self.dead_error = dead
            for rid in list(self._streams):
                self._post(rid, dead)
            self._streams.clear()
            while not self._commands.empty():     # (queued before it stopped: their callers must not wait forever)
                batch.append(self._commands.get_nowait())
            for _, _, _, reply in batch:
                if reply is not None:
                    _call_soon(reply[0], lambda f=reply[2]: f.done() or f.set_exception(dead))
            try:
                api.abort_request(list(api._requests))
            except Exception:                     # (the engine may be broken: its blocks go with it)
                pass

    def _do(self, kind, request_id, args, reply) -> bool:
        """One command from a caller; False for stop."""
        if kind == "stop":
            return False
        if kind == "drop":                        # (its generator was left: nobody reads what follows)
            if self._streams.get(request_id, (None, None))[1] is args:
                self._drop(request_id)
        elif kind == "abort":                     # the samples end now, their last output is posted now
            for rid in request_id:
                out = self._api._abort(rid, output=True)
                if out is not None:
                    self._post(out.request_id, out)
                    self._streams.pop(out.request_id, None)
        elif kind == "reset":
            loop, _, done = reply
            self._reply(loop, done, lambda: self._api.reset_prefix_cache(*args[0], **args[1]))
        else:                                     # add
            loop, outputs, added = reply
            added_ok, told = self._reply(loop, added, lambda: self._add(request_id, **args))
            if added_ok:
                self._streams[request_id] = (loop, outputs)
                if not told:                      # (its event loop has closed: nobody reads it)
                    self._drop(request_id)
        return True

    def _add(self, request_id, data_parallel_rank=None, **args) -> None:
        """Queue the request (on the engine's thread), on replica `data_parallel_rank` when one is given."""
        from jaxinfer.engine.dp_engine import on_replica
        with on_replica(self._llm.engine, data_parallel_rank):
            self._api.add_request(request_id, **args)

    @staticmethod
    def _reply(loop, future, call) -> bool:
        """Run `call` here and set the caller's future to its result (or its exception); returns whether it returned
        and whether the caller could be told (its event loop still open)."""
        try:
            result, ok = call(), True
        except Exception as e:
            result, ok = e, False
        return ok, _call_soon(loop, lambda: future.done() or (future.set_result(result) if ok else
                                                               future.set_exception(result)))

    def _post(self, request_id, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None and not _call_soon(stream[0], lambda: stream[1].put_nowait(item)):
            self._drop(request_id)                # (its event loop has closed: nobody reads it)

    def _drop(self, request_id) -> None:
        self._streams.pop(request_id, None)
        self._api.abort_request(request_id)


def _call_soon(loop, callback) -> bool:
    """Run `callback` on the caller's event loop; False if that loop has closed (the caller is gone)."""
    try:
        loop.call_soon_threadsafe(callback)
        return True
    except RuntimeError:
        return False
