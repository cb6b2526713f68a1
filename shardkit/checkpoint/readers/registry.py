"""Which reader reads which source kind: the one table an operation consults, so a new format is one
reader module and one line here (the kinds are ``export.sources.Source.kind``)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from shardkit.checkpoint.model.checkpoint import TrainingCheckpoint
from shardkit.checkpoint.readers.accelerate_state import read_accelerate_state
from shardkit.checkpoint.readers.dcp import read_dcp
from shardkit.checkpoint.readers.fsdp1 import read_fsdp1_full, read_fsdp1_sharded
from shardkit.checkpoint.readers.fsdp1_bins import read_fsdp1_bins, read_fsdp2_bins
from shardkit.checkpoint.readers.universal import read_universal
from shardkit.checkpoint.readers.zero3 import read_zero3
from shardkit.checkpoint.readers.zero12 import read_zero12
from shardkit.core.errors import CheckpointError

Reader = Callable[[Path], TrainingCheckpoint]

READERS: dict[str, Reader] = {
    "zero3": read_zero3,
    "dcp": read_dcp,
    "zero12": read_zero12,
    "universal": read_universal,
    "fsdp1-sharded": read_fsdp1_sharded,
    "fsdp1-full": read_fsdp1_full,
    "fsdp1-sharded-bins": read_fsdp1_bins,
    "fsdp2-sharded-bins": read_fsdp2_bins,
    "accelerate-state": read_accelerate_state,
}


def read_checkpoint(kind: str, folder: Path) -> TrainingCheckpoint:
    """The checkpoint at ``folder`` (a resolved source of ``kind``) as the checkpoint model."""
    reader = READERS.get(kind)
    if reader is None:
        raise CheckpointError(f"{folder}: no reader for a {kind!r} checkpoint (shardkit reads {sorted(READERS)}); "
                              "`shardkit inspect` says which commands take it")
    return reader(folder)
