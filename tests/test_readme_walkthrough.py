"""The README's walkthrough, run as written, line by line: the documented commands chain (config ->
check -> preflight -> smoke -> verify -> reshard -> consolidate -> launch) and stay true. And the
docs pages (docs/*.md) stay true too: every command they show parses, the blocks marked
`# docs-test: run` run, and every file, module, import and link they name exists."""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import glob
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from shardkit.cli import build_parser

REPO = Path(__file__).resolve().parents[1]


def walkthrough_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Walkthrough", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README: the Walkthrough section has no bash block"
    return [ln.strip() for ln in block.group(1).splitlines() if ln.strip() and not ln.strip().startswith("#")]


def test_walkthrough_uses_every_command():
    used = {shlex.split(c)[1] for c in walkthrough_commands() if c.startswith("shardkit ")}
    assert {"config", "check", "versions", "preflight", "smoke", "verify", "reshard", "consolidate", "launch"} <= used


def test_walkthrough_starts_in_a_scratch_folder():
    # run from the checkout, it wrote ckpt/, model.safetensors and run*.json there (not ignored), and
    # a second run stopped at `smoke --keep-checkpoint ckpt` (the folder existed)
    first = walkthrough_commands()[0]
    assert re.fullmatch(r'repo=\$PWD && cd "\$\(mktemp -d\)"', first), first
    for line in walkthrough_commands()[1:]:
        for word in shlex.split(line):
            assert not re.match(r"(launch|tests|ds_configs|scripts)/", word), f"{word!r} in {line!r}: write $repo/{word}"


def _run_walkthrough(root: Path, env: dict[str, str]) -> tuple[Path, str]:
    """The block as one bash script from ``root``; (the scratch folder it made, its stdout)."""
    scratch = Path(env["TMPDIR"])
    before = set(scratch.iterdir())
    script = "trap 'echo \"README walkthrough line failed: $BASH_COMMAND\" >&2' ERR\n" + "\n".join(walkthrough_commands())
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=root, env=env, capture_output=True, text=True,
                       timeout=1800)
    assert r.returncode == 0, f"README walkthrough failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    made = {p for p in set(scratch.iterdir()) - before if p.name.startswith("tmp.")}  # mktemp's; torch adds its own
    assert len(made) == 1, f"the walkthrough should make one scratch folder, made {sorted(made)}"
    return made.pop(), r.stdout


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_readme_walkthrough_runs_top_to_bottom_and_writes_only_its_scratch_folder(tmp_path):
    # The walkthrough starts "from the repository root": give it the paths it names, and nothing of
    # the checkout it could write into. It once ran in the checkout and a second run stopped at `smoke
    # --keep-checkpoint ckpt` (the first run's folder existed); it was then run twice here (216 s each
    # under load, the suite's longest test). What the second run caught is a write outside the run's own
    # scratch folder, which is asserted directly: the checkout stand-in is untouched and the run made
    # one scratch folder, so a rerun starts from nothing the first left.
    root = tmp_path / "root"
    root.mkdir()
    for name in ("launch", "tests"):
        (root / name).symlink_to(REPO / name)
    bin_dir, scratch = tmp_path / "bin", tmp_path / "tmp"
    bin_dir.mkdir()
    scratch.mkdir()
    (bin_dir / "shardkit").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m shardkit "$@"\n')
    (bin_dir / "shardkit").chmod(0o755)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO), "TMPDIR": str(scratch),
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    folder, out = _run_walkthrough(root, env)
    assert "no findings" in out, out[-3000:]
    assert (folder / "ckpt" / "latest").is_file() and (folder / "ckpt_ws3" / "latest").is_file()
    assert (folder / "model.safetensors").stat().st_size > 0
    assert {"after_init", "after_step"} <= set(json.loads((folder / "run.json").read_text()))
    assert sorted(p.name for p in root.iterdir()) == ["launch", "tests"], "the walkthrough wrote into the checkout"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "root", "tmp"], "the walkthrough wrote beside its scratch folder"


