"""The server's OpenAI semantics beyond text, with the official `openai` client against a real engine core:
logprobs (completion and chat shapes) against transformers' fp32 log_softmax, echo + prompt logprobs (what
lm-evaluation-harness' loglikelihood sends), n, seeds, penalties; the API key, the waiting-queue bound, /metrics,
vLLM's /tokenize, /detokenize, /tokenizer_info, /version, the offline /docs and the body size limit."""
import asyncio
import functools
import json
import threading
import time

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")

from helpers import hf_logits, hf_model  # noqa: E402
from test_server import MODEL, run_server, wait_idle  # noqa: E402
from jaxinfer.tokenizer import load_tokenizer  # noqa: E402

PROMPT = [5, 7, 9, 11, 300, 2, 3, 17, 40, 41, 8]
# (a request may compile a new step variant on the CPU, slow under load: httpx's 5 s default is too short)
post = functools.partial(httpx.post, timeout=120)


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    yield from run_server(tiny_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def url(server):
    return server[0]


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def ref(tiny_dir):
    """token ids -> fp32 log_softmax [len, V] of the HF model."""
    import torch
    model = hf_model(tiny_dir)
    return lambda ids: torch.log_softmax(torch.tensor(hf_logits(model, ids)), -1).numpy()


@pytest.fixture(scope="module")
def tok(url):
    """token id -> its text, as the server decodes it (/detokenize)."""
    cache = {}

    def text(t):
        if t not in cache:
            cache[t] = post(url + "/detokenize", json={"tokens": [t]}).json()["prompt"]
        return cache[t]
    return text


def test_completion_echo_logprobs_match_transformers(client, ref, tok):
    """lm-evaluation-harness' loglikelihood request: echo + logprobs, the prompt as token ids."""
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True,
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    lp = c.logprobs
    n = len(PROMPT)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ids = list(PROMPT)                    # + the generated ids: greedy under the reference
    for _ in range(3):
        ids.append(int(np.argmax(ref(ids)[-1])))
    want = ref(ids)
    for k in range(1, n + 3):
        np.testing.assert_allclose(lp.token_logprobs[k], want[k - 1, ids[k]], atol=2e-3)
        top = lp.top_logprobs[k]
        best = np.argsort(want[k - 1])[::-1][:2]
        # (a piece of a character is "" or the characters it completes with the tokens before it: TokenTexts)
        assert set(top) >= {tok(int(t)) for t in best if "\ufffd" not in tok(int(t))} and len(top) <= 3
        assert lp.tokens[k] == tok(ids[k]) or "\ufffd" in tok(ids[k])
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    assert lp.tokens[1:] == [next(iter(top)) for top in lp.top_logprobs[1:]]     # (the token first: vLLM's order)
    assert c.text.startswith(post(str(client.base_url).replace("/v1/", "/detokenize"),
                                        json={"tokens": PROMPT}).json()["prompt"])


def test_completion_echo_only_scores_the_prompt(url, client, ref):
    """max_tokens=0 with echo (vLLM's prompt scoring): the prompt's text and logprobs, nothing generated, streamed
    or not; max_tokens=0 without echo is a 400 naming it; a bad value's 400 names the value."""
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, temperature=0, logprobs=1, echo=True)
    c, want = r.choices[0], ref(PROMPT)
    assert len(c.logprobs.tokens) == len(PROMPT) and c.logprobs.token_logprobs[0] is None
    np.testing.assert_allclose(c.logprobs.token_logprobs[1:], [want[k - 1, PROMPT[k]] for k in range(1, len(PROMPT))],
                               atol=2e-3)
    assert c.text == "".join(c.logprobs.tokens) and c.finish_reason in ("length", "stop")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(PROMPT), 0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, logprobs=1, echo=True,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text
    assert [t for ch in chunks if ch.choices for t in ch.choices[0].logprobs.tokens] == c.logprobs.tokens
    assert chunks[-1].usage.completion_tokens == 0
    full = [int(t) % 500 + 3 for t in range(128)]           # a prompt that fills max_model_len=128: scored, as vLLM
    r = post(url + "/v1/completions",
             json={"model": MODEL, "prompt": full, "max_tokens": 0, "echo": True, "logprobs": 0})
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["tokens"]) == 128, r.text
    r = post(url + "/v1/completions", json={"model": MODEL, "prompt": full, "max_tokens": 1, "echo": True})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    # the dropped token's finish reason, as vLLM's: "stop" when it is a stop id (vLLM's check_stop looks at stop ids
    # before the length), streamed or not
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 0, "echo": True, "temperature": 0,
            "stop_token_ids": list(range(512))}        # every id of the tiny vocabulary
    whole = post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert whole["finish_reason"] == "stop" and whole["stop_reason"] in range(512), whole
    assert whole["text"] == c.text
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        last = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")][-1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", whole["stop_reason"]), last
    bad = post(url + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 0})
    assert bad.status_code == 400 and "echo" in bad.json()["error"]["message"]
    bad = post(url + "/v1/completions", json={"model": MODEL, "prompt": "a", "temperature": -1.5})
    assert bad.status_code == 400 and "-1.5" in bad.json()["error"]["message"], bad.json()


def test_models_retrieve(url, client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other-model")
    r = httpx.get(url + "/v1/models/")                        # no id: not a card for the model ""
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_truncate_prompt_tokens(url, client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"truncate_prompt_tokens": 4})
    assert r.usage.prompt_tokens == 4
    bad = post(url + "/v1/completions", json={"model": MODEL, "prompt": "a", "truncate_prompt_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens"


def test_chat_logprobs_and_stream_agree(client, ref):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4, temperature=0,
              logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    content = full.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in content)
    assert all(t.bytes == list(t.token.encode()) for t in content)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [(t.token, round(t.logprob, 4)) for t in content]


def test_n_samples_share_the_prompt(url, client):
    """Samples 1.. of n wait for sample 0's prompt KV and reuse it from the prefix cache (computed once)."""
    prompt = list(range(100, 141))                       # 41 tokens: 10 full blocks of 4 to reuse
    before = wait_idle(url)["prefix_cache_hit_tokens"]
    r = client.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=2, temperature=1.0)
    assert len(r.choices) == 3
    assert wait_idle(url)["prefix_cache_hit_tokens"] - before == 2 * 40


