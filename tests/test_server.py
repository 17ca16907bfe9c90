"""The OpenAI-compatible server, for real: uvicorn on 127.0.0.1, driven by the `openai` client and raw HTTP."""
import asyncio
import json
import os
import socket
import threading
import time

import httpx
import pytest
import uvicorn

openai = pytest.importorskip("openai")      # the GPU image has no openai: skip there, not fail

from jaxinfer.server import CoreProcess, build_app

# Small engine sizes for the tiny model (CPU, float32, xla backend); the same in test_server_faults.py and
# scripts/bench_serve.py --quick, so that their engine cores share compiled steps (jax_cache_env).
BASE = dict(dtype="float32", attn_backend="xla", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
            kvcache_block_size=4, num_kvcache_blocks=256, warmup=False,
            num_scheduler_steps=1)   # one token per engine call: the abort tests race a request's end otherwise
MODEL = "tiny-qwen3"


def jax_cache_env(tmp_path_factory) -> dict:
    """A persistent compilation cache for this session's engine-core processes (each compiles the same steps
    again otherwise: ~5 s a process on CPU)."""
    path = tmp_path_factory.getbasetemp() / "serve_jax_cache"
    path.mkdir(exist_ok=True)
    return {"JAX_COMPILATION_CACHE_DIR": str(path), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BASE_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")


def run_server(model_dir, tmp_path_factory, engine=None, **app_kw):
    """The engine core in its own (spawned) process (BASE, `engine` over it); the API app on uvicorn in a thread of
    this process. A generator (for fixtures): yields (url, app)."""
    with pytest.MonkeyPatch.context() as mp:      # the core's environment, copied when it is spawned
        for k, v in jax_cache_env(tmp_path_factory).items():
            mp.setenv(k, v)
        core = CoreProcess(model_dir, {**BASE, **(engine or {})})
    app = build_app(core.info, MODEL, alive=core.alive, **app_kw)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "server failed to start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{server.config.port}", app
    server.should_exit = True
    thread.join(timeout=30)
    assert core.shutdown() == 0, "the engine core did not exit cleanly"


@pytest.fixture(scope="module")
def url(tiny_dir, tmp_path_factory):
    for u, _ in run_server(tiny_dir, tmp_path_factory):
        yield u


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def wait_idle(url, timeout=30.0) -> dict:
    end = time.time() + timeout
    while True:
        st = httpx.get(url + "/stats").json()
        if st["running"] == st["waiting"] == 0:
            return st
        assert time.time() < end, f"the engine did not become idle in {timeout} s: {st}"
        time.sleep(0.02)


def test_models_and_health(url, client):
    # the first request to the core right after start-up is answered at once (the core's answers to an API
    # process whose socket had not connected yet were dropped: /stats waited 60 s, a completion forever)
    assert httpx.get(url + "/stats", timeout=10).status_code == 200
    assert [m.id for m in client.models.list().data] == [MODEL]
    card = httpx.get(url + "/v1/models").json()["data"][0]               # vLLM's card fields
    assert card["max_model_len"] == 128 and card["root"] and card["parent"] is None
    assert card["permission"][0]["object"] == "model_permission" and card["permission"][0]["allow_sampling"]
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_core_sets_its_own_xla_flags_only(url):
    """The core owns its process: the fast command-buffer mode is set there where it applies (jaxlib 0.11),
    never in this process (which spawned it)."""
    from jaxinfer.xla_options import command_buffer_flags
    st = httpx.get(url + "/stats").json()
    assert st["engine_core_xla_flags"] == command_buffer_flags(dict(os.environ, XLA_FLAGS=BASE_XLA_FLAGS))
    assert os.environ.get("XLA_FLAGS", "") == BASE_XLA_FLAGS


def test_completion_stream_equals_non_stream(url, client):
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0)
    full = client.completions.create(**kw)
    assert full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.prompt_tokens > 0 and 0 < full.usage.completion_tokens <= 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    kw["logprobs"] = 2                                  # streamed logprobs: the same tokens, logprobs and offsets
    lp = client.completions.create(**kw).choices[0].logprobs
    parts = [c.choices[0].logprobs for c in client.completions.create(**kw, stream=True) if c.choices]
    for key in ("tokens", "token_logprobs", "text_offset", "top_logprobs"):
        assert [x for p in parts for x in getattr(p, key)] == getattr(lp, key), key


