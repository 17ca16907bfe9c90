"""notebooks/xla_vs_pallas.ipynb runs top to bottom on CPU (tiny model, Pallas in interpret mode)."""
import os

import pytest

nbclient = pytest.importorskip("nbclient")   # not on the GPU image: skip there, not fail
nbformat = pytest.importorskip("nbformat")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_xla_vs_pallas_notebook_runs(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")                # the kernel inherits the environment
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(os.path.join(ROOT, "notebooks", "xla_vs_pallas.ipynb"), as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": os.path.join(ROOT, "notebooks")}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs)
    assert "4/4 prompts give identical tokens" in text
    assert "paged_attention: kernel" in text and "flash_attention: kernel" in text
    assert any("image/png" in o.get("data", {}) for o in outputs), "no plot"
    assert not any(o.get("output_type") == "error" for o in outputs)
