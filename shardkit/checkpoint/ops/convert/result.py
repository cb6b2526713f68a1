"""What a checkpoint-writing operation wrote, carried and could not carry: ``WrittenCheckpoint``, the one record
of the fields ``reshard`` and every ``convert --to`` target share (this process's share of a split run among
them), and ``ConvertResult``, a conversion's (``reshard.ReshardResult`` is the reshard's)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(kw_only=True)
class WrittenCheckpoint:
    """What an operation that writes a new checkpoint from a source wrote (``reshard_checkpoint``, the converters)."""

    output: Path
    """The new checkpoint root (holds ``latest``)."""
    tag: str
    world_size: int
    """Ranks the output is written for (DCP output: any world size loads it; the source's is kept here)."""
    source_world_size: int
    bytes: int
    """Bytes written."""
    carried: list[str] = field(default_factory=list)
    """What was carried, by name: a conversion's state ('fp32 masters', 'exp_avg', 'step', 'buffers',
    'client_state.epoch' ...); a reshard's files of the source root beside the tag copied into the output root
    (``a -> b``: an RNG file renamed for its rank), e.g. Accelerate's random_states_<process>.pkl, scheduler.bin
    (``carried_files`` decides)."""
    not_carried: list[str] = field(default_factory=list)
    """What the source held that the output does not, each with why (never dropped silently): a reshard's
    ``name (why)`` for every entry of the source it leaves (other tags, RNG files of ranks that do not exist any
    more, folders, links)."""
    notes: list[str] = field(default_factory=list)
    """Things the user should know (client_state taken from rank 0 ...)."""
    verified: str = "hash"
    """How the source was checked before it was read: 'hash' (sizes and digests), 'sizes' (--no-verify) or
    'none' (no manifest)."""
    rank: int = 0
    """This process's share (under srun/torchrun; 0 alone)."""
    processes: int = 1
    """Processes that wrote the files (under srun/torchrun; 1 alone)."""
    share_files: int = 0
    """Files this process wrote (a conversion: tensor files of the torch-free route)."""
    share_bytes: int = 0
    """Bytes this process wrote (a conversion: tensor bytes of the torch-free route)."""
    workers: int = 1
    """Writer threads this process ran (a conversion: on the torch-free route)."""
    launcher: str = "single process"


@dataclass(kw_only=True)
class ConvertResult(WrittenCheckpoint):
    """Returned by every ``convert_to_*`` target (``--to fsdp2|zero1|zero2|zero3|universal``)."""

    source_engine: str
    """'zero3' or 'fsdp2'."""
    target_engine: str
    params: int
    """Parameters carried (trainable and frozen)."""
    route: str = "bytes"
    """'bytes': tensors copied as byte ranges; 'torch': some through torch (--to fsdp2: dcp.save; --to
    zero3: tensors dcp.load reads whole), for what byte ranges cannot express."""
