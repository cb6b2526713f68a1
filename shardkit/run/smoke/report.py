"""The verdict of `shardkit smoke`: each engine's result (:class:`EngineResult`), the loss curves
compared (:func:`_compare`: bit-exact on CPU, within :data:`GPU_RTOL` on GPUs, and only with a
passed preflight), every engine's result (:class:`SmokeReport`) and the table the command prints.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from shardkit.core.render import console

# Losses on GPUs go through non-deterministic kernels (atomics in reductions): resumed curves agree
# to float noise, not bits. On CPU (gloo) every run is bit-exact and nothing less is accepted.
GPU_RTOL = 1e-4


@dataclass
class EngineResult:
    """The verdict for one engine."""

    engine: str
    ok: bool = False
    """All three runs finished, the preflight passed and the loss curves agree."""
    exact: bool = False
    """Resumed losses equal the uninterrupted ones bit for bit."""
    max_abs_diff: float | None = None
    """Largest |loss_resumed - loss_uninterrupted| over steps and ranks."""
    losses_uninterrupted: list[list[float]] = field(default_factory=list)
    """Run A: losses[rank][step]."""
    losses_resumed: list[list[float]] = field(default_factory=list)
    """Runs B then C concatenated: losses[rank][step]."""
    preflight: str = "not run"
    """Placement preflight after resume: passed, or not run (a failed preflight fails run C)."""
    checkpoint: str = ""
    """How the checkpoint was written and read (always through shardkit.checkpoint)."""
    config_source: str = ""
    """Where the config came from (a file, a preset, or generated)."""
    device: str = ""
    """The device rank 0 trained on."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall time per run."""
    failure: str | None = None
    """One line saying what failed, or None."""
    kept_checkpoint: str | None = None
    """Where run B's checkpoint was kept (``--keep-checkpoint``), or None when it was removed."""
    keep_error: str | None = None
    """Why ``--keep-checkpoint`` could not move the checkpoint there, and where it was left; None
    when it was kept or not asked for (the smoke's verdict is unchanged: the runs passed)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SmokeReport:
    """Every engine's result."""

    results: list[EngineResult]
    nproc: int
    steps: int

    @property
    def ok(self) -> bool:
        return bool(self.results) and all(r.ok for r in self.results)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "nproc": self.nproc, "steps": self.steps, "results": [r.to_dict() for r in self.results]}


def _compare(result: EngineResult) -> None:
    a, r = result.losses_uninterrupted, result.losses_resumed
    diffs = [abs(x - y) for ra, rr in zip(a, r) for x, y in zip(ra, rr)]
    result.max_abs_diff = max(diffs) if diffs else None
    result.exact = a == r
    on_gpu = not result.device.startswith("cpu")
    if any(math.isnan(x) for row in a + r for x in row):
        result.failure = "loss is NaN"
    elif result.exact or (on_gpu and all(math.isclose(x, y, rel_tol=GPU_RTOL) for ra, rr in zip(a, r) for x, y in zip(ra, rr))):
        # (close, not exact, only on GPUs: non-deterministic reductions; see GPU_RTOL)
        result.ok = result.preflight == "passed"
        if not result.ok:
            result.failure = (
                f"the placement preflight after resume did not pass (it was {result.preflight!r}); "
                "a resume counts only when every tensor was checked to be on its expected device"
            )
    else:
        step, rank = _first_difference(a, r)
        result.failure = (
            f"resumed loss differs from the uninterrupted run at step {step} on rank {rank}: "
            f"{r[rank][step]!r} vs {a[rank][step]!r} (max |diff| {result.max_abs_diff:.3g}); the checkpoint "
            "did not restore the full training state"
        )


def _first_difference(a: list[list[float]], r: list[list[float]]) -> tuple[int, int]:
    for step in range(min(len(a[0]), len(r[0]))):
        for rank in range(len(a)):
            if a[rank][step] != r[rank][step]:
                return step, rank
    return 0, 0


def print_smoke_report(report: SmokeReport, file: Any = None) -> None:
    """A short table: engine, verdict, exactness, preflight, checkpoint path, time; then failures."""
    from rich.table import Table

    con = console(file)
    table = Table(title=f"shardkit smoke: {report.nproc} ranks, {report.steps} steps, resume at step {report.steps // 2}")
    for col in ("engine", "result", "resumed vs uninterrupted", "preflight", "checkpoint save -> load", "device", "time"):
        table.add_column(col, overflow="fold")
    for r in report.results:
        verdict = "[green]pass[/]" if r.ok else "[bold red]FAIL[/]"
        if r.max_abs_diff is None:
            match = "-"
        elif r.exact:
            match = "bit-exact"
        else:
            match = f"max |diff| {r.max_abs_diff:.3g}"
        secs = sum(r.seconds.values())
        table.add_row(r.engine, verdict, match, r.preflight, r.checkpoint or "-", r.device or "-", f"{secs:.1f}s")
    con.print(table)
    for r in report.results:
        if r.ok and r.losses_uninterrupted:
            con.print(f"{r.engine}: rank 0 losses {', '.join(f'{x:.6f}' for x in r.losses_uninterrupted[0])} ({r.config_source} config)")
        if r.kept_checkpoint:
            con.print(f"{r.engine}: checkpoint kept in {r.kept_checkpoint} (try: shardkit verify {r.kept_checkpoint})")
        if r.keep_error:
            con.print(f"[yellow]warning[/] {r.engine}: {r.keep_error}")
    for r in report.results:
        if not r.ok:
            con.print(f"[bold red]FAIL[/] {r.engine}: {r.failure}")
    con.print("smoke: [green]all passed[/]" if report.ok else "smoke: [bold red]failed[/]")
