"""How a rank on any node gets the launch's settings and tells the launch what its preflight did.

The settings travel in one variable, :data:`PACKED_ENV` (``PYTHON_SHARDKIT_LAUNCH``): every
``SHARDKIT_*`` variable of the launch as base64 of JSON. Its name starts with ``PYTHON`` because
DeepSpeed's multi-node runner (pdsh, OpenMPI, MPICH, Intel MPI, MVAPICH, Slurm) passes to the
other nodes only the variables whose names start with one of its ``EXPORT_ENVS`` prefixes (MLFLOW,
PYTHON, MV2, UCX in 0.19) and the lines of ``.deepspeed_env``; a plain ``SHARDKIT_AUTOPREFLIGHT``
stays on the launch host. base64's alphabet (letters, digits, ``+/=``) is one the runner's
``export NAME=VALUE;`` line carries unquoted. The rank's ``sitecustomize`` unpacks it
(:func:`arrive`) before it decides whether the preflight is on, never overriding a value the rank
already has.

The reports go back over TCP, one JSON line per connection, to the listener whose address the
launch put in ``SHARDKIT_LAUNCH_REPORT`` (``host:port/token``): "armed" (the hooks are installed),
then "passed", "failed" (with the failure's first line) or "skipped". A report that cannot be sent
is said once on the rank's stderr and never stops the rank.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import socket
import sys
from typing import Mapping, MutableMapping

from shardkit.autopreflight.rank_env import rank_of

PACKED_ENV = "PYTHON_SHARDKIT_LAUNCH"
"""The one variable carrying every SHARDKIT_* setting of the launch to the ranks on every node."""
REPORT_ENV = "SHARDKIT_LAUNCH_REPORT"
"""``host:port/token`` of the launch's report listener (set by `shardkit launch`, travels packed)."""
SEND_TIMEOUT_S = 3.0
"""How long a rank tries to reach the launch (once: a process that could not reach it stops trying)."""
_PREFIX = "SHARDKIT_"


def pack(environ: Mapping[str, str]) -> str:
    """Every ``SHARDKIT_*`` variable of ``environ`` as the packed variable's value."""
    settings = {k: v for k, v in sorted(environ.items()) if k.startswith(_PREFIX)}
    return base64.b64encode(json.dumps(settings, separators=(",", ":")).encode()).decode("ascii")


def unpack(value: str) -> dict[str, str]:
    """The settings in a packed value; ValueError (naming what is wrong) for one that is not ours."""
    try:
        settings = json.loads(base64.b64decode(value.strip(), validate=True))
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"{PACKED_ENV} is not base64 of JSON ({exc})") from exc
    if not isinstance(settings, dict) or not all(
        isinstance(k, str) and k.startswith(_PREFIX) and isinstance(v, str) for k, v in settings.items()
    ):
        raise ValueError(f"{PACKED_ENV} does not hold SHARDKIT_* settings")
    return settings


def arrive(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Unpack the launch's settings into ``environ`` (default os.environ); a variable already set
    keeps its value (a user's own export on that node wins). Returns the names set here."""
    env = os.environ if environ is None else environ
    value = env.get(PACKED_ENV)
    if not value:
        return []
    try:
        settings = unpack(value)
    except ValueError as exc:
        print(f"shardkit autopreflight: {exc}; the launch's settings are not used in this process", file=sys.stderr)
        return []
    added = [k for k in settings if k not in env]
    for name in added:
        env[name] = settings[name]
    return added


def rank_identity(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """Who this rank is, as its reports name it."""
    env = os.environ if environ is None else environ
    rank, world = rank_of(dict(env)) or (None, None)
    return {"rank": rank, "world": world, "host": socket.gethostname(), "pid": os.getpid()}


_unreachable: set[str] = set()
"""Report addresses this process could not reach: said once, then not tried again."""


def send_report(event: str, line: str = "", environ: Mapping[str, str] | None = None) -> bool:
    """Tell the launch ``event`` (armed, passed, failed, skipped) for this rank; False when there is
    no launch to tell or it cannot be reached (said once on stderr, the rank goes on)."""
    env = os.environ if environ is None else environ
    target = env.get(REPORT_ENV, "")
    address, _, token = target.partition("/")
    host, _, port = address.rpartition(":")
    if not (host and port.isdigit() and token) or address in _unreachable:
        return False
    message = {"token": token, "event": event, "line": line, **rank_identity(env)}
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=SEND_TIMEOUT_S) as conn:
            conn.sendall(json.dumps(message).encode() + b"\n")
        return True
    except OSError as exc:
        _unreachable.add(address)
        print(
            f"shardkit autopreflight: rank {message['rank']} on {message['host']}: cannot report to the launch at "
            f"{address} ({exc}); the launch will list this rank as not reporting. Make that port reachable "
            "from this node, or set SHARDKIT_LAUNCH_ADDR to an address of the launch host this node reaches",
            file=sys.stderr, flush=True,
        )
        return False
