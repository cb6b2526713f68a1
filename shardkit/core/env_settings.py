"""Every ``SHARDKIT_*`` environment variable, in one table, read through one helper.

A value a user sets and shardkit drops silently is a setting that does not do what it says
(``SHARDKIT_SILENCE_S=abc`` once meant "the default, nothing said"). So each variable is declared
here once (:data:`SETTINGS`: its kind, default, accepted form and what it does), and every module
reads it through :func:`read_seconds` / :func:`read_choice` / :func:`read_text`: a value that does
not parse is refused naming the variable, the value seen and the accepted form (``UsageError``,
exit 2), or, where a run is already under way and stopping it would lose work, warned about once on
stderr and the default used (``during_run=True``). docs/cli.md lists the table
(tests/test_env_settings.py holds the two together).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Mapping

from shardkit.core.errors import UsageError


@dataclass(frozen=True)
class Setting:
    """One ``SHARDKIT_*`` variable."""

    name: str
    kind: str
    """'seconds' (a number >= 0; 0 where ``zero_means`` says), 'choice', 'flag' (1 or 0), 'address'
    (``host`` or ``host:port``), 'path' or 'text' (any text is a value: only the consumer can judge it)."""
    default: str
    """The value used when the variable is unset or empty, as shown in the docs."""
    accepted: str
    """The accepted form, as a refusal names it."""
    what: str
    """What the variable does, one line."""
    choices: tuple[str, ...] = ()
    zero_means: str = ""
    """For 'seconds': what 0 means (empty: 0 is refused as a wait of nothing)."""
    internal: bool = False
    """Set by shardkit launch for its ranks; a user does not set it."""
    needs: tuple[tuple[str, str], ...] = ()
    """For 'choice': (choice, Python package) pairs, a choice that works only with that package
    importable. Refused (or, during a run, warned about) when the variable is read, so a command stops
    at start rather than when it first hashes a file."""


SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("SHARDKIT_SILENCE_S", "seconds", "120", "a number of seconds >= 0 (0 turns the reports off)",
            "a rank (or a split command's process) silent this long says where it waits, and again at each interval",
            zero_means="never report"),
    Setting("SHARDKIT_STALE_LOCK_S", "seconds", "600", "a number of seconds >= 0",
            "a DeepSpeed op-build lock unchanged this long, with no builder seen, counts as left by a dead build",
            zero_means="any lock without a live builder is stale at once"),
    Setting("SHARDKIT_STALE_S", "seconds", "60", "a number of seconds > 0",
            "a split command's claim or heartbeat older than this belongs to a process that is gone"),
    Setting("SHARDKIT_JOIN_TIMEOUT_S", "seconds", "120", "a number of seconds > 0",
            "how long the processes of a split command (srun/torchrun) wait for each other to appear"),
    Setting("SHARDKIT_HASH", "choice", "blake3", "blake3 or sha256",
            "the content digest new manifests use (sha256 for tools that only know sha256)",
            choices=("blake3", "sha256"), needs=(("blake3", "blake3"),)),
    Setting("SHARDKIT_AUTOPREFLIGHT_TIMEOUT", "seconds", "120", "a number of seconds > 0",
            "how long a rank's automatic preflight waits for the other ranks to reach it"),
    Setting("SHARDKIT_AUTOPREFLIGHT_JSON", "path", "(none)", "a file path",
            "rank 0 of `shardkit launch` also writes the preflight report there as JSON"),
    Setting("SHARDKIT_LAUNCH_ADDR", "address", "(the launch host's address)",
            "a host name or IP address, optionally :port (0-65535; an IPv6 address with a port in brackets: [::1]:29600)",
            "where the ranks of `shardkit launch` report to the launch (a node that cannot reach its default address)"),
    Setting("SHARDKIT_AUTOPREFLIGHT", "flag", "(set by shardkit launch)", "1", "the ranks run the automatic preflight",
            internal=True),
    Setting("SHARDKIT_AUTOPREFLIGHT_CONFIG", "path", "(set by shardkit launch)", "a file path",
            "the config the launch found, for the ranks' expected devices", internal=True),
    Setting("SHARDKIT_LAUNCH_REPORT", "text", "(set by shardkit launch)", "host:port/token",
            "where each rank of `shardkit launch` reports its preflight (armed, passed, failed, skipped)", internal=True),
    Setting("SHARDKIT_AUTOPREFLIGHT_RANK_FROM", "choice", "(set by shardkit launch)", "pmi",
            "a rank started with no RANK yet (DeepSpeed's slurm runner: srun runs the script) knows itself by "
            "PMIX_RANK or PMI_RANK", choices=("pmi",), internal=True),
    Setting("SHARDKIT_AUTOPREFLIGHT_ARMED_PID", "text", "(set by an armed rank)", "a process id",
            "the rank that armed the preflight; a child process that inherits it neither arms nor reports", internal=True),
)}


def _raw(name: str, environ: Mapping[str, str] | None) -> str:
    if name not in SETTINGS:  # a programming error, never a user's: every variable is declared above
        raise KeyError(f"{name} is not declared in shardkit.core.env_settings.SETTINGS")
    return (os.environ if environ is None else environ).get(name, "").strip()


def _bad(name: str, raw: str, why: str, default: str, during_run: bool) -> None:
    setting = SETTINGS[name]
    shown = setting.default if setting.default.startswith("(") else f"({setting.default})"
    text = (f"{name}={raw!r} {why}: expected {setting.accepted} ({setting.what}); "
            f"set it so, or unset it for the default {shown}")
    if not during_run:
        raise UsageError(text)
    # a run is under way (a rank, a launch's ranks): stopping now would lose its work, so say it once
    warned = _WARNED
    if (name, raw) not in warned:
        warned.add((name, raw))
        print(f"shardkit: warning: {text}; using {default} for this run", file=sys.stderr, flush=True)


_WARNED: set[tuple[str, str]] = set()


def read_seconds(name: str, default: float, environ: Mapping[str, str] | None = None, *,
                 during_run: bool = False) -> float:
    """The variable's seconds, ``default`` when unset or empty. Not a finite number, negative, or
    0 where 0 means nothing: refused (``UsageError``), or warned about and ``default`` used when
    ``during_run``."""
    raw = _raw(name, environ)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        _bad(name, raw, "is not a number", f"{default:g}", during_run)
        return default
    if not math.isfinite(value) or value < 0:
        _bad(name, raw, "is not a finite number >= 0", f"{default:g}", during_run)
        return default
    if value == 0 and not SETTINGS[name].zero_means:
        _bad(name, raw, "is 0, a wait of nothing", f"{default:g}", during_run)
        return default
    return value


def read_choice(name: str, default: str, environ: Mapping[str, str] | None = None, *, during_run: bool = False) -> str:
    """The variable's value (lower-cased) when it is one of its choices, ``default`` when unset."""
    raw = _raw(name, environ).lower()
    if not raw:
        return default
    if raw not in SETTINGS[name].choices:
        _bad(name, raw, "is not one of " + ", ".join(SETTINGS[name].choices), default, during_run)
        return default
    missing = _missing_package(name, raw)
    if missing is not None:
        if not during_run:
            raise UsageError(missing)
        if (name, raw) not in _WARNED:
            _WARNED.add((name, raw))
            print(f"shardkit: warning: {missing}; using {default} for this run", file=sys.stderr, flush=True)
        return default
    return raw