# --- the docs pages: every command a page shows parses, and the blocks that say so run ----------------
#
# What a page's ```bash block may hold, and what this test does with each line:
# - `shardkit <command> ...`: parsed by the real parser (shardkit.cli.build_parser), so the command
#   exists and every flag, choice and number parses; `shardkit launch` lines' launcher part is parsed
#   by that launcher's own parser (torchrun, deepspeed, accelerate launch).
# - a block whose first line is `# docs-test: run` is also run, in order, in a temp dir holding
#   ds_configs/, tests/ and launch/ (as the walkthrough is); a line's `# exit N` comment is its exit
#   code (default 0). Such blocks hold cheap shardkit commands and `cat > FILE <<'EOF'` files.
# - other tools are not run (OTHER_TOOLS says why); the repository files they name must exist, and
#   the variables set in front of a repository script must be ones that script reads.
# Every page's repository paths, dotted `shardkit.` names, Python imports and links must exist too.

DOCS = REPO / "docs"
RUN_MARK = "# docs-test: run"

OTHER_TOOLS = {
    "pytest": "the test runner: the suite itself",
    "sbatch": "needs a Slurm cluster (tests/test_slurm.py submits the template to a real one)",
    "cat": "shell: shows a job's output (or writes a heredoc file, which run blocks do)",
    "eval": "shell: evaluates the output of a repository script (its path is checked)",
    "cd": "shell: the README walkthrough moves into a scratch folder (the walkthrough test runs it)",
}
REPO_PATH = re.compile(r"(?<![\w./-])((?:launch|scripts|ds_configs|tests|benchmarks|docs|shardkit|\.ci)/[\w./*-]*)")
DOTTED = re.compile(r"(?<![\w./-])(shardkit(?:\.[A-Za-z_]\w*)+)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def doc_pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


class DocCommand(NamedTuple):
    where: str  # page:line
    text: str  # continuation lines joined, comment kept
    run: bool  # inside a `# docs-test: run` block
    heredoc: str | None  # the body of a `<<'EOF'` on this line


def fenced_blocks(text: str, lang: str) -> list[tuple[int, list[str]]]:
    """(line number of the block's first line, its lines) of every ```lang block."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            if lines[i][3:].strip() == lang:
                blocks.append((i + 2, lines[i + 1 : j]))
            i = j
        i += 1
    return blocks


def doc_commands(page: Path) -> list[DocCommand]:
    out = []
    for first, body in fenced_blocks(page.read_text(), "bash"):
        run = bool(body) and body[0].strip() == RUN_MARK
        k = 0
        while k < len(body):
            where, line = f"{_rel(page)}:{first + k}", body[k]
            k += 1
            while line.rstrip().endswith("\\") and k < len(body):
                line = line.rstrip()[:-1] + " " + body[k].strip()
                k += 1
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            heredoc = None
            m = re.search(r"<<-?\s*'?(\w+)'?", line)
            if m:
                end = body.index(m.group(1), k)
                heredoc, k = "\n".join(body[k:end]) + "\n", end + 1
            out.append(DocCommand(where, line.strip(), run, heredoc))
    return out


def simple_commands(text: str) -> list[tuple[dict[str, str], list[str]]]:
    """A shell line as its simple commands: (variables set in front, argv), redirections dropped."""
    lex = shlex.shlex(text, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    out: list[tuple[dict[str, str], list[str]]] = [({}, [])]
    tokens = iter(lex)
    for tok in tokens:
        env, argv = out[-1]
        if tok in ("&&", "||", ";", "|", "&"):
            out.append(({}, []))
        elif tok in (">", ">>", "<", "<<", "<<-"):
            next(tokens)  # the redirection's target (or the heredoc's delimiter)
        elif not argv and re.match(r"^[A-Za-z_]\w*=", tok):
            env[tok.partition("=")[0]] = tok.partition("=")[2]
        else:
            argv.append(tok)
    return [(e, a) for e, a in out if a]


def _no_abbreviations(parser: Any) -> Any:
    """A page must spell every flag in full: argparse would take `--world-siz` for `--world-size`."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _no_abbreviations(sub)
    return parser


@functools.cache
def _shardkit_parser() -> argparse.ArgumentParser:
    return _no_abbreviations(build_parser())


def shardkit_parse(argv: list[str]) -> tuple[str | None, Any]:
    """(error or None, namespace) of `shardkit ARGV` through the real parser."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            ns = _shardkit_parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code == 0:  # --help
            return None, None
        return (err.getvalue().strip().splitlines() or ["parse error"])[-1], None
    if not getattr(ns, "func", None):
        return "names no command", None
    return None, ns


def check_repo_paths(text: str) -> list[str]:
    paths = (p.rstrip(".") for p in REPO_PATH.findall(text))
    return [f"no such file in the repository: {p}" for p in paths if not glob.glob(str(REPO / p))]


def _top_level_names(path: Path) -> dict[str, ast.AST]:
    """The names a module defines at its top level (shardkit/__init__.py: its lazy public API too)."""
    names: dict[str, ast.AST] = {}

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.If, ast.Try)):
                visit(node.body + node.orelse)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for n in (n for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)):
                    names[n.id] = node
                    if n.id == "_LAZY" and isinstance(node.value, ast.Dict):
                        names.update({k.value: node for k in node.value.keys if isinstance(k, ast.Constant)})

    visit(ast.parse(path.read_text()).body)
    return names


def resolve_dotted(name: str) -> str | None:
    """None when `name` is a shardkit module or a name defined in one (read, not imported), else why not."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:i])
        module_file = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if module_file.is_file():
            break
    else:
        return f"{name}: no such module"
    rest = parts[i:]
    if not rest:  # a module
        return None
    if rest[0] not in _top_level_names(module_file):
        return f"{name}: {'.'.join(parts[:i])} defines no {rest[0]}"
    return None


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def check_command(cmd: DocCommand, launcher_lines: list[tuple[str, str, list[str]]]) -> list[str]:
    problems = check_repo_paths(cmd.text)
    for env, argv in simple_commands(cmd.text):
        prog = argv[0]
        if prog in ("python", "python3") and argv[1:3] == ["-m", "shardkit"]:
            prog, argv = "shardkit", ["shardkit", *argv[3:]]
        if prog in ("srun", "torchrun") and "shardkit" in argv:
            # a shardkit command run once per task/process (reshard's share per process): the
            # launcher needs a cluster; the shardkit command after it must parse
            at = argv.index("shardkit")
            if prog == "torchrun" and argv[at - 1] != "-m":
                problems.append(f"`{' '.join(argv)}`: torchrun runs a module with -m shardkit")
            prog, argv = "shardkit", argv[at:]
        if prog == "shardkit":
            err, ns = shardkit_parse(argv[1:])
            if err:
                problems.append(f"`shardkit {' '.join(argv[1:])}`: {err}")
            elif ns is not None and ns.command == "launch":
                launcher_lines.append((cmd.where, ns.launcher, ns.argv))
            continue
        if prog in ("python", "python3"):
            script = argv[1] if len(argv) > 1 else ""
        elif prog == "sbatch":
            script = next((a for a in argv if a.endswith(".sbatch")), "")
        elif prog in OTHER_TOOLS:
            continue
        else:
            script = prog
        path = REPO / script.removeprefix("./")
        if not (script and path.is_file()):
            problems.append(f"`{prog}`: not shardkit, a repository script or one of OTHER_TOOLS (say why not run)")
            continue
        if script == prog and not os.access(path, os.X_OK):
            problems.append(f"{script} is not executable")
        source = path.read_text()
        for name in env:
            if f"${name}" not in source and "${" + name not in source:
                problems.append(f"{name}= is set for {script}, which never reads ${name}")
    return [f"{cmd.where}: {p}\n    {cmd.text}" for p in problems]


@pytest.mark.slow
def test_docs_pages_commands_name_real_commands_and_flags():
    problems: list[str] = []
    launcher_lines: list[tuple[str, str, list[str]]] = []
    parsed = 0
    for page in [REPO / "README.md", *doc_pages()]:
        for cmd in doc_commands(page):
            problems += check_command(cmd, launcher_lines)
            parsed += sum(1 for _, argv in simple_commands(cmd.text) if argv[0] == "shardkit")
    assert parsed >= 50, f"only {parsed} shardkit lines found in README.md and docs/*.md"
    assert launcher_lines, "no `shardkit launch` line found"
    # The launcher part of `shardkit launch` lines goes to the real launcher untouched: its own parser
    # must accept it (one process; importing torch, deepspeed and accelerate takes a few seconds).
    code = (
        "import argparse, contextlib, functools, io, json, sys\n"
        "# every flag spelled in full, as for shardkit's parser\n"
        "P = argparse.ArgumentParser; P.__init__ = functools.partialmethod(P.__init__, allow_abbrev=False)\n"
        "def parser(name):\n"
        "    if name == 'torchrun':\n"
        "        from torch.distributed.run import get_args_parser; return get_args_parser().parse_args\n"
        "    if name == 'deepspeed':\n"
        "        from deepspeed.launcher.runner import parse_args; return parse_args\n"
        "    from accelerate.commands.launch import launch_command_parser; return launch_command_parser().parse_args\n"
        "out = []\n"
        "for where, name, argv in json.loads(sys.argv[1]):\n"
        "    err = io.StringIO()\n"
        "    try:\n"
        "        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):\n"
        "            parser(name)(argv)\n"
        "    except SystemExit:\n"
        "        out.append(f'{where}: {name} refuses {argv}: ' + (err.getvalue().strip().splitlines() or ['?'])[-1])\n"
        "print('DOCS-TEST ' + json.dumps(out))\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", code, json.dumps(launcher_lines)], capture_output=True, text=True,
                       env=env, timeout=300)
    marker = [ln for ln in r.stdout.splitlines() if ln.startswith("DOCS-TEST ")]
    assert marker, r.stdout[-2000:] + r.stderr[-3000:]
    problems += json.loads(marker[-1][len("DOCS-TEST "):])
    assert not problems, "docs commands that do not parse:\n" + "\n".join(problems)


