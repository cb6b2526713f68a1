"""How `shardkit launch` ends when it is stopped (Ctrl-C, a scheduler's SIGTERM) or when the launcher
leaves rank processes behind: no rank outlives the launch, and the exit status says what stopped it.

While the launcher runs, this process is the Linux *child subreaper* (``PR_SET_CHILD_SUBREAPER``):
a rank whose launcher died (torchrun killed, a rank that ignored the launcher's SIGTERM) is
re-parented here instead of to init, so once the launcher has exited every process still below
this one is a leftover rank (or one of its workers). They get SIGTERM, a grace period, then SIGKILL,
and are named. Elsewhere (no prctl) the launcher's descendants seen when the signal came are used.
"""

from __future__ import annotations

import ctypes
import signal
import sys
from dataclasses import dataclass, field

_PR_SET_CHILD_SUBREAPER = 36
GRACE_S = 10.0
"""Seconds a leftover rank gets after SIGTERM before SIGKILL (torchrun gives its workers 30 s
itself before it exits; what is left after that is stuck)."""


def set_subreaper(on: bool) -> bool:
    """Become (or stop being) the subreaper of this process's descendants; False where the OS has
    no such thing (then the launcher's descendants are snapshotted at the signal instead)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


@dataclass
class LaunchStop:
    """What stopped the launch, and the launcher's descendants seen when it did."""

    signum: int | None = None
    """The first SIGINT/SIGTERM received (passed on to the launcher)."""
    seen: dict[int, float] = field(default_factory=dict)
    """Pids below the launcher when the signal came (the fallback where there is no subreaper), each
    with its start time: a pid reused by another process before the reap is not that one (pids wrap
    quickly where pid_max is 32768, as in many containers)."""
    before: set[int] = field(default_factory=set)
    """This process's descendants before the launcher started: never the launch's, never touched
    (a caller that runs the launch in process may have children of its own)."""

    @classmethod
    def starting_now(cls) -> "LaunchStop":
        """The state for a launch about to start (remembers the descendants that are not its own)."""
        import psutil

        return cls(before=set(_descendants(psutil.Process().pid)))

    def note(self, signum: int, launcher_pid: int) -> None:
        import psutil

        if self.signum is None:
            self.signum = signum
        for pid in _descendants(launcher_pid):
            try:
                self.seen.setdefault(pid, psutil.Process(pid).create_time())
            except psutil.Error:
                continue

    @property
    def exit_code(self) -> int | None:
        """128 + the signal's number, as a shell reports a process the signal stopped."""
        return None if self.signum is None else 128 + self.signum


def _descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def reap_leftovers(stop: LaunchStop, subreaper: bool, grace_s: float = GRACE_S) -> list[str]:
    """Stop every process the exited launcher left behind; returns ``pid (name)`` of each one that
    was still running (empty when the launcher cleaned up after itself)."""
    import psutil

    below = set(_descendants(psutil.Process().pid)) if subreaper else set()
    pids = (below | set(stop.seen)) - stop.before
    alive = []
    for pid in sorted(pids):
        try:
            proc = psutil.Process(pid)
            if pid not in below and proc.create_time() != stop.seen[pid]:
                continue  # the pid now names another process: never signal that one
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.Error:
            continue
    if not alive:
        return []
    named = []
    for proc in alive:
        try:
            named.append(f"{proc.pid} ({' '.join(proc.cmdline()[:3]) or proc.name()})")
            proc.send_signal(signal.SIGTERM)
        except psutil.Error:
            continue
    _, still = psutil.wait_procs(alive, timeout=grace_s)
    for proc in still:
        try:
            proc.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(still, timeout=grace_s)
    return named


def stop_message(launcher: str, stop: LaunchStop, leftovers: list[str]) -> str:
    """The launch's last line after a signal (or after the launcher left ranks running)."""
    left = (f"; {len(leftovers)} process(es) the launcher left running were stopped: {', '.join(leftovers[:8])}"
            if leftovers else "; no rank process is left running")
    if stop.signum is None:
        return f"shardkit launch: {launcher} exited{left}"
    name = signal.Signals(stop.signum).name
    return (f"shardkit launch: stopped by {name}: {launcher} and its ranks were stopped{left}; exit {stop.exit_code}. "
            "A checkpoint the script was writing is only complete if its save finished (shardkit verify DIR says)")