def test_cache_salt_isolates_the_prefix_cache(url, client):
    """vLLM's cache_salt field: a request reuses cached prompt blocks only from requests with the same salt (n
    samples of one request still share theirs); an empty salt is a 400 naming it."""
    prompt = list(range(200, 241))                       # 41 tokens: 10 full blocks of 4
    hits = []
    for salt in ("a", "a", "b", None, "b"):
        before = wait_idle(url)["prefix_cache_hit_tokens"]
        extra = {} if salt is None else {"extra_body": {"cache_salt": salt}}
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, **extra)
        hits.append(wait_idle(url)["prefix_cache_hit_tokens"] - before)
    assert hits == [0, 40, 0, 0, 40]
    before = wait_idle(url)["prefix_cache_hit_tokens"]
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 30}], max_tokens=2, n=2,
                                   extra_body={"cache_salt": "c"})
    assert wait_idle(url)["prefix_cache_hit_tokens"] > before            # sample 1 reused sample 0's salted blocks
    r = post(url + "/v1/completions", json=dict(model=MODEL, prompt="hi", cache_salt=""))
    assert r.status_code == 400 and "cache_salt" in r.text


def test_n_samples_differ_and_seed_repeats(client):
    kw = dict(model=MODEL, prompt="Once upon", max_tokens=8, temperature=1.0, n=3, seed=7,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1, "n samples must differ"
    b = client.completions.create(**kw)
    assert [c.text for c in sorted(b.choices, key=lambda c: c.index)] == texts, "the same seed repeats them"
    assert a.usage.completion_tokens == 24
    one = client.completions.create(**{**kw, "n": 1})
    assert one.choices[0].text == texts[0], "sample 0 of n is the n=1 sample"
    got = {}
    for ch in client.completions.create(**kw, stream=True):
        for c in ch.choices:
            got[c.index] = got.get(c.index, "") + c.text
    assert [got[i] for i in range(3)] == texts


def test_penalties_change_greedy_output(client):
    kw = dict(model=MODEL, prompt=[3, 3, 3, 3], max_tokens=12, temperature=0, logprobs=0)
    tokens = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].logprobs.tokens
    assert len(set(tokens)) < len(tokens), "the test needs a greedy output that repeats a token"
    pen = client.completions.create(**kw, frequency_penalty=1.0, presence_penalty=1.0,
                                    extra_body={"ignore_eos": True, "repetition_penalty": 2.0}).choices[0]
    assert pen.logprobs.tokens != tokens
    assert len(set(pen.logprobs.tokens)) > len(set(tokens)), "penalties discourage repeats"


def test_api_key(server, url):
    app = server[1]
    before = app.state.options
    app.state.options = before.replace(api_key="sekret")
    try:
        bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models").json()["error"]["code"] == "invalid_api_key"
        good = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
        assert [m.id for m in good.models.list().data] == [MODEL]
        assert httpx.get(url + "/health").status_code == 200          # open, as in vLLM
        assert httpx.options(url + "/v1/completions").status_code != 401     # (a preflight carries no key: vLLM's)
        app.state.options = before.replace(api_key=("k1", "k2"))         # vLLM's --api-key k1 k2: any of them
        assert [httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {k}"}).status_code
                for k in ("k1", "k2", "k3", "k1 k2")] == [200, 200, 401, 401]
    finally:
        app.state.options = before


def test_prompt_tokens_details(server, url, client):
    """vLLM's --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens counts the prompt tokens found
    in the prefix cache (a repeated 24-token prompt: its first 5 blocks of 4), plain and streamed, completions and
    chat; without the flag (or with no hits) it is absent."""
    app = server[1]
    before = app.state.options
    prompt = [int(t) % 400 + 7 for t in range(24)]
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)          # (its blocks into the cache)
    assert client.completions.create(model=MODEL, prompt=prompt, max_tokens=2).usage.prompt_tokens_details is None
    app.state.options = before.replace(enable_prompt_tokens_details=True)
    try:
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2).usage.prompt_tokens_details
        assert got.cached_tokens == 20, got
        events = _sse(url, "/v1/completions", dict(model=MODEL, prompt=prompt, max_tokens=2,
                                                     stream_options={"include_usage": True}))
        assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 20}, events[-1]
        chat = dict(model=MODEL, messages=[{"role": "user", "content": "cached " * 12}], max_tokens=2)
        first = post(url + "/v1/chat/completions", json=chat).json()["usage"]
        again = post(url + "/v1/chat/completions", json=chat).json()["usage"]
        assert "prompt_tokens_details" not in first or first["prompt_tokens_details"]["cached_tokens"] < \
            again["prompt_tokens_details"]["cached_tokens"] <= again["prompt_tokens"]
        fresh = client.completions.create(model=MODEL, prompt=[9, 8, 7], max_tokens=1).usage
        assert fresh.prompt_tokens_details is None
    finally:
        app.state.options = before
    assert server_options_flag_parses()


def server_options_flag_parses() -> bool:
    import argparse

    from jaxinfer.server.options import add_server_args, server_options
    ap = argparse.ArgumentParser()
    add_server_args(ap)
    return server_options(ap.parse_args(["--enable-prompt-tokens-details"])).enable_prompt_tokens_details is True


def test_queue_bound_answers_503_at_once(server, url):
    """max_num_seqs 8 + 0 waiting: 8 engine requests are admitted; the next gets 503 + Retry-After at once, before
    its body is read; a request that could never fit is a 400; the admitted ones complete."""
    app = server[1]
    before = app.state.options
    app.state.options = before.replace(max_waiting_requests=0)
    body = {"model": MODEL, "prompt": [f"Busy {i}" for i in range(8)], "max_tokens": 110, "ignore_eos": True}

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            busy = asyncio.ensure_future(c.post("/v1/completions", json=body))
            while (await c.get("/stats")).json()["api_inflight"] < 8:
                assert not busy.done(), busy.result().text
                await asyncio.sleep(0.01)
            t = time.perf_counter()
            over = await c.post("/v1/completions", json={"model": MODEL, "prompt": "one more", "max_tokens": 2})
            dt = time.perf_counter() - t
            # refused by the gate before its body is read: not even a broken body gets that far
            early = await c.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
            done = await busy        # (while full, the gate answers 503 to any generate request, even this one)
            too_big = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 9, "max_tokens": 2})
            return over, dt, too_big, early, done
    try:
        over, dt, too_big, early, busy = asyncio.run(go())
    finally:
        app.state.options = before
    assert over.status_code == 503 and over.headers["retry-after"] == "1" and dt < 1.0
    assert over.json()["error"]["code"] == "overloaded"
    assert early.status_code == 503 and early.json()["error"]["code"] == "overloaded"
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "n"
    assert "needs 9 engine requests" in too_big.json()["error"]["message"] and "at most 8" in too_big.text
    assert busy.status_code == 200 and busy.json()["usage"]["completion_tokens"] == 8 * 110
    metrics = httpx.get(url + "/metrics").text
    assert 'jaxinfer:requests_rejected_total{model_name="tiny-qwen3",reason="queue_full"} 2.0' in metrics


