"""What each checkpoint command accepts is said in one place, shardkit.checkpoint.layout.support.TABLE
(tests/test_inspect_table.py runs every command on a real save of every layout against it). The words
a user reads first must not trail it: each command's `shardkit --help` summary, its paragraph in
docs/cli.md, its line in docs/README.md and the opening of its task page name every family of layouts
the table says the command takes. A layout added to the table (or a command that learns one) fails
here until the words follow; a layout no command takes needs no words."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from shardkit.checkpoint.layout.support import TABLE
from shardkit.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"

#: How prose names each layout of TABLE: any one of these words does.
FAMILY_WORDS: dict[str, tuple[str, ...]] = {
    "zero3": ("ZeRO-3", "ZeRO-1/2/3"),
    "zero12": ("ZeRO-1/2", "ZeRO-1/2/3"),
    "universal": ("universal",),
    "dcp": ("DCP",),
    # accelerate's FSDP files, as the Trainer and Accelerate save them (sharded, full, per-rank)
    "fsdp-sharded": ("Trainer", "Accelerate"),
    "fsdp-full": ("Trainer", "Accelerate"),
    "fsdp-per-rank": ("Trainer", "Accelerate"),
    "accelerate-state": ("save_state",),  # one process's Accelerator.save_state folder
}
READING = ("reshard", "convert", "consolidate", "export")


def accepted(command: str) -> set[str]:
    """The layouts at least one of ``command``'s cells takes (convert: any --to)."""
    return {layout for layout, row in TABLE.items()
            for cell_command, cell in row.items() if cell_command.split(" --to ")[0] == command and cell.applies}


def missing_families(command: str, text: str) -> list[str]:
    return sorted({layout for layout in accepted(command) if not any(w in text for w in FAMILY_WORDS[layout])})


def _subparsers() -> argparse._SubParsersAction:
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    raise AssertionError("shardkit's parser has no commands")


def _summaries() -> dict[str, str]:
    return {a.dest: a.help or "" for a in _subparsers()._choices_actions}


def _descriptions() -> dict[str, str]:
    return {name: p.description or "" for name, p in _subparsers().choices.items()}


def _cli_paragraph(command: str) -> str:
    page = (DOCS / "cli.md").read_text()
    m = re.search(rf"^### `shardkit {command} [^\n]*\n\n(.*?)\n\n", page, re.S | re.M)
    assert m, f"docs/cli.md has no section for {command}"
    return m.group(1)


def _index_line(page: str) -> str:
    text = (DOCS / "README.md").read_text()
    m = re.search(rf"^- \[[^\]]+\]\({re.escape(page)}\):(.*?)(?=^- |\n\n)", text, re.S | re.M)
    assert m, f"docs/README.md does not link {page}"
    return m.group(1)


def _task_opening(page: str) -> str:
    text = (DOCS / "tasks" / page).read_text()
    return text.split("\n## ", 1)[0]


# (command, where, the text): the places a user learns what the command takes
def places() -> list[tuple[str, str, str]]:
    summaries = _summaries()
    descriptions = _descriptions()
    out = [(c, "shardkit --help", summaries[c]) for c in READING]
    out += [(c, f"shardkit {c} --help", descriptions[c]) for c in READING]
    out += [(c, "docs/cli.md", _cli_paragraph(c)) for c in READING]
    out += [("convert", "docs/README.md", _index_line("convert.md")), ("export", "docs/README.md", _index_line("export.md"))]
    out += [("export", "docs/tasks/hugging-face-model.md", _task_opening("hugging-face-model.md")),
            ("reshard", "docs/tasks/resume-on-more-or-fewer-gpus.md", _task_opening("resume-on-more-or-fewer-gpus.md")),
            ("convert", "docs/tasks/move-between-deepspeed-and-fsdp2.md",
             _task_opening("move-between-deepspeed-and-fsdp2.md"))]
    return out


def test_every_layout_a_command_takes_has_words():
    taken = set().union(*(accepted(c) for c in READING))
    assert taken <= set(FAMILY_WORDS), f"name these layouts of TABLE in FAMILY_WORDS: {sorted(taken - set(FAMILY_WORDS))}"


@pytest.mark.parametrize("command, where, text", places(), ids=lambda v: v if len(v) < 60 else "text")
def test_what_a_user_reads_names_every_layout_the_command_takes(command, where, text):
    missing = missing_families(command, text)
    assert not missing, (f"{where}, {command}: says {text!r} but support.TABLE has {command} take "
                         + ", ".join(f"{m} (say {' or '.join(FAMILY_WORDS[m])})" for m in missing))


def test_a_text_that_trails_the_table_is_named():
    assert missing_families("convert", "convert a ZeRO-3 checkpoint to FSDP2 (DCP) or back") == [
        "fsdp-full", "fsdp-per-rank", "fsdp-sharded", "universal", "zero12"]
    assert missing_families("reshard", "a ZeRO-1/2/3 checkpoint for another world size") == []


@pytest.mark.parametrize("page, claim", [
    ("tasks/hugging-face-model.md", r"`consolidate` reads ZeRO-3 checkpoints only"),
    ("tasks/hugging-face-model.md", r"per-rank FSDP1 files are\s+refused"),
    ("trainer.md", r"`verify` says so \(exit 1\)"),
])
def test_claims_the_commands_disproved_are_gone(page, claim):
    # consolidate and export read ZeRO-1/2, universal, DCP and per-rank FSDP1 files (support.TABLE);
    # verify of the Trainer's own save is the structural check of a plain save: exit 0 when whole
    assert not re.search(claim, (DOCS / page).read_text()), f"docs/{page} still says: {claim}"
    assert TABLE["fsdp-per-rank"]["consolidate"].applies and TABLE["zero12"]["consolidate"].applies
