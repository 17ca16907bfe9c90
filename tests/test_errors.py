"""Bad input raises a clear ValueError naming the value, and the engine keeps working."""
import pytest
from helpers import TINY_ENGINE, interrupt_at_call

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import EngineConfig

BASE = TINY_ENGINE


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, **BASE)


@pytest.mark.parametrize("prompt, sp, match", [
    ([], SamplingParams(), "empty"),
    ("", SamplingParams(), "empty"),
    (list(range(1, 200)), SamplingParams(), "199 tokens, more than max_model_len=128"),
    (list(range(1, 130)), SamplingParams(), "129 tokens, more than max_model_len=128"),
    ([1, 2, 512], SamplingParams(), "token id 512 out of vocabulary"),
    ([1, -1], SamplingParams(), "token id -1"),
    ([1, 2], "greedy", "SamplingParams"),
    ([1, 2], {"max_tokens": 2}, "got dict"),
    ([1, True], SamplingParams(), "token id True that is not an int"),
    ([1, 2.0], SamplingParams(), "token id 2.0 that is not an int"),
    (None, SamplingParams(), "prompt 1 must be a string"),
])
def test_bad_requests(llm, prompt, sp, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([[5, 6, 7], prompt], sp, use_tqdm=False)
    st = llm.stats()
    assert st["waiting"] == st["running"] == 0           # the good neighbour was not queued either
    out = llm.generate([5, 6, 7], SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert len(out.token_ids) >= 1 and llm.stats()["kv_blocks_free"] == st["kv_blocks_total"]


def test_ids_past_int32_in_sampling_params(llm):
    """A top_k past int32 (vLLM takes any) cannot filter anything: the request runs as without it, on the K-step
    path and the one-step path, instead of failing the step it is packed into. Stop token ids past the vocabulary
    (past int32 too) are refused by name, as current vLLM (SamplingParams' vocabulary check)."""
    ps = [[5, 6, 7], [9, 8]]
    for ids in ([2**31, 2**70], [3, 512]):
        with pytest.raises(ValueError, match=rf"out-of-vocab token id\(s\) \[{ids[1] if ids[0] == 3 else ids[0]}.*"
                                             r"Vocabulary size: 512"):
            llm.generate(ps, SamplingParams(max_tokens=2, stop_token_ids=ids), use_tqdm=False)
    for steps in (None, 1):
        llm.engine.multistep = steps is None
        big = [SamplingParams(temperature=0.8, max_tokens=6, seed=3, top_k=k) for k in (10**6, 2**31)]
        outs = [llm.generate(ps, sp, use_tqdm=False) for sp in big]
        assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    llm.engine.multistep = True
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"]


def test_prompts_of_other_types(llm):
    """None is refused by name; a numpy array of ids is one prompt (as a list of them is)."""
    import numpy as np
    with pytest.raises(ValueError, match="prompts must be a string, a list of token ids"):
        llm.generate(None, use_tqdm=False)
    sp = SamplingParams(temperature=0, max_tokens=3)
    want = llm.generate([5, 6, 7], sp, use_tqdm=False)[0].token_ids
    assert llm.generate(np.array([5, 6, 7]), sp, use_tqdm=False)[0].token_ids == want
    assert llm.generate([np.array([5, 6, 7])], sp, use_tqdm=False)[0].token_ids == want
    import jax.numpy as jnp                     # a list of 0-d arrays (list(jnp.array(ids))) is one prompt too
    assert llm.generate(list(jnp.array([5, 6, 7])), sp, use_tqdm=False)[0].token_ids == want
    assert llm.generate(list(np.array([5, 6, 7])), sp, use_tqdm=False)[0].token_ids == want
    with pytest.raises(ValueError, match="prompt 0: the tokenizer cannot encode"):
        llm.generate("bad \ud800 text", sp, use_tqdm=False)            # (a lone surrogate)
    with pytest.raises(ValueError, match="bad_words entry .* cannot be tokenized"):    # (was the tokenizer's TypeError)
        llm.generate([5, 6, 7], SamplingParams(max_tokens=3, bad_words=["\ud800"]), use_tqdm=False)
    assert llm.generate([5, 6, 7], sp, use_tqdm=False)[0].token_ids == want


def test_numpy_numbers_where_python_ones_are_taken(tiny_dir):
    """numpy scalars in engine options (floats too), in best_of and in abort_request, as Python's numbers."""
    import numpy as np
    llm = LLM(tiny_dir, **{**TINY_ENGINE, "gpu_memory_utilization": np.float32(0.5), "max_num_seqs": np.int64(4)})
    assert llm.config.gpu_memory_utilization == 0.5 and llm.config.max_num_seqs == 4
    assert SamplingParams(n=2, best_of=np.int64(2)).best_of == 2
    eng = llm.llm_engine
    eng.add_request(7, [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
    eng.abort_request(np.int64(7))
    assert not eng.has_unfinished_requests()
    # also numpy bools, numbers in bucket lists and in vLLM's options that mean nothing here
    llm = LLM(tiny_dir, **{**TINY_ENGINE, "enable_prefix_caching": np.False_, "decode_buckets": [np.int64(8)],
                           "max_logprobs": np.int64(20), "swap_space": np.float32(4), "trust_remote_code": np.True_})
    assert llm.config.enable_prefix_caching is False and llm.config.decode_buckets == (8,)


def test_vllm_engine_args_none_and_other_names(tiny_dir):
    """As vLLM's EngineArgs: None for block_size, enable_prefix_caching, async_scheduling, ... is the default;
    num_gpu_blocks_override is num_kvcache_blocks; max_model_len=-1 is "as long as fits" (the CLI's auto). The
    mosaic backend's kernels need block_size >= 8: refused at LLM(), not at the first request."""
    from jaxinfer.config import EngineConfig, ModelConfig
    base = {k: v for k, v in TINY_ENGINE.items() if k not in ("num_kvcache_blocks", "max_model_len", "block_size")}
    llm = LLM(tiny_dir, **base, block_size=None, enable_prefix_caching=None, async_scheduling=None,
              num_gpu_blocks_override=40, max_model_len=-1)
    c = llm.config
    assert (c.block_size, c.enable_prefix_caching, c.async_scheduling) == (16, True, True)
    assert llm.stats()["kv_blocks_total"] == 40 and c.max_model_len == 40 * 16
    with pytest.raises(ValueError, match="not both"):
        EngineConfig.from_kwargs(num_gpu_blocks_override=4, num_kvcache_blocks=8)
    c = EngineConfig.from_kwargs(num_gpu_blocks_override=None, num_kvcache_blocks=8, kvcache_block_size=None)
    assert (c.num_kvcache_blocks, c.block_size) == (8, 16)              # (an alias given as None: not given)
    model = ModelConfig.from_pretrained(tiny_dir)
    with pytest.raises(ValueError, match="mosaic.*block_size=4"):
        EngineConfig.from_kwargs(attn_backend="mosaic", block_size=4).resolve("gpu", model)
    assert ModelConfig.from_pretrained(tiny_dir, {"torch_dtype": "bfloat16"}).torch_dtype == "bfloat16"


def test_max_tokens_none_runs_to_max_model_len(llm):
    """vLLM's max_tokens=None: generate until the context is full (max_model_len=128 here)."""
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 128 - 3 and out.finish_reason == "length"


def test_a_prompt_of_exactly_max_model_len_gives_one_token(llm):
    """vLLM refuses only prompts longer than max_model_len; one that fills it samples one token ("length"), also
    when queued behind others, streamed, or cut to max_model_len by truncate_prompt_tokens=-1."""
    full, other = list(range(1, 129)), list(range(3, 60))
    for mt in (None, 4):
        sp = SamplingParams(temperature=0, max_tokens=mt, ignore_eos=True)
        outs = llm.generate([full, other, full[::-1]], sp, use_tqdm=False)
        assert [len(o.token_ids) for o in outs] == [1, 128 - 57 if mt is None else 4, 1]
        assert outs[0].finish_reason == outs[2].finish_reason == "length"
    cut = llm.generate([list(range(1, 300))], SamplingParams(truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert len(cut.prompt_token_ids) == 128 and len(cut.token_ids) == 1
    assert [d.finish_reason for d in llm.stream([full], SamplingParams(max_tokens=3))][-1] == "length"
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"] and st["running"] == st["waiting"] == 0


@pytest.mark.parametrize("K", [1, 4])
def test_a_prompt_of_max_model_len_chunked_down_to_its_last_token(tiny_dir, K):
    """Chunks of 13 leave such a prompt's last token (40 = 3 x 13 + 1) to a decode step, which must still run it
    (before, the scheduler found no work and generate raised), also beside a row decoding K steps per call, and
    when prompt logprobs cap a step's prompt tokens."""
    llm = LLM(tiny_dir, **{**BASE, "max_model_len": 40, "max_num_batched_tokens": 13, "num_scheduler_steps": K})
    full, short = list(range(1, 41)), [5, 6, 7]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outs = llm.generate([short, full, full[::-1]], sp, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [30, 1, 1] and {o.finish_reason for o in outs} == {"length"}
    one = llm.generate([full], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0), use_tqdm=False)[0]
    assert len(one.token_ids) == 1 and len(one.prompt_logprobs) == 40
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"] and st["running"] == st["waiting"] == 0


def test_dict_prompt_with_numpy_ids(llm):
    import numpy as np
    sp = SamplingParams(temperature=0, max_tokens=3)
    a = llm.generate({"prompt_token_ids": np.array([5, 6, 7])}, sp, use_tqdm=False)[0]
    assert a.prompt_token_ids == [5, 6, 7] and a.token_ids == llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].token_ids
    assert llm.engine.check_request(np.array([5, 6, 7]), sp).max_tokens == 3         # the engine's own check too
    with pytest.raises(ValueError, match="empty"):
        llm.engine.check_request(np.array([], dtype=int), sp)


def test_max_tokens_none_with_a_pool_smaller_than_max_model_len(tiny_dir):
    """... or until the pool is full, when it holds less than max_model_len (8 blocks of 4 tokens here)."""
    small = LLM(tiny_dir, **{**BASE, "num_kvcache_blocks": 8})
    out = small.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 8 * 4 - 3 and out.finish_reason == "length"


def test_a_given_max_model_len_gets_a_cpu_pool_that_holds_it(tiny_dir, monkeypatch):
    """The CPU's default pool is capped (memory.CPU_POOL_BYTES); a max_model_len given explicitly still gets one
    whole sequence of room (as the GPU's sizing refuses less), so max_tokens=None runs to max_model_len; a cap with
    max_model_len left unset caps max_model_len instead. warmup with max_model_len 1 starts (it has no room for
    its warm requests)."""
    from jaxinfer.engine import memory
    monkeypatch.setattr(memory, "CPU_POOL_BYTES", 4096)
    kw = {k: v for k, v in BASE.items() if k not in ("num_kvcache_blocks", "max_model_len")}
    llm = LLM(tiny_dir, **kw, max_model_len=96)
    assert llm.stats()["kv_blocks_total"] * BASE["block_size"] >= 96
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 93 and out[0].finish_reason == "length"
    capped = LLM(tiny_dir, **kw)
    assert capped.config.max_model_len == capped.stats()["kv_blocks_total"] * BASE["block_size"] < 96
    one = LLM(tiny_dir, **{**BASE, "max_model_len": 1, "warmup": True})
    assert one.generate([[5]], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_request_larger_than_pool(tiny_dir):
    small = LLM(tiny_dir, **{**BASE, "num_kvcache_blocks": 8})
    with pytest.raises(ValueError, match="needs 10 KV blocks.*only 8"):
        small.generate(list(range(1, 30)), SamplingParams(max_tokens=12), use_tqdm=False)
    assert small.generate([1, 2], SamplingParams(max_tokens=2), use_tqdm=False)[0].finish_reason
    # the pool holds 32 tokens: the last output token is never written to it, so 31 + 2 and 32 + 1 fit, 31 + 3 not
    sp = lambda m: SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)     # noqa: E731
    for n, m in ((31, 2), (32, 1), (1, 32)):
        assert len(small.generate([[5] * n], sp(m), use_tqdm=False)[0].token_ids) == m
    with pytest.raises(ValueError, match="needs 9 KV blocks for 31 prompt . 3 output tokens"):
        small.generate([[5] * 31], sp(3), use_tqdm=False)
    two = small.generate([[5] * 16, [6] * 16], sp(17), use_tqdm=False)       # together past the pool: preempted
    assert [len(o.token_ids) for o in two] == [17, 17] and small.stats()["kv_blocks_free"] == 8


@pytest.mark.parametrize("kw, match", [
    (dict(attn_backend="cuda"), "attn_backend='cuda'"), (dict(block_size=3), "block_size=3"),
    (dict(max_num_seqs=0), "max_num_seqs=0"), (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(dtype="int8"), "dtype='int8'"), (dict(num_kvcache_blocks=0), "num_kvcache_blocks=0"),
    (dict(seed=-1), "seed=-1"), (dict(seed="a"), "seed='a'"), (dict(seed=1.5), "seed=1.5"),
    (dict(enable_prefix_caching="no"), "enable_prefix_caching='no'"), (dict(warmup="yes"), "warmup='yes'"),
    (dict(async_scheduling=1), "async_scheduling=1"), (dict(gpu_memory_utilization=True), "gpu_memory_utilization"),
    (dict(max_num_seqs=2**31), "max_num_seqs=2147483648 is more than 65536"),
    (dict(block_size=2**20), "block_size=1048576 is more than 1024"),
    (dict(max_num_batched_tokens=2**40), "max_num_batched_tokens=1099511627776"),
])
def test_bad_engine_config(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_bad_model_paths(tmp_path):
    from helpers import make_tiny_model
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        LLM(str(tmp_path / "no-such-model"))
    path = make_tiny_model(str(tmp_path / "m"), max_position_embeddings=256)
    with pytest.raises(ValueError, match="max_model_len=4096 exceeds"):
        LLM(path, **{**BASE, "max_model_len": 4096})


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_pallas_pads_a_head_dim_that_is_not_a_power_of_two(tiny_dirs, kv, monkeypatch):
    """head_dim 24 (3 layers, GQA group 4): the pallas backend keeps 32-wide pages (q/k/v padded with zeros, the
    model's 1/sqrt(24) scale) and gives xla's greedy tokens and logprobs, prompts over several chunks, a prefix hit,
    K-step calls (fp8: V pages in pairs of the padded width). The pool counts the padded bytes; cudnn, triton and
    mosaic (power-of-two tiles, no padding) are refused naming the head_dim; left to the engine, a GPU runs pallas."""
    import numpy as np

    from jaxinfer.config import ModelConfig
    from jaxinfer.engine.memory import kv_bytes_per_block
    from jaxinfer.model.attention import check_backend
    path = tiny_dirs["gqa4_wide_head"]
    rng = np.random.default_rng(3)
    ps = [rng.integers(0, 512, n).tolist() for n in (5, 70, 19)]
    ps.append(ps[1][:40] + [7, 8])
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    got = {}
    for backend in ("xla", "pallas"):
        llm = LLM(path, **{**BASE, "attn_backend": backend, "kv_cache_dtype": kv, "num_scheduler_steps": 4})
        outs = [o.outputs[0] for o in llm.generate(ps, sp, use_tqdm=False)]
        got[backend] = [o.token_ids for o in outs], [[d[t].logprob for d, t in zip(o.logprobs, o.token_ids)]
                                                     for o in outs]
        st = llm.stats()
        assert st["kv_blocks_free"] == st["kv_blocks_total"]
        assert llm.engine.runner.kv_caches[0][0].shape[-1] == (32 if backend == "pallas" else 24)
    assert got["pallas"][0] == got["xla"][0]
    np.testing.assert_allclose(np.array(got["pallas"][1]), np.array(got["xla"][1]), atol=2e-3 if kv == "fp8" else 1e-4)
    model = ModelConfig.from_pretrained(path)
    assert kv_bytes_per_block(model, 4, "float32", "pallas") == kv_bytes_per_block(model, 4, "float32") * 32 // 24
    for backend in ("cudnn", "triton", "mosaic"):
        with pytest.raises(ValueError, match=f"attn_backend='{backend}' needs a power-of-two head_dim; this model's "
                                             "head_dim=24"):
            check_backend(backend, model)
    assert EngineConfig().resolve("gpu", model).attn_backend == "pallas"
    import jaxinfer.engine.memory as memory     # a pool past free memory: the padded bytes named, MiB below a GiB
    monkeypatch.setattr(memory, "free_memory_bytes", lambda device=None: 2**20)
    with pytest.raises(ValueError, match=r"needs 1.2 MiB of KV cache \(pages of head_dim 32: pallas pads 24\) but "
                                         r"only 1.0 MiB is free"):
        LLM(path, **{**BASE, "attn_backend": "pallas", "kv_cache_dtype": kv, "num_kvcache_blocks": 800 if kv == "fp8"
                     else 200})     # 6,144 bytes a block in fp32, 1,536 in fp8: 1.17 MiB


def test_kv_pool_larger_than_memory(tiny_dir):
    with pytest.raises(ValueError, match=r"num_kvcache_blocks=1000000000000 needs .* GiB"):
        LLM(tiny_dir, **{**BASE, "num_kvcache_blocks": 10**12})
    assert LLM(tiny_dir, **BASE).generate([1, 2], SamplingParams(max_tokens=2), use_tqdm=False)[0].token_ids


class _FakeGpu:
    platform = "gpu"

    def memory_stats(self):          # XLA's VMM allocator (SKIP_TEMP command buffers) keeps no stats
        return None


def test_kv_pool_sizing_without_allocator_stats(monkeypatch):
    """A GPU whose allocator reports no stats is sized from NVML's numbers; when those are missing too, the
    error says to give num_kvcache_blocks, and a given pool is accepted."""
    from jaxinfer.config import ModelConfig
    from jaxinfer.engine import memory
    cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    engine = EngineConfig(max_num_seqs=8, max_model_len=128, block_size=4, gpu_memory_utilization=0.5)
    per_block = memory.kv_bytes_per_block(cfg, 4, "float32")
    monkeypatch.setattr(memory.jax, "devices", lambda: [_FakeGpu()])
    monkeypatch.setattr(memory, "_nvml_memory", lambda device: (40 * 2**30, 4 * 2**30))
    room = memory._HEADROOM + 2 * 2 * 512 * 64 + 4 * 8 * 512        # 2 GiB, twice the LM head, the logits
    assert memory.headroom_bytes(engine, cfg) == room
    assert memory.num_blocks_for_memory(cfg, engine, "float32") == (16 * 2**30 - room) // per_block
    assert memory.free_memory_bytes() == 36 * 2**30
    monkeypatch.setattr(memory, "_nvml_memory", lambda device: None)
    with pytest.raises(ValueError, match="give num_kvcache_blocks"):
        memory.num_blocks_for_memory(cfg, engine, "float32")
    memory.check_pool_fits(cfg, engine, 10)               # an explicit pool is not refused for want of numbers
    # the xla backend may write gathered pages (up to GATHER_BUDGET a step): the pool leaves room for them too
    monkeypatch.setattr(memory, "_nvml_memory", lambda device: (40 * 2**30, 4 * 2**30))
    from jaxinfer.model.xla_attention import GATHER_BUDGET
    xla = EngineConfig(max_num_seqs=8, max_model_len=128, block_size=4, gpu_memory_utilization=0.5, attn_backend="xla")
    assert memory.headroom_bytes(xla) == memory._HEADROOM + GATHER_BUDGET
    assert memory.num_blocks_for_memory(cfg, xla, "float32") == (16 * 2**30 - room - GATHER_BUDGET) // per_block


def test_engine_options_are_the_config_fields():
    """LLM kwargs are EngineConfig's fields: an unknown one is refused by name (with a suggestion), and
    nano-vllm's kvcache_block_size is vLLM's block_size."""
    with pytest.raises(ValueError, match=r"max_num_seq=4.*did you mean max_num_seqs"):
        EngineConfig.from_kwargs(max_num_seq=4)
    assert EngineConfig.from_kwargs(kvcache_block_size=8).block_size == 8
    for name in ("max_tokens", "temperature"):       # a sampling setting given to LLM(): where it goes instead
        with pytest.raises(ValueError, match=f"{name}=.* not an engine option .*SamplingParams\\({name}="):
            EngineConfig.from_kwargs(**{name: 1})
    assert EngineConfig.from_kwargs(seed=3).seed == 3                       # (both: the engine's)
    with pytest.raises(ValueError, match="not both"):
        EngineConfig.from_kwargs(kvcache_block_size=8, block_size=8)


def test_a_users_strict_rank_promotion_is_theirs(tiny_dir):
    """jax_numpy_rank_promotion="raise" in the user's code: the engine's steps (which broadcast) still trace, and
    give the same tokens; the setting is left as the user set it."""
    import jax
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = LLM(tiny_dir, **BASE).generate([[5, 6, 7]], sp, use_tqdm=False)[0].token_ids
    with jax.numpy_rank_promotion("raise"):
        from jaxinfer.engine.executables import SHARED_EXECUTABLES
        SHARED_EXECUTABLES.clear()                 # compiled again, under the user's setting
        got = LLM(tiny_dir, **BASE).generate([[5, 6, 7]], sp, use_tqdm=False)[0].token_ids
        assert jax.config.jax_numpy_rank_promotion == "raise"
    assert got == want


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_a_users_x64_and_strict_dtype_promotion_are_theirs(tiny_dir, backend):
    """The user's jax_enable_x64 (the kernels' block tables became int64) and "strict" dtype promotion (penalties
    mix bool and float) do not reach the engine's programs: the same tokens, with and without penalties."""
    import jax
    from jaxinfer.engine.executables import SHARED_EXECUTABLES
    kw = {**BASE, "attn_backend": backend}
    sps = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, presence_penalty=0.5, repetition_penalty=1.2)]
    want = [o.token_ids for o in LLM(tiny_dir, **kw).generate([[5, 6, 7], [9, 8]], sps, use_tqdm=False)]
    with jax.enable_x64(True), jax.numpy_dtype_promotion("strict"):
        SHARED_EXECUTABLES.clear()                 # compiled again, under the user's settings
        got = [o.token_ids for o in LLM(tiny_dir, **kw).generate([[5, 6, 7], [9, 8]], sps, use_tqdm=False)]
        assert jax.config.jax_enable_x64 and jax.config.jax_numpy_dtype_promotion == "strict"
    assert got == want


def test_a_users_jit_transfer_precision_and_mesh_settings_are_theirs(tiny_dir):
    """A user debugging their own code (disable_jit, a transfer guard), asking "highest" matmul precision or
    sharding under `jax.set_mesh`: the engine still compiles and runs its own steps at XLA's own precision (not
    baked into the shared executables a later LLM reuses), moves its own batches, gives the same tokens, and
    the settings stay the user's."""
    import re

    import jax
    from jaxinfer.engine.executables import SHARED_EXECUTABLES
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = LLM(tiny_dir, **BASE).generate([[5, 6, 7]], sp, use_tqdm=False)[0].token_ids
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    with (jax.disable_jit(), jax.transfer_guard("disallow"), jax.default_matmul_precision("highest"),
          jax.set_mesh(mesh)):
        SHARED_EXECUTABLES.clear()                 # compiled again, under the user's settings
        llm = LLM(tiny_dir, **BASE)
        assert llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].token_ids == want
        assert jax.config.jax_disable_jit and jax.config.jax_default_matmul_precision == "highest"
        assert not jax.sharding.get_abstract_mesh().empty
    texts = [exe.as_text() for exe in llm.engine.runner.compiled.values()]
    assert texts and not any(re.search(r"operand_precision=\{highest", t) for t in texts)


def test_a_refused_stream_leaves_the_running_streams_aborts(llm):
    """Another thread's stream, refused (one thread at a time), does not drop the running stream's aborts."""
    import threading
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    errors, final = [], {}

    def other():
        try:
            list(llm.stream([[1, 2]], sp))
        except RuntimeError as e:
            errors.append(e)
    for k, d in enumerate(llm.stream([[5, 6, 7], [9, 8]], sp)):
        if k == 0:
            llm.abort(1)
            t = threading.Thread(target=other)
            t.start()
            t.join()
        if d.finished:
            final[d.request_id] = d.finish_reason
    assert len(errors) == 1 and final == {0: "length", 1: "abort"}
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_one_llm_serves_one_thread_at_a_time(llm):
    """A second thread calling generate while another is inside a stream gets a RuntimeError (not mixed-up
    batches); the same thread may nest calls, and once the stream ends another thread may go on."""
    import threading
    sp = SamplingParams(temperature=0, max_tokens=4)
    want = llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].token_ids
    it = llm.stream([[1, 2, 3]], SamplingParams(max_tokens=8, ignore_eos=True))
    next(it)                                                                   # this thread is inside a stream
    assert llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].token_ids == want    # nested on the same thread

    def other(out):
        try:
            out.append(llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].token_ids)
        except RuntimeError as e:
            out.append(e)
    out = []
    t = threading.Thread(target=other, args=(out,))
    t.start(), t.join()
    assert isinstance(out[0], RuntimeError) and "unfinished LLM.stream begun on another thread" in str(out[0])
    it.close()
    t = threading.Thread(target=other, args=(out,))
    t.start(), t.join()
    assert out[1] == want
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"]


