"""Shared pytest setup: CPU by default, a `gpu` marker for compiled-kernel checks."""
import os
import pkgutil
import warnings

import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# The CPU tests compile hundreds of tiny programs and run each a few times: XLA's CPU backend at LLVM -O0 compiles
# them in about half the time (a pallas-interpret engine test: 7.1 s of compiles against 14-17 s) for the whole run,
# and the processes the tests start inherit it. Not with a CUDA plugin installed (the GPU-marked tests compile as
# users do). Only this test process: the package itself sets nothing.
_CPU_FAST = "--xla_backend_optimization_level=0"
if not any(m.name.startswith("jax_cuda") for m in pkgutil.iter_modules()) and \
        _CPU_FAST not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _CPU_FAST).strip()
warnings.filterwarnings("ignore", message=".*Triton.*deprecated.*")


def _has_gpu() -> bool:
    import jax
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (compiled Pallas kernels); skipped on CPU")


# The files that take longest on 2 CPU cores, longest first: run first, so that `-n 2 --dist loadfile` (whole files
# per worker, in collection order) ends with short files on both workers instead of one long file on one of them.
LONG_FILES = ("test_parallel.py", "test_xla_attention.py", "test_bench.py", "test_fp8_engine.py",
              "test_mosaic_prefill.py", "test_mosaic_persistent.py", "test_engine.py", "test_cli.py",
              "test_notebook.py", "test_server_faults.py", "test_demo_model.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.fspath)), len(rank)))    # (stable)
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="no GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """name -> path of a tiny random fp32 checkpoint for each of helpers.TINY_CONFIGS."""
    from helpers import TINY_CONFIGS, make_tiny_model
    root = tmp_path_factory.mktemp("ckpt")
    return {name: make_tiny_model(str(root / name), **kw) for name, kw in TINY_CONFIGS.items()}


@pytest.fixture(scope="session")
def tiny_dir(tiny_dirs):
    return tiny_dirs["gqa2"]
