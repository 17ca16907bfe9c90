"""Tool calling on the server (vLLM's `--enable-auto-tool-choice --tool-call-parser hermes`), end to end: a real
engine core runs a scripted checkpoint (a real Qwen3 whose greedy answer is a fixed token chain: each token's
embedding is one-hot, the layers add nothing, and the LM head maps a token to the next one of the script), so the
answer holds Qwen3-style <tool_call> blocks; the `openai` client reads them, streamed and not."""
import argparse
import json

import httpx
import pytest

openai = pytest.importorskip("openai")

from test_server import run_server  # noqa: E402
from jaxinfer.server import tools as T  # noqa: E402
from jaxinfer.server.options import ServerOptions, add_server_args, server_options  # noqa: E402
from jaxinfer.server.protocol import ChatCompletionRequest, RequestError  # noqa: E402

MODEL = "tiny-qwen3"
CALL1 = {"name": "get_weather", "arguments": {"city": "Paris"}}
CALL2 = {"name": "get_time", "arguments": {"tz": "Europe/Paris", "note": "été"}}
# the answer, one token a piece; the tags are special tokens, so the text keeps them only because tool parsing
# turns skip_special_tokens off (vLLM's)
SCRIPT = ["Checking both.", "<tool_call>", "\n" + json.dumps(CALL1) + "\n", "</tool_call>",
          "\n<tool_call>\n" + json.dumps(CALL2, ensure_ascii=False) + "\n</tool_call>", "<|im_end|>"]
TEMPLATE = ("{%- if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
            "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
            "{%- for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
            "<|im_end|>\n{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS = [{"type": "function", "function": {"name": n, "description": "look it up", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}} for n in ("get_weather", "get_time")]
ASK = [{"role": "user", "content": "Weather and time in Paris?"}]


def make_scripted_model(path: str) -> str:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from scripts.make_tiny_model import build_tokenizer
    tok = build_tokenizer(400)
    tok.add_tokens([s for s in SCRIPT if s not in tok.get_vocab()])
    tok.chat_template = TEMPLATE
    ids = [tok.convert_tokens_to_ids(s) for s in SCRIPT]
    V = 512
    assert len(tok) <= V and len(set(ids)) == len(ids)
    config = Qwen3Config(vocab_size=V, hidden_size=V, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False,
                         max_position_embeddings=512, eos_token_id=ids[-1], bos_token_id=None,
                         pad_token_id=tok.pad_token_id)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()                        # the layer adds nothing: the residual stays the embedding
        model.model.embed_tokens.weight.copy_(torch.eye(V))
        nxt = torch.full((V,), ids[0])           # any other token starts the script
        nxt[torch.tensor(ids[:-1])] = torch.tensor(ids[1:])
        head = torch.zeros(V, V)
        head[nxt, torch.arange(V)] = 1.0
        model.lm_head.weight.copy_(head)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_scripted_model(str(tmp_path_factory.mktemp("scripted")))
    opts = ServerOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield from run_server(path, tmp_path_factory, {"max_model_len": 512}, options=opts)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)


def _calls(message_calls) -> list[dict]:
    return [{"name": c.function.name, "arguments": json.loads(c.function.arguments)} for c in message_calls]


def test_tool_calls_parsed_streamed_or_not(client):
    """The answer's two <tool_call> blocks become tool_calls (ids chatcmpl-tool-..., arguments as JSON strings),
    the text before them the content, finish_reason "tool_calls"; streamed, the content first, then the calls by
    index with the finish, the same as unstreamed; the tools reached the template."""
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Checking both."
    assert _calls(c.message.tool_calls) == [CALL1, CALL2]
    assert all(t.id.startswith("chatcmpl-tool-") and t.type == "function" for t in c.message.tool_calls)
    assert len({t.id for t in c.message.tool_calls}) == 2
    ids = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=1,
                                         extra_body={"return_token_ids": True}).model_extra["prompt_token_ids"]
    prompt = httpx.post(str(client.base_url).replace("/v1/", "/detokenize"), json={"tokens": ids}).json()["prompt"]
    assert prompt.startswith('<tools>{"type": "function", "function": {"name": "get_weather", "description"')
    odd = [{"function": {"parameters": {"type": "object"}, "description": None, "name": "f"}}]   # (order, null, no type)
    chat = client.chat.completions.create(model=MODEL, messages=ASK, tools=odd, max_tokens=1, extra_body={
        "return_token_ids": True}).model_extra["prompt_token_ids"]
    counted = httpx.post(str(client.base_url).replace("/v1/", "/tokenize"),
                         json={"model": MODEL, "messages": ASK, "tools": odd}).json()["tokens"]
    assert counted == chat                               # /tokenize renders tools as the chat route does (vLLM's)
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, stream=True):
        d = chunk.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            calls.setdefault(t.index, {"name": "", "arguments": ""})
            calls[t.index]["name"] += t.function.name or ""
            calls[t.index]["arguments"] += t.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Checking both." and finish == "tool_calls"
    assert [{"name": v["name"], "arguments": json.loads(v["arguments"])} for _, v in sorted(calls.items())] == \
        [CALL1, CALL2]
    with client.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS, temperature=0) as events:
        done = [e.name for e in events if e.type == "tool_calls.function.arguments.done"]   # (the openai helper's:
    assert done == [CALL1["name"], CALL2["name"]]               # each call ends before the finish's chunk)
    for choice in ("required", "auto"):                         # tools [] (vLLM's, OpenAI's): no calls to make
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[], tool_choice=choice, max_tokens=2)
        assert not r.choices[0].message.tool_calls, choice


