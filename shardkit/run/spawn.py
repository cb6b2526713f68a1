"""Run a function on N local ranks in fresh processes, with a hard timeout that kills them.

Used by `shardkit preflight`/`smoke` and by the multi-rank tests. Each rank gets the usual torchrun
environment (RANK, WORLD_SIZE, LOCAL_RANK, ...), a process group initialized through a ``file://``
rendezvous in a private directory (no port races), and its return value or traceback is sent back
to the parent. A rank that fails makes the parent stop the others after a short grace period, since
they are probably blocked in a collective waiting for it.

Ranks run on the CPU (gloo, GPUs hidden from them) or one per GPU (nccl); :func:`plan_ranks` picks
that and refuses more ranks than visible GPUs, since nccl cannot put two ranks on one GPU. Ranks
never outlive this process: each dies with its parent (Linux parent-death signal, plus a watchdog
thread), and SIGTERM/SIGINT to the parent are passed on to every rank's process group.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

from shardkit.core.errors import DistributedError, UsageError

Device = Literal["auto", "cpu", "gpu"]
DEVICES: tuple[Device, ...] = ("auto", "cpu", "gpu")

# CPU ranks beyond this many per core get a warning: each rank is a whole process with its own
# model copy and engine, so 64 ranks on 2 cores mostly measure the scheduler and fill the memory.
RANKS_PER_CORE_WARNING = 2

# What a CPU rank gets so that nothing in it touches a GPU, even on a GPU machine: torch sees no
# CUDA device, and DeepSpeed's accelerator is forced to its CPU one (it would pick cuda otherwise).
CPU_RANK_ENV: dict[str, str] = {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}

# After the first rank fails, how long the others get to finish (or fail themselves, which gives a
# better message) before they are killed.
FAILURE_GRACE_S = 20.0


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


@dataclass(frozen=True)
class RankPlan:
    """How many ranks to start and where they run."""

    nproc: int
    device: Literal["cpu", "gpu"]
    """cpu: gloo ranks with every GPU hidden; gpu: one nccl rank per visible GPU."""
    warnings: tuple[str, ...] = ()
    """Things to tell the user before starting (a rank count far beyond the cores)."""

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "gpu" else "gloo"

    @property
    def env(self) -> dict[str, str]:
        """Environment every rank gets on top of the parent's."""
        return dict(CPU_RANK_ENV) if self.device == "cpu" else {}


def visible_gpus() -> int:
    """CUDA GPUs this process can see (CUDA_VISIBLE_DEVICES applied); 0 without CUDA."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # pragma: no cover - torch import problems surface elsewhere
        return 0


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, e.g. a Slurm or container limit)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def default_nproc(device: Device = "auto", gpus: int | None = None) -> int:
    """One rank per visible GPU; 2 CPU ranks (gloo) with --device cpu or when no GPU is visible."""
    gpus = visible_gpus() if gpus is None else gpus
    if device == "cpu" or gpus == 0:
        return 2
    return gpus


def plan_ranks(
    nproc: int | None,
    device: Device = "auto",
    *,
    gpus: int | None = None,
    cores: int | None = None,
) -> RankPlan:
    """Decide the rank count and device for a run; UsageError when the machine cannot hold it.

    ``auto`` means one nccl rank per visible GPU, or CPU ranks when there is none. More ranks than
    visible GPUs are refused rather than left to fail inside nccl (rank 1 asks for ``cuda:1``:
    "invalid device ordinal"); ``cpu`` runs any number of gloo ranks with the GPUs hidden.
    ``gpus`` and ``cores`` default to what this machine has (tests pass them in).
    """
    _check_request(nproc, device)
    gpus = visible_gpus() if gpus is None else gpus
    if device == "gpu" and gpus == 0:
        raise UsageError(
            "--device gpu: no CUDA GPU is visible to this process "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')!r}); "
            "run with --device cpu (gloo ranks) or on a machine with GPUs"
        )
    on_gpu = device == "gpu" or (device == "auto" and gpus > 0)
    n = nproc if nproc is not None else default_nproc("gpu" if on_gpu else "cpu", gpus)
    if on_gpu:
        if n > gpus:
            raise UsageError(
                f"--nproc {n} asks for {n} ranks but {gpus} GPU(s) are visible, and nccl needs one GPU per rank; "
                f"pass --nproc {gpus} (or fewer), or --device cpu to run {n} CPU ranks with gloo"
            )
        return RankPlan(n, "gpu")
    cores = usable_cores() if cores is None else cores
    warnings: list[str] = []
    if n > RANKS_PER_CORE_WARNING * cores:
        warnings.append(
            f"--nproc {n} starts {n} CPU ranks on {cores} core(s): each rank is a whole process with its own "
            f"model and engine, so this is slow and memory-hungry; use --nproc {max(1, min(2, cores))} unless you "
            "are testing scale"
        )
    return RankPlan(n, "cpu", tuple(warnings))


def _check_request(nproc: int | None, device: str) -> None:
    if device not in DEVICES:
        raise UsageError(f"--device {device!r}: choose one of {', '.join(DEVICES)}")
    if nproc is not None and nproc < 1:
        raise UsageError(f"--nproc {nproc}: must be at least 1")


def static_world(nproc: int | None, device: Device = "auto", *, gpus: int | None = None) -> tuple[int, bool]:
    """(world size, on GPUs) for checks that spawn nothing (`preflight --static`): ``nproc`` is only
    the world size the config is checked at (it may be meant for another machine), so no rank count
    is refused here; without it, what a run here would start. ``gpus``: default this machine's."""
    _check_request(nproc, device)
    gpus = visible_gpus() if gpus is None else gpus
    on_gpu = device == "gpu" or (device == "auto" and gpus > 0)
    return (nproc if nproc is not None else default_nproc("gpu" if on_gpu else "cpu", gpus)), on_gpu


