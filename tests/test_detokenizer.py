"""Incremental detokenization: streamed pieces concatenate to exactly the full decode (multi-byte UTF-8,
BPE merges, special tokens) with both decoders (HF DecodeStream and the window decoder), and the output
processor cuts stop strings without ever streaming a part of them."""
import os

import numpy as np
import pytest
from helpers import make_tiny_model  # noqa: F401  (puts the repo root on sys.path)

from jaxinfer.detokenizer import ByteDetokenizer, FastDetokenizer, WindowDetokenizer, make_detokenizer
from jaxinfer.output_processor import OutputProcessor
from jaxinfer.tokenizer import ByteTokenizer
from scripts.make_tiny_model import build_tokenizer

TEXTS = [
    "你好，世界。今天天气很好。我们在学习推理引擎。",
    "Emoji: 😀 🚀 ✨ 👍🏽 and a family 👨‍👩‍👧",
    "Ça va? naïve café. The quick brown fox jumps over the lazy dog.",
    "mixed 中文 and English 😀😀 ünïcödé 🚀\n  def main():\n    return 0",
]


@pytest.fixture(scope="module")
def bpe():
    return build_tokenizer(400)


DECODERS = [FastDetokenizer, WindowDetokenizer]


def stream_pieces(tok, ids, chunk=1, cls=WindowDetokenizer):
    d = cls(tok)
    pieces = [d.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(d.flush())
    assert "".join(pieces) == d.text
    return pieces


def byte_fallback_tokenizer():
    """A Llama-2-style SentencePiece tokenizer (byte-fallback pieces <0x00>..<0xFF>, '▁' for spaces), built here."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{i:02X}>": 3 + i for i in range(256)}, "t\u2581infer": 259}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", clean_up_tokenization_spaces=False)


def test_a_byte_fallback_tokenizer_whose_text_changes_behind_the_stream_does_not_crash():
    """DecodeStream raises "Invalid prefix encountered" when a byte-fallback token turns earlier text into U+FFFD
    ('r' + 0x90): as vLLM's _protected_step, a new stream goes on from that token (it raised out of
    LLM.stream and the server's streams)."""
    tok = byte_fallback_tokenizer()
    ids = [3 + 0x72, 3 + 0x90, 259]
    for chunk in (1, 3):
        d = FastDetokenizer(tok)
        text = "".join(d.add(ids[i:i + chunk]) for i in range(0, 3, chunk)) + d.flush()
        assert text == d.text == "rt infer", chunk
    proc = OutputProcessor(tok, ("zz",), stream=True)
    assert proc.update(ids[:2]).text + proc.update(ids[2:], "length").text == "rt infer"


def test_logprob_texts_of_a_character_split_across_tokens_concatenate_to_the_text(bpe):
    """As vLLM's logprobs processor: a token whose text ends inside a character gets '' and the token that completes
    it the whole character, so decoded_token / the completions' tokens concatenate to the text and text_offset
    points at each token's text (they were U+FFFD each, and the offsets drifted)."""
    from jaxinfer.outputs import LogprobsList
    from jaxinfer.output_processor import TokenTexts
    from jaxinfer.server.responses import chat_logprobs, completion_logprobs
    for text in TEXTS:
        ids = bpe.encode(text, add_special_tokens=False)
        assert any(bpe.decode([t]).endswith("\ufffd") for t in ids), text     # (the case this is about)
        texts = TokenTexts(bpe)
        got = [texts(t, ids[max(0, i - 4):i]) for i, t in enumerate(ids)]
        assert "".join(got) == text and not any("\ufffd" in g for g in got), (text, got)
        rows = [[-0.5, 1, t, -0.5] for t in ids]                  # (the sampled token is its own top 1)
        lp = completion_logprobs(texts, ids, rows, 1)
        assert lp["tokens"] == got and all(text[o:].startswith(s) for o, s in zip(lp["text_offset"], got))
        for cut in (1, 5, len(ids) // 2):                        # streamed: the ids before each delta's first
            head = completion_logprobs(texts, ids[:cut], rows[:cut], 1)
            tail = completion_logprobs(texts, ids[cut:], rows[cut:], 1, 0, ids[:cut])
            assert head["tokens"] + tail["tokens"] == got
            chat = chat_logprobs(texts, ids[cut:], rows[cut:], 1, ids[:cut])["content"]
            assert [c["token"] for c in chat] == got[cut:] == [c["top_logprobs"][0]["token"] for c in chat]
            lst = LogprobsList(rows[cut:], ids[cut:], 1, texts, ids[max(0, cut - 4):cut])
            assert [d[t].decoded_token for d, t in zip(lst, ids[cut:])] == got[cut:]
        assert [texts(t) for t in ids] == [bpe.decode([t]) for t in ids]    # no context: the token alone
        echo = completion_logprobs(texts, ids, [None] + rows[1:], 1)        # echo: the first prompt token, no row
        assert echo["tokens"] == got and echo["text_offset"] == lp["text_offset"]
    # a token starting with bytes no earlier token completes (invalid UTF-8) keeps its text, U+FFFD and all
    odd = [t for t in range(400) if (d := bpe.decode([t])).startswith("\ufffd") and d.strip("\ufffd")]
    the = bpe.encode("the", add_special_tokens=False)
    for t in odd[:3]:
        ids = the + [t] + the
        texts = TokenTexts(bpe)
        got = [texts(x, ids[max(0, i - 4):i]) for i, x in enumerate(ids)]
        assert "".join(got) == bpe.decode(ids), (t, got)


def test_fast_decoder_is_chosen_for_fast_tokenizers(bpe):
    assert isinstance(make_detokenizer(bpe), FastDetokenizer)
    assert isinstance(make_detokenizer(ByteTokenizer()), ByteDetokenizer)


@pytest.mark.parametrize("cls", DECODERS)
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_bpe_pieces_concatenate_to_the_text(bpe, text, chunk, cls):
    ids = bpe.encode(text, add_special_tokens=False)
    pieces = stream_pieces(bpe, ids, chunk, cls)
    assert "".join(pieces) == bpe.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in p for p in pieces), pieces      # unfinished characters are held back
    assert sum(bool(p) for p in pieces) > len(pieces) // 3       # and it really streams


@pytest.mark.parametrize("cls", [ByteDetokenizer, WindowDetokenizer])
@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_holds_partial_characters(text, cls):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    pieces = stream_pieces(tok, ids, cls=cls)
    assert "".join(pieces) == text
    emoji = list("😀".encode())
    d = cls(tok)
    assert [d.add([b]) for b in emoji] == ["", "", "", "😀"]


@pytest.mark.parametrize("seed", range(6))
def test_random_ids_match_full_decode(bpe, seed):
    """Arbitrary ids (invalid byte runs, special tokens, ids the tokenizer lacks) still concatenate exactly,
    also when the ids end in an unfinished character (the fast decoder's flush)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 420, 60).tolist()
    for cls in DECODERS:
        assert "".join(stream_pieces(bpe, ids, cls=cls)) == bpe.decode(ids, skip_special_tokens=True)
    tok = ByteTokenizer()
    ids += rng.integers(0, 256, 40).tolist() + [0xE4, 0xB8]      # raw bytes, and an unfinished character
    for cls in (ByteDetokenizer, WindowDetokenizer):
        assert "".join(stream_pieces(tok, ids, cls=cls)) == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("cls", DECODERS)
def test_special_tokens_are_skipped(bpe, cls):
    eos = bpe.convert_tokens_to_ids("<|im_end|>")
    ids = bpe.encode("你好 world", add_special_tokens=False) + [eos]
    assert "".join(stream_pieces(bpe, ids, cls=cls)) == "你好 world"


def run_stream(tok, ids, stop, finish_at=None):
    proc, deltas = OutputProcessor(tok, stop, stream=True), []
    for n in range(1, len(ids) + 1):
        finished = n == len(ids) if finish_at is None else n == finish_at
        d = proc.update(ids[n - 1:n], "length" if finished else None)
        deltas.append(d.text)
        if d.finish_reason:
            return proc, deltas
    return proc, deltas


def test_stop_string_is_cut_and_never_streamed(bpe):
    text = "Hello world! How are you today? I am fine."
    ids = bpe.encode(text, add_special_tokens=False)
    ts, deltas = run_stream(bpe, ids, ("are you",))
    assert ts.stopped and ts.finish_reason == "stop" and ts.text == "Hello world! How " == "".join(deltas)
    assert not any("are" in d for d in deltas)


def test_stop_string_across_multibyte_pieces(bpe):
    text = "今天天气很好。我们在学习"
    ids = bpe.encode(text, add_special_tokens=False)
    ts, deltas = run_stream(bpe, ids, ("我们", "never"))
    assert ts.text == "今天天气很好。" == "".join(deltas)


def test_no_stop_match_releases_the_holdback_at_the_end(bpe):
    text = "The quick brown fox jumps"
    ids = bpe.encode(text, add_special_tokens=False)
    ts, deltas = run_stream(bpe, ids, ("a long stop string",))
    assert not ts.stopped and ts.finish_reason == "length" and "".join(deltas) == text
    assert deltas[-1]                                            # held-back tail comes out on finish


def test_a_stop_string_seen_before_min_tokens_stays_ignored_beside_a_longer_one(bpe):
    """vLLM searches each stop string only where it could end in the new text: a short one that showed up within
    min_tokens (where stop strings do not count) is not found later because a longer string widens the window."""
    ids = bpe.encode("Hello world! are you today?", add_special_tokens=False)
    first = bpe.decode(ids[:1])
    short = first.strip()[0]
    assert short not in bpe.decode(ids[1:])
    for stops in ((short,), (short, "a stop string that never occurs")):
        proc = OutputProcessor(bpe, stops, stream=True, min_tokens=2)
        texts = [proc.update([t], "length" if i == len(ids) - 1 else None).text for i, t in enumerate(ids)]
        assert not proc.stopped and "".join(texts) == proc.text == bpe.decode(ids), stops


def test_non_streaming_without_stop_decodes_once_at_the_end(bpe):
    text = "Hello world! 你好"
    ids = bpe.encode(text, add_special_tokens=False)
    proc = OutputProcessor(bpe, (), stream=False)
    assert proc._detok is None                                   # no per-token work at all
    deltas = [proc.update([t]).text for t in ids[:-1]] + [proc.update(ids[-1:], "length").text]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == text == proc.text
    assert proc.token_ids == ids
    assert proc.update([1, 2], None).token_ids == []             # after the finish, nothing more


@pytest.mark.parametrize("chunk", [2, 3, 5, 100])
def test_stop_string_ends_the_ids_however_they_are_batched(bpe, chunk):
    """Ids that arrive several at a time (a K-step call, a server reader that fell behind) end at the one that
    completes the stop string, as when they arrive one by one: the same text, ids and token count."""
    text = "Hello world! How are you today? I am fine."
    ids = bpe.encode(text, add_special_tokens=False)
    one, _ = run_stream(bpe, ids, ("are you",))
    proc, got_ids, got_text = OutputProcessor(bpe, ("are you",), stream=True), [], ""
    for i in range(0, len(ids), chunk):
        d = proc.update(ids[i:i + chunk], "length" if i + chunk >= len(ids) else None)
        got_ids, got_text = got_ids + d.token_ids, got_text + d.text
        if d.finish_reason:
            break
    assert proc.stopped and proc.token_ids == got_ids == one.token_ids and got_text == one.text == proc.text


def test_stop_token_text_is_left_out(bpe):
    """vLLM: a request that ends on a stop condition (a stop_token_ids token or EOS: the engine's "stop") keeps the
    token's id but not its text, streamed or not."""
    ids = bpe.encode("Hello world! How are you", add_special_tokens=False)
    want = bpe.decode(ids[:-1], skip_special_tokens=True)
    for stream in (True, False):
        proc = OutputProcessor(bpe, (), stream=stream)
        texts = [proc.update(ids[:-1]).text, proc.update(ids[-1:], "stop").text]
        assert "".join(texts) == proc.text == want and proc.token_ids == ids, stream


def test_include_stop_str_and_special_tokens(bpe):
    """vLLM's include_stop_str_in_output keeps the matched stop string (and a stop token's text) in the text, and
    skip_special_tokens=False keeps special tokens' text, except an EOS that ended the request (vLLM's detokenizer
    leaves the stop-terminating token out); streamed or not, the deltas add up to the text."""
    text = "Hello world! How are you today?"
    ids = bpe.encode(text, add_special_tokens=False)
    for stream in (True, False):
        proc = OutputProcessor(bpe, ("are you",), stream=stream, include_stop_str_in_output=True)
        got = "".join(proc.update([t], "length" if i == len(ids) - 1 else None).text for i, t in enumerate(ids)
                      if not proc.finished)
        assert proc.stopped and got == proc.text == "Hello world! How are you", stream
        proc = OutputProcessor(bpe, (), stream=stream, include_stop_str_in_output=True)
        got = proc.update(ids[:-1]).text + proc.update(ids[-1:], "stop").text
        assert got == proc.text == text, stream
        eos = bpe.convert_tokens_to_ids("<|im_end|>")
        proc = OutputProcessor(bpe, (), stream=stream, skip_special_tokens=False)   # EOS ends it: text left out
        got = proc.update(ids).text + proc.update([eos], "stop").text
        assert got == proc.text == text and proc.token_ids == ids + [eos], stream
        proc = OutputProcessor(bpe, (), stream=stream, skip_special_tokens=False, include_stop_str_in_output=True)
        got = proc.update(ids).text + proc.update([eos], "stop").text
        assert got == proc.text == text + "<|im_end|>", stream
        proc = OutputProcessor(bpe, (), stream=stream, skip_special_tokens=False)   # not the end: EOS text kept
        got = proc.update(ids + [eos]).text + proc.update(ids[:1], "length").text
        assert got == proc.text == text + "<|im_end|>" + bpe.decode(ids[:1]), stream


def test_a_stop_tokens_own_text_is_searched_for_stop_strings(bpe):
    """As current vLLM's detokenizer: with include_stop_str_in_output a stop token's text is searched for stop
    strings too (the string is the stop_reason and the text is cut after it); a string completed by the tokens
    before it matches first, also when they arrive in the same update (a K-step call)."""
    ids = bpe.encode("Hello world! How are you", add_special_tokens=False)
    last = bpe.decode(ids[-1:])                                       # " you"
    for stream in (True, False):
        proc = OutputProcessor(bpe, (last[:2],), stream=stream, include_stop_str_in_output=True)
        got = proc.update(ids[:-1]).text + proc.update(ids[-1:], "stop").text
        assert got == proc.text == bpe.decode(ids[:-1]) + last[:2] and proc.stop_string == last[:2], stream
        proc = OutputProcessor(bpe, ("How", last[:2]), stream=stream, include_stop_str_in_output=True)
        got = proc.update(ids, "stop").text                          # "How" ends it before the stop token
        assert proc.stopped and proc.stop_string == "How" and got == proc.text == "Hello world! How", stream
        assert proc.token_ids == ids[:len(proc.token_ids)] and len(proc.token_ids) < len(ids) - 1, stream


def test_of_two_stop_strings_in_one_update_the_one_completing_first_wins(bpe):
    """Current vLLM (check_stop_strings, earliest-completing): when one update (a multi-character token, a K-step
    call) completes several stop strings, the one ending first in the text is the stop_reason, whatever the
    list's order; the same end: the one listed first."""
    ids = bpe.encode("Hello world! How are you", add_special_tokens=False)
    for stop, want, text in ((("are", "How"), "How", "Hello world! "), (("How", "are"), "How", "Hello world! "),
                             (("w are", "are"), "w are", "Hello world! Ho"), (("are", "w are"), "are", "Hello world! How "),
                             (("re", "w a"), "w a", "Hello world! Ho")):
        proc = OutputProcessor(bpe, stop, stream=False)
        proc.update(ids[:2])
        proc.update(ids[2:])
        assert (proc.stop_string, proc.text) == (want, text), stop


def test_include_stop_str_in_output_holds_no_text_back(bpe):
    """As vLLM: text is held back while it could still start a stop string only when the string would be cut from
    the text; with include_stop_str_in_output a match is cut after its end, so each token's text goes out at once."""
    ids = bpe.encode("Hello world! How are you today?", add_special_tokens=False)
    for include, first in ((True, bpe.decode(ids[:1])), (False, "")):
        proc = OutputProcessor(bpe, ("are you today? and more",), stream=True, include_stop_str_in_output=include)
        deltas = [proc.update([t]).text for t in ids]
        assert deltas[0] == first and "".join(deltas) + proc.update([], "length").text == bpe.decode(ids), include


def test_the_presets_tokenizer_renders_a_given_chat_template():
    """Presets (ByteTokenizer) render ChatML, or a chat_template given (LLM.chat's argument, or set as the
    tokenizer's: the server's --chat-template) as transformers would; its errors are the template's."""
    from jaxinfer.prompts import render_chat
    tok, msgs = ByteTokenizer(), [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    tmpl = ("{% for m in messages %}[{{ m['role'] }}]: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}>{% endif %}")
    assert render_chat(tok, msgs[:1]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat(tok, msgs[:1], chat_template=tmpl) == "[user]: Hi\n>"
    assert render_chat(tok, msgs, add_generation_prompt=False, continue_final_message=True,
                       chat_template=tmpl) == "[user]: Hi\n[assistant]: Yo"
    tok.chat_template = tmpl
    assert render_chat(tok, msgs[:1]) == "[user]: Hi\n>" and tok.apply_chat_template(msgs[:1], tokenize=True) == \
        list(b"[user]: Hi\n>")
    with pytest.raises(ValueError, match="alternate"):
        render_chat(tok, msgs, chat_template="{{ raise_exception('roles must alternate') }}")
    # transformers' names: tools and documents None when not given, strftime_now (Llama 3.2's templates)
    probe = "{% if tools is none and documents is none %}none{% endif %}|{{ strftime_now('%Y') | length }}"
    assert render_chat(ByteTokenizer(), msgs[:1], chat_template=probe) == "none|4"
    # and transformers 5's message normalisation: keys whose value is None dropped, `reasoning` as reasoning_content
    probe = ("{% for m in messages %}{{ m.reasoning_content | default('-') }}/{{ m.content }}"
             "{% if m.tool_calls is defined %}T{% endif %}|{% endfor %}")
    turn = [{"role": "assistant", "content": "Yo", "reasoning": "hm", "tool_calls": None}]
    assert render_chat(ByteTokenizer(), turn, chat_template=probe, add_generation_prompt=False) == "hm/Yo|"


@pytest.mark.parametrize("tokenizer_class", ["Qwen2Tokenizer", "PreTrainedTokenizerFast", "GPT2Tokenizer"])
def test_load_tokenizer_matches_auto_tokenizer_without_torch(tmp_path, tokenizer_class):
    """load_tokenizer imports Qwen3's tokenizer classes directly (no torch import); it must give what
    AutoTokenizer gives: the same class, ids, text and chat prompt. Other classes still go through AutoTokenizer."""
    import json
    import shutil
    import subprocess
    import sys
    from transformers import AutoTokenizer
    from jaxinfer.tokenizer import load_tokenizer
    demo = os.path.join(os.path.dirname(__file__), "..", "jaxinfer", "assets", "qwen3-pydoc")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(demo, name), tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": tokenizer_class}))
    ours, auto = load_tokenizer(str(tmp_path)), AutoTokenizer.from_pretrained(str(tmp_path))
    assert type(ours) is type(auto)
    texts = ["def f(x):\n    return x  # ok\n", "héllo wörld 你好 🙂", "<|im_start|>user\nhi<|im_end|>", "  \n\n\t x"]
    for text in texts:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == auto.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == auto.decode(ids) and ours.decode(ids, skip_special_tokens=True) == \
            auto.decode(ids, skip_special_tokens=True)
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        auto.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours.eos_token_id == auto.eos_token_id and ours.all_special_ids == auto.all_special_ids
    if tokenizer_class != "GPT2Tokenizer":
        code = f"import sys; from jaxinfer.tokenizer import load_tokenizer; load_tokenizer({str(tmp_path)!r}); " \
               "print('torch' in sys.modules)"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "False", out.stderr[-2000:]