def test_stream_options_usage_in_every_chunk_and_one_created(url, client):
    """vLLM's stream_options: include_usage (default false, as current vLLM and OpenAI) adds a last chunk with the
    usage; with it, continuous_usage_stats puts each choice's usage so far in every chunk; every chunk of a stream
    has the same `created` (OpenAI)."""
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=6, temperature=0, stream=True)
    full = client.completions.create(**{k: v for k, v in kw.items() if k != "stream"})
    chunks = list(client.completions.create(**kw, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens and not chunks[-1].choices
    assert all(c.usage is None for c in chunks[:-1])
    for so in ({}, {"include_usage": False}, {"continuous_usage_stats": True}):
        assert not any(c.usage for c in client.completions.create(**kw, stream_options=so)), so
    usage = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(**{**kw, "temperature": 0.8}, n=2, seed=1, stream_options=usage,
                                            extra_body={"ignore_eos": True}))     # (n > 1: not greedy, as vLLM)
    assert all(c.usage is not None for c in chunks) and len({c.created for c in chunks}) == 1
    for i in range(2):
        mine = [c.usage for c in chunks if c.choices and c.choices[0].index == i]
        assert all(u.prompt_tokens == full.usage.prompt_tokens for u in mine)
        assert [u.completion_tokens for u in mine] == sorted(u.completion_tokens for u in mine)
        assert mine[-1].completion_tokens == 6
    assert chunks[-1].usage.completion_tokens == 2 * 6
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0, stream=True,
                logprobs=True, top_logprobs=2, stream_options=usage)
    chunks = list(client.chat.completions.create(**chat))
    assert all(c.usage is not None for c in chunks) and len({c.created for c in chunks}) == 1
    assert chunks[0].usage.completion_tokens == 0 and chunks[-2].usage.completion_tokens == chunks[-1].usage.completion_tokens
    # vLLM's chat stream: the finish rides on the chunk with the last token, so the usage grows on every chunk
    # with a choice (before, a separate empty finish chunk repeated the last count)
    for lp in (False, True):
        chunks = list(client.chat.completions.create(**dict(chat, max_tokens=10, logprobs=lp, top_logprobs=lp and 2),
                                                     extra_body={"ignore_eos": True, "min_tokens": 10}))
        with_choice = [c for c in chunks if c.choices]
        assert [c.choices[0].finish_reason for c in with_choice].count("length") == 1
        assert with_choice[-1].choices[0].finish_reason == "length" and not chunks[-1].choices
        assert isinstance(with_choice[-1].choices[0].delta.content, str)      # "" when the last token adds no text
        counts = [c.usage.completion_tokens for c in with_choice]
        assert counts == sorted(set(counts)) and counts[-1] == 10, counts


