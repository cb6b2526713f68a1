"""Turning reports into text for people: rich tables, colour only when stdout is a terminal."""

from __future__ import annotations

import json
from typing import Any, TextIO

from shardkit.core.findings import Report, Severity

_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "yellow", Severity.INFO: "cyan"}


def console(file: TextIO | None = None) -> Any:
    import sys

    from rich.console import Console

    # Rich assumes 80 columns when not on a terminal, folding key paths in pipes and CI logs: use a
    # wide fixed width there; on a terminal, its real width.
    target = file if file is not None else sys.stdout
    is_tty = bool(getattr(target, "isatty", lambda: False)())
    return Console(file=file, highlight=False, soft_wrap=False, width=None if is_tty else 160)


def print_report(report: Report, file: TextIO | None = None) -> None:
    """Print one finding per block: severity, key, value seen, why, fix; then a summary line."""
    con = console(file)
    if not report.findings:
        con.print(f"[green]ok[/green] {report.subject}: no findings")
        return
    from rich.table import Table

    table = Table(title=report.subject, show_lines=True, expand=False)
    for col in ("severity", "key", "value", "problem", "fix"):
        table.add_column(col, overflow="fold")
    for f in sorted(report.findings, key=lambda f: (f.severity is not Severity.ERROR, f.key)):
        table.add_row(
            f"[{_STYLE[f.severity]}]{f.severity.value}[/]",
            f.key,
            _short(f.value),
            f.message,
            f.fix,
        )
    con.print(table)
    con.print(f"{len(report.errors)} error(s), {len(report.warnings)} warning(s) in {report.subject}")


def write_json(data: Any, path: str | None, file: TextIO | None = None) -> None:
    """Write JSON to ``path`` or, when path is '-' or None, to ``file``/stdout."""
    text = json.dumps(data, indent=2, default=repr)
    if path and path != "-":
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    else:
        import sys

        (file or sys.stdout).write(text + "\n")


def _short(value: Any, limit: int = 60) -> str:
    s = json.dumps(value, default=repr) if not isinstance(value, str) else repr(value)
    return s if len(s) <= limit else s[: limit - 3] + "..."