def test_metrics(url, client):
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=5, extra_body={"ignore_eos": True})
    st = wait_idle(url)
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in r.text.splitlines() if ln and not ln.startswith("#")}
    lab = '{model_name="tiny-qwen3"}'
    assert m["jaxinfer:num_requests_running" + lab] == 0 and m["jaxinfer:num_requests_waiting" + lab] == 0
    assert m["jaxinfer:kv_cache_usage_perc" + lab] == 0.0
    assert m["jaxinfer:generation_tokens_total" + lab] == st["generated_tokens"]
    assert m["jaxinfer:prompt_tokens_total" + lab] == st["prompt_tokens"]
    assert m["jaxinfer:num_preemptions_total" + lab] == st["preemptions"]
    for h in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert m[f"jaxinfer:{h}_count" + lab] >= 1
    assert m['jaxinfer:request_success_total{finished_reason="length",model_name="tiny-qwen3"}'] >= 1
    from jaxinfer.server.metrics import VLLM_NAMES, VLLM_OLD_NAMES   # the same numbers under vLLM's names
    twins = {k: v for k, v in m.items() if k.startswith("vllm:")}
    back = {v: k for t in (VLLM_NAMES, VLLM_OLD_NAMES) for k, v in t.items()}
    assert m["vllm:gpu_cache_usage_perc" + lab] == m["vllm:kv_cache_usage_perc" + lab]     # (vLLM 0.8-0.10's name)
    for name, v in twins.items():
        base, brace, rest = name.removeprefix("vllm:").partition("{")
        stem = max((n for n in back if base.startswith(n)), key=len)
        assert m["jaxinfer:" + back[stem] + base[len(stem):] + brace + rest] == v or base.endswith("_created"), name
    assert m["vllm:request_time_per_output_token_seconds_count" + lab] >= 1 and len(twins) > 40
    assert m["vllm:num_requests_running" + lab] == 0 and m["vllm:prefix_cache_hits_total" + lab] >= 0
    # the engine core's histograms of finished requests: its phases add up, its token gaps span its decode time
    assert m["vllm:prefix_cache_queries_total" + lab] == st["prefix_cache_query_tokens"] >= st["prompt_tokens"]
    h = {k.removeprefix("vllm:").removesuffix(lab): v for k, v in m.items() if k.endswith(lab)}
    assert h["request_queue_time_seconds_count"] == h["request_inference_time_seconds_count"] >= 1
    assert h["request_inference_time_seconds_sum"] == pytest.approx(
        h["request_prefill_time_seconds_sum"] + h["request_decode_time_seconds_sum"], abs=1e-6)
    assert h["inter_token_latency_seconds_sum"] == pytest.approx(h["request_decode_time_seconds_sum"], abs=1e-6)
    assert h["inter_token_latency_seconds_count"] == h["request_generation_tokens_sum"] - h[
        "request_generation_tokens_count"] >= 4
    assert m['vllm:request_generation_tokens_bucket{le="5.0",model_name="tiny-qwen3"}'] >= 1
    # each finished prompt's n, max_tokens and longest choice (vLLM's request_params_* histograms)
    assert h["request_params_n_count"] == h["request_params_max_tokens_count"] >= 1
    assert h["request_max_num_generation_tokens_count"] == h["request_params_n_count"]
    assert m['vllm:request_params_max_tokens_bucket{le="5.0",model_name="tiny-qwen3"}'] >= 1
    info = [k for k in m if k.startswith("vllm:cache_config_info{")]
    assert info == ['vllm:cache_config_info{block_size="%d",cache_dtype="%s",num_gpu_blocks="%d"}' % (
        st["block_size"], "auto", st["kv_blocks_total"])] and m[info[0]] == 1.0   # (vLLM's: the option as given)


def _latency_sums(url) -> dict:
    m = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in httpx.get(url + "/metrics").text.splitlines()
         if ln and not ln.startswith("#")}
    return {h: (m.get(f"jaxinfer:{h}_seconds_sum" + '{model_name="tiny-qwen3"}', 0.0),     # (0 before any
                m.get(f"jaxinfer:{h}_seconds_count" + '{model_name="tiny-qwen3"}', 0.0))   # request ended)
            for h in ("time_to_first_token", "time_per_output_token", "e2e_request_latency")}


def test_metrics_time_plain_requests(url, client):
    """A plain (not streamed) request's first token is timed when it reaches the API process, not when the
    response leaves: TTFT below the end-to-end latency, TPOT above 0."""
    before = _latency_sums(url)
    client.completions.create(model=MODEL, prompt="time me", max_tokens=30, extra_body={"ignore_eos": True})
    wait_idle(url)
    after = _latency_sums(url)
    (ttft, n1), (tpot, n2), (e2e, n3) = [(after[h][0] - before[h][0], after[h][1] - before[h][1]) for h in after]
    assert (n1, n2, n3) == (1, 1, 1)
    assert 0 < ttft < e2e and tpot > 0 and ttft + 29 * tpot == pytest.approx(e2e, rel=1e-3, abs=1e-3)


def test_a_prompt_too_long_to_fit_is_refused_before_it_is_encoded(url):
    """A text prompt longer than max_model_len tokens of the vocabulary's longest entry could be: 400 at once,
    without encoding it (tokens.prompt_char_limit); with truncate_prompt_tokens it is encoded and truncated."""
    body = {"model": MODEL, "prompt": "ab " * 700_000, "max_tokens": 1}
    r = post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert "2100000 characters" in r.json()["error"]["message"]
    ok = post(url + "/v1/completions", json={**body, "prompt": "ab " * 20_000, "truncate_prompt_tokens": 8},
                    timeout=120)
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 8


def test_echo_is_the_prompt_as_sent(url, client):
    """vLLM echoes the request's text, not its tokens decoded (a tokenizer may normalise it, e.g. to NFC)."""
    for prompt in ("Cafe\u0301 menu", "  two  spaces\t"):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, temperature=0)
        assert r.choices[0].text.startswith(prompt)
        chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, temperature=0,
                                           stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
        ids = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=0, echo=True).choices[0].text
        assert ids == post(url + "/detokenize", json={"tokens": [5, 6, 7]}).json()["prompt"]


