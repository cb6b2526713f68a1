"""Where the ranks of one run meet: the torchrun environment each rank gets, and the process group
they form through a ``file://`` rendezvous in the run's private directory (no port races).

The parent names a fresh rendezvous file (:func:`fresh_rendezvous`); each rank sets its environment
(:func:`set_rank_environment`), joins the group before its target runs (:func:`join_process_group`)
and leaves it afterwards (:func:`leave_process_group`). torch is imported in the rank only.
"""

from __future__ import annotations

import os
from pathlib import Path


def fresh_rendezvous(base: Path) -> Path:
    """The rendezvous file of a run in ``base``; one an earlier run left there is removed (ranks
    that meet in an old rendezvous hang)."""
    init_file = base / "rendezvous"
    init_file.unlink(missing_ok=True)
    return init_file


def set_rank_environment(rank: int, world_size: int, env: dict[str, str]) -> None:
    """``env`` (the run's, e.g. the CPU ranks' CUDA_VISIBLE_DEVICES) and the variables torchrun
    gives a rank, in this rank's ``os.environ``."""
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


def join_process_group(backend: str, init_file: str, rank: int, world_size: int) -> None:
    """Initialize this rank's default process group through the ``file://`` rendezvous (nccl ranks
    first take their GPU)."""
    import torch.distributed as dist

    device_ids = None
    if backend == "nccl":  # pragma: no cover - GPU only
        import torch

        device_ids = [rank % torch.cuda.device_count()]
        torch.cuda.set_device(device_ids[0])
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    # gloo's init returns on a rank before its peers have finished connecting to it: a target that
    # fails at once (a model factory DeepSpeed refuses) exits and breaks the peers' connectFullMesh,
    # so they report "Connection closed by peer" instead of their own error. One barrier here lets
    # every rank finish joining before any target runs.
    dist.barrier(device_ids=device_ids)


def leave_process_group() -> None:
    """Destroy the default process group if the target left one."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