def test_a_stream_handed_to_another_thread_holds_the_llm_there(llm):
    """A begun stream may go on on another thread (a web framework's thread pool runs each `next` on any of its
    threads). Meanwhile other threads are refused, the one that began it too (both stepping the engine at once gave
    wrong tokens), and the stream's tokens are a lone run's."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    ps, sp = [[1, 2, 3], [9, 8, 7, 6]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]

    def collect(deltas):
        got = {0: [], 1: []}
        for d in deltas:
            got[d.request_id] += d.outputs[0].token_ids
        return [got[0], got[1]]
    it, errors, box = llm.stream(ps, sp), [], {}
    first = next(it)                                            # begun on this thread

    def rest():
        for k, d in enumerate(it):
            box.setdefault("deltas", [first]).append(d)
            if k == 0:
                try:
                    llm.generate(ps, sp, use_tqdm=False)        # (nested, on the thread it moved to)
                except RuntimeError as e:
                    errors.append(e)
    t = threading.Thread(target=rest)
    t.start()
    t.join()
    assert errors == [] and collect(box["deltas"]) == want      # nested on the stream's new thread: allowed

    it, box = llm.stream(ps, sp), {}
    next_box = [next(it)]
    t = threading.Thread(target=lambda: box.update(d=next(it)))
    t.start(), t.join()
    with pytest.raises(RuntimeError, match="another thread"):   # it moved: main is another thread now
        llm.generate(ps, sp, use_tqdm=False)
    assert collect(next_box + [box["d"], *it]) == want          # main takes it back (no call runs) and ends it

    it = llm.stream(ps, sp)
    with ThreadPoolExecutor(4) as pool:                         # each delta on any thread of the pool
        deltas = []
        while (d := pool.submit(next, it, None).result()) is not None:
            deltas.append(d)
    assert collect(deltas) == want
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"] and st["running"] == st["waiting"] == 0


def test_abort_reaches_the_outer_stream_after_a_nested_one_ended_or_was_dropped(llm):
    sp = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)    # (room for K-step calls: GPU defaults)
    for nested in ("ended", "dropped", "dropped begun"):
        final = {}
        for k, d in enumerate(llm.stream([[5, 6, 7], [9, 8]], sp)):
            if k == 1:
                inner = llm.stream([[4, 4]], SamplingParams(max_tokens=1, ignore_eos=True))
                if nested == "ended":
                    list(inner)
                elif nested == "dropped begun":
                    next(inner)
                del inner
                llm.abort(0)
            if d.finished:
                final[d.request_id] = d.finish_reason
        assert final == {0: "abort", 1: "length"}, nested
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"] and st["running"] == st["waiting"] == 0


def test_a_dropped_begun_stream_frees_the_llm_for_other_threads(llm):
    import threading
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    it = llm.stream([[5, 6, 7], [1, 2]], sp)
    next(it)
    del it
    out = []
    t = threading.Thread(target=lambda: out.append(llm.generate([[5, 6, 7]], sp, use_tqdm=False)))
    t.start(), t.join()
    assert len(out) == 1
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"] and st["running"] == st["waiting"] == 0


def test_a_generate_inside_a_stream_loses_none_of_the_stream(llm):
    """A generate (or a second stream) run on the same thread while a stream waits steps the engine for the stream's
    requests too: the stream still yields all of their tokens, each request's final delta once, and its text equals
    generate's."""
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ps = [[1, 2, 3], [9, 8, 7, 6]]
    want = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
    for inner in ("generate", "stream"):
        it = llm.stream(ps, sp)
        got, finals = {0: [], 1: []}, []
        d = next(it)
        got[d.request_id] += d.outputs[0].token_ids
        nested = SamplingParams(max_tokens=30, ignore_eos=True)
        if inner == "generate":                         # runs past the stream's 6 tokens: both of them finish in it
            llm.generate([[4, 4]], nested, use_tqdm=False)
        else:
            assert sum(len(x.outputs[0].token_ids) for x in llm.stream([[4, 4]], nested)) == 30
        for d in it:
            got[d.request_id] += d.outputs[0].token_ids
            if d.outputs[0].finish_reason:
                finals.append(d.request_id)
        assert [got[0], got[1]] == want and sorted(finals) == [0, 1], inner
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"]