def test_tokenize_detokenize_version_docs(url, tiny_dir):
    t = post(url + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert t["count"] == len(t["tokens"]) > 0 and t["max_model_len"] == 128 and len(t["token_strs"]) == t["count"]
    tok = load_tokenizer(tiny_dir)                                 # token_strs: the vocabulary's strings, as vLLM's
    u = post(url + "/tokenize", json={"prompt": "é 你好 world", "return_token_strs": True}).json()
    assert u["token_strs"] == tok.convert_ids_to_tokens(u["tokens"]) and "\ufffd" not in "".join(u["token_strs"])
    assert post(url + "/detokenize", json={"tokens": t["tokens"]}).json()["prompt"] == "Hello world"
    chat = post(url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > t["count"] - 2
    # vLLM's TokenizeChatRequest fields: null means absent; continue_final_message leaves the last message open
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    open_ = post(url + "/tokenize", json={"messages": msgs, "add_generation_prompt": False, "tools": None,
                                                "continue_final_message": True, "chat_template": None}).json()
    closed = post(url + "/tokenize", json={"messages": msgs, "add_generation_prompt": False}).json()
    assert open_["tokens"] == closed["tokens"][:open_["count"]] and open_["count"] < closed["count"]
    bad = post(url + "/tokenize", json={"messages": msgs, "chat_template": "{{ messages }}"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template"
    bad = post(url + "/tokenize", json={"messages": msgs, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template"
    assert post(url + "/detokenize", json={"tokens": [10**9]}).status_code == 400
    assert "eos_token" in httpx.get(url + "/tokenizer_info").json()
    assert httpx.get(url + "/version").json()["version"]
    schema = httpx.get(url + "/openapi.json").json()
    props = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "logprobs", "echo", "n", "presence_penalty"} <= set(props)
    docs = httpx.get(url + "/docs").text
    assert "cdn" not in docs and "/docs-static/swagger-ui-bundle.js" in docs      # no network needed
    assert httpx.get(url + "/docs-static/swagger-ui-bundle.js").status_code == 200


def test_body_size_limit(server, url):
    app = server[1]
    before = app.state.options
    app.state.options = before.replace(max_request_body_bytes=1000)
    try:
        r = post(url + "/v1/completions", json={"model": MODEL, "prompt": "x" * 2000})
        def chunks():
            yield b'{"model": "tiny-qwen3", "prompt": "'
            yield b"y" * 2000
            yield b'"}'
        r2 = post(url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    finally:
        app.state.options = before
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert r2.status_code == 413


def test_vllm_request_fields_cors_ping_and_empty_model(url, client):
    """vLLM's chat fields (add_generation_prompt, continue_final_message, echo; they win over chat_template_kwargs),
    add_special_tokens, model "" (the served model), a browser's CORS preflight without the API key, /ping."""
    msgs = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi th"}]
    tok = lambda **kw: post(url + "/tokenize", json={"messages": msgs, **kw}).json()["tokens"]   # noqa: E731
    kw = dict(model=MODEL, messages=msgs, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    cont = client.chat.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "add_generation_prompt": False,
                                                                  "continue_final_message": True, "echo": True}})
    spaced = client.chat.completions.create(**{**kw, "extra_body": {"ignore_eos": True,
                                                                    "spaces_between_special_tokens": False}})
    assert spaced.usage.completion_tokens == 3                          # vLLM's field, accepted
    msg = cont.choices[0].message         # the last message, left open, is continued; echo puts its text first
    assert msg.role == "assistant" and msg.content.startswith("Hi th") and len(msg.content) > len("Hi th")
    assert cont.usage.prompt_tokens == len(tok(add_generation_prompt=False)) - 2       # without "<|im_end|>\n"
    same = client.chat.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "chat_template_kwargs": {
        "add_generation_prompt": False, "continue_final_message": True}}})
    assert same.usage.prompt_tokens == len(tok())       # current vLLM: the request's own fields win over the kwargs
    chunks = list(client.chat.completions.create(**{**kw, "stream": True, "extra_body": {
        "ignore_eos": True, "add_generation_prompt": False, "continue_final_message": True, "echo": True}}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    plain = client.chat.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "echo": True}})
    assert plain.usage.prompt_tokens == len(tok()) and plain.choices[0].message.content.startswith("Hi th")
    user = client.chat.completions.create(**{**kw, "messages": msgs[:1], "extra_body": {"echo": True}})
    assert not user.choices[0].message.content.startswith("Hello")        # the answer's role is not the user's
    both = post(url + "/v1/chat/completions", json={"messages": msgs, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    r = post(url + "/v1/completions", json={"model": "", "prompt": PROMPT, "max_tokens": 1,
                                                  "add_special_tokens": True})
    assert r.status_code == 200 and r.json()["model"] == MODEL
    pre = httpx.options(url + "/v1/completions", headers={"Origin": "http://example.com",
                                                          "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
    assert httpx.get(url + "/ping").json() == post(url + "/ping").json() == {"status": "ok"}
    big = post(url + "/v1/completions", json={"prompt": "a", "truncate_prompt_tokens": 10**5})
    assert big.status_code == 400 and big.json()["error"]["param"] == "truncate_prompt_tokens"


def test_a_dropped_last_message_that_the_answer_repeats_must_be_text(tiny_dir, tmp_path_factory):
    """A template that drops unknown roles (Qwen3's does) never tokenizes the last message, yet without
    add_generation_prompt the answer takes its role (and with echo its content): a lone surrogate there is a 400
    naming messages, not a 500 or a stream cut off after its headers."""
    from jaxinfer.server.options import ServerOptions
    template = ("{% for m in messages %}{% if m.role in ('user', 'assistant') %}<|im_start|>{{ m.role }}\n"
                "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
                "<|im_start|>assistant\n{% endif %}")
    for url, _ in run_server(tiny_dir, tmp_path_factory, options=ServerOptions(chat_template=template)):
        last = [b'{"role": "\\ud800", "content": "x"}', b'{"role": "bot", "content": "\\ud800"}']
        for m, extra in [(last[0], b""), (last[0], b', "stream": true'), (last[1], b', "echo": true')]:
            body = b'{"messages": [{"role": "user", "content": "hi"}, ' + m + b'], "max_tokens": 2, ' \
                   b'"add_generation_prompt": false' + extra + b'}'
            r = post(url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                           timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        ok = post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                             "max_tokens": 2}, timeout=60)
        st = wait_idle(url)
        assert ok.status_code == 200 and st["kv_blocks_free"] == st["kv_blocks_total"], (ok.text, st)


def _sse(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_return_token_ids_and_tokens_as_token_ids(url, tok):
    """vLLM's return_token_ids: completion choices carry prompt_token_ids and token_ids (a stream: the prompt's in
    each choice's first chunk, each chunk its new ids); a chat response carries prompt_token_ids at its top (a
    stream: in its role chunks) and token_ids per choice. With echo the prompt's text is left out (vLLM's).
    return_tokens_as_token_ids names logprob tokens "token_id:N"."""
    prompt = [5, 6, 7, 8, 9]
    base = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, ignore_eos=True, return_token_ids=True)
    plain = post(url + "/v1/completions", json={**base, "return_token_ids": None}).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain
    c = post(url + "/v1/completions", json=base).json()["choices"][0]
    assert c["prompt_token_ids"] == prompt and len(c["token_ids"]) == 6 and c["text"] == plain["text"]
    assert "".join(tok(t) for t in c["token_ids"]) == c["text"]
    tokens = post(url + "/v1/completions", json={**base, "logprobs": 2}).json()["choices"][0]["logprobs"]
    tokens = tokens["tokens"]
    for lp in (None, 2):                             # (streamed logprobs: their own path)
        chunks = [ch["choices"][0] for ch in _sse(url, "/v1/completions", {**base, "logprobs": lp}) if ch["choices"]]
        assert chunks[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in ch for ch in chunks[1:])
        assert [t for ch in chunks for t in ch["token_ids"]] == c["token_ids"]
        assert "".join(ch["text"] for ch in chunks) == c["text"]
        assert lp is None or [t for ch in chunks for t in ch["logprobs"]["tokens"]] == tokens and len(tokens) == 6
    echo = post(url + "/v1/completions", json={**base, "echo": True, "logprobs": 1}).json()["choices"][0]
    assert echo["text"] == c["text"] and echo["token_ids"] == c["token_ids"]           # (the prompt's text left out)
    assert len(echo["logprobs"]["tokens"]) == len(prompt) + 6
    only = post(url + "/v1/completions", json={**base, "echo": True, "max_tokens": 0}).json()["choices"][0]
    assert only["prompt_token_ids"] == prompt and only["token_ids"] == [] and only["text"] == ""
    stop = post(url + "/v1/completions", json={**base, "stop": [tok(c["token_ids"][2])]}).json()["choices"][0]
    assert stop["finish_reason"] == "stop" and stop["token_ids"] == c["token_ids"][:3]

    ids_lp = post(url + "/v1/completions", json={**base, "logprobs": 2, "return_tokens_as_token_ids": True})
    lp = ids_lp.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
    assert all(set(top) >= {f"token_id:{t}"} for top, t in zip(lp["top_logprobs"], c["token_ids"]))

    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0,
                ignore_eos=True, return_token_ids=True)
    full = post(url + "/v1/chat/completions", json=chat).json()
    pids, out = full["prompt_token_ids"], full["choices"][0]
    assert len(pids) == full["usage"]["prompt_tokens"] and len(out["token_ids"]) == 5
    events = _sse(url, "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 1})
    assert events[0]["prompt_token_ids"] == pids and "prompt_token_ids" not in events[1]
    assert [t for e in events[1:] for t in e["choices"][0].get("token_ids", [])] == out["token_ids"]
    named = post(url + "/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 2,
                                                           "return_tokens_as_token_ids": True})
    content = named.json()["choices"][0]["logprobs"]["content"]
    assert [x["token"] for x in content] == [f"token_id:{t}" for t in out["token_ids"]]
    plain = post(url + "/v1/chat/completions", json={**chat, "logprobs": True}).json()
    assert [x["bytes"] for x in content] == [x["bytes"] for x in plain["choices"][0]["logprobs"]["content"]]  # (vLLM's)
    assert all(t["bytes"] == list(t["token"].encode()) and t["token"].startswith("token_id:")
               for x in content for t in x["top_logprobs"])


def test_reasoning_parser_on_the_server(server, url, tiny_dir):
    """--reasoning-parser qwen3: an answer without </think> is all thinking (cut off), unless the prompt closed the
    thinking (enable_thinking false): then all content; streamed as the plain answer; structured outputs apply after
    the thinking (vLLM's), or from the first token of a prompt that closed it; a multi-turn assistant message may
    carry its `reasoning` (vLLM's field, given to the template as reasoning_content too)."""
    app, before = server[1], server[1].state.options
    app.state.options = before.replace(reasoning_parser="qwen3")
    try:
        msgs = [{"role": "user", "content": "Hi"}]
        base = dict(model=MODEL, max_tokens=8, temperature=0, ignore_eos=True)
        for extra, key, other in (({}, "reasoning", "content"),
                                  ({"chat_template_kwargs": {"enable_thinking": False}}, "content", "reasoning")):
            ids = post(url + "/tokenize", json={"model": MODEL, "messages": msgs, **extra}).json()["tokens"]
            text = post(url + "/v1/completions", json={**base, "prompt": ids}).json()["choices"][0]["text"]
            assert text and "think>" not in text
            body = {**base, "messages": msgs, **extra}
            msg = post(url + "/v1/chat/completions", json=body).json()["choices"][0]["message"]
            assert msg[key] == text and msg[other] is None
            deltas = [e["choices"][0]["delta"] for e in _sse(url, "/v1/chat/completions", body) if e["choices"]]
            assert "".join(d.get(key) or "" for d in deltas) == text and not any(d.get(other) for d in deltas)
        end = load_tokenizer(tiny_dir).convert_tokens_to_ids("</think>")    # (not special, as Qwen3's: in the text)
        think = {"logit_bias": {str(end): 100}}                  # (the thinking ends at once)
        for extra in ({"guided_choice": ["yes", "no"]}, {"structured_outputs": {"choice": ["yes", "no"]}},
                      {"response_format": {"type": "json_object"}}):
            body = {**base, "messages": msgs, "ignore_eos": False, "max_tokens": 40, **extra}
            msg = post(url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
            assert msg["content"] is None and msg["reasoning"]       # (constrained after </think>: none came)
            body.update(think)                                       # (structured outputs after the thinking)
            msg = post(url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
            assert msg["reasoning"] is None and (msg["content"] in ("yes", "no") if "json" not in str(extra) else
                                                 isinstance(json.loads(msg["content"]), dict)), msg
            deltas = [e["choices"][0]["delta"] for e in _sse(url, "/v1/chat/completions", body) if e["choices"]]
            assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
            closed = {**body, "chat_template_kwargs": {"enable_thinking": False}}     # (from the first token)
            msg = post(url + "/v1/chat/completions", json=closed, timeout=60).json()["choices"][0]["message"]
            assert msg["reasoning"] is None and msg["content"]
        cont = {**base, "ignore_eos": False, "guided_choice": ["yes", "no"], "add_generation_prompt": False,
                "continue_final_message": True, "messages": [*msgs, {"role": "assistant", "content":
                                                                     "<think>\nok\n</think>\n\nThe answer is "}]}
        msg = post(url + "/v1/chat/completions", json=cont, timeout=60).json()["choices"][0]["message"]
        assert msg["content"] in ("yes", "no") and msg["reasoning"] is None, msg     # (its thinking was closed)
        turn = [*msgs, {"role": "assistant", "content": "Hello", "reasoning": "greet"},
                {"role": "user", "content": "Bye"}]
        assert post(url + "/v1/chat/completions", json={**base, "messages": turn}).status_code == 200
        turn[1] = {"role": "user", "content": "Hello", "reasoning": "greet"}          # (an assistant's only)
        assert post(url + "/v1/chat/completions", json={**base, "messages": turn}).status_code == 400
    finally:
        app.state.options = before


def test_response_role_flag(server, url):
    """vLLM's --response-role: the role of an answer that opens the assistant's turn (streamed: the role chunk);
    with add_generation_prompt false the answer keeps the last message's role."""
    app, before = server[1], server[1].state.options
    app.state.options = before.replace(response_role="bot")
    try:
        body = dict(model=MODEL, max_tokens=2, temperature=0, messages=[{"role": "user", "content": "Hi"}])
        assert post(url + "/v1/chat/completions", json=body).json()["choices"][0]["message"]["role"] == "bot"
        assert _sse(url, "/v1/chat/completions", body)[0]["choices"][0]["delta"]["role"] == "bot"
        turns = [*body["messages"], {"role": "tool", "content": "x"}]
        cont = {**body, "add_generation_prompt": False, "messages": turns}
        assert post(url + "/v1/chat/completions", json=cont).json()["choices"][0]["message"]["role"] == "tool"
    finally:
        app.state.options = before


def test_logit_bias_and_allowed_token_ids(client, url):
    """OpenAI's logit_bias (string keys, clamped to [-100, 100] as vLLM's) and vLLM's allowed_token_ids, through the
    openai client: a bias of 100 forces its token (completions, chat, streamed), a mask keeps the answer in it; the
    engine's KV blocks all come back."""
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.7, seed=1,
                                  logit_bias={"77": 500}, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == [77] * 4
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          temperature=1.0, extra_body={"allowed_token_ids": [40, 41],
                                                                       "ignore_eos": True, "return_token_ids": True})
    assert set(chat.choices[0].model_extra["token_ids"]) <= {40, 41}
    events = _sse(url, "/v1/completions", dict(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                               logit_bias={"300": 100}, ignore_eos=True, return_token_ids=True))
    assert [t for e in events if e["choices"] for t in e["choices"][0].get("token_ids") or []] == [300] * 3
    banned = post(url + "/v1/completions", json=dict(model=MODEL, prompt=PROMPT, max_tokens=4, min_tokens=2,
                                                           stop_token_ids=[40], allowed_token_ids=[40]))
    assert banned.status_code == 400 and "all stop or EOS ids" in banned.json()["error"]["message"]
    st = wait_idle(url)
    assert st["kv_blocks_free"] == st["kv_blocks_total"]


def test_bad_words(client, url, tiny_dir):
    """vLLM's bad_words through the openai client: the greedy answer's first token, banned as a word, is not
    sampled (completions and chat, streamed too); a word that makes no token or a list that is not of strings is a
    400 naming bad_words; the KV blocks all come back."""
    from jaxinfer import bad_words as bw
    from jaxinfer.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(tiny_dir)
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, ignore_eos=True, return_token_ids=True)
    plain = post(url + "/v1/completions", json=body).json()["choices"][0]["token_ids"]
    word = next(w for t in plain if (w := tokenizer.decode([t])).strip() and not w[0].isspace() and
                tokenizer.encode(w, add_special_tokens=False) == [t])
    banned = {s[0] for s in bw.token_ids(tokenizer, [word], 10**6) if len(s) == 1}
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                  extra_body={"bad_words": [word], "ignore_eos": True, "return_token_ids": True})
    got = r.choices[0].model_extra["token_ids"]
    assert got != plain and not banned & set(got) and banned & set(plain)
    events = _sse(url, "/v1/completions", {**body, "bad_words": [word]})
    assert [t for e in events if e["choices"] for t in e["choices"][0].get("token_ids") or []] == got
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                          temperature=0.9, seed=2, extra_body={"bad_words": [word], "ignore_eos": True,
                                                                               "return_token_ids": True})
    assert not banned & set(chat.choices[0].model_extra["token_ids"])
    for bad in ([""], "x", [3]):
        r = post(url + "/v1/completions", json={**body, "bad_words": bad})
        assert r.status_code == 400 and "bad_words" in (r.json()["error"]["param"] or "") + \
            r.json()["error"]["message"], (bad, r.text)
    st = wait_idle(url)
    assert st["kv_blocks_free"] == st["kv_blocks_total"]


