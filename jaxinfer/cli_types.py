"""argparse types of the `jaxinfer` command's flags (cli.py), each naming the bad value."""
from __future__ import annotations

import argparse
import json
import os
import re


def int_list(text: str) -> tuple[int, ...]:
    """argparse type of the list options: "8,32,64" -> (8, 32, 64)."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers (e.g. 8,32,64)") from None


def port(text: str) -> int:
    """argparse type: a TCP port, 0-65535 (0: any free one)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0-65535)")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number > 0")
    return value


def probability(text: str) -> float:
    """argparse type: a number in (0, 1] (top_p)."""
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not in (0, 1]")
    return value


def human_int(text: str) -> int:
    """argparse type of integer options, as vLLM reads them: 25600, 25.6k (x 1000), 1K (x 1024); m/M and g/G too."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgKMG])", text.strip())
    try:
        if not m:
            return int(text)
        number, suffix = m.groups()
        if suffix.islower():
            return int(float(number) * 1000 ** "kmg".index(suffix) * 1000)
        return int(number) * 1024 ** ("KMG".index(suffix) + 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer (e.g. 4096, 4k = 4000, 4K = 4096)") from None


def model_len(text: str) -> int | None:
    """--max-model-len: human_int, or -1 / auto for the default (the model's, capped by the KV pool), as vLLM."""
    return None if text.strip().lower() in ("-1", "auto") else human_int(text)


def dashed(argv: list[str]) -> list[str]:
    """`--max_model_len 512` as `--max-model-len 512` (vLLM's parser takes underscores in flag names; its own docs
    use them); words after a bare `--` are left alone."""
    out, options = [], True
    for tok in argv:
        if options and tok.startswith("--") and len(tok) > 2:
            name, eq, value = tok.partition("=")
            tok = name.replace("_", "-") + eq + value
        options = options and tok != "--"
        out.append(tok)
    return out


def bare_flags(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """vLLM's boolean flags given alone (`--enable-chunked-prefill MODEL`): FLAG=true, so that argparse does not
    take the next word as the flag's value; `FLAG true|false` stays as it is."""
    out = list(argv)
    for i, tok in enumerate(out):
        if tok in flags and (i + 1 == len(out) or out[i + 1].lower() not in ("true", "false", "1", "0")):
            out[i] = tok + "=true"
    return out


def flag_type(annotation: str):
    """(argparse kwargs) for an EngineConfig field's annotation (a string: annotations are postponed)."""
    if "bool" in annotation:
        return dict(action=argparse.BooleanOptionalAction)
    if annotation.startswith("tuple"):
        return dict(type=int_list, metavar="N,N,...")
    if annotation.startswith("int"):
        return dict(type=human_int, metavar="N")
    if annotation.startswith("float"):
        return dict(type=float, metavar="X")
    return dict(type=str)


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def bool_arg(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() in ("true", "1")


def at_least_two(text: str) -> int:
    """argparse type: an integer >= 2 (e.g. output tokens for a TPOT, which needs a second token)."""
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"{text!r} is less than 2")
    return value


def output_path(text: str) -> str:
    """argparse type of a results file: checked before the run, not after it (a directory, or a missing folder)."""
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text) or not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory" if os.path.isdir(text) else
                                         f"{text!r}: its folder {folder!r} does not exist")
    existed = os.path.exists(text)
    try:                                  # writable now, not after a long run
        open(text, "a").close()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written: {e.strerror}") from None
    if not existed:
        os.remove(text)
    return text


def head_counts(text: str) -> tuple[int, int]:
    """argparse type "H,K": q heads and kv heads, positive, K dividing H."""
    hk = int_list(text)
    if len(hk) != 2 or min(hk) < 1 or hk[0] % hk[1]:
        raise argparse.ArgumentTypeError(f"{text!r} is not H,K: two positive integers, K dividing H (e.g. 16,8)")
    return hk


def config_file_args(argv: list[str], parser) -> list[str]:
    """vLLM's `--config FILE` (YAML or JSON): its keys are flag names (dashes or underscores; `model` is the
    positional MODEL); they become the subcommand's defaults, so whatever the command line gives wins and nothing
    it gives is taken as a flag's value. Returns argv without `--config FILE`; a file that cannot be used, or a key
    that names no flag, is the parser's error (exit 2)."""
    import argparse
    at = [i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")]
    if not at:
        return argv
    i = at[0]
    path = argv[i].partition("=")[2] if "=" in argv[i] else (argv[i + 1] if i + 1 < len(argv) else "")
    rest = argv[:i] + argv[i + (1 if "=" in argv[i] else 2):]
    if not path.endswith((".yaml", ".yml", ".json")):
        parser.error(f"--config {path!r}: a config file must be YAML (.yaml, .yml) or JSON (.json)")
    import json

    import yaml
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)           # (JSON is YAML)
    except (OSError, yaml.YAMLError) as e:
        parser.error(f"--config {path!r} cannot be read: {e}")
    if not isinstance(config, dict):
        parser.error(f"--config {path!r} must hold a mapping of flag names to values, got {config!r:.80}")
    sub = next((a.choices.get(argv[0]) for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    if sub is None:
        parser.error("--config needs a subcommand before it (e.g. jaxinfer serve --config FILE)")
    defaults = {}
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        action = {"--model": None}.get(flag, sub._option_string_actions.get(flag))
        if flag != "--model" and action is None:
            parser.error(f"--config {path!r}: {key!r} names no flag of `{argv[0]}`")
        dest = "config_model" if action is None else action.dest     # (a MODEL or --model given wins: model_arg)
        conv = (lambda x: x) if action is None or action.type is None else action.type
        many = action is not None and action.nargs in ("+", "*")
        try:
            if many:
                value = [conv(str(x)) for x in (value if isinstance(value, list) else [value])]
            elif not (isinstance(value, bool) or value is None):
                value = conv(json.dumps(value) if isinstance(value, (dict, list)) else str(value))
        except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
            parser.error(f"--config {path!r}: {key}: {value!r:.80}: {e}")
        if action is not None and action.choices and not set(value if many else [value]) <= set(action.choices):
            parser.error(f"--config {path!r}: {key}: {value!r:.80} is not one of {list(action.choices)}")
        defaults[dest] = value
    sub.set_defaults(**defaults)
    return rest
