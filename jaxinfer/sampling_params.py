"""Per-request sampling parameters (vLLM names), validated on construction."""
from __future__ import annotations

import numbers
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace

from jaxinfer import bad_words, structured
from jaxinfer.beam_search import BeamSearchParams  # noqa: F401  (vLLM's import path)
from jaxinfer.outputs import RequestOutputKind  # (also vLLM's import path)
from jaxinfer.structured import GuidedDecodingParams, StructuredOutputsParams  # noqa: F401  (vLLM's import path)
from jaxinfer.tokenizer import check_text_fields

MAX_LOGPROBS = 20          # vLLM's default max_logprobs: logprobs / prompt_logprobs take 0 .. 20 (LLM(max_logprobs=))
MIN_TEMPERATURE = 0.01     # vLLM's floor for a positive temperature
MAX_TEMPERATURE = 1e30     # float32 holds it and its inverse (1e300 would become inf, -inf logits NaN)
TOP_K_CANDIDATES = 64      # a row with top_k <= this draws among its top candidates, no sort (sampling.py)
MAX_STOP_IDS_WITH_MIN_TOKENS = 1024  # the step bans them (and EOS) until min_tokens: step.BAN_WIDTHS' widest holds
MAX_BIASED = 1024          # logit_bias / allowed_token_ids ids a request may name (step.BIAS_WIDTHS' widest)


