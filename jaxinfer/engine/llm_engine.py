"""The engine core without strings: add requests, run steps, abort, report stats. `LLMEngine.step()` schedules,
packs, dispatches the compiled step and applies the sampled ids: what `LLM.generate` loops over and what the HTTP
server drives from its own thread."""
from __future__ import annotations

import functools
import time
from typing import Callable

import numpy as np

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.engine.batch import StepPlan, bucket_for, pack, pack_multistep
from jaxinfer.engine.block_manager import BlockManager, salt_seed
from jaxinfer.engine import extras as extras_mod
from jaxinfer.engine.executables import CompileCounter, counts_compiles
from jaxinfer.engine.memory import check_pool_fits, num_blocks_for_memory
from jaxinfer.engine.one_thread import recovering
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.model.kv_scales import kv_cache_dtype
from jaxinfer.engine.sequence import Sequence, is_finished, stamp_token_times
from jaxinfer.multistep import STOP_IDS
from jaxinfer.parallel import Placement
from jaxinfer.sampling import batch_filter, device_seed
from jaxinfer.sampling_params import SamplingParams


class LLMEngine:
    idle = staticmethod(lambda: time.sleep(0.002) or [])   # what `prepare` returns while only indexes are built
    def __init__(self, model: ModelConfig, engine: EngineConfig, params, eos_token_ids: tuple[int, ...] = (),
                 cap_max_model_len: bool = False, placement: Placement | None = None):
        """`engine` must be resolved (EngineConfig.resolve). cap_max_model_len: max_model_len was left to the
        model; lower it to what the KV pool holds (as vLLM) instead of refusing a pool that cannot hold it.
        placement: the devices of this replica (parallel/; None: the first device), params already on them."""
        if not engine.resolved:
            raise ValueError(f"the engine needs a resolved EngineConfig (EngineConfig.resolve), got {engine}")
        self.model_config = model
        self.async_scheduling = engine.async_scheduling
        self.multistep = True             # K-step decode calls allowed (False: one step per call, for A/B runs)
        self.in_flight = None             # (batch, device ids) of the step dispatched but not read yet
        self.tokenizer = None             # set by LLM: bad_words / choices are read with it (check_vocab)
        self.grammar_wait = True          # False (the server's core): json / regex indexes built in the background
        # the pool is sized from one device's memory and its share of the KV (K'/tp kv heads)
        kv_model = placement.kv_view(model) if placement is not None else model
        device = placement.local_device if placement is not None else None
        kv_dtype = kv_cache_dtype(engine.kv_cache_dtype, engine.dtype)        # fp8: twice the blocks of bf16
        num_blocks = engine.num_kvcache_blocks or num_blocks_for_memory(kv_model, engine, kv_dtype,
                                                                        strict=not cap_max_model_len, device=device)
        if cap_max_model_len:
            engine = engine.replace(max_model_len=min(engine.max_model_len, num_blocks * engine.block_size))
        self.config = engine.replace(num_kvcache_blocks=num_blocks)     # (the pool as sized)
        check_pool_fits(kv_model, engine, num_blocks, device=device)
        self.runner = ModelRunner(model, engine, params, num_blocks, placement)
        self.block_manager = BlockManager(num_blocks, engine.block_size, engine.enable_prefix_caching)
        self.scheduler = Scheduler(engine, self.block_manager, eos_token_ids)
        self.extras = extras_mod.ExtrasRunner(self.runner, engine.max_num_seqs)   # penalties / logprobs
        self.rng = np.random.default_rng(engine.seed)
        # kv_tokens_read: context tokens the steps' attention read (roofline); multistep_calls: K-step decode calls
        self.counters = dict(prompt_tokens=0, generated_tokens=0, prefill_steps=0, decode_steps=0,
                             kv_tokens_read=0, padded_tokens=0, multistep_calls=0)
        # host seconds scheduling + packing, dispatching, waiting for sampled ids, applying them (no wait: host-bound)
        self.host_time = dict(schedule_s=0.0, dispatch_s=0.0, wait_s=0.0, apply_s=0.0)
        self.compile_counter = CompileCounter()     # owned: its listener goes with the engine
        self.compilations_at_warmup, self.warmup_phases = 0, {}
        self.step_log: list | None = None     # a list: every step's host times (scripts/timing.py, STEP_LOG_COLUMNS)

    @counts_compiles
    def warmup(self, progress=None) -> None:
        """Compile every step, run each once (its first execution loads kernels), run two tiny requests; the
        phases' seconds go to `warmup_phases` (scripts/bench.py reports them with runner.compile_s)."""
        t = [time.perf_counter()]
        for phase in (lambda: self.runner.warmup(progress), self.runner.run_idle, self._warm_requests):
            phase()
            t.append(time.perf_counter())
        self.warmup_phases = dict(compile_s=t[1] - t[0], first_runs_s=t[2] - t[1], warm_requests_s=t[3] - t[2])
        self.compilations_at_warmup = self.compile_counter.count

    def _warm_requests(self) -> None:
        """Run two tiny requests through the whole path (pack, put, prefill, 1- and K-step decode, read back,
        apply), so nothing is left lazy for the first real request (it took 137 ms against 7-9 ms on the
        H200); then forget them (counters, host times, their prefix-cache blocks)."""
        bs = self.config.block_size
        n = max(1, min(bs + 1, self.config.max_model_len - 20))
        m = min(18, self.config.max_model_len - n)
        if m < 1 or -(-(n + m) // bs) * 2 > self.block_manager.num_free_blocks:       # (max_model_len 1: none)
            return
        sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=m, seed=0)   # (seeded: the RNG stays)
        seqs = [self.add_request([i % self.model_config.vocab_size] * n, sp) for i in range(2)]
        while not all(is_finished(s) for s in seqs):
            self.step()
        if self.in_flight is not None:
            self._read_in_flight()
        self.block_manager.reset_prefix_cache()
        self.counters = dict.fromkeys(self.counters, 0)
        self.host_time = dict.fromkeys(self.host_time, 0.0)

    # -- requests ---------------------------------------------------------------------------------
    def check_request(self, token_ids: list[int], params: SamplingParams, where: str = "prompt") -> SamplingParams:
        """ValueError (naming the value) for a request that can never run; else its params, max_tokens None resolved."""
        if not isinstance(params, SamplingParams) or len(token_ids) == 0:
            raise ValueError(f"{where} is empty: give at least one token" if isinstance(params, SamplingParams) else
                             f"{where}: sampling params must be a SamplingParams, got {type(params).__name__}")
        n, V, cfg = len(token_ids), self.model_config.vocab_size, self.config
        isint = lambda t: isinstance(t, (int, np.integer)) and not isinstance(t, bool)   # noqa: E731
        if bad := [t for t in token_ids if not (isint(t) and 0 <= t < V)]:
            why = "out of vocabulary: ids are in" if isint(t := bad[0]) else "that is not an int: ids are ints in"
            raise ValueError(f"{where} has token id {t!r} {why} [0, {V})")
        if n > cfg.max_model_len:        # exactly max_model_len is taken, as vLLM: one token, finish "length"
            raise ValueError(f"{where} has {n} tokens, more than max_model_len={cfg.max_model_len} (the decoder "
                             f"prompt is longer than the maximum model length)")
        room = min(cfg.max_model_len, self.block_manager.num_blocks * cfg.block_size) - n
        params = params.clone().up_to(max(1, room))      # (clone: validated again: a stop list edited in place)
        params.check_vocab(V, eos=self.scheduler.eos, tokenizer=self.tokenizer, wait=self.grammar_wait,
                           max_logprobs=cfg.max_logprobs)
        need = -(-min(n + params.max_tokens - 1, cfg.max_model_len) // cfg.block_size)   # (the last token: no KV)
        if need > self.block_manager.num_blocks:
            raise ValueError(f"{where} needs {need} KV blocks for {n} prompt + {params.max_tokens} output tokens "
                             f"but the pool has only {self.block_manager.num_blocks} (num_kvcache_blocks)")
        return params

    def add_request(self, token_ids: list[int], params: SamplingParams, prompt_source: Sequence | None = None,
                    cache_salt: str | None = None, reasoning_end: int | None = None) -> Sequence:
        """One sequence (an n > 1 request is n: add `params.for_sample(i)` for each i, sample 0 as the others'
        `prompt_source`: they reuse its cached prompt KV). cache_salt: vLLM's (only requests with the same salt, or
        none, share cached blocks). reasoning_end: structured outputs apply after this id (`</think>`)."""
        params = self.check_request(token_ids, params)      # (max_tokens None: the room the request has)
        if params.n != 1:
            raise ValueError(f"LLMEngine.add_request runs one sample, got n={params.n}: add "
                             f"params.for_sample(i) for each i in range(n) (LLM.generate does)")
        seed = params.seed if params.seed is not None else int(self.rng.integers(0, 2**31 - 1))
        seq = Sequence([int(t) for t in token_ids], params, device_seed(seed), self.config.block_size)
        seq.arrival_time = time.perf_counter()
        seq.prompt_source = prompt_source
        seq.hash_seed, seq.reasoning_end = salt_seed(cache_salt), reasoning_end     # (Sequence.constraint)
        self.counters["prompt_tokens"] += len(seq)
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence, drop: int = 0) -> None:     # drop: tokens read past a stop string, not counted
        self.scheduler.finish(seq, "abort", drop)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()
    has_unfinished_requests = has_unfinished                  # (vLLM's name)

    # -- one step ---------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one step; return the sequences that got a new token (finished ones included)."""
        with recovering(self, []):      # (any exception, Ctrl-C too: its sequences compute their KV again next step)
            return self.dispatch()()

    def dispatch(self) -> Callable[[], list[Sequence]]:
        """The first half of `step`: schedule and dispatch. Returns the second half, which reads a dispatched
        step's ids (may block) and applies them. Three parts (`prepare`, `launch`, `finish_dispatch`), so that
        data-parallel replicas (engine/dp_engine.py) can launch their device calls from threads at once.

        With async scheduling (the default) the step dispatched here is read back by the NEXT call: the host
        schedules step N+1 while the GPU runs step N, and sampled ids flow from N to N+1 on the device (K-step
        calls too: multistep.py). The step in flight is read here first (blocking) before admitting waiting
        requests: prompts are never built from tokens still on the device."""
        plan = self.prepare()
        if callable(plan):
            return plan
        self.launch(plan)
        return self.finish_dispatch(plan)

    @counts_compiles
    def prepare(self):
        """Host work before the device call: read what must be read first, schedule, pack. Returns a read
        function when there is nothing to launch, else the plan that `launch` and `finish_dispatch` take."""
        done = None                             # what a read made here returns
        if self.runner.lost_buffers() | self.extras.lost_buffers():   # an interrupted call took the KV pages
            self.in_flight = None
            self.scheduler.recompute_all()
        # (a queue that cannot be admitted yet does not force a read; a json / regex mask: extras.in_flight_tokens)
        if self.in_flight is not None and (self.scheduler.can_admit() or not self.async_scheduling):
            if not self.async_scheduling:
                return self._read_in_flight
            done = self._read_in_flight()
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch is None:
            if self.in_flight is not None:
                return self._read_in_flight
            if done is not None or not self.scheduler.has_unfinished():   # nothing left: a step returns [] (vLLM)
                return lambda: done or []
            if self.scheduler.building:
                return self.idle                               # (only json / regex indexes being built: grammar.py)
            raise RuntimeError("scheduler found no work although requests are pending (pool too small?)")
        key = bucket_for(self.config, (r := self.runner).widths, batch, r.chunk_pages)
        K = self._plan_steps(batch, key)
        extras = extras_mod.choose(batch) if K == 1 else None       # penalties / logprobs: K = 1 (scheduler)
        if extras is not None:
            packed = None                                            # packed and sent by ExtrasRunner
        elif K > 1:
            key = bucket_for(self.config, r.widths, batch, r.chunk_pages)     # the look-ahead blocks may widen W
            s = self.scheduler
            packed = pack_multistep(batch, key[2], key[3], self.config.block_size, r.num_slots, [s.stop_ids(q) for q in
                                    batch.seqs], [s.remaining(q) for q in batch.seqs], r.chunk_pages)
        else:
            packed = pack(batch, key[1], key[2], key[3], self.config.block_size, r.num_slots, r.chunk_pages)
        # a K-step call: step k reads k more tokens per row (rows that stop early read less: an upper bound)
        new_tokens = sum(batch.num_new_tokens)
        ctx = sum([s.num_computed_tokens for s in batch.seqs]) + new_tokens
        self.counters["kv_tokens_read"] += K * ctx + len(batch.seqs) * K * (K - 1) // 2
        self.counters["padded_tokens"] += K * (key[1] - new_tokens)
        self.counters["prefill_steps" if batch.is_prefill else "decode_steps"] += K
        self.counters["multistep_calls"] += K > 1
        return StepPlan(batch, key, K, batch_filter(s.filter_kind for s in batch.seqs), extras, packed, done, t0,
                        time.perf_counter())

    @counts_compiles
    def launch(self, plan: StepPlan) -> None:
        """The device call of a prepared step (asynchronous): its sampled ids go to `plan.ids`."""
        key, plan.t_launch = plan.key, time.perf_counter()     # (replicas launch once all have prepared)
        packed = self.runner.put(plan.packed) if plan.packed is not None else None
        plan.t_put = time.perf_counter() - plan.t_launch
        if plan.extras is not None:
            xkey = self.extras.key_for(key + (plan.filtered,), plan.extras)
            plan.pending = self.extras.dispatch(plan.batch, xkey, self.config.block_size, self.scheduler.eos,
                                                self.in_flight)
            ids = self.extras.sampled_ids()
        elif plan.K > 1:
            ids = self.runner.run(("multistep", *key[1:], plan.filtered, plan.K), packed)
        else:
            ids = self.runner.run(key + (plan.filtered,), packed, plan.packed)
        # start the device -> host copy of the ids now: it runs as soon as the step ends instead of when the host
        # asks (reading a ready array cost ~0.4 ms a step on the H200 host: a data-parallel round pays it per replica)
        ids.copy_to_host_async()
        plan.ids, plan.t2 = ids, time.perf_counter()

    def finish_dispatch(self, plan: StepPlan) -> Callable[[], list[Sequence]]:
        """Bookkeeping after `launch`; returns the read function `dispatch` returns."""
        batch, done = plan.batch, plan.done
        self.scheduler.on_dispatch(batch)
        self.host_time["schedule_s"] += plan.t1 - plan.t0
        self.host_time["dispatch_s"] += plan.t2 - plan.t_launch
        entry = None   # kind, rows, T, schedule, dispatch, wait, apply (the read fills these two), transfer, W, context
        if self.step_log is not None:
            ctx = sum(s.num_computed_tokens + n for s, n in zip(batch.seqs, batch.num_new_tokens))
            self.step_log.append(entry := ["prefill" if batch.is_prefill else "decode", len(batch.seqs), plan.key[1],
                                           plan.t1 - plan.t0, plan.t2 - plan.t_launch, 0.0, 0.0, plan.t_put,
                                           plan.key[-1], ctx])
        prev, self.in_flight = self.in_flight, (batch, plan.ids, entry, plan.pending)
        if prev is not None:
            return functools.partial(self._apply, *prev)
        return (lambda: done) if done is not None else list if self.async_scheduling else self._read_in_flight

    def _read_in_flight(self) -> list[Sequence]:
        prev, self.in_flight = self.in_flight, None
        return self._apply(*prev)

    @counts_compiles
    def _apply(self, batch, ids, entry=None, pending=None) -> list[Sequence]:
        """Read a dispatched step's sampled ids (blocks until it ran) and apply them."""
        t0 = time.perf_counter()
        ids, t1 = np.asarray(ids), time.perf_counter()
        if batch.num_steps > 1:
            updated, count = self.scheduler.postprocess_steps(batch, ids[:, :len(batch.seqs)])
        else:
            count = len(updated := self.scheduler.postprocess(batch, ids[:len(batch.seqs)]))
            if pending is not None:
                extras_mod.apply(batch, updated, pending)
        now, h = time.perf_counter(), self.host_time
        h["wait_s"], h["apply_s"] = h["wait_s"] + t1 - t0, h["apply_s"] + now - t1
        if entry is not None:
            entry[5:7] = t1 - t0, now - t1
        stamp_token_times(updated, now, one_each=not batch.is_prefill and batch.num_steps == 1)
        self.counters["generated_tokens"] += count
        return updated

    @counts_compiles
    def warmup_extras(self, params: SamplingParams) -> int:
        """Compile (and run once) the extras step variants requests like `params` need, every bucket; how many."""
        keys = extras_mod.warmup_keys(self.config, self.runner.widths, self.extras, params, self.tokenizer)
        if keys:
            self.extras.warmup(keys)
            self.compilations_at_warmup = self.compile_counter.count
        return len(keys)

    def _plan_steps(self, batch, key) -> int:
        """Decode steps for this call (multistep.py): K > 1 only in a bucket with K-step variants (plan_steps)."""
        if batch.is_prefill or not self.multistep or key[2] not in self.runner.multistep_buckets():
            return 1
        queued = self.in_flight is not None and self.in_flight[0].num_steps > 1
        return self.scheduler.plan_steps(batch, self.runner.multistep_ks(), STOP_IDS, queued)

    def stats(self) -> dict:
        bm, s = self.block_manager, self.scheduler
        return dict(kv_blocks_total=bm.num_blocks, kv_blocks_free=bm.num_free_blocks,
                    block_size=self.config.block_size, kv_cache_dtype=str(self.runner.kv_dtype),
                    preemptions=s.num_preemptions, prefix_cache_hit_tokens=s.num_prefix_hit_tokens,
                    prefix_cache_query_tokens=bm.query_tokens,
                    compilations=self.compile_counter.count - self.compilations_at_warmup,
                    compiled_buckets=len(c := self.runner.compiled),
                    compiled_multistep=sum(k[0] == "multistep" for k in c), compiled_extras=len(self.extras.compiled),
                    running=len(s.running), waiting=len(s.waiting) + len(s.building),
                    **{**self.counters, "generated_tokens": self.counters["generated_tokens"] - s.num_dropped_tokens},
                    **{f"host_{k}": v for k, v in self.host_time.items()})
