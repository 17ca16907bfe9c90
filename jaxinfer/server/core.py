"""The engine-core process: the scheduler and the compiled steps, nothing per token beyond what a step needs.

Started by `process.CoreProcess` with multiprocessing's 'spawn' (JAX is not fork-safe). It owns its process,
so before JAX starts it turns on XLA's fast command-buffer mode where that applies (xla_options), loads the
model itself (`LLM(model, **engine_kwargs)`), binds its ZMQ sockets and reports readiness (or the load
error) through a pipe. Then it loops:

    drain the inbox (blocking only when idle) -> engine.step() -> one message per API process

Inbound (PULL, any API process may push): msgpack lists of commands
    ["add", rid, prompt_token_ids, sampling_params_fields, source rid, cache salt, reasoning end, replica]
    ["abort", rid, (kept)]
                                      (source rid: sample 0 of the same n > 1 request, whose prompt KV this
                                      sample waits for and reuses, as LLM.generate: Sequence.prompt_source)
    ["stats", api_index, token]     ["ping", api_index, token]    ["shutdown"]
Outbound (one PUSH socket per API process; request ids are owned by API `rid % api_count`):
    ["out", [[rid, new_token_ids, finish_reason | None], ...]]   once per step, only updated requests;
                                      finish_reason "rejected" (add refused) or "error" rows add a message;
                                      a request with logprobs / prompt_logprobs adds [None, {"logprobs": one
                                      row per new token, "prompt_logprobs": rows (first output only)}]: rows as
                                      jaxinfer.outputs.logprob_dict reads them (None for the first prompt token)
    ["stats", token, {...}]     ["pong", token, None]     ["bye"] (the last message before a clean exit)

A request is one sample: the API process expands n > 1 into `params.for_sample(i)`, one rid each (the core
refuses n > 1). Stop strings are not the core's business: the API process matches them and sends "abort" with
the output tokens it kept (`kept`), so that /metrics' histograms count the request as finished, as vLLM does.
SIGINT and SIGTERM are ignored here: the API process drains HTTP first and then sends "shutdown". If the
parent process disappears (killed), the core exits by itself.
"""
from __future__ import annotations

import functools
import gc
import logging
import os
import signal
import traceback

import msgpack
import zmq

from jaxinfer.server.metrics import RequestTimes

log = logging.getLogger("jaxinfer.server.core")
IDLE_POLL_MS = 500          # idle: wake this often to check that the parent process still exists


def freeze_gc() -> None:
    """Compiling leaves ~300k long-lived Python objects (JAX's caches); a full garbage collection walked them all
    (137 ms in the middle of a 5.5 s run on the H200). Freezing moves the survivors out of the collector's view
    (as vLLM does after capturing its CUDA graphs); reference counting still frees them. It is process-wide (it
    would keep a user's cyclic garbage of that moment forever), so only the engine process, which is ours, does
    it; `LLM()` in a user's process does not (a user may call `gc.freeze()` after it)."""
    gc.collect()
    gc.freeze()


