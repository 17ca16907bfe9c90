"""vLLM's beam search: `LLM.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=32))` -> one
BeamSearchOutput per prompt, its `sequences` the best beam_width beams, best first.

The search is vLLM's (its `LLM.beam_search`), run over `generate`:
- each step, every live beam is a prompt (the tokens so far) that generates one token with logprobs = 2 * beam_width;
  each returned candidate (the top 2 * beam_width, and the sampled token when temperature > 0 picks another) extends
  the beam by that token and adds its logprob to the beam's cumulative logprob;
- a candidate ending in an EOS id is complete, unless ignore_eos (the ids `generate` stops at: the tokenizer's EOS and
  the model's config ones, e.g. Qwen3's <|endoftext|> beside <|im_end|>; vLLM's checks the tokenizer's alone and runs
  past the others); so is a beam that
  reached max_model_len (finish_reason "length"); the rest are ranked by score and the best beam_width stay live;
- after max_tokens steps, or once no beam is live, the complete and live beams together are ranked and the best
  beam_width returned, each with `text`, the decoded tokens: the prompt's as well, as vLLM's.
Score = cum_logprob / len(tokens) ** length_penalty, where tokens hold the prompt too and a final EOS does not count
(transformers' length penalty, as vLLM applies it). Logprobs are the model's own (before temperature), so
temperature only changes which extra token is sampled. Each step's prompts extend the last step's, so with prefix
caching (the default) only the newest tokens of each beam are computed again (those past its last full block).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from jaxinfer.outputs import Logprob


def _check(name: str, value, ok: bool, want: str) -> None:
    if not ok:
        raise ValueError(f"BeamSearchParams.{name} must be {want}, got {value!r:.80}")


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class BeamSearchParams:
    """vLLM's (`from jaxinfer.sampling_params import BeamSearchParams`), validated on construction."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False        # (vLLM's field; beams end on EOS only, so no stop string shows)

    def __post_init__(self):
        for name in ("beam_width", "max_tokens"):
            v = getattr(self, name)
            _check(name, v, isinstance(v, int) and not isinstance(v, bool) and v >= 1, "an int >= 1")
        _check("temperature", self.temperature, _number(self.temperature) and self.temperature >= 0,
               "a finite number >= 0")
        _check("length_penalty", self.length_penalty, _number(self.length_penalty), "a finite number")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            _check(name, getattr(self, name), isinstance(getattr(self, name), bool), "a bool")


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` (the prompt's and the generated), the per-step logprobs dicts of its generated tokens,
    `cum_logprob` their sum, `text` (set on the returned beams), finish_reason "stop" (EOS) or "length"."""
    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    lora_request: None = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best beam_width beams of one prompt, best first."""
    sequences: list[BeamSearchSequence]


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_id,
                          length_penalty: float = 1.0) -> float:
    """cumulative_logprob / len(tokens) ** length_penalty, a final EOS not counted (vLLM's; eos_token_id: an id, or
    a set of them)."""
    n = len(tokens) - (1 if tokens and _is_eos(tokens[-1], eos_token_id) else 0)
    return cumulative_logprob / (max(n, 1) ** length_penalty)


def _is_eos(token: int, eos) -> bool:
    return token in eos if isinstance(eos, (set, frozenset, tuple, list)) else token == eos


def create_sort_beams_key_function(eos_token_id, length_penalty: float):
    """vLLM's: the score of a BeamSearchSequence, as a sort key."""
    return lambda beam: get_beam_search_score(beam.tokens, beam.cum_logprob, eos_token_id, length_penalty)


def search(prompts: list[list[int]], width: int, limits: list[int], eos, ignore_eos: bool = False,
           length_penalty: float = 1.0):
    """vLLM's search (the module's rules) as a generator, driven by `LLM.beam_search` and the server (server/beam.py).
    It yields the token lists to extend by one token (every live beam of every prompt) and is sent, for each, its
    candidates [(token id, logprob, kept)] (`kept`: what the new beam keeps of this step in its `logprobs`); it
    returns, per prompt, the best `width` BeamSearchSequences, best first, with their finish_reason. limits[i]: the
    most tokens (prompt and output) prompt i's beams may hold; eos: the EOS ids (a set)."""
    def score(b: BeamSearchSequence) -> float:
        return get_beam_search_score(b.tokens, b.cum_logprob, eos, length_penalty)
    lives = [[BeamSearchSequence(list(ids))] for ids in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    while True:
        for i, limit in enumerate(limits):             # beams with no room for another token are complete
            done[i] += [b for b in lives[i] if len(b.tokens) >= limit]
            lives[i] = [b for b in lives[i] if len(b.tokens) < limit]
        live = [(i, b) for i, beams in enumerate(lives) for b in beams]
        if not live:
            break
        candidates = yield [b.tokens for _, b in live]
        grown: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for (i, b), found in zip(live, candidates):
            for t, lp, kept in found:
                new = BeamSearchSequence(b.tokens + [t], b.logprobs + [kept], cum_logprob=b.cum_logprob + lp)
                (done[i] if _is_eos(t, eos) and not ignore_eos else grown[i]).append(new)
        lives = [sorted(g, key=score, reverse=True)[:width] for g in grown]
    results = []
    for i, ids in enumerate(prompts):
        best = sorted(done[i] + lives[i], key=score, reverse=True)[:width]
        for b in best:
            ended = _is_eos(b.tokens[-1], eos) and not ignore_eos and len(b.tokens) > len(ids)
            b.finish_reason = "stop" if ended else "length"
        results.append(best)
    return results


def beam_search(llm, prompts, params: BeamSearchParams, lora_request=None, use_tqdm: bool = False,
                concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
    """`LLM.beam_search` (vLLM's signature; the module's docstring has the rules). `concurrency_limit`: how many
    prompts are searched at once (None: all)."""
    from jaxinfer import prompts as prompt_forms
    from jaxinfer.output_processor import TokenTexts
    from jaxinfer.sampling_params import SamplingParams

    prompt_forms.check_unsupported("LLM.beam_search", lora_request=lora_request)
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__} {params!r:.80}")
    params.__post_init__()                          # (a field set after construction: checked too)
    cap = llm.model_config.vocab_size if llm.config.max_logprobs == -1 else llm.config.max_logprobs
    if 2 * params.beam_width > cap:
        raise ValueError(f"beam_width={params.beam_width} is too wide: each step asks for 2 * beam_width = "
                         f"{2 * params.beam_width} logprobs, and {cap} is the most the engine returns "
                         f"(max_logprobs), so beam_width may be at most {cap // 2}")
    if concurrency_limit is not None and (not isinstance(concurrency_limit, int) or isinstance(concurrency_limit, bool)
                                          or concurrency_limit < 1):
        raise ValueError(f"concurrency_limit must be None or an int >= 1, got {concurrency_limit!r:.80}")
    step = SamplingParams(max_tokens=1, logprobs=2 * params.beam_width, temperature=params.temperature,
                          ignore_eos=True, detokenize=False)
    ids = [ids for _, ids, _ in llm._prepare(prompts, step)]      # (checks every prompt first)
    width = concurrency_limit or max(len(ids), 1)
    results = []
    for start in range(0, len(ids), width):
        group = ids[start:start + width]
        limits = [min(llm.config.max_model_len, len(p) + params.max_tokens) for p in group]
        run = search(group, params.beam_width, limits, llm._eos[0], params.ignore_eos, params.length_penalty)
        bar = tqdm(total=params.max_tokens, desc="Beam search", disable=None) if use_tqdm else None   # (off: none)
        try:
            todo = next(run)
            while True:
                outs = llm.generate([{"prompt_token_ids": t} for t in todo], step, use_tqdm=False)
                if bar is not None:
                    bar.update(1)
                found = [o.outputs[0].logprobs[0] for o in outs]         # ({token: Logprob} a beam)
                todo = run.send([[(t, lp.logprob, d) for t, lp in d.items()] for d in found])
        except StopIteration as end:
            results += end.value
        finally:
            if bar is not None:
                bar.close()
    texts = TokenTexts(llm.tokenizer)
    for best in results:
        for b in best:
            b.text = llm.tokenizer.decode(b.tokens)       # (vLLM's: the prompt's too, special tokens kept)
            for entry in b.logprobs:                      # vLLM's decoded_token (the steps ran without detokenizing)
                for t, lp in entry.items():
                    lp.decoded_token = texts(t)
    return [BeamSearchOutput(best) for best in results]
