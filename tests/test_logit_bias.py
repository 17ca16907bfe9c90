"""vLLM's logit_bias and allowed_token_ids, applied on the device in the step's extras variant: greedy decoding
picks what transformers' logits with the bias (or the mask) pick, beside plain rows in one batch, with penalties,
seeded sampling and top-k; logprobs stay the raw model's (vLLM's raw_logprobs); bad values are refused by name."""
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY_ENGINE, hf_greedy_edited, hf_model

from jaxinfer import LLM, SamplingParams
from jaxinfer.sampling import apply_bias

PROMPTS = [[5, 7, 9, 11, 300, 2, 3, 17, 40, 41, 8], [100, 200, 300, 100, 200]]


def biased(row, logit_bias=None, allowed_token_ids=None):
    x = row.astype(np.float64).copy()
    for t, v in (logit_bias or {}).items():
        x[t] += v
    if allowed_token_ids:
        keep = np.full_like(x, -np.inf)
        keep[allowed_token_ids] = x[allowed_token_ids]
        x = keep
    return x


def test_apply_bias_matches_numpy():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 40)).astype(np.float32)
    pad = 2**30
    ids = np.array([[3, 7, pad, pad], [1, 2, 39, pad], [pad] * 4], np.int32)
    vals = np.array([[5.0, -2.0, 0, 0], [0.5, 0.0, 1.0, 0], [0] * 4], np.float32)
    only = np.array([0, 1, 0], np.int32)
    got = np.asarray(apply_bias(jnp.asarray(logits), jnp.asarray(ids), jnp.asarray(vals), jnp.asarray(only)))
    want = [biased(logits[0], {3: 5.0, 7: -2.0}), biased(logits[1], {1: 0.5, 39: 1.0}, [1, 2, 39]), logits[2]]
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-6)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, **TINY_ENGINE)


@pytest.fixture(scope="module")
def greedy_ref(tiny_dir):
    model = hf_model(tiny_dir)

    return lambda prompt, n, **kw: hf_greedy_edited(model, prompt, n, lambda row, out: biased(row, **kw))


def test_greedy_with_bias_and_mask_matches_transformers(llm, greedy_ref):
    """Three rows in one batch: a bias that moves the argmax, a mask of allowed ids (with a bias among them), and a
    plain row (unchanged); then the same with K-step decode's batch sizes (a request alone)."""
    plain = greedy_ref(PROMPTS[0], 6)
    lb = {plain[0]: -5.0, 33: 3.0}
    allowed = [60, 61, 62, 300]
    cases = [dict(logit_bias=lb), dict(allowed_token_ids=allowed, logit_bias={62: 2.0, 400: 50.0}), {}]
    sps = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, **kw) for kw in cases]
    outs = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[0]], sps, use_tqdm=False)
    for out, prompt, kw in zip(outs, [PROMPTS[0], PROMPTS[1], PROMPTS[0]], cases):
        assert out.outputs[0].token_ids == greedy_ref(prompt, 6, **kw), kw
    assert set(outs[1].outputs[0].token_ids) <= set(allowed) and outs[0].outputs[0].token_ids != plain
    [alone] = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                      allowed_token_ids=[7, 9]), use_tqdm=False)
    assert alone.outputs[0].token_ids == greedy_ref(PROMPTS[1], 8, allowed_token_ids=[7, 9])
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_minus_inf_bans_a_token(llm, greedy_ref):
    """vLLM's idiom `logit_bias={id: -inf}` bans the id (greedy, and seeded with a repetition penalty that would
    multiply a negative logit); +inf is refused (it would make every other token's probability nan)."""
    plain = greedy_ref(PROMPTS[0], 6)
    banned = {t: float("-inf") for t in set(plain)}
    [g] = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias=banned),
                       use_tqdm=False)
    assert g.outputs[0].token_ids == greedy_ref(PROMPTS[0], 6, logit_bias=banned) and not set(plain) & set(
        g.outputs[0].token_ids)
    sp = SamplingParams(temperature=1.0, seed=5, max_tokens=20, ignore_eos=True, logit_bias=banned,
                        repetition_penalty=0.5)
    assert not set(plain) & set(llm.generate(PROMPTS[0], sp, use_tqdm=False)[0].outputs[0].token_ids)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: float("inf")})


def test_bias_with_penalties_seeds_topk_and_raw_logprobs(llm):
    """A bias large enough wins over any penalty and any seeded draw (top_k too); a seeded biased request repeats;
    logprobs are the raw model's (the same with and without the bias), as vLLM's default logprobs mode."""
    sp = dict(max_tokens=5, ignore_eos=True, seed=3, temperature=0.8)
    forced = SamplingParams(**sp, logit_bias={77: 100.0}, presence_penalty=2.0, top_k=5)
    [a, b] = llm.generate([PROMPTS[0], PROMPTS[0]], [forced, forced.clone()], use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == [77] * 5
    only = SamplingParams(**sp, allowed_token_ids=[10, 11], logprobs=2)
    free = SamplingParams(temperature=0, max_tokens=1, logprobs=2)
    [o, f] = llm.generate([PROMPTS[1], PROMPTS[1]], [only, free], use_tqdm=False)
    assert set(o.outputs[0].token_ids) <= {10, 11}
    lo, lf, tok = o.outputs[0].logprobs[0], f.outputs[0].logprobs[0], o.outputs[0].token_ids[0]
    top_o, top_f = ({t for t, x in d.items() if x.rank <= 2} for d in (lo, lf))
    assert top_o == top_f and not top_o <= {10, 11}           # the raw top-2, not the allowed ids
    if tok in lf:
        assert abs(lo[tok].logprob - lf[tok].logprob) < 1e-4


def test_bad_bias_is_refused_by_name(llm):
    for kw, word in ((dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(logit_bias={1: float("nan")}), "logit_bias"),
                     (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(allowed_token_ids=["a"]), "allowed"),
                     (dict(logit_bias={i: 1.0 for i in range(1025)}), "at most 1024")):
        with pytest.raises(ValueError, match=word):
            SamplingParams(**kw)
    assert SamplingParams.from_optional(logit_bias={"7": 500.0, 8: -1e9}, seed=None).logit_bias == {7: 100.0,
                                                                                                     8: -100.0}
    with pytest.raises(ValueError, match="logit_bias"):             # (a NaN is refused, not clamped to -100)
        SamplingParams.from_optional(logit_bias={"5": float("nan")})
    eos = llm.engine.scheduler.eos
    with pytest.raises(ValueError, match="all stop or EOS ids"):         # min_tokens would ban every allowed id
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[40],
                                                allowed_token_ids=[40, *eos]), use_tqdm=False)
    V = 512                                                   # (the tiny checkpoints' vocabulary)
    for kw in (dict(logit_bias={V + 5: 1.0}), dict(allowed_token_ids=[1, V])):
        with pytest.raises(ValueError, match="out-of-vocab"):
            llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, **kw), use_tqdm=False)
    assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
