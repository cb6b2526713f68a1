"""Where a checkpoint tensor's bytes are, without reading them: the unit of the checkpoint model
(``model.checkpoint``), produced by every reader (``checkpoint.readers``) and consumed by every writer.

A tensor is a list of ``Piece``s, each a contiguous run of its row-major flattened elements stored
contiguously in one file (a ZeRO-3 rank's unpadded partition, a DCP chunk). Where a layout cannot be
described so (a DCP chunk split along another dim, a compressed record), ``load`` reads the tensor
whole instead: that one tensor is then in memory, never the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides (in elements) of a row-major contiguous tensor of ``shape``, as torch gives them."""
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


@dataclass(frozen=True)
class Piece:
    """``numel`` elements of a tensor, from element ``start`` on, stored at ``offset`` of ``file``."""

    file: Path
    offset: int
    """Byte offset of the first element in ``file``."""
    start: int
    """First element (of the row-major flattened tensor) this piece holds."""
    numel: int


@dataclass
class SourceTensor:
    """One tensor of the source checkpoint, by its name there."""

    name: str
    dtype: str
    """torch dtype name without ``torch.`` (``float32``...): the dtype stored in the source."""
    shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)
    load: Callable[[], "torch.Tensor"] | None = None
    """Reads the whole tensor (only where ``pieces`` cannot describe it)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES

    def covered(self) -> bool:
        """True when the pieces cover every element once (checked before anything is written)."""
        if self.load is not None:
            return True
        pos = 0
        for p in sorted(self.pieces, key=lambda p: p.start):
            if p.start != pos:
                return False
            pos += p.numel
        return pos == self.numel
