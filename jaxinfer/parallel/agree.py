"""Several processes (jax.distributed): every process must build the same engine and feed it the same requests in
the same order. A process that does not (other options, other prompts, no call at all) would otherwise desynchronise
the collectives: wrong tokens, a crash deep in gloo / NCCL, or a hang. `agree` compares one fingerprint per process
through the jax.distributed coordination service (its key-value store, not a device collective) and raises an
error naming the difference, or the process that did not come within the timeout. With one process: nothing.
"""
from __future__ import annotations

import itertools
import os
import zlib

import jax

TIMEOUT_ENV = "JAXINFER_MULTIHOST_TIMEOUT_S"      # how long a process waits for the others (default 600 s)
_round = itertools.count()                        # (every process makes the same calls: the same round numbers)


def _exchange(what: str, mine: str) -> list[str]:
    """Every process's `mine` for this round, in process order (a RuntimeError naming one that does not come)."""
    from jax._src.distributed import global_state
    client, me, n = global_state.client, jax.process_index(), next(_round)
    timeout_s = float(os.environ.get(TIMEOUT_ENV, "600"))
    client.key_value_set(f"jaxinfer/agree/{n}/{me}", f"{what}\x1e{mine}")
    every = []
    for p in range(jax.process_count()):
        try:
            got = client.blocking_key_value_get(f"jaxinfer/agree/{n}/{p}", int(timeout_s * 1000))
        except Exception as e:  # (DEADLINE_EXCEEDED from the coordination service)
            raise RuntimeError(
                f"jax.distributed: process {p} did not reach {what} within {timeout_s:.0f} s (this is process {me}); "
                f"every process must build the same LLM and call generate / stream / chat with the same prompts in "
                f"the same order ({TIMEOUT_ENV} sets the wait)") from e
        tag, value = got.split("\x1e", 1)
        if tag != what:
            raise RuntimeError(f"jax.distributed: process {me} is at {what} but process {p} is at {tag}: every "
                               f"process must make the same LLM calls in the same order")
        every.append(value)
    if n:          # every process has read round n - 1 (each wrote round n after): this process's key of it can go
        try:
            client.key_value_delete(f"jaxinfer/agree/{n - 1}/{me}")
        except Exception:      # (a jaxlib without it: the keys only stay)
            pass
    return every


def agree(what: str, fields: dict[str, object]) -> None:
    """Every process passes the same `fields` (names -> values, compared by their repr) for `what`, or a ValueError
    naming the fields that differ."""
    if jax.process_count() == 1:
        return
    names, mine = list(fields), [f"{zlib.crc32(repr(v).encode()):08x}" for v in fields.values()]
    for p, theirs in enumerate(t.split(",") if t else [] for t in _exchange(what, ",".join(mine))):   # ("": none)
        differ = [k for k, a, b in zip(names, mine, theirs) if a != b]
        if len(theirs) != len(mine):
            differ.insert(0, f"the number of entries ({len(mine)} here, {len(theirs)} there)")
        if differ:
            raise ValueError(f"jax.distributed: {what} differs between process {jax.process_index()} and process {p} "
                             f"in {', '.join(differ[:8])}{' ...' if len(differ) > 8 else ''}: every process must pass "
                             f"the same engine options and the same requests")


def same_requests(reqs) -> None:
    """LLM.generate / stream / chat on several hosts: every process queues the same (prompt, ids, params) in order."""
    if jax.process_count() > 1:
        from dataclasses import replace

        from jaxinfer.prompts import cache_salt
        plain = lambda sp: replace(sp, extra_args=None) if sp.extra_args else sp   # noqa: E731 (unread; its objects'
        agree("LLM.generate / stream", {f"prompt {i}": (ids, plain(sp), cache_salt(p, 0))      # reprs name addresses)
                                        for i, (p, ids, sp) in enumerate(reqs)})


def min_over_processes(what: str, value: int) -> int:
    """The smallest of every process's `value` (e.g. the free memory each measured), so that all agree."""
    return value if jax.process_count() == 1 else min(int(v) for v in _exchange(what, str(int(value))))
