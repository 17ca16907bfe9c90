"""The user-facing facade: `LLM(model, ...)`, `generate`, `stats`. The only place that sees strings.

    from jaxinfer import LLM, SamplingParams
    llm = LLM("path/to/Qwen3-0.6B", max_model_len=4096, attn_backend="pallas")
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0.6, max_tokens=128))
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Sequence as Seq

import jax.numpy as jnp
from tqdm.auto import tqdm

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.detokenizer import TextStream
from jaxinfer.engine.llm_engine import LLMEngine, is_finished
from jaxinfer.engine.sequence import Sequence
from jaxinfer.hub import resolve_model
from jaxinfer.model.loader import load_params
from jaxinfer.model.presets import is_preset, preset
from jaxinfer.model.qwen3 import init_params
from jaxinfer.outputs import RequestOutput
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.tokenizer import load_tokenizer

Prompt = str | list[int]


def load_model(model: str, dtype: str, seed: int = 0):
    """(ModelConfig, params, tokenizer) from a checkpoint directory, an embedded preset (random weights) or a
    Hugging Face hub id (see jaxinfer.hub)."""
    model = resolve_model(model)
    if os.path.isdir(model):
        config = ModelConfig.from_pretrained(model)
        return config, load_params(model, config, jnp.dtype(dtype)), load_tokenizer(model)
    if is_preset(model):
        import jax
        config = preset(model)
        params = jax.jit(lambda: init_params(config, jnp.dtype(dtype), seed))()
        return config, params, load_tokenizer(None)
    raise FileNotFoundError(f"model {model!r} is neither a checkpoint directory nor an embedded preset")


class LLM:
    def __init__(self, model: str, *, dtype: str = "bfloat16", max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 16384, max_model_len: int = 4096, kvcache_block_size: int = 16,
                 num_kvcache_blocks: int | None = None, gpu_memory_utilization: float = 0.9,
                 attn_backend: str = "xla", enable_prefix_caching: bool = True,
                 decode_buckets: tuple[int, ...] | None = None, prefill_buckets: tuple[int, ...] | None = None,
                 seed: int = 0, warmup: bool = True, async_scheduling: bool = True,
                 unstack_weights: bool | None = None):
        self.config = EngineConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, kvcache_block_size=kvcache_block_size,
            num_kvcache_blocks=num_kvcache_blocks, gpu_memory_utilization=gpu_memory_utilization, dtype=dtype,
            attn_backend=attn_backend, enable_prefix_caching=enable_prefix_caching,
            decode_buckets=decode_buckets, prefill_buckets=prefill_buckets, seed=seed,
            unstack_weights=unstack_weights)
        self.model_config, params, self.tokenizer = load_model(model, self.config.dtype, seed)
        if max_model_len > self.model_config.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                             f"{self.model_config.max_position_embeddings}")
        eos = self.model_config.eos_token_id or tuple(
            t for t in [getattr(self.tokenizer, "eos_token_id", None)] if t is not None)
        self.engine = LLMEngine(self.model_config, self.config, params, eos, async_scheduling)
        if warmup:
            buckets = self.engine.runner.buckets()
            with tqdm(total=len(buckets), desc="Compiling steps", disable=None) as bar:
                self.engine.warmup(bar)

    # -- requests ---------------------------------------------------------------------------------
    def _tokenize(self, prompt: Prompt, i: int) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        if isinstance(prompt, (list, tuple)):
            return list(prompt)
        raise ValueError(f"prompt {i} must be a string or a list of token ids, got {type(prompt).__name__}")

    def _prepare(self, prompts, sampling_params) -> list[tuple[Prompt, list[int], SamplingParams]]:
        """Normalise and validate every request before any is queued (a bad one disturbs no other)."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        sampling_params = list(sampling_params)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts")
        reqs = []
        for i, (p, sp) in enumerate(zip(prompts, sampling_params)):
            ids = self._tokenize(p, i)
            self.engine.check_request(ids, sp, where=f"prompt {i}")
            reqs.append((p, ids, sp))
        return reqs

    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order."""
        reqs = self._prepare(prompts, sampling_params)
        seqs = [self.engine.add_request(ids, sp) for _, ids, sp in reqs]
        with tqdm(total=len(seqs), desc="Generating", disable=not use_tqdm or None) as bar:
            for _, seq in self._run(seqs):
                self._check_stop_strings(seq)
                bar.update(is_finished(seq))
        return [self._output(i, p, s) for i, ((p, _, _), s) in enumerate(zip(reqs, seqs))]

    def _run(self, seqs: list[Sequence]) -> Iterator[tuple[int, Sequence]]:
        """Step the engine until every seq finishes, yielding (index in seqs, seq) for each new token.
        However it ends (done, error, or the caller leaving early), nothing is left holding KV blocks."""
        index = {s.seq_id: i for i, s in enumerate(seqs)}
        try:
            while not all(is_finished(s) for s in seqs):
                for seq in self.engine.step():
                    if seq.seq_id in index:
                        yield index[seq.seq_id], seq
        finally:
            for seq in seqs:
                if not is_finished(seq):
                    self.engine.abort(seq)

    # -- text ---------------------------------------------------------------------------------------
    def _check_stop_strings(self, seq: Sequence) -> None:
        if seq.params.stop:
            self._update_text(seq)

    def _update_text(self, seq: Sequence) -> TextStream:
        """Detokenize seq's new tokens incrementally (seq.text); finish it when a stop string matches."""
        ts = getattr(seq, "text_stream", None)
        if ts is None:
            ts = seq.text_stream = TextStream(self.tokenizer, seq.params.stop)
        if ts.update(seq.output_token_ids, finished=is_finished(seq)):
            if is_finished(seq):          # finished by length/EOS in the step that completed the stop string
                seq.finish_reason = "stop"
            self.engine.scheduler.finish(seq, "stop")
        seq.text = ts.text
        return ts

    def _text_delta(self, seq: Sequence) -> tuple[str, list[int]]:
        """(new text, new token ids) of seq since the previous call; call after every step that updated seq."""
        return self._update_text(seq).pop_delta(seq.output_token_ids)

    def _output(self, i: int, prompt: Prompt, seq: Sequence) -> RequestOutput:
        text = seq.text if seq.params.stop else self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        m = {}
        if seq.first_token_time is not None:
            m["ttft_s"] = seq.first_token_time - seq.arrival_time
            if seq.num_output_tokens > 1:
                m["tpot_s"] = (seq.token_times[-1] - seq.first_token_time) / (seq.num_output_tokens - 1)
        return RequestOutput(request_id=seq.seq_id, prompt=prompt if isinstance(prompt, str) else None,
                             prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens],
                             token_ids=seq.output_token_ids, text=text, finish_reason=seq.finish_reason,
                             num_cached_tokens=seq.num_cached_tokens, metrics=m)

    def reset_prefix_cache(self) -> int:
        """Forget the cached KV of prompts no request holds (as vLLM's `reset_prefix_cache`): the next
        identical prompt is computed again, e.g. to time a workload twice. Returns the blocks forgotten."""
        return self.engine.block_manager.reset_prefix_cache()

    def stats(self) -> dict:
        return self.engine.stats()

    # -- streaming and chat -------------------------------------------------------------------------
    def stream(self, prompts: Prompt | Seq[Prompt],
               sampling_params: SamplingParams | Seq[SamplingParams] | None = None) -> Iterator[RequestOutput]:
        """Generate like `generate`, yielding deltas as tokens arrive (vLLM's DELTA output kind).

        Each yielded RequestOutput holds only what is new for one request: `request_id` is the prompt's
        index in `prompts`, `text` / `token_ids` are the new text and token ids, and `finish_reason` is set
        on the request's last delta. A request's text deltas concatenate to its `generate` text.
        Leaving the loop early (break / close) aborts the unfinished requests and frees their KV blocks.
        """
        reqs = self._prepare(prompts, sampling_params)
        seqs = [self.engine.add_request(ids, sp) for _, ids, sp in reqs]
        for i, seq in self._run(seqs):
            text, ids = self._text_delta(seq)
            if text or ids or is_finished(seq):
                prompt = reqs[i][0]
                yield RequestOutput(request_id=i, prompt=prompt if isinstance(prompt, str) else None,
                                    prompt_token_ids=reqs[i][1], token_ids=ids, text=text,
                                    finish_reason=seq.finish_reason, num_cached_tokens=seq.num_cached_tokens)

    def apply_chat_template(self, messages: list[dict], chat_template_kwargs: dict | None = None) -> str:
        """Render one conversation ([{"role": ..., "content": ...}, ...]) into a prompt string, ending with
        the assistant's turn. `chat_template_kwargs` reach the template (Qwen3: enable_thinking=False)."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError(f"a conversation must be a non-empty list of messages, got {messages!r:.80}")
        for j, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ValueError(f"message {j} must be a dict with string 'role' and 'content', got {m!r:.80}")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs must be a dict, got {chat_template_kwargs!r}")
        if getattr(self.tokenizer, "chat_template", None) is None and hasattr(self.tokenizer, "vocab_size"):
            raise ValueError("this model's tokenizer has no chat template (tokenizer_config.json "
                             "'chat_template'); use generate() with a plain prompt")
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True,
                                                  **(chat_template_kwargs or {}))

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             chat_template_kwargs: dict | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation or to a list of conversations (one output each).

            llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=64),
                     chat_template_kwargs={"enable_thinking": False})
        """
        convs = [messages] if messages and isinstance(messages, (list, tuple)) and isinstance(messages[0], dict) \
            else messages
        if not isinstance(convs, (list, tuple)) or not convs:
            raise ValueError(f"messages must be a conversation (list of dicts) or a list of them, got {messages!r:.80}")
        prompts = [self.apply_chat_template(c, chat_template_kwargs) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)