def test_vllms_request_id(client, url):
    """vLLM's answer ids: cmpl- / chatcmpl- and the X-Request-Id header if given, else the body's request_id, else a
    new uuid; every chunk of a stream carries it. (And vLLM's X-data-parallel-rank header: 0 of one replica.)"""
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"request_id": "mine-1"})
    assert r.id == "cmpl-mine-1"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                          extra_body={"request_id": "body"}, extra_headers={"X-Request-Id": "hdr"})
    assert chat.id == "chatcmpl-hdr"
    events = _sse(url, "/v1/chat/completions", dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=3, request_id="s1"))
    assert events and {e["id"] for e in events} == {"chatcmpl-s1"}
    ids = [client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).id for _ in range(2)]
    assert ids[0] != ids[1] and all(len(i) == len("cmpl-") + 32 for i in ids)
    assert post(url + "/v1/completions", json=dict(prompt=PROMPT, request_id=5)).status_code == 400
    one = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1,     # (one replica: rank 0 only)
                                    extra_headers={"X-data-parallel-rank": "0"})
    assert one.choices[0].finish_reason == "length"
    r = post(url + "/v1/completions", json=dict(prompt=PROMPT), headers={"X-data-parallel-rank": "1"})
    assert r.status_code == 400 and "X-data-parallel-rank '1'" in r.json()["error"]["message"], r.text


