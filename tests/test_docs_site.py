"""The docs site builds and the API reference covers the public API: `mkdocs build --strict` (mkdocs.yml)
turns a broken link, a missing anchor, a page left out of the build or an API entry that does not resolve
into a failure; every public name (``shardkit._LAZY``, read at run time so renames are followed) has an
entry in docs/api.md and a docstring, and so does each public method of a public class."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import shardkit

REPO = Path(__file__).resolve().parents[1]
API_PAGE = REPO / "docs" / "api.md"


def _directives() -> set[str]:
    return set(re.findall(r"^::: ([\w.]+)\s*$", API_PAGE.read_text(), flags=re.M))


def test_every_public_name_has_an_entry_in_the_api_reference():
    directives = _directives()
    missing = [f"::: {module}.{name}" for name, module in shardkit._LAZY.items() if f"{module}.{name}" not in directives]
    assert not missing, (
        "docs/api.md has no entry for these public names (shardkit._LAZY); add the lines under the section "
        "they belong to:\n" + "\n".join(missing))


def test_the_api_reference_documents_public_names_only():
    # an entry left behind by a rename would document a name `import shardkit` no longer offers
    public = {f"{module}.{name}" for name, module in shardkit._LAZY.items()}
    stale = sorted(_directives() - public)
    assert not stale, f"docs/api.md documents names that are not in shardkit._LAZY: {stale}"


def _own_doc(obj: object) -> str:
    """The docstring written on ``obj`` itself: a class inheriting one from its base has none of its own."""
    if inspect.isclass(obj):
        return (obj.__dict__.get("__doc__") or "").strip()
    return (getattr(obj, "__doc__", None) or "").strip()


def _public_methods(cls: type) -> dict[str, object]:
    """Methods and properties ``cls`` defines itself (not inherited), public by name."""
    out = {}
    for name, member in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if inspect.isfunction(member) or isinstance(member, property):
            out[name] = member
    return out


def test_every_public_name_and_its_public_methods_have_a_docstring():
    undocumented = []
    for name, module in shardkit._LAZY.items():
        obj = getattr(importlib.import_module(module), name)
        if not _own_doc(obj):
            undocumented.append(f"{module}.{name}")
        if inspect.isclass(obj):
            undocumented += [f"{module}.{name}.{m}" for m, member in _public_methods(obj).items() if not _own_doc(member)]
    assert not undocumented, (
        "public names without a docstring (the API reference is generated from them; say what it does, "
        "for which inputs, and what it raises):\n" + "\n".join(undocumented))


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_the_docs_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocstrings", reason="the docs tools come with the test extra: pip install -e '.[test]'")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    problems = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith(("WARNING", "ERROR"))]
    assert r.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(problems or [r.stderr[-3000:]])
    site = tmp_path / "site"
    # every page under docs/ is in the site, and the README's front page with it
    pages = [p.relative_to(REPO / "docs") for p in (REPO / "docs").rglob("*.md")]
    built = {p for p in pages if (site / ("" if p.name == "README.md" else p.with_suffix("").as_posix()) /
                                  "index.html").is_file()}
    assert built == set(pages), f"pages missing from the site: {sorted(map(str, set(pages) - built))}"
    assert (site / "front-page" / "index.html").is_file(), "the README is not in the site"
    api = (site / "api" / "index.html").read_text()
    missing = [name for name, module in shardkit._LAZY.items() if f'id="{module}.{name}"' not in api]
    assert not missing, f"the built API reference has no entry for {missing}"
