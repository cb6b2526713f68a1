"""How `shardkit smoke` shows where it is: a rich progress bar per engine on a terminal, one line
per stage on stderr elsewhere (logs, CI), nothing with ``--quiet``."""

from __future__ import annotations

import sys
import time
from typing import Any

from shardkit.core.render import console


class _Progress:
    """A rich progress bar per engine (A, B, C, compare) on a terminal; elsewhere (logs, CI) one
    line per stage on stderr, since a bar is never drawn there; nothing when ``show`` is False."""

    def __init__(self, show: bool, plain: bool | None = None) -> None:
        self._p = None
        # stderr, like every progress display: stdout carries the report (and --json's result alone)
        self._plain = show and (plain if plain is not None else not sys.stderr.isatty())
        self._said: dict[str, str] = {}
        self._start = time.monotonic()
        if show and not self._plain:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._p = Progress(
                TextColumn("{task.fields[engine]:<6}"),
                BarColumn(bar_width=20),
                TextColumn("{task.description}"),
                TimeElapsedColumn(),
                console=console(sys.stderr),
                transient=False,
            )

    def __enter__(self) -> "_Progress":
        if self._p is not None:
            self._p.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._p is not None:
            self._p.__exit__(*exc)

    def task(self, engine: str, total: int = 4) -> Any:
        if self._plain:
            return engine
        return self._p.add_task("starting", total=total, engine=engine) if self._p is not None else None

    def update(self, task: Any, description: str, advance: int = 0) -> None:
        if self._plain and self._said.get(task) != description:
            self._said[task] = description
            print(f"[{time.monotonic() - self._start:6.1f}s] {task}: {description}", file=sys.stderr, flush=True)
        if self._p is not None:
            self._p.update(task, description=description, advance=advance)