def test_structured_outputs_choice(client, url):
    """vLLM's structured_outputs {"choice": [...]} and older guided_choice: every answer (n samples, chat, streamed)
    is one of the choices, one spelled by byte pieces too; the grammar kind, both forms at once and an empty list are
    400s naming the field."""
    choices = ["positive", "negative", "neutral"]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.5, seed=3, n=4,
                                  extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.text in choices and c.finish_reason == "stop" for c in r.choices)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=12,
                                          temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    assert chat.choices[0].message.content in ("yes", "no")
    events = _sse(url, "/v1/chat/completions", dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=12, temperature=0, guided_choice=["yes", "no"]))
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text == chat.choices[0].message.content
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=4)
    for bad in ({"structured_outputs": {"grammar": "root ::= 'a'"}}, {"structured_outputs": {"choice": []}},
                {"structured_outputs": {"choice": ["a"]}, "guided_choice": ["b"]},
                {"guided_choice": []}):
        r = post(url + "/v1/completions", json={**body, **bad})
        want = "structured_outputs" if "structured_outputs" in bad else "guided_choice"    # (the field used)
        assert r.status_code == 400 and r.json()["error"]["param"] == want, (bad, r.text)
    snow = post(url + "/v1/completions", json={**body, "max_tokens": 8, "guided_choice": ["\u2603"]}).json()
    assert snow["choices"][0]["text"] == "\u2603"          # (byte pieces only: the regex path)
    lp = post(url + "/v1/completions", json={**body, "max_tokens": 6, "logprobs": 3, "guided_choice": ["yes"]})
    assert lp.status_code == 200, lp.text          # (masked tokens' -inf logprobs as vLLM's -9999.0: JSON has no inf)
    assert min(v for top in lp.json()["choices"][0]["logprobs"]["top_logprobs"] for v in top.values()) == -9999.0
    streamed = _sse(url, "/v1/chat/completions", dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                       max_tokens=6, logprobs=True, top_logprobs=3,
                                                       guided_choice=["yes"]))
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in streamed if e["choices"]) == "yes"
    st = wait_idle(url)
    assert st["kv_blocks_free"] == st["kv_blocks_total"]