def test_vllm_options_a_ported_script_passes(tiny_dir, llm):
    """vLLM's trust_remote_code / enforce_eager / disable_log_stats / swap_space mean nothing here and are
    accepted (checked by type); tokenizer= loads that folder's; a dict with both prompt forms uses the ids (as
    vLLM); CompletionOutput.finished() is a method as in vLLM and RequestOutput.finished an attribute."""
    other = LLM(tiny_dir, trust_remote_code=True, enforce_eager=True, disable_log_stats=True, swap_space=4,
                tokenizer=tiny_dir, **BASE)
    sp = SamplingParams(temperature=0, max_tokens=4)
    out = other.generate({"prompt": "shown", "prompt_token_ids": [5, 6, 7]}, sp, use_tqdm=False)[0]
    assert out.prompt == "shown" and out.prompt_token_ids == [5, 6, 7]
    assert out.token_ids == llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].token_ids
    assert out.finished and out.outputs[0].finished() is True and out.outputs[0].finished
    with pytest.raises(ValueError, match="enforce_eager='yes'"):
        LLM(tiny_dir, enforce_eager="yes", **BASE)
    with pytest.raises(ValueError, match="swap_space=-1 must be >= 0"):
        LLM(tiny_dir, swap_space=-1, **BASE)
    with pytest.raises(ValueError, match="tokenizer='/nowhere'"):
        LLM(tiny_dir, tokenizer="/nowhere", **BASE)
    llm.abort("3")                          # vLLM's request ids are strings
    with pytest.raises(ValueError, match="request_id must be an int"):
        llm.abort("x")