def test_chat_stream_equals_non_stream(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hello world! 你好"}], max_tokens=10,
              temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    full = client.chat.completions.create(**kw)
    msg = full.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    assert full.usage.completion_tokens <= 10
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    # stop_token_ids end it on that token: vLLM's stop_reason is the id, in the response and in the last chunk
    assert full.choices[0].model_extra["stop_reason"] is None
    every = dict(kw, extra_body={**kw["extra_body"], "ignore_eos": True, "stop_token_ids": list(range(512))})
    one = client.chat.completions.create(**every)
    assert one.usage.completion_tokens == 1 and one.choices[0].finish_reason == "stop"
    tok = one.choices[0].model_extra["stop_reason"]
    assert isinstance(tok, int) and 0 <= tok < 512
    last = list(client.chat.completions.create(**every, stream=True))[-1].choices[0]
    assert (last.finish_reason, last.model_extra["stop_reason"]) == ("stop", tok)


def test_raw_http_sse_and_batch_prompts(url):
    body = {"model": MODEL, "prompt": ["Hello", [10, 20, 30]], "max_tokens": 5, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200
    texts = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in s.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    got = ["", ""]
    for ln in lines[:-1]:
        c = json.loads(ln.removeprefix("data: "))["choices"][0]
        got[c["index"]] += c["text"]
    assert got == texts


def test_32_concurrent_streams(client, url):
    prompts = [f"Request {i}: hello world {i * 7}" for i in range(32)]
    kw = dict(model=MODEL, max_tokens=8, temperature=0)
    expected = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]

    async def run():
        aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

        async def one(p):
            text = ""
            async for c in await aclient.completions.create(prompt=p, stream=True, **kw):
                text += c.choices[0].text
            return text
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await aclient.close()
    assert asyncio.run(run()) == expected
    st = wait_idle(url)
    assert st["kv_blocks_free"] == st["kv_blocks_total"]


def test_disconnect_mid_stream_frees_blocks(url):
    body = {"model": MODEL, "prompt": "Disconnect me", "max_tokens": 100, "temperature": 0, "ignore_eos": True,
            "stream": True}
    before = wait_idle(url)
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as s:
        for i, _ in enumerate(s.iter_lines()):
            if i >= 3:
                break                     # closing the response drops the connection mid-stream
    end = time.time() + 30
    while (st := wait_idle(url))["api_aborts"] == before["api_aborts"]:
        assert time.time() < end, "the disconnect did not abort the request in the core"
        time.sleep(0.02)
    assert st["api_aborts"] == before["api_aborts"] + 1
    assert st["kv_blocks_free"] == st["kv_blocks_total"]
    assert st["generated_tokens"] - before["generated_tokens"] > 0


def test_disconnect_before_a_plain_answer_aborts_it(url):
    """No streaming: the handler is not cancelled by Starlette; the server notices the client left."""
    # 24 prompts x n=8, 8 at a time (max_num_seqs): at least 24 x 115 steps, far longer than the client waits
    # (3 x 115 steps once ran to the end within the first 0.25 s poll on a fast CPU)
    body = {"model": MODEL, "prompt": [f"Leave {i}" for i in range(24)], "max_tokens": 115, "temperature": 0.5,
            "ignore_eos": True, "n": 8}
    before = wait_idle(url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.1))
    end = time.time() + 30
    while (st := wait_idle(url))["api_aborts"] == before["api_aborts"]:
        assert time.time() < end, "the disconnect did not abort the request in the core"
        time.sleep(0.05)
    assert st["generated_tokens"] - before["generated_tokens"] < 24 * 8 * 115, "it ran to the end"
    assert st["kv_blocks_free"] == st["kv_blocks_total"]


