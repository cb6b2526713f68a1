"""Every docs page links the glossary, so no page has to re-explain "fp32 master" or "tag"; and every glossary
entry points at a section of docs/concepts.md that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
GLOSSARY = DOCS / "glossary.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s#]*)(?:#([^)\s]*))?\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _slug(heading: str) -> str:
    # GitHub's heading anchors, which mkdocs.yml's slugify also makes
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", FENCE.sub("", page.read_text()), flags=re.M)}


def _links(page: Path) -> list[tuple[Path, str]]:
    """(resolved file, anchor) of every relative link on ``page``, code blocks left out."""
    out = []
    for file, anchor in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"^[a-z]+:", file):
            continue
        out.append(((page.parent / file).resolve() if file else page, anchor))
    return out


PAGES = sorted(p for p in DOCS.rglob("*.md") if p != GLOSSARY)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_every_docs_page_links_the_glossary(page):
    assert GLOSSARY.resolve() in {dest for dest, _ in _links(page)}, (
        f"{page.relative_to(REPO)} does not link the glossary: add a line under its title, e.g. "
        f"'Words these pages use without explaining them (tag, fp32 master, DCP ...): "
        f"[glossary]({'../' * (len(page.relative_to(DOCS).parts) - 1)}glossary.md).'")


def test_every_glossary_entry_links_a_concepts_section_that_exists():
    text = FENCE.sub("", GLOSSARY.read_text())
    entries = re.split(r"^## ", text, flags=re.M)[1:]
    assert len(entries) >= 20, f"only {len(entries)} glossary entries"
    headings = [e.splitlines()[0] for e in entries]
    assert len(set(map(_slug, headings))) == len(headings), f"two entries share an anchor: {headings}"
    concepts = _anchors(DOCS / "concepts.md")
    problems = []
    for heading, entry in zip(headings, entries):
        targets = [anchor for file, anchor in LINK.findall(entry) if file == "concepts.md"]
        if not targets:
            problems.append(f"{heading}: links no section of concepts.md")
        problems += [f"{heading}: concepts.md has no section #{a}" for a in targets if a not in concepts]
    assert not problems, "\n".join(problems)
