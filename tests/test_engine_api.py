"""`llm.llm_engine`: vLLM's LLMEngine loop (add_request(request_id, prompt, params), step() -> RequestOutputs,
abort_request, has_unfinished_requests) gives what `generate` gives, in each output kind."""
import pytest
from helpers import TINY_ENGINE

from jaxinfer import LLM, SamplingParams, TokensPrompt

PROMPTS = ["Hello there", [5, 6, 7, 8, 9], TokensPrompt(prompt_token_ids=[11, 12, 13])]


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, **{**TINY_ENGINE, "max_num_seqs": 4})


def run(eng, params_of, ids=("a", "b", "c"), prompts=PROMPTS) -> dict:
    """Add a request per prompt, step until done; request_id -> list of its outputs."""
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, p, params_of(rid))
    seen = {rid: [] for rid in ids}
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen[out.request_id].append(out)
    return seen


def free(llm):
    s = llm.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"]


def test_the_vllm_loop_gives_generate_outputs(llm):
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=6, n=2, logprobs=2, prompt_logprobs=1, stop=[" the"])
    ref = llm.generate(PROMPTS, params, use_tqdm=False)
    seen = run(llm.llm_engine, lambda rid: params)
    for rid, r in zip("abc", ref):
        outs = seen[rid]
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert outs[-1].request_id == rid and outs[-1].prompt_token_ids == r.prompt_token_ids
        for a, b in zip(outs[-1].outputs, r.outputs):
            assert (a.index, a.text, a.token_ids, a.finish_reason, a.stop_reason) == \
                   (b.index, b.text, b.token_ids, b.finish_reason, b.stop_reason)
            assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-5)
            assert [sorted(d) for d in a.logprobs] == [sorted(d) for d in b.logprobs]
        assert len(outs[-1].prompt_logprobs) == len(r.prompt_token_ids) and outs[-1].prompt_logprobs[0] is None
        for prev, cur in zip(outs, outs[1:]):             # CUMULATIVE: each output extends the one before
            for a, b in zip(prev.outputs, cur.outputs):
                assert b.token_ids[:len(a.token_ids)] == a.token_ids and b.text.startswith(a.text)
    assert llm.llm_engine.get_num_unfinished_requests() == 0
    free(llm)


def test_delta_and_final_only(llm):
    base = dict(temperature=0.0, max_tokens=7, ignore_eos=True)
    ref = llm.generate(PROMPTS, SamplingParams(**base), use_tqdm=False)
    kinds = {"a": "DELTA", "b": 2, "c": "FINAL_ONLY"}
    seen = run(llm.llm_engine, lambda rid: SamplingParams(**base, output_kind=kinds[rid]))
    deltas = seen["a"]
    assert len(deltas) > 1 and sum(len(o.outputs[0].token_ids) for o in deltas) == 7
    assert "".join(o.outputs[0].text for o in deltas) == ref[0].outputs[0].text
    assert [t for o in deltas for t in o.outputs[0].token_ids] == ref[0].outputs[0].token_ids
    for rid, r in zip("bc", ref[1:]):
        [out] = seen[rid]
        assert out.finished and out.outputs[0].token_ids == r.outputs[0].token_ids
        assert out.metrics.ttft_s >= 0 and out.metrics.tpot_s >= 0       # (the final output's timings, as generate's)
    assert all(not o.metrics for o in deltas)
    with pytest.raises(ValueError, match="output_kind"):
        llm.llm_engine.add_request("x", "hi", SamplingParams(output_kind="SOMETIMES"))
    free(llm)


def test_abort_bad_requests_and_passthrough(llm):
    eng = llm.llm_engine
    long = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    eng.add_request("keep", "one two", long)
    eng.add_request("drop", [3, 4, 5], long)
    with pytest.raises(ValueError, match="'keep' is already"):
        eng.add_request("keep", "again", long)
    eng.add_request(12, [3, 4], long)
    with pytest.raises(ValueError, match="request_id '12' is already in the engine"):     # 12 and "12": one id
        eng.add_request("12", "again", long)
    eng.add_request("7", [3, 4], long)
    eng.abort_request(["12", 7])                       # (aborted by the other spelling of their ids too)
    assert eng.get_num_unfinished_requests() == 2
    with pytest.raises(ValueError, match="one prompt"):
        eng.add_request("many", ["a", "b"], long)
    with pytest.raises(ValueError, match="request_id"):
        eng.add_request(None, "a", long)
    with pytest.raises(ValueError, match="LLMEngine.add_request: priority=5 "):
        eng.add_request("prio", "a", long, priority=5)
    with pytest.raises(ValueError, match="^request 'huge'.*(max_model_len|longer)"):    # (named by its id)
        eng.add_request("huge", list(range(1, 500)), long)
    with pytest.raises(ValueError, match="^request 9 is empty"):
        eng.add_request(9, [], long)
    with pytest.raises(ValueError, match="token id 1.5"):           # (not "takes one prompt")
        eng.add_request("floats", [1.5, 2.0], long)
    for bad in (None, 1.5, [[1]]):
        with pytest.raises(ValueError, match="request_id must be"):
            eng.abort_request(bad)
    assert eng.get_num_unfinished_requests() == 2
    eng.step()
    eng.abort_request(["drop", "unknown"])
    assert eng.get_num_unfinished_requests() == 1
    outs = [o for _ in range(60) for o in eng.step()]
    assert {o.request_id for o in outs} == {"keep"} and outs[-1].finished
    assert not eng.has_unfinished_requests() and eng.get_tokenizer() is llm.get_tokenizer()
    eng.add_request("gone", "x", long)
    eng.abort_request("gone")
    assert eng.step() == [] and eng.block_manager is llm.engine.block_manager
    free(llm)
    assert llm.generate(["one two"], long, use_tqdm=False)[0].outputs[0].token_ids == outs[-1].outputs[0].token_ids


