"""The server's request translation without a server: ServerOptions, chat messages and template arguments."""
import json

import pytest

from jaxinfer.prompts import truncate
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.tokenizer import ByteTokenizer


def test_server_options():
    from jaxinfer.server.options import ServerOptions
    assert ServerOptions.create(env={"JAXINFER_API_KEY": "k"}).api_key == "k"
    assert ServerOptions.create(env={"JAXINFER_API_KEY": "k"}, api_key="flag").api_key == "flag"
    assert ServerOptions.create(env={}).api_key is None
    assert ServerOptions.create(env={"VLLM_API_KEY": "v"}).api_key == "v"        # vLLM's variable too
    assert ServerOptions.create(env={"VLLM_API_KEY": "v", "JAXINFER_API_KEY": "k"}).api_key == "k"
    with pytest.raises(ValueError, match="not a valid Jinja template"):            # at start-up, not per request
        ServerOptions.create(env={}, chat_template="{% for m in messages %}{{ m.content }}")
    for bad in [dict(max_waiting_requests=-1), dict(shutdown_timeout=-2), dict(shutdown_timeout=float("nan")),
                dict(api_key=""), dict(nope=1), dict(max_request_body_bytes=0)]:
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServerOptions.create(env={}, **bad)


def test_queue_bound_shares_add_up():
    """--max-waiting-requests over N API processes: the shares add up to max_num_seqs + N exactly (a rounded-up
    share per process let an odd total be exceeded), differ by at most one, and are never 0."""
    from types import SimpleNamespace

    from jaxinfer.server.admission import Admission
    from jaxinfer.server.options import ServerOptions
    for seqs, waiting, procs in [(8, 1, 2), (8, 3, 2), (16, 0, 3), (1, 0, 2), (5, 4, 4)]:
        state = SimpleNamespace(options=ServerOptions.create(env={}, max_waiting_requests=waiting))
        caps = [Admission(state, seqs, procs, None, None, api_index=i).capacity() for i in range(procs)]
        assert max(caps) - min(caps) <= 1 and min(caps) >= 1, caps
        assert sum(caps) == max(procs, seqs + waiting), (seqs, waiting, procs, caps)
    state = SimpleNamespace(options=ServerOptions.create(env={}))
    assert Admission(state, 8, 2, None, None).capacity() is None


def test_chat_text_parts_render_as_llm_chat_renders_them():
    """A message's text parts reach render_chat as parts, as LLM.chat's do: a template that reads a string gets
    them joined by newlines (vLLM's "string" format), one that loops over the parts gets the parts (they were
    joined first, so such a --chat-template saw one part); plain-string parts and tool_calls [] are taken."""
    from jaxinfer.prompts import render_chat
    from jaxinfer.server.chat_prompt import chat_messages, chat_prompt
    from jaxinfer.server.protocol import ChatCompletionRequest
    parts = [{"type": "text", "text": "Hi"}, "there", {"type": "text", "text": None}]
    req = ChatCompletionRequest(messages=[{"role": "user", "content": parts},
                                          {"role": "assistant", "content": "ok", "tool_calls": []}])
    assert chat_messages(req.messages) == [{"role": "user", "content": [{"type": "text", "text": "Hi"}, "there",
                                                                         {"type": "text"}]},
                                           {"role": "assistant", "content": "ok"}]
    tok = ByteTokenizer()
    joined = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    loops = ("{% for m in messages %}<{{ m['role'] }}>{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}"
             "{% endfor %}")
    for template, want in ((joined, "<user>Hi\nthere<assistant>ok"), (loops, "<user>[Hi][there]<assistant>[ok]")):
        tok.chat_template = template
        conv = [{"role": "user", "content": parts}, {"role": "assistant", "content": "ok"}]
        req = ChatCompletionRequest(messages=conv, add_generation_prompt=False)
        assert chat_prompt(tok, req)[0] == want == render_chat(tok, conv, add_generation_prompt=False)
    # a message's name goes to the template (vLLM passes it); other fields are refused by name
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi", "name": "bob"}])
    assert chat_messages(req.messages) == [{"role": "user", "content": "Hi", "name": "bob"}]
    from jaxinfer.server.protocol import RequestError
    with pytest.raises(RequestError, match="tool_calls"):
        chat_messages(ChatCompletionRequest(messages=[{"role": "assistant", "content": "", "tool_calls": [{}]}]).messages)