def test_detokenize_false_and_truncated_prompts(llm):
    """vLLM's detokenize=False (token ids only, text "") and truncate_prompt_tokens (the prompt's last k tokens,
    also past max_model_len), in generate and stream."""
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    full = llm.generate([[5, 6, 7, 8, 9]], sp, use_tqdm=False)[0]
    ids = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                         detokenize=False), use_tqdm=False)[0]
    assert ids.token_ids == full.token_ids and ids.text == "" and full.text
    streamed = list(llm.stream([[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                                  detokenize=False)))
    assert "".join(d.outputs[0].text for d in streamed) == "" and sum(len(d.outputs[0].token_ids) for d in streamed) == 4
    cut = llm.generate([[1, 2, 3, 5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                                 truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert cut.prompt_token_ids == [5, 6, 7, 8, 9] and cut.token_ids == full.token_ids
    long = llm.generate([list(range(1, 300))], SamplingParams(max_tokens=2, truncate_prompt_tokens=100),
                        use_tqdm=False)[0]
    assert long.prompt_token_ids == list(range(200, 300)) and len(long.token_ids) == 2


def test_num_cached_tokens_is_set_at_first_admission(tiny_dir):
    """RequestOutput.num_cached_tokens counts prompt tokens served from the prefix cache when the request was first
    scheduled (vLLM's); a preempted request that comes back finds its own blocks, which do not count (it was 16
    on a 9-token prompt). The stats' hit counter still counts every admission's hits."""
    import random
    llm = LLM(tiny_dir, **{**BASE, "num_kvcache_blocks": 16, "max_model_len": 128})
    random.seed(3)
    ps = [[random.randrange(3, 500) for _ in range(9)] for _ in range(2)]
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    st = llm.stats()
    assert st["preemptions"] >= 1 and [o.num_cached_tokens for o in outs] == [0, 0]
    assert st["prefix_cache_hit_tokens"] > 0 and st["kv_blocks_free"] == st["kv_blocks_total"]
    again = llm.generate(ps[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert again.num_cached_tokens == 8                   # the first prompt's two full blocks, cached


@pytest.mark.parametrize("at_call, params", [
    (1, SamplingParams(temperature=0, max_tokens=12)),                       # the prefill step
    (3, SamplingParams(temperature=0.8, seed=5, max_tokens=12)),             # a decode step
    (2, SamplingParams(temperature=0.8, seed=5, max_tokens=12, logprobs=2, presence_penalty=0.5)),   # extras' step
])
def test_an_interrupt_inside_a_step_call_leaves_the_llm_usable(tiny_dir, at_call, params):
    """Ctrl-C can land after a step call consumed its donated buffers (KV pages, ids) but before its outputs were
    kept: the next call must allocate them again and recompute what was lost, not fail on deleted buffers. A
    sequence taken off the waiting queue but not yet running when the interrupt came can be aborted too."""
    llm = LLM(tiny_dir, **BASE)
    prompts = [[5, 6, 7, 8, 9], [3, 1, 4, 1, 5, 9, 2, 6]]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    runner = llm.engine.runner
    old = (runner.kv_caches[0][0], runner.last_ids)
    interrupt_at_call((runner, llm.engine.extras), at_call)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params, use_tqdm=False)
    del runner.compile, llm.engine.extras.compile
    assert old[0].is_deleted() or old[1].is_deleted()        # what the interrupted call took: made again
    assert not (runner.kv_caches[0][0].is_deleted() or runner.last_ids.is_deleted())
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"] and st["running"] == st["waiting"] == 0
    seq = llm.engine.add_request([5, 6, 7], SamplingParams(max_tokens=3))
    llm.engine.scheduler.waiting.remove(seq)          # taken off the queue, never added to the running one
    llm.engine.abort(seq)
    assert llm.stats()["kv_blocks_free"] == st["kv_blocks_total"]


def test_a_presets_random_weights_ignore_the_users_prng_settings():
    import jax
    import numpy as np
    tiny = {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 512}

    def weights():
        llm = LLM("qwen3-0.6b", hf_overrides=tiny, attn_backend="xla", max_num_seqs=2, max_model_len=64, seed=0,
                  warmup=False)
        return [np.asarray(w) for w in jax.tree.leaves(llm.engine.runner.params)]
    want = weights()
    impl, part = jax.config.jax_default_prng_impl, jax.config.jax_threefry_partitionable
    try:
        jax.config.update("jax_default_prng_impl", "rbg")
        jax.config.update("jax_threefry_partitionable", not part)
        got = weights()
    finally:
        jax.config.update("jax_default_prng_impl", impl)
        jax.config.update("jax_threefry_partitionable", part)
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))
    llm = LLM("qwen3-0.6b", hf_overrides=tiny, attn_backend="xla", max_num_seqs=2, max_model_len=64, seed=2**64 + 5,
              warmup=False)                     # any int seed (as a checkpoint's engine takes)
    assert len(llm.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False)[0].token_ids) == 2


def test_a_delta_is_not_lost_to_an_interrupt_at_the_end_of_its_next(llm):
    """Ctrl-C landing in the call's exit after the stream produced a delta: the delta comes with the next `next`
    (a notebook re-running its loop gets every token)."""
    import sys
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].outputs[0].token_ids
    for at in (2, 6):
        it, got, seen = llm.stream([[5, 6, 7]], sp), [], [0]

        def local(frame, event, arg):
            if event == "line" and frame.f_code.co_name == "__call__" and "yield" not in str(frame.f_lineno):
                import linecache
                if "self._calls.discard(call)" in linecache.getline(frame.f_code.co_filename, frame.f_lineno):
                    seen[0] += 1
                    if seen[0] == at:
                        sys.settrace(None)
                        raise KeyboardInterrupt
            return local
        sys.settrace(lambda f, e, a: local if f.f_code.co_filename.endswith("one_thread.py") else None)
        try:
            with pytest.raises(KeyboardInterrupt):
                for d in it:
                    got += d.outputs[0].token_ids
        finally:
            sys.settrace(None)
        got += [t for d in it for t in d.outputs[0].token_ids]
        assert got == want, at
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"] and st["running"] == st["waiting"] == 0