def test_docs_pages_name_real_files_modules_and_links():
    problems: list[str] = []
    for page in [REPO / "README.md", *doc_pages()]:
        text = page.read_text()
        problems += [f"{_rel(page)}: {p}" for p in check_repo_paths(text)]
        for name in sorted(set(DOTTED.findall(text))):
            why = resolve_dotted(name.rstrip("."))
            if why:
                problems.append(f"{_rel(page)}: {why}")
        for first, body in fenced_blocks(text, "python"):
            for node in ast.walk(ast.parse("\n".join(body))):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shardkit"):
                    for alias in node.names:
                        why = resolve_dotted(f"{node.module}.{alias.name}")
                        if why:
                            problems.append(f"{_rel(page)}:{first}: {why}")
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                problems.append(f"{_rel(page)}: link to a missing file: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                problems.append(f"{_rel(page)}: link to a missing heading: {target}")
    assert not problems, "\n".join(problems)


RUN_PAGES = [p for p in doc_pages() if any(c.run for c in doc_commands(p))]

RUN_DRIVER = r"""
import contextlib, io, json, sys
from shardkit.cli import main
results = []
for step in json.loads(sys.argv[1]):
    if "write" in step:
        with open(step["write"], "w") as f:
            f.write(step["text"])
        results.append({"rc": 0, "out": ""})
        continue
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            rc = main(step["argv"])
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
    results.append({"rc": rc, "out": out.getvalue()[-3000:]})
print("DOCS-TEST " + json.dumps(results))
"""


def test_docs_have_run_blocks():
    assert {"configs.md", "versions.md", "preflight.md", "launch.md"} <= {p.name for p in RUN_PAGES}


@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda p: p.name)
@pytest.mark.slow
def test_docs_run_blocks_run(page, tmp_path):
    # One process per page runs its blocks' commands in order through shardkit.cli.main (what
    # `shardkit` runs), so torch and deepspeed are imported once, not once a line.
    steps, lines = [], []
    for cmd in doc_commands(page):
        if not cmd.run:
            continue
        (env, argv), *more = simple_commands(cmd.text)
        if cmd.heredoc is not None and argv[0] == "cat" and not env and not more:
            target = re.search(r">\s*(\S+)", cmd.text)
            assert target, f"{cmd.where}: a heredoc in a run block must be `cat > FILE <<'EOF'`"
            steps.append({"write": target.group(1), "text": cmd.heredoc})
        else:
            assert argv[0] == "shardkit" and not env and not more, (
                f"{cmd.where}: a `{RUN_MARK}` block runs shardkit commands only: {cmd.text}")
            steps.append({"argv": argv[1:]})
        expected = re.search(r"\s#\s*exit (\d+)\b", cmd.text)
        lines.append((cmd, int(expected.group(1)) if expected else 0))
    for name in ("ds_configs", "tests", "launch"):
        (tmp_path / name).symlink_to(REPO / name)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", RUN_DRIVER, json.dumps(steps)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    marker = [ln for ln in r.stdout.splitlines() if ln.startswith("DOCS-TEST ")]
    assert marker, f"the {page.name} run blocks did not finish:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    for (cmd, expected), result in zip(lines, json.loads(marker[-1][len("DOCS-TEST "):])):
        assert result["rc"] == expected, (
            f"{cmd.where}: exit {result['rc']}, the page says {expected}: {cmd.text}\n{result['out']}")
        assert "no findings" not in cmd.text or "no findings" in result["out"], f"{cmd.where}: {result['out']}"


