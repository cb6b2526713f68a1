"""Running `shardkit smoke` (:func:`run_smoke`): plan the ranks, pick each engine's config, build
DeepSpeed's ops once, then for every engine runs A (uninterrupted), B (train, save) and C (resume
in fresh ranks) on spawned ranks, compare the curves, and keep the checkpoint when asked.

A run whose ranks fail ends that engine with one line naming the rank, its exception and its log
(:func:`run_failure`); the other engines still run.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from shardkit.core.errors import ShardkitError, UsageError
from shardkit.engines.deepspeed import PREBUILT_OPS, op_failure_line, prebuild_ops_in_subprocess
from shardkit.platform.environment.report import require_no_hang_traps, require_runnable_here
from shardkit.run.smoke.options import ENGINES, Engine, SmokeOptions, config_for
from shardkit.run.smoke.progress import _Progress
from shardkit.run.smoke.report import EngineResult, SmokeReport, _compare
from shardkit.run.smoke_rank import RunSpec, rank_run
from shardkit.run.spawn.plan import CPU_RANK_ENV, plan_ranks
from shardkit.run.spawn.process import run_ranks
from shardkit.run.spawn.results import RankResult, failure_line


def run_smoke(opts: SmokeOptions, progress: bool = True) -> SmokeReport:
    """Run the smoke for every engine in ``opts.engines`` and return the verdicts."""
    plan = plan_ranks(opts.nproc, opts.device)  # type: ignore[arg-type]  # refuses more ranks than GPUs
    opts = dataclasses.replace(opts, nproc=plan.nproc, device=plan.device)
    for warning in plan.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if opts.steps < 2:
        raise UsageError(f"--steps must be at least 2 (half before the checkpoint, half after), got {opts.steps}")
    for e in opts.engines:
        if e not in ENGINES:
            raise UsageError(f"--engine {e!r}: choose one of {', '.join(ENGINES)} or all")
    keep = _keep_destinations(opts)
    configs = {e: config_for(e, opts) for e in opts.engines}
    # What this machine cannot run (a TORCH_CUDA_ARCH_LIST DeepSpeed cannot parse, fp16 on a CPU
    # without fp16 ...) stops here with one line and the fix, before op builds and ranks start.
    require_runnable_here({f"{e} ({src})": cfg for e, (cfg, src) in configs.items()}, accelerator=opts.device == "gpu")
    # ... and what would make the ranks (or the op prebuild) wait forever in silence: a stale op-build
    # lock in the extensions cache, a socket interface this host lacks
    require_no_hang_traps({**os.environ, **plan.env}, loads_deepspeed_ops="zero3" in opts.engines)
    results = []
    with _Progress(progress) as bar:
        op_failure = _prebuild_deepspeed_ops(bar, opts.device) if "zero3" in opts.engines else None
        for engine in opts.engines:
            cfg, source = configs[engine]
            if engine == "zero3" and op_failure:
                # every ZeRO-3 rank would build the op again and fail the same way, minutes later
                results.append(EngineResult(engine=engine, config_source=source, failure=op_failure))
                continue
            results.append(_smoke_engine(engine, cfg, source, opts, bar, keep.get(engine)))
    return SmokeReport(results=results, nproc=opts.nproc, steps=opts.steps)  # type: ignore[arg-type]


def _prebuild_deepspeed_ops(bar: "_Progress", device: str) -> str | None:
    """Build DeepSpeed's ops once, outside the runs' timeouts, rather than inside every rank at once
    (a fresh machine JIT-builds them on first use: minutes on a small CPU box). Returns the one-line
    failure (op, cause, fix) when one did not build, else None."""
    task = bar.task("deepspeed ops", total=len(PREBUILT_OPS))

    def on_event(event: dict[str, Any]) -> None:
        op, stage = event["op"], event["stage"]
        if stage == "building":
            bar.update(task, f"building {op} (or loading it from the cache) ...")
        elif stage == "ok":
            bar.update(task, f"built {op} in {event['seconds']} s", advance=1)
        elif stage == "skipped":
            bar.update(task, f"{op} skipped ({event['detail']})", advance=1)
        else:
            bar.update(task, f"FAILED {op}: {event['detail']}", advance=1)

    # the ranks' environment, so the ops of the accelerator the ranks will use are the ones built
    env = {**os.environ, **CPU_RANK_ENV} if device == "cpu" else None
    status, output = prebuild_ops_in_subprocess(on_event, env=env)
    failed = [(name, s) for name, s in status.items() if s.startswith("failed")]
    if not failed:
        bar.update(task, "all ops ready")
        return None
    fd, log = tempfile.mkstemp(prefix="shardkit-op-build-", suffix=".log")
    with os.fdopen(fd, "w") as fh:
        fh.write(output)
    name, first = failed[0]
    more = f"; {len(failed) - 1} more op(s) failed too" if len(failed) > 1 else ""
    bar.update(task, f"FAILED: {', '.join(n for n, _ in failed)}")
    return f"{op_failure_line(name, first)}{more} (build output: {log}); the ZeRO-3 runs were not started"


def _keep_destinations(opts: SmokeOptions) -> dict[str, Path]:
    """Where each engine's checkpoint is kept; refused before anything runs if it would replace files."""
    if not opts.keep_checkpoint:
        return {}
    root = Path(opts.keep_checkpoint)
    dests = {e: root / e for e in opts.engines} if len(opts.engines) > 1 else {opts.engines[0]: root}
    for dest in dests.values():
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise UsageError(f"--keep-checkpoint {root}: {dest} already exists and is not an empty folder; "
                             "smoke never replaces files: pick a new path or remove it")
    return dests


