"""vLLM's offline API details that ported scripts rely on: numpy numbers and list fields in SamplingParams, the
prompt TypedDicts, a bad entry in a list of params, LLM options that only describe jaxinfer, detokenize=False."""
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


def test_vllm_options_that_describe_jaxinfer():
    kw = dict(enable_chunked_prefill=True, max_logprobs=20, quantization=None, max_seq_len_to_capture=8192,
              task="generate", max_num_seqs=4)
    pop_vllm_options(kw)
    assert kw == {"max_num_seqs": 4}
    for bad, word in [(dict(enable_chunked_prefill=False), "enable_chunked_prefill=True"),
                      (dict(max_logprobs=5), "max_logprobs=20"), (dict(quantization="awq"), "no quantization")]:
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
