"""The `shardkit` command: a thin shim. Each command lives in ``shardkit/commands/<name>.py`` and
exposes ``register(subparsers)``; the parsed args go to one plain function tests can call directly.

Exit codes: 0 clean, 1 findings or failure, 2 usage error, 130 Ctrl-C, 143 SIGTERM (docs/cli.md).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from typing import Sequence

import shardkit.commands as commands_pkg
from shardkit._version import __version__
from shardkit.commands._parser import CommandLineError, CommandParser, HelpFormatter, json_results, reset_renamed_notes
from shardkit.commands._result import ACTIVE, Ending, JsonRequest, command_of, json_request
from shardkit.core.env_settings import check_all, warn_unknown
from shardkit.core.errors import ShardkitError
from shardkit.storage.atomic import forget_published, published_outputs

EPILOG = """examples:
  shardkit smoke --engine all --world-size 2 --steps 4
  shardkit config zero3 --offload-optimizer cpu --offload-param cpu -o ds_config.json
  shardkit check ds_config.json --world-size 8
  shardkit preflight ds_config.json --world-size 2
"""


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="shardkit",
        description="Make DeepSpeed ZeRO and PyTorch FSDP training start right and resume right.",
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"shardkit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Commands are discovered, not listed, so each command module is the only file that knows it.
    for info in sorted(pkgutil.iter_modules(commands_pkg.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"shardkit.commands.{info.name}")
        module.register(sub)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's cancel, ``kill``, torchrun tearing down its workers) raised in the main
    thread, so the writers stop and the staging folder is removed as on Ctrl-C."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated()


def _terminate_as_interrupt() -> None:
    import signal

    signal.signal(signal.SIGTERM, _raise_terminated)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command line; the exit status. Under ``--json``/``--json-file`` every ending (the
    command's result, a usage or environment error, a refusal, a signal at any point) writes exactly
    one JSON object, and its ``exit_code`` is the status returned (shardkit/commands/_result.py)."""
    words = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
    reset_renamed_notes()
    ending = Ending(command_of(words), json_request(words))
    previous = _sigterm_handler()
    if ending.request.wanted and previous is not None:
        _terminate_as_interrupt()  # a SIGTERM at any point, the parse included, ends in the JSON object
    ACTIVE.append(ending)
    try:
        try:
            ending.code = _run(words, ending)
        except KeyboardInterrupt as exc:  # landed in _run's own ending, outside its try
            _stopped(ending, exc)
    finally:
        ACTIVE.remove(ending)
        _close(ending, previous)
    return ending.code


def _run(words: list[str], ending: Ending) -> int:
    name = ending.command or "shardkit"
    try:
        parser = build_parser()
        args = parser.parse_args(words)
        ending.bind(args)
        name = args.command or name
        if not getattr(args, "func", None):
            parser.print_help()
            ending.fail(2, "no command given: run shardkit COMMAND (shardkit --help lists them)")
            return 2
        if getattr(args, "sigterm_cleans_up", False):
            _terminate_as_interrupt()
        forget_published()
        # every SHARDKIT_* variable judged before any work: a bad value refused naming it (exit 2),
        # not met hours later by the code that reads it; a name shardkit does not read warned about
        check_all()
        warn_unknown()
        # --json: the command's human lines go to stderr and its JSON result alone to stdout
        with json_results(args):
            return int(args.func(args) or 0)
    except CommandLineError as exc:
        sys.stderr.write(exc.usage)
        print(f"{exc.prog}: error: {exc}", file=sys.stderr)
        ending.fail(2, f"{exc.prog}: {exc}", usage=" ".join(exc.usage.split()))
        return 2
    except SystemExit:  # --help or --version: their text is the whole answer, no result object follows it
        ending.request = JsonRequest()
        raise
    except KeyboardInterrupt as exc:
        return _stopped(ending, exc)
    except ShardkitError as exc:
        print(f"shardkit {name}: error: {exc}", file=sys.stderr)
        ending.fail(exc.exit_code, str(exc))
        return exc.exit_code
    except OSError as exc:
        # File access failures the commands did not anticipate (permissions, full disk, a special
        # file): one line naming the path, never a traceback.
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"shardkit {name}: error: {where}{exc.strerror or exc}", file=sys.stderr)
        ending.fail(1, f"{where}{exc.strerror or exc}")
        return 1
    except Exception as exc:  # a bug: its traceback follows on stderr, the JSON object still says it
        ending.fail(1, f"internal error: {type(exc).__name__}: {exc} (a shardkit bug: the traceback is on stderr)")
        raise


def _stopped(ending: Ending, exc: KeyboardInterrupt) -> int:
    """A SIGTERM (143) or Ctrl-C (130): one line on stderr saying what the command left."""
    name = ending.command or "shardkit"
    if isinstance(exc, Terminated):
        line = f"terminated (SIGTERM); {_outcome()}"
        code = 143
    else:
        line = f"interrupted{'; ' + _outcome() if published_outputs() else ''}"
        code = 130
    print(f"shardkit {name}: {line}", file=sys.stderr)
    ending.fail(code, line)
    ending.code = code
    return code


def _sigterm_handler() -> object:
    """SIGTERM's handler before this run (restored as it ends); None outside the main thread, where
    no handler can be set."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.getsignal(signal.SIGTERM)


def _close(ending: Ending, previous: object) -> None:
    """The run's last act, with SIGTERM and SIGINT held: a signal that arrived after the command's
    ending is folded into it (143/130) before the JSON object is written, the object is written once,
    and SIGTERM's handler is put back. Raising ``Terminated`` after main returned would land in the
    interpreter's shutdown ('Exception ignored in atexit callback', exit 0); put back, a later SIGTERM
    ends the process as it ends any program (status 143). Except where the command chose to ignore
    SIGTERM because its status is decided (a launch node whose ranks failed their preflight, exit 3,
    while the scheduler stops the job's other steps): that stays ignored until the process ends, since
    put back, a SIGTERM landing in the interpreter's exit turned the node's 3 into 143 (seen under load
    in the two-node Slurm test: the node printed its failure line, then Slurm recorded 143)."""
    import signal

    if previous is None or not hasattr(signal, "pthread_sigmask"):
        ending.write(sys.stdout)
        return
    hold = (signal.SIGTERM, signal.SIGINT)
    held = signal.pthread_sigmask(signal.SIG_BLOCK, hold)
    try:
        pending = signal.sigpending()
        for signum, exc in ((signal.SIGTERM, Terminated()), (signal.SIGINT, KeyboardInterrupt())):
            if signum in pending and signum not in held and signal.getsignal(signum) not in (signal.SIG_DFL, signal.SIG_IGN):
                signal.sigtimedwait([signum], 0)  # taken here, so it does not land after the object is written
                if ending.code not in (130, 143):
                    _stopped(ending, exc)
        ending.write(sys.stdout)
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:
            signal.signal(signal.SIGTERM, previous)  # type: ignore[arg-type]
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _outcome() -> str:
    """What a stopped command left: a signal can land after its output was put in place (or be held
    until its switch was done), and then saying nothing was published would send the user to redo it."""
    done = published_outputs()
    if done:
        return (f"it came after {', '.join(map(str, done))} was put in place: that output is complete (nothing "
                "need be run again for it); what the command does after publishing was not done")
    return ("nothing was published: the partial output (staging folder or temporary file) was removed, the "
            "previous output is unchanged")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