def test_readme_test_command_is_the_one_ci_runs():
    text = (REPO / "README.md").read_text()
    setup = text.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    command = "./install.sh test && pytest -n 2"
    assert command in [ln.strip() for _, body in fenced_blocks(setup, "bash") for ln in body]
    assert command in (REPO / ".ci" / "run").read_text().splitlines()


def test_readme_is_a_front_page_linking_every_docs_page():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) < 200, "README.md is the front page: the guides live in docs/"
    pages = {p.name for p in doc_pages()}
    assert pages <= set(re.findall(r"\]\(docs/([\w.-]+\.md)", text)), "README.md must link every docs page"
    index = (DOCS / "README.md").read_text()
    assert pages - {"README.md"} <= set(re.findall(r"\]\(([\w.-]+\.md)", index)), "docs/README.md must link every page"


def test_architecture_picture_is_the_import_graph_layers():
    spec = importlib.util.spec_from_file_location("import_graph", REPO / "scripts" / "import_graph.py")
    assert spec and spec.loader, "scripts/import_graph.py"
    graph = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(graph)
    text = (DOCS / "architecture.md").read_text()
    picture = next(body for _, body in fenced_blocks(text, "") if any("shardkit.core" in ln for ln in body))
    drawn: dict[int, list[str]] = {}
    order: list[int] = []
    current: int | None = None
    for line in picture:
        m = re.match(r"^\s*(\d+)?\s*\|([^|]*)\|", line)
        if not m:
            continue
        if m.group(1):
            current = int(m.group(1))
            order.append(current)
            drawn[current] = []
        if current is not None:
            drawn[current] += m.group(2).split()
    assert order == list(range(len(graph.LAYERS) - 1, -1, -1)), "the picture draws the layers top to bottom"
    assert drawn == {i: list(prefixes) for i, prefixes in enumerate(graph.LAYERS)}
