"""How many ranks a run starts and where they run: CPU ranks (gloo, every GPU hidden from them) or
one rank per visible GPU (nccl).

:func:`plan_ranks` makes that choice for a run and refuses more ranks than visible GPUs, since
nccl cannot put two ranks on one GPU; :func:`static_world` answers the same question for checks
that spawn nothing. Tests replace :func:`visible_gpus` and :func:`usable_cores` here to play
another machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from shardkit.core.errors import UsageError

Device = Literal["auto", "cpu", "gpu"]
DEVICES: tuple[Device, ...] = ("auto", "cpu", "gpu")

# CPU ranks beyond this many per core get a warning: each rank is a whole process with its own
# model copy and engine, so 64 ranks on 2 cores mostly measure the scheduler and fill the memory.
RANKS_PER_CORE_WARNING = 2

# What a CPU rank gets so that nothing in it touches a GPU, even on a GPU machine: torch sees no
# CUDA device, and DeepSpeed's accelerator is forced to its CPU one (it would pick cuda otherwise).
CPU_RANK_ENV: dict[str, str] = {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}


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
                f"--world-size {n} asks for {n} ranks but {gpus} GPU(s) are visible, and nccl needs one GPU per rank; "
                f"pass --world-size {gpus} (or fewer), or --device cpu to run {n} CPU ranks with gloo"
            )
        return RankPlan(n, "gpu")
    cores = usable_cores() if cores is None else cores
    warnings: list[str] = []
    if n > RANKS_PER_CORE_WARNING * cores:
        warnings.append(
            f"--world-size {n} starts {n} CPU ranks on {cores} core(s): each rank is a whole process with its own "
            f"model and engine, so this is slow and memory-hungry; use --world-size {max(1, min(2, cores))} unless you "
            "are testing scale"
        )
    return RankPlan(n, "cpu", tuple(warnings))


def _check_request(nproc: int | None, device: str) -> None:
    if device not in DEVICES:
        raise UsageError(f"--device {device!r}: choose one of {', '.join(DEVICES)}")
    if nproc is not None and nproc < 1:
        raise UsageError(f"--world-size {nproc}: must be at least 1")


def static_world(nproc: int | None, device: Device = "auto", *, gpus: int | None = None) -> tuple[int, bool]:
    """(world size, on GPUs) for checks that spawn nothing (`preflight --static`): ``nproc`` is only
    the world size the config is checked at (it may be meant for another machine), so no rank count
    is refused here; without it, what a run here would start. ``gpus``: default this machine's."""
    _check_request(nproc, device)
    gpus = visible_gpus() if gpus is None else gpus
    on_gpu = device == "gpu" or (device == "auto" and gpus > 0)
    return (nproc if nproc is not None else default_nproc("gpu" if on_gpu else "cpu", gpus)), on_gpu