@dataclass(eq=True, kw_only=True)
class SamplingParams:
    """Validated on construction, and again when a field is set afterwards (`sp.max_tokens = 5`, as vLLM's allow);
    a value that is valid alone but not with another field (max_tokens below min_tokens) is taken, so that fields
    edited one at a time may pass through such a state: the whole is checked again when a request uses it.
    Keyword arguments only: vLLM's first field is n, nano-vllm's temperature, so a positional value is refused."""
    temperature: float = 1.0          # 0 means greedy
    top_k: int = 0                    # 0 or -1 disables
    top_p: float = 1.0                # in (0, 1]
    min_p: float = 0.0                # in [0, 1]
    max_tokens: int | None = 16       # None: until max_model_len (as vLLM)
    ignore_eos: bool = False
    seed: int | None = None           # makes this request's samples reproducible whatever the batch
    stop: list[str] | str | None = None          # a list after construction (a string becomes [string])
    stop_token_ids: list[int] | None = None      # a list after construction
    n: int = 1                        # completions per prompt (they differ; a seed repeats all of them)
    logprobs: int | None = None       # per generated token: the sampled token's logprob + the top-N (N = logprobs)
    prompt_logprobs: int | None = None   # per prompt token (the first is None): its logprob + the top-N
    presence_penalty: float = 0.0     # subtract from tokens that appeared in the output (in [-2, 2])
    frequency_penalty: float = 0.0    # subtract, times the token's count in the output (in [-2, 2])
    repetition_penalty: float = 1.0   # > 0: divide positive / multiply negative logits of prompt + output tokens
    skip_special_tokens: bool = True  # the output text leaves special tokens out (as vLLM)
    include_stop_str_in_output: bool = False   # the text keeps the stop string (or stop token) that ended it
    min_tokens: int = 0               # EOS, stop_token_ids and stop strings cannot end the output before this many
    detokenize: bool = True           # False: outputs carry token ids only (text "")
    truncate_prompt_tokens: int | None = None   # keep only the prompt's last k tokens (-1: max_model_len of them)
    bad_words: list[str] | None = None            # words the output must not contain (bad_words.py)
    # vLLM fields accepted with the value that describes jaxinfer (another value is a ValueError naming it):
    spaces_between_special_tokens: bool = True    # (vLLM applies it to slow tokenizers only; Qwen3's are fast)
    best_of: int | None = None                    # None or n (vLLM's V1 engine refuses best_of > n too)
    allowed_token_ids: list[int] | None = None
    logit_bias: dict | None = None
    logits_processors: list | None = None
    structured_outputs: object = None             # (vLLM's structured output; `guided_decoding` in older vLLM)
    guided_decoding: object = None
    extra_args: dict | None = None
    output_kind: object = RequestOutputKind.CUMULATIVE   # vLLM's; LLM.generate sets its own (stream: deltas)

    def __post_init__(self):
        for f in _INT_FIELDS:          # numpy integers / floats (e.g. seed=np.random.randint(...)) as Python's
            v = getattr(self, f)
            if isinstance(v, numbers.Integral) and not isinstance(v, (bool, int)):
                object.__setattr__(self, f, int(v))
        for f in _FLOAT_FIELDS:
            v = getattr(self, f)
            if isinstance(v, numbers.Real) and not isinstance(v, (bool, int, float)):
                object.__setattr__(self, f, float(v))

        def bad(name, why):
            raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r:.100} {why}")
        def number(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool)
        if not number(self.temperature) or not 0 <= self.temperature < float("inf"):
            bad("temperature", "must be a finite number >= 0 (0 = greedy)")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            bad("top_k", "must be an integer >= -1 (0 or -1 disable it)")
        if not number(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not number(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        mt = self.max_tokens
        if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool) or mt < 1):
            bad("max_tokens", "must be an integer >= 1, or None (up to max_model_len)")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            bad("seed", "must be an integer or None")
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            bad("stop", "must be a string, a list of strings or None")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            bad("stop", "must be a non-empty string or a list of them")
        object.__setattr__(self, "stop", list(stop))           # lists, as vLLM's
        try:                                                    # any iterable of ids (vLLM: list(...))
            if isinstance(self.stop_token_ids, (str, bytes, dict)):
                raise TypeError
            ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        except TypeError:
            bad("stop_token_ids", "must be a list of non-negative integers or None")
        ids = [int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t for t in ids]
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
            bad("stop_token_ids", "must be a list of non-negative integers")
        object.__setattr__(self, "stop_token_ids", ids)
        # as vLLM: a temperature in (0, 0.01) is 0.01 (logits / 1e-37 overflow to inf and tie); seed -1 is no seed.
        # A temperature past MAX_TEMPERATURE is MAX_TEMPERATURE: the same uniform draw, and float32 keeps it finite.
        object.__setattr__(self, "temperature", min(max(float(self.temperature), MIN_TEMPERATURE), MAX_TEMPERATURE)
                           if self.temperature else 0.0)
        if self.temperature == 0.0:             # greedy: its filters reset, as vLLM's
            [object.__setattr__(self, k, v) for k, v in (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0))]
        if self.seed == -1:
            object.__setattr__(self, "seed", None)
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if self.n > 1 and self.temperature == 0.0:
            bad("n", "must be 1 when using greedy sampling (temperature 0: the n samples would be the same), as vLLM's")
        for name in ("logprobs", "prompt_logprobs"):
            if isinstance(v := getattr(self, name), bool):         # True: 1 (vLLM takes a bool as the int it is)
                object.__setattr__(self, name, v := int(v))
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < -1):
                bad(name, "must be None or an integer >= -1 (the top-N logprobs per token; -1: the whole vocabulary)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not -2 <= v <= 2:
                bad(name, "must be a number in [-2, 2]")
            object.__setattr__(self, name, float(v))
        rp = self.repetition_penalty
        if not isinstance(rp, (int, float)) or isinstance(rp, bool) or not 0 < rp < float("inf"):
            bad("repetition_penalty", "must be a number > 0 (1 = no penalty)")
        object.__setattr__(self, "repetition_penalty", float(rp))
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "detokenize",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be True or False")
        if not self.detokenize and stop:
            bad("detokenize", "cannot be False with stop strings (they are matched in the text)")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not (k >= 1 or k == -1)):
            bad("truncate_prompt_tokens", "must be None, an integer >= 1 or -1 (max_model_len)")
        b = self.best_of
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b != self.n):
            bad("best_of", f"is not supported: only None or best_of == n ({self.n})")
        self._check_bias(bad)
        object.__setattr__(self, "bad_words", bad_words.check(self.bad_words, bad))
        object.__setattr__(self, "structured_outputs", structured.check(self.structured_outputs, self.guided_decoding,
                                                                        bad, self.min_tokens))
        object.__setattr__(self, "guided_decoding", None)        # (its older name: structured_outputs now holds it)
        if (v := self.logits_processors) is not None and not (isinstance(v, (list, tuple)) and not v):
            bad("logits_processors", "is not supported by jaxinfer (leave it None)")   # (None or empty: nothing)
        if self.extra_args is not None and not isinstance(self.extra_args, dict):   # (vLLM's: for plugins; unread)
            bad("extra_args", "must be a dict or None")
        m = self.min_tokens
        if not isinstance(m, int) or isinstance(m, bool) or m < 0 or (mt is not None and m > mt):
            bad("min_tokens", f"must be an integer in [0, max_tokens={mt}]")
        if m and len(ids) > MAX_STOP_IDS_WITH_MIN_TOKENS:
            bad("stop_token_ids", f"holds {len(ids)} ids: with min_tokens at most {MAX_STOP_IDS_WITH_MIN_TOKENS}")

    def _check_bias(self, bad) -> None:
        """logit_bias {id: bias, -inf bans it}, allowed_token_ids (non-empty): {int: float}, ints; <= MAX_BIASED."""
        lb, allowed = self.logit_bias, self.allowed_token_ids
        isid = lambda t: isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0   # noqa: E731
        real = lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool) and v < float("inf")  # noqa: E731
        if lb is not None and (not isinstance(lb, dict) or not all(isid(k) and real(v) for k, v in lb.items())):
            bad("logit_bias", "must be a dict of token ids (integers >= 0) to finite numbers or -inf, or None")
        if allowed is not None and (not isinstance(allowed, (list, tuple)) or not all(map(isid, allowed))):
            bad("allowed_token_ids", "must be a list of token ids (integers >= 0) or None")
        if allowed is not None and not allowed:
            bad("allowed_token_ids", "is not None and empty (vLLM's error): leave it None to allow every token")
        object.__setattr__(self, "logit_bias", {int(k): float(v) for k, v in lb.items()} or None if lb else None)
        object.__setattr__(self, "allowed_token_ids", list(dict.fromkeys(map(int, allowed))) if allowed else None)
        if (n := len(self.biased_ids())) > MAX_BIASED:
            bad("allowed_token_ids" if allowed else "logit_bias", f"names {n} ids: at most {MAX_BIASED}")

    def biased_ids(self) -> list[int]:
        """The ids the step's bias entries hold: allowed_token_ids if given (the rest is masked), else logit_bias'."""
        return list(self.allowed_token_ids) if self.allowed_token_ids else list(self.logit_bias or ())

    def __setattr__(self, name, value):
        if _FIELD_NAMES[-1] not in self.__dict__:      # (during __init__: its fields are set in order)
            return object.__setattr__(self, name, value)
        if name not in _FIELD_NAMES:
            raise AttributeError(f"SamplingParams has no field {name!r}")
        if isinstance(value, Iterator):            # (a one-shot iterator may be read twice below)
            value = list(value)
        try:
            checked = replace(self, **{name: value})       # validated (and normalised) as a new one would be
        except ValueError as e:   # valid alone (beside the most permissive others) is taken: edits one at a time
            try:                  # may pass through a state valid for neither; the whole is checked when used (clone)
                alone = SamplingParams(**{"max_tokens": None, name: value})
            except ValueError:
                raise e from None
            return object.__setattr__(self, name, getattr(alone, name))
        for f in _FIELD_NAMES:
            object.__setattr__(self, f, getattr(checked, f))

    __hash__ = None                                    # mutable, as vLLM's

    clone = replace                                    # a copy: sp.clone() (vLLM's)

    @classmethod
    def from_optional(cls, **kwargs) -> "SamplingParams":
        """vLLM's: None arguments take the defaults (max_tokens: no limit); logit_bias keys ints, clamped to +-100."""
        if kwargs.get("logit_bias"):
            kwargs["logit_bias"] = openai_bias(kwargs["logit_bias"])
        return cls(**{k: v for k, v in kwargs.items() if v is not None or k == "max_tokens"})

    greedy = property(lambda self: self.temperature == 0.0)

    @property
    def needs_filter(self) -> bool:
        """Whether sampling must sort the vocabulary (top-k, top-p or min-p on a sampled row)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)

    @property
    def filter_kind(self) -> bool | str:
        """How the draw filters (sampling.sample's `filtered`): False if it does not, "top_k" when its top_k is
        1..TOP_K_CANDIDATES (it needs only its top candidates), True when it must sort the vocabulary."""
        return self.needs_filter and ("top_k" if 0 < self.top_k <= TOP_K_CANDIDATES else True)

    @property
    def needs_extras(self) -> bool:
        """Penalties, logprobs, min_tokens, logit_bias, allowed_token_ids or bad_words: the step's extras variant."""
        return self.has_penalties or self.logprobs is not None or self.prompt_logprobs is not None or \
            self.min_tokens > 0 or self.has_bias or bool(self.bad_words) or self.structured_outputs is not None

    has_bias = property(lambda self: bool(self.logit_bias or self.allowed_token_ids))
    has_penalties = property(lambda self: self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or
                             self.repetition_penalty != 1.0)

    def check_vocab(self, vocab_size: int, error=ValueError, eos=(), tokenizer=None, wait: bool = True,
                    max_logprobs: int = MAX_LOGPROBS) -> None:
        """`error` (ValueError) for ids past the vocabulary (vLLM's check and words), allowed_token_ids that are
        all stop or `eos` ids banned by min_tokens (no token could be drawn), or more logprobs than `max_logprobs`
        (the engine's). bad_words are tokenized with `tokenizer` (vLLM's update_from_tokenizer; kept as its
        `_bad_words_token_ids`), refused if they cannot be. Logprobs -1 become the vocabulary size here."""
        check_text_fields(tokenizer, self, error)           # (no tokenizer: stop strings, bad_words, ... refused)
        cap = vocab_size if max_logprobs == -1 else max_logprobs
        for name in ("logprobs", "prompt_logprobs"):        # -1: vLLM's "all vocab_size log probabilities"
            asked = f"-1 (the vocabulary, {vocab_size})" if (k := getattr(self, name)) == -1 else k
            object.__setattr__(self, name, k := vocab_size if k == -1 else k)
            if k is not None and k > cap:
                raise error(f"{name}={asked} is more than max_logprobs={cap} (LLM(max_logprobs=...), --max-logprobs)")
        if self.bad_words:
            object.__setattr__(self, "_bad_words_token_ids", bad_words.token_ids(tokenizer, self.bad_words,
                                                                                vocab_size, error))
        if (so := self.structured_outputs) is not None:   # (choice: structured.py; json / regex: grammar.py)
            object.__setattr__(self, *structured.rule_of(so, tokenizer, vocab_size, eos, error, wait))
        ban = set(self.stop_token_ids) | set(eos) if self.min_tokens and self.allowed_token_ids else ()
        if ban and set(self.allowed_token_ids) <= ban:
            raise error(f"allowed_token_ids are all stop or EOS ids, which min_tokens={self.min_tokens} bans")
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("allowed_token_ids", self.allowed_token_ids),
                          ("logit_bias", self.logit_bias)):
            if oov := [t for t in ids or () if t >= vocab_size]:
                raise error(f"{name} contains out-of-vocab token id(s) {oov[:8]}. Vocabulary size: {vocab_size}")

    def up_to(self, room: int) -> "SamplingParams":
        """These params with max_tokens None (vLLM's "until max_model_len") made `room`, the tokens the context
        has left (min_tokens at most that: the request ends on "length" there, as with a max_tokens given)."""
        return self if self.max_tokens is not None else replace(self, max_tokens=room,
                                                                  min_tokens=min(self.min_tokens, room))

    def for_sample(self, index: int) -> "SamplingParams":
        """The params of completion `index` of an n > 1 request, as one n = 1 request. Sample i takes seed + i,
        as vLLM's (so n = 1 and sample 0 of n draw the same tokens, the same seed repeats all n samples, and they
        differ from each other). Without a seed each sample gets its own random seed from the engine. Prompt
        logprobs are asked of sample 0 only (they are the same for every sample; the others may then reuse the
        prompt's cached KV)."""
        if not 0 <= index < self.n:
            raise ValueError(f"sample index {index} is outside [0, n={self.n})")
        out = replace(self, n=1, best_of=None, prompt_logprobs=self.prompt_logprobs if index == 0 else None)
        if self.seed is not None:        # (set after: a sum of -1 is a seed here, not vLLM's "no seed")
            object.__setattr__(out, "seed", self.seed + index)
        return out


