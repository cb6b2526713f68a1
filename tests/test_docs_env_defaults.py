"""Every ``SHARDKIT_*`` default has one source, shardkit.core.env_settings.SETTINGS: a page that states
one (`SHARDKIT_X` (default N s), `SHARDKIT_X` (N s when unset), (`SHARDKIT_X`, default N s)) states that
value, and the code that reads a variable falls back to that value. docs/cli.md's table is generated from
SETTINGS (tests/test_env_settings.py); this covers the other pages and the readers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardkit.core.env_settings import SETTINGS

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
STATED = re.compile(r"`(SHARDKIT_[A-Z_]+)`(?:,|\s\()\s*(?:default\s+)?(\d+(?:\.\d+)?)\s+s\b")


def stated_defaults(text: str) -> list[tuple[int, str, float]]:
    """(line, variable, seconds) for every default a page states in one of the forms above."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(1), float(m.group(2))) for m in STATED.finditer(text)]


def disagreements(text: str) -> list[str]:
    out = []
    for line, name, seconds in stated_defaults(text):
        setting = SETTINGS.get(name)
        if setting is not None and setting.kind == "seconds" and float(setting.default) != seconds:
            out.append(f"line {line}: {name} {seconds:g} s, but its default is {setting.default} s "
                       "(shardkit/core/env_settings.py)")
    return out


def test_every_page_states_the_declared_default():
    problems, seen = [], 0
    for page in PAGES:
        text = page.read_text()
        seen += len(stated_defaults(text))
        problems += [f"{page.relative_to(REPO)}: {p}" for p in disagreements(text)]
    assert seen >= 3, "no stated default found: is the pattern broken?"
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("text", [
    "It repeats every `SHARDKIT_SILENCE_S` (10 s when\nunset; 0: never)",
    "A rank that never joins (`SHARDKIT_JOIN_TIMEOUT_S`, default 30 s)",
    "`SHARDKIT_STALE_S` (default 5 s)",
])
def test_a_page_stating_another_default_is_named(text):
    (problem,) = disagreements(text)
    assert problem.startswith("line ") and "but its default is" in problem


def test_a_split_commands_wait_repeats_at_the_declared_silence(monkeypatch):
    # a split reshard's waiting process once repeated every 10 s when SHARDKIT_SILENCE_S was unset,
    # while every rank spoke after the declared 120 s: one variable with two defaults
    from shardkit.storage import shared_meet

    monkeypatch.delenv("SHARDKIT_SILENCE_S", raising=False)
    assert shared_meet._Reporter("reshard").interval == float(SETTINGS["SHARDKIT_SILENCE_S"].default)
    monkeypatch.setenv("SHARDKIT_SILENCE_S", "7")
    assert shared_meet._Reporter("reshard").interval == 7.0
