"""LLM.stream (deltas as tokens arrive) and LLM.chat (chat template, enable_thinking) on a tiny checkpoint."""
import pytest

from helpers import TINY_ENGINE

from jaxinfer import LLM, SamplingParams

BASE = TINY_ENGINE
PROMPTS = ["你好，世界。", "Emoji: 😀 🚀", "The quick brown fox", [5, 6, 7, 8, 9]]


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, **BASE)


def idle(llm):
    st = llm.stats()
    return st["kv_blocks_free"] == st["kv_blocks_total"] and st["running"] == st["waiting"] == 0


def collect(llm, prompts, sp):
    texts, ids, reasons = {}, {}, {}
    for d in llm.stream(prompts, sp):
        assert reasons.get(d.request_id) is None, "delta after the last one"
        texts[d.request_id] = texts.get(d.request_id, "") + d.text
        ids[d.request_id] = ids.get(d.request_id, []) + d.token_ids
        reasons[d.request_id] = d.finish_reason
    return texts, ids, reasons


@pytest.mark.parametrize("sp", [SamplingParams(temperature=0, max_tokens=20),
                                SamplingParams(temperature=0.8, seed=3, max_tokens=20),
                                SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=["o", "好"])])
def test_stream_deltas_concatenate_to_generate(llm, sp):
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    texts, ids, reasons = collect(llm, PROMPTS, sp)
    assert [texts[i] for i in range(len(PROMPTS))] == [o.text for o in outs]
    assert [ids[i] for i in range(len(PROMPTS))] == [o.token_ids for o in outs]
    assert [reasons[i] for i in range(len(PROMPTS))] == [o.finish_reason for o in outs]
    assert idle(llm)


def test_generate_with_stream_true_streams(llm):
    """Issue 6's other spelling: llm.generate(..., stream=True) is llm.stream(...); priority / tokenization_kwargs
    (generate's own) are refused with it, naming them, and the engine stays usable."""
    sp = SamplingParams(temperature=0, max_tokens=12)
    got = [(d.request_id, d.text, d.token_ids, d.finish_reason) for d in llm.generate(PROMPTS, sp, stream=True)]
    assert got == [(d.request_id, d.text, d.token_ids, d.finish_reason) for d in llm.stream(PROMPTS, sp)]
    assert len(got) > len(PROMPTS)
    with pytest.raises(ValueError, match="priority"):
        llm.generate(PROMPTS, sp, stream=True, priority=[0] * len(PROMPTS))
    assert idle(llm) and llm.generate(PROMPTS[:1], sp, use_tqdm=False)[0].token_ids


def test_stream_with_n_samples_finishes_the_request_once(llm):
    """n > 1: each delta holds the sample that moved; the request's `finished` and `finish_reason` come on its last
    delta only, once every sample ended (vLLM's DELTA mode), and each sample's deltas concatenate to its output."""
    sp = SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=10, ignore_eos=True)
    first = llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0]
    sp.stop_token_ids = [first.outputs[0].token_ids[2]]            # sample 0 stops early, the others run on
    want = llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0]
    assert len(want.outputs[0].token_ids) == 3 and want.finished and want.finish_reason == "stop"
    deltas = list(llm.stream([[5, 6, 7]], sp))
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert [d.finish_reason is not None for d in deltas] == [d.finished for d in deltas]
    for o in want.outputs:
        mine = [d.outputs[0] for d in deltas if d.outputs[0].index == o.index]
        assert [t for c in mine for t in c.token_ids] == o.token_ids and "".join(c.text for c in mine) == o.text
        assert [c.finish_reason for c in mine][-1] == o.finish_reason and not any(c.finish_reason for c in mine[:-1])
    assert idle(llm)


def test_stop_strings_cut_the_text(llm):
    free = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    stop = next(o.text[3:5] for o in free if len(o.text) > 6 and "\ufffd" not in o.text[3:5])
    out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=stop),
                       use_tqdm=False)
    for f, o in zip(free, out):
        if stop in f.text:
            assert o.text == f.text[:f.text.index(stop)] and o.finish_reason == "stop"
        else:
            assert o.text == f.text and o.finish_reason == "length"


