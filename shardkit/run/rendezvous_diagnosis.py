"""Why a multi-node torchrun failed at its rendezvous, said in one line by `shardkit launch`.

torchrun's c10d rendezvous reports its cross-node failures badly: a node that never joins ends every
other node's agent with a bare ``RendezvousTimeoutError`` (no message at all) after ``join_timeout``
(600 s by default); a rendezvous host this node cannot reach ends with "The connection to the C10d
store has failed. See inner exception for details." after ``read_timeout`` (60 s), and so does a
store that went away mid-run because the node hosting it failed first. `shardkit launch` keeps the
tail of torchrun's stderr (:class:`StderrTail`, everything still printed as it comes) and, when the
run ended with one of them, :func:`diagnose` names the endpoint, what it resolves to on this node,
the node and rank counts, why, and the fix."""

from __future__ import annotations

import os
import re
import socket
import sys
import threading
from dataclasses import dataclass
from typing import IO, Callable, Sequence

#: torchrun's defaults for --rdzv_conf join_timeout / read_timeout (DynamicRendezvousHandler,
#: c10d_rendezvous_backend), used when the command line does not set them.
DEFAULT_JOIN_TIMEOUT_S = 600
DEFAULT_READ_TIMEOUT_S = 60
#: How much of torchrun's stderr is kept for the diagnosis (the failure is in its last traceback).
TAIL_BYTES = 64 * 1024


@dataclass(frozen=True)
class Rendezvous:
    """A torchrun c10d rendezvous across nodes, as its command line describes it."""

    endpoint: str
    """``host:port`` of the store (hosted by the agent on the node whose name or address it is)."""
    min_nodes: int
    """Nodes the rendezvous waits for (``--nnodes N``, or N of ``N:M``)."""
    nproc_per_node: int | None
    run_id: str | None
    join_timeout_s: int
    """Seconds every node has to join (``--rdzv_conf join_timeout``)."""
    read_timeout_s: int
    """Seconds a node has to reach the store (``--rdzv_conf read_timeout``)."""

    @property
    def host(self) -> str:
        return self.endpoint.rsplit(":", 1)[0].strip("[]") if ":" in self.endpoint else self.endpoint


def _option(args: Sequence[str], names: Sequence[str]) -> str | None:
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in names:
            return value if eq else (args[i + 1] if i + 1 < len(args) else None)
    return None


def rendezvous_of(launcher_args: Sequence[str]) -> Rendezvous | None:
    """The c10d rendezvous of torchrun's arguments when it spans nodes (None for --standalone,
    one node, or another backend: nothing crosses a node then)."""
    args = list(launcher_args)
    backend = _option(args, ("--rdzv_backend", "--rdzv-backend"))
    endpoint = _option(args, ("--rdzv_endpoint", "--rdzv-endpoint"))
    nnodes = (_option(args, ("--nnodes",)) or "1").split(":")
    if backend != "c10d" or not endpoint or "--standalone" in args:
        return None
    if not all(n.isdigit() for n in nnodes) or max(int(n) for n in nnodes) < 2:
        return None
    conf = dict(
        kv.split("=", 1) for kv in (_option(args, ("--rdzv_conf", "--rdzv-conf")) or "").split(",") if "=" in kv
    )
    nproc = _option(args, ("--nproc_per_node", "--nproc-per-node"))

    def seconds(key: str, default: int) -> int:
        value = conf.get(key, "").strip()
        return int(value) if value.isdigit() else default

    return Rendezvous(
        endpoint=endpoint, min_nodes=int(nnodes[0]), nproc_per_node=int(nproc) if nproc and nproc.isdigit() else None,
        run_id=_option(args, ("--rdzv_id", "--rdzv-id")),
        join_timeout_s=seconds("join_timeout", DEFAULT_JOIN_TIMEOUT_S),
        read_timeout_s=seconds("read_timeout", DEFAULT_READ_TIMEOUT_S),
    )