# The parent-death signal: a catchable one, so the rank can take its whole process group (what it
# started: a JIT build, DataLoader workers) down with it. SIGKILL would end the rank at once and
# orphan its children, since they are in the rank's group, not the parent's.
PARENT_DEATH_SIGNAL = signal.SIGTERM


def _die_with_parent(parent_pid: int) -> None:
    """End this rank and its process group when the process that spawned it dies, however it died.

    The rank is its own session leader (os.setsid), so a SIGKILL of the parent, or a SIGTERM it had
    no time to pass on, would otherwise leave it running and holding memory (and GPUs) forever.
    The kernel sends PARENT_DEATH_SIGNAL the moment the parent exits (Linux prctl); its handler
    kills the rank's group. A watchdog thread does the same where prctl is missing, where the
    target replaced the handler, or where the main thread is stuck in C code and cannot run it.
    """
    rank_pid = os.getpid()

    def kill_group(signum: int, _frame: Any) -> None:
        if os.getpid() != rank_pid:
            # a forked child of the rank inherited this handler (a DataLoader worker SIGTERMed by
            # its own loader): it dies alone, as it would have without us
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        _kill_own_group()

    signal.signal(PARENT_DEATH_SIGNAL, kill_group)  # before prctl: the signal may come at once
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(PARENT_DEATH_SIGNAL), 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.2)
        _kill_own_group()

    threading.Thread(target=watch, name="shardkit-parent-watchdog", daemon=True).start()


def _kill_own_group() -> None:
    """SIGKILL this rank's process group (the rank is its leader), the rank last of all."""
    try:
        os.killpg(os.getpgrp(), signal.SIGKILL)
    finally:
        os._exit(1)


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
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            # A port must be set for code that reads it; the group itself uses the file rendezvous.
            "MASTER_PORT": env.get("MASTER_PORT", "29500"),
            "CROSS_RANK": "0",
            "CROSS_SIZE": "1",
        }
    )
    result: dict[str, Any] = {"rank": rank}
    code = 0
    try:
        import torch.distributed as dist

        if backend == "nccl":  # pragma: no cover - GPU only
            import torch

            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        try:
            result["value"] = _resolve(target)(*args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - everything must reach the parent
        result["error"] = traceback.format_exc()
        result["error_type"] = type(exc).__name__
        result["error_message"] = str(exc)
        code = 1
        # Also into the rank's own output (its log file when the target redirected it), so the log
        # of a failed rank ends with the reason, not with the last thing the engine printed.
        print(f"shardkit: rank {rank} failed:\n{result['error']}", file=sys.stderr, flush=True)
    try:
        payload = pickle.dumps(result)
    except Exception as exc:  # the return value did not pickle
        payload = pickle.dumps({"rank": rank, "error": f"result of rank {rank} cannot be pickled: {exc}"})
        code = 1
    tmp = Path(result_dir) / f".rank{rank}.tmp"
    tmp.write_bytes(payload)
    tmp.replace(Path(result_dir) / f"rank{rank}.pkl")
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
    init_file = base / "rendezvous"
    # A reused workdir must not hand back an earlier run's results or rendezvous (the latter hangs).
    for stale in [init_file, *base.glob("rank*.pkl"), *base.glob(".rank*.tmp")]:
        stale.unlink(missing_ok=True)
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


@dataclass
class _ForwardSignals:
    """While ranks run, SIGTERM/SIGINT to this process go to every rank's process group first.

    The ranks are session leaders (os.setsid), so neither Ctrl-C in a terminal nor `kill` of this
    process reaches them by itself; then this process reacts as it would have without us.
    """

    procs: list[Any]
    previous: dict[int, Any] = field(default_factory=dict)

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set there; the ranks still die with this process
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(sig)
            if previous is signal.SIG_IGN or previous is None:
                # SIG_IGN: this process ignores it (nohup), so do the ranks. None: a handler set
                # from C, which Python cannot put back (signal.signal(sig, None) is a TypeError):
                # leave it in place rather than lose it.
                continue
            self.previous[sig] = previous
            signal.signal(sig, self._forward)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous.clear()

    def _forward(self, signum: int, frame: Any) -> None:
        for p in self.procs:
            _signal_group(p.pid, signal.Signals(signum))
        previous = self.previous.get(signum, signal.SIG_DFL)
        self.restore()
        if callable(previous):
            previous(signum, frame)  # Python's SIGINT handler raises KeyboardInterrupt
        elif previous is signal.SIG_DFL:
            os.kill(os.getpid(), signum)  # die of the signal, as without the handler


def _signal_group(pid: int | None, sig: signal.Signals) -> None:
    if pid is None:
        return
    try:
        os.killpg(pid, sig)  # the rank is its group's leader (os.setsid in _rank_main)
    except (ProcessLookupError, PermissionError):
        pass


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
