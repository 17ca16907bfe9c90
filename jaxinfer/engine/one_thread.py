"""OneThread: an LLM's engine is driven by one thread at a time (its scheduler and block manager are not
thread-safe). A second thread that calls generate / stream while another one is inside gets a clear error instead
of silently mixed-up batches; the same thread may nest calls (a generate inside a stream's loop), and `run`, the
loop that steps the engine for a call, then still delivers what the nested call's steps did to its sequences.
A stream (`Stream`) holds the LLM from its first delta to its end for the thread that iterates it, and may be
handed to another thread between deltas (each delta is checked, not only the first)."""
from __future__ import annotations

import contextlib
import inspect
import threading
import weakref
from collections.abc import Iterator

import jax

from jaxinfer.engine.sequence import Sequence, id_mark, is_finished


REFUSED = ("this LLM is generating on another thread: an LLM serves one thread at a time (give each thread its own "
           "LLM, or serve it: `python -m jaxinfer serve`)")
STREAM_HELD = ("this LLM is held by an unfinished LLM.stream begun on another thread: iterate it to its end (from any "
               "thread, this one too), close() it, or use `with llm.stream(...)`; an LLM serves one thread at a time")


class _Call:
    """A running call, listed weakly: an interrupt in its exit does not leave it listed once its frame is gone (a
    kept traceback, e.g. a REPL's sys.last_traceback, keeps the frame and so the listing until it is replaced)."""
    __slots__ = ("thread", "__weakref__")

    def __init__(self, thread: int):
        self.thread = thread


class OneThread:
    def __init__(self):
        self._lock = threading.RLock()       # (re-entrant: a Stream's __del__ may run anywhere)
        self._calls = weakref.WeakSet()      # running calls (_Call)
        self._streams = weakref.WeakSet()    # begun Streams: one not ended holds the LLM for its thread
        self._orphans = []                   # generators of begun Streams collected unended: the next call closes them
        self.steps = 0          # engine steps its holder ran (LLM._run: a nested call's steps show up here)

    def _holders(self, stream: Stream | None) -> set[int]:
        """The threads of the running calls and of the begun, unended streams (but `stream`)."""
        return {c.thread for c in self._calls} | {s.thread for s in self._streams if s is not stream and s.begun}

    @contextlib.contextmanager
    def _locked(self):
        """The lock, held for a few bytecodes. Should an interrupt leave it held (one landing between a `with`
        block's body and its exit can), another thread gets the usual refusal after a second instead of a hang."""
        if not self._lock.acquire(timeout=1.0):
            raise RuntimeError(REFUSED)
        try:
            yield
        finally:
            self._lock.release()

    @contextlib.contextmanager
    def __call__(self, stream: Stream | None = None):
        """One call of this thread (`stream`: one delta of it). Refused while another thread runs a call or holds
        a begun stream; a stream's delta takes the stream over from a thread that runs nothing now."""
        me = threading.get_ident()
        call = _Call(me)
        with self._locked():
            if others := self._holders(stream) - {me}:
                if not {c.thread for c in self._calls} & others:     # (only begun streams of other threads hold it)
                    raise RuntimeError(STREAM_HELD)
                raise RuntimeError(REFUSED)
            self._calls.add(call)
            if stream is not None:
                stream.thread = me
                self._streams.add(stream)
        try:
            self._close_orphans()
            yield
            self._close_orphans()                            # (those collected meanwhile: their blocks back now)
        finally:
            with contextlib.suppress(RuntimeError), self._locked():    # (unlisted or not, `call` dies with this frame)
                self._calls.discard(call)

    def _close_orphans(self) -> None:
        while self._orphans:
            self._orphans.pop().close()                      # (aborts its requests: GeneratorExit in `run`)

    def held_elsewhere(self) -> bool:
        """Whether another thread runs a call or holds a begun stream now."""
        return bool(self._holders(None) - {threading.get_ident()})

    def forget(self, stream: Stream) -> None:
        """A begun stream was collected unended: close it now if no call runs, else in the next call."""
        with contextlib.suppress(RuntimeError), self._locked():
            self._streams.discard(stream)
            self._orphans.append(stream._gen)
            if self._calls:
                return
        with contextlib.suppress(RuntimeError), self():
            pass

    def run(self, engine, seqs: list[Sequence], before_step=None) -> Iterator[tuple[int, Sequence]]:
        """Step `engine` until every seq finishes, yielding (index in seqs, seq) for each new token.
        However it ends (done, error, or the caller leaving early), nothing is left holding KV blocks.
        The caller may run the engine itself while a yield is pending (a nested call on the same thread): then
        seqs that moved meanwhile are yielded too, each finished one once. `before_step()`: called before each
        engine step (LLM.stream's aborts: they take effect even while no token comes, e.g. during a prefill)."""
        index = {s.seq_id: i for i, s in enumerate(seqs)}
        first = 0           # seqs[:first] are finished, and stay so: no rescan of every sequence per step
        done = set()        # finished seqs yielded
        try:
            while first < len(seqs):
                if before_step is not None:
                    before_step()
                if is_finished(seqs[first]):
                    first += 1
                    continue
                self.steps += 1
                for seq in engine.step():
                    if seq.seq_id in index:
                        mark = self.steps
                        if is_finished(seq):
                            done.add(seq.seq_id)
                        yield index[seq.seq_id], seq
                        while self.steps != mark:            # the caller stepped the engine meanwhile
                            mark = self.steps
                            for i, s in enumerate(seqs):
                                if s.seq_id not in done:
                                    if is_finished(s):
                                        done.add(s.seq_id)
                                    yield i, s
        except GeneratorExit:                                # the caller left early: the finally aborts
            raise
        except BaseException:                                # an error, or a KeyboardInterrupt anywhere
            recover(engine, seqs)
            raise
        finally:
            for seq in seqs:
                if not is_finished(seq):
                    engine.abort(seq)


