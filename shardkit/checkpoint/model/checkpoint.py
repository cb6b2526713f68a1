"""One training checkpoint, whatever wrote it: the object every reader produces and every writer
consumes, opened and verified once and carried to the end of an operation.

Every logical tensor is a ``SourceTensor`` (byte-range ``Piece``s of the source files, or a named
loader where bytes cannot be described so), keyed by the parameter's name in the model's
``state_dict`` (no ``module.`` or FSDP prefixes; readers strip those):

- ``weights``: what a model loads: each trainable parameter's value (the fp32 master where the
  format keeps one, else the training dtype's value), frozen parameters and buffers, in model order.
- ``optimizer``: per trainable parameter, each optimizer state by torch's name (``exp_avg``,
  ``exp_avg_sq``...), unpadded and in the parameter's shape. Empty when the reader describes
  weights only (``optimizer_described`` says which).
- ``scalars``: per-run values (``step``, the optimizer's ``param_groups`` hyperparameters, a loss
  scaler, values that differ per rank under ``per_rank``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardkit.checkpoint.model.tensors import SourceTensor, refuse_uncovered

FP32 = "fp32"
"""Pseudo state key of the fp32 masters (a trainable parameter's ``weights`` entry) beside its optimizer states."""
#: The dtype a run of each ``TrainingCheckpoint.precision`` trains its module in (what DeepSpeed's files hold it in).
TRAINING_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass
class TrainingCheckpoint:
    """A checkpoint described format-neutrally (no tensor bytes read)."""

    format: str
    """``zero1``, ``zero2``, ``zero3``, ``dcp``, ``fsdp1-sharded``, ``fsdp1-full``, ``fsdp1-local``, ``universal``."""
    folder: Path
    """The folder the tensors are read from (a DeepSpeed tag folder, a DCP folder...)."""
    weights: dict[str, SourceTensor]
    world_size: int | None = None
    """Ranks that wrote it (None where the format does not record it: a full state dict)."""
    tag: str | None = None
    precision: str = "fp32"
    """The training precision: ``fp32``, ``bf16`` or ``fp16``."""
    aliases: dict[str, str] = field(default_factory=dict)
    """Tied names stored once: ``{alias: name holding the data}``."""
    frozen: set[str] = field(default_factory=set)
    """Names in ``weights`` that had requires_grad=False."""
    buffers: set[str] = field(default_factory=set)
    """Names in ``weights`` that are buffers, not parameters."""
    optimizer: dict[str, dict[str, SourceTensor]] = field(default_factory=dict)
    """``{parameter name: {state name: tensor}}`` for trainable parameters."""
    optimizer_described: bool = False
    """True when the reader describes the optimizer state (an empty ``optimizer`` then means none saved)."""
    scalars: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    """What a user should know about what was read (the source named, what is exported)."""

    @property
    def trainable(self) -> list[str]:
        """Names of the trainable parameters, in model order."""
        return [n for n in self.weights if n not in self.frozen and n not in self.buffers]

    def tensor(self, name: str, key: str) -> SourceTensor:
        """Parameter ``name``'s masters (``key`` ``FP32``) or its optimizer state ``key``."""
        return self.weights[name] if key == FP32 else self.optimizer[name][key]

    def all_tensors(self) -> Iterator[tuple[str, SourceTensor]]:
        """Every tensor with what it is: the weights by name, each optimizer state as ``exp_avg of 'w'``."""
        yield from self.weights.items()
        for name, states in self.optimizer.items():
            for state, t in states.items():
                yield f"{state} of {name!r}", t

    def uncovered(self) -> list[str]:
        """Tensors whose pieces do not cover every element exactly once (checked before writing)."""
        return [t.name for _, t in self.all_tensors() if not t.covered()]

    def refuse_uncovered(self) -> None:
        """CheckpointError naming the first tensor (weights, then optimizer states) whose pieces do not
        hold every element exactly once, and where (``tensors.refuse_uncovered``)."""
        refuse_uncovered(self.folder, self.all_tensors())
