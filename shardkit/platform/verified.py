"""The verified-releases record (shardkit/data/verified_releases.json): which combinations of the
packages in :data:`PACKAGES` were run end to end, and, for an installed combination that is not one
of them, which package differs from the closest row and by how much.

A row names every package it vouches for: ``deepspeed`` and ``torch`` as one release each (compared
by release number, so ``2.13.0+cpu`` and ``2.13.0+cu121`` are one torch), ``transformers`` as one
release or as the list of releases it was run with, read as the range from the oldest to the newest
of them. A row that leaves a package out vouches for nothing about it: the installed combination is
then not verified by that row, and the reason says so. Nothing here imports torch or deepspeed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

from packaging.version import InvalidVersion, Version

#: The packages a verified row names and ``shardkit versions`` compares, in the order it shows them.
PACKAGES = ("torch", "deepspeed", "transformers")


def verified_releases(data: Any = None) -> list[dict[str, Any]]:
    """Rows of shardkit/data/verified_releases.json whose ``result`` is "pass", [] when absent.

    The verification run records failures too (``"result": "fail"``, what broke); a failed row
    must never make a release read as verified. Accepted shapes: a list of {"deepspeed": ..,
    "torch": .., "result": ..} or {"releases": [...]}; ``data`` is the parsed file (read when None).
    """
    if data is None:
        try:
            text = resources.files("shardkit").joinpath("data/verified_releases.json").read_text("utf-8")
            data = json.loads(text)
        except (FileNotFoundError, OSError, ValueError):
            return []
    rows = data.get("releases", data.get("verified", [])) if isinstance(data, dict) else data
    return [r for r in rows if isinstance(r, dict) and r.get("result") == "pass"] if isinstance(rows, list) else []


def verified_deepspeed_releases() -> list[str]:
    out = []
    for row in verified_releases():
        v = row.get("deepspeed")
        if isinstance(v, str):
            try:
                Version(v)
            except InvalidVersion:
                continue
            out.append(v)
    return out


def _release(text: str) -> Version:
    """The release number alone: "2.13.0+cpu" -> 2.13.0 (raises InvalidVersion)."""
    return Version(Version(text).base_version)


def recorded_range(recorded: Any) -> tuple[Version, Version] | None:
    """(oldest, newest) release a row's cell was run with: one release, or a list of releases; None
    when the cell is absent or not a version."""
    values = recorded if isinstance(recorded, list) else [recorded]
    try:
        releases = [_release(v) for v in values if isinstance(v, str)]
    except InvalidVersion:
        return None
    if not releases or len(releases) != len(values):
        return None
    return min(releases), max(releases)


def show_recorded(recorded: Any) -> str:
    """A row's cell as the docs table and a reason show it: "2.13.0+cpu", "5.23.0-5.24.0"."""
    if isinstance(recorded, list):
        span = recorded_range(recorded)
        return f"{span[0]}-{span[1]}" if span and span[0] != span[1] else ", ".join(map(str, recorded))
    return str(recorded)


def _how_far(installed: Version, low: Version, high: Version) -> str:
    """By how much ``installed`` lies outside [low, high]: "2 minor releases newer than 5.24.0"."""
    newer = installed > high
    edge = high if newer else low
    for place, (a, b) in zip(("major", "minor", "patch"), zip(installed.release + (0, 0), edge.release + (0, 0))):
        if a != b:
            n = abs(a - b)
            return f"{n} {place} release{'s' if n > 1 else ''} {'newer' if newer else 'older'} than {edge}"
    return f"{'newer' if newer else 'older'} than {edge}"  # a pre/post/dev release of the edge itself


def package_differs(name: str, recorded: Any, installed: str | None) -> str | None:
    """Why ``installed`` is not what a row's ``name`` cell vouches for, None when it is."""
    span = recorded_range(recorded)
    if recorded is None:
        return f"the row records no {name} version, so it vouches for none"
    if installed is None:
        return f"{name} is not installed (the row ran {show_recorded(recorded)})"
    if span is None:
        return None if recorded == installed else f"{name} {installed} is not the row's {recorded!r}"
    try:
        seen = _release(installed)
    except InvalidVersion:
        return f"{name} {installed!r} is not a version the row's {show_recorded(recorded)} can be compared with"
    low, high = span
    if low <= seen <= high:
        return None
    ran = "" if low == high else f" (the row ran {low} to {high})"
    return f"{name} {installed} is {_how_far(seen, low, high)}{ran}"


@dataclass(frozen=True)
class Match:
    """How an installed combination compares with the verified rows."""

    verified: bool
    why: str
    """Empty when verified; else which package differs from the closest row and by how much."""


def match(versions: dict[str, str | None], rows: list[dict[str, Any]]) -> Match:
    """Whether a passing row vouches for every package of ``versions``; if not, why, against the
    closest row (the one with the same DeepSpeed release and the fewest differing packages)."""
    if not rows:
        return Match(False, "the verified-releases record has no passing row")
    best: tuple[int, dict[str, Any], list[str]] | None = None
    for row in rows:
        differs = [d for name in PACKAGES if (d := package_differs(name, row.get(name), versions.get(name)))]
        if not differs:
            return Match(True, "")
        rank = len(differs) + (10 if package_differs("deepspeed", row.get("deepspeed"), versions.get("deepspeed")) else 0)
        if best is None or rank < best[0]:
            best = (rank, row, differs)
    _, row, differs = best if best is not None else (0, {}, [])
    cells = ", ".join(f"{name} {show_recorded(row.get(name))}" for name in PACKAGES if row.get(name) is not None)
    return Match(False, f"{'; '.join(differs)}; closest verified row: {cells} ({row.get('date', 'undated')}). "
                        "Install those releases for a combination that was run end to end, or see docs/versions.md")
