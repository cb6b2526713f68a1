"""Whole tensors of a ZeRO-3 checkpoint read through the one ZeRO-3 reader (``readers.zero3``: each
tensor's byte ranges in the rank files, ``read_slice``), for tests that compare values bit for bit."""

from __future__ import annotations

from pathlib import Path

import torch

from shardkit.checkpoint.model.checkpoint import TrainingCheckpoint
from shardkit.checkpoint.readers.zero3 import read_zero3
from shardkit.checkpoint.readers.zero3_open import open_zero3_layout
from shardkit.checkpoint.writers.zero3 import read_slice


def read_model(path: str | Path) -> TrainingCheckpoint:
    """The checkpoint at ``path`` (root, tag folder or a rank file) as the checkpoint model."""
    return read_zero3(open_zero3_layout(path).tag_dir)


def gathered(model: TrainingCheckpoint, name: str, key: str = "fp32") -> torch.Tensor:
    """Parameter ``name``'s full, unpadded ``key`` tensor (``fp32``: the master; else an optimizer state)."""
    t = model.weights[name] if key == "fp32" else model.optimizer[name][key]
    return read_slice(t, 0, t.numel).reshape(t.shape)
