"""The run state DeepSpeed's ZeRO-1/2 loader takes from a checkpoint, torch-loaded (memory-mapped: only the
entries touched are paged in) with DeepSpeed's real classes: the model-states dict and a rank's optimizer dict
(loss scaler, ``clip_grad``, param groups, ``step``), which the in-process resume hands to the engine around the
partitions it reads through ``readers.zero12``; and the alignment paddings of rank 0's parsed optimizer dict.
"""

from __future__ import annotations

from typing import Any

from shardkit.checkpoint.model.checkpoint import TrainingCheckpoint
from shardkit.checkpoint.zero3.files import OPTIM_FILE
from shardkit.checkpoint.zero12.files import MODEL_FILE, OPTIMIZER_KEY
from shardkit.storage.torch_load import safe_torch_load


def model_states(ckpt: TrainingCheckpoint) -> dict[str, Any]:
    """The model-states file's dict (one for every rank under ZeRO-1/2)."""
    sd: dict[str, Any] = safe_torch_load(ckpt.folder / MODEL_FILE, mmap=True, real_deepspeed_objects=True)
    return sd


def optim_states(ckpt: TrainingCheckpoint, rank: int) -> dict[str, Any]:
    """Saved rank ``rank``'s ``optimizer_state_dict`` (``read_zero12`` listed the folder: no rank is missing)."""
    path = ckpt.folder / OPTIM_FILE.format(prefix=ckpt.scalars["native"]["prefix"], rank=rank)
    sd: dict[str, Any] = safe_torch_load(path, mmap=True, real_deepspeed_objects=True)[OPTIMIZER_KEY]
    return sd


def base_optimizer_state(optim_sd: dict[str, Any]) -> dict[str, Any]:
    """The inner torch optimizer's ``{"state", "param_groups"}`` of an ``optim_states`` dict."""
    base: dict[str, Any] = optim_sd["base_optimizer_state"]
    return base


def alignment_paddings(optim_file: dict[str, Any]) -> list[list[int]] | None:
    """``param_alignment_paddings`` of a parsed optimizer file (``scalars["native"]["optim_file"]``), or None."""
    saved = optim_file[OPTIMIZER_KEY].get("param_alignment_paddings")
    return [list(p) for p in saved] if saved is not None else None
