"""notebooks/xla_vs_pallas.ipynb runs top to bottom on CPU (tiny model, Pallas in interpret mode, cudnn and
triton skipped with a message), under Jupyter (nbclient) as a reader runs it; scripts/run_notebook.py (the GPU
machine's runner: no Jupyter there) is checked on a small notebook of its own."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_four_way_notebook_runs(monkeypatch, tmp_path):
    """Run from a folder outside the checkout (the notebook then finds it through the jaxinfer it imports)."""
    nbclient = pytest.importorskip("nbclient")   # not on the GPU image: skip there, not fail
    nbformat = pytest.importorskip("nbformat")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")                # the kernel inherits the environment
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(os.path.join(ROOT, "notebooks", "xla_vs_pallas.ipynb"), as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs)
    assert not any(o.get("output_type") == "error" for o in outputs), text[-2000:]
    assert "xla vs pallas: 4/4 prompts give identical tokens" in text
    assert "skipping cudnn: cudnn needs a CUDA GPU" in text and "skipping triton:" in text
    assert "decode 2 x    64: xla" in text and "prefill 1 x    64: xla" in text
    assert "W pallas" in text and "kernels per layer" in text
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 2, "no plots"


def test_run_notebook_executes_cells_and_keeps_outputs(tmp_path):
    cells = [("markdown", "# t"), ("code", "import matplotlib.pyplot as plt\nx = 6 * 7\nprint('x is', x)"),
             ("code", "plt.plot([1, 2], [3, 4])\nx + 1"), ("code", "raise ValueError('boom')"), ("code", "print(1)")]
    nb = {"cells": [{"cell_type": t, "metadata": {}, "source": s, **({"outputs": [], "execution_count": None}
                                                                      if t == "code" else {})} for t, s in cells],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 4}
    src, out = tmp_path / "in.ipynb", tmp_path / "out.ipynb"
    src.write_text(json.dumps(nb))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "run_notebook.py"), str(src), "-o", str(out)],
                       capture_output=True, text=True, env={**os.environ, "MPLBACKEND": "Agg"})
    assert r.returncode == 1 and "FAILED" in r.stdout              # a cell raised: the run says so
    done = [c for c in json.loads(out.read_text())["cells"] if c["cell_type"] == "code"]
    assert done[0]["outputs"][0]["text"] == ["x is 42\n"] and done[0]["execution_count"] == 1
    kinds = [o["output_type"] for o in done[1]["outputs"]]
    assert kinds == ["execute_result", "display_data"] and done[1]["outputs"][0]["data"]["text/plain"] == ["43"]
    assert done[1]["outputs"][1]["data"]["image/png"]
    assert done[2]["outputs"][-1]["ename"] == "ValueError" and done[3]["execution_count"] is None
