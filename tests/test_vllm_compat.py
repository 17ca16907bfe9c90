"""vLLM's offline API details that ported scripts rely on: numpy numbers and list fields in SamplingParams, the
prompt TypedDicts, a bad entry in a list of params, LLM options that only describe jaxinfer, detokenize=False."""
import dataclasses
import os

import numpy as np
import pytest
from helpers import TINY_ENGINE

from jaxinfer import LLM, CompletionOutput, SamplingParams, TextPrompt, TokensPrompt
from jaxinfer.compat import pop_vllm_options


def test_sampling_params_take_numpy_numbers_and_keep_lists():
    sp = SamplingParams(seed=np.int64(3), max_tokens=np.int32(5), temperature=np.float32(0.5), top_k=np.int64(4),
                        top_p=np.float64(0.9), stop="x", stop_token_ids=[np.int64(7)])
    assert (sp.seed, sp.max_tokens, sp.top_k) == (3, 5, 4) and type(sp.seed) is int and type(sp.temperature) is float
    assert sp.stop == ["x"] and sp.stop_token_ids == [7] and type(sp.stop_token_ids[0]) is int
    assert SamplingParams().stop == [] and SamplingParams().stop_token_ids == []
    sp.seed = np.int16(9)
    assert type(sp.seed) is int and sp.seed == 9
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=np.float32(1.5))


def test_sampling_params_as_vllms_greedy_n_bool_logprobs_and_any_id_iterable():
    """As vLLM's SamplingParams: n > 1 with greedy sampling is refused (also when set later), and greedy resets
    top_k / top_p / min_p; a bool logprobs is the int it is (True: 1); stop_token_ids may be any iterable of ids
    (vLLM takes list(...) of it)."""
    with pytest.raises(ValueError, match="n=2 must be 1 when using greedy sampling"):
        SamplingParams(n=2, temperature=0)
    sp = SamplingParams(n=3)
    sp.temperature = 0.0           # valid alone: taken, the whole checked when used (fields edited one at a time)
    with pytest.raises(ValueError, match="greedy sampling"):
        sp.clone()
    sp.n = 1
    assert sp.clone() == SamplingParams(temperature=0.0) and SamplingParams(n=3, temperature=1e-3).temperature == 0.01
    assert (SamplingParams(logprobs=True).logprobs, SamplingParams(prompt_logprobs=False).prompt_logprobs) == (1, 0)
    g = SamplingParams(temperature=0, top_k=20, top_p=0.5, min_p=0.1)      # greedy: vLLM resets the filters
    assert (g.top_k, g.top_p, g.min_p) == (0, 1.0, 0.0) and g == SamplingParams(temperature=0)
    assert SamplingParams(stop_token_ids={7}).stop_token_ids == [7] == SamplingParams(stop_token_ids=(7,)).stop_token_ids
    assert SamplingParams(stop_token_ids=iter([7, 8])).stop_token_ids == [7, 8]
    assert SamplingParams(stop_token_ids=np.array([7, 8])).stop_token_ids == [7, 8]
    assert SamplingParams(stop_token_ids=np.array([], dtype=int)).stop_token_ids == []
    for bad in ("7", 7, {7: 1}, np.array(7)):
        with pytest.raises(ValueError, match="stop_token_ids"):
            SamplingParams(stop_token_ids=bad)


def test_text_prompts_get_the_tokenizers_special_tokens_chat_prompts_do_not(tiny_dir, tmp_path):
    """As vLLM: generate() encodes a text prompt with the tokenizer's special tokens (a BOS its post-processor adds;
    add_special_tokens=False in tokenization_kwargs turns that off), LLM.chat's rendered prompt without them (the
    template has its own: no second BOS)."""
    from tokenizers import processors
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    bos = tok.convert_tokens_to_ids("<|endoftext|>")
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                                  special_tokens=[("<|endoftext|>", bos)])
    tok.save_pretrained(tmp_path)
    llm = LLM(tiny_dir, tokenizer=str(tmp_path), **TINY_ENGINE)
    plain = tok.encode("hi there", add_special_tokens=False)
    sp = SamplingParams(temperature=0, max_tokens=1)
    assert llm.generate("hi there", sp, use_tqdm=False)[0].prompt_token_ids == [bos, *plain]
    assert llm.generate("hi there", sp, use_tqdm=False, tokenization_kwargs={"add_special_tokens": False}
                        )[0].prompt_token_ids == plain
    out = llm.chat([{"role": "user", "content": "hi"}], sp, use_tqdm=False)[0]
    assert out.prompt_token_ids == tok.encode(out.prompt, add_special_tokens=False) and out.prompt_token_ids[0] != bos
    out = llm.chat([{"role": "user", "content": "hi"}], sp, use_tqdm=False,       # (vLLM's chat takes them too)
                   tokenization_kwargs={"add_special_tokens": True})[0]
    assert out.prompt_token_ids == tok.encode(out.prompt) and out.prompt_token_ids[0] == bos
    # `jaxinfer generate --chat` too (it renders with the template, then generates: no second BOS)
    import jaxinfer.cli as cli
    seen, plain_generate = [], llm.generate
    cli.build_llm, build = (lambda a: llm), cli.build_llm
    llm.generate = lambda *a, **k: seen.extend(plain_generate(*a, **k)) or seen
    try:
        assert cli.main(["generate", tiny_dir, "--chat", "-p", "hi", "--max-tokens", "1"]) == 0
    finally:
        cli.build_llm, llm.generate = build, plain_generate
    assert seen[0].prompt_token_ids == tok.encode(seen[0].prompt, add_special_tokens=False)
    # chat_template_kwargs cannot undo LLM.chat's own add_generation_prompt (current vLLM merges the arguments last)
    a, b = (llm.chat([{"role": "user", "content": "hi"}], sp, use_tqdm=False, chat_template_kwargs=kw)[0].prompt
            for kw in (None, {"add_generation_prompt": False}))
    assert a == b and a.endswith("<|im_start|>assistant\n")
    assert llm.chat([{"role": "user", "content": "hi"}], sp, use_tqdm=False, chat_template_kwargs={
        "chat_template": None})[0].prompt == a                                  # (None: not given)
    with pytest.raises(ValueError, match="tokenization_kwargs must be a dict"):
        llm.chat([{"role": "user", "content": "hi"}], sp, use_tqdm=False, tokenization_kwargs=["bad"])


