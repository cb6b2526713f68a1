"""Every package's docstring says what the package holds today: a newcomer reads ``__init__.py`` to find
where things live, so each package has a docstring, and every place it names exists: a ``shardkit.x.y``
module or name, a ``pkg/`` folder, a repository path (``shardkit/cli.py``), or a dotted module path
relative to the package or one above it (``storage.verify.check_resumable``).

Read from the source (the AST), never imported: a package that imports torch is checked the same way."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import shardkit

PACKAGE = Path(shardkit.__file__).resolve().parent
REPO = PACKAGE.parent
PACKAGES = sorted(p.parent for p in PACKAGE.rglob("__init__.py") if "__pycache__" not in p.parts)

DOTTED = re.compile(r"(?<![\w./-])shardkit(?:\.[A-Za-z_]\w*)+")
# ``pkg/`` or `pkg/sub/`: a folder named in backticks
FOLDER = re.compile(r"`+([A-Za-z_]\w*(?:/[A-Za-z_]\w*)*)/`+")
REPO_PATH = re.compile(r"(?<![\w/.-])((?:shardkit|docs|tests|benchmarks|scripts)/[\w./-]*\w)")
# ``a.b`` or ``a.b.c`` in double backticks, maybe called: a module path relative to this package or one above
RELATIVE = re.compile(r"``([a-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\([^`]*\))?``")
# ``sitecustomize.py``, ``model.safetensors``: a file name, not a module path
FILE_SUFFIXES = {"py", "json", "md", "txt", "toml", "yaml", "yml", "sh", "pt", "bin", "pkl", "safetensors", "distcp"}


def _module_file(base: Path) -> Path | None:
    """The file defining module or package ``base`` (a path without suffix), if there is one."""
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def _top_level_names(path: Path) -> set[str]:
    """Names a module defines at its top level (shardkit/__init__.py: its lazy public names too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            if isinstance(node.value, ast.Dict):  # shardkit's _LAZY table: public name -> module
                names.update(k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
    return names


def _resolves(parts: list[str], root: Path) -> bool:
    """Whether ``parts`` (a dotted path from folder ``root``) is a module, package, or a name one defines."""
    for i in range(len(parts), 0, -1):
        module = _module_file(root.joinpath(*parts[:i]))
        if module is not None:
            rest = parts[i:]
            return not rest or rest[0] in _top_level_names(module)
    return False


def docstring_problems(package_dir: Path, doc: str) -> list[str]:
    """The places ``doc`` (the docstring of the package in ``package_dir``) names that do not exist."""
    ancestors = [package_dir, *[p for p in package_dir.parents if p == PACKAGE or PACKAGE in p.parents]]
    problems = []
    for m in DOTTED.finditer(doc):
        if not _resolves(m.group(0).split("."), REPO):
            problems.append(f"{m.group(0)}: no such shardkit module or name")
    for m in FOLDER.finditer(doc):
        if not any((a / m.group(1)).is_dir() for a in ancestors):
            problems.append(f"{m.group(1)}/: no such folder in {package_dir.relative_to(REPO)} or a package above it")
    for m in REPO_PATH.finditer(doc):
        if not (REPO / m.group(1)).exists():
            problems.append(f"{m.group(1)}: no such path in the repository")
    for m in RELATIVE.finditer(doc):
        parts = m.group(1).split(".")
        if parts[0] == "shardkit":
            continue  # DOTTED's
        if parts[-1] in FILE_SUFFIXES:
            continue  # ``zero_to_fp32.py`` is DeepSpeed's: a bare file name says nothing of where it lives
        # a name ours only if its first part is a module or package here or above (torch.load is torch's)
        roots = [a for a in ancestors if _module_file(a / parts[0]) is not None]
        if roots and not any(_resolves(parts, a) for a in roots):
            problems.append(f"{m.group(1)}: no such module or name under {roots[0].relative_to(REPO)}")
    return problems


def _docstring(package_dir: Path) -> str | None:
    return ast.get_docstring(ast.parse((package_dir / "__init__.py").read_text()))


@pytest.mark.parametrize("package_dir", PACKAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_package_says_what_it_holds_and_names_only_what_exists(package_dir):
    doc = _docstring(package_dir)
    assert doc and doc.strip(), f"{package_dir.relative_to(REPO)}/__init__.py has no docstring: say what the package holds"
    problems = docstring_problems(package_dir, doc)
    assert not problems, (f"{package_dir.relative_to(REPO)}/__init__.py's docstring names what does not exist "
                          "(moved or renamed since it was written?):\n" + "\n".join(problems))


# What shardkit/checkpoint/__init__.py said once the io/ package had become shardkit.storage.
STALE_CHECKPOINT_DOCSTRING = """Checkpoints shardkit writes and reads, in three layers:

- ``io/``: byte-level plumbing every format and operation shares (atomic files and tags, the one
  staged save sequence, manifest, verify, the unpickling allow-list, streaming writers);
- one package per on-disk format: ``zero3/`` (DeepSpeed ZeRO-3), ``dcp/`` (FSDP2 through
  torch.distributed.checkpoint), ``hf_trainer/`` (the Hugging Face Trainer's ``checkpoint-N``);
- ``ops/``: what users run (save/resume per engine, reshard, convert, consolidate).

Every writer goes through ``io.staged_save.atomic_checkpoint``; every loader checks the manifest first
(``shardkit.io.verify.check_resumable_distributed``) and unpickles nothing outside an allow-list
(``storage.torch_load.no_such_name``, ``dcp.safe_load``); see shardkit/io/verify.py.
"""


def test_a_docstring_naming_a_package_that_moved_is_caught():
    got = docstring_problems(PACKAGE / "checkpoint", STALE_CHECKPOINT_DOCSTRING)
    assert got == [
        "shardkit.io.verify.check_resumable_distributed: no such shardkit module or name",
        "io/: no such folder in shardkit/checkpoint or a package above it",
        "shardkit/io/verify.py: no such path in the repository",
        "storage.torch_load.no_such_name: no such module or name under shardkit",
    ]
    # what exists passes: the formats, the storage layer, a public name, a module path from a package above
    assert docstring_problems(PACKAGE / "checkpoint" / "ops", "``zero3/``, ``storage.verify.check_resumable``, "
                              "``shardkit.preflight``, ``readers.registry``, ``dcp.safe_load``, shardkit/cli.py, "
                              "torch's ``torch.load``, ``model.safetensors``, ``zero_to_fp32.py``") == []
