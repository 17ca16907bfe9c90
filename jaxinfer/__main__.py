"""`python -m jaxinfer ...` is the `jaxinfer` command (see jaxinfer/cli.py)."""
import sys

from jaxinfer.cli import main

sys.exit(main())
