"""A described ZeRO-3 checkpoint: ``Zero3Checkpoint`` is a checkpoint's files and layout, tensors left
on disk (built by ``readers.zero3_open.open_zero3_layout``); ``ParamSlot`` is where one trainable
parameter lives in the per-rank flat partitions. Plain data: the rank files are parsed by the readers
(``readers.zero3_open``, ``readers.zero3``), never here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardkit.checkpoint.model.checkpoint import FP32 as FP32  # the fp32 master partitions' key (fp32_flat_groups)
from shardkit.checkpoint.zero3.layout import rank_range


@dataclass(frozen=True)
class ParamSlot:
    """Where one trainable parameter lives in the checkpoint's per-rank flat partitions."""

    name: str
    shape: tuple[int, ...]
    numel: int
    param_group: int
    """Index of the optimizer param group (``param_groups[i]``) the parameter belongs to."""
    sub_group: int
    """Index of the sub-group: ``fp32_flat_groups[i]`` and inner optimizer state ``i``."""
    offset: int
    """Start of this parameter's partition inside every rank's sub-group flat tensor."""
    partition_numel: int
    """``ceil(numel / world_size)``: elements per rank, the last rank zero-padded."""

    def rank_range(self, rank: int) -> tuple[int, int]:
        """Elements ``[start, stop)`` of the flattened parameter that ``rank`` holds (without padding)."""
        return rank_range(rank, self.partition_numel, self.numel)


@dataclass
class Zero3Checkpoint:
    """A ZeRO-3 checkpoint's files and layout (read from rank 0's files; tensors stay on disk)."""

    tag_dir: Path
    tag: str
    world_size: int
    model_files: list[Path]
    optim_files: list[Path]
    slots: list[ParamSlot]
    sub_group_numel: list[int]
    """Per-rank flat length of each sub-group."""
    sub_group_param_group: list[int]
    param_groups: list[dict[str, Any]]
    """The inner optimizer's param groups (hyperparameters; ``params`` dropped)."""
    state_keys: list[str]
    """Per-element optimizer state keys found (e.g. ``exp_avg``, ``exp_avg_sq``)."""
    precision: str
    """``bf16``, ``fp16`` or ``fp32``: the training precision the checkpoint was written with."""
    ds_version: str | None
    ds_config: dict[str, Any]
    model_state: dict[str, Any] = field(repr=False)
    """Rank 0's model_states dict as parsed (``TensorRef`` placeholders, buffers, counters, client state)."""

    @property
    def num_params(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def frozen_param_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = self.model_state.get("frozen_param_shapes") or {}
        return {k: tuple(v) for k, v in shapes.items()}

    @property
    def shared_params(self) -> dict[str, str]:
        """Aliases: ``{name not stored: name that holds the data}`` (tied weights)."""
        return dict(self.model_state.get("shared_params") or {})
