"""What `LLM.generate` returns per prompt (vLLM's shapes and names): RequestOutput, CompletionOutput, Logprob.

Logprobs travel from the engine as compact rows (one per token, fp32 from the step, see
sampling.logprob_stats): [the token's logprob, its rank, top ids x W, top logprobs x W] for a static width
W >= the N asked for. `logprob_dict` turns a row into vLLM's `{token_id: Logprob}`: the token itself plus
the top N (N + 1 entries when the token is not among the top N). `LogprobsList` does so on access: a
benchmark run with logprobs=5 names ~1M entries, and making them all up front took ~2 s of host time (CPU).
The outputs' logprobs fields hold it until first read, and are plain lists from then on (`Made`), so that
`dataclasses.asdict(output)` gives vLLM's nested dicts (json.dumps-able) and a run that never reads them makes none.
"""
from __future__ import annotations

import enum
from collections.abc import MutableSequence, Sequence
from dataclasses import dataclass, field

from jaxinfer.detokenizer import FIXUP_TOKENS


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None               # 1 = the most likely token
    decoded_token: str | None = None


class RequestOutputKind(enum.Enum):
    """vLLM's (`from jaxinfer.sampling_params import RequestOutputKind`): what SamplingParams.output_kind asks of
    llm.llm_engine and AsyncLLMEngine: everything so far, only what is new, or only the finished request."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class Made:
    """A dataclass field whose LogprobsList value becomes a plain list when first read (see the module docstring)."""
    def __set_name__(self, owner, name: str):
        self.key = "_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            return None                           # (the field's default, as dataclass reads it)
        value = obj.__dict__.get(self.key)
        if isinstance(value, LogprobsList):
            value = obj.__dict__[self.key] = list(value)
        return value

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.key] = value


@dataclass
class CompletionOutput:
    index: int                            # which of the request's n samples
    text: str                             # generated text (truncated before a matched stop string)
    token_ids: list[int]                  # generated tokens
    cumulative_logprob: float | None = None    # sum of the tokens' logprobs (when logprobs were asked)
    logprobs: Sequence[dict[int, Logprob]] | None = Made()   # per generated token (when logprobs were asked)
    finish_reason: str | None = None      # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop_token_ids entry that ended it (None: EOS, length)

    @property
    def finished(self) -> "Flag":
        """Whether it ended: `o.finished()` as vLLM's method, or `o.finished` as RequestOutput's attribute."""
        return Flag(self.finish_reason is not None)


class Flag(int):
    """A bool that can also be called (vLLM's CompletionOutput.finished is a method, RequestOutput's an attribute)."""
    def __call__(self) -> bool:
        return bool(self)

    def __repr__(self) -> str:
        return repr(bool(self))


class RequestMetrics(dict):
    """A request's timings, {"ttft_s", "tpot_s"} (of its first sample; empty for streamed deltas), read as a dict
    or by attribute: `m.ttft_s`, and vLLM's name `m.first_token_latency` (= ttft_s)."""
    def __getattr__(self, name):
        try:
            return self[{"first_token_latency": "ttft_s"}.get(name, name)]
        except KeyError:
            raise AttributeError(f"RequestMetrics has no {name!r} (it has {sorted(self)})") from None