def test_leaving_a_stream_early_aborts_and_frees_blocks(llm):
    it = llm.stream(PROMPTS, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    first = next(it)
    assert first.token_ids
    assert not idle(llm)
    it.close()
    assert idle(llm)
    sp = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    with llm.stream(PROMPTS, sp) as s:      # a `with` block closes it on leaving, a break included
        for i, d in enumerate(s):
            if i == 2:
                break
        assert not idle(llm)
    assert idle(llm)
    for d in llm.stream(PROMPTS, sp):      # a break out of a stream no variable keeps: dropped, so closed
        break
    assert idle(llm)


def test_chat_applies_the_template(llm):
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]
    sp = SamplingParams(temperature=0, max_tokens=8)
    [out] = llm.chat(conv, sp, use_tqdm=False)
    assert out.prompt == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello world!<|im_end|>\n"
                          "<|im_start|>assistant\n")
    assert out.token_ids == llm.generate(out.prompt, sp, use_tqdm=False)[0].token_ids
    [nothink] = llm.chat(conv, sp, chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)
    assert nothink.prompt == out.prompt + "<think>\n\n</think>\n\n"
    many = llm.chat([conv, conv[1:]], sp, use_tqdm=False)
    assert len(many) == 2 and many[0].token_ids == out.token_ids
    # OpenAI-style text parts, joined by newlines (as vLLM)
    parts = [conv[0], {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world!"}]}]
    [joined] = llm.chat(parts, sp, use_tqdm=False)
    assert joined.prompt == out.prompt.replace("Hello world!", "Hello\nworld!")
    assert idle(llm)


def test_chat_takes_vllms_arguments(llm):
    """vLLM's LLM.chat signature: use_tqdm third (a dict there is chat_template_kwargs, the older form),
    add_generation_prompt, continue_final_message, chat_template; LoRA and tools are refused by name."""
    conv = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi th"}]
    sp = SamplingParams(temperature=0, max_tokens=4)
    [plain] = llm.chat(conv[:1], sp, False)
    assert plain.prompt.endswith("<|im_start|>assistant\n")
    [nothink] = llm.chat(conv[:1], sp, {"enable_thinking": False})
    assert nothink.prompt == plain.prompt + "<think>\n\n</think>\n\n"
    [cont] = llm.chat(conv, sp, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert cont.prompt.endswith("<|im_start|>assistant\nHi th")
    [closed] = llm.chat(conv, sp, use_tqdm=False, add_generation_prompt=False)
    assert closed.prompt == cont.prompt + "<|im_end|>\n"
    own_template = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
    [own] = llm.chat(conv[:1], sp, use_tqdm=False, chat_template=own_template)
    assert own.prompt == "Hello|"
    for kw, word in [(dict(continue_final_message=True), "continue_final_message"), (dict(lora_request=1), "lora"),
                     (dict(tools="f"), "tools"), (dict(chat_template_content_format="x"), "content_format"),
                     (dict(mm_processor_kwargs={"x": 1}), "mm_processor_kwargs")]:
        with pytest.raises(ValueError, match=word):
            llm.chat(conv, sp, use_tqdm=False, **kw)
    assert llm.chat([], sp) == [] and llm.chat(conv[:1], sp, use_tqdm=False, mm_processor_kwargs=None)
    assert idle(llm)


def test_chat_passes_tools_and_tool_turns_to_the_template(llm, monkeypatch):
    """As vLLM's LLM.chat: `tools` reach the template; an assistant turn with only tool_calls (content None or
    missing) and empty or plain-string content parts render as text; a given chat_template is used even when the
    tokenizer has none."""
    sp = SamplingParams(temperature=0, max_tokens=2)
    template = ("{% for t in tools or [] %}[{{ t['function']['name'] }}]{% endfor %}{% for m in messages %}"
                "{{ m['role'] }}:{{ m['content'] }}{% if m.get('tool_calls') %}<call>{% endif %}|{% endfor %}")
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    call = [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]
    conv = [{"role": "user", "content": [{"type": "text", "text": "Paris?"}, "Now"]},
            {"role": "assistant", "content": None, "tool_calls": call},
            {"role": "tool", "content": "sunny", "tool_call_id": "c1"}, {"role": "assistant", "tool_calls": call},
            {"role": "user", "content": []}]
    [out] = llm.chat(conv, sp, use_tqdm=False, chat_template=template, tools=tools)
    assert out.prompt == "[weather]user:Paris?\nNow|assistant:<call>|tool:sunny|assistant:<call>|user:|"
    monkeypatch.setattr(llm.tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat(conv[:1], sp, use_tqdm=False)
    [own] = llm.chat(conv[:1], sp, use_tqdm=False, chat_template=template)
    assert own.prompt == "user:Paris?\nNow|"
    assert idle(llm)


def test_chat_gives_tool_call_arguments_and_content_parts_as_vllm(llm):
    """As vLLM's chat preprocessing: an assistant's tool-call arguments reach the template as a mapping (a JSON
    string parsed; "" or None: {}), so a template may iterate them or print them with tojson; "refusal" and
    "thinking" content parts are text; a part whose text is None is skipped. The caller's messages are unchanged."""
    template = ("{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}{% for c in m.get('tool_calls') or [] %}"
                "<{{ c['function']['name'] }} {{ c['function']['arguments'] | tojson }}"
                "{% for k, v in c['function']['arguments'] | items %} {{ k }}={{ v }}{% endfor %}>{% endfor %}|"
                "{% endfor %}")
    def call(arguments):
        return {"id": "c", "type": "function", "function": {"name": "w", "arguments": arguments}}
    conv = [{"role": "user", "content": [{"type": "text", "text": "Paris?"}, {"type": "text", "text": None}, "",
                                         {"type": "text", "text": ""}]},          # (empty parts: left out too)
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}],
             "tool_calls": [call('{"city":"Paris"}'), call(""), call(None), call({"a": 1})]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "Hm."}, {"type": "text", "text": "Ok"}]}]
    before = repr(conv)
    [out] = llm.chat(conv, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False, chat_template=template)
    assert out.prompt == ('user:Paris?|assistant:No.<w {"city": "Paris"} city=Paris><w {}><w {}><w {"a": 1} a=1>|'
                          'assistant:Hm.\nOk|')
    assert repr(conv) == before
    bad = [{"role": "assistant", "content": "", "tool_calls": [call("{not json")]}]
    with pytest.raises(ValueError, match="message 0: tool call arguments"):
        llm.chat(bad, use_tqdm=False, chat_template=template)
    assert idle(llm)