def test_chat_template_kwargs_and_continue_final_message():
    from jaxinfer.server.chat_prompt import apply_chat_template, chat_template_kwargs
    from jaxinfer.server.protocol import ChatCompletionRequest, RequestError
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    req = lambda **kw: ChatCompletionRequest(messages=msgs, **kw)     # noqa: E731
    assert chat_template_kwargs(req()) == {"add_generation_prompt": True, "continue_final_message": False}
    kw = chat_template_kwargs(req(add_generation_prompt=False, continue_final_message=True))
    text = apply_chat_template(ByteTokenizer(), msgs, kw)
    assert text.endswith("<|im_start|>assistant\nHel")
    # current vLLM merges the request's own add_generation_prompt / continue_final_message over chat_template_kwargs
    over = chat_template_kwargs(req(chat_template_kwargs={"add_generation_prompt": False, "enable_thinking": False,
                                                          "continue_final_message": True}))
    assert over == {"add_generation_prompt": True, "continue_final_message": False, "enable_thinking": False}
    assert apply_chat_template(ByteTokenizer(), msgs, over).endswith("<|im_start|>assistant\n")
    # reasoning_effort (vLLM's): thinking unless "none", an enable_thinking given wins; the template gets it too
    for effort, given, thinking in (("none", {}, False), ("low", {}, True), ("none", {"enable_thinking": True}, True)):
        kw = chat_template_kwargs(req(reasoning_effort=effort, chat_template_kwargs=given))
        assert (kw["enable_thinking"], kw["reasoning_effort"]) == (thinking, effort)
    with pytest.raises(ValueError, match="reasoning_effort"):
        req(reasoning_effort="extreme")
    with pytest.raises(RequestError, match="continue_final_message"):
        chat_template_kwargs(req(continue_final_message=True))
    # a template (or tools) given through chat_template_kwargs is refused as the request's own fields are (vLLM)
    for name, value in (("chat_template", "{{ messages }}"), ("tools", [{"type": "function"}])):
        with pytest.raises(RequestError, match=f"chat_template_kwargs.{name} is not supported") as e:
            chat_template_kwargs(req(chat_template_kwargs={name: value}))
        assert e.value.param == name
    assert chat_template_kwargs(req(chat_template_kwargs={"chat_template": None}))["add_generation_prompt"]
    # /tokenize (vLLM's): tools, given or in chat_template_kwargs (which wins), reach the template
    f, g = [{"type": "function", "function": {"name": "f"}}], [{"type": "function", "function": {"name": "g"}}]
    tok = ByteTokenizer()
    tok.chat_template = "{% for t in tools or [] %}{{ t.function.name }};{% endfor %}{{ messages[-1].content }}"
    assert apply_chat_template(tok, msgs, chat_template_kwargs(req(), tools=f)) == "f;Hel"
    assert apply_chat_template(tok, msgs, chat_template_kwargs(req(chat_template_kwargs={"tools": g}), [])) == "g;Hel"


