"""The waiting-queue bound of one API process (`--max-waiting-requests`).

Engine requests in flight are bounded by max_num_seqs + max_waiting_requests, split over the API processes
(shares differ by at most one and add up to the bound; each gets at least one). Two checks use it:
- `full()`, from the Gate middleware before a generate request's body is read: while this process is at its
  share, the request gets 503 at once, at the cost of one pass through the gate (an overloaded event loop is
  busy with streams, and every further step of a request waits for it);
- `admit(need)`, from the handler once the request is parsed: the exact need (prompts x n), 400 for a request
  that could never fit, 503 + Retry-After when it does not fit now.
"""
from __future__ import annotations

from collections.abc import Callable

from jaxinfer.server import protocol as P


class Admission:
    def __init__(self, state, max_num_seqs: int, api_processes: int, metrics,
                 client: Callable[[], object], api_index: int = 0):
        """`state`: the app's state (.options, .client, read per call: tests swap options); `client()` the
        live CoreClient (raises 503 when the engine is dead)."""
        self.state, self.max_num_seqs, self.api_processes = state, max_num_seqs, api_processes
        self.metrics, self.client, self.api_index = metrics, client, api_index

    def capacity(self) -> int | None:
        """This API process's share of max_num_seqs + max_waiting_requests (None: no bound)."""
        waiting = self.state.options.max_waiting_requests
        if waiting is None:
            return None
        share, extra = divmod(self.max_num_seqs + waiting, self.api_processes)
        return max(1, share + (self.api_index < extra))

    def _overloaded(self, inflight: int) -> str:
        self.metrics.observe_rejected("queue_full")
        return (f"the server is overloaded ({inflight} requests in flight, --max-waiting-requests "
                f"{self.state.options.max_waiting_requests}); retry later")

    def full(self) -> str | None:
        """The 503 message when this process is at its share of the bound, else None."""
        cap, c = self.capacity(), self.state.client
        if cap is None or c is None or c.inflight < cap:
            return None
        return self._overloaded(c.inflight)

    def admit(self, need: int) -> None:
        """Raise a RequestError (400 or 503) unless `need` more engine requests fit now."""
        c, cap = self.client(), self.capacity()
        if cap is None:
            return
        if need > cap:
            share = "" if self.api_processes == 1 else f" (its share over {self.api_processes} API processes)"
            raise P.RequestError(f"the request needs {need} engine requests (prompts x n) but the server admits at "
                                 f"most {cap} at a time{share}: max_num_seqs + --max-waiting-requests", param="n")
        if c.inflight + need > cap:
            raise P.RequestError(self._overloaded(c.inflight), status=503, code="overloaded",
                                 headers={"Retry-After": str(self.state.options.retry_after_s)})
