"""docs/cli.md's "Commands" section and the parsers agree: every command has a section, every flag of
every (sub)command is listed in its section's flag table, and no flag is listed that the command lacks.

The parsers are walked from shardkit.cli.build_parser() each run, so a flag or command added anywhere
fails here until the reference lists it."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from shardkit.cli import build_parser

CLI_MD = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
FLAG = re.compile(r"(?<![\w-])(--?[a-zA-Z][a-zA-Z0-9-]*)")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _commands() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every command a user runs: ('check',), ('config', 'zero3'), ... (a parent with kinds is not one)."""
    found: dict[tuple[str, ...], argparse.ArgumentParser] = {}
    for name, parser in _subparsers(build_parser()).items():
        kinds = _subparsers(parser)
        if kinds:
            found.update({(name, kind): sub for kind, sub in kinds.items()})
        else:
            found[(name,)] = parser
    return found


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings} - {"-h", "--help"}


def _commands_section() -> str:
    text = CLI_MD.read_text(encoding="utf-8")
    start = text.index("\n## Commands\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def _sections() -> dict[tuple[str, ...], set[str]]:
    """Each `### `shardkit ...`` section: the command path(s) its heading names -> the flags its table lists."""
    known = _commands()
    out: dict[tuple[str, ...], set[str]] = {}
    for block in re.split(r"\n(?=### )", _commands_section()):
        heading, _, body = block.partition("\n")
        paths = []
        for span in re.findall(r"`shardkit ([^`]+)`", heading):
            words = span.split()
            path = tuple(words[:2]) if tuple(words[:2]) in known else (words[0],)
            paths.append(path)
        if not heading.startswith("### ") or not paths:
            continue
        flags: set[str] = set()
        for line in body.splitlines():
            if line.startswith("| `"):  # a flag row: the flags are the first cell's code spans
                first = line.split("|")[1]
                for code in re.findall(r"`([^`]+)`", first):
                    flags.update(FLAG.findall(code))
        for path in paths:
            out[path] = flags
    return out


def test_every_command_has_a_section_and_no_section_names_a_missing_command():
    sections, commands = _sections(), _commands()
    assert set(commands) - set(sections) == set(), "commands with no section in docs/cli.md"
    assert set(sections) - set(commands) == set(), "sections in docs/cli.md for commands the CLI lacks"


@pytest.mark.parametrize("path", sorted(_commands()), ids=lambda p: " ".join(p))
def test_every_flag_is_listed_and_every_listed_flag_exists(path):
    sections = _sections()
    parser = _commands()[path]
    # one section may cover several commands (config zero3 and zero2): a listed flag must exist in one of them
    covered = [p for p, flags in sections.items() if flags is sections[path]]
    union = set().union(*(_flags(_commands()[p]) for p in covered))
    listed = sections[path]
    assert _flags(parser) - listed == set(), f"`shardkit {' '.join(path)}` flags missing from docs/cli.md"
    assert listed - union == set(), f"docs/cli.md lists flags `shardkit {' '.join(path)}` does not have"


def test_every_exit_code_is_documented():
    section = _commands_section()
    table = section[section.index("### Exit codes") :]
    codes = set(re.findall(r"^\| (\d+|other) \|", table, re.M))
    assert {"0", "1", "2", "3", "130", "143", "other"} <= codes
    assert "128 + the signal" in table


def test_every_old_spelling_is_in_the_vocabulary_table():
    """An alias a parser keeps for an old script is named where the vocabulary is explained."""
    section = _commands_section()
    vocabulary = section[section.index("### One vocabulary") : section.index("### Results")]
    olds = {s for p in _commands().values() for a in p._actions if (a.help or "").startswith("old spelling")
            for s in a.option_strings}
    assert olds, "no alias found: the test would pass vacuously"
    for old in olds:
        assert f"`{old}" in vocabulary, f"{old} is accepted but docs/cli.md's vocabulary table does not name it"
