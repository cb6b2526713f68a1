"""What `shardkit preflight CONFIG` does on the host: static checks, then N spawned ranks
(``shardkit.harness.preflight_rank``) that build the model, initialize DeepSpeed or FSDP2 from
CONFIG, run the placement preflight and one training step; their failures are named here.

Kept out of the command module so tests call ``run_preflight(PreflightOptions(...))`` directly.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from shardkit.errors import DistributedError, UsageError
from shardkit.harness.preflight_rank import RankSpec, preflight_rank

if TYPE_CHECKING:
    from shardkit.harness.spawn import RankPlan, RankResult


@dataclass(frozen=True)
class PreflightOptions:
    """The command line of `shardkit preflight`, as plain data."""

    config: str
    """DeepSpeed JSON/YAML config, or a shardkit FSDP2 config (top-level ``"fsdp"`` key)."""
    nproc: int | None = None
    """Ranks to spawn; None = one per visible GPU, else (or with device "cpu") 2 CPU ranks (gloo)."""
    device: str = "auto"
    """auto: one nccl rank per visible GPU, CPU ranks without GPUs; cpu: gloo ranks that cannot see a
    GPU; gpu: GPUs or a refusal. More ranks than visible GPUs is refused unless "cpu"."""
    model: str | None = None
    """``llama:SIZE`` or ``pkg.module:factory``; None = the tiny built-in Llama (no downloads)."""
    static: bool = False
    """Stop after the static config checks (no ranks spawned)."""
    json_path: str | None = None
    """Write the placement report (every rank's records) as JSON here; '-' = stdout."""
    timeout: float = 60.0
    """Seconds a rank may be late to the preflight before it is named as missing."""
    record_path: str | None = None
    """``--record FILE``: each rank writes where every tensor is (the GPU ground-truth format)."""
    run_timeout: float = 600.0
    """Hard limit for the whole spawned run (import, engine init, preflight, one step)."""


def run_preflight(opts: PreflightOptions, out: TextIO | None = None) -> int:
    """Exit code: 0 clean, 1 findings (static errors, placement problems, a failed step)."""
    from shardkit.checks import check_file
    from shardkit.config.loading import config_kind, load_config
    from shardkit.harness.spawn import plan_ranks
    from shardkit.models import resolve_model_factory
    from shardkit.render import print_report

    out = out or sys.stdout
    if opts.timeout <= 0:
        raise UsageError(f"--timeout {opts.timeout}: must be positive (seconds a late rank is waited for)")
    plan = plan_ranks(opts.nproc, opts.device)  # type: ignore[arg-type]  # UsageError names the fix
    cfg = load_config(opts.config)
    nproc = plan.nproc
    report = check_file(opts.config, world_size=nproc, accelerator=plan.device == "gpu")
    print_report(report, file=out)
    if not report.ok:
        print(f"static checks failed: fix {len(report.errors)} error(s) above before spawning ranks", file=out)
        return 1
    if opts.static:
        return 0
    resolve_model_factory(opts.model)  # a bad --model is a usage error here, not a crash in N ranks
    for warning in plan.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return _run_ranks(opts, cfg, config_kind(cfg), plan, out)


def _run_ranks(opts: PreflightOptions, cfg: dict[str, Any], kind: str, plan: "RankPlan", out: TextIO) -> int:
    from shardkit.harness.spawn import run_ranks

    nproc = plan.nproc
    log_dir = tempfile.mkdtemp(prefix="shardkit-preflight-logs-")
    json_path = None if opts.json_path in (None, "-") else str(Path(opts.json_path).resolve())
    spec = RankSpec(cfg, kind, opts.model, opts.timeout, json_path or (str(Path(log_dir) / "report.json") if opts.json_path == "-" else None), log_dir,
                    record_path=str(Path(opts.record_path).resolve()) if opts.record_path else None)
    print(f"spawning {nproc} rank(s) ({kind}) on {plan.device} ({plan.backend}); rank logs in {log_dir}", file=out, flush=True)
    results = run_ranks(preflight_rank, nproc, args=(spec,), timeout=opts.run_timeout, device=plan.device, raise_on_error=False)
    values = [r.value for r in results if r.ok and isinstance(r.value, dict)]
    crashed = [r for r in results if not r.ok]
    if crashed and not values:
        failures = [rank_failure(r, log_dir) for r in crashed]
        if opts.json_path:
            from shardkit.render import write_json

            write_json(failure_record(opts, plan, failures), opts.json_path, file=out)
        lines = "\n".join(f"  rank {f['rank']}: {f['error']} (log: {f['log']})" for f in failures)
        raise DistributedError(
            f"{len(crashed)} of {nproc} rank(s) failed before the preflight finished:\n{lines}\n"
            "Fix the first error above (the rank logs hold the full tracebacks) and run the preflight again."
        )
    first = min((r for r in results if r.ok), key=lambda r: r.rank)
    value = first.value
    print(value["text"], file=out)
    if opts.json_path == "-" and spec.json_path and Path(spec.json_path).exists():
        out.write(Path(spec.json_path).read_text())
    if not value["preflight_ok"]:
        return 1
    if value.get("step_error"):
        print(f"training step failed after a clean preflight: {value['step_error']}", file=out)
        return 1
    if crashed:
        raise DistributedError(f"ranks {[r.rank for r in crashed]} failed after the preflight:\n" + "\n".join((r.error or "") for r in crashed))
    if value.get("loss") is not None:
        print(f"one training step after the preflight: ok (rank {first.rank} loss {value['loss']:.4f})", file=out)
    shutil.rmtree(log_dir, ignore_errors=True)  # logs are kept only when something failed
    return 0


def rank_failure(result: "RankResult", log_dir: str) -> dict[str, Any]:
    """One failed rank as plain data: its exception (type and first message line), exit code, log."""
    if result.error_type:
        message = next((line.strip() for line in (result.error_message or "").splitlines() if line.strip()), "")
        error = f"{result.error_type}: {message}" if message else result.error_type
    else:  # killed at the timeout, or died without reporting (segfault, os._exit, OOM killer)
        lines = [line.strip() for line in (result.error or "").splitlines() if line.strip()]
        error = lines[-1] if lines else f"exit code {result.exitcode}"
        last = _last_log_line(log_dir, result.rank)
        if last and result.exitcode not in (None, 0):
            error += f"; last log line: {last}"
    return {
        "rank": result.rank,
        "error": error,
        "error_type": result.error_type,
        "exitcode": result.exitcode,
        "log": str(Path(log_dir) / f"rank{result.rank}.log"),
    }


def failure_record(opts: PreflightOptions, plan: "RankPlan", failures: list[dict[str, Any]]) -> dict[str, Any]:
    """What ``--json`` holds when ranks died before the preflight could report (no placement)."""
    return {
        "ok": False,
        "stage": "ranks failed before the preflight finished",
        "config": str(opts.config),
        "world_size": plan.nproc,
        "device": plan.device,
        "failures": failures,
    }


def _last_log_line(log_dir: str, rank: int) -> str:
    path = Path(log_dir) / f"rank{rank}.log"
    if not path.exists():
        return ""
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else ""