def test_truncate_refuses_more_than_max_model_len_and_cors_origins():
    assert truncate([1, 2, 3], 2, 8) == [2, 3] and truncate([1, 2, 3], -1, 2) == [2, 3]
    # the server's -1 leaves room for max_tokens (current vLLM: max_model_len - max_tokens, completions' 16 default)
    from jaxinfer.server.protocol import ChatCompletionRequest, CompletionRequest
    from jaxinfer.server.tokens import truncation
    chat = lambda **kw: ChatCompletionRequest(messages=[{"role": "user", "content": "a"}], **kw)  # noqa: E731
    assert truncation(CompletionRequest(prompt="a", truncate_prompt_tokens=-1), 256, 16) == 240
    assert truncation(CompletionRequest(prompt="a", truncate_prompt_tokens=-1, max_tokens=100), 256, 16) == 156
    assert truncation(chat(truncate_prompt_tokens=-1, max_completion_tokens=50), 256, None) == 206
    assert truncation(chat(truncate_prompt_tokens=-1), 256, None) == -1
    assert truncation(CompletionRequest(prompt="a", truncate_prompt_tokens=8), 256, 16) == 8
    assert truncation(CompletionRequest(prompt="a", truncate_prompt_tokens=-1, max_tokens=0, echo=True), 256, 16) == 255
    with pytest.raises(ValueError, match="truncate_prompt_tokens=9 is greater than max_model_len=8"):
        truncate([1, 2, 3], 9, 8)
    from jaxinfer.server.options import ServerOptions
    assert ServerOptions().origins() == ["*"] and ServerOptions(allowed_origins="").origins() == []
    assert ServerOptions(allowed_origins='["http://a", "http://b"]').origins() == ["http://a", "http://b"]
    assert ServerOptions(allowed_origins="http://a, http://b").origins() == ["http://a", "http://b"]
    with pytest.raises(ValueError, match="allowed_origins"):
        ServerOptions(allowed_origins="[1]")


def test_completion_top_logprobs_keep_the_best_of_tokens_with_the_same_text():
    """Several ids may decode to one text (partial UTF-8 bytes all give "\ufffd"): the legacy dict, keyed by text,
    keeps the more likely one's logprob, whichever comes first."""
    from jaxinfer.server.responses import completion_logprobs
    texts = {5: "\ufffd", 6: "\ufffd", 7: "a"}
    row = [-0.5, 0.0, 5, 6, 7, -0.5, -1.5, -2.0]   # sampled logprob, rank, then the top 3 ids and their logprobs
    out = completion_logprobs(texts.get, [5], [row], 3)
    assert out["token_logprobs"] == [-0.5]
    assert out["top_logprobs"] == [{"\ufffd": -0.5, "a": -2.0}]
    # the sampled id is the worse of two with its text: the key holds the better one's, so a client reading
    # "token_logprob == max(top)" as greedy (lm-eval) sees that it was not
    row = [-3.0, 2.0, 7, 6, 5, -0.2, -1.0, -3.0]
    out = completion_logprobs(texts.get, [5], [row], 2)
    assert out["top_logprobs"] == [{"\ufffd": -1.0, "a": -0.2}] and out["token_logprobs"] == [-3.0]


def test_check_request_counts_the_kv_the_request_writes():
    """The API process's early pool check is the engine's: the last output token is never written to the pool."""
    from jaxinfer.server.protocol import RequestError, check_request
    limits = dict(vocab_size=100, block_size=4, num_blocks=8, max_model_len=128)
    for n, m in ((31, 2), (32, 1), (1, 32)):
        check_request([5] * n, SamplingParams(max_tokens=m), limits)
    with pytest.raises(RequestError, match="needs 9 KV blocks for 31 prompt . 3 output tokens"):
        check_request([5] * 31, SamplingParams(max_tokens=3), limits)


def test_choice_stop_reason_tells_the_tokenizers_eos_from_the_others():
    """The API process reports a choice's stop_reason as LLM.generate does: None on the tokenizer's EOS, the id
    on another EOS id of the model (vLLM adds them to stop_token_ids) or on a stop_token_ids entry."""
    from jaxinfer.output_processor import OutputProcessor
    from jaxinfer.server.choices import Choice
    eos = (frozenset({2, 9}), 2)

    def reason(ids, **kw):
        sp = SamplingParams(**kw)
        ch = Choice(0, [1], sp, OutputProcessor.for_params(ByteTokenizer(), sp, False), eos)
        ch.proc.update(ids, "stop")
        return ch.stop_reason
    assert [reason([70, 2]), reason([70, 9]), reason([70, 7], stop_token_ids=[7]), reason([70, 2], stop_token_ids=[2]),
            reason([70, 2], ignore_eos=True, stop_token_ids=[2])] == [None, 9, 7, None, 2]


