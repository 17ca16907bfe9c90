"""The views a `DPEngine` offers of its replicas' schedulers, block managers and runners: what `LLM`, the server
and the benchmarks read of an `LLMEngine`'s, routed to a sequence's replica or summed over them."""
from __future__ import annotations

from typing import TYPE_CHECKING

from jaxinfer.engine.sequence import Sequence

if TYPE_CHECKING:
    from jaxinfer.engine.dp_engine import DPEngine
    from jaxinfer.engine.llm_engine import LLMEngine


class SchedulerView:
    """What callers use of `engine.scheduler`, routed to the sequence's replica."""

    def __init__(self, dp: DPEngine):
        self._dp = dp

    def finish(self, seq: Sequence, reason: str, drop: int = 0) -> None:
        owner = self._dp._owner.pop(seq.seq_id, None)     # (kept, it would stay listed for good)
        if owner is not None:           # (a sequence that finished in the last step: only its cut tokens count)
            owner.scheduler.finish(seq, reason, drop)
        elif drop:                      # finished longer ago: its cut tokens are counted on the first replica
            self._dp.replicas[0].scheduler.finish(seq, reason, drop)

    def has_unfinished(self) -> bool:
        return self._dp.has_unfinished()

    @property
    def eos(self) -> frozenset[int]:
        return self._dp.replicas[0].scheduler.eos

    @property
    def waiting(self) -> list[Sequence]:
        return [s for r in self._dp.replicas for s in (*r.scheduler.waiting, *r.scheduler.building)]

    @property
    def running(self) -> list[Sequence]:
        return [s for r in self._dp.replicas for s in r.scheduler.running]


class BlockManagerView:
    def __init__(self, replicas: list[LLMEngine]):
        self._replicas = replicas

    def reset_prefix_cache(self, in_use: bool = False) -> int:
        return sum(r.block_manager.reset_prefix_cache(in_use) for r in self._replicas)

    @property
    def cached(self) -> dict:
        return {k: v for r in self._replicas for k, v in r.block_manager.cached.items()}

    @property
    def num_blocks(self) -> int:
        """All replicas' pools together (as num_free_blocks: an idle engine has them equal)."""
        return sum(r.block_manager.num_blocks for r in self._replicas)

    @property
    def blocks_per_replica(self) -> int:
        """One replica's pool: what one request can use."""
        return self._replicas[0].block_manager.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return sum(r.block_manager.num_free_blocks for r in self._replicas)

    @property
    def prefix_caching(self) -> bool:
        return self._replicas[0].block_manager.prefix_caching

    @prefix_caching.setter
    def prefix_caching(self, on: bool) -> None:
        for r in self._replicas:
            r.block_manager.prefix_caching = on


class RunnerView:
    def __init__(self, replicas: list[LLMEngine]):
        self._replicas = replicas

    def buckets(self) -> list:
        """Every replica's buckets (each replica has its own executables: they are bound to devices)."""
        return [k for r in self._replicas for k in r.runner.buckets()]

    def __getattr__(self, name):         # params, widths, compiled, ...: replica 0's
        return getattr(self._replicas[0].runner, name)