def test_generate_beside_engine_requests(llm):
    """A generate call while the engine API has requests in flight runs them too; the next step reports them."""
    eng = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    eng.add_request("bg", [7, 8, 9], sp)
    ref = llm.generate([[7, 8, 9]], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    [out] = eng.step()
    assert out.finished and out.outputs[0].token_ids == ref[0].outputs[0].token_ids[:4]
    assert not eng.has_unfinished_requests()
    free(llm)


def test_numpy_token_ids(llm):
    """Token ids as numpy integers (a list of them, or an array), as `generate` takes them."""
    import numpy as np
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    want = llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].outputs[0].token_ids
    seen = run(llm.llm_engine, lambda rid: sp, ids=("l", "a"), prompts=[list(np.array([5, 6, 7])), np.array([5, 6, 7])])
    assert [seen[r][-1].outputs[0].token_ids for r in "la"] == [want, want]
    free(llm)


def test_tokenization_kwargs_reach_the_tokenizer(llm):
    """vLLM's tokenization_kwargs (LLMEngine.add_request, LLM.generate): truncation + max_length keep max_length
    tokens of a text prompt, and of a token prompt too (from the tokenizer's truncation side)."""
    text = "The quick brown fox jumps over the lazy dog"
    full = llm.get_tokenizer().encode(text, add_special_tokens=False)
    assert len(full) > 3
    cut = {"truncation": True, "max_length": 3}
    sp = SamplingParams(temperature=0, max_tokens=2)
    eng = llm.llm_engine
    eng.add_request("t", text, sp, tokenization_kwargs=cut)
    eng.add_request("i", full, sp, tokenization_kwargs=cut)
    done = {}
    while eng.has_unfinished_requests():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    assert done["t"].prompt_token_ids == done["i"].prompt_token_ids == full[:3]
    outs = llm.generate([text, full], sp, use_tqdm=False, tokenization_kwargs=cut)
    assert [o.prompt_token_ids for o in outs] == [full[:3]] * 2
    assert outs[0].token_ids == done["t"].outputs[0].token_ids
    import numpy as np                      # Hugging Face's meanings: no max_length is the tokenizer's own limit,
    for kw, n in [({"truncation": True}, len(full)), ({"truncation": "do_not_truncate", "max_length": 2}, len(full)),
                  ({"truncation": "longest_first", "max_length": np.int64(2)}, 2)]:   # a strategy truncates
        assert len(llm.generate(text, sp, use_tqdm=False, tokenization_kwargs=kw)[0].prompt_token_ids) == n
    with pytest.raises(ValueError, match="max_length"):
        llm.generate(text, sp, use_tqdm=False, tokenization_kwargs={"truncation": True, "max_length": 0})
    with pytest.raises(ValueError, match="tokenization_kwargs must be a dict"):
        llm.generate(text, sp, use_tqdm=False, tokenization_kwargs=["truncation"])
    free(llm)


def test_vllms_engine_args_and_from_engine_args(tiny_dir):
    """vLLM's llm_engine_example: EngineArgs.add_cli_args / from_cli_args, LLMEngine.from_engine_args, then the
    add_request / step loop; the same tokens as LLM.generate."""
    import argparse

    from jaxinfer import EngineArgs, LLMEngine
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    argv = ["--model", tiny_dir, "--dtype", "float32", "--max-model-len", "128", "--block-size", "4",
            "--num-kvcache-blocks", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--no-warmup"]
    args = parser.parse_args(argv)
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.model == tiny_dir and engine_args.kwargs["max_model_len"] == 128
    assert (engine_args.max_model_len, engine_args.enable_prefix_caching, engine_args.dtype) == (128, True, "float32")
    thinking = EngineArgs.from_cli_args(parser.parse_args([*argv, "--reasoning-parser", "qwen3"]))   # (vLLM's)
    assert thinking.kwargs["reasoning_parser"] == "qwen3" and EngineArgs(reasoning_parser="qwen3").reasoning_parser
    parser.add_argument("--my-own-flag", type=int)       # vLLM's basic example: LLM(**vars(args)) of the engine flags
    mine = vars(parser.parse_args(["--model", tiny_dir, "--enforce-eager", "--my-own-flag", "3", *argv[2:]]))
    assert mine.pop("my_own_flag") == 3 and LLM(**mine).config.max_model_len == 128
    engine = LLMEngine.from_engine_args(engine_args, usage_context=None)
    assert isinstance(engine, LLMEngine) and engine.model_config.max_model_len == 128
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    engine.add_request("0", [5, 6, 7], sp)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    want = LLM(tiny_dir, **TINY_ENGINE).generate([[5, 6, 7]], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert done["0"].outputs[0].token_ids == want
    import dataclasses                                   # a dataclass as vLLM's (its benchmarks: LLM(**asdict(args)))
    ea = EngineArgs(tiny_dir, **TINY_ENGINE)
    assert ea.kwargs == TINY_ENGINE and repr(ea).endswith("warmup=False)")
    assert (ea.seed, ea.tensor_parallel_size) == (0, 1)                  # (unset: LLM()'s defaults)
    assert LLM(**dataclasses.asdict(ea)).config.max_model_len == 128
    assert dataclasses.replace(ea, max_model_len=64).kwargs["max_model_len"] == 64
