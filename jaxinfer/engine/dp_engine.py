"""Data parallelism: `data_parallel_size` engine replicas in one process, each on its own devices.

`create_engine` is what `LLM` calls: one `LLMEngine` for dp = 1 (tensor-parallel or not), else a `DPEngine`
over dp of them. `DPEngine` offers what `LLM`, the server and the benchmarks use of an `LLMEngine`
(add_request, step, abort, has_unfinished, check_request, stats, warmup, and `scheduler` / `block_manager` /
`runner` views), so nothing above it changes.

- A request goes to the replica with the least outstanding work (tokens still to compute or to generate).
- `step()` first dispatches a step on every replica, then reads them: each replica's step is queued on its
  devices before the host waits for any result (JAX dispatch is asynchronous), so the devices run together
  instead of taking turns. The Python part of every replica's dispatch (schedule, pack) and of its read runs on
  the calling thread; only the device calls run at once, from one thread per replica (`_launch_all`). (A whole
  engine step per thread was measured on 2 H200s, 30,051 / 31,210 tok/s against 30,409 / 29,248 from one
  thread: no gain, since each thread's Python work held up the others' launches; `h200x2_2026-11-30_dp_threads.json`.)
- `stats()` sums the replicas' counters and lists each replica's own under "replicas"; `sized_stats(engine)` gives
  either engine's with the same keys at every size (what `LLM.stats()` and the server's /stats show).
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.engine.memory import num_blocks_for_memory
from jaxinfer.engine.dp_views import BlockManagerView, RunnerView, SchedulerView
from jaxinfer.engine.one_thread import recovering
from jaxinfer.engine.sequence import Sequence
from jaxinfer.model.attention import check_backend
from jaxinfer.model.kv_scales import kv_cache_dtype
from jaxinfer.parallel import Placement, make_placements, shared_seed
from jaxinfer.parallel.agree import agree
from jaxinfer.sampling_params import SamplingParams

# stats that are the same for every replica, not summed (compilations are each replica's own: summed)
_NOT_SUMMED = ("block_size", "kv_cache_dtype")


def create_engine(model: ModelConfig, config: EngineConfig, load: Callable[[Placement], dict],
                  eos_token_ids: tuple[int, ...] = (), cap_max_model_len: bool = False, tokenizer=None):
    """The engine for `config.tensor_parallel_size` x `config.data_parallel_size` devices (the first ones).
    load(placement) -> params placed on that placement's devices (e.g. `load_params(..., placement=p)`).
    tokenizer: what requests' bad_words and structured choices are read with (LLMEngine.tokenizer)."""
    # several hosts: the same options and model everywhere (else the collectives desynchronise), checked first
    agree("LLM()", {**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)}, "eos": eos_token_ids,
                    **{f"model.{f.name}": getattr(model, f.name) for f in dataclasses.fields(model)
                       if f.name != "name"}})
    placements = make_placements(config.tensor_parallel_size, config.data_parallel_size)
    config = config.replace(seed=shared_seed(config.seed))       # several hosts: one engine seed for all
    placements[0].check(model)            # heads that do not divide: before any weight is read
    check_backend(config.attn_backend, model)
    if config.attn_backend == "mosaic":   # (a GPU: EngineConfig.resolve refuses it elsewhere) Hopper, head_dim 64/128
        from pallas_kernels.mosaic import check_hopper
        check_hopper(placements[0].devices[0], model.head_dim)
    if len(placements) == 1:
        engine = LLMEngine(model, config, load(placements[0]), eos_token_ids, cap_max_model_len, placements[0])
    else:
        engine = DPEngine(model, config, load, eos_token_ids, placements, cap_max_model_len)
    for replica in getattr(engine, "replicas", [engine]):
        replica.tokenizer = tokenizer
    return engine


@contextlib.contextmanager
def on_replica(engine, rank: int | None):
    """Requests added inside go to replica `rank` (vLLM's data_parallel_rank; checked by the caller); None, or an
    engine of one replica: where they would go anyway."""
    pin = rank is not None and hasattr(engine, "pinned")
    if pin:
        engine.pinned = rank
    try:
        yield
    finally:
        if pin:
            engine.pinned = None


def sized_stats(engine) -> dict:
    """engine.stats() with `replicas` (dp = 1: itself), `data_parallel_size` and `tensor_parallel_size` at any size."""
    st = engine.stats()
    st = st if "replicas" in st else {**st, "data_parallel_size": 1, "replicas": [dict(st)]}
    return {**st, "tensor_parallel_size": engine.config.tensor_parallel_size}