def test_vllm_request_fields_this_server_refuses_are_named_as_unsupported():
    """vLLM's request fields with no counterpart here (a per-request chat_template, documents, ...) are a 400
    "not supported" naming the field, as the other known fields (not "unrecognized"); their no-op values pass."""
    from jaxinfer.server import protocol as P
    msgs = [{"role": "user", "content": "hi"}]
    for field, value in (("chat_template", "{{ 1 }}"), ("documents", [{"text": "a"}]), ("priority", 3),
                         ("mm_processor_kwargs", {})):
        with pytest.raises(P.RequestError, match=f"{field}=.*not supported") as e:
            P.check_unsupported(P.ChatCompletionRequest(messages=msgs, **{field: value}))
        assert e.value.code == "unsupported_parameter" and e.value.param == field
    P.check_unsupported(P.ChatCompletionRequest(messages=msgs, priority=0, return_tokens_as_token_ids=True,
                                                return_token_ids=True))
    # the openai package's bookkeeping fields are accepted as no-ops; verbosity only at its default
    P.check_unsupported(P.ChatCompletionRequest(messages=msgs, safety_identifier="u1", prompt_cache_key="k",
                                                prompt_cache_retention="24h", verbosity="medium", stream=True,
                                                stream_options={"include_obfuscation": False}))
    with pytest.raises(P.RequestError, match="verbosity='low'.*not supported"):
        P.check_unsupported(P.ChatCompletionRequest(messages=msgs, verbosity="low"))



def test_an_empty_stream_options_without_stream_is_taken_as_absent():
    """vLLM refuses stream_options without stream only when it is non-empty (some SDKs always send {})."""
    from jaxinfer.server import protocol as P
    P.check_unsupported(P.CompletionRequest(prompt="hi", stream_options={}))
    with pytest.raises(P.RequestError, match="stream_options"):
        P.check_unsupported(P.CompletionRequest(prompt="hi", stream_options={"include_usage": True}))


def test_vllms_default_chat_template_kwargs_and_force_include_usage_flags():
    """`--default-chat-template-kwargs` (a request's own kwargs win over them) and `--enable-force-include-usage`
    (a stream carries its usage whatever its stream_options say), as vLLM's serve flags."""
    import argparse

    from jaxinfer.server.options import ServerOptions, add_server_args, server_options
    from jaxinfer.server.protocol import ChatCompletionRequest, CompletionRequest, include_usage
    ap = argparse.ArgumentParser()
    add_server_args(ap)
    opts = server_options(ap.parse_args(["--enable-force-include-usage", "--default-chat-template-kwargs",
                                         '{"enable_thinking": false, "x": 1}']))
    assert opts.enable_force_include_usage and opts.default_chat_template_kwargs == {"enable_thinking": False, "x": 1}
    assert not server_options(ap.parse_args([])).enable_force_include_usage
    req = opts.apply(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=True,
                                           chat_template_kwargs={"x": 2}))
    assert req.chat_template_kwargs == {"enable_thinking": False, "x": 2} and include_usage(req)
    assert req.stream_options.continuous_usage_stats
    plain = opts.apply(CompletionRequest(prompt="hi", chat_template_kwargs=None))     # (a completion's extra field)
    assert plain.stream_options is None and not include_usage(plain) and plain.chat_template_kwargs is None
    assert server_options(ap.parse_args(["--enable-force-include-usage", "--no-enable-force-include-usage"])
                          ).enable_force_include_usage is False
    assert not include_usage(ServerOptions().apply(CompletionRequest(prompt="hi", stream=True)))
    for bad in ({"chat_template": "{{ messages }}"}, {"tools": []}):
        with pytest.raises(ValueError, match="default_chat_template_kwargs"):
            ServerOptions(default_chat_template_kwargs=bad)
    from jaxinfer.server.tokens import TokenizeRequest                # /tokenize renders as chat does
    assert TokenizeRequest(messages=[{"role": "user", "content": "hi"}], reasoning_effort="none").reasoning_effort


