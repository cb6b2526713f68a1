"""What the ranks of a `shardkit launch` tell it about their preflight, and the launch's closing line.

The launch listens on a small TCP port (:class:`RankReports`) whose address travels to the ranks in
the launch's packed settings (:mod:`shardkit.autopreflight.launch_link`); each rank sends "armed"
when its hooks are installed, then "passed", "failed" or "skipped". Ranks on this machine reach it
on loopback; ranks that DeepSpeed's multi-node runner starts on other nodes reach it at the local
address that routes toward the job's first host (or SHARDKIT_LAUNCH_ADDR). Each message is one line
per rank, so the launch keeps a few bytes per rank and never grows with tensors.

At the end the launch says what holds: the preflight passed on N of N ranks, failed on some (exit 3,
:func:`preflight_summary`), or never ran on some, named, with why (:func:`never_ran_line`).
"""

from __future__ import annotations

import json
import secrets
import select
import socket
import threading
import time
from dataclasses import dataclass, field

from shardkit.autopreflight import site_dir
from shardkit.autopreflight.launch_link import PACKED_ENV
from shardkit.core.env_settings import read_address
from shardkit.core.errors import UsageError
from shardkit.run.launch_ranks import ExpectedRanks

ENV_ADDR = "SHARDKIT_LAUNCH_ADDR"
"""An address (``host`` or ``host:port``) of the launch host that every node reaches; overrides the
routed guess."""
DRAIN_S = 0.5
"""After the launcher exits: reports still in flight from the last ranks are read for this long."""
_MAX_LINE = 64 * 1024


@dataclass
class RankReport:
    """What one rank told the launch."""

    host: str = "?"
    events: set[str] = field(default_factory=set)
    """armed, passed, failed, skipped."""
    line: str = ""
    """The failure's (or the skip's) first line."""
    world: int | None = None


