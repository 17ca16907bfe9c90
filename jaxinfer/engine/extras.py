"""Penalties and logprobs on the host side: which step variant a batch needs, the penalty slots, the
variants' executables and the device state, and the logprob rows read back into the sequences.

A batch in which no request asks for penalties or logprobs runs the plain compiled step (nothing here is
touched, nothing is compiled). Otherwise it runs the "extras" variant of its bucket (step.make_extras_step),
compiled on first use and counted in stats (`compiled_extras`); `LLMEngine.warmup_extras(params)` compiles
them ahead of time (benchmarks, servers that expect them).

Penalty counts live on the device, one row per slot: prompt_seen [S, V] bool and output_counts [S, V]
int32 (S = max_num_seqs; with tp > 1, V padded and split by vocabulary, as the logits are). A running request
with penalties holds a slot; slots of requests that stopped running (finished, or preempted: they restart at
position 0 and clear their slot) are taken back when needed. Only [B, 2 + 2W] fp32 logprob rows come back per
step, never [B, V].
"""
from __future__ import annotations

import collections
import threading
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import bad_words, structured
from jaxinfer.engine.batch import pack_extras
from jaxinfer.engine.runner import compile_threads, program_switches
from jaxinfer.engine.scheduler import PROMPT_LOGPROB_TOKENS
from jaxinfer.engine.sequence import Sequence, Status
from jaxinfer.parallel.layout import KV_SPEC, padded_vocab
from jaxinfer.parallel.vocab import VOCAB_SPEC
from jaxinfer.extras_step import make_extras_step
from jaxinfer.step import BAN_WIDTHS, BIAS_WIDTHS, Extras, extras_layout, idle_batch
from jaxinfer.xla_options import step_compiler_options

CPU_VARIANTS = 32               # extras programs an engine on the CPU holds (the least recently used go first)
LOGPROB_WIDTHS = (5, 20)        # static top-N widths: a batch asking N logprobs computes the smallest >= N


def logprob_width(n: int) -> int:
    """The top-N width a batch asking n logprobs computes: LOGPROB_WIDTHS' smallest >= n, past them (max_logprobs
    above 20) the power of two >= n (logprob_stats takes at most the vocabulary)."""
    return next((w for w in LOGPROB_WIDTHS if w >= n), 1 << (n - 1).bit_length())


def choose(batch) -> Extras | None:
    """The extras variant this batch needs, or None (the plain step)."""
    if not any(s.needs_extras for s in batch.seqs):       # the default path: one cheap pass
        return None
    ps = [s.params for s in batch.seqs]
    penalties = any(p.has_penalties for p in ps)
    asks = [p.logprobs for p in ps if p.logprobs is not None]
    prompt = batch.is_prefill and any(p.prompt_logprobs is not None for p in ps)
    bans = max((ban_width(s.params) for s in batch.seqs if s.banning), default=0)
    bias = bias_width(ps)
    bad = bad_words.width(max(len(s.bad_words_ids) for s in batch.seqs))   # (at most one entry per sequence)
    choice = max((s.choice.width for s in batch.seqs if s.choice is not None), default=0)
    grammar = next((s.grammar.rule.words for s in batch.seqs if s.grammar is not None), 0)
    if not (penalties or asks or prompt or bans or bias or bad or choice or grammar):
        return None
    n = max(asks + [p.prompt_logprobs for p in ps if prompt and p.prompt_logprobs is not None], default=0)
    return Extras(penalties, bool(asks), logprob_width(n), -1 if prompt else 0, bans, bias, bad, choice,   # -1: from
                  grammar)                                                                            # the bucket


