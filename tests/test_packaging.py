"""Every package the engine imports is one that `pip install -e .` installs: a module imported by jaxinfer/ or
pallas_kernels/ comes from a distribution named in pyproject's [project] dependencies, or is one of the optional
ones below (each in an extra, or guarded where it is imported). A chat template needs jinja2, which transformers
asks for without requiring: a plain install's chat failed before it was listed."""
import ast
import importlib.metadata as md
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
OPTIONAL = {"jax_triton": "triton", "triton": "triton",      # attn_backend="triton" (the [triton] extra)
            "pynvml": None}                                     # GPU memory when JAX keeps no stats (memory.py)


def imported_modules() -> dict[str, str]:
    """Top-level third-party module -> a file importing it."""
    found = {}
    for root in ("jaxinfer", "pallas_kernels"):
        for path in sorted((ROOT / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for top in (n.split(".")[0] for n in names):
                    if top not in sys.stdlib_module_names and top not in ("jaxinfer", "pallas_kernels"):
                        found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_imported_package_is_a_declared_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {norm(re.split(r"[\s<>=!~\[;]", d, maxsplit=1)[0]) for d in project["dependencies"]}
    extras = project["optional-dependencies"]
    dists = md.packages_distributions()
    missing = []
    for module, where in imported_modules().items():
        if module in OPTIONAL:
            extra = OPTIONAL[module]
            assert extra is None or any(norm(module) in norm(d) for d in extras[extra]), (module, extra)
            continue
        names = {norm(d) for d in dists.get(module, [])}
        assert names, f"{module} (imported by {where}) is not installed"
        if not names & declared:
            missing.append(f"{module} ({sorted(names)}, imported by {where})")
    assert not missing, "imported but not in [project] dependencies: " + ", ".join(missing)
