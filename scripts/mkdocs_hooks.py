"""mkdocs hooks for the docs site (``mkdocs.yml``): the repository's README.md becomes a site page.

The pages under docs/ are written to read right on GitHub, where docs/ sits inside the repository: they
link the front page as ``../README.md`` and the README links them as ``docs/<page>.md``. mkdocs only
knows the files under docs/, so without these hooks every such link is a broken link under
``mkdocs build --strict``. The README is added to the site as ``front-page.md`` with its ``docs/``
prefixes dropped, and the pages' links to ``../README.md`` are pointed at it; every other link is left
to mkdocs' own checks.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

FRONT_PAGE = "front-page.md"
REPO = Path(__file__).resolve().parents[1]


def on_files(files: Files, config: Any) -> Files:
    text = (REPO / "README.md").read_text()
    # the README's links into docs/ as links between site pages
    text = re.sub(r"\]\(docs/", "](", text)
    files.append(File.generated(config, FRONT_PAGE, content=text))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    depth = page.file.src_uri.count("/")
    # from docs/<page>.md, ../README.md is the repository's README; from docs/tasks/<page>.md,
    # ../README.md is docs/README.md, a site page already, and ../../README.md the repository's
    readme = "../" * (depth + 1) + "README.md"
    return re.sub(r"\]\(" + re.escape(readme) + r"(?=[#)])", "](" + "../" * depth + FRONT_PAGE, markdown)
