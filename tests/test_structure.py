"""The package's shape, enforced: no import cycles, imports at the top of modules, and PyMC,
PyTensor and ArviZ imported by the adapter only (:mod:`pymc_sgmcmc.adapter`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pymc_sgmcmc"

# Function-local imports are for starting JAX lazily and for optional dependencies only.
LOCAL_IMPORTS_ALLOWED = {"jax", "jaxlib", "zarr", "dask", "matplotlib"}

# The host libraries: only the adapter (pymc_sgmcmc.adapter) may import them, directly or
# through importlib (issue 40: PyMC touched in one place).
HOST_LIBRARIES = ("pymc", "pytensor", "arviz", "xarray_einstats")
ADAPTER = "pymc_sgmcmc.adapter"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = module.split(".")
        base = base if is_package else base[:-1]
        base = base[: len(base) - node.level + 1]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    return [prefix] + [f"{prefix}.{a.name}" for a in node.names]


def _top_level_imports(tree: ast.Module) -> list[ast.AST]:
    """Import statements executed at import time (module body, and if/try blocks in it)."""
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            out.append(node)
        elif isinstance(node, ast.If | ast.Try):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            todo.extend(ast.iter_child_nodes(node))
    return out


def test_no_import_cycles():
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        targets = set()
        for node in _top_level_imports(tree):
            for target in _imported(node, name, path.name == "__init__.py"):
                if target in modules and target != name:
                    targets.add(target)
        graph[name] = targets
    # A module importing the package root would import every module (see __init__.py).
    root_importers = [n for n, t in graph.items() if "pymc_sgmcmc" in t and n != "pymc_sgmcmc"]
    assert not root_importers, f"import submodules, not the package root: {root_importers}"
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt == "pymc_sgmcmc":
                continue
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_imports_are_at_the_top_of_modules():
    found = []
    for name, path in _modules().items():
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    root = _imported(node, name, path.name == "__init__.py")[0].split(".")[0]
                    if root not in LOCAL_IMPORTS_ALLOWED:
                        found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {root}")
    assert not found, (
        "function-local imports (move them to the top of the module; only JAX and the "
        f"optional {sorted(LOCAL_IMPORTS_ALLOWED - {'jax', 'jaxlib'})} may be local): {found}"
    )


def _host_library(name: str) -> str | None:
    root = name.split(".")[0]
    if root in HOST_LIBRARIES or root.startswith("arviz_"):
        return root
    return None


def test_only_the_adapter_imports_pymc_pytensor_or_arviz():
    found = []
    for name, path in _modules().items():
        if name == ADAPTER or name.startswith(ADAPTER + "."):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import | ast.ImportFrom):
                targets = _imported(node, name, path.name == "__init__.py")[:1]
                if isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
            elif isinstance(node, ast.Call):
                # importlib.import_module("pymc...") / __import__("pymc...")
                func = ast.unparse(node.func)
                if func.endswith("import_module") or func == "__import__":
                    targets = [a.value for a in node.args if isinstance(a, ast.Constant)]
            for target in targets:
                if isinstance(target, str) and _host_library(target):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {target}")
    assert not found, (
        "only pymc_sgmcmc.adapter may import pymc, pytensor or arviz (move the code that "
        f"needs them there, or pass their values down): {found}"
    )


def _resolve(path: str) -> object:
    """The object at a dotted path: the longest importable module, then attributes (an
    attribute of pymc's Model is looked up on an instance: they are set in __init__)."""
    import importlib

    import pymc as pm

    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if obj is pm.Model:
                obj = pm.Model()
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def test_every_private_pymc_name_listed_resolves():
    from pymc_sgmcmc.adapter.internals import PRIVATE_NAMES

    missing = []
    for path in PRIVATE_NAMES:
        try:
            _resolve(path)
        except (ImportError, AttributeError) as error:
            missing.append(f"{path}: {error}")
    assert not missing, missing


def test_an_unsupported_pymc_gets_one_message_naming_the_supported_ones():
    from pymc_sgmcmc.adapter.internals import check_versions

    for supported in ("6.0.0", "6.4.0", "6.10.1", "5.28.5"):
        check_versions(supported)
    for unsupported in ("5.27.1", "7.0.0", "4.4.0"):
        with pytest.raises(ImportError) as info:
            check_versions(unsupported)
        message = str(info.value)
        assert f"PyMC {unsupported}" in message
        assert "PyMC 6.0 up to (not including) 7.0" in message and "PyMC 5.28" in message
