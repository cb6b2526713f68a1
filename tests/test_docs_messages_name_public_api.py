"""What shardkit tells a user (errors, notes, help, summaries) names only public API: `shardkit.NAME` with
NAME in ``shardkit.__all__``, never a private module path such as
``shardkit.checkpoint.ops.resume_zero3.guard_plain_loads``, which may move in any release.

Every string constant of the package is read (the AST, so comments and docstrings are left out: they
speak to maintainers), except a module path used to import or run something (``importlib.import_module
("shardkit.x")``, ``-m shardkit.x``, ``from shardkit.x import``) and the lazy table in
shardkit/__init__.py that maps public names to their modules."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import shardkit

PACKAGE = Path(shardkit.__file__).resolve().parent
DOTTED = re.compile(r"(?<![\w./-])shardkit(?:\.[A-Za-z_]\w*)+")
MODULE_PATH = re.compile(r"shardkit(?:\.\w+)*\.?")  # a whole string that is a module path (an import)
# a programming error, never shown for a user's input: every variable is declared in that table
NOT_FOR_USERS = {("core/env_settings.py", "shardkit.core.env_settings.SETTINGS")}


def _non_doc_strings(tree: ast.AST) -> list[ast.Constant]:
    docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def private_names(text: str) -> list[str]:
    """Dotted shardkit names in ``text`` a user cannot rely on."""
    if MODULE_PATH.fullmatch(text):
        return []
    out = []
    for m in DOTTED.finditer(text):
        before = text[max(0, m.start() - 7):m.start()]
        if before.endswith(("from ", "import ", "-m ")):
            continue
        parts = m.group(0).split(".")
        if len(parts) == 2 and parts[1] in shardkit.__all__:
            continue
        out.append(m.group(0))
    return out


def test_messages_name_only_public_api():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "__init__.py":
            continue  # the lazy table: public name -> defining module
        for node in _non_doc_strings(ast.parse(path.read_text())):
            for name in private_names(node.value):
                if (rel, name) not in NOT_FOR_USERS:
                    problems.append(f"shardkit/{rel}:{node.lineno}: {name}")
    assert not problems, ("user-facing strings name private module paths; name the public `shardkit.X` "
                          "(export it from shardkit/__init__.py if it has none):\n" + "\n".join(problems))


def test_a_private_path_in_a_message_is_found_and_a_public_one_is_not():
    assert private_names("load with shardkit.checkpoint.ops.resume_zero3.guard_plain_loads(engine)") == [
        "shardkit.checkpoint.ops.resume_zero3.guard_plain_loads"]
    assert private_names("load with shardkit.guard_plain_loads(engine).load_checkpoint(OUT)") == []
    assert private_names("shardkit.commands.") == [] and private_names("python -m shardkit.run.x") == []


def test_the_guard_convert_names_is_public():
    # convert --to zero3 (FusedAdam, DeepSpeedCPUAdam) tells users to load with shardkit.guard_plain_loads
    from shardkit import guard_plain_loads
    from shardkit.checkpoint.ops.resume_zero3 import guard_plain_loads as defined

    assert guard_plain_loads is defined and "guard_plain_loads" in shardkit.__all__
