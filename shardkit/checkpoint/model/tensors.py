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

What needs a tensor's values in memory (a resume's partitions, a writer's torch route) reads them here
(``read_into``, ``read_slice``): only the bytes of the window asked for, straight into the tensor.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, overload

from shardkit.core.errors import CheckpointError
from shardkit.core.files import regular_fd
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
    index_fault: str | None = None
    """Set by a reader whose source's own index of the tensor's chunks does not cover it exactly once,
    where ``load`` reads it anyway (torch's ``dcp.load`` leaves elements no chunk holds as they were)."""

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
        return self.coverage_fault() is None

    def coverage_fault(self) -> str | None:
        """None when the pieces hold every element exactly once; else the first gap or overlap, in words
        (``elements 16..31 of 32 are in no stored piece``)."""
        if self.load is not None or isinstance(self.pieces, Pieces):
            # a loader's coverage is its reader's to judge; a layout covers every element by construction
            return self.index_fault
        pos, last = 0, None
        for p in sorted((p for p in self.pieces if p.numel), key=lambda p: p.start):
            if p.start > pos:
                return (f"elements {pos:,}..{p.start - 1:,} of {self.numel:,} are in no stored piece"
                        + (f" (the pieces around them are in {last.file.name} and {p.file.name})" if last else ""))
            if p.start < pos and last is not None:
                return (f"elements {p.start:,}..{min(pos, p.start + p.numel) - 1:,} are stored twice, in "
                        f"{last.file.name} and in {p.file.name}")
            pos, last = p.start + p.numel, p
        if pos < self.numel:
            return f"elements {pos:,}..{self.numel - 1:,} of {self.numel:,} are in no stored piece"
        if pos > self.numel:
            return f"its pieces hold {pos:,} elements where the tensor has {self.numel:,}"
        return None


#: What a piece's file that ends before the piece's bytes is told to do, unless the caller says otherwise.
CUT_SHORT_FIX = ("the file was cut short after it was read (a copy still running?). Re-copy it, or resume from the "
                 "previous checkpoint")


def read_into(t: SourceTensor, lo: int, out: "torch.Tensor", fix: str = CUT_SHORT_FIX) -> None:
    """Elements ``[lo, lo + out.numel())`` of ``t`` (flattened) into ``out`` (1-D, contiguous, CPU): its
    pieces' bytes read straight into ``out`` (``read_bytes``: no intermediate buffer, which made the first
    ZeRO-3 resume 5x slower than the memory-mapped reader it replaced), read and cast where ``out`` has
    another dtype, through ``t.load`` where a loader holds it."""
    import torch

    if t.load is not None:
        out.copy_(t.load().reshape(-1)[lo:lo + out.numel()])
    elif str(out.dtype).removeprefix("torch.") != t.dtype:
        out.copy_(read_slice(t, lo, lo + out.numel(), fix))
    else:
        read_bytes(t, lo, memoryview(out.view(torch.uint8).numpy().data), fix)


def read_bytes(t: SourceTensor, lo: int, view: memoryview, fix: str = CUT_SHORT_FIX) -> None:
    """The bytes of elements ``[lo, lo + len(view) // itemsize)`` of ``t``, from its pieces into ``view`` (no
    torch). CheckpointError naming the file for one that ends early (``fix``: what to do), and for elements
    no piece holds."""
    size, done = ITEMSIZE[t.dtype], 0
    hi = lo + len(view) // size
    for piece in t.pieces_in(lo, hi):
        at, want, got = (piece.start - lo) * size, piece.numel * size, 0
        fd = regular_fd(piece.file)
        try:
            while got < want and (n := os.preadv(fd, [view[at + got:at + want]], piece.offset + got)) > 0:
                got += n
        finally:
            os.close(fd)
        if got != want:
            raise CheckpointError(f"{piece.file}: ends {want - got} byte(s) before the {want} bytes of {t.name} at "
                                  f"offset {piece.offset} the layout places there: {fix}")
        done += want
    if done != len(view):
        raise CheckpointError(f"{t.name}: elements [{lo}, {hi}) are not all in the rank files' pieces "
                              "(an internal error of the ZeRO-3 layout; please report it with the folder's listing)")