def test_preset_with_engine_seed_none_and_a_prompt_past_a_tiny_pool(tiny_dir):
    tiny = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                head_dim=16, vocab_size=300)
    llm = LLM("qwen3-0.6b", hf_overrides=tiny, seed=None, **{**TINY_ENGINE, "dtype": "float32"})
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    assert llm.llm_engine.has_unfinished_requests() is False            # vLLM's name too
    # max_tokens=None on a prompt the pool cannot hold: the pool's message, not a made-up max_tokens
    small = LLM(tiny_dir, **{**TINY_ENGINE, "num_kvcache_blocks": 1})
    with pytest.raises(ValueError, match="num_kvcache_blocks"):
        small.generate([list(range(1, 11))], SamplingParams(max_tokens=None), use_tqdm=False)


def test_engine_step_with_nothing_to_do_returns_nothing(tiny_dir):
    """vLLM's `LLMEngine.step()` returns [] when no request is left; a loop that steps a few more times after the
    last request finished (or before the first) must not fail."""
    llm = LLM(tiny_dir, **TINY_ENGINE)
    eng = llm.llm_engine
    assert eng.step() == [] and not eng.has_unfinished_requests()
    eng.add_request("r", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    last = None
    while eng.has_unfinished_requests():
        last = eng.step() or last
    assert len(last[0].outputs[0].token_ids) == 3 and last[0].finished
    assert eng.step() == [] and eng.step() == []
    assert eng.stats()["kv_blocks_free"] == eng.stats()["kv_blocks_total"]
    assert llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids == last[0].outputs[0].token_ids


def test_engine_options_take_numpy_integers(tiny_dir):
    llm = LLM(tiny_dir, **{**TINY_ENGINE, "max_num_seqs": np.int64(4), "tensor_parallel_size": np.int32(1),
                           "data_parallel_size": np.int64(1), "seed": np.uint8(3)})
    assert (llm.config.max_num_seqs, llm.config.seed) == (4, 3) and type(llm.config.max_num_seqs) is int
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        LLM(tiny_dir, **{**TINY_ENGINE, "tensor_parallel_size": np.int64(0)})


def test_sampling_params_take_vllms_unused_fields_unset():
    sp = SamplingParams(n=2, best_of=2, spaces_between_special_tokens=False, bad_words=[], logit_bias=None,
                        structured_outputs=None, guided_decoding=None, extra_args={}, output_kind=2)
    assert sp.for_sample(1).best_of is None and sp.spaces_between_special_tokens is False and sp.output_kind == 2
    assert SamplingParams(allowed_token_ids=[1], logit_bias={1: 1.0}).has_bias       # (test_logit_bias.py)
    from jaxinfer import RequestOutputKind
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE                # (vLLM's default)
    assert SamplingParams(extra_args={"a": 1}).extra_args == {"a": 1}   # (vLLM's: for plugins, read by nothing here)
    assert SamplingParams.from_optional(max_tokens=None, n=None).max_tokens is None     # (vLLM's: no limit)
    for kw in (dict(best_of=3), dict(bad_words="x"), dict(logits_processors=[print]), dict(spaces_between_special_tokens=1),
               dict(structured_outputs={"grammar": "g"}), dict(guided_decoding={"json": 5}),
               dict(extra_args="a")):
        with pytest.raises(ValueError, match=next(iter(kw))):
            SamplingParams(**kw)


def test_vllm_options_that_describe_jaxinfer():
    kw = dict(enable_chunked_prefill=True, quantization=None, max_seq_len_to_capture=8192,
              task="generate", pipeline_parallel_size=1, max_num_seqs=4, runner="generate", convert="none",
              compilation_config={"level": 3}, disable_custom_all_reduce=True, cpu_offload_gb=0,
              tokenizer_revision=None, logprobs_mode="raw_logprobs", enable_lora=False, max_lora_rank=16,
              distributed_executor_backend="mp", scheduling_policy="fcfs", served_model_name="my-model")
    pop_vllm_options(kw)                                  # (runner / convert: vLLM's names for task since 2025)
    assert kw == {"max_num_seqs": 4}
    pop_vllm_options(dict(compilation_config=None, cpu_offload_gb=0.0))
    for bad, word in [(dict(enable_chunked_prefill=False), "enable_chunked_prefill=True"),
                      (dict(cpu_offload_gb=4), "cpu_offload_gb=0"), (dict(tokenizer_revision="v2"), "no tokenizer_rev"),
                      (dict(logprobs_mode="processed_logprobs"), "raw_logprobs"), (dict(enable_lora=True), "enable_lora"),
                      (dict(compilation_config="O3"), "int or dict"),
                      (dict(runner="pooling"), "runner='auto' or 'generate'"), (dict(convert="embed"), "convert"),
                      (dict(quantization="awq"), "no quantization"),
                      (dict(pipeline_parallel_size=2), "pipeline_parallel_size=1"),
                      (dict(distributed_executor_backend="ray"), "'mp' or 'uni' or 'external_launcher'"),
                      (dict(scheduling_policy="priority"), "scheduling_policy='fcfs'"),
                      (dict(served_model_name=3), "served_model_name=3 must be a str or list")]:
        with pytest.raises(ValueError, match=word):
            pop_vllm_options(bad)
    at_defaults = dict(enable_sleep_mode=False, speculative_config=None, kv_transfer_config=None, model_impl="auto",
                       limit_mm_per_prompt=None, disable_cascade_attn=False, kv_cache_memory_bytes=None,
                       logits_processors=None, max_num_partial_prefills=1, guided_decoding_backend="xgrammar",
                       num_lookahead_slots=0, disable_sliding_window=False)     # (vLLM features jaxinfer lacks, off)
    pop_vllm_options(at_defaults)
    assert at_defaults == {}
    for bad, word in [(dict(enable_sleep_mode=True), "enable_sleep_mode=False"),
                      (dict(speculative_config={"method": "ngram"}), "no speculative_config"),
                      (dict(model_impl="transformers"), "model_impl='auto'")]:
        with pytest.raises(ValueError, match=word):
            pop_vllm_options(bad)


def test_prompt_dicts_bad_params_entry_and_detokenize_false(tiny_dir):
    llm = LLM(tiny_dir, **TINY_ENGINE)
    sp = SamplingParams(temperature=0, max_tokens=3, logprobs=1, prompt_logprobs=1)
    a, b = llm.generate([TextPrompt(prompt="Hello"), TokensPrompt(prompt_token_ids=[5, 6, 7])], sp, use_tqdm=False)
    assert a.prompt == "Hello" and b.prompt_token_ids == [5, 6, 7] and isinstance(a.outputs[0], CompletionOutput)
    with pytest.raises(ValueError, match=r"sampling_params\[1\] must be a SamplingParams"):
        llm.generate(["a", "b"], [sp, None], use_tqdm=False)
    raw = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, logprobs=1, prompt_logprobs=1,
                                                   detokenize=False), use_tqdm=False)[0]
    assert raw.outputs[0].text == "" and raw.outputs[0].token_ids == b.outputs[0].token_ids
    entries = [lp for d in raw.outputs[0].logprobs for lp in d.values()] + \
        [lp for d in raw.prompt_logprobs[1:] for lp in d.values()]
    assert entries and all(lp.decoded_token is None for lp in entries)          # as vLLM: nothing decoded
    assert all(lp.decoded_token is not None for d in b.outputs[0].logprobs for lp in d.values())
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]
    for name in ("encode", "embed", "classify", "score", "reward"):       # vLLM's pooling methods: a clear refusal
        with pytest.raises(ValueError, match=rf"LLM.{name}\(\) needs a pooling model"):
            getattr(llm, name)(["Hello"])
    for name in ("sleep", "wake_up", "collective_rpc", "apply_model", "set_tokenizer", "get_metrics"):
        with pytest.raises(NotImplementedError, match=rf"LLM.{name}\(\) is not supported"):     # (not AttributeError)
            getattr(llm, name)()
    # vLLM's generate arguments: lora_request=None and priority 0 run; anything else is refused by name
    same = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False, lora_request=None,
                        priority=[0])[0]
    assert same.outputs[0].token_ids == b.outputs[0].token_ids
    for kw, name in ((dict(lora_request=object()), "lora_request"), (dict(priority=[1]), "priority"),
                     (dict(priority=[0, 0]), "one entry per prompt"), (dict(priority=0), "priority")):
        with pytest.raises(ValueError, match=name):
            llm.generate(["a"], sp, use_tqdm=False, **kw)
    # a text model's prompt dicts may carry vLLM's multimodal keys empty; given data, they are refused by name
    empty = dict(multi_modal_data=None, mm_processor_kwargs={})
    c, d = llm.generate([{"prompt": "Hello", **empty}, {"prompt_token_ids": [5, 6, 7], **empty}], sp, use_tqdm=False)
    assert (c.outputs[0].token_ids, d.outputs[0].token_ids) == (a.outputs[0].token_ids, b.outputs[0].token_ids)
    with pytest.raises(ValueError, match=r"prompt 0: \['multi_modal_data'\] given"):
        llm.generate([{"prompt": "Hello", "multi_modal_data": {"image": 1}}], sp, use_tqdm=False)
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_cache_salt_isolates_the_prefix_cache(tiny_dir):
    """vLLM's "cache_salt" prompt key: requests share cached prompt blocks only with the same salt (or none); the
    tokens do not depend on it; a salt that is not a non-empty string is refused by name."""
    llm = LLM(tiny_dir, **TINY_ENGINE)
    ids, sp = list(range(1, 30)), SamplingParams(temperature=0, max_tokens=4)     # 7 full blocks of 4 tokens
    hits = lambda: llm.stats()["prefix_cache_hit_tokens"]                            # noqa: E731
    outs = []
    for salt, hit in (("a", False), ("a", True), ("b", False), (None, False), (None, True), ("b", True)):
        before = hits()
        prompt = {"prompt_token_ids": ids} if salt is None else {"prompt_token_ids": ids, "cache_salt": salt}
        outs.append(llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids)
        assert (hits() > before) == hit, (salt, hit)
    assert all(o == outs[0] for o in outs)
    for bad in ("", 5):
        with pytest.raises(ValueError, match="cache_salt"):
            llm.generate([{"prompt": "Hello", "cache_salt": bad}], sp, use_tqdm=False)
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_bad_values_are_value_errors_naming_them(tiny_dir):
    """Values the type checks let through before: a stop list edited in place after construction (the request
    checks its params again), a non-bool ignore_eos, a best_of that only equals n, vLLM's unused fields given
    something other than None or empty, a numpy scalar as the prompt; engine options block_size=None and a
    scalar bucket list."""
    llm = LLM(tiny_dir, **TINY_ENGINE)
    sp = SamplingParams(stop=["zz"], max_tokens=2)
    sp.stop.append(5)
    ids = SamplingParams(min_tokens=1, stop_token_ids=[1], max_tokens=2)
    ids.stop_token_ids.append("x")
    for bad, name in ((sp, "stop"), (ids, "stop_token_ids")):
        with pytest.raises(ValueError, match=name):
            llm.generate([[5, 6, 7]], bad, use_tqdm=False)
    for kw in (dict(ignore_eos="False"), dict(best_of=1.0), dict(n=2, best_of=2.0), dict(bad_words=0),
               dict(logit_bias="x")):
        with pytest.raises(ValueError, match=next(iter(kw.keys() - {"n"}))):
            SamplingParams(**kw)
    assert SamplingParams(bad_words=[], logit_bias={}, best_of=1).best_of == 1
    with pytest.raises(ValueError, match="allowed_token_ids=.*empty"):       # (vLLM refuses it too)
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="prompts must be"):
        llm.generate(np.int64(5), use_tqdm=False)
    from jaxinfer.config import EngineConfig
    for kw, name in ((dict(block_size=None), "block_size"), (dict(decode_buckets=2.0), "decode_buckets"),
                     (dict(prefill_buckets=np.array(8)), "prefill_buckets"),
                     (dict(decode_buckets=[True, 8]), "decode_buckets")):      # (a bool is no bucket size)
        with pytest.raises(ValueError, match=name):
            EngineConfig(**kw)
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"] and st["running"] == st["waiting"] == 0


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


