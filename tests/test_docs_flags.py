"""Every `shardkit <command> --flag` the docs name exists in the live parser.

tests/test_readme_walkthrough.py parses the ```bash blocks of README.md and docs/*.md line by line.
This test covers what it does not: inline code (`reshard --no-verify`, `config fsdp --pin-memory`),
blocks of any language, and the pages below docs/ (docs/tasks/). It only asks whether the command
and each long flag exist, since inline code is often a fragment. The parser is built from
shardkit.cli each run and walked through its subparsers, so flags and aliases other work adds are
known without a list to update here.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path

import pytest

from shardkit.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
# tokens that end the shardkit part of a shell line
STOP = {"|", "||", "&&", ";", "&", ">", ">>", "<", "2>", "2>&1", "#", "--"}
# what a page writes for "some command": `...`, `<command>`, `COMMAND`, `X`
PLACEHOLDER = re.compile(r"\.\.\.|<[^>]*>|[A-Z][A-Z_]*|\|")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--")}


def _passes_through(parser: argparse.ArgumentParser) -> bool:
    """A parser with a REMAINDER positional (`launch`) hands unknown flags to another program."""
    return any(a.nargs == argparse.REMAINDER for a in parser._actions)


def _tokens(text: str) -> list[str]:
    try:
        return shlex.split(text, comments=False)
    except ValueError:  # an unbalanced quote in a fragment
        return text.split()


def _flag_names(token: str) -> list[str]:
    """`--pin-memory/--no-pin-memory` -> both; `--json=-` -> `--json`; `[--force]` -> `--force`."""
    names = []
    for part in token.strip("[](),.:;'\"").split("/"):
        part = part.split("=", 1)[0].rstrip("[](),.:;'\"")
        if re.fullmatch(r"--[a-z][a-z0-9_-]*", part):
            names.append(part)
    return names


def _old_spellings(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Flags a parser keeps only for old scripts (help "old spelling of --X") -> what to write instead."""
    out = {}
    for action in parser._actions:
        new = re.match(r"old spelling of (--[a-z][a-z0-9-]*)", action.help or "")
        if new:
            out.update({s: new.group(1) for s in action.option_strings})
    return out


def _takes_old_json_file(parser: argparse.ArgumentParser) -> bool:
    """`--json` takes an optional value on the commands that once took `--json FILE` (smoke, preflight)."""
    return any("--json" in a.option_strings and a.nargs == "?" for a in parser._actions)


def check(words: list[str], root: argparse.ArgumentParser, strict_command: bool) -> str | None:
    """None when ``words`` (what follows `shardkit`) names a real command and only its flags."""
    parser, path = root, ["shardkit"]
    rest = list(words)
    while rest and _subparsers(parser) and not rest[0].startswith("-"):
        subs = _subparsers(parser)
        if PLACEHOLDER.fullmatch(rest[0]):
            return None  # `shardkit <command> --help`, `config ... --fit`: stands for any command
        if rest[0] not in subs:
            if strict_command or len(path) > 1:
                return f"`{' '.join(path)}` has no command {rest[0]!r} (it has: {', '.join(sorted(subs))})"
            return None  # prose-like fragment ("shardkit checks ..."): not a command line
        parser = subs[rest.pop(0)]
        path.append(parser.prog.split()[-1])
    if len(path) == 1 and not any(w.startswith("--") for w in rest[:1]):
        return None
    known = _flags(parser) | {"--help"}
    if _subparsers(parser):  # `config --fit`: a flag of one of its kinds
        known |= {f for sub in _subparsers(parser).values() for f in _flags(sub)}
    passthrough = _passes_through(parser)
    old = {} if passthrough else _old_spellings(parser)
    for i, word in enumerate(rest):
        if word in STOP or word.startswith("#"):
            break
        for flag in _flag_names(word):
            if flag not in known and not passthrough:
                return f"`{' '.join(path)}` has no flag {flag} (it has: {', '.join(sorted(known))})"
            if flag in old:
                return f"`{' '.join(path)}` {flag} is the old spelling: write {old[flag]}"
        following = rest[i + 1] if i + 1 < len(rest) else None
        if (word == "--json" and _takes_old_json_file(parser) and following is not None
                and following not in STOP and not following.startswith(("-", "#"))):
            return f"`{' '.join(path)}` --json {following} is the old spelling: write --json-file {following}"
        if passthrough and not word.startswith("-") and word not in known:
            break  # the launcher's or the script's own arguments from here on
    return None


def _shell_lines(block: str) -> list[str]:
    return [line.strip() for line in re.sub(r"\\\n\s*", " ", block).splitlines() if line.strip()]


def mentions(page: Path) -> list[tuple[int, str, bool]]:
    """(line, the words after `shardkit`, whether the command must exist) for every place the
    page's code names shardkit, or a shardkit command followed by a flag."""
    text = page.read_text()
    root_commands = set(_subparsers(build_parser()))
    out: list[tuple[int, str, bool]] = []
    blocks = list(FENCE.finditer(text))
    for m in blocks:
        first = text.count("\n", 0, m.start(1)) + 1
        for offset, line in enumerate(m.group(1).splitlines()):
            if line.lstrip().startswith("#"):
                continue
            for words in _after_shardkit(line):
                out.append((first + offset, words, True))
    outside = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for m in INLINE.finditer(outside):
        line = outside.count("\n", 0, m.start()) + 1
        code = m.group(1).strip()
        found = _after_shardkit(code)
        if found:
            out += [(line, words, code.startswith("shardkit ")) for words in found]
        elif code.split(" ", 1)[0] in root_commands and "--" in code:
            out.append((line, code, False))  # `config zero3 --no-pin-memory`, `reshard --no-verify`
    return out