_FIELD_NAMES = tuple(f.name for f in fields(SamplingParams))
_INT_FIELDS = ("top_k", "max_tokens", "seed", "n", "logprobs", "prompt_logprobs", "min_tokens",
               "truncate_prompt_tokens", "best_of")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def per_prompt(params, count: int, default: SamplingParams) -> list[SamplingParams]:
    """One SamplingParams per prompt, from `params`: one (shared), a list of `count`, or None (`default`);
    anything else is a ValueError naming it."""
    params = default if params is None else params
    if not isinstance(params, (SamplingParams, list, tuple)):
        raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got {type(params).__name__} "
                         f"{params!r:.80}")
    params = [params] * count if isinstance(params, SamplingParams) else list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    bad = next((i for i, sp in enumerate(params) if not isinstance(sp, SamplingParams)), None)
    if bad is not None:
        raise ValueError(f"sampling_params[{bad}] must be a SamplingParams, got {params[bad]!r:.80}")
    return params


def openai_bias(bias: dict) -> dict[int, float]:
    """OpenAI's logit_bias as vLLM reads it: keys as ints (else ValueError), values clamped to [-100, 100] (a NaN is
    kept as it is, so that SamplingParams refuses it: clamping would make it -100)."""
    return {int(k): v if v != v else min(100.0, max(-100.0, v)) for k, v in bias.items()}