def test_hf_overrides_replace_config_fields(tiny_dir, tmp_path):
    """vLLM's hf_overrides: a YaRN rope_scaling given that way runs as if config.json said it (same tokens as
    an edited copy of the checkpoint), and it changes the model's longest context."""
    import json
    import shutil
    edited = str(tmp_path / "yarn")
    shutil.copytree(tiny_dir, edited)
    with open(f"{edited}/config.json") as f:
        config = json.load(f)
    with open(f"{edited}/config.json", "w") as f:
        json.dump({**config, "rope_scaling": YARN}, f)
    engine = {**TINY_ENGINE, "max_model_len": None, "num_kvcache_blocks": 128}      # 128 x 4-token blocks
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [list(range(3, 60)), [7, 8, 9]]
    llm = LLM(tiny_dir, hf_overrides={"rope_scaling": YARN}, **engine)
    assert llm.model_config.rope_yarn[:1] == (32,) and llm.model_config.max_length == 128
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in LLM(edited, **engine).generate(prompts, sp, use_tqdm=False)]
    assert ours == want


def test_hf_overrides_on_presets_and_bad_values(tiny_dir, tmp_path):
    from jaxinfer.hub import model_config_for
    from jaxinfer.model.presets import preset
    _, c = model_config_for("qwen3-0.6b", {"num_hidden_layers": 2, "rope_scaling": {**YARN, "factor": 2.0}})
    want = preset("qwen3-0.6b")
    assert c.num_hidden_layers == 2 and c.rope_scaling_factor == 2.0 and c.rope_yarn[0] == 32
    assert (c.vocab_size, c.head_dim, c.eos_token_id, c.rope_theta) == (want.vocab_size, want.head_dim,
                                                                       want.eos_token_id, want.rope_theta)
    assert model_config_for("qwen3-0.6b", {})[1] == want
    with pytest.raises(ValueError, match="hf_overrides='x'"):
        LLM(tiny_dir, hf_overrides="x", **TINY_ENGINE)

    def fewer_layers(config):              # vLLM's other form: a function of the transformers config
        config.num_hidden_layers = 1
        return config
    assert model_config_for("qwen3-0.6b", fewer_layers)[1] == dataclasses.replace(want, num_hidden_layers=1)
    assert model_config_for(tiny_dir, fewer_layers)[1] == model_config_for(tiny_dir, {"num_hidden_layers": 1})[1]
    assert model_config_for(tiny_dir, lambda c: c)[1] == model_config_for(tiny_dir)[1]
    with pytest.raises(ValueError, match="must return the config"):
        LLM(tiny_dir, hf_overrides=lambda c: None, **TINY_ENGINE)
    with pytest.raises(ValueError, match="llama"):
        LLM(tiny_dir, hf_overrides={"model_type": "llama"}, **TINY_ENGINE)
    # generation_config.json's EOS ids still end generation when eos_token_id is overridden
    import json
    import shutil
    ckpt = shutil.copytree(tiny_dir, str(tmp_path / "with_generation_config"))
    with open(os.path.join(ckpt, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, 0]}, f)
    assert set(model_config_for(ckpt, {"eos_token_id": 7})[1].eos_token_id) == {7, 2, 0}


