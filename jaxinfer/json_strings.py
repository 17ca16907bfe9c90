"""A JSON schema's string `pattern`s and `format`s as expressions over JSON text (grammar.py's json kind).

outlines-core writes a string's `pattern` (or its own expression for a `format`) between the quotes as it is, but
the expression is matched against the JSON text, not the string's value: `.`, `[^@]` or `\\S` there also match `"`,
`\\` and control characters, which JSON text may not hold unescaped (the answer would not parse), and its `\\d`
matches any Unicode digit (a `date` of other scripts' digits). So before outlines-core sees the schema, each pattern
is rewritten to match only JSON-valid text whose value the pattern matches: what may match an unsafe character is
cut to the safe ones (also the escapes of the quote, backslash, \\n, \\t, \\r they matched; a quote,
backslash or control character, written as it is or as a \\x / \\u escape, becomes its JSON escape), `\\d` is ASCII
(as xgrammar, vLLM's default backend, reads it), and each `format` outlines-core knows becomes such a pattern of
our own (RFC 3339 dates and times with their offset, as jsonschema's format checker wants them).
"""
from __future__ import annotations

import json
import re
import warnings

_UNSAFE = '"\\\\\\x00-\\x1F\\x7F-\\x9F'          # regex class items: what JSON text may not hold unescaped
SAFE = f"[^{_UNSAFE}]"                           # any character JSON text may hold as it is
_DATE = ("[0-9]{4}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)|"   # (no Feb 29:
         "02-(0[1-9]|1[0-9]|2[0-8]))")                                                       # leap years unchecked)
_TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_URI_CHARS = "[a-zA-Z0-9._~%!$&'()*+,;=:@/-]"
FORMATS = {
    "date": _DATE, "time": _TIME, "date-time": f"{_DATE}T{_TIME}",
    "uuid": "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
    "email": "[a-zA-Z0-9._%+-]+@[a-zA-Z0-9-]+(\\.[a-zA-Z0-9-]+)*\\.[a-zA-Z]{2,}",
    "uri": f"(https?|ftp)://[a-zA-Z0-9-]+(\\.[a-zA-Z0-9-]+)*(:[0-9]+)?(/{_URI_CHARS}*)?(\\?{_URI_CHARS}*)?"
           f"(#{_URI_CHARS}*)?",
}
# escapes outside a class: their JSON-text form (s: whitespace as a space or an escape; D / S / W: without the unsafe)
# (a quote, a backslash, \\n, \\t, \\r, \\f: those characters' JSON escapes, `_literal`)
_ESCAPES = {"d": "[0-9]", "D": f"[^0-9{_UNSAFE}]", "s": "( |\\\\[tnrf])", "S": f"[^\\s{_UNSAFE}]",
            "W": f"[^\\w{_UNSAFE}]"}
_CHARS = {'"': '"', "\\": "\\", "n": "\n", "t": "\t", "r": "\r", "f": "\f"}
_ESCAPED = '"\\\n\t\r'                            # unsafe characters a class or \\S may give as escapes