class RankReports:
    """The launch's report listener: a thread accepting one JSON line per connection."""

    def __init__(self, bind_host: str, port: int = 0) -> None:
        self.token = secrets.token_hex(8)
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self._server = socket.socket(family, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._server.bind((bind_host, port))
        except OSError as exc:
            self._server.close()
            raise UsageError(
                f"shardkit launch cannot listen for the ranks' preflight reports at {bind_host}:{port} ({exc}); set "
                f"{ENV_ADDR} to an address of this host the nodes reach (host or host:port), or use --no-preflight"
            ) from exc
        self._server.listen(1024)
        self.host = bind_host
        self.port = int(self._server.getsockname()[1])
        self.ranks: dict[int, RankReport] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="shardkit-rank-reports", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        """``host:port/token``: what the ranks get in SHARDKIT_LAUNCH_REPORT."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}/{self.token}"

    def _serve(self) -> None:
        quiet_since: float | None = None
        while True:
            readable, _, _ = select.select([self._server], [], [], 0.1)
            if readable:
                quiet_since = None
                try:
                    conn, _ = self._server.accept()
                except OSError:
                    continue
                with conn:
                    self._read(conn)
            elif self._stop.is_set():
                quiet_since = quiet_since or time.monotonic()
                if time.monotonic() - quiet_since >= DRAIN_S:
                    return

    def _read(self, conn: socket.socket) -> None:
        conn.settimeout(2.0)
        data = b""
        try:
            while b"\n" not in data and len(data) < _MAX_LINE:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                data += chunk
            message = json.loads(data.split(b"\n", 1)[0])
        except (OSError, ValueError):
            return  # not one of our ranks' lines: ignored
        if not isinstance(message, dict) or message.get("token") != self.token:
            return
        rank, event = message.get("rank"), message.get("event")
        if not isinstance(rank, int) or event not in ("armed", "passed", "failed", "skipped"):
            return
        with self._lock:
            seen = self.ranks.setdefault(rank, RankReport())
            seen.host = str(message.get("host", "?"))
            seen.events.add(event)
            world = message.get("world")
            seen.world = world if isinstance(world, int) else seen.world
            if event in ("failed", "skipped"):
                seen.line = str(message.get("line", ""))

    def failures(self) -> dict[int, str]:
        """Rank -> first line of its preflight failure, in rank order."""
        with self._lock:
            return {r: self.ranks[r].line for r in sorted(self.ranks) if "failed" in self.ranks[r].events}

    def close(self) -> dict[int, RankReport]:
        """Stop listening once the reports in flight are read; every rank's report."""
        self._stop.set()
        self._thread.join(timeout=10)
        self._server.close()
        with self._lock:
            return dict(self.ranks)


def listen_address(expected: ExpectedRanks, environ: dict[str, str]) -> tuple[str, int]:
    """Where the listener binds: SHARDKIT_LAUNCH_ADDR (``host`` or ``host:port``); loopback when every
    rank runs on this machine; else the local address that routes toward the job's first host."""
    given = read_address(ENV_ADDR, environ)  # a port out of 0-65535 or a malformed host: refused naming it
    if given is not None:
        return given
    if not expected.remote:
        return "127.0.0.1", 0
    return _routed_address(expected.route_host), 0


def _routed_address(toward: str | None) -> str:
    """The local IP the kernel would send from toward ``toward`` (a UDP connect sends nothing)."""
    for target in (toward, socket.gethostname()):
        if not target:
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((target, 9))
                return str(probe.getsockname()[0])
        except OSError:
            continue
    return "0.0.0.0"


def preflight_summary(failures: dict[int, str], world_size: int | None, node: str | None = None) -> str:
    """The launch's last line after ranks failed their preflight (``node``: this node's name, in a
    run over several nodes, where each node's launch names its own ranks)."""
    of = f" of {world_size}" if world_size else ""
    if node:
        of += f" on this node ({node}; every node names its own ranks)"
    first = next(iter(failures.values()), "") or "placement preflight failed"
    return (
        f"shardkit launch: placement preflight failed on rank(s) {sorted(failures)}{of} before the first optimizer "
        f"step: {first}; exit 3. The table is above (rank 0's output); fix the placement, or relaunch with "
        "`shardkit launch --no-preflight` to skip the check."
    )


def outcome_line(reports: dict[int, RankReport], expected: ExpectedRanks, address: str, node: str | None,
                 launcher_code: int = 0) -> str:
    """The launch's closing line when no rank failed: passed on N of N, or the ranks that never ran it
    (``launcher_code``: the launcher's exit status; a launcher that failed before any rank reported
    is the likelier reason than a variable that did not arrive)."""
    worlds = [r.world for r in reports.values() if r.world]
    count = expected.count or (max(worlds) if worlds and not expected.per_node else None) or len(reports)
    if expected.hosts:
        wanted = sorted(expected.hosts)
    elif not expected.per_node:
        wanted = list(range(count))
    else:  # one node's ranks of a bigger job: their global numbers are the launcher's to give
        wanted = sorted(reports)[:count] if len(reports) >= count else sorted(reports)
    passed = [r for r in wanted if "passed" in reports.get(r, RankReport()).events]
    where = f" on this node ({node})" if node else ""
    hosts = sorted({reports[r].host for r in passed})
    if len(passed) == count and count:
        return f"shardkit launch: placement preflight passed on {count} of {count} rank(s){where} (hosts: {', '.join(hosts)})"
    if expected.per_node and not expected.hosts and len(reports) < count:
        unheard = count - len(reports)
        return (f"shardkit launch: warning: the placement preflight never ran on {unheard} of this node's {count} "
                f"rank(s){where}: {_no_report_why(expected, address)}")
    if not reports and launcher_code != 0:
        return (f"shardkit launch: warning: the placement preflight never ran: the launcher exited with {launcher_code} "
                "before any rank reported (see its output above; the ranks may never have started)")
    missing = [r for r in wanted if r not in passed]
    return "shardkit launch: warning: " + "; ".join(
        _group_line(ranks, why, count, expected, reports) for why, ranks in _by_reason(missing, reports, expected, address).items()
    )


def _by_reason(missing: list[int], reports: dict[int, RankReport], expected: ExpectedRanks, address: str) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for rank in missing:
        seen = reports.get(rank)
        if seen is None:
            why = _no_report_why(expected, address)
        elif "skipped" in seen.events:
            why = seen.line or "the preflight was unavailable in that rank"
        else:
            why = "its hooks were armed, but the rank never reached an optimizer step (it ended, or failed, before one)"
        groups.setdefault(why, []).append(rank)
    return groups


def _group_line(ranks: list[int], why: str, count: int, expected: ExpectedRanks, reports: dict[int, RankReport]) -> str:
    hosts = sorted({expected.hosts.get(r) or (reports[r].host if r in reports else "?") for r in ranks})
    return f"the placement preflight never ran on rank(s) {ranks} of {count} (hosts {', '.join(hosts)}): {why}"


def _no_report_why(expected: ExpectedRanks, address: str) -> str:
    if expected.unreachable:
        return expected.unreachable
    host_port = address.split("/", 1)[0]
    if expected.rank_from == "pmi":
        return ("no report came from them: under DeepSpeed's slurm runner a rank knows its number at start-up only "
                "from PMIx/PMI (PMIX_RANK, PMI_RANK), which srun sets with --mpi=pmix or --mpi=pmi2; pass "
                "--launcher_args=--mpi=pmix (DeepSpeed's MPI discovery through mpi4py needs it too, unless the cluster's "
                f"MpiDefault is pmix), or see whether {PACKED_ENV} arrived (the rank says so on its stderr) and "
                f"{host_port} is reachable from the nodes (set {ENV_ADDR})")
    if expected.remote:
        return (f"no report came from them: {PACKED_ENV} did not arrive there (the rank says so on its stderr), or "
                f"shardkit's sitecustomize folder {site_dir()}, on their PYTHONPATH, is missing on that node (install "
                f"shardkit at the same path on every node), or {host_port} is not reachable from it (set {ENV_ADDR})")
    return (f"no report came from them: {PACKED_ENV} and SHARDKIT_AUTOPREFLIGHT did not arrive in their environment "
            f"(the rank says so on its stderr), or shardkit's sitecustomize ({site_dir()}) did not load there "
            "(PYTHONPATH replaced, or the ranks never started)")