def test_structured_outputs_json_and_regex(client, url):
    """OpenAI's response_format (json_schema, json_object) and vLLM's structured_outputs json / regex and guided_json /
    guided_regex: answers match (JSON parses to the schema's keys), streamed the same; bad forms are 400s naming
    the field; every KV block returns."""
    import regex
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
              "required": ["color", "ok"]}
    msgs = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert chat.choices[0].finish_reason == "stop", chat
    got = json.loads(chat.choices[0].message.content)
    assert set(got) == {"color", "ok"} and got["color"] in ("red", "green") and isinstance(got["ok"], bool)
    events = _sse(url, "/v1/chat/completions", dict(model=MODEL, messages=msgs, max_tokens=40, temperature=0,
                                                     structured_outputs={"json": schema}))
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == \
        chat.choices[0].message.content
    pattern = r"(cat|dog)s? [0-9]{1,2}!"
    for extra in ({"guided_regex": pattern}, {"structured_outputs": {"regex": pattern}}):
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=1.5, seed=2, n=3,
                                      extra_body=extra)
        assert all(regex.fullmatch(pattern, c.text) and c.finish_reason == "stop" for c in r.choices), r
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                  extra_body={"guided_json": json.dumps(schema)})
    assert json.loads(r.choices[0].text)["color"] in ("red", "green")
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, extra_body={
        "guided_json": schema, "guided_whitespace_pattern": "", "guided_decoding_backend": "xgrammar"})  # (vLLM's)
    assert json.loads(r.choices[0].text)["color"] in ("red", "green") and " " not in r.choices[0].text
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})   # (as vLLM's)
    assert r.choices[0].text.startswith("{")
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=4)
    for bad, want in (({"response_format": {"type": "xml"}}, "response_format"),
                      ({"response_format": {"type": "json_schema", "json_schema": "x"}}, "response_format"),
                      ({"response_format": {"type": "json_schema"}}, "response_format"),    # (no schema: OpenAI 400s)
                      ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format"),
                      ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format"),
                      ({"guided_regex": "a("}, "guided_regex"), ({"guided_json": "{bad"}, "guided_json"),
                      ({"guided_json": {"type": "string", "pattern": "\\x4"}}, "guided_json"),    # (bad escape)
                      ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
                      ({"structured_outputs": {"regex": "a"}, "guided_json": {}}, "structured_outputs")):
        r = post(url + "/v1/completions", json={**body, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == want, (bad, r.text)
    st = wait_idle(url)
    assert st["kv_blocks_free"] == st["kv_blocks_total"]


def test_index_builds_wait_off_the_tokenizer_thread(url, monkeypatch):
    """A new json / regex index is awaited on the event loop, not on the tokenizer thread: while one is (held)
    building, other requests are tokenized and answered; released, its request answers a match. One past
    grammar.BUILD_TIMEOUT_S is a 400 naming the request's field."""
    import concurrent.futures

    import regex

    from jaxinfer import grammar
    gate = threading.Event()

    class Held(grammar._Build):                   # (its thread builds once the gate opens)
        def __init__(self, regex, vocab, limit):
            super().__init__(regex, vocab, limit, make=lambda *a: gate.wait(30) and grammar.index_worker.build(*a))
    monkeypatch.setattr(grammar, "_Build", Held)
    pattern = r"(held|kept) [0-9]{2}!"
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(httpx.post, url + "/v1/completions", json={**body, "guided_regex": pattern}, timeout=60)
        time.sleep(0.3)
        for _ in range(3):                     # (the tokenizer thread is free: these do not wait for the index)
            r = post(url + "/v1/completions", json={**body, "prompt": "other text"}, timeout=10)
            assert r.status_code == 200 and not held.done()
        gate.set()
        r = held.result()
    assert r.status_code == 200 and regex.fullmatch(pattern, r.json()["choices"][0]["text"]), r.text
    monkeypatch.setattr(grammar, "_Build", Held.__base__)
    monkeypatch.setattr(grammar, "BUILD_TIMEOUT_S", 0.0)
    r = post(url + "/v1/completions", json={**body, "structured_outputs": {"json": {
        "type": "string", "maxLength": 13}}}, timeout=60)                # (~0.2 s to index: past 0 s)
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text
    assert "takes over 0 s to index" in r.json()["error"]["message"]
    st = wait_idle(url)
    assert st["kv_blocks_free"] == st["kv_blocks_total"]


def test_forced_tool_choice(client, url):
    """vLLM's tool_choice "required" and a named function, without the tool-call flags: the answer is constrained
    to the function's parameters schema (named) or a list of {name, parameters} (required), and comes back as
    tool_calls with content "" and finish_reason "stop" (named) or "tool_calls" (required), streamed the same."""
    params = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
              "required": ["color", "ok"]}
    tools = [{"type": "function", "function": {"name": "paint", "parameters": params}},
             {"type": "function", "function": {"name": "wait", "parameters": {
                 "type": "object", "properties": {"long": {"type": "boolean"}}, "required": ["long"]}}}]
    msgs = [{"role": "user", "content": "Hi"}]
    named = client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=40, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "paint"}})
    c = named.choices[0]
    assert c.finish_reason == "stop" and c.message.content == "" and len(c.message.tool_calls) == 1, c
    assert c.message.tool_calls[0].function.name == "paint"
    assert json.loads(c.message.tool_calls[0].function.arguments)["color"] in ("red", "green")
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=100, temperature=1.0,
                                           seed=seed, tool_choice="required", parallel_tool_calls=False)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content == "" and len(c.message.tool_calls) == 1, c
        call = c.message.tool_calls[0].function
        assert set(json.loads(call.arguments)) == ({"color", "ok"} if call.name == "paint" else {"long"})
        events = _sse(url, "/v1/chat/completions", dict(model=MODEL, messages=msgs, tools=tools, max_tokens=100,
                                                         temperature=1.0, seed=seed, tool_choice="required",
                                                         parallel_tool_calls=False, stream=True))
        got = [t for e in events if e["choices"] for t in e["choices"][0]["delta"].get("tool_calls") or []]
        assert [(t["function"]["name"], t["function"]["arguments"]) for t in got] == [(call.name, call.arguments)]
        assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "tool_calls"
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "bogus"}}}}}]
    r = post(url + "/v1/chat/completions", json=dict(model=MODEL, messages=msgs, tools=bad,
                                                           tool_choice="required"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    st = wait_idle(url)
    assert st["kv_blocks_free"] == st["kv_blocks_total"]


def test_vllms_prompt_logprobs(client, url, ref, tok):
    """vLLM's prompt_logprobs: per prompt token None (the first) or {id: {logprob, rank, decoded_token}}, the token
    first, then the k most likely; on completion choices (every sample of n) and at the top of a chat answer; with
    stream and k > 0 a 400 (vLLM's words); with echo + logprobs the two widths are each their own."""
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0.8, seed=1, n=2, logprobs=1,
                                  echo=True, extra_body={"prompt_logprobs": 3})
    want = ref(PROMPT)
    for c in r.choices:
        plp = c.model_extra["prompt_logprobs"]
        assert len(plp) == len(PROMPT) and plp[0] is None
        for i in range(1, len(PROMPT)):
            entries = list(plp[i].items())
            assert entries[0][0] == str(PROMPT[i]) and len(plp[i]) <= 4
            np.testing.assert_allclose(entries[0][1]["logprob"], want[i - 1, PROMPT[i]], atol=2e-3)
            assert abs(entries[0][1]["rank"] - 1 - int(np.sum(want[i - 1] > want[i - 1, PROMPT[i]]))) <= 1  # (ties)
            best = [str(t) for t in np.argsort(want[i - 1])[::-1][:3]]
            assert {k for k, v in plp[i].items() if v["rank"] <= 3} == set(best)
            assert entries[0][1]["decoded_token"] == tok(PROMPT[i]) or "\ufffd" in tok(PROMPT[i])
        assert all(len(top) <= 2 for top in c.logprobs.top_logprobs[1:])           # echo's own width (1)
    hi = [{"role": "user", "content": "Hi"}]
    chat = post(url + "/v1/chat/completions", json={"model": MODEL, "messages": hi, "max_tokens": 1,
                                                          "prompt_logprobs": 0, "return_token_ids": True}).json()
    assert len(chat["prompt_logprobs"]) == len(chat["prompt_token_ids"]) and chat["prompt_logprobs"][0] is None
    assert all(len(d) == 1 for d in chat["prompt_logprobs"][1:])
    ask = {"model": MODEL, "prompt": "hi"}
    bad = post(url + "/v1/completions", json={**ask, "prompt_logprobs": 2, "stream": True})
    assert bad.status_code == 400 and "not available when `stream=True`" in bad.json()["error"]["message"]
    assert post(url + "/v1/completions", json={**ask, "prompt_logprobs": 21}).status_code == 400


def test_vllms_beam_search(client, url, tiny_dir):
    """vLLM's use_beam_search (n = beam width, length_penalty): the choices are the n best beams of vLLM's search over
    transformers' logprobs, best first (text: the generated tokens', an ending EOS left out); the same streamed (each
    choice whole), in chat, and with logprobs; fields a beam search does not use are 400s naming them; a client that
    leaves a plain search ends it."""
    from helpers import hf_beam_search
    eos = load_tokenizer(tiny_dir).eos_token_id
    prompt = [45, 147, 254, 307, 154, 12, 290, 203]          # (an EOS beam is among its best 3: test_beam_search.py)
    want = hf_beam_search(hf_model(tiny_dir), prompt, 3, 8, eos, 0.7)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, n=3, logprobs=2,
                                  extra_body={"use_beam_search": True, "length_penalty": 0.7, "return_token_ids": True,
                                              "skip_special_tokens": False})
    got = [c.model_extra["token_ids"] for c in r.choices]
    assert [prompt + g for g in got] == [w[0] for w in want]
    assert [c.finish_reason for c in r.choices] == ["stop" if w[0][-1] == eos else "length" for w in want]
    assert "stop" in [c.finish_reason for c in r.choices]
    for c, g, (_, cum) in zip(r.choices, got, want):
        assert sum(c.logprobs.token_logprobs) == pytest.approx(cum, abs=1e-3)
        ids = g[:-1] if g[-1] == eos else g
        text = post(url + "/detokenize", json={"tokens": ids}).json()["prompt"] if ids else ""
        assert c.text == text
    events = _sse(url, "/v1/completions", dict(model=MODEL, prompt=prompt, max_tokens=8, n=3, use_beam_search=True,
                                               length_penalty=0.7, temperature=0, skip_special_tokens=False))
    assert sorted((c["index"], c["text"]) for e in events for c in e["choices"] if c["text"]) == \
        [(i, c.text) for i, c in enumerate(r.choices) if c.text]
    events = _sse(url, "/v1/completions", dict(model=MODEL, prompt=prompt, max_tokens=8, n=3, use_beam_search=True,
                                               length_penalty=0.7, temperature=0, skip_special_tokens=False,
                                               stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(e.get("usage") for e in events) and not events[-1]["choices"]           # (usage in every chunk)
    assert events[-1]["usage"]["completion_tokens"] == r.usage.completion_tokens
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          n=2, extra_body={"use_beam_search": True})
    assert len(chat.choices) == 2 and [c.index for c in chat.choices] == [0, 1]
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=4, use_beam_search=True)
    for bad, param in (({"n": 11}, "n"), ({"top_p": 0.5}, "top_p"), ({"stop": ["x"]}, "stop"), ({"seed": 1}, "seed"),
                       ({"use_beam_search": False, "length_penalty": 2.0}, "length_penalty")):
        r = post(url + "/v1/completions", json={**body, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
    sent = lambda: httpx.get(url + "/stats").json()["api_requests"]      # noqa: E731 (engine requests so far)
    with pytest.raises(httpx.ReadTimeout):      # a plain search whose client leaves ends at its next step (each
        post(url + "/v1/completions", timeout=1.0, json=dict(model=MODEL, prompt=[PROMPT, [7, 8]], max_tokens=110,
                                                              n=10, use_beam_search=True, ignore_eos=True))
    time.sleep(1.0)                             # step can be shorter than the handler's disconnect poll)
    left = sent()
    time.sleep(1.0)
    assert sent() - left <= 2 * 10
    st = wait_idle(url)
    assert st["kv_blocks_free"] == st["kv_blocks_total"]
