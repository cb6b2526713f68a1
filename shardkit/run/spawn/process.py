"""Starting the rank processes of a run, waiting for them and stopping them: :func:`run_ranks`, the
harness API `shardkit preflight`/`smoke`, the multi-rank tests and the benchmarks use; and
:func:`_rank_main`, what each spawned process runs (its own process group, the rendezvous, the
target, its result sent back).

A rank that fails makes the parent stop the others after :data:`FAILURE_GRACE_S`, since they are
probably blocked in a collective waiting for it; ranks still running at the timeout are killed.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

from shardkit.core.errors import DistributedError, UsageError
from shardkit.run.spawn.lifetime import _die_with_parent, _ForwardSignals, _signal_group
from shardkit.run.spawn.plan import plan_ranks
from shardkit.run.spawn.rendezvous import (
    fresh_rendezvous,
    join_process_group,
    leave_process_group,
    set_rank_environment,
)
from shardkit.run.spawn.results import RankResult, _collect, _failure_message, clear_results, send_result
from shardkit.run.spawn.silence import STATUS_SUFFIX, SilenceReporter, start_rank_watchdog

# After the first rank fails, how long the others get to finish (or fail themselves, which gives a
# better message) before they are killed.
FAILURE_GRACE_S = 20.0


def _resolve(target: Callable[..., Any] | str) -> Callable[..., Any]:
    if callable(target):
        return target
    module, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    fn: Callable[..., Any] = obj
    return fn


def _by_name(target: Callable[..., Any]) -> Callable[..., Any] | str:
    """``module:qualname`` for an importable target, so the rank imports it only after its
    environment is set (a module that imports deepspeed picks its accelerator at import)."""
    import types

    if not isinstance(target, types.FunctionType):  # a bound method or partial pickles as itself
        return target
    module, qualname = target.__module__, target.__qualname__
    if module and module != "__main__" and "<" not in qualname:
        return f"{module}:{qualname}"
    return target


def _rank_main(
    target: Callable[..., Any] | str,
    rank: int,
    world_size: int,
    init_file: str,
    result_dir: str,
    backend: str,
    env: dict[str, str],
    args: tuple[Any, ...],
    parent_pid: int | None = None,
) -> None:
    # Own process group, so a kill at the timeout also reaches what the rank started (a JIT build
    # of a DeepSpeed op, DataLoader workers) instead of leaving it running.
    os.setsid()
    if parent_pid is not None:
        _die_with_parent(parent_pid)
    set_rank_environment(rank, world_size, env)
    # says where this rank waits once it has been silent for SHARDKIT_SILENCE_S (the parent names it too)
    start_rank_watchdog(rank, result_dir)
    result: dict[str, Any] = {"rank": rank}
    code = 0
    try:
        join_process_group(backend, init_file, rank, world_size)
        try:
            result["value"] = _resolve(target)(*args)
        finally:
            leave_process_group()
    except BaseException as exc:  # noqa: BLE001 - everything must reach the parent
        result["error"] = traceback.format_exc()
        result["error_type"] = type(exc).__name__
        result["error_message"] = str(exc)
        code = 1
        # Also into the rank's own output (its log file when the target redirected it), so the log
        # of a failed rank ends with the reason, not with the last thing the engine printed.
        print(f"shardkit: rank {rank} failed:\n{result['error']}", file=sys.stderr, flush=True)
    if not send_result(result_dir, rank, result):
        code = 1
    os._exit(code)  # skip atexit handlers that can hang after a failed collective


def run_ranks(
    target: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout: float = 300.0,
    backend: str | None = None,
    device: Literal["cpu", "gpu"] | None = None,
    env: dict[str, str] | None = None,
    workdir: str | Path | None = None,
    raise_on_error: bool = True,
) -> list[RankResult]:
    """Run ``target(*args)`` on ``world_size`` spawned ranks and return each rank's result.

    ``target`` must be importable (a module-level function). ``device`` "cpu" runs gloo ranks that
    cannot see a GPU, "gpu" one nccl rank per GPU; ``backend`` "gloo"/"nccl" is the same choice by
    its backend's name; with neither, GPUs are used when there are enough of them, and more ranks
    than GPUs is a UsageError (see :func:`plan_ranks`). Raises DistributedError naming the ranks
    that failed or did not finish within ``timeout`` seconds, unless ``raise_on_error`` is False,
    in which case the results (with errors filled in) are returned.
    """
    if world_size < 1:
        raise DistributedError(f"world size must be at least 1, got {world_size}")
    if backend not in (None, "gloo", "nccl"):
        raise UsageError(f"backend {backend!r}: shardkit ranks use gloo (CPU) or nccl (one GPU per rank)")
    if device is None and backend is not None:
        device = "cpu" if backend == "gloo" else "gpu"
    elif device is not None and backend is not None and backend != ("gloo" if device == "cpu" else "nccl"):
        raise UsageError(f"backend {backend!r} does not fit device {device!r}: cpu ranks use gloo, gpu ranks nccl")
    plan = plan_ranks(world_size, device or "auto")
    backend = plan.backend
    ctx = mp.get_context("spawn")
    own_dir = workdir is None
    base = Path(tempfile.mkdtemp(prefix="shardkit-ranks-")) if own_dir else Path(workdir)  # type: ignore[arg-type]
    base.mkdir(parents=True, exist_ok=True)
    # A reused workdir must not hand back an earlier run's results or rendezvous (the latter hangs).
    init_file = fresh_rendezvous(base)
    clear_results(base)
    for old in base.glob(f"rank*{STATUS_SUFFIX}"):  # an earlier run's silent ranks are not this run's
        old.unlink(missing_ok=True)
    silent = SilenceReporter(base, world_size)
    child_env = {**plan.env, **(env or {})}
    procs: list[Any] = []
    forwarding = _ForwardSignals(procs)
    try:
        forwarding.install()
        for rank in range(world_size):
            p = ctx.Process(
                target=_rank_main,
                args=(_by_name(target), rank, world_size, str(init_file), str(base), backend, child_env, tuple(args), os.getpid()),
                name=f"shardkit-rank{rank}",
            )
            p.start()
            procs.append(p)
        deadline = time.monotonic() + timeout
        first_failure: float | None = None
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if now > deadline:
                break
            if first_failure is None and any(p.exitcode not in (None, 0) for p in procs):
                first_failure = now
            if first_failure is not None and now - first_failure > FAILURE_GRACE_S:
                break
            silent.poll()
            time.sleep(0.05)
        killed = set()
        for rank, p in enumerate(procs):
            if p.is_alive():
                killed.add(rank)
                _signal_group(p.pid, signal.SIGTERM)
        for p in procs:
            p.join(5)
            if p.is_alive():
                _signal_group(p.pid, signal.SIGKILL)
                p.join(5)
        for p in procs:  # children the ranks left behind, even after a clean exit
            _signal_group(p.pid, signal.SIGKILL)
        results = [_collect(base, rank, p.exitcode if rank not in killed else None) for rank, p in enumerate(procs)]
        timed_out = bool(killed) and first_failure is None
        for r in results:
            if r.rank in killed and r.error is None:
                r.error = (
                    f"rank {r.rank} did not finish within {timeout:.0f}s and was killed"
                    if timed_out
                    else f"rank {r.rank} was still running {FAILURE_GRACE_S:.0f}s after another rank failed "
                    "(probably blocked in a collective) and was killed"
                )
        if raise_on_error and not all(r.ok for r in results):
            raise DistributedError(_failure_message(results, timed_out, timeout))
        return results
    finally:
        forwarding.restore()
        for p in procs:
            if p.is_alive():  # an exception (KeyboardInterrupt) left them running
                _signal_group(p.pid, signal.SIGKILL)
                p.join(5)
        if own_dir:
            shutil.rmtree(base, ignore_errors=True)


def redirect_output(path: str | Path) -> None:
    """Send this rank's stdout/stderr (fd level, so C++ logs too) to ``path``, line-buffered.

    DeepSpeed and torch log per rank; the parent prints one verdict and the logs keep the rest.
    Line buffering keeps the last lines of a rank killed at a timeout.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
