"""Structured outputs after the thinking (vLLM's `reasoning_parser`): a request's choice / json / regex applies from
the token after `</think>`, unless its prompt closed the thinking. The thinking is the unconstrained greedy output;
what follows it is the constrained greedy output of the prompt extended by the thinking; pipelined steps (the step
in flight may be drawing `</think>`), preemption, a batch of mixed rows, the chat template's enable_thinking."""
import pytest
import regex
from helpers import TINY_ENGINE

import jaxinfer.llm
from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.sequence import Sequence
from jaxinfer.structured import OFF, reasoning_marks, thinking_closed

PROMPTS = [[5, 7, 9, 11, 300, 2, 3, 17, 40, 41, 8], [100, 200, 300, 100, 200], [9, 8, 7, 6, 5, 4, 3]]
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "the blue"]}, "n": {"type": "integer"}},
          "required": ["color", "n"]}
REGEX = r"(cat|dog)s? [0-9]{1,3}!"
KINDS = [{"regex": REGEX}, {"json": SCHEMA}, {"choice": ["yes", "no", "maybe not"]}]
N = 36


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, reasoning_parser="qwen3", **TINY_ENGINE)


def ends_at(free: list[int], lo: int = 0, hi: int = N) -> dict[int, int]:
    """k -> the id at position k of an unconstrained output, for the k in [lo, hi) whose id is new there (a
    thinking's end)."""
    return {k: free[k] for k in range(lo, min(hi, len(free))) if free[k] not in free[:k] and free[k] != 2}


def constrained(llm, prompt, kind, n, **kw):
    sp = SamplingParams(temperature=0, max_tokens=n, structured_outputs=kind, **kw)
    return llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids


def test_thinking_then_structured_output(llm, monkeypatch):
    """For several thinking lengths, each kind beside a plain row and the other kinds in one batch: the output is the
    unconstrained thinking up to its end id, then the constrained greedy output of the prompt extended by it. Rows
    are packed while the step that may draw the end id is in flight (the device applies the constraint only if it
    did), and the plain row is unchanged."""
    plain = SamplingParams(temperature=0, max_tokens=N)
    free = llm.generate(PROMPTS[0], plain, use_tqdm=False)[0].outputs[0].token_ids
    ends = ends_at(free, 0, N - 8)
    assert len(ends) >= 3, free
    ends = {k: ends[k] for k in sorted(ends)[::max(1, len(ends) // 3)]}
    armed, current = [], {}
    real = Sequence.constraint
    monkeypatch.setattr(Sequence, "constraint", lambda s: armed.append(c := real(s)) or c)
    monkeypatch.setattr(jaxinfer.llm, "reasoning_wait", lambda marks, ids, sp: current.get("end")
                        if sp.structured_outputs is not None else None)
    for k, end in ends.items():
        current["end"] = end
        sps = [SamplingParams(temperature=0, max_tokens=N, structured_outputs=kind) for kind in KINDS] + [plain]
        outs = [o.outputs[0] for o in llm.generate([PROMPTS[0]] * len(sps), sps, use_tqdm=False)]
        current["end"] = None
        assert outs[-1].token_ids == free
        for out, kind in zip(outs, KINDS):
            thinking = free[:k + 1]
            assert out.token_ids[:k + 1] == thinking, (k, kind)
            assert out.token_ids[k + 1:] == constrained(llm, PROMPTS[0] + thinking, kind, N - k - 1), (k, kind)
        text = llm.get_tokenizer().decode(outs[0].token_ids[k + 1:], skip_special_tokens=True)
        assert regex.fullmatch(REGEX, text) or outs[0].finish_reason == "length", text
    assert any(c[0] >= 0 for c in armed) and any(c[0] == OFF for c in armed)      # (armed in flight, and off)
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_real_end_token_and_closed_prompts(llm):
    """With the tokenizer's own `</think>` (drawn first through a logit bias, which the constraint then overrides),
    the rest is the constrained output of the prompt ending with `</think>`, which a prompt closing the thinking
    gets from its first token; the chat template with enable_thinking false closes it too, and so does an assistant
    answer continued after its closed thinking; an earlier turn's does not."""
    tok = llm.get_tokenizer()
    end = tok.convert_tokens_to_ids("</think>")
    for kind in KINDS[:2]:
        sp = SamplingParams(temperature=0, max_tokens=N, structured_outputs=kind, logit_bias={end: 100.0},
                            skip_special_tokens=False)
        [out] = [o.outputs[0] for o in llm.generate(PROMPTS[1], sp, use_tqdm=False)]
        [closed] = [o.outputs[0] for o in llm.generate(PROMPTS[1] + [end], sp, use_tqdm=False)]
        assert out.token_ids[0] == end and out.token_ids[1:] == closed.token_ids[:N - 1], kind
        assert out.text.startswith("</think>")
    msgs = [{"role": "user", "content": "the cat"}]
    sp = SamplingParams(temperature=0, max_tokens=N, structured_outputs={"regex": REGEX})
    off = llm.chat(msgs, sp, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})[0].outputs[0]
    assert regex.fullmatch(REGEX, off.text) or off.finish_reason == "length", off.text
    prompt = llm.get_tokenizer().apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                                     enable_thinking=False)
    marks = reasoning_marks("qwen3", tok)
    ids = tok.encode(prompt, add_special_tokens=False)
    assert thinking_closed(ids, marks) and thinking_closed(ids + tok.encode("The answer is"), marks)  # (continued)
    assert not thinking_closed(PROMPTS[0], marks)
    turn = tok.encode(prompt + "yes<|im_end|>\n<|im_start|>user\nmore</think><|im_end|>\n<|im_start|>assistant\n")
    assert not thinking_closed(turn, marks)                 # (an earlier turn's thinking, a quoted tag)
    cont = [*msgs, {"role": "assistant", "content": "<think>\nok\n</think>\n\nThe answer is "}]
    out = llm.chat(cont, SamplingParams(temperature=0, max_tokens=N, structured_outputs={"choice": ["yes", "no"]}),
                   use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0].outputs[0]
    assert out.text in ("yes", "no"), out.text            # (constrained from its first token)


def test_preempted_thinking_rows_resume(tiny_dir, llm, monkeypatch):
    """With a pool too small for all rows, preempted rows (some still thinking) give the tokens of a roomy run."""
    prompts = [[i + 3, 7, 9, 11, 300, 2, 3, 17] for i in range(6)]
    plain = SamplingParams(temperature=0, max_tokens=N)
    frees = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    ends = {tuple(p): next(iter(ends_at(f, 4, 12).values()), None) for p, f in zip(prompts, frees)}
    monkeypatch.setattr(jaxinfer.llm, "reasoning_wait", lambda marks, ids, sp: ends[tuple(ids)])
    sp = SamplingParams(temperature=0, max_tokens=N, structured_outputs={"json": SCHEMA})
    roomy = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    small = LLM(tiny_dir, **{**TINY_ENGINE, "num_kvcache_blocks": 40})
    assert [o.outputs[0].token_ids for o in small.generate(prompts, sp, use_tqdm=False)] == roomy
    assert small.stats()["preemptions"] > 0
    assert small.stats()["kv_blocks_free"] == small.stats()["kv_blocks_total"]
    for p, f, out in zip(prompts, frees, roomy):
        k = f.index(ends[tuple(p)]) if ends[tuple(p)] is not None else -1
        assert out[:k + 1] == f[:k + 1]


def test_refusals(tiny_dir):
    with pytest.raises(ValueError, match="reasoning_parser='qwq' is not one of"):
        LLM(tiny_dir, reasoning_parser="qwq", **TINY_ENGINE)
