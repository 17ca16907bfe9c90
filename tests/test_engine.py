"""End to end on tiny checkpoints (fp32): the engine equals transformers, and a sequence's output does not
depend on its batch neighbours, chunking, prefix-cache hits or preemption. Every run returns all blocks."""
import gc
import os
import weakref

import numpy as np
import pytest
from helpers import TINY_ENGINE, hf_greedy, hf_model

from jaxinfer import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
BASE = TINY_ENGINE


def prompts(vocab, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def tokens(llm, ps, sp=GREEDY):
    outs = llm.generate(ps, sp, use_tqdm=False)
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"], st
    assert st["running"] == st["waiting"] == 0
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("name", ["gqa1_tied", "gqa2", "gqa4_wide_head"])
def test_greedy_equals_transformers(tiny_dirs, name):
    llm = LLM(tiny_dirs[name], **BASE)
    ps = prompts(llm.model_config.vocab_size, [1, 5, 17, 40])
    ours = tokens(llm, ps)
    ref = hf_model(tiny_dirs[name])
    for p, o in zip(ps, ours):
        assert o == hf_greedy(ref, p, 12), f"prompt of {len(p)} tokens"


@pytest.fixture(scope="module")
def alone(tiny_dir):
    """Reference: each prompt generated on its own."""
    llm = LLM(tiny_dir, **BASE)
    ps = prompts(512, [3, 9, 16, 23, 30, 41])
    shared = ps[4][:20]
    ps += [ps[4], shared + [5, 6, 7], ps[4] + [8, 9], ps[2]]   # repeats, shared prefix, prefix-of
    return ps, [tokens(llm, [p])[0] for p in ps]


def test_batch_neighbours_do_not_matter(tiny_dir, alone):
    ps, ref = alone
    llm = LLM(tiny_dir, **BASE)
    assert tokens(llm, ps) == ref
    assert tokens(llm, ps[::-1]) == ref[::-1]


def test_stats_and_config_give_the_sizes_on_one_device(tiny_dir):
    """stats() has the same keys at every size (dp = 1: one replica, itself); config holds the pool as sized."""
    llm = LLM(tiny_dir, **{**BASE, "num_kvcache_blocks": None})
    st = llm.stats()
    assert (st["data_parallel_size"], st["tensor_parallel_size"], len(st["replicas"])) == (1, 1, 1)
    assert st["replicas"][0]["kv_blocks_total"] == st["kv_blocks_total"] == llm.config.num_kvcache_blocks > 0


def test_chunked_prefill(tiny_dir, alone):
    ps, ref = alone
    llm = LLM(tiny_dir, **{**BASE, "max_num_batched_tokens": 8, "prefill_buckets": (8,), "enable_prefix_caching": False})
    assert tokens(llm, ps) == ref
    assert llm.stats()["prefill_steps"] > sum(len(p) for p in ps) // 8


def test_prefix_cache_hits(tiny_dir, alone):
    ps, ref = alone
    llm = LLM(tiny_dir, **BASE)
    assert tokens(llm, ps) == ref                      # repeats within one call
    assert llm.stats()["prefix_cache_hit_tokens"] > 0
    before = llm.stats()["prefix_cache_hit_tokens"]
    assert tokens(llm, ps[:3]) == ref[:3]              # a later call hits blocks freed by the first
    assert llm.stats()["prefix_cache_hit_tokens"] - before >= 4 * 2


def test_prefix_caching_off_gives_same_tokens(tiny_dir, alone):
    ps, ref = alone
    llm = LLM(tiny_dir, **{**BASE, "enable_prefix_caching": False})
    assert tokens(llm, ps) == ref and llm.stats()["prefix_cache_hit_tokens"] == 0


def test_preemption(tiny_dir, alone):
    ps, ref = alone
    llm = LLM(tiny_dir, **{**BASE, "num_kvcache_blocks": 24})
    assert tokens(llm, ps) == ref
    assert llm.stats()["preemptions"] > 0


@pytest.mark.parametrize("chunk,opts", [(8, {"num_kvcache_blocks": 24}), (12, {}), (4, {"max_num_seqs": 3}),
                                        (256, {"block_size": 16, "num_kvcache_blocks": 64})])
def test_xla_chunked_decode_over_flat_tables(tiny_dir, alone, monkeypatch, chunk, opts):
    """The xla decode in chunks of a few pages over flat tables whose per-row budgets are narrower than the
    longest rows (decode_context_buckets 8 / 16 tokens): with preemption (a 24-block pool), chunks of 3 pages,
    1-page chunks with rows queued behind others, and 16-token blocks. Shared prefixes put the same blocks in
    several rows' tables. Same tokens as each prompt alone."""
    import jaxinfer.model.xla_decode as xd
    monkeypatch.setattr(xd, "DECODE_CHUNK", chunk)
    ps, ref = alone
    llm = LLM(tiny_dir, **{**BASE, "attn_backend": "xla", "decode_context_buckets": (8, 16), **opts})
    assert tokens(llm, ps) == ref
    if opts.get("num_kvcache_blocks") == 24:
        assert llm.stats()["preemptions"] > 0


def test_block_size_one_and_sixteen(tiny_dir, alone):
    ps, ref = alone
    for bs in (1, 16):
        llm = LLM(tiny_dir, **{**BASE, "block_size": bs, "num_kvcache_blocks": 1024 // bs})
        assert tokens(llm, ps[:4]) == ref[:4], bs


def test_seeded_sampling_ignores_neighbours(tiny_dir):
    llm = LLM(tiny_dir, **BASE)
    ps = prompts(512, [5, 11, 7], seed=1)
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=1234, ignore_eos=True)
    other = SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True)
    alone = tokens(llm, [ps[1]], sp)[0]
    mixed = tokens(llm, ps, [other, sp, other])[1]
    assert alone == mixed
    assert tokens(llm, [ps[1]], SamplingParams(**{**sp.__dict__, "seed": 99}))[0] != alone


def test_filtered_sampling_runs_the_step_then_resample(tiny_dir):
    """top-k / top-p / min-p run the bucket's one model program, then a small "resample" program on its sampled
    rows (no filtered copy of the model step is compiled). top_k=1 and min_p=1 keep only the top token, so a hot
    temperature must still give the greedy tokens (the plain step's draw would not), in prefill and decode,
    beside an unfiltered neighbour whose seeded draw is unchanged by it."""
    llm = LLM(tiny_dir, **BASE)
    ps = prompts(512, [5, 11, 7], seed=3)
    greedy = tokens(llm, ps)
    hot = dict(temperature=5.0, max_tokens=12, ignore_eos=True, seed=7)
    plain = SamplingParams(**hot)
    assert tokens(llm, ps, SamplingParams(**hot, top_k=1)) == greedy
    assert tokens(llm, ps, SamplingParams(**hot, min_p=1.0)) == greedy
    alone = tokens(llm, ps[1:2], plain)[0]
    assert alone != greedy[1]                                          # the hot draw is not greedy
    mixed = tokens(llm, ps, [SamplingParams(**hot, top_k=1), plain, SamplingParams(**hot, top_p=1e-6)])
    assert mixed == [greedy[0], alone, greedy[2]]
    runner = llm.engine.runner
    model_steps = [k for k in runner.compiled if k[0] in ("prefill", "decode")]
    assert model_steps and not any(k[4] for k in model_steps)
    assert any(k[0] == "resample" for k in runner.compiled)


def test_small_top_k_batches_skip_the_sort_with_the_same_tokens(tiny_dir):
    """Batches whose filtering rows all have a small top_k (Qwen3's generation config: top_k=20, top_p=0.95) run
    the "top_k" resample program, with no sort; a row draws the same tokens there as beside a top_p-only
    neighbour, whose batch sorts."""
    llm = LLM(tiny_dir, **BASE)
    ps = prompts(512, [5, 11], seed=4)
    hot = dict(temperature=1.5, max_tokens=12, ignore_eos=True)
    qwen = SamplingParams(**hot, top_k=20, top_p=0.95, seed=3)
    alone = tokens(llm, ps[:1], qwen)[0]
    runner = llm.engine.runner
    assert {k[4] for k in runner.compiled if k[0] == "resample"} == {"top_k"}
    beside = tokens(llm, ps, [qwen, SamplingParams(**hot, top_p=0.9, seed=5)])[0]
    assert beside == alone and True in {k[4] for k in runner.compiled if k[0] == "resample"}


def test_large_decode_buckets_draw_small_top_k_inside_the_step(tiny_dir, monkeypatch):
    """Decode buckets of TOP_K_STEP_MIN_ROWS rows or more compile a "top_k_only" step: a batch whose rows are all
    greedy or have a small top_k draws inside it from their candidates (no plain draw, no resample program). A
    row's tokens are those of the step + resample path (beside a plain-sampled or a top_p-only neighbour), and a
    greedy neighbour's are its greedy tokens."""
    from jaxinfer.engine import runner as runner_mod
    monkeypatch.setattr(runner_mod, "TOP_K_STEP_MIN_ROWS", 1)
    llm = LLM(tiny_dir, **{**BASE, "attn_backend": "pallas", "num_scheduler_steps": 1})   # (xla: no such step)
    runner = llm.engine.runner
    assert {k for k in runner.buckets() if k[0] == "decode" and k[4]} == runner.direct_steps != set()
    assert {k[4] for k in runner.direct_steps} == {"top_k_only"}
    ran = []
    compile_ = runner.compile
    monkeypatch.setattr(runner, "compile", lambda key, *a: ran.append(key) or compile_(key, *a))
    ps = prompts(512, [5, 11, 8], seed=6)
    hot = dict(temperature=1.5, max_tokens=12, ignore_eos=True)
    qwen, plain = SamplingParams(**hot, top_k=20, top_p=0.95, seed=3), SamplingParams(**hot, seed=4)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    direct = tokens(llm, ps[:2], [qwen, greedy])
    assert any(k[0] == "decode" and k[4] == "top_k_only" for k in ran)
    assert direct[1] == tokens(llm, ps[1:2], greedy)[0]
    ran.clear()
    with_plain = tokens(llm, ps[:2], [qwen, plain])            # a plain-sampled row: step + "top_k" resample
    assert not any(k[4] == "top_k_only" for k in ran) and ("resample", 8, 8, 0, "top_k") in ran
    assert with_plain[0] == direct[0] and with_plain[1] == tokens(llm, ps[1:2], plain)[0]
    beside = tokens(llm, ps, [qwen, SamplingParams(**hot, top_p=0.9, seed=5), plain])    # sorted
    assert beside[0] == direct[0] and beside[2] == tokens(llm, ps[2:], plain)[0]


def test_no_compilation_after_warmup(tiny_dir):
    gc.unfreeze()
    llm = LLM(tiny_dir, **{**BASE, "warmup": True})
    assert llm.stats()["compilations"] == 0
    assert gc.get_freeze_count() == 0     # the collector is process-wide: LLM() leaves it alone (the server's engine
    #                                       process freezes it: server/core.freeze_gc)
    ps = prompts(512, [1, 2, 7, 33, 60, 90, 100, 3, 4], seed=2)
    tokens(llm, ps, SamplingParams(temperature=0.7, top_k=5, max_tokens=20))
    tokens(llm, ps[:1], SamplingParams(temperature=0, max_tokens=27, ignore_eos=True))
    assert llm.stats()["compilations"] == 0
    runner = weakref.ref(llm.engine.runner)
    del llm
    gc.collect()
    assert runner() is None          # frozen objects are still freed: a deleted engine's KV cache goes back


def test_warmups_second_pass_skips_programs_with_a_long_first_run(tiny_dir, monkeypatch):
    """Warm-up runs every program once while others compile, then again (run_idle), except those whose first run
    took SECOND_RUN_MAX_S or more (the xla backend's widest steps took seconds each)."""
    from jaxinfer.engine import runner as runner_mod
    llm = LLM(tiny_dir, **{**BASE, "warmup": True})
    r = llm.engine.runner
    assert set(r._first_run_s) == set(r.compiled) and all(t > 0 for t in r._first_run_s.values())
    slow, *rest = list(r.compiled)
    r._first_run_s[slow] = runner_mod.SECOND_RUN_MAX_S
    r._ran.clear()
    calls = []
    monkeypatch.setattr(r, "run_once", calls.append)
    r.run_idle()
    assert calls == rest


def test_executable_cache_shares_live_programs_and_forgets_dropped_ones():
    """Engines share compiled steps (the second engine of a size starts at once), yet LLMs made and dropped one
    after another do not keep every program they compiled (a sweep of options ran the process out of memory
    mappings): the cache holds what live engines hold, and only the `keep` most recently used besides."""
    from types import SimpleNamespace
    from jaxinfer.engine.executables import ExecutableCache

    class Exe:        # stands for a jax Compiled (weak-referenceable)
        pass
    cache, builds, dev = ExecutableCache(keep=2), [], [SimpleNamespace(id=0)]
    build = lambda: builds.append(1) or Exe()                           # noqa: E731
    held = cache.get(("a",), dev, build)                                # an engine holds this one
    assert cache.get(("a",), dev, build) is held and len(builds) == 1
    dropped = weakref.ref(cache.get(("b",), dev, build))               # an engine that went away
    for k in "cde":                                                     # more recent programs push it out
        cache.get((k,), dev, build)
    gc.collect()
    assert dropped() is None and len(builds) == 5
    assert cache.get(("a",), dev, build) is held and len(builds) == 5   # still held by its engine: shared
    cache.get(("b",), dev, build)
    assert len(builds) == 6                                             # compiled again when wanted again


def test_compilations_count_only_the_engines_own(tiny_dir):
    """A user's own jitted code and a second LLM's compilations are not the first engine's (stats() counted every
    compilation in the process)."""
    import jax
    import jax.numpy as jnp
    llm = LLM(tiny_dir, **BASE)                      # (warmup=False: requests compile lazily, and count)
    tokens(llm, ["a b c"], SamplingParams(temperature=0, max_tokens=3))
    before = llm.stats()["compilations"]
    jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.ones(7)).block_until_ready()
    other = LLM(tiny_dir, **{**BASE, "max_num_seqs": 5, "max_num_batched_tokens": 76})   # shapes no other test uses
    tokens(other, ["a b c"], SamplingParams(temperature=0, max_tokens=3))
    assert other.stats()["compilations"] > 0
    assert llm.stats()["compilations"] == before


