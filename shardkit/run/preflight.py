"""What `shardkit preflight CONFIG` does on the host: static checks, then N spawned ranks
(``shardkit.run.preflight_rank``) that build the model, initialize DeepSpeed or FSDP2 from
CONFIG, run the placement preflight and one training step; their failures are named here.

Kept out of the command module so tests call ``run_preflight(PreflightOptions(...))`` directly.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from shardkit.checks import check_file
from shardkit.config.loading import config_kind, load_config
from shardkit.core.errors import DistributedError, UsageError
from shardkit.core.render import print_report, write_json
from shardkit.engines.model_factory import resolve_model_factory
from shardkit.platform.environment.report import require_no_hang_traps
from shardkit.run.preflight_rank import RankSpec, preflight_rank
from shardkit.run.spawn.plan import RankPlan, plan_ranks, static_world
from shardkit.run.spawn.process import run_ranks
from shardkit.run.spawn.results import RankResult, failure_line


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
    """Write the placement report (rank 0's records and every rank's summary) as JSON here; '-' = stdout."""
    timeout: float = 60.0
    """Seconds a rank may be late to the preflight before it is named as missing."""
    record_path: str | None = None
    """``--record FILE``: each rank writes where every tensor is (the GPU ground-truth format)."""
    run_timeout: float = 600.0
    """Hard limit for the whole spawned run (import, engine init, preflight, one step)."""


def run_preflight(opts: PreflightOptions, out: TextIO | None = None) -> int:
    """Exit code: 0 clean, 1 findings (static errors, placement problems, a failed step)."""
    out = out or sys.stdout
    if opts.timeout <= 0:
        raise UsageError(f"--rank-wait {opts.timeout}: must be positive (seconds a late rank is waited for)")
    if opts.static:
        # nothing is spawned: --world-size is only the world size to check at (more ranks than this
        # machine's GPUs is fine: the config may be meant for another machine)
        nproc, on_gpu = static_world(opts.nproc, opts.device)  # type: ignore[arg-type]
        plan = None
    else:
        plan = plan_ranks(opts.nproc, opts.device)  # type: ignore[arg-type]  # UsageError names the fix
        nproc, on_gpu = plan.nproc, plan.device == "gpu"
    cfg = load_config(opts.config)
    report = check_file(opts.config, world_size=nproc, accelerator=on_gpu)
    print_report(report, file=out)
    if not report.ok:
        print(f"static checks failed: fix {len(report.errors)} error(s) above before spawning ranks", file=out)
        return 1
    if plan is None:
        return 0
    resolve_model_factory(opts.model)  # a bad --model is a usage error here, not a crash in N ranks
    # a stale op-build lock or a socket interface this host lacks: the ranks would wait in silence
    require_no_hang_traps({**os.environ, **plan.env}, loads_deepspeed_ops=config_kind(cfg) != "fsdp")
    for warning in plan.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return _run_ranks(opts, cfg, config_kind(cfg), plan, out)


def _run_ranks(opts: PreflightOptions, cfg: dict[str, Any], kind: str, plan: "RankPlan", out: TextIO) -> int:
    nproc = plan.nproc
    log_dir = tempfile.mkdtemp(prefix="shardkit-preflight-logs-")
    json_path = None if opts.json_path in (None, "-") else str(Path(opts.json_path).resolve())
    spec = RankSpec(cfg, kind, opts.model, opts.timeout, json_path or (str(Path(log_dir) / "report.json") if opts.json_path == "-" else None), log_dir,
                    record_path=str(Path(opts.record_path).resolve()) if opts.record_path else None)
    print(f"spawning {nproc} rank(s) ({kind}) on {plan.device} ({plan.backend}); rank logs in {log_dir}", file=out, flush=True)
    results = run_ranks(preflight_rank, nproc, args=(spec,), timeout=opts.run_timeout, device=plan.device, raise_on_error=False)
    code = verdict(opts, plan, results, spec, log_dir, out)
    if code == 0:
        shutil.rmtree(log_dir, ignore_errors=True)  # logs are kept only when something failed
    return code


def verdict(opts: PreflightOptions, plan: "RankPlan", results: "list[RankResult]", spec: RankSpec, log_dir: str,
            out: TextIO) -> int:
    """Exit code from the ranks' results (0 clean, 1 a finding); DistributedError, one line per
    dead rank and a --json failure record, when ranks died before or after the preflight."""
    values = [r.value for r in results if r.ok and isinstance(r.value, dict)]
    crashed = [r for r in results if not r.ok]
    if crashed and not values:
        _ranks_died(opts, plan, crashed, log_dir, "before the preflight finished", None, out)
    first = min((r for r in results if r.ok), key=lambda r: r.rank)
    value = first.value
    print(value["text"], file=out)
    placement = _read_json(spec.json_path)
    if crashed and value["preflight_ok"]:
        # the report passed on the ranks that finished, but others died after it (in the step, at
        # exit): the same one line per rank and failure record as a death before the preflight
        _ranks_died(opts, plan, crashed, log_dir, "after the preflight", placement, out)
    if opts.json_path == "-" and spec.json_path and Path(spec.json_path).exists():
        out.write(Path(spec.json_path).read_text())
    if not value["preflight_ok"]:
        return 1
    if value.get("step_error"):
        print(f"training step failed after a clean preflight: {value['step_error']}", file=out)
        return 1
    if value.get("loss") is not None:
        print(f"one training step after the preflight: ok (rank {first.rank} loss {value['loss']:.4f})", file=out)
    return 0


def _read_json(path: str | None) -> dict[str, Any] | None:
    import json

    if not path or not Path(path).exists():
        return None
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _ranks_died(opts: PreflightOptions, plan: "RankPlan", crashed: "list[RankResult]", log_dir: str, when: str,
                placement: dict[str, Any] | None, out: TextIO) -> None:
    failures = [rank_failure(r, log_dir) for r in crashed]
    if opts.json_path:
        record = {**(placement or {}), **failure_record(opts, plan, failures, stage=f"ranks failed {when}")}
        write_json(record, opts.json_path, file=out)
    lines = "\n".join(f"  rank {f['rank']}: {f['error']} (log: {f['log']})" for f in failures)
    raise DistributedError(
        f"{len(crashed)} of {plan.nproc} rank(s) failed {when}:\n{lines}\n"
        "Fix the first error above (the rank logs hold the full tracebacks) and run the preflight again."
    )


def rank_failure(result: "RankResult", log_dir: str) -> dict[str, Any]:
    """One failed rank as plain data: its exception (type and first message line), exit code, log."""
    error = failure_line(result)
    if not result.error_type:  # died without reporting (segfault, os._exit, OOM killer): its log's end
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


def failure_record(opts: PreflightOptions, plan: "RankPlan", failures: list[dict[str, Any]],
                   stage: str = "ranks failed before the preflight finished") -> dict[str, Any]:
    """What ``--json`` holds when ranks died: before the preflight could report (no placement), or
    after it (then on top of the placement report the surviving ranks wrote)."""
    return {
        "ok": False,
        "stage": stage,
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