def _smoke_engine(engine: Engine, cfg: dict[str, Any], source: str, opts: SmokeOptions, bar: _Progress,
                  keep: Path | None = None) -> EngineResult:
    result = EngineResult(engine=engine, config_source=source)
    task = bar.task(engine)
    own = opts.workdir is None
    base = Path(tempfile.mkdtemp(prefix=f"shardkit-smoke-{engine}-")) if own else Path(opts.workdir) / engine  # type: ignore[arg-type]
    base.mkdir(parents=True, exist_ok=True)
    ckpt = base / "checkpoint"
    half = opts.steps // 2
    common = dict(engine=engine, config=cfg, model=opts.model, seed=opts.seed, batch=opts.batch, seq_len=opts.seq_len)
    runs = [
        ("A", f"run A: {opts.steps} steps uninterrupted", RunSpec(start=0, stop=opts.steps, checkpoint_root=str(base / "unused"), **common)),
        ("B", f"run B: {half} steps, save", RunSpec(start=0, stop=half, checkpoint_root=str(ckpt), save=True, **common)),
        ("C", f"run C: resume in fresh ranks, {opts.steps - half} steps", RunSpec(start=half, stop=opts.steps, checkpoint_root=str(ckpt), resume=True, **common)),
    ]
    outputs: dict[str, list[dict[str, Any]]] = {}
    try:
        for name, label, spec in runs:
            bar.update(task, label)
            if name == "C" and opts.after_save is not None:
                opts.after_save(ckpt)
            t0 = time.monotonic()
            outputs[name] = _run(spec, opts, base / f"ranks-{name}", name)
            result.seconds[name] = round(time.monotonic() - t0, 2)
            bar.update(task, label, advance=1)
        a, b, c = outputs["A"], outputs["B"], outputs["C"]
        result.device = a[0]["device"]
        result.preflight = c[0]["preflight"]
        result.checkpoint = f"{b[0]['checkpoint']} -> {c[0]['checkpoint']}"
        result.losses_uninterrupted = [r["losses"] for r in a]
        result.losses_resumed = [rb["losses"] + rc["losses"] for rb, rc in zip(b, c)]
        _compare(result)
        bar.update(task, "compared" if result.ok else "FAILED", advance=1)
        if keep is not None and result.ok:
            result.keep_error = keep_checkpoint(ckpt, keep)
            result.kept_checkpoint = None if result.keep_error else str(keep)
    except _RunFailed as exc:
        result.failure = str(exc)
        bar.update(task, "FAILED")
    if own and result.ok and not result.keep_error:
        shutil.rmtree(base, ignore_errors=True)
    return result


def keep_checkpoint(ckpt: Path, keep: Path) -> str | None:
    """Move a passing run's checkpoint to ``keep`` (checked empty before the runs); None when it
    moved, else one line naming ``keep``, the error and where the checkpoint still is. Files that
    appeared in ``keep`` during the run, permissions or a full disk must not turn a passing smoke
    into a traceback."""
    try:
        keep.parent.mkdir(parents=True, exist_ok=True)
        if keep.exists():
            keep.rmdir()  # empty before the runs; OSError if something was put there since
        shutil.move(str(ckpt), str(keep))  # manifest paths are relative: still verifiable there
    except OSError as exc:
        return (f"--keep-checkpoint {keep}: could not move the checkpoint there: {exc}; it was left in "
                f"{ckpt} (move it yourself, or free/fix {keep} and run again)")
    return None


def run_failure(name: str, bad: "list[RankResult]", workdir: Path) -> "_RunFailed":
    """The one line for a run whose ranks failed: the rank that raised (over peers killed while
    waiting for it), its exception in one line, and its log."""
    first = next((r for r in bad if r.error_type), bad[0])
    what = {"A": "uninterrupted run", "B": "run before the checkpoint", "C": "resume"}[name]
    return _RunFailed(f"run {name} ({what}) failed on rank {first.rank}: {failure_line(first)} "
                      f"(log: {workdir / f'rank{first.rank}.log'})")


class _RunFailed(ShardkitError):
    """One of the three runs did not finish; the message is the line the report prints."""


def _run(spec: RunSpec, opts: SmokeOptions, workdir: Path, name: str) -> list[dict[str, Any]]:
    workdir.mkdir(parents=True, exist_ok=True)
    spec = copy.copy(spec)
    spec.log_dir = str(workdir)
    results = run_ranks(
        rank_run, opts.nproc, args=(spec,), timeout=opts.timeout, device=opts.device, workdir=workdir, raise_on_error=False  # type: ignore[arg-type]
    )
    bad = [r for r in results if not r.ok]
    if not bad:
        return [r.value for r in results]
    raise run_failure(name, bad, workdir)
