"""vLLM's structured outputs, the `choice` kind: the output is exactly one of the given strings, then EOS.

`SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))` (vLLM's; `guided_decoding` /
`GuidedDecodingParams` are its older names; the server's `structured_outputs: {"choice": [...]}` and
`guided_choice`). The json, regex and json_object kinds are grammar.py's; grammar and structural_tag are refused.

As vLLM's grammar backends do, any tokenization spelling a choice is allowed, not only the tokenizer's own: after
output text g, the tokens allowed are those whose text t makes g + t a prefix of a choice, and EOS once g is a
choice. On the device these are (token id, condition) entries of the extras step (extras_step.py): a constrained
row keeps only the ids whose condition is -1 or equals its input token, and masks the rest. The condition lets the
host pack a step before it has read the one in flight (whose sampled token is this step's input): it then packs,
for each token that step may have drawn, the tokens allowed after it. Such rows run one step a call.
"""
from __future__ import annotations

import bisect
import weakref
from dataclasses import dataclass, fields, replace

from jaxinfer import grammar

NO_COND = -1
OFF = -2                      # a row's on-condition that never holds (Sequence.constraint)
REASONING_PARSERS = ("qwen3", "deepseek_r1")      # vLLM's parsers of <think>...</think> (server/reasoning.py)
WIDTHS = (16, 128, 1024)      # entries a row holds in a step (step.Extras.choice): the smallest that fits
MAX_CHARS = 4096              # the choices' characters in all
MAX_EOS = 8                   # EOS ids a finished choice allows (the first of them, sorted)
_TABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # tokenizer -> (V, texts, ids by text)
_RULES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()    # tokenizer -> {(V, choices): ChoiceRule}
_SETTINGS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
             "backend", "backend_was_auto")


@dataclass(eq=True, kw_only=True)
class StructuredOutputsParams:
    """vLLM's fields; one kind of choice, json, regex or json_object (grammar and structural_tag are refused)."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self):               # (vLLM's check: a kind given as False, json_object=False, counts)
        given = [k for k in KIND_FIELDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams needs one kind of constraint ({', '.join(KIND_FIELDS)}), "
                             f"got {len(given)}: {given}")


@dataclass(eq=True, kw_only=True)
class GuidedDecodingParams(StructuredOutputsParams):
    """vLLM's older name, with its older fields (`backend`: the grammar library, which jaxinfer does not choose)."""
    backend: str | None = None
    backend_was_auto: bool = False

    def __post_init__(self):               # (the older check: more than one kind is refused, none is not)
        if len(given := [k for k in KIND_FIELDS if getattr(self, k) is not None]) > 1:
            raise ValueError(f"GuidedDecodingParams needs one kind of constraint at most ({', '.join(KIND_FIELDS)}), "
                             f"got {given}")

    @classmethod
    def from_optional(cls, **kw) -> "GuidedDecodingParams | None":
        """None when no kind is given (vLLM's)."""
        return None if all(kw.get(k) is None for k in KIND_FIELDS) else cls(**kw)


KIND_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def check(value, legacy, bad, min_tokens: int = 0) -> StructuredOutputsParams | None:
    """SamplingParams' check of structured_outputs / guided_decoding (a StructuredOutputsParams or a dict of its
    fields; None or {} for none): the choice kind only, without min_tokens > 1 (an answer may be one token, then
    only EOS is allowed, which min_tokens bans). `bad(field, why)` raises."""
    given = [v for v in (value, legacy) if v is not None and v != {}]
    if len(given) > 1:
        bad("structured_outputs", "and guided_decoding are one setting (its older name): give one")
    if not given:
        return None
    v, name = given[0], "structured_outputs" if given[0] is value else "guided_decoding"   # (the field given)
    if isinstance(v, dict):
        cls = GuidedDecodingParams if name == "guided_decoding" else StructuredOutputsParams
        if unknown := set(v) - {f.name for f in fields(cls)}:
            bad(name, f"has no field {sorted(unknown)[0]!r}")
        try:
            v = cls(**v)
        except ValueError as e:
            bad(name, str(e))
    if not isinstance(v, StructuredOutputsParams):
        bad(name, "must be a StructuredOutputsParams, a dict of its fields, or None")
    if type(v) is not StructuredOutputsParams:              # (GuidedDecodingParams: its StructuredOutputsParams)
        try:
            v = StructuredOutputsParams(**{f.name: getattr(v, f.name) for f in fields(StructuredOutputsParams)})
        except ValueError as e:
            bad(name, str(e))
    kinds = [f.name for f in fields(v) if f.name not in _SETTINGS and getattr(v, f.name) not in (None, False)]
    if other := [k for k in kinds if k not in ("choice", *grammar.KINDS)]:
        bad(name, f"{other[0]} is not supported by jaxinfer (choice, json, regex and json_object are)")
    if len(kinds) != 1:
        bad(name, f"needs one kind (choice, json, regex or json_object), not {len(kinds)}: {kinds}")
    if isinstance(min_tokens, int) and min_tokens > 1:
        bad("min_tokens", "cannot be more than 1 with structured_outputs: the answer may end (EOS) before it")
    if kinds[0] == "regex" and not isinstance(v.regex, str):
        bad(name, "regex must be a string")
    if kinds[0] == "json" and not isinstance(v.json, (str, dict)):
        bad(name, "json must be a JSON schema: a dict or its JSON text")
    if kinds[0] == "json_object" and v.json_object is not True:
        bad(name, "json_object must be True")
    if kinds[0] != "choice":
        grammar.regex_for(v, lambda why: bad(name, why.removeprefix("structured_outputs ")))   # (a schema's errors)
        return v
    c = v.choice
    if not isinstance(c, (list, tuple)) or not c or not all(isinstance(x, str) and x for x in c):
        bad(name, "choice must be a non-empty list of non-empty strings")
    if sum(map(len, c)) > MAX_CHARS:
        bad(name, f"choice holds {sum(map(len, c))} characters: at most {MAX_CHARS}")
    return replace(v, choice=list(dict.fromkeys(c)))


