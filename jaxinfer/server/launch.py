"""`serve(model, engine_kwargs, ...)`: start the engine core, then the HTTP side, and tear both down in order.

Exit codes (`serve` returns them; `jaxinfer serve` and `python -m jaxinfer.server` exit with them):
- 0: stopped by SIGTERM after draining: new requests get 503, in-flight ones finish (or end with finish_reason
  "abort" after `shutdown_timeout`), then the core is shut down; a second signal stops at once. SIGINT (Ctrl-C)
  drains the same way; uvicorn then raises it again, so `jaxinfer serve` exits 130, the shell's code for Ctrl-C;
- 1: the engine core died (in-flight requests got an error; /health answered 503 meanwhile), or an API
  process died (api_server_count > 1).
A model that fails to load raises (ValueError / FileNotFoundError / RuntimeError) before anything listens.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading

from jaxinfer.server.app import build_app, load_model_tokenizer
from jaxinfer.server.options import ServerOptions
from jaxinfer.server.process import CoreInfo, CoreProcess

log = logging.getLogger("jaxinfer.server")
EXIT_GRACE_S = 1.0      # after the core died: time for error events to reach clients before the server exits
PENDING_GRACE_S = 0.5   # a signal that came before uvicorn served: the drain starts this long after it does


def serve(model: str, engine_kwargs: dict | None = None, host: str = "127.0.0.1", port: int = 8000,
          served_model_name: str | list[str] | None = None, log_level: str = "info", api_server_count: int = 1,
          options: ServerOptions | None = None) -> int:
    """Serve `model` (directory, preset or hub id; engine options as for `LLM`) until SIGTERM / SIGINT or the
    engine core dies; returns the exit code (see the module docstring). `options`: ServerOptions (default:
    `ServerOptions.create()`, the API key from $JAXINFER_API_KEY or $VLLM_API_KEY)."""
    if not isinstance(api_server_count, int) or api_server_count < 1:
        raise ValueError(f"api_server_count={api_server_count!r} must be a positive integer")
    from jax._src.distributed import global_state
    if global_state.client is not None:     # (the engine core is a process of its own: it would see this host only)
        raise ValueError("serve() does not span hosts: jax.distributed is initialized in this process, but the "
                         "server's engine core is a process of its own that neither joins it nor shares requests "
                         "between hosts; run one server per host without jax.distributed (-tp / -dp over that "
                         "host's devices), or LLM.generate from the same script on every host")
    options = options if options is not None else ServerOptions.create()
    options, engine_kwargs = generation_config_to_both(options, engine_kwargs)
    name = served_model_name or model          # (a list: several names, the first in answers)
    sock = bind(host, port)                    # a port in use fails now, not after loading the model
    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, _interrupt) if main else None   # while loading: stop the load
    try:
        core = CoreProcess(model, engine_kwargs, api_server_count)
        try:
            # while the core loads the model: this process's own start-up (transformers' import: seconds)
            tokenizer = load_model_tokenizer(core.tokenizer) if api_server_count == 1 else None
            core.wait_ready()
            pending: list[int] = []      # a SIGTERM before uvicorn's handler is in: kept, then drains (vLLM's)
            if main:
                signal.signal(signal.SIGTERM, lambda sig, frame: pending.append(sig))
            where = f"[{host}]" if ":" in host else host
            sock.listen(2048)               # before the line: a client that waits for it is queued, not refused
            line = "jaxinfer API server on http%s://%s:%d (model %s)" % (
                "s" * bool(options and options.ssl_certfile), where, sock.getsockname()[1],
                name if isinstance(name, str) else ", ".join(name))
            if log.isEnabledFor(logging.INFO) and log.hasHandlers():
                log.info(line)
            else:           # serve() from Python without logging set up: the port (port=0) must still be told
                print(line, file=sys.stderr, flush=True)
            if api_server_count == 1:
                return run_api(core.info, name, host, port, log_level, alive=core.alive, sock=sock,
                               tokenizer=tokenizer, options=options, pending=pending)
            return _run_api_processes(core, name, host, port, log_level, api_server_count, sock, options, pending)
        finally:
            code = core.shutdown()
            log.info("engine core exited with code %s", code)
    finally:
        sock.close()
        if main:
            signal.signal(signal.SIGTERM, old)


def generation_config_to_both(options: ServerOptions, engine_kwargs: dict | None) -> tuple[ServerOptions, dict]:
    """generation_config / override_generation_config given as engine options (`LLM`'s keywords) or as server
    options mean the same: the API process fills requests' left-out fields from them, and the engine core's
    `LLM` gets them too (it checks the same file, and a folder's EOS ids end generation). Given twice, with
    different values: a ValueError."""
    kw, moved = dict(engine_kwargs or {}), {}
    for key, default in (("generation_config", "auto"), ("override_generation_config", None)):
        if key in kw:
            value, given = kw.pop(key), getattr(options, key)
            if given != default and given != value:
                raise ValueError(f"{key} given twice: {value!r} (engine options) and {given!r} (server options)")
            moved[key] = value
    options = dataclasses.replace(options, **moved) if moved else options
    return options, {**kw, "generation_config": options.generation_config,
                     "override_generation_config": options.override_generation_config}


def bind(host: str, port: int):
    """The server's socket, bound but not listening: connections are refused until the core is ready (then it
    listens, and uvicorn accepts)."""
    import socket
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def _interrupt(sig, frame):
    raise KeyboardInterrupt


def run_api(info: CoreInfo, name: str, host: str, port: int, log_level: str, api_index: int = 0,
            alive=None, sock=None, tokenizer=None, options: ServerOptions | None = None,
            ignore_sigint: bool = False, pending: list[int] | None = None) -> int:
    """One API process: uvicorn on (host, port) or on an inherited listening socket. Returns 1 if the core
    died, else 0. ignore_sigint: one of several API processes, whose parent forwards SIGINT (Ctrl-C reaches the
    whole process group) as SIGTERM; taking both would make the forwarded one a second signal, which stops at
    once instead of draining. pending: signals that came before uvicorn's handlers were in (the caller's handler
    appends them; uvicorn restores it after): handled as soon as they are."""
    import asyncio

    import uvicorn
    dead: list[str] = []
    pending = pending if pending is not None else []

    def on_dead(why: str) -> None:
        dead.append(why)
        asyncio.get_running_loop().call_later(EXIT_GRACE_S, setattr, server, "should_exit", True)

    class DrainingServer(uvicorn.Server):
        """The first SIGTERM / SIGINT drains (app.py); a second one stops at once: in-flight requests end with
        finish_reason "abort" now (their streams end cleanly; a response a client stopped reading is dropped after
        1 s); after the drain, a signal ends uvicorn's wait for connections."""
        signals = 0

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if pending and self.started:   # a signal before it served: drains once the connections queued on the
                asyncio.get_running_loop().call_later(PENDING_GRACE_S, self.handle_pending)   # socket are taken

        def handle_pending(self):
            while pending:
                self.handle_exit(pending.pop(0), None)

        def handle_exit(self, sig, frame):
            if ignore_sigint and sig == signal.SIGINT:
                return
            if not self.started:                  # (kept until it serves: startup)
                return pending.append(sig)
            self.signals += 1
            if self.should_exit:                  # drained: uvicorn waits for connections; a signal ends the wait
                self.force_exit = True
                return
            app.state.start_drain(self.stop, now=self.signals > 1)

        def stop(self, force: bool = False):
            if force:           # a response still unsent (its client stopped reading): drop the connections, so
                self.drop_connections()                                # that its handler ends as on a disconnect
            elif app.state.hurry:   # a response handed over whole but unread stays in its socket's buffer, which
                asyncio.get_running_loop().call_later(1.0, self.drop_connections, True)   # holds uvicorn's exit
            self.should_exit = True

        def drop_connections(self, unflushed_only: bool = False):
            for conn in list(self.server_state.connections):
                transport = getattr(conn, "transport", None)
                if transport is not None and (not unflushed_only or transport.get_write_buffer_size()):
                    transport.abort()

    app = build_app(info, name, api_index=api_index, tokenizer=tokenizer, alive=alive, on_dead=on_dead,
                    options=options)
    server = DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                                           access_log=not (options and options.disable_uvicorn_access_log),
                                           **(options.uvicorn_kwargs() if options else {})))
    server.run(sockets=[sock] if sock is not None else None)
    if dead:
        log.error("exiting: %s", dead[0])
    return 1 if dead or not server.started else 0


