"""scripts/bench.py with module constants set first: the other side of an A/B on an engine switch.

    PYTHONPATH=. python scripts/bench_with.py MODULE.NAME=VALUE [...] [bench.py's arguments]
    e.g. PYTHONPATH=. python scripts/bench_with.py jaxinfer.model.xla_decode.DECODE_CHUNK=128 --attn-backend xla

VALUE is read as a Python literal when it is one (32, 1.5, "x", ()), else kept as a string.
"""
import ast
import importlib
import os
import runpy
import sys


def apply(item: str) -> None:
    target, value = item.split("=", 1)
    module, name = target.rsplit(".", 1)
    try:
        value = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        pass
    mod = importlib.import_module(module)
    if not hasattr(mod, name):
        raise SystemExit(f"bench_with.py: {module} has no {name}")
    setattr(mod, name, value)


if __name__ == "__main__":
    args = sys.argv[1:]
    while args and "=" in args[0] and not args[0].startswith("-"):
        apply(args.pop(0))
    here = os.path.dirname(os.path.abspath(__file__))
    sys.argv = [os.path.join(here, "bench.py")] + args
    runpy.run_path(sys.argv[0], run_name="__main__")
