"""What `LLM.generate` returns per prompt (vLLM-style names)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]                  # generated tokens
    text: str                             # generated text (truncated before a matched stop string)
    finish_reason: str | None             # "stop" | "length" | "abort"
    num_cached_tokens: int = 0            # prompt tokens served from the prefix cache
    metrics: dict = field(default_factory=dict)   # ttft_s, tpot_s

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
