"""The network interface a process group is told to use: ``GLOO_SOCKET_IFNAME`` and
``NCCL_SOCKET_IFNAME`` naming an interface this host does not have.

Both are set once in a job script or a shell profile and then carried to machines where the name
differs (``eth0`` vs ``ens5``, ``ib0`` on a node without InfiniBand). Every rank then loads its
model and only fails at ``init_process_group``: gloo with "Unable to find address for: <name>"
(Megatron-LM#436), NCCL with "Bootstrap : no socket interface found", or, on a node where the
name exists but is not routed, a rendezvous that never completes. Named here before any rank starts.

The rules are the libraries' own: gloo takes a comma-separated list of exact interface names
(ProcessGroupGloo, one device per name); NCCL a comma-separated list of name prefixes, exact names
after a leading ``=``, and an exclusion list after a leading ``^`` (which cannot name a missing
interface, so it is not checked).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Callable, Mapping, Sequence

from shardkit.core.findings import Finding, Severity

IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def host_interfaces(sys_class_net: Path = Path("/sys/class/net")) -> list[str]:
    """This host's network interface names (socket.if_nameindex, else /sys/class/net)."""
    try:
        return sorted(name for _, name in socket.if_nameindex())
    except (OSError, AttributeError):
        try:
            return sorted(os.listdir(sys_class_net))
        except OSError:
            return []


def missing_interfaces(variable: str, value: str, interfaces: Sequence[str]) -> list[str]:
    """The entries of ``value`` that match no interface in ``interfaces``, by ``variable``'s rule
    (gloo: exact names, every one must exist; NCCL: prefixes, or exact after '=', and one match is
    enough, so all entries are missing or none)."""
    entries = [e.strip() for e in value.split(",") if e.strip()]
    if variable == "GLOO_SOCKET_IFNAME":
        return [e for e in entries if e not in interfaces]
    if value.startswith("^"):
        return []  # an exclusion list: never names a missing interface
    exact = value.startswith("=")
    names = [e.lstrip("=") for e in entries]
    matched = any((i == n) if exact else i.startswith(n) for n in names for i in interfaces)
    return [] if matched else names


def ifname_findings(
    environ: Mapping[str, str] | None = None, interfaces: Sequence[str] | None = None
) -> list[Finding]:
    """An error for each of GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME that names no interface here."""
    env = os.environ if environ is None else environ
    have = list(host_interfaces() if interfaces is None else interfaces)
    out: list[Finding] = []
    for variable in IFNAME_VARIABLES:
        value = env.get(variable)
        if not value or not value.strip() or not have:
            continue  # unset, or the interface list could not be read: nothing to compare with
        missing = missing_interfaces(variable, value.strip(), have)
        if not missing:
            continue
        backend = "gloo" if variable.startswith("GLOO") else "NCCL"
        symptom = ("gloo fails every rank at init_process_group with 'Unable to find address for: "
                   f"{missing[0]}'" if backend == "gloo" else
                   "NCCL fails every rank at its first collective with 'Bootstrap : no socket interface found'")
        message = (f"{variable}={value!r} names {', '.join(repr(m) for m in missing)}, which this host does not have "
                   f"(its interfaces: {', '.join(have)}): {symptom}, after every rank has loaded its model; a name "
                   "that exists but is not routed between nodes makes the rendezvous hang instead.")
        fix = (f"`export {variable}=<one of {', '.join(i for i in have if i != 'lo') or 'lo'}>` (the interface the nodes "
               f"reach each other on), or `unset {variable}` to let {backend} choose")
        out.append(Finding(Severity.ERROR, f"env:{variable}", value, message, fix, "env:socket-ifname"))
    return out


def _addresses(host: str) -> list[str]:
    return sorted({str(info[4][0]) for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)})


def loopback_rendezvous_warning(
    host: str, nodes: int, resolve: Callable[[str], list[str]] = _addresses
) -> str | None:
    """A rendezvous across ``nodes`` nodes whose host is a loopback address here ('localhost',
    127.x, ::1): each node's agent then hosts its own store on its own loopback and waits for nodes
    that never come, in silence until join_timeout (600 s) ends it with a bare
    RendezvousTimeoutError. A warning, not an error: "nodes" that are all this host (a test of a
    multi-node set-up on one machine) do meet there."""
    if nodes < 2:
        return None
    own = {socket.gethostname().lower(), socket.getfqdn().lower()} - {"localhost", "localhost.localdomain"}
    if host.lower() in own:
        # this node's own name: Debian-style /etc/hosts maps it to 127.0.1.1 here, yet the other
        # nodes resolve it through DNS, and torch's agent here hosts the store on every interface
        return None
    try:
        addresses = resolve(host)
    except OSError:
        return None  # not resolvable here: named after the failure (shardkit.run.rendezvous_diagnosis)
    if not addresses or not all(a.startswith("127.") or a in ("::1", "0:0:0:0:0:0:0:1") for a in addresses):
        return None
    return (f"the rendezvous host {host!r} is this machine's loopback ({', '.join(addresses)}) but the run spans "
            f"{nodes} nodes: on separate machines every node would host its own store and wait, printing nothing, "
            "until join_timeout (600 s by default). Fix: use the first node's hostname or an address every node "
            "reaches (Slurm: MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n1)); ignore this "
            "if every node is this machine")