def token_table(tokenizer, vocab_size: int) -> tuple[list[str], dict[str, list[int]]]:
    """Each token's text (decoded alone) and the ids of each text, special tokens, empty texts and partial characters
    left out (they cannot spell a choice's text). Made once per tokenizer and vocabulary size."""
    got = _TABLES.get(tokenizer)
    if got is not None and got[0] == vocab_size:
        return got[1], got[2]
    n = min(vocab_size, len(tokenizer)) if hasattr(tokenizer, "__len__") else min(vocab_size, 256)
    if hasattr(tokenizer, "batch_decode"):
        texts = tokenizer.batch_decode([[i] for i in range(n)], skip_special_tokens=False)
    else:
        texts = [tokenizer.decode([i], skip_special_tokens=False) for i in range(n)]
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    by_text: dict[str, list[int]] = {}
    for i, t in enumerate(texts):
        if t and "\ufffd" not in t and i not in special:
            by_text.setdefault(t, []).append(i)
    _TABLES[tokenizer] = (vocab_size, texts, by_text)
    return texts, by_text


class Unspellable(ValueError):
    """Choices the step's entries cannot hold: one that whole-token texts cannot spell (a character split over byte
    tokens: "café", emoji), or too many ids at a step. Such a list goes to grammar.py's regex path (its index works
    on bytes, as vLLM's grammar backends)."""


def rule_of(so, tokenizer, vocab_size: int, eos, error=ValueError, wait: bool = True) -> tuple[str, object]:
    """("_choice_rule", ChoiceRule) or ("_grammar_rule", grammar.GrammarRule): the rule a request's
    StructuredOutputsParams `so` follows (choices the choice kind cannot take go the regex path)."""
    if so.choice is not None:
        try:
            return "_choice_rule", rule_for(so.choice, tokenizer, vocab_size, error)
        except Unspellable:
            pass
    return "_grammar_rule", grammar.GrammarRule(grammar.regex_for(so, error), tokenizer, vocab_size, eos, error, wait)


def choice_width(choices: list[str], tokenizer, vocab_size: int) -> int:
    """The entries a row of these choices needs (its ChoiceRule's width), 0 if they go the regex path."""
    try:
        return rule_for(choices, tokenizer, vocab_size).width
    except Unspellable:
        return 0


def rule_for(choices: list[str], tokenizer, vocab_size: int, error=ValueError) -> "ChoiceRule":
    """ChoiceRule(...), kept per tokenizer for the last 64 choice lists (a server's requests repeat them); raises
    Unspellable for choices it cannot take."""
    if tokenizer is None:
        return ChoiceRule(choices, tokenizer, vocab_size, error)
    rules = _RULES.setdefault(tokenizer, {})
    key = (vocab_size, tuple(choices))
    if key not in rules:
        rule = ChoiceRule(choices, tokenizer, vocab_size, error)
        if len(rules) >= 64:
            rules.pop(next(iter(rules)))
        rules[key] = rule
    return rules[key]


