"""What every command module builds its parser with (the leading underscore keeps it out of command
discovery in shardkit/cli.py)."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keep the hand-wrapped examples in every epilog as written."""


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
