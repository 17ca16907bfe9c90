"""`python -m jaxinfer.server MODEL [--engine JSON] [--port N] ...`: the server with engine options as JSON
(the keyword arguments of `LLM`). `jaxinfer serve` is the same with one flag per engine option."""
import argparse
import json
import logging
import sys

from jaxinfer.cli_types import json_object, port
from jaxinfer.server.launch import serve
from jaxinfer.server.options import add_server_args, server_options


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxinfer.server", description=__doc__)
    ap.add_argument("model", help="checkpoint directory, preset name or Hugging Face hub id")
    ap.add_argument("--engine", type=json_object, default={},
                    help='engine options as a JSON object, e.g. \'{"max_num_seqs": 64}\'')
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=port, default=8000)
    ap.add_argument("--served-model-name", nargs="+", default=None)
    ap.add_argument("--api-server-count", type=int, default=1)
    ap.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_server_args(ap)
    a = ap.parse_args(argv)
    if not isinstance(a.engine, dict):
        ap.error(f"--engine must be a JSON object of engine options, got {json.dumps(a.engine)[:80]}")
    logging.basicConfig(level=a.log_level.upper(), format="%(levelname)s:     %(message)s")
    try:
        return serve(a.model, a.engine, a.host, a.port, a.served_model_name, a.log_level, a.api_server_count,
                     server_options(a))
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"jaxinfer.server: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