@pytest.mark.parametrize("bad, param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    ({"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"prompt": "hi", "logit_bias": {"x5": 10}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"-5": 10}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"100000": 10}}, "logit_bias"),                 # past the vocabulary
    ({"prompt": "hi", "best_of": 3}, "best_of"),
    ({"prompt": "hi", "no_such_field": 1}, "no_such_field"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "temperature": 2.5}, "temperature"),              # OpenAI's and current vLLM's 0..2
    ({"prompt": "hi", "temperature": 0, "n": 2}, "n"),                  # greedy n > 1 (vLLM's 400)
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "hi", "stop": 5}, "stop"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": 42}, "prompt"),
    ({"prompt": [1, 10**9]}, "prompt"),
    ({"prompt": [True, 2]}, "prompt"),
    (b'{"prompt": "hi \\ud800"}', "prompt"),                 # a lone surrogate: valid JSON, not encodable text
    (b'{"prompt": "hi", "bad_words": ["\\ud800"]}', "bad_words"),                 # (these two were plain-text 500s)
    (b'{"prompt": "hi", "request_id": "\\ud800", "stream": true}', "request_id"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "bad_words": ["\\ud800"]}', "bad_words"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "request_id": "\\ud800"}', "request_id"),
    ({"prompt": "hi", "seed": 2**64}, "seed"),
    ({"prompt": "hi", "top_k": 2**64}, "top_k"),
    ({"prompt": "hi", "stop_token_ids": [2**64]}, "stop_token_ids"),
    ({"prompt": "x" * 400}, "prompt"),
    ({"prompt": "hi", "max_tokens": 500}, "max_tokens"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),     # without stream (as vLLM)
    ({"prompt": "hi", "stream": True, "stream_options": {"bogus": 1}}, "stream_options"),
    ({"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
    ({"prompt": "hi", "user": 5}, "user"),
    ({"prompt": "hi", "allowed_token_ids": [1, 10**9]}, "allowed_token_ids"),
    ({"messages": [{"role": "user", "content": "x" * 400}]}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    # a last message the template drops (an unknown role) is repeated by the answer: a lone surrogate there too
    (b'{"messages": [{"role": "user", "content": "hi"}, {"role": "\\ud800", "content": "x"}], '
     b'"add_generation_prompt": false}', "messages"),
    (b'{"messages": [{"role": "user", "content": "hi"}, {"role": "\\ud800", "content": "x"}], '
     b'"add_generation_prompt": false, "stream": true}', "messages"),
    (b'{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "\\ud800"}], '
     b'"add_generation_prompt": false, "echo": true}', "messages"),
])
def test_invalid_requests_get_400_and_server_keeps_serving(url, bad, param):
    chat = "messages" in (bad if isinstance(bad, dict) else bad.decode())
    route = "/v1/chat/completions" if chat else "/v1/completions"
    if isinstance(bad, dict):
        r = httpx.post(url + route, json={"model": MODEL, **bad} if "model" not in bad else bad, timeout=30)
    else:
        r = httpx.post(url + route, content=bad, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param
    ok = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_json_body_without_a_json_content_type_is_told_so(url, ctype):
    """`curl -d` sends a form content type: the 400 says the body must be sent as application/json."""
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    r = httpx.post(url + "/v1/completions", content=body, headers={"content-type": ctype} if ctype else {}, timeout=30)
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"], r.text


def test_chat_content_parts_read_as_vllm_reads_them(url):
    """refusal, thinking, input_text and output_text parts are text; a part with None or "" text is left out: the
    prompt is the one of the same conversation as strings (as LLM.chat renders it)."""
    parts = [{"type": "input_text", "text": "Hi"}, {"type": "text", "text": None}, {"type": "text", "text": ""}]
    said = [{"type": "refusal", "refusal": "No."}, {"type": "thinking", "thinking": "Hm."},
            {"type": "output_text", "text": "Ok"}]
    body = {"model": MODEL, "max_tokens": 1, "temperature": 0}
    got = httpx.post(url + "/v1/chat/completions", json={**body, "messages": [
        {"role": "user", "content": parts}, {"role": "assistant", "content": said}, {"role": "user", "content": "x"}]})
    want = httpx.post(url + "/v1/chat/completions", json={**body, "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "No.\nHm.\nOk"},
        {"role": "user", "content": "x"}]})
    assert got.status_code == want.status_code == 200, got.text
    assert got.json()["usage"] == want.json()["usage"]
    assert got.json()["choices"][0]["message"] == want.json()["choices"][0]["message"]
    bad = httpx.post(url + "/v1/chat/completions", json={**body, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    assert "content.0.type" in bad.json()["error"]["message"] and "'image_url'" in bad.json()["error"]["message"]


def test_ids_past_int32_run_beside_other_requests(url):
    """A top_k past int32 (vLLM takes any) filters nothing; a request with it runs beside another one instead of
    failing the step both are in. Stop token ids past the vocabulary are a 400 naming them (current vLLM's)."""
    import concurrent.futures as cf
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    odd = {**body, "top_k": 2**31, "seed": -2**63}
    with cf.ThreadPoolExecutor(2) as pool:
        rs = list(pool.map(lambda b: httpx.post(url + "/v1/completions", json=b, timeout=60), (body, odd)))
    assert [r.status_code for r in rs] == [200, 200], [r.text for r in rs]
    assert rs[0].json()["choices"][0]["text"] == rs[1].json()["choices"][0]["text"]
    r = httpx.post(url + "/v1/completions", json={**body, "stop_token_ids": [3, 2**31, 2**62]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids", r.text
    assert f"out-of-vocab token id(s) [{2**31}, {2**62}]" in r.json()["error"]["message"]


def test_default_max_tokens_is_the_room_the_pool_leaves():
    """No max_tokens (the openai client's chat default): the rest of the context, which a KV pool smaller than
    max_model_len limits too, so such a request runs instead of being refused."""
    from jaxinfer.server import protocol as P
    req = P.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert P.sampling_params(req, 19, 2048, None, pool_tokens=256).max_tokens == 256 - 19
    assert P.sampling_params(req, 19, 2048, None).max_tokens == 2048 - 19
    assert P.sampling_params(req, 19, 2048, 16, pool_tokens=256).max_tokens == 16
    # completions' default (vLLM's 16) is checked as if given: past the context, a 400, not a shorter completion
    with pytest.raises(P.RequestError, match="250 in the prompt, 16 in the completion"):
        P.sampling_params(P.CompletionRequest(prompt="a"), 250, 256, 16)
    # an explicit null is vLLM's 16 too (current vLLM normalises a null max_tokens to the field's default)
    assert P.sampling_params(P.CompletionRequest(prompt="a", max_tokens=None), 200, 256, 16).max_tokens == 16


def test_model_sampling_defaults_fill_what_a_request_leaves_out(tmp_path):
    """The model's generation_config.json (vLLM's --generation-config auto) gives the fields a request does not
    set; its max_new_tokens is the default max_tokens, not a ceiling on a request's own (current vLLM's
    get_max_tokens: only a --generation-config folder's or --override-generation-config's max_new_tokens caps,
    the server's `cap`); a bad --generation-config is refused by name."""
    from jaxinfer.server import protocol as P
    from jaxinfer.server.options import ServerOptions
    defaults = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 7}
    chat = P.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_k=5)
    sp = P.sampling_params(chat, 19, 2048, None, defaults=defaults)
    assert (sp.temperature, sp.top_k, sp.top_p, sp.max_tokens) == (0.6, 5, 0.95, 7)
    sp = P.sampling_params(P.CompletionRequest(prompt="a", temperature=0, max_tokens=30), 1, 2048, 16, defaults=defaults)
    assert (sp.temperature, sp.max_tokens) == (0.0, 30)
    assert P.sampling_params(P.CompletionRequest(prompt="a"), 1, 2048, 16, defaults=defaults).max_tokens == 16
    for req, want in ((P.CompletionRequest(prompt="a", max_tokens=30), 7), (P.CompletionRequest(prompt="a"), 7),
                      (P.CompletionRequest(prompt="a", max_tokens=3), 3), (chat, 7)):
        assert P.sampling_params(req, 1, 2048, 16, defaults=defaults, cap=7).max_tokens == want
    from jaxinfer.generation_config import max_tokens_cap
    assert max_tokens_cap("auto", None, defaults) is None and max_tokens_cap("vllm", None, {}) is None
    assert max_tokens_cap("auto", {"max_new_tokens": 5}, {**defaults, "max_tokens": 5}) == 5
    assert max_tokens_cap(str(tmp_path), None, defaults) == 7
    assert ServerOptions(generation_config=str(tmp_path)).generation_config == str(tmp_path)
    with pytest.raises(ValueError, match="generation_config='nowhere'"):
        ServerOptions(generation_config="nowhere")
    # vLLM's --override-generation-config JSON: checked at start-up, a JSON object on the command line
    with pytest.raises(ValueError, match="override_generation_config"):
        ServerOptions(override_generation_config={"beams": 2})
    # bad values too, at start-up (not a 400 for every request that leaves temperature out), and in a file
    with pytest.raises(ValueError, match="override_generation_config: .*temperature=-1"):
        ServerOptions(override_generation_config={"temperature": -1})
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "generation_config.json").write_text('{"top_p": 7}')
    with pytest.raises(ValueError, match="generation_config.json.*top_p=7"):
        ServerOptions(generation_config=str(bad))
    import argparse
    from jaxinfer.server.options import add_server_args, server_options
    ap = argparse.ArgumentParser()
    add_server_args(ap)
    opts = server_options(ap.parse_args(["--override-generation-config", '{"temperature": 0.5}']))
    assert opts.override_generation_config == {"temperature": 0.5}
    # as engine options (serve(model, {"generation_config": ...}), --engine JSON) they are the server's too, and
    # the engine core's LLM gets the server's (it checks the same file: "vllm" ignores a broken one)
    from jaxinfer.server.launch import generation_config_to_both
    opts, kw = generation_config_to_both(ServerOptions(), {"generation_config": "vllm", "max_num_seqs": 2})
    assert opts.generation_config == "vllm" and kw == {"generation_config": "vllm", "max_num_seqs": 2,
                                                       "override_generation_config": None}
    opts, kw = generation_config_to_both(ServerOptions(generation_config=str(bad / "..")), None)
    assert kw["generation_config"] == str(bad / "..") and opts.generation_config == str(bad / "..")
    with pytest.raises(ValueError, match="generation_config given twice"):
        generation_config_to_both(ServerOptions(generation_config="vllm"), {"generation_config": str(tmp_path)})


def test_a_command_that_cannot_be_encoded_fails_alone():
    """The API process sends each event-loop turn's commands as one message; one that msgpack cannot encode
    (an int past 64 bits) fails its own request with a 400 and the others still go."""
    import asyncio

    import msgpack

    from jaxinfer.server.client import Collector, CoreClient

    class Push:
        sent = []

        def send(self, data):
            self.sent.append(msgpack.unpackb(data))

    async def go():
        c = CoreClient.__new__(CoreClient)
        c._packb, c._push, c._cmds = msgpack.packb, Push(), []
        good, bad = Collector(1, True), Collector(1, True)
        c._requests = {1: (good, 0), 2: (bad, 0)}
        c._cmds = [["add", 1, [1, 2], {"seed": 3}], ["add", 2, [1, 2], {"seed": 2**70}], ["abort", 7]]
        c._flush()
        return Push.sent, good, bad, c._requests
    sent, good, bad, left = asyncio.run(go())
    assert sent == [[["add", 1, [1, 2], {"seed": 3}], ["abort", 7]]]
    assert good.error is None and bad.error.status == 400 and "cannot be sent" in str(bad.error) and left == {1: left[1]}


def test_openai_client_errors(url, client):
    """An unknown model is 404 (NotFoundError), an unimplemented field a 400 naming it (tool_choice "auto" without
    the server's tool-call flags, as vLLM); unknown routes and methods answer in OpenAI's error shape."""
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="hi")
    assert "no-such-model" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], tool_choice="auto",
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert e.value.body["param"] == "tools" and "--enable-auto-tool-choice" in e.value.body["message"]
    for method, path, status in [("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)]:
        r = httpx.request(method, url + path)
        assert r.status_code == status and r.json()["error"]["message"]
    # a lone surrogate in the model name (valid JSON, not encodable as UTF-8): a 404 naming it, not a 500
    chat = b'"messages": [{"role": "user", "content": "hi"}]'
    for path, body in (("/v1/completions", b'"prompt": "hi"'), ("/v1/chat/completions", chat)):
        r = httpx.post(url + path, content=b'{' + body + b', "model": "x\\ud800"}',
                       headers={"content-type": "application/json"})
        assert r.status_code == 404 and "\\ud800" in r.json()["error"]["message"], r.text


def _generation_tokens(url) -> tuple[float, float]:
    """The engine core's request_generation_tokens histogram: (count, sum)."""
    m = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in httpx.get(url + "/metrics").text.splitlines()
         if ln.startswith("vllm:request_generation_tokens_")}
    lab = '{model_name="tiny-qwen3"}'
    name = "vllm:request_generation_tokens_"
    return m.get(name + "count" + lab, 0.0), m.get(name + "sum" + lab, 0.0)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_text_and_aborts_in_the_core(url, client, stream):
    # The stop string sits early in a long completion, so the core still has ~90 tokens to go when the API process
    # sees it: the request must end by the API's abort, not by running out of tokens first (a race with K-step
    # decode calls when the stop was near the end).
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=100, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    stop = full[6:8]
    expected = full[:full.find(stop)]
    for attempt in range(3):      # on a loaded machine (CI) the core may finish the ~90 tokens before the abort lands
        idle = wait_idle(url)
        before, counted = idle["api_aborts"], _generation_tokens(url)
        if stream:
            chunks = list(client.completions.create(**kw, stop=[stop], stream=True,
                                                    stream_options={"include_usage": True}))
            text, reason = "".join(c.choices[0].text for c in chunks[:-1]), chunks[-2].choices[0].finish_reason
            stop_reason, usage = chunks[-2].choices[0].model_extra["stop_reason"], chunks[-1].usage
        else:
            resp = client.completions.create(**kw, stop=[stop])
            out, usage = resp.choices[0], resp.usage
            text, reason, stop_reason = out.text, out.finish_reason, out.model_extra["stop_reason"]
        assert (text, reason, stop_reason) == (expected, "stop", stop)     # vLLM's stop_reason: the matched string
        st = wait_idle(url)
        assert st["kv_blocks_free"] == st["kv_blocks_total"]
        if st["api_aborts"] == before + 1:       # the tokens the core ran past the stop are not counted (as LLM's)
            assert st["generated_tokens"] - idle["generated_tokens"] == usage.completion_tokens
        if st["api_aborts"] == before + 1:
            break
    assert st["api_aborts"] == before + 1, "the stop string did not end the request in the core (3 tries)"
    # /metrics' engine histograms count it as finished, with the tokens kept (the core ran past the stop): vLLM
    # records a stop string's finish like any other
    count, total = _generation_tokens(url)
    assert count == counted[0] + 1 and 0 < total - counted[1] <= 100      # (100: the core ended first)
    kept = client.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "include_stop_str_in_output": True,
                                                              "skip_special_tokens": True}}, stop=[stop], stream=stream)
    kept = "".join(c.choices[0].text for c in kept) if stream else kept.choices[0].text
    assert kept == expected + stop                                    # vLLM's include_stop_str_in_output