def same_bytes(a: SourceTensor, b: SourceTensor) -> bool:
    """``a`` and ``b`` hold the same bytes (a tied weight saved under two names): the same dtype and shape,
    every element stored and equal, compared 16 MiB at a time; False where either is empty, not fully
    stored (its reader's refusal says so later) or held by a loader (not compared)."""
    if ((a.dtype, a.shape) != (b.dtype, b.shape) or not a.numel or a.load is not None or b.load is not None
            or not (a.covered() and b.covered())):
        return False
    size = ITEMSIZE[a.dtype]
    step = (16 * 2**20) // size
    for lo in range(0, a.numel, step):
        x, y = bytearray(min(step, a.numel - lo) * size), bytearray(min(step, a.numel - lo) * size)
        read_bytes(a, lo, memoryview(x))
        read_bytes(b, lo, memoryview(y))
        if x != y:
            return False
    return True


def read_slice(t: SourceTensor, lo: int, hi: int, fix: str = CUT_SHORT_FIX) -> "torch.Tensor":
    """Elements ``[lo, hi)`` of ``t`` (flattened) as a new tensor of its dtype (``read_into``)."""
    import torch

    out = torch.empty(hi - lo, dtype=getattr(torch, t.dtype))
    read_into(t, lo, out, fix)
    return out


def box_fault(shape: tuple[int, ...], boxes: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]) -> str | None:
    """None when the boxes ``(offsets, sizes)`` (a DCP tensor's chunks, in any dims) tile ``shape`` exactly
    once; else the first region no box holds, or two hold, as index ranges (``[32:64, 0:128] is in no
    stored chunk``). Swept one dim at a time: slabs of dim 0 cost one pass over their starts."""
    for offsets, sizes in boxes:
        # a damaged .metadata can give a chunk fewer sizes than dims (the sweep found one): said, not an IndexError
        if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, sizes, shape)):
            return f"a chunk at offsets {list(offsets)} with sizes {list(sizes)} lies outside the shape {list(shape)}"
    found = _box_gap(shape, [b for b in boxes if all(b[1])])
    if found is None:
        return None
    region, count = found
    where = ("[" + ", ".join(f"{lo}:{hi}" for lo, hi in region) + "]") if region else "its one element"
    return f"{where} is in no stored chunk" if count == 0 else f"{where} is stored in {count} chunks"


def _box_gap(shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]
             ) -> tuple[list[tuple[int, int]], int] | None:
    if not shape:
        return None if len(boxes) == 1 else ([], len(boxes))
    cuts = sorted({0, shape[0], *(o[0] for o, _ in boxes), *(o[0] + n[0] for o, n in boxes)})
    boxes = sorted(boxes, key=lambda b: b[0][0])
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    nxt = 0
    for lo, hi in zip(cuts, cuts[1:]):
        active = [b for b in active if b[0][0] + b[1][0] > lo]
        while nxt < len(boxes) and boxes[nxt][0][0] <= lo:
            active.append(boxes[nxt])
            nxt += 1
        inner = _box_gap(shape[1:], [(o[1:], n[1:]) for o, n in active])
        if inner is not None:
            return [(lo, hi), *inner[0]], inner[1]
    return None


def written_as(tensors: Mapping[str, SourceTensor]) -> Iterator[tuple[str, SourceTensor]]:
    """``{output name: tensor}`` as ``refuse_uncovered`` takes it: the output name said where it is not the
    source's (a Hugging Face name, a tied alias)."""
    for name, t in tensors.items():
        yield (name if name == t.name else f"written as {name!r}"), t


def refuse_uncovered(folder: Path, tensors: Iterable[tuple[str, SourceTensor]]) -> None:
    """Raise CheckpointError naming the first tensor whose pieces do not hold every element exactly once,
    with its first gap or overlap; every operation calls it before it writes anything. Each tensor comes
    with what it is to the caller (its output name, ``exp_avg of 'w'``), said beside its source name
    where the two differ."""
    faults, seen = [], set()
    for role, t in tensors:
        if id(t) not in seen:  # a tied alias is its holder's tensor: checked, and named, once
            seen.add(id(t))
            fault = t.coverage_fault()
            if fault is not None:
                faults.append((role, t, fault))
    if not faults:
        return
    role, t, fault = faults[0]
    more = ""
    if len(faults) > 1:
        names = ", ".join(repr(f[1].name) for f in faults[1:4]) + (", ..." if len(faults) > 4 else "")
        more = f" {len(faults) - 1} more tensor(s) are not fully stored either: {names}."
    raise CheckpointError(
        f"{folder}: tensor {t.name!r}{'' if role == t.name else f' ({role})'} ({t.dtype}{list(t.shape)}) is not "
        f"fully stored: {fault}.{more} The checkpoint's index of its pieces (DCP's .metadata, the ranks' partition "
        "records) does not add up to the tensor: a rank's save stopped part-way, or files of different saves are "
        "mixed. Nothing was written; pass a complete checkpoint (save it again, or restore the missing files "
        "from the same save)")
