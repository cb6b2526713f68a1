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
from shardkit.commands._parser import HelpFormatter, json_results, reset_renamed_notes
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
    parser = argparse.ArgumentParser(
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


def _terminate_as_interrupt() -> None:
    import signal

    def handler(signum: int, frame: object) -> None:
        raise Terminated()

    signal.signal(signal.SIGTERM, handler)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    reset_renamed_notes()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if getattr(args, "sigterm_cleans_up", False):
        _terminate_as_interrupt()
    forget_published()
    try:
        # every SHARDKIT_* variable judged before any work: a bad value refused naming it (exit 2),
        # not met hours later by the code that reads it; a name shardkit does not read warned about
        check_all()
        warn_unknown()
        # --json: the command's human lines go to stderr and its JSON result alone to stdout
        with json_results(args):
            return int(args.func(args) or 0)
    except Terminated:
        print(f"shardkit {args.command}: terminated (SIGTERM); {_outcome()}", file=sys.stderr)
        return 143
    except ShardkitError as exc:
        print(f"shardkit {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        # File access failures the commands did not anticipate (permissions, full disk, a special
        # file): one line naming the path, never a traceback.
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"shardkit {args.command}: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        done = published_outputs()
        print(f"shardkit {args.command}: interrupted{'; ' + _outcome() if done else ''}", file=sys.stderr)
        return 130


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