def json_text(pattern: str) -> str:
    """`pattern` (a JSON schema string's) as an expression over the string's JSON text between its quotes."""
    out, i, n = [], 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            e = pattern[i + 1]
            if e in "pP" and i + 2 < n and pattern[i + 2] == "{":          # \p{..} / \P{..}: kept, cut to SAFE
                if (end := pattern.find("}", i) + 1) == 0:
                    raise ValueError(f"the pattern {pattern!r:.80} has an unclosed '\\{e}{{'")
                out.append(f"[{pattern[i:end]}&&{SAFE}]")
                i = end
                continue
            if (code := _code_point(pattern, i)) is not None:    # \xHH, \x{..}, \uHHHH, \u{..}, \UHHHHHHHH
                out.append(_literal(chr(code[0])) if _unsafe(chr(code[0])) else pattern[i:code[1]])
                i = code[1]
                continue
            if e in "DSW":                            # also the escapes of the quote, backslash, ... it matches
                out.append(_with_escapes(_ESCAPES[e], _members(pattern[i:i + 2], _ESCAPED)))
            else:
                out.append(_literal(_CHARS[e]) if e in _CHARS else _ESCAPES.get(e, c + e))
            i += 2
        elif c == "[":
            end = _class_end(pattern, i)
            body = pattern[i + 1:end]
            # what JSON text may hold as it is (a negated class: the unsafe characters excluded too; else its ASCII
            # digits), and the escapes of the quote, backslash, \n, \t, \r it holds
            safe = f"[{body}{_UNSAFE}]" if body.startswith("^") else f"[[{_ascii_digits(body)}]&&{SAFE}]"
            out.append(_with_escapes(safe, _members(f"[{body}]", _ESCAPED)))
            i = end + 1
        elif c == ".":                                # (JSON Schema's `.`: any character but \n and \r)
            out.append(_with_escapes(SAFE, '"\\\t'))
            i += 1
        elif _unsafe(c):                              # a raw quote, backslash or control character: its escape
            out.append(_literal(c))
            i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _unsafe(c: str) -> bool:
    """A character JSON text may not hold as it is (as _UNSAFE: also 0x7F-0x9F, which JSON allows escaped)."""
    return c in '"\\' or ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F


def _literal(c: str) -> str:
    """An expression matching the JSON escape of the unsafe character `c` (its short form where JSON has one), as a
    group (a quantifier after it repeats the whole escape)."""
    short = {'"': '"', "\\": "\\\\", "\n": "n", "\t": "t", "\r": "r", "\f": "f", "\b": "b"}.get(c)
    return "(\\\\" + (short if short is not None else f"u{ord(c):04x}") + ")"


def _with_escapes(safe: str, chars) -> str:
    """`safe` or one of the JSON escapes of `chars`, as one group."""
    return f"({'|'.join([safe, *map(_literal, chars)])})" if chars else safe


def _members(expr: str, chars: str) -> str:
    """Those of `chars` that the one-character expression `expr` (a class, \\S, ...) matches, where Python's re
    reads it as our regexes do (else none: it is cut to SAFE only, e.g. a \\p{..}, nested or && class)."""
    inner = expr[1:-1] if expr.startswith("[") else ""
    if "[" in inner or "&&" in inner or "--" in inner or "~~" in inner:
        return ""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            member = re.compile(expr).fullmatch
    except (re.error, ValueError):
        return ""
    return "".join(ch for ch in chars if member(ch))


def _code_point(pattern: str, i: int) -> tuple[int, int] | None:
    """(code point, end) of the hex escape at pattern[i] (\\xHH, \\x{H..}, \\uHHHH, \\u{H..}, \\UHHHHHHHH), else
    None; a ValueError naming a malformed one."""
    kind, j = pattern[i + 1], i + 2
    if kind not in "xuU":
        return None
    if kind != "U" and pattern.startswith("{", j):
        end = pattern.find("}", j)
        digits, after = (pattern[j + 1:end], end + 1) if end > 0 else ("", j + 1)
    else:
        width = {"x": 2, "u": 4, "U": 8}[kind]
        digits, after = pattern[j:j + width], j + width
        digits = digits if len(digits) == width else ""
    hexadecimal = 0 < len(digits) <= 8 and all(d in "0123456789abcdefABCDEF" for d in digits)
    if not hexadecimal or (code := int(digits, 16)) > 0x10FFFF:
        raise ValueError(f"the pattern {pattern!r:.80} has a bad escape {pattern[i:after]!r}")
    return code, after


def _class_end(pattern: str, start: int) -> int:
    """Index of the `]` that closes the class opened at `start` (a `]` first in it, or escaped, is a member)."""
    i = start + 1
    if i < len(pattern) and pattern[i] == "^":
        i += 1
    if i < len(pattern) and pattern[i] == "]":
        i += 1
    while i < len(pattern):
        if pattern[i] == "\\":
            i += 2
            continue
        if pattern[i] == "]":
            return i
        i += 1
    raise ValueError(f"the pattern {pattern!r:.80} has an unclosed '['")


