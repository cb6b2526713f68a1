"""The few process-group helpers checkpoint code needs, usable with or without a process group
(single process: rank 0 of 1, collectives are no-ops)."""

from __future__ import annotations

import sys
from typing import Any, Mapping


def process_group_active() -> bool:
    """Whether a default torch.distributed process group is initialized in this process."""
    # No process group can exist in a process that never imported torch.distributed: answering
    # from sys.modules keeps the torch-free writers (reshard, convert, consolidate) free of a 1-3 s
    # `import torch` that the check itself would cost.
    if "torch.distributed" not in sys.modules:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def rank_world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if not process_group_active():
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def barrier() -> None:
    """``dist.barrier()`` when a process group exists."""
    if process_group_active():
        import torch.distributed as dist

        dist.barrier()


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (``[obj]`` without a process group)."""
    if not process_group_active():
        return [obj]
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank."""
    if not process_group_active():
        return obj
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


# --- the launcher's variables against each other and against the process group --------------------

_LAUNCH_FIX = ("launch with torchrun, the deepspeed launcher or `shardkit launch`, which set RANK, WORLD_SIZE and "
               "LOCAL_RANK together for every rank (under srun: RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS "
               "LOCAL_RANK=$SLURM_LOCALID)")


def rank_env_problems(
    environ: Mapping[str, str],
    *,
    group: tuple[int, int] | None = None,
    accelerators: int = 0,
    before_init: bool = False,
) -> list[str]:
    """What is wrong with this rank's launcher variables, one message per problem (what, the value,
    why it matters, then `` Fix: `` and the fix); empty when nothing is.

    ``group``: (rank, world size) of the process group already formed, compared with RANK and
    WORLD_SIZE (code that reads the variables, DeepSpeed's included, and the group then disagree).
    ``accelerators``: devices this rank can see (``CUDA_VISIBLE_DEVICES`` applied); 0 on a CPU run,
    where LOCAL_RANK picks no device. ``before_init``: the check runs before the group is formed,
    where an unset LOCAL_RANK sends DeepSpeed's ``init_distributed`` into MPI discovery.
    """
    values: dict[str, int] = {}
    problems: list[str] = []
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        raw = environ.get(key)
        if raw is None:
            continue
        try:
            values[key] = int(raw.strip())
        except ValueError:
            problems.append(f"{key}={raw!r} is not an integer: every launcher sets it to a rank count or index. "
                            f"Fix: {_LAUNCH_FIX}")
    rank, world, local = values.get("RANK"), values.get("WORLD_SIZE"), values.get("LOCAL_RANK")
    if world is not None and world < 1:
        problems.append(f"WORLD_SIZE={world}: a run has at least 1 rank. Fix: {_LAUNCH_FIX}")
    elif rank is not None and world is not None and not 0 <= rank < world:
        problems.append(
            f"RANK={rank} with WORLD_SIZE={world}: ranks count 0..{world - 1}, so this rank cannot exist and torch's "
            "init_process_group waits for it until its timeout ('The client socket has timed out' / "
            f"'{world - 1}/{world} clients joined'). Fix: {_LAUNCH_FIX}"
        )
    if local is not None and local < 0:
        problems.append(f"LOCAL_RANK={local}: a rank's index on its node is never negative. Fix: {_LAUNCH_FIX}")
    elif local is None and rank is not None and world is not None and (before_init or (accelerators > 0 and world > 1)):
        why = []
        if before_init:
            why.append("DeepSpeed's init_distributed then falls back to MPI discovery and stops with "
                       "\"ModuleNotFoundError: No module named 'mpi4py'\"")
        if accelerators > 0 and world > 1:
            why.append("every rank of a node computes on device 0 (LOCAL_RANK defaults to 0)")
        problems.append(f"LOCAL_RANK is not set while RANK={rank} and WORLD_SIZE={world} are: {'; and '.join(why)}. "
                        f"Fix: {_LAUNCH_FIX}")
    elif local is not None and accelerators > 0 and local >= accelerators:
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        shown = f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "CUDA_VISIBLE_DEVICES unset"
        problems.append(
            f"LOCAL_RANK={local} but this rank sees {accelerators} accelerator(s) ({shown}): device {local} does not "
            "exist ('invalid device ordinal'), or ranks share a device when the index wraps. Fix: start at most "
            f"{accelerators} rank(s) per node (--nproc_per_node {accelerators}), or make as many devices visible "
            "as ranks per node"
        )
    if group is not None:
        g_rank, g_world = group
        if world is not None and world != g_world:
            problems.append(
                f"WORLD_SIZE={world} in this rank's environment, but its process group has {g_world} rank(s): code "
                "that reads the variable (DeepSpeed's engine, data samplers, checkpoint writers) and the group "
                f"disagree (a stale export, or init_process_group(world_size={g_world}) by hand). Fix: unset WORLD_SIZE "
                "before launching, or let the launcher set it"
            )
        if rank is not None and rank != g_rank and (world is None or 0 <= rank < world):
            problems.append(
                f"RANK={rank} in this rank's environment, but it is rank {g_rank} of its process group: rank-0-only "
                "work (saving, logging) may run twice or never (a stale export, or init_process_group(rank=...) by "
                "hand). Fix: unset RANK before launching, or let the launcher set it"
            )
    return problems
