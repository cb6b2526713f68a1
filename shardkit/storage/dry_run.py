"""``--dry-run`` as the real run stopped where it would first write, so a dry run approves only what
the run would start: every check the run makes before writing (the source's layout, its manifest
and digests, ``config.json`` and ``--model-config``, the output path, ``--force``) is the run's own
code, not a second copy that can fall behind it.

Each operation calls :func:`writing_starts` just before its first change to the file system (the
output's parent folder created, a staging folder claimed, stale leftovers removed); the shared
writers (``staged_save.atomic_checkpoint``, ``shared_tag.write_tag_shared``) call it too. Under
:func:`checks_only` that call raises :class:`_WouldWrite`, which ``checks_only`` takes: the
operation's checks have all passed and nothing was written.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


class _WouldWrite(BaseException):
    """The operation reached its first write under ``checks_only`` (never seen outside it). A
    BaseException, so no `except Exception` on the way turns it into an error of its own."""


_DRY: list[str] = []
"""The command being dry-run (one entry while ``checks_only`` is active)."""


def writing_starts(what: str) -> None:
    """Called by an operation just before it first writes ``what``: under a dry run, stop here."""
    if _DRY:
        raise _WouldWrite(what)


@contextmanager
def checks_only(command: str) -> Iterator[None]:
    """Run the block (the real operation) up to its first write. Its refusals propagate as in the
    real run; reaching the end without meeting a ``writing_starts`` is a shardkit bug (the dry run
    could have written), said as such."""
    _DRY.append(command)
    try:
        yield
    except _WouldWrite:
        return
    finally:
        _DRY.pop()
    raise RuntimeError(f"shardkit {command} --dry-run ran to its end without stopping before its first write "
                       "(an operation lacks storage.dry_run.writing_starts): report this as a bug")
