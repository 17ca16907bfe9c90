"""OneThread: an LLM's engine is driven by one thread at a time (its scheduler and block manager are not
thread-safe). A second thread that calls generate / stream while another one is inside gets a clear error instead
of silently mixed-up batches; the same thread may nest calls (a generate inside a stream's loop)."""
from __future__ import annotations

import contextlib
import threading


class OneThread:
    def __init__(self):
        self._lock, self._owner, self._depth = threading.Lock(), None, 0

    @contextlib.contextmanager
    def __call__(self):
        me = threading.get_ident()
        with self._lock:
            if self._owner not in (None, me):
                raise RuntimeError("this LLM is generating on another thread: an LLM serves one thread at a time "
                                   "(give each thread its own LLM, or serve it: `python -m jaxinfer serve`)")
            self._owner, self._depth = me, self._depth + 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._owner = None