def test_hf_overrides_rope_theta_beats_rope_parameters(tmp_path):
    """transformers 5 keeps rope_theta inside rope_parameters (the presets' config.json too): an overridden
    rope_theta must replace it there, not be shadowed by it. Bad values name the field."""
    import json
    from jaxinfer.hub import model_config_for
    assert model_config_for("qwen3-0.6b", {"rope_theta": 5e5})[1].rope_theta == 5e5
    ckpt = tmp_path / "v5"
    ckpt.mkdir()
    from jaxinfer.model.loader import hf_config
    from jaxinfer.model.presets import preset
    cfg = hf_config(preset("qwen3-0.6b"))
    assert cfg["rope_parameters"]["rope_theta"] == 1e6
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert model_config_for(str(ckpt), {"rope_theta": 2e4})[1].rope_theta == 2e4
    assert model_config_for(str(ckpt))[1].rope_theta == 1e6
    for bad, match in (({"rope_theta": "abc"}, "rope_theta='abc'"), ({"hidden_size": None}, "'hidden_size'"),
                       ({"rms_norm_eps": [1]}, r"rms_norm_eps=\[1\]"), ({"rms_norm_eps": "abc"}, "rms_norm_eps='abc'"),
                       ({"eos_token_id": {"a": 1}}, "eos_token_id="), ({"tie_word_embeddings": "false"}, "tie_word"),
                       ({"rope_scaling": {"rope_type": "linear", "factor": None}}, "factor=None"),
                       ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": "x"}}, "beta_fast='x'"),
                       ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "truncate": "no"}}, "truncate='no'")):
        with pytest.raises(ValueError, match=match):                  # (not a TypeError from float() / int())
            model_config_for("qwen3-0.6b", bad)
    (ckpt / "config.json").write_text("[1]")                                      # JSON, but not an object
    with pytest.raises(ValueError, match="config.json' must hold a JSON object"):
        model_config_for(str(ckpt))
    (ckpt / "config.json").write_text(json.dumps(cfg))
    # a broken generation_config.json only loses its EOS ids here: LLM's sampling defaults name it (unless
    # generation_config="vllm", which does not read it: tests/test_engine.py)
    (ckpt / "generation_config.json").write_text("[1]")
    assert model_config_for(str(ckpt))[1].eos_token_id == model_config_for("qwen3-0.6b")[1].eos_token_id