def outstanding(q: Sequence) -> int:
    """Tokens a sequence still has to compute (its prompt) or generate (up to max_tokens)."""
    return len(q) - q.num_computed_tokens + q.params.max_tokens - q.num_output_tokens


def outstanding_tokens(engine: LLMEngine) -> int:
    """A replica's work left: its sequences' `outstanding` tokens."""
    s = engine.scheduler
    return sum(outstanding(q) for q in (*s.waiting, *s.building, *s.running))


class DPEngine:
    def __init__(self, model: ModelConfig, config: EngineConfig, load: Callable[[Placement], dict],
                 eos_token_ids: tuple[int, ...], placements: list[Placement], cap_max_model_len: bool = False):
        self.model_config = model
        params = [load(p) for p in placements]
        if not config.num_kvcache_blocks:
            # size the pool once, from replica 0's device after every replica's weights are in but before any
            # pool is: every replica gets the same pool (and the same max_model_len cap)
            kv_dtype = kv_cache_dtype(config.kv_cache_dtype, config.dtype)     # fp8: twice the blocks of bf16
            config = config.replace(num_kvcache_blocks=num_blocks_for_memory(
                placements[0].kv_view(model), config, kv_dtype, strict=not cap_max_model_len,
                device=placements[0].local_device))
        self.replicas = [LLMEngine(model, config, p, eos_token_ids, cap_max_model_len, placement)
                         for p, placement in zip(params, placements)]
        del params
        for r in self.replicas[1:]:      # one draw sequence in submission order: requests without a seed get the
            r.rng = self.replicas[0].rng  # seeds (so the tokens) one replica would give them, no two the same
        self.config = self.replicas[0].config
        self._owner: dict[int, LLMEngine] = {}            # seq_id -> its replica, until a step after it finished
        self._just_finished: list[Sequence] = []
        self._load: dict[LLMEngine, int] | None = None     # outstanding tokens per replica (add_request)
        self.pinned: int | None = None                    # a replica index the next adds go to (data_parallel_rank)
        self._pool: ThreadPoolExecutor | None = None      # launches replicas 1.. (made at the first step)
        self._launching = {r: threading.Lock() for r in self.replicas}   # held by a pool thread while it launches
        self._generation = 0                              # bumped when a step is left by an exception (`_settle`)
        self.scheduler = SchedulerView(self)
        self.block_manager = BlockManagerView(self.replicas)
        self.runner = RunnerView(self.replicas)

    def warmup(self, progress=None) -> None:
        """Replica 0 compiles every bucket; the others load those executables onto their own devices
        (ExecutableCache / parallel/relocate.py: milliseconds a step), or compile where that cannot be done."""
        t0 = time.perf_counter()
        self.replicas[0].runner.warmup(progress)
        t1 = time.perf_counter()
        with ThreadPoolExecutor(len(self.replicas) - 1) as pool:
            list(pool.map(lambda r: r.runner.warmup(progress), self.replicas[1:]))
        t2 = time.perf_counter()
        for r in self.replicas:      # first runs and tiny requests; compilations count from the end of these
            r.warmup()
        rest = [r.warmup_phases for r in self.replicas]
        self.warmup_phases = dict(compile_s=t1 - t0, other_replicas_s=t2 - t1,
                                  **{k: sum(p[k] for p in rest) for k in ("first_runs_s", "warm_requests_s")})

    # -- requests ---------------------------------------------------------------------------------
    def check_request(self, token_ids: list[int], params: SamplingParams, where: str = "prompt") -> SamplingParams:
        return self.replicas[0].check_request(token_ids, params, where)

    def add_request(self, token_ids: list[int], params: SamplingParams, prompt_source: Sequence | None = None,
                    cache_salt: str | None = None, reasoning_end: int | None = None) -> Sequence:
        # the samples of one request stay on one replica (they share its cached prompt); the replicas' loads are
        # counted once a step and kept up to date by the adds (counting them at each add made N adds O(N^2))
        if self._load is None:
            self._load = {r: outstanding_tokens(r) for r in self.replicas}
        replica = (self._owner.get(prompt_source.seq_id) if prompt_source is not None else None) or \
            (self.replicas[self.pinned] if self.pinned is not None else min(self.replicas, key=self._load.__getitem__))
        seq = replica.add_request(token_ids, params, prompt_source, cache_salt, reasoning_end)
        self._owner[seq.seq_id], self._load[replica] = replica, self._load[replica] + outstanding(seq)
        return seq

    def owner(self, seq: Sequence) -> LLMEngine:
        return self._owner[seq.seq_id]

    def abort(self, seq: Sequence, drop: int = 0) -> None:
        if seq.seq_id in self._owner:
            self._owner.pop(seq.seq_id).abort(seq, drop)

    def has_unfinished(self) -> bool:
        return any(r.has_unfinished() for r in self.replicas)
    has_unfinished_requests = has_unfinished                  # (vLLM's name)

    def warmup_extras(self, params: SamplingParams) -> int:
        """LLMEngine.warmup_extras on every replica; compilations are counted from the end of the last."""
        n = sum(r.warmup_extras(params) for r in self.replicas)
        for r in self.replicas:
            r.compilations_at_warmup = r.compile_counter.count
        return n

    # -- one step ---------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Prepare a step on every replica with work (schedule, pack: Python, this thread), launch them all at
        once (one thread per replica: see `_launch_all`), then read them in turn."""
        with recovering(self, []):      # (any exception, Ctrl-C too: the replicas' sequences compute their KV again)
            try:
                return self._step()
            except BaseException:
                self._settle()          # (no launch this step queued may still run, or start, once it is left)
                raise

    def _step(self) -> list[Sequence]:
        self._load = None
        todo = [(r, r.prepare()) for r in self.replicas if r.has_unfinished() or r.in_flight is not None]
        todo = [(r, p) for r, p in todo if p is not r.idle] or todo[:1]   # (one idle replica's sleep at most)
        error = self._launch_all([(r, p) for r, p in todo if not callable(p)])
        # (a launch that failed leaves its plan without ids: the others are still recorded, then it is raised)
        reads = [p if callable(p) else r.finish_dispatch(p) for r, p in todo if callable(p) or p.ids is not None]
        if error is not None:
            raise error
        updated = [seq for read in reads for seq in read()]
        for seq in self._just_finished:   # kept one step longer: a stop string's cut (LLM._process_text) is theirs
            self._owner.pop(seq.seq_id, None)
        self._just_finished = [seq for seq in updated if seq.finish_reason is not None]
        return updated

    def _launch_all(self, plans: list) -> BaseException | None:
        """Launch the replicas' device calls: this thread launches the first, a pool thread each other one.
        A launch spends most of its ~0.8 ms (Qwen3-0.6B) in XLA's C++ with the GIL released, so launches from
        several threads overlap: on 2 H200s two launches took 0.90 ms from two threads against 1.78 ms one after
        the other (scripts/probe_launch.py). The Python work (schedule, pack, apply) stays on this thread: a
        thread that runs Python while another waits for the GIL makes that one wait up to the interpreter's
        5 ms switch interval. Returns the first launch's exception, if any (every other launch still runs)."""
        if len(plans) < 2:
            for r, p in plans:
                r.launch(p)
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(len(self.replicas) - 1, thread_name_prefix="jaxinfer-dp-launch")
        futures, errors = [], []
        try:       # (the submits too: a Ctrl-C landing between them must still wait for those queued)
            for r, p in plans[1:]:
                futures.append(self._pool.submit(self._launch_one, r, p, self._generation))
            plans[0][0].launch(plans[0][1])
        except BaseException as e:      # (Ctrl-C too) the other launches still finish and are recorded first:
            errors.append(e)            # one left running would write its masks while recovery resets the guides
        for f in futures:
            while True:
                try:
                    f.result()
                except KeyboardInterrupt as e:      # a Ctrl-C while waiting: wait on until that launch is done
                    errors.append(e)
                    if not f.done():
                        continue
                except BaseException as e:
                    errors.append(e)
                break
        return errors[0] if errors else None

    def _launch_one(self, replica: LLMEngine, plan, generation: int) -> None:
        """A pool thread's launch; skipped when the step that queued it was left by an exception meanwhile."""
        with self._launching[replica]:
            if generation == self._generation:
                replica.launch(plan)

    def _settle(self) -> None:
        """A step is left by an exception: its queued launches that have not begun will not run, and one that runs
        is waited for (a Ctrl-C can land inside `submit` once the launch is queued, before `_launch_all` lists it,
        or where it has stopped waiting)."""
        self._generation += 1
        for lock in self._launching.values():
            lock.acquire()
            lock.release()

    @property
    def step_log(self) -> list | None:
        logs = [r.step_log for r in self.replicas]
        return None if logs[0] is None else [e for log in logs for e in log]

    @step_log.setter
    def step_log(self, value: list | None) -> None:
        for r in self.replicas:
            r.step_log = None if value is None else list(value)

    def stats(self) -> dict:
        per = [r.stats() for r in self.replicas]
        total = {k: (max(s[k] for s in per) if k in _NOT_SUMMED else sum(s[k] for s in per)) for k in per[0]}
        return {**total, "data_parallel_size": len(per), "replicas": per}
