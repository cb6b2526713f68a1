"""The house plan holds: shardkit's import graph (function-level imports included) has no cycle, no
import that runs back up a layer and no two packages importing each other; imports of shardkit's own
modules sit at the top of the file outside the named lazy boundaries (scripts/import_graph.py lists
the layers and the boundaries)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "import_graph.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)


def _script():
    spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _problems(out: str) -> str:
    """The script's report without its inner-import lines (test_no_inner_imports... has those)."""
    return "\n".join(line for line in out.splitlines() if not line.startswith("inner import:"))


def test_no_import_cycles_and_no_upward_imports():
    r = _run()
    if "no cycles, no upward imports" not in r.stdout or "unlayered:" in r.stdout:
        pytest.fail(_problems(r.stdout) + r.stderr)


def test_no_two_packages_import_each_other():
    r = _run()
    if "no two packages import each other" not in r.stdout or r.returncode != 0:
        pytest.fail(_problems(r.stdout) + r.stderr)


def test_no_inner_imports_outside_the_lazy_boundaries():
    r = _run("--strict-inner")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "\n0 inner imports" in r.stdout


def _write(root: Path, files: dict[str, tuple[str, str]]) -> dict[str, Path]:
    """A throwaway shardkit tree: module name -> path, as the script's main() builds it."""
    modules = {}
    for name, (relative, text) in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        modules[name] = path
    return modules


def test_inner_imports_are_found_unless_at_a_boundary_or_marked(tmp_path):
    graph = _script()
    body = (
        "import os\n"
        "from shardkit.b import x\n"  # top of the file: fine
        "def f():\n"
        "    import torch\n"  # third party: not shardkit's own
        "    from shardkit.b import y\n"  # hidden
        "    from shardkit.b import z  # lazy: keeps torch out of `shardkit check`\n"
        "    from shardkit.b import s\n"  # an inline comment covers its own import only
        "    # lazy: keeps deepspeed out of `shardkit verify`\n"
        "    from shardkit.b import w\n"
        "    from shardkit.b import u\n"  # right under the comment's import: covered too
        "    from shardkit.b import (\n"
        "        v,  # lazy: keeps torch out of `shardkit --help`\n"
        "    )\n"
        "    x = 1\n"
        "    from shardkit.b import t\n"  # a run of covered imports ends at other code
        "    class C:\n"
        "        async def g(self):\n"
        "            from ..b import q\n"  # nested and relative: hidden
        "    return C\n"
    )
    modules = _write(
        tmp_path,
        {
            "shardkit": ("shardkit/__init__.py", ""),
            "shardkit.a": ("shardkit/a/__init__.py", ""),
            "shardkit.a.m": ("shardkit/a/m.py", body),
            "shardkit.b": ("shardkit/b.py", ""),
            "shardkit.commands.c": ("shardkit/commands/c.py", body),  # the CLI boundary: allowed
        },
    )
    found = graph.inner_imports(modules)
    assert found == [
        ("shardkit.a.m", 5, ["shardkit.b"]),
        ("shardkit.a.m", 7, ["shardkit.b"]),
        ("shardkit.a.m", 15, ["shardkit.b"]),
        ("shardkit.a.m", 18, ["shardkit.b"]),
    ], found


def test_packages_importing_each_other_are_found():
    graph = _script()
    assert graph.package("shardkit.run.spawn.process") == "shardkit.run"
    assert graph.package("shardkit.autopreflight.hooks") == "shardkit.autopreflight"
    assert graph.package("shardkit.checkpoint.zero3.layout") == "shardkit.checkpoint.zero3"
    assert graph.package("shardkit.cli") == "shardkit.cli"
    edges = {
        "shardkit.placement.snapshot": {"shardkit.storage.atomic"},
        "shardkit.storage.atomic": {"shardkit.checkpoint.zero3.layout"},  # io -> zero3 only: fine
        "shardkit.checkpoint.zero3.layout": {"shardkit.placement.preflight"},
        "shardkit.checkpoint.ops.reshard": {"shardkit.placement.preflight"},
        "shardkit.placement.preflight": {"shardkit.checkpoint.ops.reshard"},
    }
    mutual = graph.mutual_packages({m: set() for t in edges.values() for m in t} | edges)
    assert [(a, b) for a, b, *_ in mutual] == [("shardkit.checkpoint.ops", "shardkit.placement")], mutual


#: The house rule: a module is small enough to read in one sitting (zero3/repartition.py,
#: ops/consolidate.py and run/launcher.py grew past it once; each was split by concern).
MAX_MODULE_LINES = 450


def _long_modules(root: Path) -> list[str]:
    return sorted(f"{p.relative_to(root)}: {n} lines" for p in root.rglob("*.py")
                  if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES)


def test_no_module_over_450_lines():
    too_long = _long_modules(REPO / "shardkit")
    assert not too_long, f"split these by concern (at most {MAX_MODULE_LINES} lines each): {too_long}"


def test_a_long_module_is_found(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "big.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (tmp_path / "pkg" / "small.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    assert _long_modules(tmp_path) == [f"pkg/big.py: {MAX_MODULE_LINES + 1} lines"]
