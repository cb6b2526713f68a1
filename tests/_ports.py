"""Ports for tests that start launcher-shaped jobs. Never a fixed number: CI runs the suite on two
xdist workers, and two tests given the same MASTER_PORT at the same time are one job to shardkit
(its split runs name a job by MASTER_ADDR:MASTER_PORT, and their rank 0 leaves a pointer named by
that job in the shared temporary folder) and one rendezvous to torch (a store that cannot bind its
port joins whatever store listens there instead, or fails with EADDRINUSE)."""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import socket
import tempfile
from pathlib import Path

# Claims are files in one folder every worker of every run on this machine sees: a port is handed
# out once while its claimer lives. Checking that a port is free is not enough: it is free until a
# job binds it seconds later, and the other worker may have been handed the same number meanwhile
# (its random module may even stand where this one's does: a library's set_seed reseeds it).
_CLAIMS = Path(tempfile.gettempdir()) / "shardkit-test-ports"
_MINE: list[Path] = []
_RANDOM = random.SystemRandom()


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out by itself (bind to port 0, a connect's source port)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _claim(port: int) -> bool:
    """True when this process now holds `port`'s claim: made here, or taken over from a claimer that
    has ended (a killed run leaves its claims behind)."""
    _CLAIMS.mkdir(exist_ok=True)
    path = _CLAIMS / str(port)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                owner = int(path.read_text() or "0")
            except (OSError, ValueError):
                return False  # being written this instant, or unreadable: someone else's
            if owner and _alive(owner):
                return False
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        _MINE.append(path)
        return True
    return False


@atexit.register
def _release() -> None:
    for path in _MINE:
        with contextlib.suppress(OSError):
            path.unlink()


def free_port(span: int = 1) -> int:
    """A port p with p .. p + span - 1 free on every address and claimed by no other live test
    process, chosen below the kernel's ephemeral range: a port from there (bind to port 0) is free
    only until a job binds it seconds later, and meanwhile the other test worker's ranks take
    ephemeral ports by the hundred. Chosen at random (from the OS, not the random module's state) in
    ~12,000 ports; a port stays claimed until this test process ends, so it is never handed twice."""
    low = max(1024, min(_ephemeral_low(), 65536) - 12000)
    high = min(_ephemeral_low(), 65536) - span
    for _ in range(500):
        port = _RANDOM.randint(low, max(low, high))
        with contextlib.ExitStack() as stack:
            try:
                for p in range(port, port + span):
                    stack.enter_context(socket.socket()).bind(("", p))
            except OSError:
                continue
        if all(_claim(p) for p in range(port, port + span)):
            return port
    raise RuntimeError(f"no {span} consecutive free, unclaimed port(s) in {low}-{high}")


def job_port() -> str:
    """A MASTER_PORT of this test's own for processes started with torchrun's variables by hand (no
    torchrun): nothing listens there, the port only names the job (shardkit.storage.shared_save)."""
    return str(free_port())
