"""Ranks never outlive the process that started them.

Each rank is the leader of its own process group (``os.setsid`` in its entry point), so a kill
reaches what it started too (a JIT build, DataLoader workers). That also takes it out of reach of
the parent's terminal and of a `kill` of the parent, hence the two halves here: in the rank,
:func:`_die_with_parent` (a parent-death signal plus a watchdog thread); in the parent,
:class:`_ForwardSignals`, which passes SIGTERM/SIGINT on to every rank's group, and
:func:`_signal_group`, which the parent uses to stop the ranks.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

# The parent-death signal: a catchable one, so the rank can take its whole process group (what it
# started: a JIT build, DataLoader workers) down with it. SIGKILL would end the rank at once and
# orphan its children, since they are in the rank's group, not the parent's.
PARENT_DEATH_SIGNAL = signal.SIGTERM


def _die_with_parent(parent_pid: int) -> None:
    """End this rank and its process group when the process that spawned it dies, however it died.

    The rank is its own session leader (os.setsid), so a SIGKILL of the parent, or a SIGTERM it had
    no time to pass on, would otherwise leave it running and holding memory (and GPUs) forever.
    The kernel sends PARENT_DEATH_SIGNAL the moment the parent exits (Linux prctl); its handler
    kills the rank's group. A watchdog thread does the same where prctl is missing, where the
    target replaced the handler, or where the main thread is stuck in C code and cannot run it.
    """
    rank_pid = os.getpid()

    def kill_group(signum: int, _frame: Any) -> None:
        if os.getpid() != rank_pid:
            # a forked child of the rank inherited this handler (a DataLoader worker SIGTERMed by
            # its own loader): it dies alone, as it would have without us
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        _kill_own_group()

    signal.signal(PARENT_DEATH_SIGNAL, kill_group)  # before prctl: the signal may come at once
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(PARENT_DEATH_SIGNAL), 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.2)
        _kill_own_group()

    threading.Thread(target=watch, name="shardkit-parent-watchdog", daemon=True).start()


def _kill_own_group() -> None:
    """SIGKILL this rank's process group (the rank is its leader), the rank last of all."""
    try:
        os.killpg(os.getpgrp(), signal.SIGKILL)
    finally:
        os._exit(1)


@dataclass
class _ForwardSignals:
    """While ranks run, SIGTERM/SIGINT to this process go to every rank's process group first.

    The ranks are session leaders (os.setsid), so neither Ctrl-C in a terminal nor `kill` of this
    process reaches them by itself; then this process reacts as it would have without us.
    """

    procs: list[Any]
    previous: dict[int, Any] = field(default_factory=dict)

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set there; the ranks still die with this process
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(sig)
            if previous is signal.SIG_IGN or previous is None:
                # SIG_IGN: this process ignores it (nohup), so do the ranks. None: a handler set
                # from C, which Python cannot put back (signal.signal(sig, None) is a TypeError):
                # leave it in place rather than lose it.
                continue
            self.previous[sig] = previous
            signal.signal(sig, self._forward)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous.clear()

    def _forward(self, signum: int, frame: Any) -> None:
        for p in self.procs:
            _signal_group(p.pid, signal.Signals(signum))
        previous = self.previous.get(signum, signal.SIG_DFL)
        self.restore()
        if callable(previous):
            previous(signum, frame)  # Python's SIGINT handler raises KeyboardInterrupt
        elif previous is signal.SIG_DFL:
            os.kill(os.getpid(), signum)  # die of the signal, as without the handler


def _signal_group(pid: int | None, sig: signal.Signals) -> None:
    if pid is None:
        return
    try:
        os.killpg(pid, sig)  # the rank is its group's leader (os.setsid in _rank_main)
    except (ProcessLookupError, PermissionError):
        pass