def test_tool_choice_variants(client, server):
    """parallel_tool_calls false: the first call only; cut off inside the first call's block (max_tokens): that
    call, finish "tool_calls" (vLLM's); tool_choice "none": no parsing (the text as it is, tags and all); a named
    function or "required" with response_format: a 400 naming tool_choice; a tool result turn is templated."""
    one = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0,
                                         parallel_tool_calls=False).choices[0]
    assert _calls(one.message.tool_calls) == [CALL1] and one.finish_reason == "tool_calls"
    cut = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=3)
    assert cut.choices[0].finish_reason == "tool_calls"         # (cut after a call: vLLM's "tool_calls" too)
    assert _calls(cut.choices[0].message.tool_calls) == [CALL1]
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0,
                                          tool_choice="none").choices[0]
    assert none.message.tool_calls is None and none.finish_reason == "stop"
    assert none.message.content == "".join(SCRIPT[:-1])             # (the tags are plain tokens, as Qwen3's)
    for choice in ({"type": "function", "function": {"name": "get_time"}}, "required"):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                           response_format={"type": "json_object"})
        assert e.value.body["param"] == "tool_choice" and "cannot be given with" in e.value.body["message"]
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(CALL1["arguments"])}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    prompt = httpx.post(server[0] + "/tokenize", json={"model": MODEL, "messages": turn, "tools": TOOLS}).json()
    assert httpx.post(server[0] + "/v1/chat/completions", json={"model": MODEL, "messages": turn, "tools": TOOLS,
                                                                 "max_tokens": 2}).status_code == 200
    assert prompt["count"] > 0


def test_tool_requests_checked_as_vllm():
    """tools.resolve: "auto" (the default with tools) needs the server flags (without them the 400 names `tools`,
    which such a server refuses but with tool_choice "none"); tool_choice without tools, an unknown value, a named
    function not among the tools are 400s naming tool_choice; "none" shows the tools to
    the template unless --exclude-tools-when-tool-choice-none; vLLM's flags, checked at start-up."""
    on, off = ServerOptions(enable_auto_tool_choice=True, tool_call_parser="hermes"), ServerOptions()

    def req(**kw):
        return ChatCompletionRequest(messages=ASK, **kw)
    assert T.resolve(req(), off) == T.ToolUse(None, False)
    assert T.resolve(req(tools=TOOLS), on).parse and T.resolve(req(tools=TOOLS), on).tools[0]["function"]["name"] == \
        "get_weather"
    assert T.resolve(req(tools=TOOLS, parallel_tool_calls=False), on).first_only
    assert T.resolve(req(tools=TOOLS, tool_choice="none"), off) == T.ToolUse(T.resolve(req(tools=TOOLS), on).tools,
                                                                              False)
    assert T.resolve(req(tools=TOOLS, tool_choice="none"), ServerOptions(
        exclude_tools_when_tool_choice_none=True)).tools is None
    named = {"type": "function", "function": {"name": "get_time"}}
    forced = req(tools=TOOLS, tool_choice=named)                  # (without the flags too, as vLLM's)
    assert T.resolve(forced, off).forced == "get_time" and forced.structured_outputs == {"json": TOOLS[1][
        "function"]["parameters"]}
    bounded = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "minimum": {"type": "integer", "minimum": 1, "maximum": 9}}, "anyOf": [{"required": ["minimum"]}],
        "$defs": {"d": {"multipleOf": 2, "type": "string", "pattern": "a", "maxLength": 2}}}}}]
    assert T.resolve(req(tools=bounded, tool_choice={"type": "function", "function": {"name": "f"}}), off) and \
        T._schema(bounded, "f", False) == {"type": "object", "properties": {"minimum": {"type": "integer"}},
                                          "anyOf": [{}], "$defs": {"d": {"type": "string", "pattern": "a"}}}
    forced = req(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert T.resolve(forced, off).forced == "required" and forced.structured_outputs["json"]["maxItems"] == 1
    assert [i["properties"]["name"]["enum"] for i in forced.structured_outputs["json"]["items"]["anyOf"]] == \
        [["get_weather"], ["get_time"]]
    for kw, opts, words, param in (
            (dict(tools=TOOLS), off, "requires --enable-auto-tool-choice", "tools"),
            (dict(tools=TOOLS, tool_choice="auto"), off, "requires --enable-auto-tool-choice", "tools"),
            (dict(tools=TOOLS, tool_choice="required", guided_regex="a"), off, "cannot be given with guided_regex",
             "tool_choice"),
            (dict(tools=TOOLS, tool_choice=named, structured_outputs={"regex": "a"}), on, "cannot be given with",
             "tool_choice"),
            (dict(tools=[{"function": {"name": n, "parameters": {"$defs": {"d": {"type": t}}}}} for n, t in
                         (("f", "string"), ("g", "integer"))], tool_choice="required"), on, "twice", "tools"),
            (dict(tool_choice="auto"), on, "`tools` must be set", "tool_choice"),
            (dict(tools=TOOLS, tool_choice="any"), on, "Invalid value for `tool_choice`", "tool_choice"),
            (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), on, "does not match",
             "tool_choice")):
        with pytest.raises(RequestError, match=words) as e:
            T.resolve(req(**kw), opts)
        assert e.value.param == param
    ap = argparse.ArgumentParser()
    add_server_args(ap)
    o = server_options(ap.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                      "--exclude-tools-when-tool-choice-none"]))
    assert o.enable_auto_tool_choice and o.tool_call_parser == "hermes" and o.exclude_tools_when_tool_choice_none
    with pytest.raises(ValueError, match="requires tool_call_parser"):
        ServerOptions(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="tool_call_parser='mistral'"):
        ServerOptions(tool_call_parser="mistral")


