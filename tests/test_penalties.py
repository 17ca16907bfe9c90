"""Presence, frequency and repetition penalties (vLLM's formula) applied on the device: greedy decoding with a
penalty picks what a numpy reference on transformers' logits picks; counts survive chunking and preemption;
bad values are refused."""
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY_ENGINE, hf_logits, hf_model

from jaxinfer import LLM, SamplingParams
from jaxinfer.sampling import apply_penalties

PROMPTS = [[5, 7, 9, 11, 300, 2, 3, 17, 40, 41, 8], [100, 200, 300, 100, 200]]
CASES = {"presence": dict(presence_penalty=1.5), "frequency": dict(frequency_penalty=0.7),
         "repetition": dict(repetition_penalty=1.8), "all": dict(presence_penalty=-0.5, frequency_penalty=0.4,
                                                                 repetition_penalty=1.3)}


def penalize(logits, prompt, output, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0):
    """vLLM's apply_penalties in numpy on one row: repetition over prompt + output, then frequency and presence
    over the output."""
    x = logits.astype(np.float64).copy()
    seen = np.zeros(len(x), bool)
    seen[list(prompt) + list(output)] = True
    x = np.where(seen, np.where(x > 0, x / repetition_penalty, x * repetition_penalty), x)
    counts = np.bincount(np.asarray(output, int), minlength=len(x)) if output else np.zeros(len(x))
    return x - frequency_penalty * counts - presence_penalty * (counts > 0)


def test_apply_penalties_matches_numpy():
    rng = np.random.default_rng(0)
    V, B = 50, 3
    logits = rng.standard_normal((B, V)).astype(np.float32) * 3
    prompts = [rng.integers(0, V, 6).tolist() for _ in range(B)]
    outputs = [rng.integers(0, V, 9).tolist() for _ in range(B)]
    kw = dict(presence_penalty=[0.5, 0.0, -1.0], frequency_penalty=[0.3, 1.0, 0.0], repetition_penalty=[1.2, 1.0, 0.7])
    seen = np.zeros((B, V), bool)
    counts = np.zeros((B, V), np.int32)
    for b in range(B):
        seen[b, prompts[b]] = True
        np.add.at(counts[b], outputs[b], 1)
    got = apply_penalties(jnp.asarray(logits), jnp.asarray(seen), jnp.asarray(counts),
                          *(jnp.asarray(kw[k], jnp.float32) for k in ("repetition_penalty", "frequency_penalty",
                                                                       "presence_penalty")))
    want = [penalize(logits[b], prompts[b], outputs[b], **{k: v[b] for k, v in kw.items()}) for b in range(B)]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def reference(tiny_dir):
    model = hf_model(tiny_dir)

    def greedy(prompt, n, **pen):
        out = []
        for _ in range(n):
            row = hf_logits(model, prompt + out)[-1]
            out.append(int(np.argmax(penalize(row, prompt, out, **pen))))
        return out
    return greedy


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, **TINY_ENGINE)


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_with_penalty_picks_the_reference(llm, reference, case):
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, **CASES[case])
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == reference(p, 8, **CASES[case])
    assert any(o.token_ids != q.token_ids for o, q in zip(outs, plain)), "the penalty changed nothing"
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"], st


@pytest.mark.parametrize("backend", ["pallas"])
def test_penalties_other_backend(tiny_dir, reference, backend):
    llm = LLM(tiny_dir, **{**TINY_ENGINE, "attn_backend": backend})
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, **CASES["all"])
    assert llm.generate(PROMPTS[:1], sp, use_tqdm=False)[0].token_ids == reference(PROMPTS[0], 3, **CASES["all"])


def test_penalty_counts_survive_chunking_preemption_and_slot_reuse(tiny_dir, llm):
    """12 penalised requests (more than max_num_seqs=8 slots: slots are reused), in a tiny pool (preemptions:
    recomputed sequences rebuild their counts) with an 8-token prefill budget (chunked prompts), draw the
    tokens each draws alone."""
    rng = np.random.default_rng(1)
    ps = [rng.integers(0, 512, int(rng.integers(3, 20))).tolist() for _ in range(12)]
    sps = [SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True, **CASES[sorted(CASES)[i % 4]])
           for i in range(12)]
    alone = [llm.generate([p], [sp], use_tqdm=False)[0].token_ids for p, sp in zip(ps, sps)]
    crowded = LLM(tiny_dir, **{**TINY_ENGINE, "num_kvcache_blocks": 20, "max_num_batched_tokens": 8,
                               "prefill_buckets": (8,)})
    got = [o.token_ids for o in crowded.generate(ps, sps, use_tqdm=False)]
    assert got == alone
    st = crowded.stats()
    assert st["preemptions"] > 0 and st["kv_blocks_free"] == st["kv_blocks_total"], st


def test_warmup_extras_compiles_ahead(tiny_dir):
    llm = LLM(tiny_dir, **{**TINY_ENGINE, "max_num_seqs": 2, "decode_buckets": (2,), "prefill_buckets": (32,),
                           "max_num_batched_tokens": 32, "max_model_len": 16, "block_size": 8})
    sp = SamplingParams(temperature=0.0, max_tokens=4, presence_penalty=1.0, logprobs=1)
    n = llm.engine.warmup_extras(sp)
    assert n == llm.stats()["compiled_extras"] > 0
    llm.generate(PROMPTS[:1], sp, use_tqdm=False)
    assert llm.stats()["compiled_extras"] == n and llm.stats()["compilations"] == 0


@pytest.mark.parametrize("kw, name", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(logprobs=-2), "logprobs"), (dict(logprobs=1.0), "logprobs"), (dict(prompt_logprobs=1.5), "prompt_logprobs"),
    (dict(n=0), "n"), (dict(n=True), "n")])
def test_bad_values_are_refused(kw, name):
    with pytest.raises(ValueError, match=f"SamplingParams.{name}="):
        SamplingParams(**kw)


def test_bench_options_ask_every_request_and_compile_ahead():
    """bench.py --logprobs / --presence-penalty (the lead's A/B on the GPU): every request asks, and the variants
    are compiled before the timed run (warmup_extras, tested above)."""
    import os
    import sys
    from types import SimpleNamespace
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import bench
    args = bench.parse(["--num-seqs", "3", "--logprobs", "5", "--presence-penalty", "0.5"])
    asked = []
    llm = SimpleNamespace(engine=SimpleNamespace(warmup_extras=lambda sp: asked.append(sp) or 7))
    _, params = bench.workload(3, 120, 110, vocab=512)
    out = bench.with_extras(llm, params, args)
    assert [(p.logprobs, p.presence_penalty, p.max_tokens) for p in out] == [(5, 0.5, p.max_tokens) for p in params]
    assert asked == [out[0]]
    assert bench.with_extras(llm, params, bench.parse([])) is params