def _missing_package(name: str, choice: str) -> str | None:
    """Why ``name=choice`` cannot work here (a package it needs does not import) and the fix, else None."""
    import importlib

    setting = SETTINGS[name]
    for needing, package in setting.needs:
        if needing != choice:
            continue
        try:
            importlib.import_module(package)
        except ImportError as exc:
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            others = " or ".join(f"{name}={c}" for c in setting.choices if c != choice)
            return (f"{name}={choice!r} needs the Python package {package} ({setting.what}), which does not import "
                    f"here ({why}): pip install {package}, or set {others}")
    return None


def read_address(name: str, environ: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """The variable's (host, port), port 0 when none is given (any free port); None when unset. A
    port that is not a number in 0-65535, an empty host or one with characters no host name or IP
    address holds: refused (``UsageError``), not met as an OverflowError when a socket binds it."""
    raw = _raw(name, environ)
    if not raw:
        return None
    host, port = raw, ""
    if raw.startswith("["):  # [IPv6] or [IPv6]:port
        inside, closed, rest = raw[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            _bad(name, raw, "has an unclosed or misplaced ']'", "", False)
        host, port = inside, rest[1:]
        if rest and not port:
            _bad(name, raw, "ends in ':' with no port", "", False)
    elif raw.count(":") == 1:  # host:port (a bare IPv6 address has several colons and no port)
        host, port = raw.split(":")
        if not port:
            _bad(name, raw, "ends in ':' with no port", "", False)
    if not host:
        _bad(name, raw, "names no host", "", False)
    if not all(c.isalnum() or c in ".-_:%" for c in host):
        _bad(name, raw, f"has a host {host!r} with characters no host name or IP address holds", "", False)
    if port and not (port.isdigit() and int(port) <= 65535):
        _bad(name, raw, f"has the port {port!r}, not a number in 0-65535", "", False)
    return host, int(port or 0)


def read_text(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The variable's value, None when unset or empty (paths and flags: any text is a value)."""
    return _raw(name, environ) or None


def unknown_settings(environ: Mapping[str, str] | None = None) -> list[str]:
    """``SHARDKIT_*`` variables set here that shardkit does not read (a typo sets nothing)."""
    env = os.environ if environ is None else environ
    return sorted(k for k in env if k.startswith("SHARDKIT_") and k not in SETTINGS and not k.startswith(_OTHER_PREFIXES))


#: Prefixes the repository's own scripts use (benchmarks, the local Slurm cluster, the release verifier).
_OTHER_PREFIXES: tuple[str, ...] = ("SHARDKIT_BENCH_", "SHARDKIT_SLURM_", "SHARDKIT_DEPS")


def check_all(environ: Mapping[str, str] | None = None) -> None:
    """Every declared variable that is set, read once: the first bad one refused (commands call this
    at start, so a bad value is named before any work, not when the code that reads it is reached)."""
    for name, setting in SETTINGS.items():
        if setting.kind == "seconds":
            read_seconds(name, 0.0 if setting.zero_means else 1.0, environ)
        elif setting.kind == "choice":
            read_choice(name, setting.default, environ)
        elif setting.kind == "address":
            read_address(name, environ)


def warn_unknown(environ: Mapping[str, str] | None = None) -> list[str]:
    """One warning on stderr per ``SHARDKIT_*`` variable shardkit does not read, with the declared name it
    most resembles: a typo (``SHARDKIT_SILENSE_S``) otherwise sets nothing and says nothing. Returns them."""
    import difflib

    unknown = unknown_settings(environ)
    for name in unknown:
        near = difflib.get_close_matches(name, list(SETTINGS), n=1, cutoff=0.75)
        hint = f"did you mean {near[0]}?" if near else "the variables shardkit reads are listed in docs/cli.md"
        print(f"shardkit: warning: {name} is set, but shardkit reads no such variable, so it changes nothing "
              f"({hint}); unset it or correct the name", file=sys.stderr, flush=True)
    return unknown


def docs_table() -> str:
    """The Markdown table docs/cli.md shows under "Environment variables" (tests/test_env_settings.py
    compares the two, so the page cannot drift from this table)."""
    rows = ["| variable | default | accepted | what it does |", "|---|---|---|---|"]
    for s in SETTINGS.values():
        what = s.what + (f"; 0: {s.zero_means}" if s.zero_means else "")
        what += " (set by `shardkit launch` for its ranks; not for users)" if s.internal else ""
        rows.append(f"| `{s.name}` | {s.default} | {s.accepted} | {what.replace('|', '/')} |")
    return "\n".join(rows) + "\n"