class Stream:
    """LLM.stream's iterator. Each delta is one call (OneThread) of the thread that asks for it; once begun, the
    stream holds the LLM for that thread until it ends or is closed, and may move to another thread (a web
    framework's thread pool) while no call runs. `aborts`: LLM.abort's request ids for it."""

    def __init__(self, one_thread: OneThread, make):
        self.aborts, self.thread, self._delta = set(), None, None
        self._one_thread, self._gen = one_thread, make(self.aborts)

    @property
    def open(self) -> bool:
        """Not ended (done, failed or closed)."""
        return inspect.getgeneratorstate(self._gen) != inspect.GEN_CLOSED

    @property
    def begun(self) -> bool:
        """Begun and not ended."""
        return inspect.getgeneratorstate(self._gen) in (inspect.GEN_SUSPENDED, inspect.GEN_RUNNING)

    def __iter__(self):
        return self

    def __next__(self):
        if self._delta is None:
            if not self.open:
                raise StopIteration
            with self._one_thread(self):
                self._delta = next(self._gen)   # (kept: an interrupt in the call's exit must not lose it, it comes
        delta, self._delta = self._delta, None  # with the next `next`)
        return delta

    def close(self) -> None:
        """Abort the requests that have not finished and free their KV blocks (as leaving the loop early does)."""
        if self.begun:
            with self._one_thread(self):
                self._gen.close()
        self._gen.close()                                    # (not begun: nothing ran)

    def __enter__(self):        # `with llm.stream(...) as s:` closes it on leaving the block (a break included)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:                                        # (at interpreter exit the modules' names may be gone)
            if inspect.getgeneratorstate(self._gen) == inspect.GEN_SUSPENDED:
                self._one_thread.forget(self)
        except Exception:
            pass


class Window:
    """The ids of the sequences one call queues: those made after it began, and (once `close` ran, after the call
    queued its last one) before that point. Sequences that a nested call on the same thread makes later are not
    its own. `recover` aborts the queued ones: a call interrupted between queuing a sequence and listing it."""
    def __init__(self):
        self.start, self.end = id_mark(), None

    def close(self) -> None:
        self.end = id_mark()

    def __contains__(self, seq_id: int) -> bool:
        return self.start < seq_id and (self.end is None or seq_id < self.end)


def recover(engine, seqs, since: Window | None = None) -> None:
    """After an exception in an engine call: abort seqs that have not finished, and the queued sequences made in
    `since` (those an interrupted call queued before it could list them), then rebuild the
    KV blocks' reference counts and free list from the sequences the engine still holds (a KeyboardInterrupt can
    land between any two bytecodes, e.g. inside the block manager's allocate or free_seq: a block taken but not
    yet in a table, or a sequence freed twice, would otherwise leak or be handed to two sequences at once)."""
    for seq in seqs:
        if not is_finished(seq):
            engine.abort(seq)
    for replica in getattr(engine, "replicas", None) or [engine]:       # (a DPEngine: each replica's pool)
        if since is not None:
            for seq in [*replica.scheduler.waiting, *replica.scheduler.building, *replica.scheduler.running]:
                if seq.seq_id in since:
                    engine.abort(seq)
                    replica.abort(seq)                      # (a DPEngine may not have listed its owner yet)
        replica.in_flight = None                # the step may be half applied: the survivors (a nested call's
        replica.scheduler.recompute_all()       # outer stream, the engine API's requests) compute their KV again
        replica.scheduler.recount_blocks()
        replica.runner.lost_buffers(failed)     # a call that failed on the device: its outputs are made again
        if replica.extras.counts is not None and failed(replica.extras.counts):
            replica.extras.counts = None


def failed(arrays) -> bool:
    """Whether device arrays (a pytree) hold a failed call's error (a step that failed while it ran: its outputs,
    donated to the next step, would fail it too) or were deleted. Waits for them."""
    try:
        jax.block_until_ready(arrays)
        return False
    except Exception:                           # noqa: BLE001 (whatever the device reported)
        return True


@contextlib.contextmanager
def recovering(engine, seqs: list[Sequence], since: Window | None = None):
    """`recover(engine, seqs, since)` on any exception but a generator's close, then re-raise."""
    try:
        yield
    except GeneratorExit:
        raise
    except BaseException:
        recover(engine, seqs, since)
        raise
