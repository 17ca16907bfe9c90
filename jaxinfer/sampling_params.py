"""Per-request sampling parameters (vLLM names), validated on construction."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0          # 0 means greedy
    top_k: int = 0                    # 0 or -1 disables
    top_p: float = 1.0                # in (0, 1]
    min_p: float = 0.0                # in [0, 1]
    max_tokens: int = 16
    ignore_eos: bool = False
    seed: int | None = None           # makes this request's samples reproducible whatever the batch
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None

    def __post_init__(self):
        def bad(name, why):
            raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} {why}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            bad("temperature", "must be a number >= 0 (0 = greedy)")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            bad("top_k", "must be an integer >= -1 (0 or -1 disable it)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            bad("seed", "must be an integer or None")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            bad("stop", "must be a non-empty string or a list of them")
        object.__setattr__(self, "stop", stop)
        ids = tuple(self.stop_token_ids or ())
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
            bad("stop_token_ids", "must be a list of non-negative integers")
        object.__setattr__(self, "stop_token_ids", ids)
        object.__setattr__(self, "temperature", float(self.temperature))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_filter(self) -> bool:
        """Whether sampling must sort the vocabulary (top-k, top-p or min-p on a sampled row)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)
