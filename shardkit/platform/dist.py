"""The few process-group helpers checkpoint code needs, usable with or without a process group
(single process: rank 0 of 1, collectives are no-ops)."""

from __future__ import annotations

from typing import Any


def _active() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def rank_world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    import torch.distributed as dist

    if _active():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier() -> None:
    """``dist.barrier()`` when a process group exists."""
    import torch.distributed as dist

    if _active():
        dist.barrier()


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (``[obj]`` without a process group)."""
    import torch.distributed as dist

    if not _active() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank."""
    import torch.distributed as dist

    if not _active() or dist.get_world_size() == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]