def test_chat_content_format_tool_turns_and_template_kwargs_as_current_vllm(llm):
    """Current vLLM's chat preprocessing: a template looping over `m['content'].split(...)` reads a string (only a
    loop over the content itself, maybe filtered or sliced, takes the parts); an empty tool_calls list is left out;
    a tool result's parts are one string also for a template that takes parts; chat_template inside
    chat_template_kwargs is refused; a non-text part is refused naming its type."""
    from jaxinfer.prompts import render_chat
    tok, sp = llm.tokenizer, SamplingParams(temperature=0, max_tokens=1)
    lines = ("{% for m in messages %}{{ m['role'] }}:{% for x in m['content'].split('\n') %}>{{ x }};{% endfor %}|"
             "{% endfor %}")
    assert render_chat(tok, [{"role": "user", "content": "a\nb"}], chat_template=lines,
                       add_generation_prompt=False) == "user:>a;>b;|"
    parts = ("{% for m in messages %}{{ m['role'] }}:{% if m.tool_calls is defined %}T{% endif %}"
             "{% for p in m['content'] | selectattr('type') %}[{{ p['text'] }}]{% endfor %}"
             "{% if m['content'] is string %}{{ m['content'] }}{% endif %}|{% endfor %}")
    conv = [{"role": "assistant", "content": "Hi", "tool_calls": []},
            {"role": "tool", "content": [{"type": "text", "text": "sunny"}, {"type": "text", "text": "warm"}]},
            {"role": "user", "content": [{"type": "text", "text": "ok"}]}]
    assert render_chat(tok, conv, chat_template=parts, add_generation_prompt=False) == \
        "assistant:[Hi]|tool:sunny\nwarm|user:[ok]|"
    with pytest.raises(ValueError, match="chat_template_kwargs must not hold 'chat_template'"):
        llm.chat([{"role": "user", "content": "Hi"}], sp, chat_template_kwargs={"chat_template": parts}, use_tqdm=False)
    with pytest.raises(ValueError, match="unsupported chat content part type 'file'"):
        llm.chat([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "file"}]}], sp, use_tqdm=False)
    assert idle(llm)


@pytest.mark.parametrize("bad", ["hello", [{"role": 1, "content": "x"}], [{"content": "x"}], [[]],
                                 [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]])
def test_chat_rejects_bad_messages(llm, bad):
    with pytest.raises(ValueError, match="message|conversation"):
        llm.chat(bad, use_tqdm=False)
    assert idle(llm)


def test_preset_byte_tokenizer_chat_template():
    from jaxinfer.tokenizer import ByteTokenizer
    text = ByteTokenizer().apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
