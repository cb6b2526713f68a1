"""What a conversion wrote, carried and could not carry: one record for both directions."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ConvertResult:
    """Returned by ``convert_to_dcp`` and ``convert_to_zero3``."""

    output: Path
    """The new checkpoint root (holds ``latest``)."""
    tag: str
    source_engine: str
    """'zero3' or 'fsdp2'."""
    target_engine: str
    world_size: int
    """Ranks the output is written for (DCP output: any world size loads it; the source's is kept here)."""
    source_world_size: int
    params: int
    """Parameters carried (trainable and frozen)."""
    bytes: int
    """Bytes written."""
    carried: list[str] = field(default_factory=list)
    """What was carried, by name ('fp32 masters', 'exp_avg', 'step', 'buffers', 'client_state.epoch' ...)."""
    not_carried: list[str] = field(default_factory=list)
    """What the source held that the output does not, each with why (never dropped silently)."""
    notes: list[str] = field(default_factory=list)
    verified: str = "hash"
    """How the source was checked before it was read: 'hash' (sizes and digests), 'sizes' or 'none' (no manifest)."""
    route: str = "bytes"
    """'bytes': tensors copied as byte ranges; 'torch': some through torch (--to fsdp2: dcp.save; --to
    zero3: tensors dcp.load reads whole), for what byte ranges cannot express."""
    rank: int = 0
    """This process's share (under srun/torchrun; 0 alone)."""
    processes: int = 1
    """Processes that wrote the files (under srun/torchrun; 1 alone)."""
    share_files: int = 0
    """Tensor files this process wrote (torch-free route)."""
    share_bytes: int = 0
    """Tensor bytes this process wrote (torch-free route)."""
    workers: int = 1
    """Writer threads this process ran (torch-free route)."""
    launcher: str = "single process"