def test_generation_config_gives_the_default_sampling_params(tiny_dir, tmp_path):
    """As vLLM: generate() without sampling params uses the checkpoint's recommended values (the file's difference
    from the installed transformers' GenerationConfig defaults, as vLLM reads it: transformers 5 has none, so a
    top_k of 50 counts); generation_config="vllm" ignores them; override_generation_config is merged over them;
    a bad value is refused."""
    import json
    import shutil
    from transformers import GenerationConfig
    from jaxinfer.generation_config import FIELDS, sampling_defaults
    d = str(tmp_path / "ckpt")
    shutil.copytree(tiny_dir, d)
    with open(os.path.join(d, "generation_config.json")) as f:
        gen = json.load(f)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({**gen, "temperature": 0.0, "top_k": 50, "top_p": 0.9, "max_new_tokens": 5}, f)
    diff = GenerationConfig.from_pretrained(d).to_diff_dict()              # what vLLM reads
    want = {("max_tokens" if k == "max_new_tokens" else k): diff[k] for k in FIELDS if diff.get(k) is not None}
    assert sampling_defaults(d) == want and {"temperature": 0.0, "top_p": 0.9, "max_tokens": 5}.items() <= want.items()
    assert sampling_defaults(d, "vllm") == {} and sampling_defaults(tiny_dir) == {}
    llm = LLM(d, **BASE)
    assert llm.get_default_sampling_params() == SamplingParams(**want)
    over = LLM(d, override_generation_config={"top_p": 0.5, "max_new_tokens": 7}, **BASE)
    assert over.get_default_sampling_params() == SamplingParams(**{**want, "top_p": 0.5, "max_tokens": 7})
    only = LLM(d, generation_config="vllm", override_generation_config={"temperature": 0.2}, **BASE)
    assert only.get_default_sampling_params() == SamplingParams(temperature=0.2)
    with pytest.raises(ValueError, match="override_generation_config"):
        LLM(d, override_generation_config={"beams": 2}, **BASE)
    out = llm.generate(["Hello world"])[0].outputs[0]
    greedy = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
    assert out.token_ids == greedy.token_ids and len(out.token_ids) <= 5
    assert LLM(d, generation_config="vllm", **BASE).get_default_sampling_params() == SamplingParams()
    with pytest.raises(ValueError, match="generation_config='nowhere'"):
        LLM(d, generation_config="nowhere", **BASE)
    # a broken generation_config.json is named (not valid JSON, not an object), unless "vllm" ignores it
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    for text, why in (("{", "not valid JSON"), ("[1, 2]", "must hold a JSON object")):
        (broken / "generation_config.json").write_text(text)
        with pytest.raises(ValueError, match=why):
            LLM(str(broken), **BASE)
        with pytest.raises(ValueError, match=why):
            LLM(tiny_dir, generation_config=str(broken), **BASE)
        assert LLM(str(broken), generation_config="vllm", **BASE).get_default_sampling_params() == SamplingParams()
    # a folder's eos_token_id ends generation too (vLLM adds it to the stop ids), reported as the stop_reason
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [greedy.token_ids[2]]}))
    out = LLM(d, generation_config=str(folder), **BASE).generate(["Hello world"], SamplingParams(
        temperature=0, max_tokens=5))[0].outputs[0]
    k = greedy.token_ids.index(greedy.token_ids[2])
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (greedy.token_ids[:k + 1], "stop",
                                                                   greedy.token_ids[2])


