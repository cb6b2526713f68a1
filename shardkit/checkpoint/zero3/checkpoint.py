"""A described ZeRO-3 checkpoint and one rank's partitions: the objects a reader hands out.

``Zero3Checkpoint`` is a checkpoint's files and layout, tensors left on disk (built by
``reader.open_zero3_checkpoint``); ``ParamSlot`` is where one trainable parameter lives in the
per-rank flat partitions; ``RankPartitions`` is one rank's optimizer file, memory-mapped.

Reading is streaming: rank files are opened with ``torch.load(mmap=True, weights_only=True)`` and
slices are read with ``os.preadv`` straight into the destination tensor (the mapping's pages are
never touched), so memory stays near the tensors being produced. ``open_zero3_checkpoint(...,
torch_free=True)`` parses the files with ``read_structure`` instead and never imports torch.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardkit.checkpoint.zero3.file_offsets import FileOffsets, torch_uint8
from shardkit.checkpoint.zero3.layout import rank_range
from shardkit.core.errors import CheckpointError
from shardkit.core.files import regular_fd
from shardkit.storage.torch_load import safe_torch_load

if TYPE_CHECKING:
    import torch

FP32 = "fp32"
"""Pseudo state key for the fp32 master partitions (``fp32_flat_groups``)."""


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
    """Rank 0's model_states dict (parameter placeholders, buffers, counters, client state)."""
    torch_free: bool = False
    """Opened with ``read_structure``: tensors are ``TensorRef``s, ``open_rank`` is unavailable."""

    @property
    def root(self) -> Path:
        return self.tag_dir.parent

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

    @contextmanager
    def open_rank(self, rank: int) -> Iterator["RankPartitions"]:
        """Map one rank's optim file; its pages are released when the block ends."""
        if self.torch_free:
            raise RuntimeError("open_rank needs torch: open the checkpoint without torch_free=True")
        sd = safe_torch_load(self.optim_files[rank], mmap=True)
        part = RankPartitions(self, rank, zero3_optimizer_sd(sd, self.optim_files[rank]), FileOffsets(self.optim_files[rank], sd))
        try:
            yield part
        finally:
            # Drop every reference to the mapping so it is unmapped now, not when the caller's
            # `as` variable is rebound: holding two rank files at once doubles resident pages.
            part.release()
            del sd, part

    def frozen_fragments(self, rank: int) -> dict[str, "torch.Tensor"]:
        """Rank ``rank``'s partitions of parameters the optimizer does not own (frozen ones)."""
        if not self.frozen_param_shapes:
            return {}
        sd = self.model_state if rank == 0 else safe_torch_load(self.model_files[rank], mmap=True)
        return dict(sd.get("frozen_param_fragments") or {})


class RankPartitions:
    """One rank's flat partitions, memory-mapped: ``flat(key, sub_group)`` -> 1-D tensor."""

    def __init__(self, ckpt: Zero3Checkpoint, rank: int, optim_sd: dict[str, Any], offsets: "FileOffsets | None" = None):
        self.ckpt, self.rank, self._sd = ckpt, rank, optim_sd
        self._state = optim_sd["optimizer_state_dict"].get("state", {})
        self._offsets = offsets
        self._fd: int | None = None

    @property
    def path(self) -> Path:
        return self.ckpt.optim_files[self.rank]

    def release(self) -> None:
        self._sd, self._state, self._offsets = {}, {}, None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def byte_offset(self, slot: ParamSlot, key: str) -> int | None:
        """Where this rank's piece of ``slot`` starts in the rank *file*, or None when unknown.

        Lets callers copy the bytes file-to-file (``os.copy_file_range``) without paging them in.
        """
        t = self.flat(key, slot.sub_group)
        base = self._offsets.of(t) if self._offsets is not None else None
        return None if base is None else base + slot.offset * t.element_size()

    def read_into(self, key: str, sub_group: int, start: int, out: "torch.Tensor") -> None:
        """Copy elements ``[start, start + out.numel())`` of a flat tensor into ``out`` (1-D, contiguous).

        Reads with ``os.preadv`` straight into ``out`` when the file offset is known: one syscall,
        no page faults on the mapping (which on a busy VM made mmap copies ~4x slower).
        """
        src = self.flat(key, sub_group)
        base = self._offsets.of(src) if self._offsets is not None and src.dtype == out.dtype else None
        if base is not None and hasattr(os, "preadv") and out.is_contiguous() and out.device.type == "cpu":
            view = memoryview(out.view(torch_uint8()).numpy())
            done, want, at = 0, view.nbytes, base + start * src.element_size()
            if self._fd is None:
                self._fd = regular_fd(self.path)
            while done < want:
                n = os.preadv(self._fd, [view[done:]], at + done)
                if n <= 0:
                    break
                done += n
            if done == want:
                return
        out.copy_(src.narrow(0, start, out.numel()))

    def flat(self, key: str, sub_group: int) -> "torch.Tensor":
        if key == FP32:
            t = self._sd["fp32_flat_groups"][sub_group]
        else:
            entry = self._state.get(sub_group)
            if entry is None or key not in entry:
                raise CheckpointError(
                    f"{self.ckpt.optim_files[self.rank]}: optimizer state {key!r} of sub-group {sub_group} "
                    "is missing (the optimizer never stepped, or it is not an Adam-style optimizer)"
                )
            t = entry[key]
        want = self.ckpt.sub_group_numel[sub_group]
        if t.numel() != want:
            raise CheckpointError(
                f"{self.ckpt.optim_files[self.rank]}: {key} of sub-group {sub_group} has {t.numel()} "
                f"elements, expected {want} from param_shapes at world size {self.ckpt.world_size}. "
                "The rank files come from different saves or the file is damaged."
            )
        return t.reshape(-1)


def zero3_optimizer_sd(sd: Any, path: Path) -> dict[str, Any]:
    """The ``optimizer_state_dict`` of a loaded ZeRO-3 optim file; CheckpointError for any other file."""
    osd = sd.get("optimizer_state_dict") if isinstance(sd, dict) else None
    if not isinstance(osd, dict) or "fp32_flat_groups" not in osd:
        raise CheckpointError(
            f"{path}: not a ZeRO-3 optimizer file (no optimizer_state_dict.fp32_flat_groups). "
            "ZeRO-1/2 checkpoints keep single_partition_of_fp32_groups instead; use DeepSpeed's zero_to_fp32.py for those."
        )
    return osd
