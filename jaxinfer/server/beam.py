"""vLLM's beam search on the server: `"use_beam_search": true` on /v1/completions and /v1/chat/completions, with
`n` the beam width (<= 10) and `length_penalty` (vLLM's request fields).

The search is `LLM.beam_search`'s (jaxinfer/beam_search.py) with the engine requests sent to the core: each step,
every live beam of every prompt is a request for one token with 2 * n logprobs. The request's n best beams become its
n choices, best first: their generated tokens, text (an ending EOS left out, as vLLM's), logprobs when asked, and
finish_reason "stop" (an EOS id) or "length". Streamed, each choice comes whole in one chunk once the search ends
(vLLM's too: its search yields once). Only temperature, max_tokens (max_completion_tokens), ignore_eos, length_penalty,
logprobs and the text options shape a beam search; the sampling fields it does not use are refused by name (vLLM
ignores them), and so is `length_penalty` without `use_beam_search`.
"""
from __future__ import annotations

from dataclasses import replace

from jaxinfer import beam_search
from jaxinfer.output_processor import OutputProcessor, TextDelta
from jaxinfer.outputs import logprob_dict
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.server.choices import Choice
from jaxinfer.server.errors import RequestError

# request fields that a beam search does not use, with the values that mean "not used"
UNUSED = {"top_p": (None, 1.0), "top_k": (None, 0, -1), "min_p": (None, 0.0), "seed": (None,), "stop": (None, [], ""),
          "stop_token_ids": (None, []), "presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0),
          "repetition_penalty": (None, 1.0), "min_tokens": (None, 0), "logit_bias": (None, {}),
          "allowed_token_ids": (None,), "bad_words": (None, []), "structured_outputs": (None,),
          "guided_choice": (None,), "guided_json": (None,), "guided_regex": (None,),
          "response_format": (None, {"type": "text"}), "echo": (None, False), "prompt_logprobs": (None,), "tools": (None, [])}


def check(req, limits: dict) -> None:
    """400s for a beam search the server cannot run as asked (fields named), before anything is submitted.
    limits: the core's (its max_logprobs bounds the width: a step asks for 2 * n logprobs)."""
    if not req.use_beam_search:
        if req.length_penalty not in (None, 1.0):
            raise RequestError("length_penalty applies to beam search only: give use_beam_search: true",
                               param="length_penalty")
        return
    cap = limits["vocab_size"] if limits.get("max_logprobs", 20) == -1 else limits.get("max_logprobs", 20)
    if (req.n or 1) > cap // 2:
        raise RequestError(f"n={req.n} is the beam width under use_beam_search and may be at most {cap // 2} (each "
                           f"step asks for 2 * n logprobs, at most {cap}: max_logprobs)", param="n")
    for name, unused in UNUSED.items():
        if getattr(req, name, None) not in unused:
            raise RequestError(f"{name} is not used by beam search (use_beam_search: true); leave it out",
                               param=name, code="unsupported_parameter")


async def search(step, tokenizer, prompts: list[list[int]], params: list[SamplingParams], n: int,
                 length_penalty: float, eos: tuple, max_model_len: int, gone=None) -> list[Choice]:
    """The n best beams of each prompt (beam_search.search's rules) as finished choices (index = prompt * n + rank).
    `step(items)` runs engine requests [(ids, SamplingParams)] to their end and returns their Choices (app.collect).
    `gone()` (awaited between steps: a step can be shorter than app.collect's disconnect poll): the client left, so
    the search ends (499)."""
    one = SamplingParams(max_tokens=1, logprobs=2 * n, temperature=params[0].temperature, ignore_eos=True,
                         detokenize=False)                  # (a request's prompts share their sampling fields)
    limits = [min(max_model_len, len(ids) + sp.max_tokens) for ids, sp in zip(prompts, params)]
    run = beam_search.search(prompts, n, limits, frozenset(eos[0]), params[0].ignore_eos, length_penalty)
    try:
        todo = next(run)
        while True:
            if gone is not None and await gone():
                raise RequestError("the client disconnected", status=499)
            chs = await step([(t, one) for t in todo])
            todo = run.send([[(t, lp.logprob, [lp.logprob, lp.rank, *ch.logprobs[0][2:]]) for t, lp in
                              logprob_dict(ch.logprobs[0], ch.token_ids[0], 2 * n).items()] for ch in chs])
    except StopIteration as end:
        results = end.value
    out = []
    for i, (sp, best) in enumerate(zip(params, results)):
        final = replace(sp, n=1)
        for j, b in enumerate(best):
            proc = OutputProcessor.for_params(tokenizer, final, False)
            ch = Choice(i * n + j, prompts[i], final, proc, (frozenset(eos[0]), eos[1]))
            ch.proc.update(b.tokens[len(prompts[i]):], b.finish_reason)
            ch.logprobs = b.logprobs                   # (the engine's row form: the candidate's logprob and rank)
            out.append(ch)
    return out


async def as_run(choices_awaitable):
    """A finished search as choices.run's stream: (choice, its whole text delta) for each choice."""
    for ch in await choices_awaitable:
        yield ch, TextDelta(ch.proc.text, ch.token_ids, ch.proc.finish_reason)