def test_vllms_return_tokens_as_token_ids_flag_is_a_default_a_request_overrides():
    import argparse

    from jaxinfer.server.options import ServerOptions, add_server_args, server_options
    from jaxinfer.server.protocol import CompletionRequest
    ap = argparse.ArgumentParser()
    add_server_args(ap)
    opts = server_options(ap.parse_args(["--return-tokens-as-token-ids"]))
    assert opts.apply(CompletionRequest(prompt="hi")).return_tokens_as_token_ids is True
    assert opts.apply(CompletionRequest(prompt="hi", return_tokens_as_token_ids=False)).return_tokens_as_token_ids is False
    assert ServerOptions().apply(CompletionRequest(prompt="hi")).return_tokens_as_token_ids is None
    with pytest.raises(ValueError, match="return_tokens_as_token_ids"):
        ServerOptions(return_tokens_as_token_ids="yes")


def test_reasoning_parser_splits_thinking_streamed_or_not():
    """--reasoning-parser qwen3 (vLLM's): the thinking (a leading <think> dropped, up to </think>) goes to
    `reasoning`, the rest to `content`; streamed deltas cut anywhere (inside a tag too) give the same split."""
    import asyncio
    import random
    from types import SimpleNamespace

    from jaxinfer.server import streams
    from jaxinfer.server.protocol import ChatCompletionRequest
    from jaxinfer.server.reasoning import split, thinking_closed
    text = "<think>\nplan: add 2 and 2\n</think>\n\nThe answer is 4."
    assert split(text, False) == ("\nplan: add 2 and 2\n", "\n\nThe answer is 4.")
    assert split(text, True) == (None, text) and split("cut off <thi", False) == ("cut off <thi", None)
    assert split("no tags", False) == ("no tags", None) and split("</think>", False) == (None, None)
    assert thinking_closed("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", {}) is True
    assert thinking_closed("qwen3", "<|im_start|>assistant\n", {"enable_thinking": False}) is True
    assert thinking_closed("deepseek_r1", "<|im_start|>assistant\n", {"enable_thinking": False}) is True
    assert thinking_closed("qwen3", "user: why <think></think>?<|im_start|>assistant\n", {}) is False   # (quoted)
    assert split("\n<think>section</think>\nrest", False) == ("\nsection", "\nrest")   # (as vLLM streams it)
    assert thinking_closed(None, "", {}) is None
    import argparse

    from jaxinfer.server.chat_prompt import chat_messages
    from jaxinfer.server.options import ServerOptions, add_server_args, server_options
    ap = argparse.ArgumentParser()
    add_server_args(ap)
    assert server_options(ap.parse_args(["--reasoning-parser", "qwen3"])).reasoning_parser == "qwen3"
    with pytest.raises(ValueError, match="reasoning_parser='qwq'"):
        ServerOptions(reasoning_parser="qwq")
    for key in ("reasoning", "reasoning_content"):       # a multi-turn assistant's thinking, for the template
        m = chat_messages(ChatCompletionRequest(messages=[{"role": "assistant", "content": "a", key: "r"}]).messages)
        assert m[0]["reasoning"] == m[0]["reasoning_content"] == "r"
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "2+2?"}])
    proc = SimpleNamespace(text=text, finish_reason="stop")
    ch = SimpleNamespace(index=0, token_ids=[1], logprobs=[], stop_reason=None, proc=proc)
    msg = streams.chat_choice(ch, None, None, req=req, think=False)["message"]
    assert (msg["reasoning"], msg["content"]) == split(text, False) and msg["reasoning_content"] == msg["reasoning"]
    quiet = ChatCompletionRequest(messages=req.messages, include_reasoning=False, return_token_ids=True)
    hidden = streams.chat_choice(ch, 2, None, req=quiet, think=False)     # (no logprobs or ids to show it by)
    assert hidden["message"]["reasoning"] is None and hidden["logprobs"] is None and "token_ids" not in hidden

    async def events(pieces):
        async def run():
            for i, piece in enumerate(pieces):
                yield ch, SimpleNamespace(text=piece, token_ids=[1], finish_reason="stop" if i == len(pieces) - 1
                                          else None)
        body = streams.chat_stream(run(), "r", "m", [[1, 2]], 1, req, None, think=False).body_iterator
        return [json.loads(e[6:]) for e in [e async for e in body] if e.startswith("data: {")]
    for _ in range(30):
        cuts = sorted(random.sample(range(1, len(text)), 5))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        deltas = [e["choices"][0]["delta"] for e in asyncio.run(events(pieces))]
        got = tuple("".join(d.get(key) or "" for d in deltas) for key in ("reasoning", "content"))
        assert got == split(text, False), pieces
        assert all(d.get("reasoning_content") == d.get("reasoning") for d in deltas)    # (vLLM 0.11's older name)


