"""Importing jaxinfer, and an LLM made, used and deleted, leave the user's process as they found it (run in a
process of its own: the checks read process-wide state)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import logging, multiprocessing, os, signal, threading, warnings
def state():
    return (dict(os.environ), [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)],
            list(logging.root.handlers), logging.root.level, len(warnings.filters),
            multiprocessing.get_start_method(allow_none=True))
before = state()
import jaxinfer
assert state() == before, "import jaxinfer changed the process"
from jaxinfer import LLM, SamplingParams
import jax
jax.config.update("jax_enable_x64", True)               # a user's own JAX settings survive an LLM
threads = {t.name for t in threading.enumerate()}
before = state()
llm = LLM("qwen3-pydoc", max_model_len=256)
out = llm.generate(["Hello", [5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
assert all(len(o.outputs[0].token_ids) == 4 for o in out)
beams = llm.beam_search([[5, 6, 7]], jaxinfer.BeamSearchParams(beam_width=2, max_tokens=2))
del llm
after = state()
assert after[0] == before[0], "os.environ changed"
assert after[1:] == before[1:], (before[1:], after[1:])   # signals, logging, warnings, multiprocessing's start method
assert jax.config.jax_enable_x64
new = {t.name for t in threading.enumerate()} - threads
assert not any("tqdm" in n for n in new), new           # (a disabled progress bar is not made at all)
multiprocessing.set_start_method("spawn")                # (a user's script may still choose its own)
print("OK")
"""


def test_import_and_an_llm_leave_the_process_alone():
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}
    r = subprocess.run([sys.executable, "-c", SCRIPT], env={**env, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]
