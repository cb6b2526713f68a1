"""Where a checkpoint tensor's bytes are, without reading them: the unit of the checkpoint model
(``model.checkpoint``), produced by every reader (``checkpoint.readers``) and consumed by every writer.

A tensor is a sequence of ``Piece``s, each a contiguous run of its row-major flattened elements stored
contiguously in one file (a ZeRO-3 rank's unpadded partition, a DCP chunk). Where a layout cannot be
described so (a DCP chunk split along another dim, a compressed record), ``load`` reads the tensor
whole instead: that one tensor is then in memory, never the model.

Most readers store the pieces as a list. A layout that splits every tensor over every rank (ZeRO-3)
gives a ``Pieces`` instead: each piece computed from the layout when asked for, so a process holds
no ranks x tensors list, and ``SourceTensor.pieces_in`` of an element window costs only the pieces
of the ranks overlapping it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, overload

from shardkit.storage.torch_load import ITEMSIZE

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

    def clipped(self, lo: int, hi: int, itemsize: int) -> Piece | None:
        """The part of this piece holding elements ``[lo, hi)`` of the tensor (None when it holds none)."""
        a, b = max(lo, self.start), min(hi, self.start + self.numel)
        if b <= a:
            return None
        return Piece(self.file, self.offset + (a - self.start) * itemsize, a, b - a)


class Pieces(Sequence[Piece]):
    """Pieces computed on demand (a reader's layout arithmetic), in element order, each covering the
    elements after the one before: subclasses give ``__len__``, ``piece`` and ``overlapping``."""

    def piece(self, i: int) -> Piece:
        raise NotImplementedError

    def overlapping(self, lo: int, hi: int) -> range:
        """Indices of the pieces holding elements of ``[lo, hi)``."""
        raise NotImplementedError

    @overload
    def __getitem__(self, i: int) -> Piece: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[Piece]: ...

    def __getitem__(self, i: int | slice) -> Piece | Sequence[Piece]:
        if isinstance(i, slice):
            return [self.piece(j) for j in range(len(self))[i]]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.piece(i)

    def within(self, lo: int, hi: int) -> Iterator[Piece]:
        """The pieces holding elements of ``[lo, hi)`` (not clipped), found by arithmetic, not a scan:
        no other piece is computed (a ZeRO-3 rank file is parsed only when one of its pieces is asked for)."""
        for i in self.overlapping(lo, hi):
            yield self.piece(i)


@dataclass
class SourceTensor:
    """One tensor of the source checkpoint, by its name there."""

    name: str
    dtype: str
    """torch dtype name without ``torch.`` (``float32``...): the dtype stored in the source."""
    shape: tuple[int, ...]
    pieces: Sequence[Piece] = field(default_factory=list)
    """Where the elements lie: a list, or ``Pieces`` computed on demand (ZeRO-3); readers that build a
    list append to it."""
    load: Callable[[], "torch.Tensor"] | None = None
    """Reads the whole tensor (only where ``pieces`` cannot describe it)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES

    def add(self, piece: Piece) -> None:
        """Append ``piece`` to a reader's list of pieces (a ``Pieces`` layout takes none)."""
        if not isinstance(self.pieces, list):
            raise TypeError(f"{self.name}: its pieces are computed from a layout; nothing can be added")
        self.pieces.append(piece)

    def pieces_in(self, lo: int, hi: int) -> Iterator[Piece]:
        """The parts of the pieces holding elements ``[lo, hi)``, clipped to it, in element order."""
        itemsize = ITEMSIZE[self.dtype]
        pieces = self.pieces.within(lo, hi) if isinstance(self.pieces, Pieces) else sorted(
            self.pieces, key=lambda p: p.start)
        for p in pieces:
            part = p.clipped(lo, hi, itemsize)
            if part is not None:
                yield part

    def covered(self) -> bool:
        """True when the pieces cover every element once (checked before anything is written)."""
        if self.load is not None or isinstance(self.pieces, Pieces):
            return True  # computed from a layout that covers every element by construction
        pos = 0
        for p in sorted(self.pieces, key=lambda p: p.start):
            if p.start != pos:
                return False
            pos += p.numel
        return pos == self.numel