def test_hf_overrides_flag(tiny_dir, capsys):
    from jaxinfer import cli
    a = cli.build_parser().parse_args(["generate", tiny_dir, "--hf-overrides", '{"rope_scaling": {"factor": 2}}',
                                       "--max-num-seqs", "4"])
    assert cli.engine_kwargs(a) == {"max_num_seqs": 4, "hf_overrides": {"rope_scaling": {"factor": 2}}}
    assert "hf_overrides" not in cli.engine_kwargs(cli.build_parser().parse_args(["generate", tiny_dir]))
    for bad in ("{1:", "[1]"):
        with pytest.raises(SystemExit) as e:
            cli.build_parser().parse_args(["serve", tiny_dir, "--hf-overrides", bad])
        assert e.value.code == 2
    assert "--hf-overrides" in capsys.readouterr().err


def test_skip_tokenizer_init(tiny_dir, tmp_path):
    """vLLM's skip_tokenizer_init=True runs a checkpoint with no tokenizer files on token-id prompts: transformers'
    greedy tokens, empty text, logprobs without decoded tokens; what needs text is a ValueError saying so; without
    the option such a folder runs the same way, with a warning."""
    import shutil

    from helpers import hf_greedy, hf_model
    bare = tmp_path / "no_tokenizer"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(tiny_dir, name), bare / name)
    with pytest.warns(UserWarning, match="skip_tokenizer_init=True"):     # (without it: the same, and a warning)
        quiet = LLM(str(bare), **TINY_ENGINE)
    assert quiet.generate([[5, 7]], use_tqdm=False)[0].outputs[0].text == ""
    with pytest.raises(ValueError, match="no tokenizer files in .*no_tokenizer.*tokenizer=FOLDER"):   # (the cause)
        quiet.generate(["Hello"])
    llm = LLM(str(bare), skip_tokenizer_init=True, **TINY_ENGINE)
    model, eos = hf_model(str(bare)), llm.model_config.eos_token_id[0]
    outs = llm.generate([[5, 7, 9, 11], TokensPrompt(prompt_token_ids=[100, 200])],
                        SamplingParams(temperature=0, max_tokens=6, logprobs=1), use_tqdm=False)
    for o in outs:
        assert o.outputs[0].token_ids == hf_greedy(model, o.prompt_token_ids, 6, eos)
        assert o.outputs[0].text == "" and all(e.decoded_token is None for d in o.outputs[0].logprobs for e in d.values())
    for call, word in [(lambda: llm.generate(["Hello"]), "a text prompt needs a tokenizer"),
                       (lambda: llm.get_tokenizer(), "skip_tokenizer_init is True"),
                       (lambda: llm.generate([[5]], SamplingParams(stop=["x"])), "stop"),
                       (lambda: llm.generate([[5]], SamplingParams(bad_words=["x"])), "bad_words"),
                       (lambda: llm.chat([{"role": "user", "content": "Hi"}]), "chat needs a tokenizer")]:
        with pytest.raises(ValueError, match=word):
            call()
    assert llm.llm_engine.tokenizer is None                 # (vLLM's LLMEngine.tokenizer; its get_tokenizer raises)
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"] and st["running"] == st["waiting"] == 0


def test_start_and_stop_profile(tiny_dir, tmp_path, monkeypatch):
    """vLLM's LLM.start_profile / stop_profile: JAX's trace of what ran in between, in $JAXINFER_PROFILER_DIR (or
    vLLM's $VLLM_TORCH_PROFILER_DIR); without either a RuntimeError; a bad profile_prefix a ValueError."""
    llm = LLM(tiny_dir, **TINY_ENGINE)
    for name in ("JAXINFER_PROFILER_DIR", "VLLM_TORCH_PROFILER_DIR"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="JAXINFER_PROFILER_DIR"):
        llm.start_profile()
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="profile_prefix"):
        llm.start_profile("../up")
    folder = llm.start_profile("run1")
    try:
        llm.generate([[5, 7, 9]], SamplingParams(max_tokens=3), use_tqdm=False)
    finally:
        llm.stop_profile()
    written = [f for _, _, files in os.walk(folder) for f in files]
    assert folder == str(tmp_path / "run1") and any(f.endswith(".xplane.pb") for f in written), written