def _app_without_core(model_dir, **options):
    """build_app on a CoreInfo whose core does not run: routes that need no engine answer (no lifespan here)."""
    import os

    from jaxinfer.server import build_app
    from jaxinfer.server.options import ServerOptions
    from jaxinfer.server.process import CoreInfo
    limits = {"max_model_len": 128, "vocab_size": 512, "num_blocks": 16, "block_size": 4}
    info = CoreInfo(model_dir, "ipc:///nonexistent-in", ("ipc:///nonexistent-out",), os.getpid(), limits)
    return build_app(info, "m", options=ServerOptions(**options))


def test_vllms_http_flags(tiny_dir):
    """vLLM's --disable-fastapi-docs, --root-path, --allowed-methods / --allowed-headers / --allow-credentials and
    --enable-request-id-headers (also on a refused request), and the options' checks."""
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from jaxinfer.server.options import ServerOptions
    plain = TestClient(_app_without_core(tiny_dir))
    assert plain.get("/openapi.json").status_code == plain.get("/docs").status_code == 200
    assert "x-request-id" not in plain.get("/version").headers
    off = TestClient(_app_without_core(tiny_dir, disable_fastapi_docs=True, enable_request_id_headers=True,
                                       api_key="k"))
    assert [off.get(p).status_code for p in ("/openapi.json", "/docs", "/redoc")] == [404, 404, 404]
    assert off.get("/version", headers={"X-Request-Id": "abc"}).headers["x-request-id"] == "abc"
    new = [off.get("/version").headers["x-request-id"] for _ in range(2)]
    assert len(new[0]) == 32 and new[0] != new[1]
    refused = off.get("/v1/models", headers={"X-Request-Id": "r1"})
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "r1"
    assert "root_path" not in ServerOptions(root_path="/api").uvicorn_kwargs()      # (FastAPI's, as vLLM's)
    proxied = TestClient(_app_without_core(tiny_dir, api_key="k", enable_request_id_headers=True, root_path="/api"))
    assert proxied.get("/api/openapi.json").json()["servers"] == [{"url": "/api"}]
    assert proxied.get("/api/v1/models").status_code == 401                 # the key is still asked for
    assert proxied.get("/api/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
    assert proxied.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200   # (a proxy that
    assert proxied.get("/v1/models").status_code == 401                                      # strips the prefix)
    docs = proxied.get("/api/docs").text                                    # the docs' links carry the prefix
    assert "/api/openapi.json" in docs and ("/api/docs-static/" in docs or "fastapi-offline" in docs)
    assert proxied.get("/api/nothing").json()["error"]["message"].endswith("GET /api/nothing")
    cors = TestClient(_app_without_core(tiny_dir, allowed_origins="http://a", allowed_methods="GET, POST",
                                        allowed_headers='["X-Custom"]', allow_credentials=True,
                                        enable_request_id_headers=True))
    ask = {"Origin": "http://a", "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "X-Custom"}
    pre = cors.options("/v1/models", headers={**ask, "X-Request-Id": "p1"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-credentials"] == "true"
    assert pre.headers["x-request-id"] == "p1"                              # (a preflight's answer too)
    assert "POST" in pre.headers["access-control-allow-methods"] and "DELETE" not in pre.headers[
        "access-control-allow-methods"]
    assert cors.options("/v1/models", headers={**ask, "Access-Control-Request-Method": "DELETE"}).status_code == 400
    assert cors.options("/v1/models", headers={**ask, "Access-Control-Request-Headers": "X-Other"}).status_code == 400
    for bad in (dict(response_role=""), dict(allowed_methods="[1]"), dict(ssl_keyfile="/no/such.pem"),
                dict(ssl_cert_reqs=3)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServerOptions(**bad)


def test_https_with_vllms_ssl_flags(tiny_dir, tmp_path):
    """--ssl-certfile / --ssl-keyfile: the API answers over HTTPS (uvicorn with the options' TLS arguments, as
    launch.run_api builds it), checked against the certificate; plain HTTP gets no answer there."""
    import shutil
    import subprocess
    import threading
    import time

    import httpx
    import uvicorn
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate with")
    key, cert = str(tmp_path / "key.pem"), str(tmp_path / "cert.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    from jaxinfer.server.options import ServerOptions
    from test_server import free_port
    for bad in (dict(ssl_certfile=cert), dict(ssl_certfile=key, ssl_keyfile=cert)):   # at start-up, not after loading
        with pytest.raises(ValueError, match="do not load as a PEM certificate"):
            ServerOptions(**bad)
    opts = ServerOptions(ssl_keyfile=key, ssl_certfile=cert)
    assert opts.uvicorn_kwargs() == {"ssl_keyfile": key, "ssl_certfile": cert, "ssl_ca_certs": None, "ssl_cert_reqs": 0}
    app = _app_without_core(tiny_dir, ssl_keyfile=key, ssl_certfile=cert)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                                          **opts.uvicorn_kwargs()))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive()
            time.sleep(0.05)
        assert httpx.get(f"https://127.0.0.1:{port}/version", verify=cert).json()["version"]
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/version", timeout=5)
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_a_drain_ends_the_wait_for_an_index():
    """A request waiting for its json / regex index when the drain (SIGTERM) starts gets the drain's 503 (it is not
    in the engine, so the drain would not wait for it; uvicorn cancelled it after 5 s with a 500)."""
    import asyncio
    from types import SimpleNamespace

    from jaxinfer.server import formats
    from jaxinfer.server.errors import RequestError
    building = SimpleNamespace(_grammar_rule=SimpleNamespace(build=SimpleNamespace(result=lambda deadline: None)))
    with pytest.raises(RequestError) as e:
        asyncio.run(asyncio.wait_for(formats.index_built(building, "guided_json", lambda: True), 5))
    assert e.value.status == 503 and e.value.code == "shutting_down"


def test_an_unexpected_exception_is_openais_500():
    """A handler's bug answers in OpenAI's shape (a 500 naming the exception), not Starlette's plain text."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from jaxinfer.server.errors import internal_error
    app = FastAPI()
    app.exception_handler(Exception)(internal_error)

    @app.get("/boom")
    def boom():
        raise KeyError("x")
    r = TestClient(app, raise_server_exceptions=False).get("/boom")
    assert r.status_code == 500, r.text
    assert r.json()["error"] == {"message": "internal error: KeyError: 'x'", "type": "server_error", "param": None,
                                 "code": "internal_error"}


def test_structured_output_errors_name_the_field_sent_not_its_internal_form():
    from jaxinfer.server import protocol as P
    schema = {"type": "object", "properties": {"a": {"type": "string", "not": {}}}}
    cases = (("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, None),
             ("guided_json", schema, None), ("structured_outputs", {"json": schema}, "{'json'"))
    for field, body, value in cases:
        with pytest.raises(P.RequestError) as e:
            P.sampling_params(P.CompletionRequest(prompt="hi", **{field: body}), 2, 100, None)
        assert e.value.param == field and "json schema keyword 'not' at #/properties/a" in str(e.value)
        if value is None:           # (another field's form, {'json': ...}, is not what the client sent)
            assert str(e.value).startswith(f"{field}: json schema") and "{'json'" not in str(e.value), str(e.value)
        else:                       # (the field as sent: its value is quoted, as for any other field)
            assert str(e.value).startswith(f"{field}={value}"), str(e.value)


def test_metrics_series_exist_at_zero_before_any_request():
    """The latency histograms and the finished-request counters (each finished_reason) are there at 0 from the
    start, as vLLM's, so a dashboard or a rate() has a series before the first request ends."""
    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest

    from jaxinfer.server.metrics import ServerMetrics
    text = generate_latest(ServerMetrics("m").registry).decode()
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_time_per_output_token_seconds_count", "jaxinfer:time_to_first_token_seconds_count"):
        assert f'{name}{{model_name="m"}} 0.0' in text, name
    for reason in ("stop", "length", "abort"):
        assert f'vllm:request_success_total{{finished_reason="{reason}",model_name="m"}} 0.0' in text, reason


def test_logprobs_up_to_the_cores_max_logprobs():
    """The server's bound on logprobs / top_logprobs / prompt_logprobs (and on a beam's width, 2 * n logprobs a
    step) is the core's max_logprobs (vLLM's --max-logprobs; -1: the vocabulary), a 400 naming the request's own
    field past it, as vLLM's, not OpenAI's fixed 20."""
    from jaxinfer.server import beam
    from jaxinfer.server.errors import RequestError
    from jaxinfer.server.protocol import ChatCompletionRequest, CompletionRequest, check_request
    base = dict(vocab_size=100, block_size=4, num_blocks=64, max_model_len=128)
    check_request([5], SamplingParams(max_tokens=2, logprobs=30, prompt_logprobs=30), {**base, "max_logprobs": 30})
    check_request([5], SamplingParams(max_tokens=2, logprobs=100), {**base, "max_logprobs": -1})
    for param, sp in (("logprobs", SamplingParams(logprobs=21)), ("prompt_logprobs", SamplingParams(prompt_logprobs=31))):
        with pytest.raises(RequestError, match=f"{param}=\\d+ is more than max_logprobs=") as e:
            check_request([5], sp, {**base, "max_logprobs": 20 if param == "logprobs" else 30})
        assert e.value.param == param
    with pytest.raises(RequestError, match="top_logprobs=21 is more than max_logprobs=20") as e:
        check_request([5], SamplingParams(logprobs=21), base, "messages")     # (a chat request: its field's name)
    assert e.value.param == "top_logprobs"
    assert CompletionRequest(prompt="a", logprobs=40).logprobs == 40                 # (no fixed 20 in the schema)
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "a"}], top_logprobs=40).top_logprobs == 40
    from jaxinfer.server.protocol import chat_top_logprobs, engine_prompt_logprobs    # -1: the vocabulary (vLLM's)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "a"}], logprobs=True, top_logprobs=-1,
                                 prompt_logprobs=-1)
    assert chat_top_logprobs(chat, 100) == chat.top_logprobs == 100 and engine_prompt_logprobs(chat, 100) == 100
    with pytest.raises(ValueError, match="logprobs"):
        CompletionRequest(prompt="a", logprobs=-1)                 # (completions: >= 0, as vLLM's)
    wide = CompletionRequest(prompt="a", n=12, use_beam_search=True)
    beam.check(wide, {**base, "max_logprobs": 24})
    with pytest.raises(RequestError, match="at most 10") as e:
        beam.check(wide, base)
    assert e.value.param == "n"


def test_text_a_tokenizer_cannot_take_is_named_plainly():
    """A lone surrogate (valid JSON, not UTF-8 text): a 400 naming the field and the character, not the
    tokenizer's internal type error."""
    from jaxinfer.server.errors import RequestError
    from jaxinfer.server.tokens import encode_text
    with pytest.raises(RequestError, match="not valid UTF-8 text .* at character 3") as e:
        encode_text(ByteTokenizer(), "hi \ud800", param="messages")
    assert e.value.param == "messages"