class StderrTail:
    """Copies a child's stderr pipe to ours as it comes, keeping the last TAIL_BYTES for diagnosis."""

    def __init__(self, pipe: IO[bytes], sink: IO[str] | None = None) -> None:
        self._pipe = pipe
        self._sink = sink or sys.stderr
        self._tail = bytearray()
        self._thread = threading.Thread(target=self._pump, name="shardkit-stderr-tail", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        raw = getattr(self._sink, "buffer", None)
        fd = self._pipe.fileno()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            if raw is not None:
                raw.write(chunk)
                raw.flush()
            else:
                self._sink.write(chunk.decode(errors="replace"))
                self._sink.flush()
            self._tail += chunk
            del self._tail[:-TAIL_BYTES]

    def text(self, wait_s: float = 5.0) -> str:
        """The tail so far, after waiting up to ``wait_s`` for the pipe to close (a rank that
        outlives its agent keeps it open: never wait on that forever)."""
        self._thread.join(wait_s)
        return bytes(self._tail).decode(errors="replace")


def _resolved(host: str, resolve: Callable[[str], list[str]]) -> str:
    try:
        addresses = resolve(host)
    except OSError as exc:
        return f"{host} does not resolve here ({exc})"
    if not addresses:
        return f"{host} does not resolve here"
    return f"{host} resolves to {', '.join(addresses)} here"


def _addresses(host: str) -> list[str]:
    return sorted({str(info[4][0]) for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)})


def _inner_error(tail: str) -> str:
    """The store's own error under torchrun's "See inner exception" (the line that says why)."""
    lines = [ln.strip() for ln in tail.splitlines()]
    for line in reversed(lines):
        if re.match(r"^[\w.]*(DistNetworkError|DistStoreError|DistError|TimeoutError|ConnectionError)\b", line) and \
                "RendezvousConnectionError" not in line:
            return line.split(" Exception raised from")[0][:300].rstrip(".")
    return "no further detail in torchrun's output"


def diagnose(
    rdzv: Rendezvous,
    stderr_tail: str,
    *,
    hostname: str | None = None,
    resolve: Callable[[str], list[str]] = _addresses,
) -> str | None:
    """One line naming a rendezvous failure in torchrun's stderr tail; None when there is none."""
    here = hostname or socket.gethostname()
    ranks = f" x {rdzv.nproc_per_node} rank(s)" if rdzv.nproc_per_node else ""
    run = f" (rdzv_id {rdzv.run_id})" if rdzv.run_id else ""
    if re.search(r"^[\w.]*RendezvousTimeoutError\b", stderr_tail, re.MULTILINE):
        others = rdzv.min_nodes - 1
        missing_ranks = f" ({others * rdzv.nproc_per_node} rank(s))" if rdzv.nproc_per_node else ""
        missing = f"the other node{missing_ranks}" if others == 1 else f"up to {others} other nodes{missing_ranks}"
        return (
            f"shardkit launch: the rendezvous at {rdzv.endpoint}{run} timed out after {rdzv.join_timeout_s}s "
            f"(join_timeout) on this node ({here}) waiting for {rdzv.min_nodes} node(s){ranks}: this node joined but "
            f"{missing} never did, so no rank started. A node that never joins did not start its launcher (check "
            "that srun started one task per node and that none failed first: its output is above or in its log), is "
            f"still starting (slow file system or imports), or cannot reach {rdzv.endpoint} "
            f"({_resolved(rdzv.host, resolve)}). Fix the missing node, or give slow nodes longer with "
            "`--rdzv_conf join_timeout=SECONDS` (RDZV_CONF=join_timeout=SECONDS for launch/slurm_multinode.sbatch)."
        )
    connection_failed = re.search(r"^[\w.]*RendezvousConnectionError\b.*C10d store has failed", stderr_tail, re.MULTILINE)
    if connection_failed and "in _create_tcp_store" not in stderr_tail[: connection_failed.start()]:
        # the store was reached, then went away: its host (an agent on another node) ended first
        return (
            f"shardkit launch: the rendezvous store at {rdzv.endpoint}{run} went away while this node ({here}) was "
            f"still using it ({_inner_error(stderr_tail)}): the node hosting it ({rdzv.host}, the job's first node) "
            "ended first, and that node's output names the first failure; this node's error follows from it."
        )
    if connection_failed:
        return (
            f"shardkit launch: this node ({here}) could not reach the rendezvous store at {rdzv.endpoint}{run} "
            f"within {rdzv.read_timeout_s}s (read_timeout): {_resolved(rdzv.host, resolve)}; the store said: "
            f"{_inner_error(stderr_tail)}. The node named by the endpoint (the job's first node, MASTER_ADDR) hosts "
            f"the store, and every node must reach it there. Fix: make {rdzv.host} resolve to that node's address "
            f"on every node (`getent hosts {rdzv.host}` on each; /etc/hosts or DNS), open port "
            f"{rdzv.endpoint.rsplit(':', 1)[-1]} between the nodes, or set MASTER_ADDR to an address every node reaches."
        )
    return None
