"""Owns the weights and the paged KV cache; compiles one step per bucket at start-up and runs them.

Every bucket (kind, T tokens, B rows, W block-table width) is compiled ahead of time, so serving never
compiles; the executables live in an `ExecutableCache` (engine/executables.py), shared by every LLM in the process.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.engine.memory import cache_head_dim
from jaxinfer.model import layers, xla_attention, xla_decode
from jaxinfer.model.attention import cache_dtypes, cache_layout
from jaxinfer.model.kv_scales import kv_cache_dtype, with_kv_scales
from jaxinfer.parallel import Placement, kv_heads, make_placements
from jaxinfer.parallel.layout import KV_SPEC
from jaxinfer.multistep import make_multistep, multistep_layout
from jaxinfer.step import RESAMPLE_FIELDS, batch_layout, draws_from_candidates, idle_batch, jit_step, make_resample, \
    make_step, resample_fields
from jaxinfer.engine.executables import SHARED_EXECUTABLES, ExecutableCache
from jaxinfer.xla_options import step_compiler_options

log = logging.getLogger(__name__)
COMPILE_THREADS: int | None = None   # None: compile_threads() picks
# warm-up runs each program once as soon as it is compiled, while others compile (False: only after the last
# compile, for A/B runs). On 2xH200, dp=2 on W gave 32,359 / 32,454 tok/s with it and 33,983 / 32,325 without
# (the spread of repeated runs); it took Qwen3-32B tp=2's first runs (17.6 s before) out of its warm-up.
OVERLAP_FIRST_RUNS = True
# warm-up's second pass (run_idle) skips a program whose first run took this long: what that pass saves a request
# (milliseconds) is nothing beside such a step, and the xla backend's widest programs (40,960-token tables) took
# seconds each, most of its first_runs_s (docs/performance.md, twenty-ninth run).
SECOND_RUN_MAX_S = 1.0
MULTISTEP_KS = (4, 16)        # auto: steps per call compiled for small batches (the engine picks per call)
# decode buckets up to this many rows get K-step variants. Measured on the H200 (0.6B, 1024-token context,
# TPOT K-step vs one step per call): batch 1 1.39 vs 1.51 ms, batch 8 1.61 vs 1.64, batch 32 2.44 vs 2.24 ms, so
# bucket 32 runs one step per call (and warm-up compiles 4 programs fewer).
MULTISTEP_MAX_ROWS = 8
# decode buckets of at least this many rows also get a "top_k_only" step: a batch whose rows are all greedy or
# have a small top_k (Qwen3's own sampling settings) draws inside the step, from its candidates alone
# (sampling.sample), with no plain draw over the vocabulary and no "resample" program (a second LM-head matmul
# and launch) after it. Smaller buckets and the xla backend (whose warm-up it would push past 60 s) resample.
TOP_K_STEP_MIN_ROWS = 128


def compile_threads() -> int:
    """Steps compiled at once at warm-up: COMPILE_THREADS, or one per two CPU cores (up to 32). A compile keeps
    about two cores busy: on the H200's 16-core host 16 threads made each compile twice as long as 8 did."""
    return max(1, COMPILE_THREADS or min(32, (os.cpu_count() or 1) // 2))


def decode_chunk_pages(engine: EngineConfig) -> int:
    """Pages a chunk of the xla backend's chunked decode reads (model/xla_decode.py), whose steps take flat
    block tables; 0 for the other backends and decode forms (tables of one row each)."""
    if engine.attn_backend != "xla" or xla_decode.DECODE_FORM != "chunks":
        return 0
    return max(1, min(xla_decode.DECODE_CHUNK // engine.block_size, engine.max_blocks_per_seq))


def program_switches() -> tuple:
    """The module switches a compiled step depends on (in every executables key): gemv's, the xla decode's."""
    x = xla_decode
    return layers.GEMV_MAX_ROWS, layers.GEMV_FUSE, x.DECODE_FORM, x.DECODE_CHUNK, x.MERGE, xla_attention.GATHER


def rows_out(kind: str) -> bool:
    """Whether a step of this kind keeps its sampled rows (for the "resample" program of filtered batches): the
    model steps do, in a donated buffer updated in place (as a fresh output each step, dp=2 lost 8-11% on W)."""
    return kind in ("prefill", "decode")


class ModelRunner:
    """One replica's weights, KV cache and compiled steps, on the devices of its `Placement` (parallel/): one
    device by default; with tensor_parallel_size > 1 a "tp" mesh, params and caches split by NamedSharding and
    each bucket compiled once as one SPMD program over the mesh."""

    def __init__(self, model: ModelConfig, engine: EngineConfig, params, num_blocks: int,
                 placement: Placement | None = None, executables: ExecutableCache | None = None):
        self.model, self.engine = model, engine
        self.executables = executables if executables is not None else SHARED_EXECUTABLES
        self.placement = placement or make_placements(1, 1, jax.devices()[:1])[0]
        self.mesh = self.placement.mesh if (tp := self.placement.tp) > 1 else None
        self.dtype = jnp.dtype(engine.dtype)
        self.interpret = self.placement.devices[0].platform != "gpu"
        # fp8 KV cache: per-layer k_scale / v_scale [L, 1] join the params (model/kv_scales.py)
        self.kv_dtype = kv_cache_dtype(engine.kv_cache_dtype, self.dtype)
        self.params = self._place(with_kv_scales(model, params, self.kv_dtype, tp))
        self.num_blocks, self.num_slots = num_blocks, num_blocks * engine.block_size
        # [P, bs, K', D] pages per layer (xla, pallas: one pair [L * P, ...] for all layers), split by kv head: each
        # device holds K'/tp heads (parallel/layout.py)
        shape = (num_blocks, engine.block_size, kv_heads(model, tp) if tp > 1 else model.num_key_value_heads,
                 cache_head_dim(engine.attn_backend, model.head_dim))
        kv_shape, pairs = cache_layout(engine.attn_backend, model.num_hidden_layers, shape,
                                       jnp.dtype(self.kv_dtype).itemsize, tp)
        # pallas fp8: V in pairs; xla fp8 off the GPU: byte pages. cache_kind: part of the shared executables' key
        self.k_dtype, v_shape, self.v_dtype = cache_dtypes(engine.attn_backend, self.kv_dtype, kv_shape,
                                                           not self.interpret)
        self.cache_kind = (pairs, kv_shape, str(self.k_dtype), v_shape, str(self.v_dtype))
        # xla reads all W pages of a row: a ladder of narrower tables lets short contexts read less. The kernels
        # read only the pages a row needs, but a [B, W] table for a 40k-token model (W = 2560) would be sent and
        # packed every step: they get one narrow width beside the full one (config.BACKEND_DEFAULTS).
        # The xla decode ("chunks" form) takes flat tables (engine/batch.py): its W is a budget of pages per row
        # on average, in whole chunks of `chunk_pages`.
        self.widths = engine.block_table_widths(decode=True)
        self.chunk_pages = decode_chunk_pages(engine)
        if self.chunk_pages:
            self.widths = tuple(sorted({-(-w // self.chunk_pages) * self.chunk_pages for w in self.widths}))
        self.compiled: dict[tuple[str, int, int, int, bool], object] = {}
        self.compile_s: dict[tuple, float] = {}      # seconds each step took to compile (or to load: relocate.py)
        self.max_rows = max(engine.max_num_seqs, *engine.decode_buckets)   # a bucket may exceed max_num_seqs
        self.hidden_size = model.hidden_size
        self._allocate()
        self._run_lock = threading.Lock()
        self._ran: set[tuple] = set()                # programs run once (run_once)
        self._first_run_s: dict[tuple, float] = {}   # each program's first run, seconds (warm-up's first pass)
        self.top_k_min_rows = TOP_K_STEP_MIN_ROWS    # fixed for this runner (buckets() and run() agree)
        self.direct_steps = {k for k in self.buckets() if k[0] == "decode" and k[4]}   # filtered inside the step

    def _place(self, params):
        """params onto this replica's devices with their tp shardings; arrays already there are kept (no copy,
        so the caller's reference does not double the weights' memory)."""
        targets = self.placement.param_shardings(params)
        return jax.tree.map(lambda a, s: a if getattr(a, "sharding", None) is not None and
                            a.sharding.is_equivalent_to(s, a.ndim) else jax.device_put(a, s), params, targets)

    def buckets(self) -> list[tuple[str, int, int, int, bool]]:
        """(kind, T, B, W, filtered[, K]) of every program to compile: one model step per bucket (unfiltered
        sampling; it also returns the sampled rows' hidden states), one "resample" program per row count that
        draws those rows again with top-k / top-p / min-p (step.make_resample: a batch that filters runs the
        step, then it; two variants: the vocabulary sorted, or small top_k's candidates), a "top_k_only" step for
        the large decode buckets (TOP_K_STEP_MIN_ROWS), and the K-step decode calls of small batches."""
        e = self.engine
        out = [("prefill", T, min(e.max_num_seqs, T), W, False)
               for T in e.prefill_buckets for W in e.prefill_table_widths(T)]
        out += [("decode", B, B, W, False) for B in e.decode_buckets for W in self.widths]
        if e.attn_backend != "xla":
            out += [("decode", B, B, W, "top_k_only") for B in e.decode_buckets if B >= self.top_k_min_rows
                    for W in self.widths]
        out += [("resample", B, B, 0, f) for B in sorted({k[2] for k in out if rows_out(k[0])})
                for f in (True, "top_k")]
        # K-step decode calls (multistep.py): small batches (host-bound) unless K is given; plain or small-top_k draws
        return out + [("multistep", B, B, W, f, K) for B in self.multistep_buckets() for W in self.widths
                      for K in self.multistep_ks() for f in (False, "top_k")]

    def multistep_ks(self) -> tuple[int, ...]:
        """Steps per call compiled: num_scheduler_steps, or MULTISTEP_KS up to max_model_len (xla: the largest)."""
        n, xla = self.engine.num_scheduler_steps, self.engine.attn_backend == "xla"
        auto = MULTISTEP_KS[-1:] if xla else MULTISTEP_KS
        return tuple(k for k in auto if k <= self.engine.max_model_len) if n is None else (() if n == 1 else (n,))

    def multistep_buckets(self) -> tuple[int, ...]:
        explicit = self.engine.num_scheduler_steps is not None     # (as vLLM's multi-step: every decode bucket)
        buckets = [B for B in self.engine.decode_buckets if explicit or B <= MULTISTEP_MAX_ROWS]
        return tuple(buckets) if self.multistep_ks() else ()

    def compile(self, key: tuple[str, int, int, int, bool], quiet: bool = False):
        if key not in self.compiled:
            kind, T, B, W, filtered, *K = key
            shared = (self.model, self.engine.attn_backend, str(self.dtype), str(self.kv_dtype), self.num_blocks,
                      self.engine.block_size, self.interpret, self.max_rows,
                      isinstance(self.params["layers"], tuple), self.cache_kind, len(self.placement.devices), key,
                      rows_out(kind), *program_switches())

            def build():
                rep = self.placement.replicated
                options = step_compiler_options(self.placement.devices[0].platform, len(self.placement.devices))
                if kind == "resample":
                    rows = jax.ShapeDtypeStruct(self.rows.shape, self.dtype, sharding=rep)
                    fields = jax.ShapeDtypeStruct((len(RESAMPLE_FIELDS) * B,), jnp.int32, sharding=rep)
                    fn = jax.jit(make_resample(self.model, B, self.max_rows, self.mesh, filtered), out_shardings=rep)
                    ids = jax.ShapeDtypeStruct((self.max_rows,), jnp.int32, sharding=rep)
                    return fn.lower(self.params, rows, fields, ids).compile(compiler_options=options)
                if kind == "multistep":
                    step = make_multistep(self.model, B, W, K[0], self.engine.attn_backend, self.interpret, filtered,
                                          self.mesh)
                    size = multistep_layout(B, W)["_size"][0]
                else:
                    step = make_step(self.model, kind, T, B, W, self.engine.attn_backend, self.interpret,
                                     self.max_rows, filtered, self.mesh, rows_out=rows_out(kind))
                    size = batch_layout(T, B, W)["_size"][0]
                packed = jax.ShapeDtypeStruct((size,), jnp.int32, sharding=rep)
                out = (rep, self.placement.sharding(KV_SPEC))      # the caches keep their split across steps
                args = (self.params, self.kv_caches, packed, self.last_ids)
                if rows_out(kind):                                  # the sampled rows' buffer (for "resample")
                    out, args = out + (rep,), args + (self.rows,)
                elif kind == "multistep":                           # and each row's last id, for the next call
                    out += (rep,)
                lowered = jit_step(step, out, (1, 4) if rows_out(kind) else (1,)).lower(*args)
                return lowered.compile(compiler_options=options)
            t0 = time.perf_counter()
            self.compiled[key] = self.executables.get(shared, self.placement.devices, build)
            self.compile_s[key] = time.perf_counter() - t0
            if not quiet and time.perf_counter() - t0 > 0.5:       # a step compiled (or relocated) lazily, mid-run
                log.info("the %s step for %d tokens, %d rows, %d-block tables: compiled or loaded in %.1f s",
                         kind, T, B, W, time.perf_counter() - t0)
        return self.compiled[key]

    def warmup(self, progress=None, threads: int | None = None) -> None:
        """Compile every bucket in parallel threads (XLA compiles outside the GIL) while this thread runs each
        compiled program once (`run_once`), so the devices' first runs overlap the other compiles. The runs stay
        on the calling thread, the one that serves."""
        keys = [k for k in self.buckets() if k not in self.compiled]
        with ThreadPoolExecutor(threads or compile_threads()) as pool:
            futures = {pool.submit(self.compile, k, True): k for k in keys}
            for future in as_completed(futures):
                future.result()
                if OVERLAP_FIRST_RUNS:
                    self.run_once(futures[future])
                if progress is not None:
                    progress.update(1)
        self._ran.clear()                  # and once more now that nothing compiles: see run_idle

    def run_idle(self) -> None:
        """Run every compiled program that has not run since `warmup` once (`run_once`). Warm-up runs each
        program twice: first while the others compile (kernel loading, CUDA graphs), then all of them after the
        last compile. Without the second pass the first request after `LLM()` took 13-16 ms against 6-7 ms on
        the H200 (measured; the suspect is device memory that compiling, i.e. autotuning, allocated and freed
        after a program's first run). The second pass costs milliseconds a program, except where a program's
        own run is long: those whose first run took SECOND_RUN_MAX_S or more are not run again."""
        for key in list(self.compiled):
            if self._first_run_s.get(key, 0.0) < SECOND_RUN_MAX_S:
                self.run_once(key)

    def run_once(self, key) -> None:
        """Run a compiled program once on an all-padding batch and read its ids back: the first execution of
        an executable (kernel loading, CUDA graph capture) and the first transfers then happen here, not in the
        first request. One at a time (a step donates the caches); a program that already ran is skipped."""
        with self._run_lock:
            if key in self._ran:
                return
            kind, T, B, W = key[:4]
            t0 = time.perf_counter()
            if kind == "resample":
                fields = np.zeros((len(RESAMPLE_FIELDS), B), np.int32)
                fields[RESAMPLE_FIELDS.index("top_p")] = np.float32(1.0).view(np.int32)
                self.last_ids = self.compile(key)(self.params, self.rows, self.put(fields.reshape(-1)), self.last_ids)
                np.asarray(self.last_ids)
            else:
                size = (multistep_layout(B, W) if kind == "multistep" else batch_layout(T, B, W))["_size"][0]
                np.asarray(self.run(key, self.put(idle_batch(size, T, B, W, self.num_slots))))
            self._ran.add(key)
            self._first_run_s.setdefault(key, time.perf_counter() - t0)

    def _allocate(self) -> None:
        """The device state each step donates and gets back, zeroed: the KV pages, the previous step's sampled ids,
        the last step's sampled rows' hidden states (its first B rows; what a filtering batch's "resample" reads)."""
        pairs, kv_shape, _, v_shape, _ = self.cache_kind
        self.kv_caches = list(zip(self.placement.zeros_kv(kv_shape, self.k_dtype, pairs),
                                  self.placement.zeros_kv(v_shape, self.v_dtype, pairs)))
        self.last_ids = self.placement.put(np.zeros((self.max_rows,), np.int32))
        self.rows = self.placement.put(np.zeros((self.max_rows, self.hidden_size), self.dtype))

    def lost_buffers(self, failed=None) -> bool:
        """Whether a call took the donated state and its outputs were not kept (a KeyboardInterrupt) or they carry a
        device error (`failed`: one_thread.failed); if so it is made again, zeroed (the old freed first: the pool is
        most of the memory), and the KV is recomputed."""
        state = (self.kv_caches, self.last_ids, self.rows)
        if not any(a.is_deleted() for a in (state[0][0][0], *state[1:])) and not (failed and failed(state)):
            return False
        for a in jax.tree.leaves(state):
            a.delete()
        self._allocate()
        return True

    def put(self, packed: np.ndarray) -> np.ndarray | jax.Array:
        """A step's packed batch as its compiled step takes it: the numpy array itself, which the call copies to
        the device(s) (one host -> device copy, replicated over tp) with less host work than a `device_put`
        first (~20 against ~100 us a step on the dev CPU); a global array when processes span hosts."""
        return self.placement.put(packed) if jax.process_count() > 1 else packed

    def run(self, key: tuple[str, int, int, int, bool], packed, source: np.ndarray | None = None) -> jax.Array:
        """Dispatch one step (asynchronous); returns the device array of sampled ids [max_rows]. `packed`: the
        step's batch as `put` gives it. A filtered key (key[4]) runs the bucket's step, then its "resample"
        program on the step's sampled rows, with the sampling fields of `source` (the packed batch as numpy;
        default `packed`); a "top_k" batch whose rows all draw from their candidates runs the bucket's
        "top_k_only" step alone where it has one (TOP_K_STEP_MIN_ROWS)."""
        kind, T, B, W, filtered = key[:5]
        if kind == "multistep":        # ids [K, B]; last_ids: each row's last id (-1: stopped), for the next call
            ids, self.kv_caches, self.last_ids = self.compile(key)(self.params, self.kv_caches, packed, self.last_ids)
        else:
            fields = resample_fields(np.asarray(packed if source is None else source), T, B, W) if filtered else None
            if filtered == "top_k" and (kind, T, B, W, "top_k_only") in self.direct_steps and \
                    draws_from_candidates(fields, B):
                filtered = "top_k_only"                    # drawn inside the step: no resample
            direct = filtered == "top_k_only"
            self.last_ids, self.kv_caches, self.rows = self.compile((kind, T, B, W, filtered if direct else False))(
                self.params, self.kv_caches, packed, self.last_ids, self.rows)
            if filtered and not direct:
                self.last_ids = self.compile(("resample", B, B, 0, filtered))(self.params, self.rows, self.put(fields),
                                                                              self.last_ids)
            ids = self.last_ids
        # ids are replicated over a mesh that may span hosts: read this host's copy
        return ids.addressable_data(0) if jax.process_count() > 1 else ids
