"""vLLM's `bad_words` (SamplingParams): words the output must not contain, as token sequences.

Each word is tokenized as vLLM does: as written (left-stripped), and with a leading space when that gives a different
first token in as many tokens (the word inside a text). A sequence [t1, ..., tm] bans tm from a step whose output so
far ends with t1 .. t(m-1); a one-token sequence bans its token always. Only generated tokens count (not the prompt).

On the device (step.make_extras_step) each row holds up to a width of (token id, condition) entries: the id is banned
(its logit set to -inf) when the condition is NO_COND or equals the row's input token. The condition is what lets the
host pack a step before it has read the one in flight: that step's sampled token, this step's input, is the only one
it does not know (`entries`), and rows with bad words run one step a call (no K-step form).
"""
from __future__ import annotations

MAX_SEQUENCES = 128        # token sequences a request's words may make (vLLM's VLLM_MAX_NUM_BAD_WORDS)
WIDTHS = (16, MAX_SEQUENCES)   # entries a row holds in a step (step.Extras.bad_words): the smallest that fits
NO_COND = -1


def check(words, bad) -> list[str] | None:
    """SamplingParams' check: a list of strings (empty: None); `bad(field, why)` raises."""
    if words is None:
        return None
    if isinstance(words, str) or not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
        bad("bad_words", "must be a list of strings or None")
    if len(words) > MAX_SEQUENCES:
        bad("bad_words", f"holds {len(words)} words: at most {MAX_SEQUENCES}")
    return list(words) or None


def token_ids(tokenizer, words: list[str], vocab_size: int, error=ValueError) -> list[list[int]]:
    """The token sequences of `words` (vLLM's update_from_tokenizer). `error(message)` for a word that makes no
    token, more than MAX_SEQUENCES sequences, or an id past the vocabulary; a missing tokenizer is an error too."""
    if tokenizer is None:
        raise error("bad_words needs a tokenizer (this engine has none): give token-level bans as logit_bias")
    out: list[list[int]] = []
    for word in words:
        for space in ("", " "):
            try:
                ids = [int(t) for t in tokenizer.encode(space + word.lstrip(), add_special_tokens=False)]
            except (TypeError, ValueError) as e:     # (a lone surrogate: the tokenizer cannot take it)
                raise error(f"bad_words entry {word!r:.80} cannot be tokenized ({str(e)[:120]})") from None
            if not ids:
                if not space:
                    raise error(f"bad_words entries must tokenize to at least one token, got {word!r:.80}")
                continue
            if not space or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
    if len(out) > MAX_SEQUENCES:
        raise error(f"bad_words make too many token sequences: {len(out)}. The max number is {MAX_SEQUENCES}.")
    if oov := [t for ids in out for t in ids if not 0 <= t < vocab_size]:
        raise error(f"bad_words contains out-of-vocab token id(s) {oov[:8]}. Vocabulary size: {vocab_size}")
    return out


def entries(sequences: list[list[int]], tail: list[int], pending: int, n: int | None = None) -> list[tuple[int, int]]:
    """(id, condition) bans for the token sampled after the `n` tokens generated so far (default len(tail)), of
    which `tail` holds the last ones (at least min(n, the longest sequence's length) of them) and the last `pending`
    are still on the device: 0, or 1 when the step's input token is the one in flight."""
    n = len(tail) if n is None else n
    L, out = len(tail), {}
    for seq in sequences:
        m = len(seq)
        if m > n + 1:
            continue
        if m == 1:
            out[(seq[0], NO_COND)] = None
        elif pending == 0 and tail[L - m + 1:] == seq[:-1]:
            out[(seq[-1], NO_COND)] = None
        elif pending == 1 and tail[L - m + 1:L - 1] == seq[:-2]:   # the last one: the step's input token
            out[(seq[-1], seq[-2])] = None
    return list(out)


def width(count: int) -> int:
    """The smallest of WIDTHS that holds `count` entries; 0 for none."""
    return next(w for w in WIDTHS if w >= count) if count else 0
