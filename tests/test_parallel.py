"""Runs tests/parallel_cases.py (tensor / data parallelism on 8 CPU devices) in a separate pytest process:
the device count is fixed when JAX starts (XLA_FLAGS=--xla_force_host_platform_device_count=8), and the rest
of the suite must keep one device."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_parallel_cases_on_eight_cpu_devices():
    env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") +
                                       " --xla_force_host_platform_device_count=8").strip(),
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           os.path.join(HERE, "parallel_cases.py")],
                          cwd=os.path.dirname(HERE), env=env, capture_output=True, text=True, timeout=900)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "failed" not in proc.stdout, tail