def test_stop_strings_and_eos(tiny_dir):
    llm = LLM(tiny_dir, **BASE)
    p = "Hello world"
    full = llm.generate(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    assert len(full.text) > 4
    stop = full.text[2:4]
    cut = llm.generate(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.find(stop)]
    eos_tok = full.token_ids[3]
    stopped = llm.generate(p, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[eos_tok]),
                           use_tqdm=False)[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == eos_tok
    assert stopped.token_ids == full.token_ids[:full.token_ids.index(eos_tok) + 1]
    # as vLLM: the stop token's id is kept, its text is not; streamed deltas say the same
    tok = llm.get_tokenizer()
    assert stopped.text == tok.decode(stopped.token_ids[:-1], skip_special_tokens=True) != full.text
    sp = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[eos_tok], stop=["no such stop"])
    for params in (sp, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[eos_tok])):
        deltas = list(llm.stream(p, params))
        assert "".join(d.text for d in deltas) == stopped.text, params
    assert llm.generate(p, sp, use_tqdm=False)[0].text == stopped.text
    raw = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[eos_tok], skip_special_tokens=False)
    assert llm.generate(p, raw, use_tqdm=False)[0].text == tok.decode(stopped.token_ids[:-1])   # (also for EOS)
    # vLLM's stop_reason: the matched stop string, the stop_token_ids entry, None for length (and EOS)
    assert cut.outputs[0].stop_reason == stop and stopped.outputs[0].stop_reason == eos_tok
    assert full.outputs[0].stop_reason is None and full.finish_reason == "length"
    last = [d for d in llm.stream(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))][-1]
    assert last.finish_reason == "stop" and last.outputs[0].stop_reason == stop
    # include_stop_str_in_output (vLLM): the stop string, or the stop token's text, stays in the text
    inc = dict(temperature=0, max_tokens=24, include_stop_str_in_output=True)
    kept = llm.generate(p, SamplingParams(**inc, ignore_eos=True, stop=[stop]), use_tqdm=False)[0]
    assert kept.text == full.text[:full.text.find(stop) + len(stop)] and kept.token_ids == cut.token_ids
    assert "".join(d.text for d in llm.stream(p, SamplingParams(**inc, ignore_eos=True, stop=[stop]))) == kept.text
    kept = llm.generate(p, SamplingParams(**inc, stop_token_ids=[eos_tok]), use_tqdm=False)[0]
    assert kept.text == tok.decode(stopped.token_ids, skip_special_tokens=True)
    with pytest.raises(ValueError, match="include_stop_str_in_output"):
        SamplingParams(include_stop_str_in_output="yes")
    with pytest.raises(ValueError, match="skip_special_tokens"):
        SamplingParams(skip_special_tokens=None)
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_dict_prompts(tiny_dir):
    """vLLM's prompt dicts: {"prompt": text} and {"prompt_token_ids": ids}, alone or in a list; anything else is
    refused by name."""
    llm = LLM(tiny_dir, **BASE)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = llm.get_tokenizer().encode("Hello world", add_special_tokens=False)
    plain = llm.generate(["Hello world", ids], sp, use_tqdm=False)
    dicts = llm.generate([{"prompt": "Hello world"}, {"prompt_token_ids": ids}], sp, use_tqdm=False)
    assert [o.token_ids for o in dicts] == [o.token_ids for o in plain]
    assert dicts[0].prompt == "Hello world" and dicts[1].prompt is None and dicts[1].prompt_token_ids == ids
    assert llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)[0].token_ids == plain[1].token_ids
    with pytest.raises(ValueError, match=r"prompt 1: a dict prompt .* got keys \['text'\]"):
        llm.generate(["Hello", {"text": "x"}], sp, use_tqdm=False)
    for bad, named in (({"prompt": 5}, "'prompt' = 5"), ({"prompt_token_ids": "abc"}, "'prompt_token_ids' = 'abc'")):
        with pytest.raises(ValueError, match=f"prompt 0: a dict prompt .* got {named}"):
            llm.generate(bad, sp, use_tqdm=False)
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_pallas_backend_equals_xla(tiny_dir, alone):
    """The Pallas kernels (interpret mode on CPU) give the same greedy tokens as the XLA path (the decode kernel
    picks each layer's q/k norm row out of the stacked weights)."""
    ps, ref = alone
    llm = LLM(tiny_dir, **{**BASE, "attn_backend": "pallas", "block_size": 16, "num_kvcache_blocks": 64})
    assert tokens(llm, ps[:6]) == ref[:6]