def test_revision_download_dir_and_tokenizer_options(tiny_dir, tmp_path, monkeypatch):
    """vLLM's download_dir (the Hugging Face cache) and revision reach the hub lookup; tokenizer=FOLDER serves a
    checkpoint that has no tokenizer files; --tokenizer / --revision / --download-dir are command-line flags too."""
    import shutil
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(tiny_dir, name), bare / name)
    llm = LLM(str(bare), tokenizer=tiny_dir, **TINY_ENGINE)
    assert llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)[0].prompt_token_ids

    from jaxinfer import cli
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someone--tiny-qwen3"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(tiny_dir, repo / "snapshots" / commit)
    llm = LLM("someone/tiny-qwen3", download_dir=str(tmp_path / "hub"), revision="main", hf_token="hf_x", **TINY_ENGINE)
    assert llm.model_config.vocab_size == 512
    with pytest.raises(ValueError, match=r"hf_token=\*\*\* must be"):         # (vLLM's hf_token; not echoed)
        LLM("someone/tiny-qwen3", download_dir=str(tmp_path / "hub"), hf_token=12345, **TINY_ENGINE)
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(FileNotFoundError, match="someone/tiny-qwen3"):
        LLM("someone/tiny-qwen3", download_dir=str(tmp_path / "hub"), revision="v2", **TINY_ENGINE)
    with pytest.raises(ValueError, match="revision=3"):
        LLM(tiny_dir, revision=3, **TINY_ENGINE)
    a = cli.build_parser().parse_args(["serve", "someone/tiny-qwen3", "--revision", "main", "--download-dir",
                                       "/d", "--tokenizer", tiny_dir])
    assert cli.engine_kwargs(a) == {"revision": "main", "download_dir": "/d", "tokenizer": tiny_dir}
    for more, token in ((["--hf-token"], True), (["--hf-token", "hf_x"], "hf_x")):    # (vLLM's flag; alone: saved one)
        assert cli.engine_kwargs(cli.build_parser().parse_args(["serve", "m", *more]))["hf_token"] == token
    from jaxinfer import EngineArgs
    assert "hf_x" not in repr(EngineArgs("m", hf_token="hf_x"))


def test_hf_overrides_rope_scaling_without_rope_theta_says_what_it_does(tmp_path):
    """YaRN given as hf_overrides (the README's way to 131k tokens) on a checkpoint that keeps rope_theta only inside
    rope_parameters (transformers 5): rope_theta falls back to 10000 as transformers does (parity), with a warning
    naming the checkpoint's theta and how to keep it; one given inside rope_scaling wins, silently."""
    import json
    import warnings
    from helpers import make_tiny_model
    from jaxinfer.config import ModelConfig
    path = make_tiny_model(str(tmp_path / "m"), max_position_embeddings=64,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert "rope_theta" not in json.load(open(os.path.join(path, "config.json")))   # only inside rope_parameters
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    with pytest.warns(UserWarning, match=r'rope_theta is 10000.0 .*checkpoint.s 1000000.0.*add "rope_theta": 1000000.0'):
        c = ModelConfig.from_pretrained(path, {"rope_scaling": yarn, "max_position_embeddings": 256})
    assert c.rope_theta == 10000.0 and c.rope_scaling_factor == 4.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = ModelConfig.from_pretrained(path, {"rope_scaling": {**yarn, "rope_theta": 1e6},
                                               "max_position_embeddings": 256})
        assert c.rope_theta == 1e6
        assert ModelConfig.from_pretrained(path).rope_theta == 1e6


@pytest.mark.parametrize("steps", [1, 4])
def test_stop_id_as_the_last_token_allowed_is_stop(tiny_dir, steps):
    """vLLM's check_stop looks at stop ids before the length: a stop id (or EOS) drawn as the max_tokens-th token
    ends the request on "stop" with it as stop_reason, as one token earlier (one-step and K-step calls alike)."""
    llm = LLM(tiny_dir, **{**TINY_ENGINE, "num_scheduler_steps": steps})
    base = dict(temperature=0.0, ignore_eos=True)
    ids = llm.generate([[5, 6, 7]], SamplingParams(**base, max_tokens=6), use_tqdm=False)[0].outputs[0].token_ids
    k = next(i for i in range(1, 6) if ids[i] not in ids[:i])        # a token's first appearance, not the first
    last = llm.generate([[5, 6, 7]], SamplingParams(**base, max_tokens=k + 1, stop_token_ids=[ids[k]]),
                        use_tqdm=False)[0].outputs[0]
    assert (last.token_ids, last.finish_reason, last.stop_reason) == (ids[:k + 1], "stop", ids[k])
    assert last.text == llm.tokenizer.decode(ids[:k])                # the stop token's text left out, as "stop"
    room = llm.generate([[5, 6, 7]], SamplingParams(**base, max_tokens=k + 2, stop_token_ids=[ids[k]]),
                        use_tqdm=False)[0].outputs[0]
    assert (room.token_ids, room.finish_reason, room.stop_reason) == (ids[:k + 1], "stop", ids[k])


def test_generate_request_ids_are_the_prompts_indices(tiny_dir):
    """generate's RequestOutput.request_id is the prompt's index (as stream's), whatever n or earlier calls."""
    llm = LLM(tiny_dir, **TINY_ENGINE)
    for n in (2, 1):
        outs = llm.generate([[5, 6], [7], [8, 9]], SamplingParams(n=n, max_tokens=2), use_tqdm=False)
        assert [o.request_id for o in outs] == [0, 1, 2] and [len(o.outputs) for o in outs] == [n] * 3


def test_sampling_params_are_keyword_only_and_logprobs_concatenate(tiny_dir):
    with pytest.raises(TypeError, match="positional"):
        SamplingParams(2)                     # vLLM's first field is n, nano-vllm's temperature: refused
    llm = LLM(tiny_dir, **TINY_ENGINE)
    o = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, logprobs=1, prompt_logprobs=1), use_tqdm=False)[0]
    lps = o.outputs[0].logprobs
    assert [None] + lps == [None, *lps] and lps + [None] == [*lps, None] and len(o.prompt_logprobs[1:] + lps) == 5
    assert list(lps) == lps and isinstance(list(lps), list)


