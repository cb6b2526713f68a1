"""Who wants to see the structures ``torch_load.read_structure`` parses: ``shardkit verify`` runs a format's
reader under ``observe_structures`` and checks what the reader parsed anyway (each rank file's pickle, the
ranks' agreement) instead of parsing every file a second time."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Callable, Iterator

#: The callbacks installed in this thread (a context variable: a reader's worker threads are not watched).
_OBSERVERS: ContextVar[tuple[Callable[[Path, Any], None], ...]] = ContextVar("structure_observers", default=())


@contextmanager
def observe_structures(callback: Callable[[Path, Any], None]) -> Iterator[None]:
    """Within the block, call ``callback(path, structure)`` after every successful ``read_structure``."""
    token = _OBSERVERS.set((*_OBSERVERS.get(), callback))
    try:
        yield
    finally:
        _OBSERVERS.reset(token)


def parsed(path: Path, structure: Any) -> None:
    """``read_structure`` reports a successful parse (nothing to do where nobody observes)."""
    for observe in _OBSERVERS.get():
        observe(path, structure)
