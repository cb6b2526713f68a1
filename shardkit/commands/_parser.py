"""What every command module builds its parser with (the leading underscore keeps it out of command
discovery in shardkit/cli.py): the shared flags, defined once so no command can spell them
differently, and the old spellings kept as aliases that say once, on stderr, what replaced them.

The vocabulary (docs/cli.md, "Commands"):

- ``--json``: the result as JSON alone on stdout (every human line goes to stderr);
  ``--json-file PATH``: the same JSON written to PATH. ``smoke`` and ``preflight`` once took
  ``--json FILE``: a path after ``--json`` there still works, as ``--json-file``, with a note.
- ``--world-size N``: how many ranks (``--nproc`` is its old spelling on smoke and preflight).
- ``--engine``: ``zero2``, ``zero3``, ``fsdp2``, ``torch``, ``all`` (each command takes its subset;
  ``fsdp`` and ``deepspeed`` are old spellings of ``fsdp2`` and ``zero3``).
- ``--no-verify``: sizes only, no content digests (verify's ``--no-checksum`` is its old spelling).
- ``--model``: ``llama:SIZE`` or ``pkg.module:factory`` where a model is built (smoke's bare size is
  the old spelling of ``llama:SIZE``); estimate and ``config --fit`` read a model's config instead
  (a config.json, a folder holding one, or a hub id).
- ``--timeout S``: a hard limit on a run; a wait for a late rank is ``--rank-wait S``.
- ``--dry-run``: the run's own checks (the run stopped before its first write, ``storage.dry_run``), then
  the plan; nothing written. ``--quiet``: no progress display.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, NoReturn, Sequence, TextIO

from shardkit.core.errors import UsageError


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keep the hand-wrapped examples in every epilog as written."""


class CommandLineError(UsageError):
    """argparse's refusal of a command line (a missing or unknown argument, a value of the wrong type),
    raised instead of argparse's own exit so shardkit.cli.main ends it as every other failure: the
    usage and the message on stderr, exit 2, and under ``--json`` the one JSON object on stdout."""

    def __init__(self, message: str, usage: str, prog: str):
        super().__init__(message)
        self.usage, self.prog = usage, prog


class CommandParser(argparse.ArgumentParser):
    """The parser of ``shardkit`` and of every command (``add_subparsers`` gives each subparser its
    parent's class): inside shardkit.cli.main its errors are raised as :class:`CommandLineError`, not
    printed and exited on; elsewhere (a tool walking ``build_parser()``) argparse's own exit stands."""

    def error(self, message: str) -> NoReturn:
        from shardkit.commands._result import ACTIVE

        if ACTIVE:
            raise CommandLineError(message, self.format_usage(), self.prog)
        super().error(message)


def add_command(
    sub: argparse._SubParsersAction, name: str, help: str, example: str, description: str | None = None
) -> argparse.ArgumentParser:
    """Create a subcommand parser whose --help ends with a worked example."""
    return sub.add_parser(
        name,
        help=help,
        description=description or help,
        epilog=f"example:\n  {example}",
        formatter_class=HelpFormatter,
    )


# --- old spellings -----------------------------------------------------------------------------

_NOTED: set[str] = set()


def reset_renamed_notes() -> None:
    """Each command run says each note once (main() runs in-process more than once in tests and tools)."""
    _NOTED.clear()


def note_renamed(old: str, new: str) -> None:
    """Say once per process, on stderr, that ``old`` is now spelled ``new`` (the old one still works)."""
    if old in _NOTED:
        return
    _NOTED.add(old)
    print(f"shardkit: note: {old} is now {new}; the old spelling still works, but scripts should use {new}",
          file=sys.stderr, flush=True)


def alias_action(new: str) -> type[argparse.Action]:
    """A store action for an old flag: notes the new name, stores into the new flag's dest (for a
    flag one command renames; the shared ones below carry their old spellings themselves)."""

    class _Alias(argparse._StoreAction):
        def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                     option_string: str | None = None) -> None:
            note_renamed(option_string or self.option_strings[0], new)
            setattr(namespace, self.dest, values)

    return _Alias


