"""Bytes done of the total, the rate and the time left, for every command that moves checkpoint bytes.

The byte loops (``storage``'s hashing writer, ``copy_bytes``, the export and consolidate cast
writes) call one function, :func:`advance`, with the planned bytes they just wrote (tensor data, a
whole file copied); the operations say how many they plan to write with :func:`expect` once they
know. Bytes no plan can count before they exist (zip headers and directories, pickles, a DCP
``.metadata``) go through :func:`grow`, which adds them to the total and to the bytes done alike, so
the bytes done never pass the total ("1.8 MiB of 1.7 MiB" was every such byte counted as done and
none expected). All three cost one attribute read when no command is reporting (a library call, a
test, a rank of a training run), so the writers need no option threaded through them.

What the user reads is one sentence, :func:`describe`, on a terminal and in a log alike: bytes done
of the total in binary units (KiB, MiB, GiB), the percentage, the rate in the same units per second
(MiB/s), the time left while running, and at the end the time taken (``done after 12 s``, or
``stopped after``) in place of the time left.

A command turns reporting on around its work with :func:`reporting`: a live rich bar on a terminal,
a plain line every ``interval`` seconds otherwise (a Slurm log, a pipe), one closing line, nothing
with ``quiet``. Always on stderr: stdout carries ``--json``. Under srun/torchrun only the process
with rank 0 reports, for the whole job: the other processes' counts come from the heartbeat files
the shared save already writes (``shared_save.heartbeat`` puts :func:`counts` in them, rank 0's
heartbeat registers their reader with :func:`watch_peers`); until every process has beaten once, or
where there are no heartbeat files, rank 0's own share times the number of processes stands in (the
shares are split by bytes, so they advance at about the same pace). The line says which.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, TextIO

#: Seconds between two plain progress lines (a log line every few seconds is read; more is noise).
PLAIN_INTERVAL_S = 5.0


class ByteProgress:
    """Thread-safe count of bytes written against an expected total (None: not known yet)."""

    def __init__(self, label: str, *, processes: int = 1, clock: Callable[[], float] = time.monotonic):
        self.label, self.processes, self.clock = label, max(1, processes), clock
        self.started = clock()
        self._done, self._total = 0, 0
        self._lock = threading.Lock()
        self.peers: Callable[[], list[tuple[int, int]]] | None = None
        """The other processes' (bytes written, bytes expected), as their heartbeat files last said."""
        self._peers_read: tuple[float, list[tuple[int, int]]] | None = None
        self.outcome: str | None = None
        """None while running; "done" or "stopped" once the command's work ended (set by :func:`reporting`)."""

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self._done += nbytes

    def expect(self, nbytes: int) -> None:
        with self._lock:
            self._total += nbytes

    def grow(self, nbytes: int) -> None:
        """Bytes written that no plan counted: done and total grow together."""
        with self._lock:
            self._done += nbytes
            self._total += nbytes

    @property
    def done(self) -> int:
        """Bytes of the whole job written so far (see ``job``)."""
        return self.job()[0]

    @property
    def total(self) -> int | None:
        return self.job()[1] or None

    def job(self) -> tuple[int, int, str]:
        """(done, expected, how it is known) for the whole job: this process's own counts alone; under
        a launcher, summed with every other process's heartbeat, or scaled up from the processes heard so far."""
        if self.processes == 1:
            return self._done, self._total, ""
        peers = self._peer_counts()
        heard = 1 + len(peers)
        done, total = self._done + sum(d for d, _ in peers), self._total + sum(t for _, t in peers)
        if heard >= self.processes:
            return done, total, f" (all {self.processes} processes, from their heartbeat files)"
        scale = self.processes / heard
        how = (f"this process's share x {self.processes}" if heard == 1 else
               f"the {heard} processes heard from so far, scaled to {self.processes}")
        return int(done * scale), int(total * scale), f" (estimated for {self.processes} processes: {how})"

    def _peer_counts(self) -> list[tuple[int, int]]:
        # read at most every 2 s: the live bar asks 5 times a second, and a thousand heartbeat files on
        # a shared filesystem are not free
        if self.peers is None:
            return []
        now = self.clock()
        if self._peers_read is None or now - self._peers_read[0] >= 2.0:
            self._peers_read = (now, self.peers())
        return self._peers_read[1]

    def figures(self) -> str:
        """:func:`describe` of the whole job now: what the live bar shows after its label and bar."""
        done, expected, how = self.job()
        return describe(done, expected or None, self.clock() - self.started, outcome=self.outcome) + how

    def line(self) -> str:
        """``label: 1.2 GiB of 4.0 GiB (30%), 310.0 MiB/s, 9 s left``: what a plain progress line says."""
        return f"{self.label}: {self.figures()}"