@dataclass
class RequestOutput:
    """vLLM's fields, in vLLM's order (its first six may be given by position)."""
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: Sequence[dict[int, Logprob] | None] | None = Made()   # per prompt token; the first is None
    outputs: list[CompletionOutput] = field(default_factory=list)   # one per sample (n); a delta: those that moved
    # every sample has ended (a streamed delta: True on the request's last delta only); None: from `outputs`
    finished: bool | None = None
    metrics: dict = field(default_factory=RequestMetrics)   # ttft_s, tpot_s (of the first sample)
    lora_request: None = None             # (vLLM's; no LoRA here)
    num_cached_tokens: int = 0            # prompt tokens served from the prefix cache

    def __post_init__(self):
        if self.finished is None:
            self.finished = all(o.finished for o in self.outputs)
        if type(self.metrics) is dict:
            self.metrics = RequestMetrics(self.metrics)

    def add(self, next_output: "RequestOutput", aggregate: bool) -> None:
        """vLLM's: fold a later output of this request in. Each of its samples extends the one with the same index
        (aggregate: text, token ids and logprobs appended, the rest taken) or replaces it (not aggregate); a
        sample not here yet is appended."""
        self.finished = bool(self.finished or next_output.finished)
        for new in next_output.outputs:
            old = next((i for i, o in enumerate(self.outputs) if o.index == new.index), None)
            if old is None:
                self.outputs.append(new)
            elif not aggregate:
                self.outputs[old] = new
            else:
                o = self.outputs[old]
                o.text += new.text
                o.token_ids = [*o.token_ids, *new.token_ids]
                if new.logprobs:
                    o.logprobs = [*(o.logprobs or []), *new.logprobs]
                o.cumulative_logprob, o.finish_reason, o.stop_reason = (new.cumulative_logprob, new.finish_reason,
                                                                        new.stop_reason)

    # the first completion's fields, as before n existed (a streamed delta: the sample that moved)
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        """outputs[0]'s, once the whole request has ended (`finished`); None before."""
        return self.outputs[0].finish_reason if self.finished else None


def logprob_dict(row: list[float], token_id: int, n: int, decode=None) -> dict[int, Logprob]:
    """vLLM's per-token logprobs from an engine row (see the module docstring): token_id with its own
    logprob and rank, then the top n. decode(token_id) -> str fills decoded_token (None: left empty)."""
    width = (len(row) - 2) // 2
    out = {int(token_id): Logprob(float(row[0]), int(row[1]))}
    for r in range(min(n, width)):
        t = int(row[2 + r])
        if t not in out:
            out[t] = Logprob(float(row[2 + width + r]), r + 1)
    if decode is not None:
        for t, lp in out.items():
            lp.decoded_token = decode(t)
    return out


def cumulative_logprob(rows: list[list[float]]) -> float:
    return float(sum(r[0] for r in rows))


class LogprobsList(MutableSequence):
    """A list of `{token_id: Logprob}` (None where a row is None) made from engine rows as it is read. It reads,
    slices, compares, concatenates and changes (append, extend, ...) as a list does; `list(x)` gives a plain
    list, and so does pickling it (a plain list of what it holds, without the tokenizer). With `context`
    (the ids before the first, maybe []), decode(token_id, ids before it) (TokenTexts: a character split
    across tokens goes to the token that completes it, as vLLM's)."""

    def __init__(self, rows: list, token_ids: list[int], n: int, decode=None, context: list[int] | None = None):
        self._rows, self._ids, self._n, self._decode = rows, token_ids, n, decode
        self._context = context
        self._made: dict[int, dict] = {}
        self._list: list | None = None             # every entry made, once the list is changed

    def __len__(self) -> int:
        return len(self._rows) if self._list is None else len(self._list)

    def _plain(self) -> list:
        if self._list is None:
            self._list = [self[i] for i in range(len(self._rows))]
        return self._list

    def __setitem__(self, i, value) -> None:
        self._plain()[i] = value

    def __delitem__(self, i) -> None:
        del self._plain()[i]

    def insert(self, i: int, value) -> None:
        self._plain().insert(i, value)

    def __reduce__(self):
        return list, (list(self),)

    def copy(self) -> list:
        return list(self)

    def __getitem__(self, i):
        if self._list is not None:
            return self._list[i]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self))[i]                          # negative indices; IndexError past the end
        if i not in self._made:
            row = self._rows[i]
            decode = self._decode
            if decode is not None and self._context is not None:
                before = (self._context + self._ids[max(0, i - FIXUP_TOKENS):i])[-FIXUP_TOKENS:]
                decode = lambda t, d=self._decode: d(t, before)    # noqa: E731
            self._made[i] = None if row is None else logprob_dict(row, self._ids[i], self._n, decode)
        return self._made[i]

    def __add__(self, other) -> list:
        return list(self) + list(other)

    def __radd__(self, other) -> list:                   # [None] + out.logprobs, prompt_logprobs[1:] + ...
        return list(other) + list(self)

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and not isinstance(other, str) and list(self) == list(other)

    def __repr__(self) -> str:
        return repr(list(self))