def test_long_context_decode_splits(tiny_dir, alone, monkeypatch):
    """Decode programs with wide tables cut rows by their share of the batch's context (balanced splits, up to
    what the grid and the partials budget allow): the same greedy tokens."""
    from jaxinfer.model import attention
    tiles = lambda width, rows: attention.long_decode_tiles(width, rows, 4, 2, 32, np.array([5])).get("num_splits")
    assert tiles(4096, 8) is None and tiles(8192, 8) == 64 and tiles(8192, 32) == 16 and tiles(8192, 256) == 2
    monkeypatch.setattr(attention, "PARTIALS_BUDGET", 1 << 14)
    assert tiles(8192, 8) == 4 and tiles(8192, 256) == 1
    monkeypatch.setattr(attention, "LONG_DECODE_TOKENS", 16)       # the tiny model's tables count as wide
    monkeypatch.setattr(attention, "PARTIALS_BUDGET", 1 << 20)
    ps, ref = alone
    llm = LLM(tiny_dir, **{**BASE, "attn_backend": "pallas"})
    assert tokens(llm, ps[:6]) == ref[:6]


def test_sync_scheduling_gives_same_tokens(tiny_dir, alone):
    """Async scheduling (step N+1 packed while N runs, tokens fed on device) changes nothing."""
    ps, ref = alone
    llm = LLM(tiny_dir, **{**BASE, "async_scheduling": False})
    assert tokens(llm, ps) == ref