def _api_main(info: CoreInfo, name: str, host: str, port: int, log_level: str, api_index: int, sock,
              options: ServerOptions, metrics_dir: str) -> None:
    pending: list[int] = []                            # until uvicorn's handler is in (run_api)
    signal.signal(signal.SIGTERM, lambda sig, frame: pending.append(sig))
    signal.signal(signal.SIGINT, signal.SIG_IGN)       # the parent forwards it (run_api's ignore_sigint)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})    # (blocked while it started)
    # this process is ours: prometheus_client's multiprocess mode (metrics.py), set before it is imported
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    logging.basicConfig(level=log_level.upper(), format=f"%(levelname)s:     [api {api_index}] %(message)s")
    raise SystemExit(run_api(info, name, host, port, log_level, api_index, sock=sock, options=options,
                             ignore_sigint=True, pending=pending))


def _run_api_processes(core: CoreProcess, name: str, host: str, port: int, log_level: str, n: int, sock,
                       options: ServerOptions, pending: list[int]) -> int:
    """n API processes share one listening socket (the kernel spreads connections); this process watches
    them and the core. SIGTERM/SIGINT here (or one in `pending`, come before) are forwarded to the API
    processes, which drain; one that a signal stopped before its start-up is done counts as a clean stop."""
    import multiprocessing as mp
    from multiprocessing.connection import wait

    ctx = mp.get_context("spawn")
    metrics_dir = tempfile.mkdtemp(prefix="jaxinfer-metrics-")
    procs = [ctx.Process(target=_api_main, name=f"jaxinfer-api-{i}",
                         args=(core.info, name, host, port, log_level, i, sock, options, metrics_dir))
             for i in range(n)]
    stopping, told = [], set()

    def forward(sig, frame, untold_only=False):
        stopping.append(sig)
        for p in procs:
            if p.is_alive() and not (untold_only and p.pid in told):
                told.add(p.pid)
                p.terminate()                             # SIGTERM: uvicorn drains
    prev = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        # started with SIGTERM / SIGINT blocked (the mask outlives exec): one that comes while a child imports is
        # held until its handler is in (_api_main), not fatal to it with connections already queued on the socket
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        try:
            for p in procs:
                p.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if pending or stopping:                           # (came while they started: each is told once)
            forward(signal.SIGTERM, None, untold_only=True)
        rc = 0
        while any(p.is_alive() for p in procs):
            wait([p.sentinel for p in procs] + [core.proc.sentinel], timeout=1.0)
            failed = [p for p in procs if p.exitcode not in (None, 0)] or ([] if core.alive() else [core.proc])
            if failed and not stopping:
                log.error("%s exited with code %s; stopping the server", failed[0].name, failed[0].exitcode)
                rc = 1
                forward(signal.SIGTERM, None)
        for p in procs:
            p.join()
        return rc or max(p.exitcode not in (0, -signal.SIGTERM) for p in procs)
    finally:
        for s, h in prev.items():
            signal.signal(s, h)
        shutil.rmtree(metrics_dir, ignore_errors=True)