def test_hermes_parsing_and_its_stream():
    """vLLM's hermes rules: no tag, all content; a bad block, no calls and all content (nothing lost); an open
    last block counts; text after the last block is dropped. The stream holds a tag's start back and gives the
    same content and calls as the whole text, however the text is cut."""
    call = '<tool_call>\n{"name": "f", "arguments": {"x": [1, 2]}}\n</tool_call>'
    assert T.extract("plain") == ("plain", [])
    content, calls = T.extract("Hi " + call + "\n" + call.replace('"f"', '"g"') + " tail")
    assert content == "Hi " and [c["function"]["name"] for c in calls] == ["f", "g"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": [1, 2]}
    assert T.extract(call[:-len("</tool_call>")])[1][0]["function"]["name"] == "f"      # (cut off: still a call)
    for bad in ("<tool_call>{not json}</tool_call>", '<tool_call>{"name": "f"}</tool_call>',
                '<tool_call>["f"]</tool_call>', call + "<tool_call>{", '<tool_call>{"name": "f", "arguments": ' + "[" * 5000):
        assert T.extract("x" + bad) == ("x" + bad, [])
    assert T.extract(call)[0] is None and len(T.extract(call + call, first_only=True)[1]) == 1
    assert T.finish_reason("stop", [1]) == T.finish_reason("length", [1]) == "tool_calls"   # (vLLM's)
    assert T.finish_reason("length", []) == "length" and T.finish_reason("abort", [1]) == "abort"
    named, required = T.ToolUse(None, True, forced="f"), T.ToolUse(None, True, True, forced="required")
    content, calls = named.extract('{"x": 1}')            # forced calls (vLLM's): content "", "stop" stays "stop"
    assert content == "" and calls[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert named.finish_reason("stop", calls) == "stop"
    content, calls = named.extract('{"x": ')             # cut short (max_tokens): still the call, as vLLM's
    assert content == "" and calls[0]["function"] == {"name": "f", "arguments": '{"x": '}
    content, calls = required.extract('[{"name": "g", "parameters": {"y": "é"}}, {"name": "f", "parameters": {}}]')
    assert content == "" and [c["function"] for c in calls] == [{"name": "g", "arguments": '{"y": "é"}'}]
    assert required.finish_reason("stop", calls) == "tool_calls" and required.finish_reason("length", []) == "length"
    assert required.extract("[]") == ("[]", []) and required.extract('[{"name": "g"}]') == ('[{"name": "g"}]', [])
    s = T.Stream(named)                                        # as the plain answer (streams.py: `and text`)
    assert s.feed('{"x"') == ("", []) and s.feed(": 1}", last=True)[1][0]["function"]["arguments"] == '{"x": 1}'
    assert T.Stream(named).feed("", last=True) == ("", [])    # no answer text (cut off while thinking): no call,
    for text in ("Hi <tool_cal> " + call + call, "a<tool_call>{bad}</tool_call>", "no calls <tool_", "<tool_call"):
        whole = T.extract(text)
        for step in (1, 3, 7):
            s, out, found = T.Stream(T.ToolUse(None, True)), "", []
            for i in range(0, len(text), step):
                piece, calls = s.feed(text[i:i + step], last=i + step >= len(text))
                out, found = out + piece, found + calls
            assert out == (whole[0] or "") and [c["function"] for c in found] == [c["function"] for c in whole[1]]
