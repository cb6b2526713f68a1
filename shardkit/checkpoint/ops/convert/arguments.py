"""The argument checks every ``convert --to`` target shares, said once (world size, writer threads)."""

from __future__ import annotations

from shardkit.core.errors import UsageError
from shardkit.storage.manifest import MAX_WORLD_SIZE


def check_world_size(world_size: object) -> int:
    """``world_size`` as the data-parallel ranks of the resuming DeepSpeed run; UsageError naming the value
    otherwise (bool is refused: ``True`` is an int to Python, never a world size a user meant). The bound is
    the largest world size a shardkit manifest records."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= MAX_WORLD_SIZE:
        raise UsageError(f"--world-size {world_size!r}: must be a whole number from 1 to {MAX_WORLD_SIZE} (the data-"
                         "parallel ranks of the resuming DeepSpeed run)")
    return world_size


def check_workers(workers: int | None, what: str = "files") -> None:
    """``workers`` (None: the target's default) is at least 1; ``what`` names what they write at once."""
    if workers is not None and workers < 1:
        raise UsageError(f"workers={workers}: must be at least 1 ({what} written at once)")
