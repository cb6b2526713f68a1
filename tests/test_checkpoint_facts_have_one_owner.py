"""Each checkpoint fact is defined once and owned by one module: two copies of a key's spelling drift
apart silently (a convert would write DCP keys that dcp.load misses), and a helper borrowed as ``_x`` from
another module has no owner (renaming it there breaks the borrower)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "shardkit"


@functools.cache
def _top_levels() -> tuple[tuple[str, tuple[ast.stmt, ...]], ...]:
    """(module path, its top-level statements) for every module of shardkit, parsed once for all cases
    (parsing the whole package took 7 s per case on a loaded machine)."""
    return tuple((str(path.relative_to(PACKAGE)), tuple(ast.parse(path.read_text(encoding="utf-8")).body))
                 for path in sorted(PACKAGE.rglob("*.py")))


def _definitions(name: str) -> list[str]:
    """Modules of shardkit that define ``name`` at top level (a function, or a constant assigned)."""
    found = []
    for module, body in _top_levels():
        for node in body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                found.append(module)
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                found.append(module)
    return found


@pytest.mark.parametrize("name", ["dcp_model_key", "dcp_optim_key", "MODEL_KEY", "OPTIM_KEY", "training_precision"])
def test_each_checkpoint_fact_is_defined_in_one_module(name: str) -> None:
    # two copies of the DCP key spelling drift apart silently: a convert would write keys dcp.load misses
    assert len(_definitions(name)) == 1, _definitions(name)


def test_no_checkpoint_module_imports_another_modules_private_names() -> None:
    # a helper borrowed as `_x` from another module has no owner: renaming it there breaks the borrower
    borrowed = []
    for path in sorted((PACKAGE / "checkpoint").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shardkit.checkpoint"):
                borrowed += [f"{path.relative_to(PACKAGE)}: {node.module}.{a.name}" for a in node.names
                             if a.name.startswith("_") and a.name != "__version__"]
    assert borrowed == []
