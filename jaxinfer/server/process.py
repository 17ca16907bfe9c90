"""Start the engine-core process (`CoreProcess`) and describe how to reach it (`CoreInfo`, picklable: API
processes of `api_server_count > 1` get it as an argument)."""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass

import msgpack
import zmq

log = logging.getLogger("jaxinfer.server")


@dataclass(frozen=True)
class CoreInfo:
    model: str                    # resolved: a checkpoint directory or a preset name
    in_addr: str                  # the core's inbox (API processes push)
    out_addrs: tuple[str, ...]    # one per API process (the core pushes)
    pid: int
    limits: dict                  # max_model_len, vocab_size, num_blocks, block_size
    tokenizer: str | None = None  # the engine's `tokenizer` folder, when one was given (else `model`'s)


class CoreProcess:
    """Spawn the engine core; `info` (or `wait_ready()`) waits until it has loaded the model, or raises its
    load error. In between, the caller may do its own start-up work (load the tokenizer) in parallel."""

    def __init__(self, model: str, engine_kwargs: dict | None = None, api_count: int = 1):
        import multiprocessing as mp

        from jaxinfer.hub import resolve_model
        from jaxinfer.server.core import run_core
        kw = engine_kwargs or {}                  # resolved once, here: every process then reads the same files
        resolved = resolve_model(model, kw.get("revision"), kw.get("download_dir"), kw.get("hf_token"))
        self.tokenizer = kw.get("tokenizer") or resolved
        self._dir = tempfile.mkdtemp(prefix="jaxinfer-")
        in_addr = f"ipc://{self._dir}/in"
        outs = tuple(f"ipc://{self._dir}/out{i}" for i in range(api_count))
        ctx = mp.get_context("spawn")             # JAX is not fork-safe
        recv, send = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=run_core, name="jaxinfer-engine-core",
                                args=(resolved, dict(engine_kwargs or {}), in_addr, list(outs), send, os.getpid()))
        self.proc.start()
        send.close()
        self.model, self._recv, self._info = resolved, recv, None
        self._addrs = (in_addr, outs)

    @property
    def info(self) -> CoreInfo:
        return self.wait_ready()

    def wait_ready(self) -> CoreInfo:
        if self._info is None:
            try:
                msg = self._wait_ready(self._recv)
            except BaseException as e:            # load error, or Ctrl-C while loading
                if isinstance(e, Exception):
                    self.proc.join(5)             # a reported load error: the core exits by itself (1, not -9)
                self.kill()
                raise
            self._info = CoreInfo(self.model, *self._addrs, self.proc.pid, msg["limits"], self.tokenizer)
        return self._info

    def _wait_ready(self, recv) -> dict:
        while not recv.poll(0.2):
            if not self.proc.is_alive():
                raise RuntimeError(f"the engine core exited with code {self.proc.exitcode} while loading the model")
        try:
            msg = recv.recv()
        except EOFError:
            self.proc.join(5)
            raise RuntimeError(f"the engine core exited with code {self.proc.exitcode} while loading the model") from None
        if "error" in msg:
            log.debug("engine core load error:\n%s", msg.get("traceback", ""))
            err = msg["error"]
            cls = ValueError if err.startswith("ValueError") else \
                FileNotFoundError if err.startswith("FileNotFoundError") else RuntimeError
            raise cls(f"the engine core could not load the model: {err.split(': ', 1)[-1]}")
        return msg

    def alive(self) -> bool:
        return self.proc.is_alive()

    def shutdown(self, timeout: float = 30.0) -> int | None:
        """Ask the core to exit (it aborts what is left), wait, kill it if it does not. Returns its exit code."""
        if self.proc.is_alive() and self._info is not None:     # still loading: nothing to drain, kill it
            ctx = zmq.Context.instance()
            s = ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 1000)
            s.connect(self._addrs[0])
            s.send(msgpack.packb([["shutdown"]]))
            s.close()
            self.proc.join(timeout)
        self.kill()
        return self.proc.exitcode

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)
        shutil.rmtree(self._dir, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    """For API processes that are not the core's parent (the parent reaps it at once)."""
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
