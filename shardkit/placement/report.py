"""The preflight verdict as plain data, and its renderings: a text table, a per-device summary, JSON.

The same text goes into the PreflightError every rank raises and onto rank 0's stdout, so what a
user reads in any rank's log is what rank 0 printed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardkit.core.findings import Finding, Severity
from shardkit.placement.records import PlacementRecord, RankReport

# Beyond this many rows the table is cut (the JSON report keeps every record).
MAX_TABLE_ROWS = 40


@dataclass
class PlacementReport:
    """Every rank's records plus the findings of the cross-rank checks."""

    ranks: list[RankReport]
    """One report per rank, ordered by rank."""
    findings: list[Finding] = field(default_factory=list)
    """Cross-rank findings (versions, config digest, parameter set, ZeRO-3 coverage, unmanaged ...)."""
    missing_ranks: list[int] = field(default_factory=list)
    """Ranks whose report never arrived within the timeout."""

    @property
    def mismatches(self) -> list[PlacementRecord]:
        return [r for rep in self.ranks for r in rep.records if not r.ok]

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity is Severity.ERROR]

    @property
    def ok(self) -> bool:
        return not self.missing_ranks and not self.mismatches and not self.errors

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def bytes_by_device(self) -> dict[int, dict[str, int]]:
        """rank -> device -> bytes held, each storage counted once (views and aliases share one)."""
        out: dict[int, dict[str, int]] = {}
        for rep in self.ranks:
            seen: set[str] = set()
            per = out.setdefault(rep.rank, {})
            for r in rep.records:
                if r.storage:
                    if r.storage in seen:
                        continue
                    seen.add(r.storage)
                per[r.actual] = per.get(r.actual, 0) + (r.storage_bytes or r.bytes)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "world_size": len(self.ranks) + len(self.missing_ranks),
            "missing_ranks": self.missing_ranks,
            "mismatches": [r.to_dict() for r in self.mismatches],
            "findings": [f.to_dict() for f in self.findings],
            "bytes_by_device": {str(k): v for k, v in self.bytes_by_device().items()},
            "ranks": [rep.to_dict() for rep in self.ranks],
        }

    def render(self) -> str:
        """Plain-text verdict: mismatch table, findings, bytes per device per rank."""
        lines: list[str] = []
        n_tensors = sum(len(rep.records) for rep in self.ranks)
        engines = sorted({rep.engine for rep in self.ranks}) or ["?"]
        head = f"placement preflight ({', '.join(engines)}, {len(self.ranks)} rank(s), {n_tensors} tensors)"
        if self.ok:
            lines.append(f"{head}: ok")
        else:
            problems = len(self.mismatches) + len(self.errors) + (1 if self.missing_ranks else 0)
            lines.append(f"{head}: {problems} problem(s)")
        if self.missing_ranks:
            lines.append(f"missing ranks: {self.missing_ranks}")
        mm = self.mismatches
        if mm:
            lines.append("")
            lines.append("tensors on the wrong device:")
            rows = [["what", "actual", "expected", "rank", "bytes", "why expected"]]
            for r in mm[:MAX_TABLE_ROWS]:
                rows.append([r.name, r.actual, r.expected, str(r.rank), f"{r.bytes:,}", r.why])
            lines += _table(rows)
            if len(mm) > MAX_TABLE_ROWS:
                lines.append(f"... and {len(mm) - MAX_TABLE_ROWS} more (write them all with json_path= / --json)")
        if self.findings:
            lines.append("")
            lines.append("cross-rank findings:")
            for f in self.findings:
                lines.append(f"- [{f.severity.value}] {f.key}: {f.message} Fix: {f.fix}")
        summary = self.bytes_by_device()
        if summary:
            devices = sorted({d for per in summary.values() for d in per})
            rows = [["rank", *devices]]
            for rank in sorted(summary):
                rows.append([str(rank), *[_human(summary[rank].get(d, 0)) for d in devices]])
            lines.append("")
            lines.append("bytes per device per rank:")
            lines += _table(rows)
        return "\n".join(lines)


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = []
    for n, row in enumerate(rows):
        out.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return ["  " + line for line in out]


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)  # pragma: no cover