def test_xla_prefill_chunks_under_a_memory_budget():
    """The chunked (lax.map) xla prefill equals the one-shot one."""
    import jax.numpy as jnp

    from jaxinfer.model.attention import prefill_xla
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((12, 4, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((12, 4, 2, 8)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((24, 4, 8)), jnp.float32)
    tables = jnp.asarray(rng.permutation(12)[:12].reshape(3, 4), jnp.int32)
    cu, lens = jnp.array([0, 5, 16, 20], jnp.int32), jnp.array([9, 16, 4], jnp.int32)   # prefixes, padding
    whole = prefill_xla(q, k, v, tables, cu, lens)
    per_token = 2 * 16 * 2 * 8 * 4
    chunked = prefill_xla(q, k, v, tables, cu, lens, gather_budget_bytes=5 * per_token)  # chunks of 4
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(whole), atol=1e-6, rtol=1e-6)
    assert float(jnp.abs(whole[20:]).max()) == 0.0


def test_yarn_model_equals_transformers_past_its_original_length(tmp_path):
    """A YaRN checkpoint (Qwen3's long-context setting, scaled down: 32 trained positions, factor 4): prompts and
    decoded tokens past position 32 equal transformers' greedy tokens (pallas: the prefill kernel and the decode
    kernel, which rotates q/k itself, get the same tables as the xla path), and max_model_len may reach 4 x 32."""
    backend = "pallas"
    from helpers import make_tiny_model
    path = make_tiny_model(str(tmp_path / "m"), max_position_embeddings=64, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
    llm = LLM(path, **{**BASE, "attn_backend": backend})
    assert llm.config.max_model_len == 128
    ps = prompts(llm.model_config.vocab_size, [5, 30, 70])
    ref = hf_model(path)
    for p, o in zip(ps, tokens(llm, ps)):
        assert o == hf_greedy(ref, p, 12), f"prompt of {len(p)} tokens"