def _after_shardkit(line: str) -> list[str]:
    """The words after each `shardkit` word of a shell line (`python -m shardkit`, `srun ... shardkit`)."""
    toks = _tokens(line)
    found = []
    for i, tok in enumerate(toks):
        if tok == "shardkit" and (i == 0 or toks[i - 1] not in ("import", "from", "pip", "install")):
            found.append(shlex.join(toks[i + 1:]))
    return found


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return build_parser()


def test_every_page_names_only_commands_and_flags_the_parser_has(parser):
    problems, seen = [], 0
    for page in PAGES:
        for line, words, strict in mentions(page):
            seen += 1
            why = check(_tokens(words), parser, strict)
            if why:
                problems.append(f"{page.relative_to(REPO)}:{line}: {why}\n    {words}")
    assert seen >= 100, f"only {seen} shardkit mentions found: is the page scan broken?"
    assert not problems, "docs name commands or flags the parser lacks:\n" + "\n".join(problems)


@pytest.mark.parametrize("words, problem", [
    ("reshard ckpt --world-size 3 --frobnicate -o out", "`shardkit reshard` has no flag --frobnicate"),
    ("config fsdp --cpu-offload --no-such-thing", "`shardkit config fsdp` has no flag --no-such-thing"),
    ("reshrd ckpt --world-size 3", "has no command 'reshrd'"),
    ("config zero9 --world-size 2", "`shardkit config` has no command 'zero9'"),
])
def test_a_missing_flag_or_command_is_named(parser, words, problem):
    why = check(_tokens(words), parser, strict_command=True)
    assert why is not None and problem in why, why


@pytest.mark.parametrize("words, problem", [
    ("smoke --engine all --nproc 2 --steps 4", "`shardkit smoke` --nproc is the old spelling: write --world-size"),
    ("preflight ds.json --world-size 2 --json placement.json",
     "`shardkit preflight` --json placement.json is the old spelling: write --json-file placement.json"),
    ("verify ckpt --no-checksum", "`shardkit verify` --no-checksum is the old spelling: write --no-verify"),
])
def test_an_old_spelling_is_named_with_the_current_one(parser, words, problem):
    assert check(_tokens(words), parser, strict_command=True) == problem


@pytest.mark.parametrize("words", [
    "smoke --engine zero3 --json",
    "preflight ds.json --json --world-size 2",
    "preflight ds.json --json  # the report alone on stdout",
    "launch --launcher torchrun --standalone --nproc_per_node 2 train.py --deepspeed_config ds.json",
    "config zero3 --pin-memory/--no-pin-memory",
    "verify ckpt --world-size 8  # --not-a-flag in a comment",
    "smoke --help",
])
def test_launcher_arguments_comments_and_spelled_pairs_pass(parser, words):
    assert check(_tokens(words), parser, strict_command=True) is None


def test_a_page_with_an_unknown_inline_flag_fails(tmp_path, parser):
    page = tmp_path / "page.md"
    page.write_text("Use `reshard --no-such-flag` or\n\n```bash\nshardkit convert a --to fsdp2 --bogus -o b\n```\n")
    found = [check(_tokens(words), parser, strict) for _, words, strict in mentions(page)]
    assert [w is not None and w.split(" has ")[1].split(" (")[0] for w in found] == [
        "no flag --bogus", "no flag --no-such-flag"]


@pytest.mark.parametrize("flag, expected", [("--pin-memory", True), ("--no-pin-memory", False)])
def test_config_fsdp_takes_both_pin_memory_spellings(run_cli, flag, expected):
    # `config zero3` has --no-pin-memory; a script written for it must work for `config fsdp` too
    # (--accelerator: pinning needs one, and this machine may have none)
    code, out, err = run_cli("config", "fsdp", "--cpu-offload", flag, "--accelerator")
    assert code == 0, err
    assert json.loads(out)["fsdp"]["pin_memory"] is expected


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_pages_below_docs_link_to_files_and_headings_that_exist():
    # tests/test_readme_walkthrough.py checks the links of docs/*.md; the task pages live a level down
    problems = []
    pages = [p for p in PAGES if p.parent != REPO / "docs" and p != REPO / "README.md"]
    assert pages, "no pages below docs/ found"
    for page in pages:
        for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", FENCE.sub("", page.read_text())):
            if re.match(r"^[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                problems.append(f"{page.relative_to(REPO)}: link to a missing file: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                problems.append(f"{page.relative_to(REPO)}: link to a missing heading: {target}")
    assert not problems, "\n".join(problems)


def test_every_task_page_is_linked_from_the_docs_index():
    index = (REPO / "docs" / "README.md").read_text()
    tasks = {p.name for p in (REPO / "docs" / "tasks").glob("*.md")}
    assert tasks and tasks <= set(re.findall(r"\]\(tasks/([\w.-]+\.md)\)", index))
