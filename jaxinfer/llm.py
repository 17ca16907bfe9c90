"""The user-facing facade: `LLM(model, ...)`, `generate`, `stats`; below it the engine sees token ids only
(`LLM("path/to/Qwen3-0.6B").generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0.6, max_tokens=128))`)."""
from __future__ import annotations

import os
import weakref
from collections.abc import Iterator
from contextlib import nullcontext
from types import SimpleNamespace
from typing import Sequence as Seq

import jax
from tqdm.auto import tqdm

from jaxinfer import profiling, prompts as prompt_forms
from jaxinfer.beam_search import beam_search
from jaxinfer.compat import EngineControlRefused, PoolingRefused, pop_vllm_options, python_numbers
from jaxinfer.config import EngineConfig
from jaxinfer.engine.dp_engine import create_engine, sized_stats
from jaxinfer.engine.executables import engine_numerics
from jaxinfer.engine.llm_engine import is_finished
from jaxinfer.engine.one_thread import OneThread, Stream, Window, recovering
from jaxinfer.engine.sequence import Sequence, Status
from jaxinfer.generation_config import folder_eos_ids, sampling_defaults
from jaxinfer.hub import load_weights, model_config_for
from jaxinfer.model.supported import check_platform
from jaxinfer.output_processor import (OutputProcessor, TextDelta, TokenTexts, completion, eos_ids, logprobs_of,
                                       metrics_of, prompt_logprobs_of, primary_eos, stop_reason, warm_up)
from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.parallel.agree import same_requests
from jaxinfer.prompts import Prompt, truncate
from jaxinfer.sampling_params import SamplingParams, per_prompt
from jaxinfer.structured import reasoning_marks, reasoning_wait
from jaxinfer.tokenizer import load_tokenizer, usable
from jaxinfer.xla_options import warn_if_slow_command_buffers