def test_chat_template_content_format(tiny_dir):
    """vLLM's chat_template_content_format: "openai" hands the template a list of text parts, "string" one string,
    "auto" what the template iterates over."""
    llm = LLM(tiny_dir, **TINY_ENGINE)
    tmpl = ("{% for m in messages %}{% if m.content is string %}S:{{ m.content }}{% else %}"
            "{% for p in m.content %}P:{{ p.text }}{% endfor %}{% endif %}|{% endfor %}")
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}, {"role": "assistant", "content": None},
            {"role": "user", "content": "c"}]

    def rendered(fmt, template=tmpl):
        return llm.chat(msgs, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=template,
                        chat_template_content_format=fmt)[0].prompt
    assert rendered("string") == "S:a\nb|S:|S:c|"
    assert rendered("openai") == rendered("auto") == "P:aP:b||P:c|"
    plain = "{% for m in messages %}{{ m.content }}|{% endfor %}"
    assert rendered("auto", plain) == "a\nb||c|"
    bracket = "{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}|{% endfor %}"
    assert rendered("auto", bracket) == rendered("openai", bracket) == "ab||c|"    # (Gemma 3's, Llama 4's form)
    # the template's own errors are ValueErrors, as vLLM's (raise_exception, syntax, a string template's parts)
    for bad, fmt in (("{{ raise_exception('roles must alternate') }}", "auto"), ("{% for %}", "auto"),
                     (plain.replace("m.content", "m.content + 1"), "openai")):
        with pytest.raises(ValueError, match="chat template"):
            rendered(fmt, bad)


def test_an_eos_id_other_than_the_tokenizers_is_the_stop_reason(tiny_dir):
    """vLLM adds a generation config's EOS ids other than the tokenizer's to stop_token_ids: ending on one
    reports its id as stop_reason; the tokenizer's EOS reports None (generate, stream and the engine API)."""
    base = dict(temperature=0.0, max_tokens=8)
    plain = LLM(tiny_dir, **TINY_ENGINE)
    ids = plain.generate([[5, 6, 7]], SamplingParams(**base, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    k = next(i for i in range(1, 8) if ids[i] not in ids[:i])
    eos = plain.get_tokenizer().eos_token_id
    assert eos not in ids[:k + 1]
    llm = LLM(tiny_dir, **TINY_ENGINE, hf_overrides={"eos_token_id": [eos, ids[k]]})
    out = llm.generate([[5, 6, 7]], SamplingParams(**base), use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (ids[:k + 1], "stop", ids[k])
    last = list(llm.stream([[5, 6, 7]], SamplingParams(**base)))[-1]
    assert (last.finish_reason, last.outputs[0].stop_reason) == ("stop", ids[k])
    assert llm.generate([[5, 6, 7]], SamplingParams(**base, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids == ids
    primary = LLM(tiny_dir, **TINY_ENGINE, hf_overrides={"eos_token_id": [ids[k], eos]})   # order does not matter
    assert primary.generate([[5, 6, 7]], SamplingParams(**base), use_tqdm=False)[0].outputs[0].stop_reason == ids[k]
    e = llm.llm_engine
    e.add_request("a", [5, 6, 7], SamplingParams(**base))
    while e.has_unfinished_requests():
        done = [o for o in e.step() if o.finished]
    assert done[0].outputs[0].stop_reason == ids[k]


def test_stream_reports_the_requests_num_cached_tokens_for_every_sample(tiny_dir):
    """With n > 1, samples 1.. reuse sample 0's prompt blocks; a request's num_cached_tokens is sample 0's (the
    request's prompt hits) in every delta, as in generate."""
    llm = LLM(tiny_dir, **TINY_ENGINE)
    prompt, sp = list(range(3, 16)), SamplingParams(n=3, seed=1, max_tokens=4)
    want = llm.generate([prompt], sp, use_tqdm=False)[0].num_cached_tokens
    llm.reset_prefix_cache()
    assert {d.num_cached_tokens for d in llm.stream([prompt], sp)} == {want}
    assert {d.num_cached_tokens for d in llm.stream([prompt], sp)} == {12}             # all but the last token


def test_use_tqdm_takes_a_progress_bar_factory(tiny_dir):
    """vLLM's `use_tqdm` may be a callable that makes the progress bar (a tqdm class or a partial of one)."""
    made = []

    class bar:                                       # the part of tqdm's interface generate uses
        def __init__(self, total, **kw):
            self.total, self.n = total, 0
            made.append(self)
        __enter__ = lambda self: self
        __exit__ = lambda self, *exc: None

        def update(self, k=1):
            self.n += k
    llm = LLM(tiny_dir, **TINY_ENGINE)
    outs = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3, n=2), use_tqdm=bar)
    assert len(outs) == 2 and len(made) == 1 and made[0].total == 4 and made[0].n == 4
    assert llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2), use_tqdm=bar) and len(made) == 2


def test_outputs_pickle_small_change_as_lists_and_merge_as_vllms(tiny_dir):
    """Outputs with logprobs pickle (and deepcopy) without the tokenizer their lazy logprobs decode with, as plain
    lists; the logprobs change as a list does (append, extend, item assignment: vLLM's RequestOutput.add extends
    them); RequestOutput takes vLLM's positional order and merges deltas with vLLM's add(); metrics read by
    attribute too (vLLM's first_token_latency)."""
    import copy
    import pickle

    from jaxinfer import RequestOutput
    llm = LLM(tiny_dir, **TINY_ENGINE)
    sp = SamplingParams(max_tokens=5, logprobs=2, prompt_logprobs=1, seed=3)
    o = llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0]
    blob = pickle.dumps(o)
    assert len(blob) < 4000 and b"tokenizer" not in blob.lower()
    back = pickle.loads(blob)
    assert type(back.outputs[0].logprobs) is list and back.outputs[0].logprobs == o.outputs[0].logprobs
    assert back.prompt_logprobs == o.prompt_logprobs and copy.deepcopy(o).outputs[0].logprobs == o.outputs[0].logprobs
    lps = o.outputs[0].logprobs
    first = lps[0]
    lps.append(None)
    lps.extend([None])
    lps[0] = {}
    assert len(lps) == 7 and lps[-2:] == [None, None] and lps[0] == {} and lps[1] == back.outputs[0].logprobs[1]
    del lps[0]
    lps.insert(0, first)
    assert lps[:5] == back.outputs[0].logprobs and lps.copy() == list(lps) and type(lps.copy()) is list
    assert o.metrics.first_token_latency == o.metrics["ttft_s"] == o.metrics.ttft_s > 0
    merged = None
    for d in llm.stream([[5, 6, 7]], sp):
        if merged is None:
            merged = d
        else:
            merged.add(d, aggregate=True)
    c, ref = merged.outputs[0], back.outputs[0]
    assert (c.text, c.token_ids, c.logprobs, c.finish_reason, merged.finished) == (
        ref.text, ref.token_ids, ref.logprobs, ref.finish_reason, True)
    assert abs(c.cumulative_logprob - ref.cumulative_logprob) < 1e-5
    r = RequestOutput("7", "p", [1, 2], None, [CompletionOutput(0, "a", [3])], False)    # vLLM's order
    r.add(RequestOutput("7", "p", [1, 2], None, [CompletionOutput(0, "b", [4], finish_reason="length")], True), False)
    assert (r.outputs[0].text, r.outputs[0].token_ids, r.finished) == ("b", [4], True)


