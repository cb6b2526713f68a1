"""The preflight verdict as plain data, and its renderings: a text table, a per-device summary, JSON.

The same text goes into the PreflightError every rank raises and onto rank 0's stdout, so what a
user reads in any rank's log is what rank 0 printed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardkit.core.findings import Finding, Severity
from shardkit.placement.fixes import fix_for, fix_lines, meta_fix_line
from shardkit.placement.records import PlacementRecord, RankReport
from shardkit.placement.summary import MAX_NAMED_PER_RANK, RankSummary, summarize

# Beyond this many rows the table is cut (the JSON report keeps every record).
MAX_TABLE_ROWS = 40


@dataclass
class PlacementReport:
    """Every rank's records plus the findings of the cross-rank checks."""

    ranks: list[RankReport]
    """The full reports this process holds, ordered by rank: every rank's when judged in one process,
    only its own in a distributed preflight (peers ship summaries, never their records)."""
    summaries: list[RankSummary] = field(default_factory=list)
    """Every judged rank's summary (rank 0 of a distributed preflight holds all of them)."""
    findings: list[Finding] = field(default_factory=list)
    """Cross-rank findings (versions, config digest, parameter set, ZeRO-3 coverage, unmanaged ...)."""
    missing_ranks: list[int] = field(default_factory=list)
    """Ranks whose report never arrived within the timeout."""

    def _summaries(self) -> list[RankSummary]:
        if self.summaries:
            return self.summaries
        return [summarize(rep) for rep in self.ranks]

    @property
    def mismatches(self) -> list[PlacementRecord]:
        """Tensors on the wrong device: all of them for ranks whose full report is held, the first
        few a rank named in its summary for the others (``mismatch_count`` counts them all)."""
        held = {rep.rank for rep in self.ranks}
        own = [r for rep in self.ranks for r in rep.records if not r.ok]
        named = [r for s in self.summaries if s.rank not in held for r in s.misplaced]
        return sorted(own + named, key=lambda r: r.rank)

    @property
    def mismatch_count(self) -> int:
        """Tensors on the wrong device on every judged rank, including those a summary only counted."""
        held = {rep.rank for rep in self.ranks}
        return (sum(1 for rep in self.ranks for r in rep.records if not r.ok)
                + sum(s.misplaced_count for s in self.summaries if s.rank not in held))

    @property
    def rank_count(self) -> int:
        """Ranks judged (rank 0 of a distributed preflight judged every rank that arrived)."""
        return len(self.summaries) if self.summaries else len(self.ranks)

    @property
    def tensor_count(self) -> int:
        """Tensors checked on every judged rank."""
        return sum(s.n_tensors for s in self._summaries())

    @property
    def errors(self) -> list[Finding]:
        """The cross-rank findings of severity ERROR (each fails the preflight)."""
        return [f for f in self.findings if f.severity is Severity.ERROR]

    @property
    def ok(self) -> bool:
        """True when every rank arrived, no tensor is on the wrong device and no cross-rank check failed."""
        return not self.missing_ranks and not self.mismatch_count and not self.errors

    @property
    def exit_code(self) -> int:
        """0 when ``ok``, else 1: the exit status this verdict stands for."""
        return 0 if self.ok else 1

    def bytes_by_device(self) -> dict[int, dict[str, int]]:
        """rank -> device -> bytes held, each storage counted once (views and aliases share one)."""
        return {s.rank: dict(s.bytes_by_device) for s in self._summaries()}

    def _bytes_by_role(self) -> dict[int, dict[str, int]]:
        """``bytes_by_device`` with each rank's own compute device as '<type> (own)', so ranks of one
        model on cuda:0..7 of every node hold the same row (and 1,024 ranks print as a few rows)."""
        out: dict[int, dict[str, int]] = {}
        for s in self._summaries():
            per = out.setdefault(s.rank, {})
            for dev, n in s.bytes_by_device.items():
                key = f"{dev.split(':')[0]} (own)" if dev == s.compute_device and ":" in dev else dev
                per[key] = per.get(key, 0) + n
        return out

    def _engine(self) -> str:
        """The one engine every judged rank ran (``deepspeed-zero3`` ...), '' when they differ."""
        engines = {s.engine for s in self._summaries()}
        return engines.pop() if len(engines) == 1 else ""

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON data: the verdict, mismatches with their fixes, findings, bytes per device, and
        every rank's report and summary (what ``--json`` prints and ``--json-file`` writes)."""
        return {
            "ok": self.ok,
            "world_size": self.rank_count + len(self.missing_ranks),
            "missing_ranks": self.missing_ranks,
            "mismatch_count": self.mismatch_count,
            "mismatches": [r.to_dict() for r in self.mismatches],
            "fixes": {k: fix_for(k, self._engine()) for k in dict.fromkeys(r.kind for r in self.mismatches)},
            "findings": [f.to_dict() for f in self.findings],
            "bytes_by_device": {str(k): v for k, v in self.bytes_by_device().items()},
            "ranks": [rep.to_dict() for rep in self.ranks],
            "summaries": [s.to_dict() for s in self._summaries()],
        }

    def render(self) -> str:
        """Plain-text verdict: mismatch table, findings, bytes per device per rank."""
        lines: list[str] = []
        summaries = self._summaries()
        n_tensors = self.tensor_count
        engines = sorted({s.engine for s in summaries}) or ["?"]
        engine = self._engine()
        head = f"placement preflight ({', '.join(engines)}, {self.rank_count} rank(s), {n_tensors} tensors)"
        if self.ok:
            lines.append(f"{head}: ok")
        else:
            problems = self.mismatch_count + len(self.errors) + (1 if self.missing_ranks else 0)
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
            shown = min(len(mm), MAX_TABLE_ROWS)
            if self.mismatch_count > shown:
                lines.append(f"... and {self.mismatch_count - shown} more (each rank names its first "
                             f"{MAX_NAMED_PER_RANK} in the JSON report, json_path= / --json; the full list is in "
                             "collect_records on that rank)")
            lines.append("how to fix:")
            lines += fix_lines([r.kind for r in mm], engine)
            lines += meta_fix_line([r.actual for r in mm])
        if self.findings:
            lines.append("")
            lines.append("cross-rank findings:")
            for f in self.findings:
                lines.append(f"- [{f.severity.value}] {f.key}: {f.message} Fix: {f.fix}")
        summary = self._bytes_by_role()
        if summary:
            devices = sorted({d for per in summary.values() for d in per})
            rows = [["rank", *devices]]
            # ranks holding the same bytes on every device share one row: 1,024 ranks of one model
            # are a few rows, not a page every rank reads
            for ranks, per in _same_rows(summary):
                rows.append([ranks, *[_human(per.get(d, 0)) for d in devices]])
            lines.append("")
            lines.append("bytes per device per rank (own = the rank's compute device):")
            lines += _table(rows)
        return "\n".join(lines)


def _same_rows(summary: dict[int, dict[str, int]]) -> list[tuple[str, dict[str, int]]]:
    runs: list[tuple[list[int], dict[str, int]]] = []
    for rank in sorted(summary):
        if runs and runs[-1][1] == summary[rank] and runs[-1][0][-1] == rank - 1:
            runs[-1][0].append(rank)
        else:
            runs.append(([rank], summary[rank]))
    out = [(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}", per) for r, per in runs[:MAX_TABLE_ROWS]]
    if len(runs) > MAX_TABLE_ROWS:
        out.append((f"... {len(runs) - MAX_TABLE_ROWS} more", {}))
    return out


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