class LLM(PoolingRefused, EngineControlRefused):
    """An offline engine for one model: `LLM(model, **engine_options)`.

    `model` is a checkpoint directory, an embedded preset ("qwen3-0.6b": random weights) or a hub id. The engine
    options are the fields of `jaxinfer.config.EngineConfig`, with vLLM's names (dtype, attn_backend, max_num_seqs,
    max_num_batched_tokens, max_model_len, block_size, num_kvcache_blocks, gpu_memory_utilization,
    enable_prefix_caching, seed, async_scheduling, warmup, ...); unset, the platform's defaults
    (`PLATFORM_DEFAULTS`: the benchmarked configuration on a GPU, small settings on a CPU; `llm.config` shows them,
    the pool `stats()`). `generation_config`: where the defaults of `generate(prompts)` without sampling params come
    from (`get_default_sampling_params`). vLLM's `reasoning_parser` ("qwen3", "deepseek_r1"): structured outputs
    apply after the thinking's `</think>` (unless the prompt closed it).
    """

    def __init__(self, model: str, generation_config: str = "auto", override_generation_config=None, **kwargs):
        kwargs = python_numbers(kwargs)           # (numpy ints, floats and bools as Python's)
        tokenizer, parser = pop_vllm_options(kwargs), kwargs.pop("reasoning_parser", None)     # (compat.py)
        hub = {k: kwargs.pop(k) for k in ("hf_overrides", "revision", "download_dir", "hf_token") if k in kwargs}
        requested = EngineConfig.from_kwargs(**kwargs)
        check_platform(requested, jax.default_backend(), ready=True)   # before the model (a hub id downloads it)
        path, model_config = model_config_for(model, **hub)
        self.default_sampling_params = sampling_defaults(path if os.path.isdir(path) else None, generation_config,
                                                         override_generation_config)
        self._default_params = SamplingParams(**self.default_sampling_params)
        config = requested.resolve(jax.default_backend(), model_config)
        self.model_config = model_config
        self.tokenizer = load_tokenizer(tokenizer or (path if os.path.isdir(path) else None), missing_ok=True)
        self._reasoning = reasoning_marks(parser, self.tokenizer)     # structured outputs wait for </think> (vLLM's)
        self._one_thread, self._streams = OneThread(), []      # one thread at a time; weak refs to the streams

        def load(placement):                     # (called by create_engine, under the engine's JAX settings)
            return load_weights(path, model_config, config.dtype, config.seed or 0, placement,   # (presets)
                                kv_scales=config.kv_cache_dtype != "auto" and not config.calculate_kv_scales)
        eos = eos_ids(self.tokenizer, self.model_config.eos_token_id + folder_eos_ids(generation_config))
        # max_model_len unset (or -1): the model's, capped by the KV pool (vLLM: only for -1; unset, it refuses)
        with engine_numerics():                  # a user's JAX settings stay theirs (executables.engine_numerics)
            self.engine = create_engine(self.model_config, config, load, eos,
                                        cap_max_model_len=requested.max_model_len is None, tokenizer=self.tokenizer)
        self._eos = (frozenset(eos), primary_eos(self.tokenizer, eos))     # (stop_reason's)
        self.config = self.engine.config
        warn_if_slow_command_buffers()
        if self.config.warmup:
            buckets = self.engine.runner.buckets()
            with tqdm(total=len(buckets), desc="Compiling steps", disable=None) as bar:
                self.engine.warmup(bar)
            warm_up(self.tokenizer)                  # the tokenizer's and the detokenizer's lazy first calls

    @property
    def llm_engine(self):
        """vLLM's LLMEngine API (add_request / step / abort_request / ...) over this LLM's engine (engine_api.py)."""
        from jaxinfer.engine_api import EngineAPI
        return self.__dict__.setdefault("_engine_api", EngineAPI(self))

    def abort(self, request_id: int) -> None:
        """Stop a request of the newest `stream` not ended (request_id: the prompt's index; "3" too), from the loop's
        body or another thread: its samples end with finish_reason "abort", freeing their KV blocks before the next
        step. Unknown or finished ids are ignored (as vLLM)."""
        request_id = int(request_id) if isinstance(request_id, str) and request_id.isdigit() else request_id
        if not isinstance(request_id, int) or isinstance(request_id, bool):
            raise ValueError(f"request_id must be an int (RequestOutput.request_id of LLM.stream), got {request_id!r}")
        for stream in [s for r in self._streams if (s := r()) is not None and s.open][-1:]:   # the newest not ended
            stream.aborts.add(request_id)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json recommendations, if any (vLLM's)."""
        return self._default_params.clone()

    def get_tokenizer(self):
        """The tokenizer (a Hugging Face tokenizer for checkpoints; a byte-level stand-in for presets; none with
        skip_tokenizer_init=True: a ValueError, as vLLM's)."""
        return usable(self.tokenizer)

    # -- requests ---------------------------------------------------------------------------------
    def _prepare(self, prompts, sampling_params, tokenization_kwargs=None) -> list[tuple[Prompt, list, SamplingParams]]:
        """Normalise and validate every request before any is queued (a bad one disturbs no other)."""
        prompts = prompt_forms.as_list(prompts)
        sampling_params = per_prompt(sampling_params, len(prompts), self._default_params)
        reqs = []
        for i, (p, sp) in enumerate(zip(prompts, sampling_params)):
            ids = prompt_forms.token_ids(self.tokenizer, p, i, tokenization_kwargs)
            ids = truncate(ids, sp.truncate_prompt_tokens, self.config.max_model_len)
            self.engine.check_request(ids, sp, where=f"prompt {i}")
            reqs.append((p, ids, sp))
        return reqs

    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None, priority: list[int] | None = None,
                 tokenization_kwargs: dict | None = None, stream: bool = False) -> list[RequestOutput]:
        """Generate for every prompt; outputs in prompt order (request_id: the prompt's index, as in `stream`).
        `use_tqdm`: a bool, or (vLLM's) a callable making the bar from total= and desc=. vLLM's `lora_request` (None
        only), `priority` (None / 0s) and `tokenization_kwargs` (cuts token prompts too) work. stream=True: stream()."""
        prompt_forms.check_unsupported("LLM.generate", lora_request=lora_request, **(
            dict(priority=priority, tokenization_kwargs=tokenization_kwargs) if stream else {}))
        if stream:
            return self.stream(prompts, sampling_params)
        reqs = self._prepare(prompts, sampling_params, tokenization_kwargs)
        prompt_forms.check_priority(priority, len(reqs))
        with self._one_thread():
            return self._generate(reqs, use_tqdm)

    def _generate(self, reqs, use_tqdm: bool) -> list[RequestOutput]:
        seqs, stop_texts, mine = [], {}, Window()   # stop_texts: seq_id -> OutputProcessor of those with stop strings
        with recovering(self.engine, seqs, mine):   # (an exception: nothing stays queued, no block is lost)
            groups = self._add(reqs, mine)
            seqs.extend(s for g in groups for s in g)   # (not an inlined list comprehension: test_interrupts)
            # (no tqdm at all when off: making one fixes multiprocessing's start method and starts a monitor thread)
            make = use_tqdm if callable(use_tqdm) else lambda **kw: tqdm(**kw, disable=None) if use_tqdm else \
                nullcontext(SimpleNamespace(update=lambda n=1: None))
            with make(total=len(seqs), desc="Generating") as bar:
                for _, seq in self._one_thread.run(self.engine, seqs):     # per token: keep it lean
                    if seq.params.stop:             # only these are detokenized as they run (the rest at the end)
                        self._process_text(seq, stop_texts, stream=False)
                    if seq.status is Status.FINISHED:
                        bar.update(1)
        texts = TokenTexts(self.tokenizer)
        return [self._output(i, p, g, texts, stop_texts) for i, ((p, _, _), g) in enumerate(zip(reqs, groups))]

    def _add(self, reqs, mine: Window) -> list[list[Sequence]]:
        """One sequence per sample (SamplingParams.for_sample); samples 1.. reuse sample 0's prompt KV (prefix cache,
        Sequence.waits_for_prompt). Callers hold `recovering(..., mine)`: a KeyboardInterrupt leaves none queued."""
        same_requests(reqs)                       # several hosts: every process queues the same, in order
        groups = []
        for p, ids, sp in reqs:
            groups.append([])
            end = reasoning_wait(self._reasoning, ids, sp)
            for j in range(sp.n):
                groups[-1].append(self.engine.add_request(ids, sp if sp.n == 1 else sp.for_sample(j), cache_salt=
                                  prompt_forms.cache_salt(p, 0), prompt_source=groups[-1][0] if j else None,
                                  reasoning_end=end))
        mine.close()                    # (later sequences, e.g. a nested call's, are not this call's)
        return groups

    # -- text ---------------------------------------------------------------------------------------
    def _process_text(self, seq: Sequence, procs: dict[int, OutputProcessor], stream: bool) -> TextDelta:
        """Feed seq's new tokens to its OutputProcessor (in procs, by seq_id; the one the server uses too);
        finish seq in the engine when a stop string matched."""
        proc = procs.get(seq.seq_id)
        if proc is None:
            proc = procs[seq.seq_id] = OutputProcessor.for_params(self.tokenizer, seq.params, stream)
        new = seq.output_token_ids[len(proc.token_ids):]
        try:
            delta = proc.update(new, seq.finish_reason)
        except BaseException:      # half applied: a new processor reads all of seq's ids at the next call (engine_api)
            del procs[seq.seq_id]
            raise
        if proc.stopped:      # a stop string; the tokens a K-step call (or later calls) read back after it are dropped
            self.engine.scheduler.finish(seq, "stop", len(seq.output_token_ids) - len(proc.token_ids))
        return delta

    def _output(self, i: int, prompt: Prompt, group: list[Sequence], texts: TokenTexts, procs: dict) -> RequestOutput:
        outs = [completion(j, seq, texts, procs.get(seq.seq_id), self.tokenizer, self._eos)
                for j, seq in enumerate(group)]
        seq = group[0]
        return RequestOutput(request_id=i, prompt=prompt_forms.text(prompt),
                             prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens], outputs=outs,
                             prompt_logprobs=prompt_logprobs_of(seq, texts),
                             num_cached_tokens=seq.num_cached_tokens, metrics=metrics_of(seq))

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget the cached KV of prompts (vLLM's): the next identical prompt is computed again. False, as vLLM's,
        while requests hold cached blocks (those stay cached), unless reset_running_requests (they keep their KV)."""
        bm = self.engine.block_manager
        bm.reset_prefix_cache(in_use=bool(reset_running_requests))
        return not bm.cached

    def stats(self) -> dict:
        """The engine's numbers, summed over replicas; at every size also `data_parallel_size`,
        `tensor_parallel_size` and `replicas` (each replica's own numbers)."""
        return sized_stats(self.engine)

    # vLLM's beam_search(prompts, BeamSearchParams(...)) (beam_search.py), start_profile / stop_profile (profiling.py)
    beam_search, start_profile, stop_profile = beam_search, profiling.start_profile, profiling.stop_profile

    # -- streaming and chat -------------------------------------------------------------------------
    def stream(self, prompts: Prompt | Seq[Prompt],
               sampling_params: SamplingParams | Seq[SamplingParams] | None = None) -> Iterator[RequestOutput]:
        """Generate like `generate`, yielding deltas as tokens arrive (vLLM's DELTA output kind). Each delta holds
        what is new for one request: request_id (the prompt's index), the new text / token_ids (n > 1: the moved
        sample's, `outputs[0].index`), finished / finish_reason on its last delta (all n samples ended); its text
        deltas concatenate to its `generate` text. Ending it early (close(), a `with` block, a break out of `for d
        in llm.stream(...)`; one kept in a variable waits for close()) aborts the unfinished requests and frees
        their KV blocks. Bad input raises here; `abort` calls from here on are this stream's until it ends or a
        newer one is made. Begun, it holds the LLM for the thread iterating it (it may change between deltas)."""
        reqs = self._prepare(prompts, sampling_params)
        stream = Stream(self._one_thread, lambda aborts: self._streaming(reqs, aborts))    # (one_thread.py)
        if not self._one_thread.held_elsewhere():        # (else it is refused: the running stream keeps its aborts)
            self._streams = [r for r in self._streams if (s := r()) is not None and s.open] + [weakref.ref(stream)]
        return stream

    def _streaming(self, reqs, aborts: set) -> Iterator[RequestOutput]:
        with recovering(self.engine, seqs := [], mine := Window()):                     # (see _generate)
            groups = self._add(reqs, mine)
            seqs.extend(s for g in groups for s in g)
            yield from self._stream(reqs, groups, seqs, aborts)

    def _stream(self, reqs, groups, seqs, aborts: set) -> Iterator[RequestOutput]:
        where = [(i, j) for i, g in enumerate(groups) for j in range(len(g))]
        procs, sent = {}, {}    # seq_id -> OutputProcessor; seq_id -> (output tokens yielded, their cumulative logprob)
        texts = TokenTexts(self.tokenizer)
        left = [len(g) for g in groups]           # samples going

        def delta(k: int, seq: Sequence, d: TextDelta) -> RequestOutput:
            (i, j), (start, before) = where[k], sent.get(seq.seq_id, (None, 0.0))
            left[i] -= d.finish_reason is not None
            lps, cum = logprobs_of(seq, start or 0, d.token_ids, texts, before)
            sent[seq.seq_id] = ((start or 0) + len(d.token_ids), cum or 0.0)
            stop = None if d.finish_reason is None else stop_reason(seq, procs.get(seq.seq_id), *self._eos)
            return RequestOutput(request_id=i, prompt=prompt_forms.text(reqs[i][0]), prompt_token_ids=reqs[i][1],
                                 outputs=[CompletionOutput(j, d.text, d.token_ids, cum, lps, d.finish_reason, stop)],
                                 prompt_logprobs=prompt_logprobs_of(seq, texts) if start is None else None,
                                 num_cached_tokens=groups[i][0].num_cached_tokens, finished=left[i] == 0)

        ended, aborted = set(), []                # seq ids whose final delta was yielded (an abort's comes early)

        def take_aborts():                        # LLM.abort: end those prompts' samples now (before a step too:
            while aborts:                         # a prompt still being prefilled yields nothing meanwhile)
                i = aborts.pop()
                for k2, s in enumerate(seqs):
                    if where[k2][0] == i and not is_finished(s):
                        self.engine.abort(s)
                        ended.add(s.seq_id)
                        aborted.append(k2)

        def abort_deltas():
            take_aborts()
            while aborted:
                k2 = aborted.pop(0)
                yield delta(k2, seqs[k2], TextDelta("", [], "abort"))

        for k, seq in self._one_thread.run(self.engine, seqs, take_aborts):
            if seq.seq_id not in ended:           # (aborted after this step's updates were listed: nothing more)
                d = self._process_text(seq, procs, stream=True)
                if d.text or d.token_ids or d.finish_reason:
                    yield delta(k, seq, d)
            yield from abort_deltas()
        yield from abort_deltas()                 # requests that an abort ended before a step (no update came)

    def apply_chat_template(self, messages: list[dict], chat_template_kwargs: dict | None = None) -> str:
        """Render one conversation ([{"role": ..., "content": ...}, ...]) into a prompt string, ending with
        the assistant's turn. `chat_template_kwargs` reach the template (Qwen3: enable_thinking=False)."""
        return prompt_forms.render_chat(self.tokenizer, messages, chat_template_kwargs)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None, use_tqdm: bool | dict = True,
             lora_request=None, chat_template: str | None = None, chat_template_content_format: str = "auto",
             add_generation_prompt: bool = True, continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, mm_processor_kwargs=None,
             tokenization_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation or to a list of conversations (one output each). A
        message's content is a string or a list of text parts; `tools` (OpenAI's function schemas) reach the chat
        template (no tool-call parsing). vLLM's signature; a dict as the third argument is chat_template_kwargs.

            llm.chat([{"role": "user", "content": "Hi"}], chat_template_kwargs={"enable_thinking": False})
        """
        if isinstance(use_tqdm, dict):
            use_tqdm, chat_template_kwargs = True, {**use_tqdm, **(chat_template_kwargs or {})}
        prompt_forms.check_unsupported("LLM.chat", lora_request=lora_request, mm_processor_kwargs=mm_processor_kwargs)
        prompts = prompt_forms.chat_prompts(self.tokenizer, messages, chat_template_kwargs, tools=tools,
                                            chat_template_content_format=chat_template_content_format,
                                            chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                                            continue_final_message=continue_final_message)
        return self.generate(prompts, sampling_params, use_tqdm, tokenization_kwargs={"add_special_tokens": False, **(
            tokenization_kwargs or {})} if isinstance(tokenization_kwargs, (dict, type(None))) else tokenization_kwargs)