def ban_width(params) -> int:
    """The ids a min_tokens row bans, its stop_token_ids and EOS ids: the BAN_WIDTHS one that holds them; 0 if none."""
    return 0 if not params.min_tokens else BAN_WIDTHS[len(params.stop_token_ids or ()) > BAN_WIDTHS[0] // 2]


def bias_width(params) -> int:
    """The smallest of BIAS_WIDTHS that holds every row's logit_bias / allowed_token_ids entries; 0 if none."""
    n = max((len(p.biased_ids()) for p in params if p.has_bias), default=0)
    return next(w for w in BIAS_WIDTHS if w >= n) if n else 0



class ExtrasRunner:
    """One engine's extras variants and penalty state (on its runner's devices)."""

    def __init__(self, runner, num_slots: int):
        self.runner = runner
        self.num_slots = num_slots                   # S; slot S is the padding slot (writes dropped)
        self.owner: list[Sequence | None] = [None] * num_slots
        self.slot_of: dict[int, int] = {}            # seq_id -> slot
        self.counts = None                           # (prompt_seen, output_counts), made on first use
        # (key, part) -> executable. On a CPU only the CPU_VARIANTS used last: the variant space is combinatorial,
        # and every program held keeps its code mapped (~200-300 memory mappings each; Linux allows 65,530)
        self.compiled: collections.OrderedDict[tuple, object] = collections.OrderedDict()
        self._keep = CPU_VARIANTS if runner.placement.devices[0].platform == "cpu" else None
        self._lock, self._lru = threading.Lock(), threading.Lock()
        self.drawless = False                        # a split variant's model part ran but its draw did not

    # -- slots ----------------------------------------------------------------------------------------
    def slots(self, seqs: list[Sequence]) -> list[int]:
        out = []
        for seq in seqs:
            if not seq.params.has_penalties:
                out.append(self.num_slots)
                continue
            slot = self.slot_of.get(seq.seq_id)
            if slot is None:
                slot = self._free_slot()
                self.owner[slot], self.slot_of[seq.seq_id] = seq, slot
            out.append(slot)
        return out

    def _free_slot(self) -> int:
        for i, o in enumerate(self.owner):
            if o is None or o.status is not Status.RUNNING:
                if o is not None:
                    del self.slot_of[o.seq_id]
                    self.owner[i] = None
                return i
        raise RuntimeError("no free penalty slot: more running sequences than max_num_seqs")

    # -- compile and run -------------------------------------------------------------------------------
    def key_for(self, key: tuple, extras: Extras) -> tuple:
        """(kind, T, B, W, filtered, extras) with prompt_rows fixed from the bucket's T."""
        if extras.prompt_rows < 0:
            extras = extras._replace(prompt_rows=min(key[1], PROMPT_LOGPROB_TOKENS))
        return (*key, extras)

    def compile(self, key: tuple, part: str = "whole"):
        """The executable of one extras variant, or of one part of a split one (split: "model" / "draw")."""
        with self._lru:
            exe = self.compiled.get((key, part))
            if exe is not None:
                self.compiled.move_to_end((key, part))
                return exe
        if key[-1].penalties:
            with self._lock:                     # the counts state is made once, whichever thread lowers first
                self._counts()
        r = self.runner
        kind, T, B, W, filtered, extras = key
        shared = ("extras", r.model, r.engine.attn_backend, str(r.dtype), str(r.kv_dtype), r.num_blocks,
                  r.engine.block_size, r.interpret, r.max_rows, isinstance(r.params["layers"], tuple),
                  r.cache_kind, len(r.placement.devices), self.num_slots, key, part, *program_switches())

        def build():
            step = make_extras_step(r.model, kind, T, B, W, r.engine.attn_backend, r.interpret, r.max_rows, filtered,
                                    r.mesh, extras, part)
            rep = r.placement.replicated
            packed = jax.ShapeDtypeStruct((extras_layout(T, B, W, extras)["_size"][0],), jnp.int32, sharding=rep)
            counts = self._counts() if extras.penalties else None
            if part == "draw":                  # (params, rows, packed, input tokens, counts): nothing donated
                rows = jax.ShapeDtypeStruct((B, r.hidden_size), r.dtype, sharding=rep)
                last = jax.ShapeDtypeStruct((B,), jnp.int32, sharding=rep)
                lowered = jax.jit(step, out_shardings=(rep, rep)).lower(r.params, rows, packed, last, counts)
            else:
                kv, split = r.placement.sharding(KV_SPEC), r.placement.sharding(VOCAB_SPEC)
                out = (rep, rep, kv, split) if part == "model" else (rep, kv, split, rep)
                jitted = jax.jit(step, donate_argnums=(1, 4), out_shardings=out)
                lowered = jitted.lower(r.params, r.kv_caches, packed, r.last_ids, counts)
            return lowered.compile(compiler_options=step_compiler_options(
                r.placement.devices[0].platform, len(r.placement.devices)))
        exe = r.executables.get(shared, r.placement.devices, build)
        with self._lru:
            self.compiled[(key, part)] = exe
            while self._keep and len(self.compiled) > self._keep:
                self.compiled.popitem(last=False)           # (compiled again if it is wanted again)
        return exe

    @staticmethod
    def split(key: tuple) -> bool:
        """Whether a variant runs as two programs: a decode step with json / regex rows, whose masks need the tokens
        of the step in flight: its model part is queued behind that step before the host reads them and writes the
        masks, its draw after (extras_step.make_extras_step's parts)."""
        return key[0] == "decode" and bool(key[-1].grammar)

    def parts(self, key: tuple) -> tuple[str, ...]:
        return ("model", "draw") if self.split(key) else ("whole",)

    def _run(self, key: tuple, packed: np.ndarray, masks=None):
        """Run a variant on a packed batch (masks: what writes a split variant's masks and returns the batch to draw
        with); returns the device logprob rows or None."""
        r, extras = self.runner, key[-1]
        counts = self._counts() if extras.penalties else None
        if not self.split(key):
            r.last_ids, r.kv_caches, counts, out = self.compile(key)(r.params, r.kv_caches, r.put(packed), r.last_ids,
                                                                     counts)
            self.counts = counts if extras.penalties else self.counts
            return out
        self.drawless = True      # until the draw is dispatched: an interrupt between the parts means a recompute
        rows, last, r.kv_caches, counts = self.compile(key, "model")(r.params, r.kv_caches, r.put(packed), r.last_ids,
                                                                     counts)
        self.counts = counts if extras.penalties else self.counts
        drawn = masks() if masks is not None else packed      # (waits for the step in flight's tokens)
        r.last_ids, out = self.compile(key, "draw")(r.params, rows, r.put(drawn), last, counts)
        self.drawless = False
        return out

    def _counts(self):
        if self.counts is None:
            placement, S = self.runner.placement, self.num_slots
            V = padded_vocab(self.runner.model.vocab_size, placement.tp)   # (split by vocabulary, as the logits)
            self.counts = tuple(placement.put(np.zeros((S, V), dt), VOCAB_SPEC) for dt in (bool, np.int32))
        return self.counts

    def lost_buffers(self) -> bool:
        """Whether the penalty counts were donated to a call whose outputs were not kept (runner.lost_buffers):
        then they are made again, zeroed, on next use, and the running requests must start over."""
        if self.drawless:
            self.drawless, self.counts = False, None
            return True
        if self.counts is None or not self.counts[0].is_deleted():
            return False
        self.counts = None
        return True

    def dispatch(self, batch, key: tuple, block_size: int, eos=frozenset(), in_flight=None):
        """Pack, send and run one extras step (asynchronous). Returns (key, device logprob rows or None,
        [(seq, prompt position)] of its prompt-logprob rows), for `apply`. in_flight: the engine's step in flight
        (a json / regex row's mask is packed with the token it sampled: in_flight_tokens)."""
        r = self.runner
        kind, T, B, W, filtered, extras = key
        packed, where, masks = pack_extras(batch, T, B, W, block_size, r.num_slots, extras,
                                           self.slots(batch.seqs), self.num_slots, r.chunk_pages, eos,
                                           lambda: in_flight_tokens(in_flight), self.split(key))
        out = self._run(key, packed, masks)
        if jax.process_count() > 1 and out is not None:   # replicated over hosts: read this host's copy
            out = out.addressable_data(0)
        if out is not None:
            out.copy_to_host_async()                     # as the ids (LLMEngine.dispatch): read back when ready
        return key, out, where

    def sampled_ids(self):
        """The step's sampled ids as the host reads them (runner.run's rule for a mesh spanning hosts)."""
        ids = self.runner.last_ids
        return ids.addressable_data(0) if jax.process_count() > 1 else ids

    def warmup(self, keys: list[tuple]) -> None:
        """Compile the given extras keys and run each once on an all-padding batch."""
        r = self.runner
        with ThreadPoolExecutor(compile_threads()) as pool:   # XLA compiles outside the GIL
            list(pool.map(lambda kp: self.compile(*kp), [(k, p) for k in keys for p in self.parts(k)]))
        for key in keys:
            kind, T, B, W, filtered, extras = key
            size = extras_layout(T, B, W, extras)["_size"][0]
            buf = idle_batch(size, T, B, W, r.num_slots)
            lay = extras_layout(T, B, W, extras)
            off, n = lay["pen_slot"]
            buf[off:off + n] = self.num_slots                       # padding rows: the dropped slot
            off, n = lay["repetition"]
            buf[off:off + n].view(np.float32)[:] = 1.0
            self._run(key, buf)
            np.asarray(r.last_ids)


def warmup_keys(cfg, widths: tuple[int, ...], runner: "ExtrasRunner", params, tokenizer=None) -> list:
    """The step variants (every bucket) that requests like `params` (penalties / logprobs) need; [] if none.
    tokenizer: what the engine tokenizes bad_words with (their token sequences set the variant's width)."""
    V, so = runner.runner.model.vocab_size, params.structured_outputs
    seqs = bad_words.token_ids(tokenizer, params.bad_words, V) if params.bad_words else []
    e = Extras(params.has_penalties, params.logprobs is not None,
               logprob_width(max(V if n == -1 else n or 0 for n in (params.logprobs, params.prompt_logprobs))), 0,
               ban_width(params), bias_width([params]), bad_words.width(len(seqs)),
               choice := structured.choice_width(so.choice, tokenizer, V) if so is not None and so.choice else 0,
               -(-V // 32) if so is not None and not choice else 0)
    if not (e.penalties or e.logprobs or e.bans or e.bias or e.bad_words or e.choice or e.grammar or
            params.prompt_logprobs is not None):
        return []
    f = params.filter_kind
    keys = [("decode", B, B, W, f, e) for B in cfg.decode_buckets for W in widths]
    pre = e._replace(prompt_rows=-1) if params.prompt_logprobs is not None else e
    return keys + [runner.key_for(("prefill", T, min(cfg.max_num_seqs, T), W, f), pre)
                   for T in cfg.prefill_buckets for W in cfg.prefill_table_widths(T)]


def apply(batch, updated: list[Sequence], pending) -> None:
    """Give the sequences their logprob rows of a read step (pending: what `ExtrasRunner.dispatch` returned).
    A row that got no token this step (finished meanwhile, or a prompt chunk that stops mid-prompt) gets
    no logprobs; prompt logprobs land at their prompt position."""
    key, out, where = pending
    if out is None:
        return
    extras = key[-1]
    rows = np.asarray(out).tolist()
    if extras.logprobs:
        got = {s.seq_id for s in updated}
        for i, seq in enumerate(batch.seqs):
            if batch.sampled[i] and seq.seq_id in got and seq.params.logprobs is not None:
                seq.logprob_rows.append(rows[i])
        rows = rows[key[2]:]
    for (seq, pos), row in zip(where, rows):
        if seq.prompt_logprob_rows is not None:
            seq.prompt_logprob_rows[pos] = row


def in_flight_tokens(in_flight) -> dict[int, int]:
    """seq_id -> the token the one-step call in flight sampled for it, read once that step has run (blocking): a json
    / regex row's mask is packed with it (grammar.py), so the rest of such a step is packed while that one runs."""
    batch, ids = in_flight[0], np.asarray(in_flight[1])
    return {s.seq_id: int(t) for s, t in zip(batch.seqs, ids[:len(batch.seqs)])} if batch.num_steps == 1 else {}
