"""What a rank sends back and how the parent collects it.

A rank writes its return value, or its traceback, as ``rank<N>.pkl`` in the run's directory
(:func:`send_result`: a temporary file renamed into place, so the parent never reads half of one);
the parent reads each rank's file into a :class:`RankResult` (:func:`_collect`) and sums the failed
ones up (:func:`failure_line` for one rank, :func:`_failure_message` for the run).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class RankResult:
    """What one spawned rank ended with."""

    rank: int
    exitcode: int | None
    """Process exit code; None when it had to be killed."""
    value: Any = None
    """The target's return value (must pickle)."""
    error: str | None = None
    """Formatted traceback when the target raised."""
    error_type: str | None = None
    """Class name of the exception the target raised."""
    error_message: str | None = None
    """``str(exception)`` when the target raised."""

    @property
    def ok(self) -> bool:
        return self.exitcode == 0 and self.error is None


def failure_line(result: RankResult) -> str:
    """A failed rank in one line, the same in every command: ``Type: first line of the message``
    when the target raised (just ``Type`` for an empty or blank message), else the last line of
    what is known (killed at the timeout, died without a result), else its exit code."""
    if result.error_type:
        message = next((line.strip() for line in (result.error_message or "").splitlines() if line.strip()), "")
        return f"{result.error_type}: {message}" if message else result.error_type
    lines = [line.strip() for line in (result.error or "").splitlines() if line.strip()]
    return lines[-1] if lines else f"exit code {result.exitcode}"


def clear_results(base: Path) -> None:
    """Remove the results an earlier run left in ``base`` (a reused workdir)."""
    for stale in [*base.glob("rank*.pkl"), *base.glob(".rank*.tmp")]:
        stale.unlink(missing_ok=True)


def send_result(result_dir: str, rank: int, result: dict[str, Any]) -> bool:
    """Rank side: leave ``result`` where the parent collects it. False when it did not pickle (a
    return value that cannot be sent); an error naming that is sent instead."""
    sent = True
    try:
        payload = pickle.dumps(result)
    except Exception as exc:  # the return value did not pickle
        payload = pickle.dumps({"rank": rank, "error": f"result of rank {rank} cannot be pickled: {exc}"})
        sent = False
    tmp = Path(result_dir) / f".rank{rank}.tmp"
    tmp.write_bytes(payload)
    tmp.replace(Path(result_dir) / f"rank{rank}.pkl")
    return sent


def _collect(base: Path, rank: int, exitcode: int | None) -> RankResult:
    path = base / f"rank{rank}.pkl"
    if not path.exists():
        msg = None  # killed ranks get their message from the caller
        if exitcode is not None:
            msg = f"rank {rank} exited with code {exitcode} without reporting a result (killed, os._exit, or a hard crash)"
        return RankResult(rank=rank, exitcode=exitcode, error=msg)
    data = pickle.loads(path.read_bytes())
    return RankResult(
        rank=rank,
        exitcode=exitcode,
        value=data.get("value"),
        error=data.get("error"),
        error_type=data.get("error_type"),
        error_message=data.get("error_message"),
    )


def _failure_message(results: list[RankResult], timed_out: bool, timeout: float) -> str:
    bad = [r for r in results if not r.ok]
    head = (
        f"ranks {[r.rank for r in bad]} did not finish within {timeout:.0f}s"
        if timed_out
        else f"{len(bad)} of {len(results)} ranks failed: {[r.rank for r in bad]}"
    )
    parts = [head]
    for r in bad:
        parts.append(f"--- rank {r.rank} (exit code {r.exitcode}) ---\n{(r.error or '').rstrip()}")
    return "\n".join(parts)
