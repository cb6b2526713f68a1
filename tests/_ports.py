"""Ports for tests that start launcher-shaped jobs. Never a fixed number: CI runs the suite on two
xdist workers, and two tests given the same MASTER_PORT at the same time are one job to shardkit
(its split runs name a job by MASTER_ADDR:MASTER_PORT, and their rank 0 leaves a pointer named by
that job in the shared temporary folder) and one rendezvous to torch (a store that cannot bind its
port joins whatever store listens there instead)."""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out by itself (bind to port 0, a connect's source port)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(span: int = 1) -> int:
    """A port p with p .. p + span - 1 free on every address, chosen below the kernel's ephemeral
    range: a port from there (bind to port 0) is free only until a job binds it seconds later,
    and meanwhile the other test worker's ranks take ephemeral ports by the hundred (a rendezvous
    store that cannot bind its port joins whatever store listens there instead). Chosen at random
    in ~12,000 ports, so two workers' jobs (bound or only named by it) meet about once in 12,000."""
    low = max(1024, min(_ephemeral_low(), 65536) - 12000)
    high = min(_ephemeral_low(), 65536) - span
    for _ in range(500):
        port = random.randint(low, max(low, high))
        with contextlib.ExitStack() as stack:
            try:
                for p in range(port, port + span):
                    stack.enter_context(socket.socket()).bind(("", p))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no {span} consecutive free port(s) in {low}-{high}")


def job_port() -> str:
    """A MASTER_PORT of this test's own for processes started with torchrun's variables by hand (no
    torchrun): nothing listens there, the port only names the job (shardkit.storage.shared_save)."""
    return str(free_port())
