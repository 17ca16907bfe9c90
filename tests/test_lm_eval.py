"""lm-evaluation-harness drives the server as `local-completions` (its OpenAI-completions client) on the two
local tasks of tests/lm_eval_tasks/: a loglikelihood one (echo + logprobs, the prompt as token ids) and a
generate_until one (stop strings), with the server's own tokenizer (lm_eval's "remote" backend: /tokenize,
/detokenize, /tokenizer_info). The log-likelihoods lm_eval computes must equal transformers' fp32 ones.

lm_eval is heavy (datasets, pandas, ...): it is the `eval` extra, and this test skips without it:
    pip install -e ".[eval]" && JAX_PLATFORMS=cpu python -m pytest -q -p no:xdist tests/test_lm_eval.py
"""
import os

import httpx
import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("openai")

from helpers import hf_logits, hf_model  # noqa: E402
from test_server import MODEL, run_server  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def url(tiny_dir, tmp_path_factory):
    for u, _ in run_server(tiny_dir, tmp_path_factory):
        yield u


def test_lm_eval_local_completions(url, tiny_dir, monkeypatch):
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    monkeypatch.chdir(ROOT)                       # the task files name their data relative to the repository
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = simple_evaluate(
        model="local-completions",
        model_args=dict(base_url=url + "/v1/completions", model=MODEL, tokenizer_backend="remote",
                        tokenized_requests=True, max_length=128, max_retries=1, timeout=120),
        tasks=["jaxinfer_ll", "jaxinfer_gen"], task_manager=TaskManager(include_path=os.path.join(ROOT, "tests",
                                                                                                  "lm_eval_tasks")),
        log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    res = out["results"]
    assert 0.0 <= res["jaxinfer_ll"]["acc,none"] <= 1.0
    assert 0.0 <= res["jaxinfer_gen"]["exact_match,none"] <= 1.0

    def encode(text):
        return httpx.post(url + "/tokenize", json={"prompt": text}).json()["tokens"]
    model = hf_model(tiny_dir)
    samples = out["samples"]["jaxinfer_ll"]
    assert len(samples) == 3
    for s in samples:
        for (context, continuation), resp in zip(s["arguments"], s["resps"]):
            ll = float(resp[0][0])
            whole, ctx = encode(context + continuation), encode(context)   # as lm_eval splits the pair
            ids = whole
            lp = torch.log_softmax(torch.tensor(hf_logits(model, ids)), -1).numpy()
            want = sum(lp[k - 1, ids[k]] for k in range(len(ctx), len(ids)))
            np.testing.assert_allclose(ll, want, atol=2e-3 * (len(ids) - len(ctx)))

    gen = out["samples"]["jaxinfer_gen"]
    assert len(gen) == 2
    for s in gen:                                 # what lm_eval got is what the server generates
        prompt = s["arguments"][0][0]
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": encode(prompt), "max_tokens": 8,
                                                      "temperature": 0, "stop": ["\n"]}).json()
        assert s["resps"][0][0] == r["choices"][0]["text"]
