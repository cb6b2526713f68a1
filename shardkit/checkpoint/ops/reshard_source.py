"""What a reshard planner (``reshard_zero12``, ``reshard_zero3``) hands ``reshard.reshard_checkpoint``: the opened
source in the words the reshard seals and reports with, and the files to write (each planner's own job type)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generic, TypeVar

J = TypeVar("J")


@dataclass
class PlannedReshard(Generic[J]):
    tag_dir: Path
    stage: int
    world_size: int
    """Ranks that saved the source."""
    precision: str
    ds_config: dict[str, Any]
    ds_version: str | None
    optim_files: list[Path]
    model_files: list[Path]
    model_state: dict[str, Any]
    """Rank 0's model-states dict (``global_steps``...)."""
    unchanged: bool
    """The new layout is the source's own: ``reshard`` copies the rank files instead of writing ``jobs``."""
    jobs: list[J]
    """The new tag folder's files as the writer builds them: one optimizer file per new rank, then the model
    states (ZeRO-3 plans none for an unchanged layout; ZeRO-1/2's are closures, planned anyway)."""
    notes: list[str] = field(default_factory=list)
    """What the report says of the source or how the files were built (empty when they are copied)."""
    check_copied: Callable[[Path], None] = lambda path: None
    """Checks one source file the copy route carries against its place, as the reader checks the files it
    parses (ZeRO-3's lazy reader parses a rank file when its pieces are read, and a copy reads none); the
    ZeRO-1/2 reader has parsed and checked every rank file already."""
