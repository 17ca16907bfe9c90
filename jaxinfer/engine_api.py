"""`llm.llm_engine`: vLLM's LLMEngine request API over an LLM's engine, for code written against vLLM's loop:

    engine = llm.llm_engine
    engine.add_request("a", "Hello, my name is", SamplingParams(max_tokens=32))
    while engine.has_unfinished_requests():
        for out in engine.step():              # RequestOutputs of the requests that moved in this step
            if out.finished:
                print(out.request_id, out.outputs[0].text)

Request ids are the caller's (vLLM: strings), prompts take every form `generate` takes, and an output holds what
`SamplingParams.output_kind` asks: everything so far (vLLM's default, CUMULATIVE), only what is new (DELTA), or only
the finished request (FINAL_ONLY); a kind is given as vLLM's enum, its name or its value. Stop strings, n samples,
logprobs and prompt logprobs behave as in `generate`. `abort_request` ends requests and frees their KV blocks at once
(they yield no further output). What it does not define it takes from the engine below (`stats()`, `block_manager`,
`scheduler`, `warmup_extras`, ...).

As vLLM's, it can be made without an LLM in hand: `LLMEngine.from_engine_args(EngineArgs(model, **options))`
(both importable from jaxinfer; `EngineArgs.add_cli_args(parser)` / `from_cli_args(args)` are the engine flags of
`jaxinfer generate`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, make_dataclass
from numbers import Integral

from jaxinfer import prompts as prompt_forms
from jaxinfer.engine.one_thread import Window, recovering
from jaxinfer.engine.sequence import Sequence, is_finished
from jaxinfer.output_processor import TokenTexts, logprobs_of, metrics_of, prompt_logprobs_of, stop_reason
from jaxinfer.outputs import CompletionOutput, RequestOutput

KINDS = {0: "CUMULATIVE", 1: "DELTA", 2: "FINAL_ONLY"}     # vLLM's RequestOutputKind values


def output_kind(params) -> str:
    kind = params.output_kind
    kind = getattr(kind, "name", kind)
    kind = KINDS.get(kind, kind) if isinstance(kind, int) else kind
    kind = "CUMULATIVE" if kind is None else str(kind).upper()
    if kind not in KINDS.values():
        raise ValueError(f"output_kind={params.output_kind!r}: the engine gives CUMULATIVE (0), DELTA (1) or "
                         f"FINAL_ONLY (2) outputs")
    return kind


@dataclass
class _Request:
    request_id: object
    prompt: object
    prompt_ids: list[int]
    seqs: list[Sequence]
    kind: str
    procs: dict = field(default_factory=dict)               # seq_id -> OutputProcessor (stream mode)
    text: list = field(default_factory=list)                # per sample: text so far
    ids: list = field(default_factory=list)                 # per sample: token ids shown so far
    prompt_sent: bool = False
    cum: dict = field(default_factory=dict)                 # per sample: cumulative logprob sent (DELTA)
    ended: set = field(default_factory=set)                 # samples whose finish_reason was sent

    def sent(self) -> tuple:
        """What its outputs gave (step puts it back when an exception keeps them from the caller)."""
        return list(self.text), list(self.ids), self.prompt_sent, dict(self.cum), set(self.ended)


def check_id(request_id) -> None:
    if isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
        raise ValueError(f"request_id must be a string (vLLM's) or an int, got {request_id!r:.80}")


def request_ids(request_id) -> list:
    """One id or an iterable of them (vLLM's abort) as a list of str / int ids (numpy ints as ints); ValueError
    naming anything else."""
    one = isinstance(request_id, (str, Integral))
    try:
        ids = [int(r) if isinstance(r, Integral) and not isinstance(r, bool) else r
               for r in ([request_id] if one else request_id)]
    except TypeError:
        raise ValueError(f"request_id must be a str, an int or an iterable of them, got {request_id!r:.80}") from None
    for rid in ids:
        check_id(rid)
    return ids


def _twin(request_id):
    """The id's other spelling (5 and "5" name one request), None if it has none."""
    if isinstance(request_id, int):
        return str(request_id)
    try:
        return int(request_id) if str(int(request_id)) == request_id else None
    except ValueError:
        return None


class EngineAPI:
    def __init__(self, llm):
        self._llm, self._requests = llm, {}                  # request_id -> _Request, in arrival order

    @classmethod
    def from_engine_args(cls, engine_args: "EngineArgs", **vllm_kwargs) -> "EngineAPI":
        """vLLM's: the engine of `LLM(engine_args.model, **engine_args.kwargs)` (usage_context, ... ignored)."""
        from jaxinfer.llm import LLM
        return LLM(engine_args.model, **engine_args.kwargs).llm_engine

    def __getattr__(self, name):
        return getattr(self._llm.engine, name)

    def get_tokenizer(self):
        return self._llm.get_tokenizer()

    # vLLM's LLMEngine.tokenizer: None with skip_tokenizer_init=True (get_tokenizer() raises then, as vLLM's)
    tokenizer = property(lambda self: None if getattr(self._llm.tokenizer, "skipped", False) else self.get_tokenizer())

    @property
    def model_config(self) -> "ModelConfigView":
        return ModelConfigView(self._llm.model_config, self._llm.config.max_model_len)

    def get_model_config(self) -> "ModelConfigView":
        return self.model_config

    def reset_prefix_cache(self, *args, **kwargs) -> bool:
        """vLLM's LLMEngine.reset_prefix_cache: LLM.reset_prefix_cache's."""
        return self._llm.reset_prefix_cache(*args, **kwargs)

    def add_request(self, request_id, prompt, params=None, arrival_time=None, lora_request=None,
                    tokenization_kwargs=None, trace_headers=None, priority: int = 0) -> None:
        """Queue one prompt (a string, a list of token ids, or a TextPrompt / TokensPrompt dict) under the caller's
        request_id; `params`: SamplingParams (None: `llm.get_default_sampling_params()`). vLLM's other arguments are
        accepted (lora_request None, priority 0; tokenization_kwargs reach the tokenizer, as LLM.generate's)."""
        prompt_forms.check_unsupported("LLMEngine.add_request", lora_request=lora_request)
        if isinstance(priority, bool) or priority != 0:
            raise ValueError(f"LLMEngine.add_request: priority={priority!r:.80} is not supported by jaxinfer (0 only)")
        check_id(request_id)
        if request_id in self._requests or _twin(request_id) in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine (abort it or let it finish first)")
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], (str, dict, list, tuple)):
            raise ValueError(f"add_request takes one prompt, got a list of {len(prompt)} (add one request each)")
        if params is not None and not hasattr(params, "n"):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__} {params!r:.80}")
        added, kind = None, output_kind(params or self._llm.get_default_sampling_params())
        try:       # (an exception, even a Ctrl-C as the `with` blocks exit, leaves nothing queued)
            with self._llm._one_thread(), recovering(self._llm.engine, [], mine := Window()):
                try:
                    [(p, ids, sp)] = self._llm._prepare([prompt], params, tokenization_kwargs)
                except ValueError as e:       # (it names the prompt by its place in a list of one: name the request)
                    raise ValueError(str(e).replace("prompt 0", f"request {request_id!r}", 1)) from None
                [group] = self._llm._add([(p, ids, sp)], mine)
                self._requests[request_id] = added = _Request(request_id, p, ids, group, kind, text=[""] * len(group),
                                                              ids=list([] for _ in group))
        except BaseException:
            if added is not None and self._requests.get(request_id) is added:
                self._abort(request_id)
            raise

    def abort_request(self, request_id) -> None:
        """End one request or several (an iterable of ids) and free their KV blocks; unknown ids are ignored."""
        for rid in request_ids(request_id):
            self._abort(rid)

    def _abort(self, request_id, output: bool = False) -> RequestOutput | None:
        """End one request (its id is free again at once); `output` (AsyncLLMEngine.abort): return its last output,
        finish_reason "abort" for the samples that had not ended. None for an unknown id."""
        req = self._requests.pop(self._key(request_id), None)
        for seq in req.seqs if req else ():
            if not is_finished(seq):
                self._llm.engine.abort(seq)
        return self._output(req, TokenTexts(self._llm.tokenizer)) if req and output else None

    def _key(self, request_id):
        """The key a request was added under: the id itself or its other spelling (5 and "5" name one request)."""
        return request_id if request_id in self._requests or _twin(request_id) not in self._requests \
            else _twin(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or self._llm.engine.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def step(self) -> list[RequestOutput]:
        """Run one engine step (when there is work) and return the outputs of this API's requests that moved."""
        saved, sent = self._requests, []
        try:       # (an exception, even a Ctrl-C as the `with` blocks exit: nothing of this step counts as sent)
            with self._llm._one_thread(), recovering(self._llm.engine, []):   # (Ctrl-C: the requests go on, recomputed)
                if self._llm.engine.has_unfinished():
                    self._llm._one_thread.steps += 1
                    self._llm.engine.step()
                outputs, texts, saved = [], TokenTexts(self._llm.tokenizer), dict(self._requests)
                sent = [(r, r.sent()) for r in saved.values()]
                for rid, req in saved.items():
                    out = self._output(req, texts)
                    if out is not None:
                        outputs.append(out)
                    if all(is_finished(s) and j in req.ended for j, s in enumerate(req.seqs)):
                        del self._requests[rid]
        except BaseException:
            self._requests = saved                # (the next step gives them again: _output reads what was not sent)
            for req, state in sent:
                req.text, req.ids, req.prompt_sent, req.cum, req.ended = state
            raise
        return outputs

    def _output(self, req: _Request, texts: TokenTexts) -> RequestOutput | None:
        moved = []
        for j, seq in enumerate(req.seqs):
            self._llm._process_text(seq, req.procs, stream=True)
            # what the processor gave beyond what was sent (also what an interrupted step did not return)
            d = req.procs[seq.seq_id].since(len(req.text[j]), len(req.ids[j]), j in req.ended)
            if d.text or d.token_ids or d.finish_reason:
                moved.append((j, d))
        if not moved:
            return None
        starts = {j: len(req.ids[j]) for j, _ in moved}
        for j, d in moved:
            req.text[j], req.ids[j] = req.text[j] + d.text, req.ids[j] + d.token_ids
            if d.finish_reason:
                req.ended.add(j)
        finished = len(req.ended) == len(req.seqs)
        if req.kind == "FINAL_ONLY" and not finished:
            return None
        if req.kind == "DELTA":
            outs = [self._completion(j, req.seqs[j], starts[j], d.text, d.token_ids, d.finish_reason, req, texts)
                    for j, d in moved]
        else:
            outs = [self._completion(j, s, 0, req.text[j], req.ids[j], req.procs[s.seq_id].finish_reason, req, texts)
                    for j, s in enumerate(req.seqs)]
        first = not req.prompt_sent or req.kind != "DELTA"
        req.prompt_sent = True
        return RequestOutput(request_id=req.request_id, prompt=prompt_forms.text(req.prompt),
                             prompt_token_ids=req.prompt_ids, outputs=outs,
                             prompt_logprobs=prompt_logprobs_of(req.seqs[0], texts) if first else None,
                             num_cached_tokens=req.seqs[0].num_cached_tokens, finished=finished,
                             metrics=metrics_of(req.seqs[0]) if finished and req.kind != "DELTA" else {})

    def _completion(self, j, seq, start, text, ids, reason, req, texts) -> CompletionOutput:
        # (the cumulative logprob counts every token so far: a delta adds its rows to the running sum)
        lps, req.cum[j] = logprobs_of(seq, start, ids, texts, req.cum.get(j, 0.0) if start else 0.0)
        stop = None if reason is None else stop_reason(seq, req.procs.get(seq.seq_id), *self._llm._eos)
        return CompletionOutput(j, text, list(ids), req.cum[j], lps, reason, stop)


class ModelConfigView:
    """`llm.llm_engine.model_config`: the model's config (jaxinfer's ModelConfig: vocab_size, num_hidden_layers,
    ...) with vLLM's `max_model_len` (the engine's: the longest prompt + output), as vLLM's ModelConfig has it."""

    def __init__(self, model_config, max_model_len: int):
        self._config, self.max_model_len = model_config, max_model_len

    def __getattr__(self, name):
        if name.startswith("_"):                 # (copy / pickle look up their hooks before _config exists)
            raise AttributeError(name)
        return getattr(self._config, name)

    def __repr__(self) -> str:
        return f"{self._config!r} (max_model_len={self.max_model_len})"


LLMEngine = EngineAPI                 # vLLM's name (`from jaxinfer import LLMEngine`); the engine below is engine/


class _EngineArgsBase:
    @property
    def kwargs(self) -> dict:
        """LLM()'s keyword arguments: the options that differ from their defaults."""
        return {f.name: v for f in fields(self) if f.name != "model" and (v := getattr(self, f.name)) != f.default}

    @staticmethod
    def add_cli_args(parser):
        """The engine flags (--model, --max-num-seqs, ...) on `parser` (or an argument group), each stored under
        its LLM() keyword, so that `LLM(**vars(parser.parse_args()))` runs, as with vLLM's; returns `parser`."""
        from jaxinfer.cli import add_engine_args
        add_engine_args(parser, llm_names=True)
        return parser

    @classmethod
    def from_cli_args(cls, args):
        """From a namespace of add_cli_args' flags (other attributes, e.g. a script's own flags, are left out)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names and v is not None})

    def __repr__(self) -> str:
        shown = [f"{k}={'***' if k == 'hf_token' else repr(v)}" for k, v in self.kwargs.items()]
        return f"EngineArgs({', '.join([f'model={self.model!r}', *shown])})"


def _engine_args_fields() -> list[tuple]:
    """(name, type, field) of every LLM() keyword argument, with LLM()'s default (None: the engine picks)."""
    from jaxinfer.cli import VLLM_MODEL_OPTIONS
    from jaxinfer.compat import ALIASES, FIXED, IGNORED
    from jaxinfer.config import EngineConfig
    defaults = {f.name: f.default for f in fields(EngineConfig)}
    names = sorted({*defaults, *VLLM_MODEL_OPTIONS, *IGNORED, *FIXED, *ALIASES, "override_generation_config",
                    "reasoning_parser"})
    out = [("model", str, field(default="qwen3-pydoc")), ("generation_config", str, field(default="auto"))]
    return out + [(n, object, field(default=defaults.get(n))) for n in names]


# vLLM's EngineArgs: a dataclass of a model and LLM()'s keyword arguments (dataclasses.asdict(args) are LLM()'s),
# for LLMEngine.from_engine_args; the default model is the demo model (vLLM's has one too)
EngineArgs = make_dataclass("EngineArgs", _engine_args_fields(), bases=(_EngineArgsBase,), repr=False,
                            namespace={"__module__": __name__})