class ChoiceRule:
    """A request's choices against one tokenizer's table: the ids allowed after each output text (`options`) and the
    entries of each step (`entries`). Made at admission: every text a row can reach is walked once, tokens that lead
    where no choice can be finished are left out, and a choice that no tokenization spells is refused."""

    def __init__(self, choices: list[str], tokenizer, vocab_size: int, error=ValueError):
        if tokenizer is None:
            raise error("structured_outputs needs a tokenizer (this engine has none)")
        self.choices = sorted(choices)
        self.texts, self.by_text = token_table(tokenizer, vocab_size)
        longest = max(map(len, self.by_text), default=0)
        graph: dict[str, tuple[list[tuple[int, str]], bool]] = {}
        todo = [""]
        while todo:                                   # every text the allowed tokens reach from ""
            g = todo.pop()
            if g in graph:
                continue
            steps, end = {}, False
            for c in self._starting(g):
                rest = c[len(g):]
                end |= not rest
                for k in range(1, min(len(rest), longest) + 1):
                    for i in self.by_text.get(rest[:k], ()):
                        steps[i] = rest[:k]
            graph[g] = (list(steps.items()), end)
            todo += [g + t for t in set(steps.values()) if g + t not in graph]
        live = {g for g, (_, end) in graph.items() if end}      # texts from which a choice can still be finished
        for g in sorted(graph, key=len, reverse=True):           # (a step always lengthens the text)
            if g not in live and any(g + t in live for _, t in graph[g][0]):
                live.add(g)
        if missing := [c for c in choices if c not in live]:
            raise Unspellable(f"structured_outputs choice {missing[0]!r:.80} cannot be spelled with this "
                              f"tokenizer's whole-token texts")
        self.graph = {g: ([(i, t) for i, t in steps if g + t in live], end) for g, (steps, end) in graph.items()
                      if g in live}
        self.width = max(sum(len(self.options(g + t)[0]) + MAX_EOS for _, t in steps) +    # (an EOS in flight too)
                         (MAX_EOS * MAX_EOS if end else 0) for g, (steps, end) in self.graph.items())
        if self.width > WIDTHS[-1]:
            raise Unspellable(f"structured_outputs choice allows up to {self.width} tokens at a step: at most "
                              f"{WIDTHS[-1]}")
        self.width = next(w for w in WIDTHS if w >= self.width)

    def _starting(self, text: str) -> list[str]:
        """The choices that start with `text` (a range of the sorted list)."""
        i = j = bisect.bisect_left(self.choices, text)
        while j < len(self.choices) and self.choices[j].startswith(text):
            j += 1
        return self.choices[i:j]

    def options(self, text: str) -> tuple[list[tuple[int, str]], bool]:
        """(id, its text) of the tokens allowed after output `text`, and whether `text` is a whole choice."""
        return self.graph.get(text, ([], False))

    def entries(self, outputs: list[int], pending: int, eos, start: int = 0) -> list[tuple[int, int]]:
        """(id, condition) entries of the ids allowed next, after outputs[start:] (a sequence's token ids from its
        first output: not copied) of which the last `pending` (0 or 1: the step's input token) are still on the
        device. After an EOS (ignore_eos) only EOS ids are allowed."""
        n, eos = len(outputs) - pending, sorted(eos)[:MAX_EOS]
        if n > start and outputs[n - 1] in eos:
            return [(e, NO_COND) for e in eos]
        text = "".join(self.texts[outputs[i]] for i in range(start, n))    # (at most a choice's length: it was one)
        steps, end = self.options(text)
        if not pending:
            return [(i, NO_COND) for i, _ in steps] + [(e, NO_COND) for e in eos if end]
        out = [(e, first) for first in eos for e in eos] if end else []     # (an EOS in flight)
        for first, piece in steps:
            nxt, nxt_end = self.options(text + piece)
            out += [(i, first) for i, _ in nxt] + [(e, first) for e in eos if nxt_end]
        return out


TURN_OPENERS = ("<think>", "<|im_start|>", "<｜Assistant｜>", "<｜User｜>")     # (Qwen's and DeepSeek's)


def reasoning_marks(parser: str | None, tokenizer) -> tuple[int, frozenset[int]] | None:
    """(the id of `</think>`, which ends a reasoning parser's thinking: vLLM's `reasoning_parser`, structured outputs
    apply after it; the ids of TURN_OPENERS in the vocabulary), or None without a parser."""
    if parser is None:
        return None
    if parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser={parser!r} is not one of {REASONING_PARSERS}")
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    if "</think>" not in vocab:
        raise ValueError(f"reasoning_parser={parser!r} needs '</think>' as one token of the tokenizer's vocabulary")
    return vocab["</think>"], frozenset(vocab[t] for t in TURN_OPENERS if t in vocab)


def thinking_closed(ids: list[int], marks: tuple[int, frozenset[int]]) -> bool:
    """Whether a prompt closed the thinking of the turn it ends in: a `</think>` after its last `<think>` and after
    the last turn's start (Qwen3's template with enable_thinking false ends with `<think>\n\n</think>\n\n`; an
    answer continued after its closed thinking counts; an earlier turn's thinking does not)."""
    end, openers = marks
    for t in reversed(ids):
        if t == end or t in openers:
            return t == end
    return False


def reasoning_wait(marks, ids: list[int], params) -> int | None:
    """The id a request's structured outputs wait for (`marks`: reasoning_marks'), or None: they apply from the first
    token (no parser, no structured outputs, or a prompt that closed the thinking)."""
    return None if marks is None or params.structured_outputs is None or thinking_closed(ids, marks) else marks[0]