@pytest.mark.parametrize("text", ["", "plain", 'quote " backslash \\ newline \n tab \t', "你好 😀 \u2028", "\x00\x1f"])
@pytest.mark.parametrize("reason", [None, "stop", "length"])
def test_chunk_encoder_equals_the_chunk_dicts(text, reason):
    from jaxinfer.server import responses as P
    enc = P.ChunkEncoder("cmpl-1", 'model "x"', "text_completion")

    def parse(event):
        assert event.startswith("data: ") and event.endswith("\n\n")
        d = json.loads(event[6:])
        d.pop("created")
        return d
    want = P.completion_chunk("cmpl-1", 'model "x"', 3, text, reason)
    assert parse(enc.completion(3, text, reason)) == parse(P.sse(want))
    assert parse(enc.completion(3, text, reason))["usage"] is None        # vLLM's completion chunks carry it
    stop = text if reason == "stop" else None          # vLLM's stop_reason: the matched string (or a token id)
    want = P.completion_chunk("cmpl-1", 'model "x"', 3, text, reason, {"tokens": [text]}, stop_reason=stop)
    assert parse(enc.completion_lp(3, text, reason, {"tokens": [text]}, stop)) == parse(P.sse(want))
    enc = P.ChunkEncoder("chat-1", "m", "chat.completion.chunk")
    assert parse(enc.chat_content(text)) == parse(P.sse(P.chat_chunk("chat-1", "m", {"content": text}, None)))
    assert "usage" not in parse(enc.chat_content(text))                   # (chat chunks do not, as vLLM's)
    assert parse(enc.chat_content(text, 2)) == parse(P.sse(P.chat_chunk("chat-1", "m", {"content": text}, None, 2)))
