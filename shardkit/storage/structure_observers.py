"""Who wants to see the structures ``torch_load.read_structure`` parses: ``shardkit verify`` runs a format's
reader under ``observe_structures`` and checks what the reader parsed anyway (each rank file's pickle, the
ranks' agreement, and the zip records its central directory lists) instead of opening every file a second
time; and, within ``reusing_parses``, a file parsed a moment ago is handed back instead of parsed again
(verify's layout detection, the reader's opening and its description each parse rank 0's files)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Callable, Iterator
from zipfile import ZipInfo

#: ``callback(path, structure, records)``: the file parsed, what its data.pkl holds, its zip central directory.
Observer = Callable[[Path, Any, list[ZipInfo]], None]

#: The callbacks installed in this thread (a context variable: a reader's worker threads are not watched).
_OBSERVERS: ContextVar[tuple[Observer, ...]] = ContextVar("structure_observers", default=())

#: (absolute path, size, mtime) -> (structure, records) of the first few files parsed in a ``reusing_parses``
#: block; None outside one.
_Kept = dict[tuple[str, int, int], tuple[Any, list[ZipInfo]]]
_REUSED: ContextVar[tuple[_Kept, int] | None] = ContextVar("reused_structures", default=None)


@contextmanager
def observe_structures(callback: Observer) -> Iterator[None]:
    """Within the block, call ``callback(path, structure, records)`` after every successful ``read_structure``
    (and every structure ``reusing_parses`` hands back)."""
    token = _OBSERVERS.set((*_OBSERVERS.get(), callback))
    try:
        yield
    finally:
        _OBSERVERS.reset(token)


@contextmanager
def reusing_parses(keep: int = 4) -> Iterator[None]:
    """Within the block, ``read_structure`` of a file among the first ``keep`` it parsed, unchanged on disk (same
    size and mtime), returns that parse: the same object, which callers read and never change. The first: the
    files parsed again are rank 0's, which the layout detection reads first and a reader reads before and after
    every other rank's. ``keep`` bounds the memory (a verify of 1,024 ranks holds a few files' structures)."""
    token = _REUSED.set(({}, keep))
    try:
        yield
    finally:
        _REUSED.reset(token)


def _key(path: Path) -> tuple[str, int, int]:
    st = os.stat(path)
    return os.path.abspath(path), st.st_size, st.st_mtime_ns


def recall(path: Path) -> Any | None:
    """The structure of ``path`` parsed earlier in this ``reusing_parses`` block, reported to the observers as
    a parse is; None: parse it (outside a block, or not among the files kept)."""
    reused = _REUSED.get()
    if reused is None:
        return None
    kept, _ = reused
    try:
        key = _key(path)
    except OSError:  # missing, a loop of links, unreadable: nothing kept; the checked open names why
        return None
    hit = kept.get(key)
    if hit is None:
        return None
    parsed(path, *hit)
    return hit[0]


def parsed(path: Path, structure: Any, records: list[ZipInfo], reusable: bool = True) -> None:
    """``read_structure`` reports a successful parse (nothing to do where nobody observes or reuses);
    ``reusable``: parsed through the default allow-list, the only parses ``recall`` hands back."""
    reused = _REUSED.get()
    if reused is not None and reusable:
        kept, keep = reused
        if len(kept) < keep:
            kept[_key(path)] = (structure, records)
    for observe in _OBSERVERS.get():
        observe(path, structure, records)
