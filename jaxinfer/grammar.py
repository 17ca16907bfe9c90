"""vLLM's structured outputs of the json, regex and json_object kinds, on outlines-core (one of vLLM's grammar backends;
a dependency of jaxinfer, imported on first use). The kind becomes a regular expression (a JSON schema through
outlines-core's `build_regex_from_schema`; json_object through the schema `{"type": "object"}`, whose nesting
outlines-core bounds), the expression an index over the tokenizer's vocabulary (each token by its bytes: a token may
hold part of a character), and each constrained row of a step gets the bitmask of the tokens allowed after its output
so far, EOS ids where the expression may end. Unlike the choice kind's entries (structured.py), a mask cannot be packed
for every token the step in flight may have drawn, so the packer writes the masks last, with the tokens of the step in
flight, read as it ends (extras.in_flight_tokens): the rest of the batch is packed meanwhile; such rows run one step a
call. An index that failed or ran out of time is refused again at once (for TIMED_OUT_RETRY_S when out of time).
"""
from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
import weakref

import numpy as np

from jaxinfer import index_worker
from jaxinfer.json_strings import NAMED as _NAMED, VALUES as _VALUES, ascii_digits, contradiction, json_text_schema, \
    walk, without_anchors

_INDEXES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # tokenizer -> {(V, eos, regex): Index}
_VOCABS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()    # tokenizer -> {(V, eos): Vocabulary}
KINDS = ("json", "regex", "json_object")
BUILD_TIMEOUT_S = 20.0        # an index build that takes longer is refused (e.g. a string's maxLength in the 20s)
BACKGROUND_TIMEOUT_S = 60.0   # the same in the server's engine core (its API process built the index first)
TIMED_OUT_RETRY_S = 60.0      # a build that ran out of time is refused at once for this long, then tried again
IN_ENGINE_CORE = False        # set by the server's engine core (its process is ours)
# index builds at once in a process (a core each, in worker processes; the rest wait: a limit counts from the slot)
BUILD_SLOTS = threading.BoundedSemaphore(max(1, min(4, (os.cpu_count() or 2) // 2)))
# JSON schema keywords outlines-core's expressions do not enforce (its expression is the same without them): refused
UNENFORCED = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "uniqueItems", "contains",
              "minContains", "maxContains", "minProperties", "maxProperties", "patternProperties", "dependentRequired",
              "dependentSchemas", "if", "then", "else", "propertyNames", "unevaluatedProperties", "unevaluatedItems",
              "dependencies", "not"}
MASK_CACHE = 64     # masks kept per index by guide state: a copy (~1 us), not outlines-core's write (~13 us at 151k)
LENGTHS = {"minLength", "maxLength"}     # not enforced beside a pattern, a format or an enum (outlines-core drops them)


def _outlines(error):
    try:
        return __import__("outlines_core")
    except ImportError:
        raise error("structured_outputs json / regex / json_object need outlines-core: pip install "
                    "'outlines-core>=0.2.11,<0.3'") from None


def regex_for(so, error=ValueError) -> str:
    """The regular expression of a StructuredOutputsParams of one of KINDS (checked by structured.check), or of a
    choice list the choice kind cannot take (structured.Unspellable). A regex's leading `^` and trailing `$` are
    dropped: the whole output must match anyway (xgrammar, vLLM's default backend, drops them too); `\\d` is ASCII."""
    if so.choice is not None:
        return "(" + "|".join("".join("\\" + c if c in _META else c for c in choice) for choice in so.choice) + ")"
    if so.regex is not None:
        return ascii_digits(without_anchors(so.regex))
    schema = {"type": "object"} if so.json is None else so.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise error(f"structured_outputs json is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise error(f"structured_outputs json must be a JSON schema object, not {type(schema).__name__}")
    if bad := contradiction(schema):
        raise error(f"structured_outputs json schema has {bad}: no value can match it")
    if found := unenforced(schema):
        raise error(f"structured_outputs json schema keyword {found[1]!r} at {found[0]} is not supported "
                    f"(outlines-core would not enforce it)")
    ws = "" if so.disable_any_whitespace else so.whitespace_pattern
    _outlines(error)
    from outlines_core.json_schema import build_regex_from_schema
    try:
        return build_regex_from_schema(json.dumps(json_text_schema(schema)), ws)     # (its strings: json_strings.py)
    except Exception as e:             # (outlines-core's own errors name what it cannot take)
        raise error(f"structured_outputs json schema is not supported: {e}") from None


_META = set("\\.^$|?*+()[]{}")   # escaped in a choice's regex (only these: outlines-core refuses "\\ ", say)
def relaxed(schema):
    """A copy of `schema` without its UNENFORCED keywords (server/tools.py: a tool's parameters)."""
    return walk(schema, _relax)


def _relax(schema: dict) -> dict:
    drop = UNENFORCED | (LENGTHS if {"pattern", "format", "enum"} & schema.keys() else set()) | \
        ({"required"} if "properties" not in schema else set())
    out = {k: v for k, v in schema.items() if k not in drop}
    if isinstance(out.get("required"), list) and isinstance(out.get("properties"), dict):
        out["required"] = [k for k in out["required"] if k in out["properties"]]
    return out


def unenforced(schema, where: str = "#") -> tuple[str, str] | None:
    """(path, keyword) of the first UNENFORCED keyword in a schema (or `required` without `properties`), else None."""
    if not isinstance(schema, dict):
        return None
    if hit := sorted(UNENFORCED & schema.keys()):
        return where, hit[0]
    if schema.get("required") and "properties" not in schema:
        return where, "required"
    if isinstance(schema.get("properties"), dict) and isinstance(schema.get("required"), list) and (
            missing := [k for k in schema["required"] if k not in schema["properties"]]):
        return where, f"required {missing[0]!r:.40} (not in properties)"
    beside = sorted({"pattern", "format", "enum"} & schema.keys())
    if (lengths := sorted(LENGTHS & schema.keys())) and beside:
        return where, f"{lengths[0]} beside {beside[0]}"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return where, "allOf of more than one schema"
    for key, value in schema.items():
        if key in _VALUES:
            continue
        named = key in _NAMED and isinstance(value, dict)
        subs = value.items() if named else enumerate(value) if isinstance(value, list) else [(None, value)]
        for k, sub in subs:
            if found := unenforced(sub, f"{where}/{key}" + ("" if k is None else f"/{k}")):
                return found
    return None


@functools.cache
def _byte_of() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a byte-level BPE token uses for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in keep]
    return {chr(b): b for b in keep} | {chr(256 + k): b for k, b in enumerate(shifted)}


def token_bytes(tokenizer, vocab_size: int) -> dict[bytes, list[int]]:
    """The ids of each token's bytes, special tokens left out. Byte-level BPE tokens (Qwen's) are read through the
    byte alphabet; another tokenizer's tokens by their text decoded alone, those that decode to part of a character
    left out; tokenizer.ByteTokenizer's (a preset's) ids 0..255 are the bytes."""
    if not hasattr(tokenizer, "__len__"):
        return {bytes([i]): [i] for i in range(min(vocab_size, 256))}
    n = min(vocab_size, len(tokenizer))
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
    alphabet = _byte_of()
    byte_level = all(p is None or set(p) <= alphabet.keys() for p in pieces)
    texts = None if byte_level else tokenizer.batch_decode([[i] for i in range(n)], skip_special_tokens=False)
    out: dict[bytes, list[int]] = {}
    for i in range(n):
        if i in special or pieces[i] is None:
            continue
        if byte_level:
            b = bytes(alphabet[c] for c in pieces[i])
        elif texts[i] and "\ufffd" not in texts[i]:
            b = texts[i].encode()
        else:
            continue
        if b:
            out.setdefault(b, []).append(i)
    return out


class GrammarRule:
    """A regular expression's index over one tokenizer's vocabulary, shared by the requests that give it; `start()`
    makes a sequence's GrammarState. eos: the ids the engine stops at (allowed where the expression may end).
    wait=False (the server's engine core, whose API process built the same index first): a new index is built in
    the background, and the scheduler admits the sequence once it is `ready()`, so running requests go on."""

    def __init__(self, regex: str, tokenizer, vocab_size: int, eos, error=ValueError, wait: bool = True):
        self.wait = wait
        if tokenizer is None:
            raise error("structured_outputs needs a tokenizer (this engine has none)")
        oc = _outlines(error)
        self.eos, self.words = sorted(eos), -(-vocab_size // 32)
        if not self.eos:
            raise error("structured_outputs json / regex need an EOS token id (the model has none)")
        vocabs = _VOCABS.setdefault(tokenizer, {})
        key = (vocab_size, self.eos[0])
        if key not in vocabs:
            vocabs[key] = oc.Vocabulary(self.eos[0], {b: ids for b, ids in token_bytes(tokenizer, vocab_size).items()
                                                      if self.eos[0] not in ids})
        indexes = _INDEXES.setdefault(tokenizer, {})
        if (key + (regex,)) not in indexes or indexes[key + (regex,)].retry_at <= time.monotonic():
            if len(indexes) >= 64:
                indexes.pop(next(iter(indexes)))
            limit = BACKGROUND_TIMEOUT_S if IN_ENGINE_CORE else BUILD_TIMEOUT_S
            indexes[key + (regex,)] = _Build(regex, vocabs[key], limit)
        self.build, self._oc, self._regex = indexes[key + (regex,)], oc, regex
        while wait and self.build.result() is None:     # (its deadline runs from when it gets a slot)
            self.build.thread.join(0.02)
        if why := self.refusal(wait):                  # (failed or out of time: refused again at once)
            raise error(why)

    def refusal(self, deadline: bool = True) -> str | None:
        """Why the index cannot be used: it cannot be built, or (deadline) not within BUILD_TIMEOUT_S; else None."""
        why, r = self.build.result(deadline), self._regex
        return f"structured_outputs {'regex ' + repr(r)[:80] + ' ' if len(r) < 200 else ''}{why}" \
            if isinstance(why, str) else None

    def ready(self) -> bool:
        return self.build.result(self.wait) is not None

    def start(self) -> "GrammarState":
        return GrammarState(self)


class _Build:
    """outlines-core's Index built in a worker process (index_worker.py), waited for by a thread, once one of
    BUILD_SLOTS is free; `result()`: the Index, why not (a string: it cannot be built, or not within BUILD_TIMEOUT_S
    of getting its slot; the worker is killed at `limit`), or None while it waits or runs. make: what builds it."""

    def __init__(self, regex: str, vocab, limit: float, make=None):
        # deadline: set when the build gets its slot; retry_at: when a new request builds it again (worker died: 0)
        self.box, self.deadline, self.retry_at = [], None, float("inf")
        self.masks: dict = {}                       # (guide state or None when ended, eos ids, words) -> the row

        def build():
            try:
                with BUILD_SLOTS:
                    self.deadline = time.monotonic() + BUILD_TIMEOUT_S
                    got = (make or index_worker.build)(regex, vocab, limit)
                if got is None:                     # (how long it took depends on how busy the machine was)
                    self.retry_at = time.monotonic() + TIMED_OUT_RETRY_S
                self.box.append(_too_long(limit) if got is None else _cannot(got) if isinstance(got, str) else got)
            except Exception as e:                  # (a worker that died: the next request builds it again)
                self.retry_at = 0.0 if isinstance(e, index_worker.WorkerDied) else self.retry_at
                self.box.append(_cannot(str(e)))
        self.thread = threading.Thread(target=build, daemon=True, name="jaxinfer-grammar-index")
        self.thread.start()

    def result(self, deadline: bool = True):
        """deadline False (a background build, which the API process built within BUILD_TIMEOUT_S first): no limit."""
        if self.box:
            return self.box[0]
        if deadline and self.deadline is not None and time.monotonic() >= self.deadline:
            return _too_long(BUILD_TIMEOUT_S)
        return None


def _cannot(error: str) -> str:
    return f"cannot be followed: {error}" + " (^ and $ are taken only at its ends)" * ("anchored" in error)


def _too_long(limit: float) -> str:
    return f"takes over {limit:.0f} s to index: simplify it (long or wide repetitions cost most: maxLength, {{m,n}})"


class GrammarState:
    """One sequence's place in its rule's index, moved on by the output tokens the host has read."""

    def __init__(self, rule: GrammarRule):
        self.rule, self.guide, self.read, self.ended = rule, None, 0, False

    def ready(self) -> bool:
        return self.rule.ready()

    def reset(self) -> None:
        """Forget the guide's place (the next write replays the output read so far): a step whose token it went
        past while on the device was dropped (Scheduler.recompute_all, after an interrupt)."""
        self.guide, self.read, self.ended = None, 0, False

    def write(self, row: np.ndarray, outputs: list[int], start: int, pending: int, last: int | None = None) -> None:
        """Write the bitmask (token t: bit t % 32 of int32 word t // 32 of `row`) of the ids allowed after
        outputs[start:], whose last `pending` (0 or 1: the input token of the step being packed, still on the
        device) is `last` (the engine waits for the step in flight to read it)."""
        assert pending == 0 or (pending == 1 and last is not None), "a grammar row's input token was not read"
        rule, n = self.rule, len(outputs) - start
        if self.guide is None:
            index = rule.build.result(rule.wait)
            if isinstance(index, str) or index is None:   # (a background build that failed: the answer ends at once)
                logging.getLogger("jaxinfer").warning("structured_outputs %s: the request ends", index)
                self.ended = True
            else:
                self.guide = rule._oc.Guide(index, 0)
        for t in outputs[start + self.read:len(outputs) - pending] + ([last] if pending else []):
            if t in rule.eos or self.ended:    # (ignore_eos: after an EOS only EOS ids)
                self.ended = True
                continue
            try:
                self.guide.advance(t, return_tokens=False)
            except Exception:                  # (a token the mask left out: e.g. allowed_token_ids left it none)
                self.ended = True
        self.read = n
        key, masks = (None if self.ended else self.guide.get_state(), tuple(rule.eos), row.size), rule.build.masks
        if (known := masks.get(key)) is not None:     # (a mask depends on the state alone)
            row[:] = known
            return
        row[:] = 0
        if not self.ended:
            self.guide.write_mask_into(row.ctypes.data, row.size, 4)
        if self.ended or self.guide.is_finished() or not row.any():   # (a dead end, never reached: EOS ends it)
            eos = np.asarray(rule.eos)
            eos = eos[eos < 32 * row.size]
            np.bitwise_or.at(row.view(np.uint32), eos // 32, (1 << (eos % 32)).astype(np.uint32))
        if MASK_CACHE:
            if len(masks) >= MASK_CACHE:
                masks.clear()                          # (the states in use come back at once)
            masks[key] = row.copy()