def _ascii_digits(body: str) -> str:
    """A class body with its `\\d` as 0-9 (an escaped backslash before a d stays)."""
    out, i = [], 0
    while i < len(body):
        if body[i] == "\\" and i + 1 < len(body):
            out.append("0-9" if body[i + 1] == "d" else body[i:i + 2])
            i += 2
        else:
            out.append(body[i])
            i += 1
    return "".join(out)


def ascii_digits(regex: str) -> str:
    """A regex kind's expression with `\\d` as [0-9] outside classes and 0-9 inside (xgrammar's reading); one
    with an unclosed class as it is (outlines-core names the error)."""
    out, i, n = [], 0, len(regex)
    while i < n:
        if regex[i] == "\\" and i + 1 < n:
            out.append("[0-9]" if regex[i + 1] == "d" else regex[i:i + 2])
            i += 2
        elif regex[i] == "[":
            try:
                end = _class_end(regex, i)
            except ValueError:
                return regex
            body = regex[i + 1:end]
            out.append(f"[{body}]" if body.startswith("^") else f"[{_ascii_digits(body)}]")
            i = end + 1
        else:
            out.append(regex[i])
            i += 1
    return "".join(out)


VALUES = ("enum", "const", "examples", "default", "required")     # keywords whose values are not schemas
NAMED = ("properties", "$defs", "definitions")                     # keywords whose values are {name: schema}


def walk(schema, edit, named: bool = False):
    """A copy of `schema` with `edit` applied to each of its schemas, innermost first (edit gets a copy)."""
    if isinstance(schema, list):
        return [walk(v, edit) for v in schema]
    if not isinstance(schema, dict):
        return schema
    if named:
        return {k: walk(v, edit) for k, v in schema.items()}
    return edit({k: v if k in VALUES else walk(v, edit, k in NAMED) for k, v in schema.items()})


def json_text_schema(schema):
    """A copy of `schema` whose string patterns and known formats are JSON-text patterns (`json_text`, FORMATS)
    and whose property names are written as JSON text (`json_name`)."""
    return walk(schema, _json_text_string)


def _json_text_string(out: dict) -> dict:
    if isinstance(out.get("properties"), dict):      # (outlines-core writes a name between quotes as it is)
        out["properties"] = {json_name(k): v for k, v in out["properties"].items()}
        if isinstance(out.get("required"), list):
            out["required"] = [json_name(k) if isinstance(k, str) else k for k in out["required"]]
    if isinstance(out.get("format"), str) and out["format"] in FORMATS:
        if "pattern" in out:
            raise ValueError(f"a pattern beside format {out['format']!r} (the answer could match only one of them)")
        out["pattern"] = FORMATS[out.pop("format")]
    elif isinstance(out.get("pattern"), str):        # (anchored or not, the whole value matches)
        out["pattern"] = json_text(without_anchors(out["pattern"]))
    return out


def contradiction(schema) -> str | None:
    """A bound pair of a schema that no value meets (minItems above maxItems, minLength above maxLength), named;
    else None (outlines-core's own error for it names neither: "Failed to build DFA")."""
    found: list[str] = []

    def look(s: dict) -> dict:
        for lo, hi in (("minItems", "maxItems"), ("minLength", "maxLength")):
            a, b = s.get(lo), s.get(hi)
            if isinstance(a, int) and isinstance(b, int) and a > b:
                found.append(f"{lo}={a} above {hi}={b}")
        return s
    walk(schema, look)
    return found[0] if found else None


def json_name(name):
    """A property name as JSON text writes it between its quotes (a quote, backslash or control character
    escaped; other characters as they are)."""
    return json.dumps(name, ensure_ascii=False)[1:-1] if isinstance(name, str) else name


def without_anchors(regex: str) -> str:
    """`regex` without a leading `^` and a trailing `$` (an escaped `\\$` is a dollar sign: kept)."""
    r = regex[1:] if regex.startswith("^") else regex
    escapes = len(r[:-1]) - len(r[:-1].rstrip("\\"))          # (backslashes before a last `$`)
    return r[:-1] if r.endswith("$") and escapes % 2 == 0 else r