def run_core(model: str, engine_kwargs: dict, in_addr: str, out_addrs: list[str], ready_conn, parent_pid: int) -> None:
    """The spawn target. Sends {"limits": ...} or {"error": ...} on ready_conn, then serves until shutdown."""
    from jaxinfer.xla_options import set_process_flags
    set_process_flags()                    # before JAX starts its backend (LLM() below starts it)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        from jaxinfer.llm import LLM
        llm = LLM(model, **engine_kwargs)
        core = EngineCore(llm.engine, in_addr, out_addrs, parent_pid)
        freeze_gc()                        # this process is ours (see freeze_gc)
    except BaseException as e:             # report it: the server must not start listening
        ready_conn.send({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        ready_conn.close()
        raise SystemExit(1) from None
    cfg, bm = llm.engine.config, llm.engine.block_manager
    pool = getattr(bm, "blocks_per_replica", bm.num_blocks)     # what one request can use (data-parallel: a replica's)
    ready_conn.send({"limits": dict(max_model_len=cfg.max_model_len, vocab_size=llm.model_config.vocab_size,
                                    num_blocks=pool, block_size=cfg.block_size, kv_cache_dtype=cfg.kv_cache_dtype,
                                    max_num_seqs=cfg.max_num_seqs * cfg.data_parallel_size,   # (the queue bound)
                                    data_parallel_size=cfg.data_parallel_size, max_logprobs=cfg.max_logprobs,
                                    pid=os.getpid(), eos=[sorted(llm._eos[0]), llm._eos[1]],   # (stop_reason)
                                    xla_flags=os.environ.get("XLA_FLAGS", ""))})
    ready_conn.close()
    core.run()


class EngineCore:
    def __init__(self, engine, in_addr: str, out_addrs: list[str], parent_pid: int):
        from jaxinfer import grammar
        self.engine, self.parent_pid = engine, parent_pid
        grammar.IN_ENGINE_CORE = True                           # (this process is the core's: its index limit)
        for replica in getattr(engine, "replicas", [engine]):  # json / regex indexes built beside the steps (the API
            replica.grammar_wait = False                       # process built each first: grammar.GrammarRule)
        # numpy scalars (in stats, say) as Python numbers: a message that cannot be packed must not kill the core
        self.pack = msgpack.Packer(default=lambda o: o.item() if hasattr(o, "item") else repr(o))
        self.unpackb = functools.partial(msgpack.unpackb, strict_map_key=False)     # (logit_bias: int keys)
        self.ctx = zmq.Context(1)
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.RCVHWM, 0)
        self.inbox.bind(in_addr)
        self.outs = []
        for addr in out_addrs:
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.SNDHWM, 0)          # never drop or block on outputs
            s.setsockopt(zmq.LINGER, 5000)       # a clean exit delivers what was sent
            s.bind(addr)
            self.outs.append(s)
        self.live: dict[int, list] = {}          # seq_id -> [rid, seq, tokens sent]
        self.by_rid: dict[int, int] = {}         # rid -> seq_id
        self.running = True
        self.times = RequestTimes(engine.config.max_model_len)     # finished requests' histograms (/metrics)

    # -- loop ---------------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            while self.running:
                self._drain(block=not self.engine.has_unfinished())
                if not self.running or not self.engine.has_unfinished():
                    continue
                try:
                    updated = self.engine.step()
                except Exception as e:           # fail the requests in flight, free their blocks, keep serving
                    log.exception("engine step failed")
                    self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
                    continue
                if updated:
                    self._send_outputs(updated)
        finally:
            for i in range(len(self.outs)):
                self._send(i, ["bye"])
            self.inbox.close(linger=0)
            for s in self.outs:
                s.close()
            self.ctx.term()

    def _drain(self, block: bool) -> None:
        if block:
            while not self.inbox.poll(IDLE_POLL_MS):
                if os.getppid() != self.parent_pid:     # orphaned: the API process is gone
                    log.warning("the server process is gone; the engine core exits")
                    self.running = False
                    return
        while self.inbox.poll(0):               # (cheaper per step than a raised zmq.Again)
            for cmd in self.unpackb(self.inbox.recv()):
                self._command(cmd)

    def _command(self, cmd: list) -> None:
        kind = cmd[0]
        if kind == "add":
            self._add(*cmd[1:])
        elif kind == "abort":
            seq_id = self.by_rid.pop(cmd[1], None)
            if seq_id is not None:
                seq = self.live.pop(seq_id)[1]
                # a stop string ended it (kept: the tokens up to the match): the tokens read past it are not
                # counted as generated (as LLM.generate's), and the request is finished for the histograms
                self.engine.abort(seq, max(0, seq.num_output_tokens - cmd[2]) if len(cmd) > 2 else 0)
                if len(cmd) > 2:
                    self.times.add(seq, num_output=cmd[2])
        elif kind == "stats":
            from jaxinfer.engine.dp_engine import sized_stats
            self._send(cmd[1], ["stats", cmd[2], {**sized_stats(self.engine), "request_times": self.times.snapshot()}])
        elif kind == "ping":                     # (an API process starting: until one arrives there)
            self._send(cmd[1], ["pong", cmd[2], None])
        elif kind == "shutdown":
            for rid in list(self.by_rid):
                self._command(["abort", rid])
            self.running = False

    def _add(self, rid: int, token_ids: list[int], fields: dict, source: int | None = None,
             cache_salt: str | None = None, reasoning_end: int | None = None, rank: int | None = None) -> None:
        from jaxinfer.engine.dp_engine import on_replica
        from jaxinfer.sampling_params import SamplingParams
        src = self.live[self.by_rid[source]][1] if source in self.by_rid else None
        try:
            with on_replica(self.engine, rank):             # (X-data-parallel-rank: checked by the API)
                seq = self.engine.add_request(token_ids, SamplingParams(**fields), prompt_source=src,
                                              cache_salt=cache_salt, reasoning_end=reasoning_end)
        except (ValueError, TypeError) as e:    # the API checked it already; this is the authoritative check
            self._send(rid % len(self.outs), ["out", [[rid, [], "rejected", str(e)]]])
            return
        self.live[seq.seq_id] = [rid, seq, 0]
        self.by_rid[rid] = seq.seq_id

    # -- outputs ------------------------------------------------------------------------------------
    def _send_outputs(self, updated) -> None:
        rows: list[list] = [[] for _ in self.outs]
        n_api = len(self.outs)
        for seq in updated:
            entry = self.live.get(seq.seq_id)
            if entry is None:                    # aborted
                continue
            rid, _, sent = entry
            n, p = seq.num_output_tokens, seq.num_prompt_tokens        # (tokens read back from the device)
            entry[2] = n
            reason = seq.finish_reason
            if reason is not None:               # finished: forget it
                del self.live[seq.seq_id], self.by_rid[rid]
                self.times.add(seq)
            row = [rid, seq.token_ids[p + sent:p + n], reason]
            if seq.params.logprobs is not None or (sent == 0 and (seq.prompt_logprob_rows is not None or
                                                                  seq.num_cached_tokens)):
                extra = {"logprobs": seq.logprob_rows[sent:n]} if seq.params.logprobs is not None else {}
                if sent == 0 and seq.prompt_logprob_rows is not None:
                    extra["prompt_logprobs"] = seq.prompt_logprob_rows
                if sent == 0 and seq.num_cached_tokens:      # (prefix-cache hits: usage's prompt_tokens_details)
                    extra["cached"] = seq.num_cached_tokens
                row += [None, extra]
            rows[rid % n_api].append(row)
        for i, r in enumerate(rows):
            if r:
                self._send(i, ["out", r])

    def _fail_all(self, message: str) -> None:
        rows: list[list] = [[] for _ in self.outs]
        for rid in list(self.by_rid):
            seq = self.live.pop(self.by_rid.pop(rid))[1]
            self.engine.abort(seq)
            rows[rid % len(self.outs)].append([rid, [], "error", message])
        for i, r in enumerate(rows):
            if r:
                self._send(i, ["out", r])

    def _send(self, api_index: int, msg) -> None:
        try:     # never block: a bound PUSH socket whose API process is gone has no peer to queue for
            self.outs[api_index].send(self.pack.pack(msg), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            if os.getppid() != self.parent_pid:
                self.running = False          # orphaned mid-run: stop generating for nobody
            elif msg[0] not in ("bye", "pong"):   # (at shutdown the API process may have gone first)
                log.warning("API process %d is not connected; dropped a message", api_index)
