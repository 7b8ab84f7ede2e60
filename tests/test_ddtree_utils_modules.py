"""The ddtree_* modules by role: each ``__all__`` lists exactly the public names the module
defines, and the shipped ones import only what a build ships next to them."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = ["ddtree_utils", "ddtree_triton", "ddtree_serving", "ddtree_budget", "ddtree_reference"]


def _defined_public_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if not n.startswith("_") and n != "logger"}  # logging handle, not API


@pytest.mark.parametrize("name", MODULES)
def test_all_lists_every_public_name(name):
    if name == "ddtree_triton":
        pytest.importorskip("triton")
    mod = importlib.import_module(name)
    public = _defined_public_names(ROOT / f"{name}.py")
    assert sorted(mod.__all__, key=str.lower) == sorted(public, key=str.lower)
    assert all(hasattr(mod, n) for n in mod.__all__)


@pytest.mark.parametrize("name", ["ddtree_utils", "ddtree_triton", "ddtree_serving", "ddtree_budget"])
def test_shipped_modules_import_no_oracle_and_nothing_unshipped(name):
    """A shipped module imports the standard library, torch / triton, and its shipped siblings
    only (ddtree_reference is the tests' and is never shipped)."""
    from ddtree_deploy.deploy.build.series import SHIPPED_MODULES

    siblings = {m[:-3] for m in SHIPPED_MODULES}
    tree = ast.parse((ROOT / f"{name}.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
    allowed = siblings | {"torch", "triton", "__future__"} | set(__import__("sys").stdlib_module_names)
    assert imported <= allowed, imported - allowed
    assert "ddtree_reference" not in imported
