"""What commands do with the environment findings: ``require_runnable_here`` stops a run before
anything starts with one line (``one_line``) when this machine cannot run its configs, and
``version_report`` is what `shardkit versions` shows (installed versions, support status, the
table rows that apply, this machine's environment rows included).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from shardkit.config.loading import config_kind
from shardkit.core.errors import ShardkitError
from shardkit.core.findings import Finding, Report, Severity
from shardkit.platform.environment.ext_lock import ExtensionLock, describe, extension_lock_findings, inspect_locks
from shardkit.platform.environment.facts import EnvironmentFacts, probe_environment, run_has_accelerator
from shardkit.platform.environment.interfaces import ifname_findings, loopback_rendezvous_warning
from shardkit.platform.environment.rows import environment_findings
from shardkit.platform.versions import (
    SUPPORTED_DEEPSPEED,
    installed_versions,
    known_bad_findings,
    parse_version,
    support_status,
)


class EnvironmentCheckError(ShardkitError, RuntimeError):
    """This machine cannot run what was asked (a known-bad environment row at error level)."""


def one_line(finding: Finding) -> str:
    """A finding as the single line a command stops with: key, value, what and why, then the fix."""
    return f"{finding.key}={finding.value!r}: {finding.message} Fix: {finding.fix}"


def require_runnable_here(
    configs: Mapping[str, Mapping[str, Any]],
    *,
    accelerator: bool | None = None,
    facts: EnvironmentFacts | None = None,
) -> list[Finding]:
    """Stop before anything starts when this machine cannot run ``configs`` (name -> DeepSpeed or
    FSDP2 config, run here; ``accelerator``: whether the ranks use a GPU, default what this machine
    has). Raises EnvironmentCheckError with the first error's one line; returns the warnings."""
    facts = facts or probe_environment()
    accelerator = run_has_accelerator(accelerator, facts)
    warnings: list[Finding] = []
    for name, cfg in configs.items():
        engine = "fsdp" if isinstance(cfg.get("fsdp"), dict) else "deepspeed"
        for f in environment_findings(cfg, facts=facts, accelerator=accelerator, engine=engine):
            if f.severity is Severity.ERROR:
                raise EnvironmentCheckError(f"{name}: this machine cannot run it: {one_line(f)}")
            if f not in warnings:
                warnings.append(f)
    return warnings


def require_no_hang_traps(
    environ: Mapping[str, str] | None = None,
    *,
    loads_deepspeed_ops: bool = True,
    cross_node: tuple[str, int] | None = None,
    warn: Callable[[str], None] | None = None,
) -> list[ExtensionLock]:
    """Stop before any rank starts when it would wait forever in silence: a build lock with no live
    builder in the torch extensions cache the ranks use (``ext_lock``), or GLOO_SOCKET_IFNAME /
    NCCL_SOCKET_IFNAME naming an interface this host lacks (``interfaces``). ``environ``: the ranks'
    environment. ``loads_deepspeed_ops``: False for runs known to load no op (FSDP2 only), where a
    stale lock is only a warning. ``cross_node``: (rendezvous host, nodes) of a run across nodes,
    warned about when the host is this machine's loopback. Other locks (a build in progress, or one
    that cannot be told) are passed to ``warn`` (one line each, default stderr) and returned;
    raises EnvironmentCheckError naming the problems."""
    import sys

    locks = inspect_locks(environ)
    blocking = [lock for lock in locks if lock.verdict == "stale" and loads_deepspeed_ops]
    problems = [describe(lock) for lock in blocking]
    problems += [one_line(f) for f in ifname_findings(environ)]
    if problems:
        raise EnvironmentCheckError(
            "not started: every rank would hang in silence or fail at its rendezvous: " + "; ".join(problems)
        )
    say = warn or (lambda line: print(line, file=sys.stderr, flush=True))
    for lock in locks:
        say(f"warning: {describe(lock)}")
    loopback = loopback_rendezvous_warning(*cross_node) if cross_node else None
    if loopback:
        say(f"warning: {loopback}")
    return locks


def version_report(
    cfg: dict[str, Any] | None,
    *,
    deepspeed_version: str | None = None,
    source: str | None = None,
    environment: Any = None,
) -> tuple[dict[str, Any], Report]:
    """What `shardkit versions` shows: installed versions, support status, and the table rows that
    apply (to ``cfg`` when given) as a Report, this machine's environment rows included.

    ``environment``: shardkit.platform.environment.facts.EnvironmentFacts to evaluate instead of probing this
    machine; False leaves the environment rows out.
    """

    installed = installed_versions()
    ds = str(parse_version(deepspeed_version)) if deepspeed_version else installed.get("deepspeed")
    status = support_status({**installed, "deepspeed": ds} if ds else installed)
    subject = f"deepspeed {ds}" + (f" with {source}" if source else "") if ds else "deepspeed (not installed)"
    report = Report(subject=subject)
    if ds:
        report.extend(known_bad_findings(cfg, ds, installed.get("torch")))
    if environment is not False:
        engine = "fsdp" if cfg is not None and config_kind(cfg) == "fsdp" else "deepspeed"
        report.extend(environment_findings(cfg, facts=environment, deepspeed_version=ds, engine=engine))
    if environment is None:  # this machine (not facts given by a caller): what would hang a run here
        report.extend(extension_lock_findings())
        report.extend(ifname_findings())
    data = {
        "installed": installed,
        "deepspeed": ds,
        "support": {
            "range": str(SUPPORTED_DEEPSPEED),
            "supported": status.supported,
            "verified": status.verified,
            "verified_why": status.why,
            "notes": status.notes,
        },
    }
    return data, report