def describe(done: int, total: int | None, elapsed: float, *, outcome: str | None = None) -> str:
    """The progress contract, the one sentence both displays show: ``1.2 GiB of 4.0 GiB (30%), 310.0
    MiB/s, 9 s left`` while running; ``..., 310.0 MiB/s (done after 13 s)`` once ``outcome`` is set.
    Binary units throughout (format_bytes), the rate in the same units per second; without a total,
    no percentage and no time left."""
    elapsed = max(elapsed, 1e-9)
    rate = done / elapsed
    text = format_bytes(done)
    if total:
        text += f" of {format_bytes(total)} ({min(100.0, 100.0 * done / total):.0f}%)"
    text += f", {format_bytes(rate)}/s"
    if outcome is not None:
        return text + f" ({outcome} after {_duration(elapsed)})"
    if total and rate > 0:
        text += f", {_duration(max(0.0, (total - done) / rate))} left"
    return text


_ACTIVE: ByteProgress | None = None


def advance(nbytes: int) -> None:
    """The byte loops' one callback: ``nbytes`` more written (no-op when nothing reports)."""
    active = _ACTIVE
    if active is not None:
        active.advance(nbytes)


def expect(nbytes: int) -> None:
    """An operation's plan: ``nbytes`` more will be written by this process."""
    active = _ACTIVE
    if active is not None:
        active.expect(nbytes)


def grow(nbytes: int) -> None:
    """``nbytes`` written that no :func:`expect` planned (headers, pickles, metadata): added to the
    total and to the bytes done, so done never passes the total (no-op when nothing reports)."""
    active = _ACTIVE
    if active is not None:
        active.grow(nbytes)


def counts() -> tuple[int, int]:
    """This process's (bytes written, bytes expected) in the command now reporting; (0, 0) when none."""
    active = _ACTIVE
    return (active._done, active._total) if active is not None else (0, 0)


def watch_peers(read: Callable[[], list[tuple[int, int]]] | None) -> None:
    """Rank 0 of a split command: where the other processes' counts are read (None: no longer)."""
    active = _ACTIVE
    if active is not None:
        active.peers, active._peers_read = read, None


@contextmanager
def reporting(label: str, *, quiet: bool = False, rank: int = 0, processes: int = 1,
              stream: TextIO | None = None, interval: float = PLAIN_INTERVAL_S,
              live: bool | None = None) -> Iterator[ByteProgress]:
    """Count the bytes written inside the block and show them on ``stream`` (stderr). ``live``: a rich
    bar (default: when ``stream`` is a terminal). Nothing is shown with ``quiet`` or on rank > 0."""
    global _ACTIVE
    out = stream if stream is not None else sys.stderr
    meter = ByteProgress(label, processes=processes)
    shown = not quiet and rank == 0
    if live is None:
        live = bool(getattr(out, "isatty", lambda: False)())
    previous, _ACTIVE = _ACTIVE, meter
    stop = threading.Event()
    thread: threading.Thread | None = None
    if shown:
        target = _live_bar if live else _plain_lines
        thread = threading.Thread(target=target, args=(meter, out, interval, stop), name="shardkit-progress", daemon=True)
        thread.start()
    finished = False
    try:
        yield meter
        finished = True
    finally:
        _ACTIVE = previous
        meter.outcome = "done" if finished else "stopped"  # the last line or frame says the time taken
        stop.set()
        if thread is not None:
            thread.join(timeout=5)
            if not live and meter.done:
                print(meter.line(), file=out, flush=True)


def _plain_lines(meter: ByteProgress, out: TextIO, interval: float, stop: threading.Event) -> None:
    while not stop.wait(interval):
        if meter.done:
            print(meter.line(), file=out, flush=True)


def _live_bar(meter: ByteProgress, out: TextIO, interval: float, stop: threading.Event) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn

    # rich's own DownloadColumn/TransferSpeedColumn/TimeRemainingColumn mix decimal rates (MB/s) with
    # binary totals and end a finished bar at 0:00:00: the figures are describe()'s, as in a log
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[figures]}"))
    with Progress(*columns, console=Console(file=out), transient=False) as bar:
        task = bar.add_task(meter.label, total=None, figures="")
        while True:
            finished = stop.wait(0.2)
            total = meter.total
            bar.update(task, completed=meter.done, total=total if total else None, figures=meter.figures())
            if finished:
                return


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover (the loop returns)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
