"""outlines-core index builds in worker processes that can be stopped (grammar.py's builds): a build past its time
limit is killed with its process, so its memory and its core come back and the builds waiting behind it go on (an
index can take minutes and gigabytes, e.g. `.{20000}`; a thread cannot be stopped). vLLM compiles its regexes in
killable workers too.

A worker runs this file as a script: it imports neither jaxinfer nor the user's main module (a script with no
`if __name__ == "__main__"` guard is safe, unlike multiprocessing's spawn), reads (regex, vocabulary) pickles from
its stdin one at a time and writes ("index", Index) or ("error", text) to its stdout. Idle workers wait for the next
build (starting one costs ~0.2 s) and exit when this process does (their stdin closes).
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__":          # (the script's folder is jaxinfer/, whose module names must not shadow others)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import pickle                      # noqa: E402
import select                      # noqa: E402
import struct                      # noqa: E402
import subprocess                  # noqa: E402
import threading                   # noqa: E402

_HEADER = struct.Struct("<Q")
_IDLE: list[subprocess.Popen] = []
_LOCK = threading.Lock()


class WorkerDied(RuntimeError):
    """The worker died mid-build (killed by hand or by the OOM killer): not the expression's fault (not kept)."""


def build(regex: str, vocab, limit: float | None):
    """outlines_core.Index(regex, vocab) built in a worker: the Index; a string (outlines-core's error); None when not
    done within `limit` seconds (None: no limit), the worker then killed. Raises WorkerDied."""
    with _LOCK:
        proc = _IDLE.pop() if _IDLE else None
    if proc is not None and proc.poll() is not None:     # (one that died while idle: killed by hand, say)
        _stop(proc)
        proc = None
    if proc is None:
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, bufsize=0)
    try:
        _send(proc.stdin, (regex, vocab))
        if not select.select([proc.stdout], [], [], limit)[0]:
            _stop(proc)
            return None
        kind, value = _read(proc.stdout)
    except (OSError, EOFError, pickle.UnpicklingError) as e:
        _stop(proc)
        raise WorkerDied(f"the index builder process died ({type(e).__name__}; exit code {proc.returncode})")
    with _LOCK:
        _IDLE.append(proc)
    return value                        # (the Index, or outlines-core's error)


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()
    for f in (proc.stdin, proc.stdout):
        f.close()


def _send(f, obj) -> None:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    data = memoryview(_HEADER.pack(len(body)) + body)
    while data:                         # (unbuffered: a write may take part of it)
        data = data[f.write(data):]


def _read(f):
    return pickle.loads(_exactly(f, _HEADER.unpack(_exactly(f, _HEADER.size))[0]))


def _exactly(f, n: int) -> bytes:
    parts, left = [], n
    while left:
        got = f.read(left)
        if not got:
            raise EOFError
        parts.append(got)
        left -= len(got)
    return b"".join(parts)


def _serve() -> None:
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)           # (Ctrl-C reaches the process group: the parent decides)
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)                                           # (anything printed goes to stderr, not the replies)
    inp = os.fdopen(0, "rb", buffering=0)
    import outlines_core
    while True:
        try:
            regex, vocab = _read(inp)
        except EOFError:
            return
        box: list = []

        def work():
            try:
                box.append(("index", outlines_core.Index(regex, vocab)))      # (it releases the GIL)
            except Exception as e:
                box.append(("error", str(e)))
        worker = threading.Thread(target=work, daemon=True)
        worker.start()
        while worker.is_alive():        # the parent sends nothing mid-build: stdin readable is its end (it exited,
            if select.select([inp], [], [], 0.2)[0]:       # Ctrl-C, killed): no build outlives the process it is for
                os._exit(0)
        _send(out, box.pop())           # (the Index is not kept while idle)


if __name__ == "__main__":
    _serve()
