"""Execute a notebook's code cells in this process and write the notebook back with their outputs.

For machines without Jupyter (the GPU machine has no jupyter, nbclient or nbformat): plain json, the standard
library and matplotlib. Each code cell runs in one shared namespace, in the notebook's directory; its stdout and
stderr become stream outputs (and are echoed here as they come), the value of a last bare expression an
execute_result, every open matplotlib figure a PNG display_data (then it is closed), and an exception an error
output, after which the run stops (exit status 1) and the notebook is still written.

  PYTHONPATH=. python scripts/run_notebook.py notebooks/xla_vs_pallas.ipynb [-o OUT.ipynb]
"""
from __future__ import annotations

import argparse
import ast
import base64
import contextlib
import io
import json
import os
import sys
import time
import traceback


class _Tee(io.TextIOBase):
    """Collects what a cell prints and echoes it to the real stream, so a long run shows progress."""

    def __init__(self, echo):
        self.buf, self.echo = io.StringIO(), echo

    def write(self, s):
        self.echo.write(s)
        self.echo.flush()
        return self.buf.write(s)

    def flush(self):
        self.echo.flush()


def _source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def _figures() -> list[dict]:
    """PNG outputs of the open matplotlib figures (closed afterwards); none if matplotlib was never imported."""
    if "matplotlib.pyplot" not in sys.modules:
        return []
    plt = sys.modules["matplotlib.pyplot"]
    out = []
    for num in plt.get_fignums():
        fig = plt.figure(num)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
        out.append({"output_type": "display_data", "metadata": {},
                    "data": {"image/png": base64.b64encode(buf.getvalue()).decode("ascii"),
                             "text/plain": [f"<Figure {fig.get_figwidth():.0f}x{fig.get_figheight():.0f} in>"]}})
    plt.close("all")
    return out


def run_cell(code: str, ns: dict, count: int) -> tuple[list[dict], bool]:
    """Run one cell's code in ns -> (outputs, ok)."""
    out_t, err_t = _Tee(sys.__stdout__), _Tee(sys.__stderr__)
    outputs, ok, result = [], True, None
    with contextlib.redirect_stdout(out_t), contextlib.redirect_stderr(err_t):
        try:
            tree = ast.parse(code)
            last = tree.body[-1] if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            body = ast.Module(body=tree.body[:-1] if last else tree.body, type_ignores=[])
            exec(compile(body, f"<cell {count}>", "exec"), ns)
            if last is not None:
                result = eval(compile(ast.Expression(last.value), f"<cell {count}>", "eval"), ns)
        except Exception as e:  # noqa: BLE001 (reported as the cell's error output)
            ok = False
            tb = traceback.format_exception(type(e), e, e.__traceback__)
            outputs_err = {"output_type": "error", "ename": type(e).__name__, "evalue": str(e), "traceback": tb}
    for name, tee in (("stdout", out_t), ("stderr", err_t)):
        if tee.buf.getvalue():
            outputs.append({"output_type": "stream", "name": name, "text": _lines(tee.buf.getvalue())})
    if result is not None and ok:
        outputs.append({"output_type": "execute_result", "execution_count": count, "metadata": {},
                        "data": {"text/plain": _lines(repr(result))}})
    outputs += _figures()
    if not ok:
        sys.__stderr__.write("".join(outputs_err["traceback"]))
        outputs.append(outputs_err)
    return outputs, ok


def run_notebook(path: str, out_path: str | None = None) -> bool:
    """Run every code cell of the notebook at `path` in order; write it (to out_path or in place). True if no
    cell failed."""
    with open(path, encoding="utf-8") as f:
        nb = json.load(f)
    os.environ.setdefault("MPLBACKEND", "Agg")          # figures are captured, never shown in a window
    ns = {"__name__": "__main__"}
    cwd = os.getcwd()
    os.chdir(os.path.dirname(os.path.abspath(path)))
    ok, count, t0 = True, 0, time.perf_counter()
    try:
        for cell in nb["cells"]:
            if cell.get("cell_type") != "code":
                continue
            if not ok:                                   # after an error: the rest stay unexecuted
                cell["outputs"], cell["execution_count"] = [], None
                continue
            count += 1
            cell["outputs"], ok = run_cell(_source(cell), ns, count)
            cell["execution_count"] = count
    finally:
        os.chdir(cwd)
    nb.setdefault("metadata", {})["language_info"] = {"name": "python", "version": sys.version.split()[0]}
    with open(out_path or path, "w", encoding="utf-8") as f:
        json.dump(nb, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"run_notebook: {count} code cells in {time.perf_counter() - t0:.1f} s, "
          f"{'ok' if ok else 'FAILED'}; wrote {out_path or path}", file=sys.__stdout__)
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebook")
    ap.add_argument("-o", "--output", help="write the executed notebook here (default: in place)")
    a = ap.parse_args(argv)
    return 0 if run_notebook(a.notebook, a.output) else 1


if __name__ == "__main__":
    sys.exit(main())