def test_llm_engine_has_vllms_model_config_tokenizer_and_reset_prefix_cache(tiny_dir):
    """What code written against vLLM's LLMEngine reads (lm-eval's vLLM backend: model_config.max_model_len; RL
    frameworks: llm.llm_engine.reset_prefix_cache())."""
    llm = LLM(tiny_dir, **TINY_ENGINE)
    engine = llm.llm_engine
    assert engine.model_config.max_model_len == llm.config.max_model_len
    import copy
    import pickle
    for twin in (copy.deepcopy(engine.model_config), pickle.loads(pickle.dumps(engine.model_config))):
        assert (twin.max_model_len, twin.vocab_size) == (llm.config.max_model_len, llm.model_config.vocab_size)
    assert engine.get_model_config().vocab_size == llm.model_config.vocab_size
    assert engine.tokenizer is llm.get_tokenizer()
    sp = SamplingParams(max_tokens=1)
    llm.generate([list(range(3, 40))], sp, use_tqdm=False)
    assert llm.generate([list(range(3, 40))], sp, use_tqdm=False)[0].num_cached_tokens > 0
    assert engine.reset_prefix_cache() is True and llm.reset_prefix_cache(reset_running_requests=True) is True
    assert llm.generate([list(range(3, 40))], sp, use_tqdm=False)[0].num_cached_tokens == 0
    running = llm.stream([list(range(3, 40))], SamplingParams(max_tokens=20, ignore_eos=True))
    next(running)                                      # (its prompt's blocks are cached and held)
    assert llm.reset_prefix_cache() is False           # as vLLM's while requests hold blocks
    assert llm.reset_prefix_cache(reset_running_requests=True) is True
    assert llm.generate([list(range(3, 40))], sp, use_tqdm=False)[0].num_cached_tokens == 0
    assert len(list(running)) > 0 and llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_version_and_vllms_inputs_module(tiny_dir):
    """`jaxinfer.__version__` (vllm.__version__) is the installed package's; `jaxinfer.inputs` has vLLM's prompt
    types (`from vllm.inputs import TokensPrompt`), which generate takes; LLM() takes vLLM's executor backend,
    scheduling policy and served model name."""
    import importlib.metadata

    import jaxinfer
    from jaxinfer.inputs import PromptType, TextPrompt, TokensPrompt
    assert jaxinfer.__version__ == importlib.metadata.version("jaxinfer") and "__version__" in dir(jaxinfer)
    llm = LLM(tiny_dir, distributed_executor_backend="mp", scheduling_policy="fcfs", served_model_name="m",
              **TINY_ENGINE)                                    # (vLLM's options that describe what jaxinfer does)
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    a, b = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7]), TextPrompt(prompt="hi")], sp, use_tqdm=False)
    assert a.outputs[0].token_ids == llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert b.prompt == "hi" and PromptType is not None
