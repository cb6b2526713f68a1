"""The run state DeepSpeed's own loaders take from a ZeRO-3 checkpoint's rank files, torch-loaded with
DeepSpeed's real classes: a rank's model-states dict (buffers, LR scheduler, counters, client state)
and optim-states dict (loss scaler, the inner optimizer's param groups and non-partition state). The
in-process resume hands them to the engine around the partitions it reads through ``readers.zero3``.

Memory-mapped (``safe_torch_load(mmap=True)``): only the small entries a caller touches are paged in,
never the flat partitions beside them.
"""

from __future__ import annotations

from typing import Any

from shardkit.checkpoint.readers.zero3_open import zero3_optimizer_sd
from shardkit.checkpoint.zero3.checkpoint import Zero3Checkpoint
from shardkit.core.errors import CheckpointError
from shardkit.storage.torch_load import safe_torch_load


def model_states(ckpt: Zero3Checkpoint, rank: int) -> dict[str, Any]:
    """Saved rank ``rank``'s model-states dict, a copy the caller may change."""
    path = ckpt.model_files[rank]
    sd = safe_torch_load(path, mmap=True, real_deepspeed_objects=True)
    if not isinstance(sd, dict):
        raise CheckpointError(f"{path}: holds a {type(sd).__name__}, where DeepSpeed saves a dict of the model "
                              "states: the file is damaged or was not written by DeepSpeed. Re-copy it")
    return dict(sd)


def optim_states(ckpt: Zero3Checkpoint, rank: int) -> dict[str, Any]:
    """Saved rank ``rank``'s optim-states dict (checked to be a ZeRO-3 one)."""
    path = ckpt.optim_files[rank]
    sd = safe_torch_load(path, mmap=True, real_deepspeed_objects=True)
    zero3_optimizer_sd(sd, path)
    return dict(sd)


def saved_state(optim_sd: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """The inner torch optimizer's ``state`` of an ``optim_states`` dict: ``{sub-group: {key: value}}``."""
    return optim_sd["optimizer_state_dict"]["optimizer_state_dict"].get("state") or {}