def _alias_true_action(new: str) -> type[argparse.Action]:
    class _AliasTrue(argparse._StoreTrueAction):
        def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                     option_string: str | None = None) -> None:
            note_renamed(option_string or self.option_strings[0], new)
            setattr(namespace, self.dest, True)

    return _AliasTrue


# --- the shared flags ---------------------------------------------------------------------------

def add_json(p: argparse.ArgumentParser, *, file_after_json: bool = False) -> None:
    """``--json`` (JSON alone on stdout) and ``--json-file PATH``. ``file_after_json``: the command once
    took ``--json FILE`` (smoke, preflight): ``--json -`` is ``--json``, ``--json PATH`` is
    ``--json-file PATH`` with a note."""
    if file_after_json:
        p.add_argument("--json", nargs="?", const="-", default=None, metavar="-", action=_LegacyJson,
                       help="print the result as JSON alone on stdout (human text on stderr); '--json FILE' is the old "
                            "spelling of --json-file FILE")
    else:
        p.add_argument("--json", action="store_true", default=False,
                       help="print the result as JSON alone on stdout (human text goes to stderr)")
    p.add_argument("--json-file", default=None, metavar="PATH", help="also write the result as JSON to PATH")


class _LegacyJson(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if values in (None, "-"):
            namespace.json = True
            return
        note_renamed(f"--json {values}", f"--json-file {values}")
        namespace.json = False
        namespace.json_file = values


def add_world_size(p: argparse.ArgumentParser, help: str, *, required: bool = False, default: int | None = None,
                   nproc_alias: bool = False, metavar: str = "N") -> None:
    """``--world-size N``; ``nproc_alias``: the command once spelled it ``--nproc``."""
    target: Any = p.add_mutually_exclusive_group(required=True) if required and nproc_alias else p
    target.add_argument("--world-size", type=int, default=default, required=required and not nproc_alias,
                        metavar=metavar, help=help)
    if nproc_alias:
        target.add_argument("--nproc", dest="world_size", type=int, metavar=metavar, action=alias_action("--world-size"),
                            help="old spelling of --world-size")


def add_no_verify(p: argparse.ArgumentParser, help: str | None = None, *, no_checksum_alias: bool = False) -> None:
    p.add_argument("--no-verify", action="store_true", dest="no_verify",
                   help=help or "check only the sizes of the source's files against its manifest, not their content "
                                "digests (faster)")
    if no_checksum_alias:
        p.add_argument("--no-checksum", dest="no_verify", action=_alias_true_action("--no-verify"),
                       help="old spelling of --no-verify")


def add_dry_run(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (what is read, where it would be written, by how many processes) and write nothing")


def add_quiet(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true",
                   help="no progress display (on a terminal: no live bar; otherwise: no progress lines on stderr)")


#: The one --engine vocabulary; each command takes the subset it can act on.
ENGINES = ("zero2", "zero3", "fsdp2", "torch", "all")
_ENGINE_ALIASES = {"fsdp": "fsdp2", "deepspeed": "zero3"}


def add_engine(p: argparse.ArgumentParser, choices: Sequence[str], help: str, *, default: str | None = None) -> None:
    unknown = set(choices) - set(ENGINES)
    if unknown:  # a programming error: a command inventing its own engine name
        raise ValueError(f"--engine choices {sorted(unknown)} are not in the shared vocabulary {ENGINES}")
    olds = {old: new for old, new in _ENGINE_ALIASES.items() if new in choices}

    def engine(value: str) -> str:
        if value in olds:
            note_renamed(f"--engine {value}", f"--engine {olds[value]}")
            return olds[value]
        return value

    p.add_argument("--engine", type=engine, choices=list(choices), default=default, help=help)


#: What --model means wherever a model is built.
MODEL_SPEC_HELP = "llama:SIZE (tiny, small, 40m, 160m) or pkg.module:factory"
LLAMA_SIZES = ("tiny", "small", "40m", "160m")


def llama_size(value: str) -> str:
    """smoke's ``--model``: ``llama:SIZE`` (the bare size is its old spelling)."""
    if value.startswith("llama:") and value[len("llama:"):] in LLAMA_SIZES:
        return value[len("llama:"):]
    if value in LLAMA_SIZES:
        note_renamed(f"--model {value}", f"--model llama:{value}")
        return value
    raise argparse.ArgumentTypeError(f"{value!r}: smoke builds Llama models only: llama:SIZE with SIZE one of "
                                     f"{', '.join(LLAMA_SIZES)}")


# --- JSON results -------------------------------------------------------------------------------

_REAL_STDOUT: list[TextIO] = []


@contextmanager
def json_results(args: argparse.Namespace) -> Iterator[None]:
    """Around a command: with ``--json`` every line the command prints goes to stderr, so stdout holds
    the JSON alone (``emit_json`` writes it there). A ShardkitError under ``--json``/``--json-file``
    still gives a JSON result (``ok: false`` and the message); inside shardkit.cli.main the run's one
    object says it instead (shardkit/commands/_result.py)."""
    from contextlib import redirect_stdout

    from shardkit.core.errors import ShardkitError

    wants = bool(getattr(args, "json", False)) or bool(getattr(args, "json_file", None))
    if not wants:
        yield
        return
    from shardkit.commands._result import ACTIVE

    _REAL_STDOUT.append(sys.stdout)
    try:
        if getattr(args, "json", False):
            with redirect_stdout(sys.stderr):
                yield
        else:
            yield
    except (ShardkitError, OSError, KeyboardInterrupt) as exc:
        # inside shardkit.cli.main the run's one object says it (written as main ends)
        if not ACTIVE and not getattr(args, "json_emitted", False):
            emit_json(args, {"command": args.command, "ok": False, "exit_code": _exit_code(exc), "error": _one_line(exc)})
        raise
    finally:
        _REAL_STDOUT.pop()


def _exit_code(exc: BaseException) -> int:
    """The code shardkit.cli.main returns for ``exc`` (130 Ctrl-C, 143 its SIGTERM exception)."""
    if isinstance(exc, KeyboardInterrupt):
        return 143 if type(exc).__name__ == "Terminated" else 130
    return int(getattr(exc, "exit_code", 1))


def _one_line(exc: BaseException) -> str:
    """What shardkit.cli.main prints after 'error: ' for ``exc``."""
    if isinstance(exc, KeyboardInterrupt):
        return "terminated (SIGTERM)" if type(exc).__name__ == "Terminated" else "interrupted"
    if isinstance(exc, OSError) and not hasattr(exc, "exit_code"):
        where = f"{exc.filename}: " if exc.filename else ""
        return f"{where}{exc.strerror or exc}"
    return str(exc)


def emit_json(args: argparse.Namespace, data: dict[str, Any]) -> None:
    """Write ``data`` as the command's JSON result: to stdout with ``--json``, to PATH with ``--json-file``."""
    from shardkit.commands._result import ACTIVE

    args.json_emitted = True
    if ACTIVE:  # inside shardkit.cli.main: held, and written once as the run ends (commands/_result.py)
        ACTIVE[-1].result = data
        return
    text = json.dumps(data, indent=2, default=_plain) + "\n"
    if getattr(args, "json", False):
        out = _REAL_STDOUT[-1] if _REAL_STDOUT else sys.stdout
        out.write(text)
        out.flush()
    path = getattr(args, "json_file", None)
    if path:
        _write_atomically(path, text)


def _write_atomically(path: str, text: str) -> None:
    """A reader polling PATH never sees half a result: written beside it, then renamed."""
    if path == "-":
        (_REAL_STDOUT[-1] if _REAL_STDOUT else sys.stdout).write(text)
        return
    from shardkit.storage.atomic import atomic_write_text  # removes its temporary whatever stops it, a SIGTERM too

    atomic_write_text(path, text)


def _plain(value: Any) -> Any:
    import os

    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return repr(value)


class Stopwatch:
    """Seconds since the command started, for every result's ``seconds`` field."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock, self._start = clock, clock()

    @property
    def seconds(self) -> float:
        return round(self._clock() - self._start, 3)
