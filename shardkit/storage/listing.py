"""One listing of a checkpoint folder, taken once and handed to every step that asks what the folder holds.

A resuming rank used to list its tag folder five times (finding the tag, the ZeRO stage, the links leaving
it, the rank files, twice) and stat every entry on the way: at 1,024 ranks on a shared filesystem each
listing of a folder of 2,048 rank files is a metadata storm of its own. ``list_folder`` reads the folder
once with ``os.scandir``, whose entries carry the file type the directory itself records (``d_type``), so
telling files, folders and links apart costs no ``stat`` but for the links.

The one-shot commands (``consolidate``, ``verify``, ``convert``, ``reshard``) ask about their source folder
from a dozen places (the layout refusal, the resolver, the link check, the reader, verify's file walk), each
once a listing of its own. Inside ``source_listed_once`` every ``list_folder`` (and ``walk``) of a folder of
the source is answered from the first listing of it: the command lists its tag folder once, whichever step
asks first. Only folders of the source are held (a command reads its source and never writes it), never
one it writes: those are listed afresh each time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import inspect
import os
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar


@dataclass(frozen=True)
class FolderListing:
    """What one ``os.scandir`` of ``folder`` found."""

    folder: Path
    names: tuple[str, ...]
    """Every entry's name, sorted."""
    files: frozenset[str]
    """Regular files, and links to regular files (``Path.is_file``'s answer)."""
    links: tuple[str, ...]
    """Symbolic links, to anything (the entries a reader must not follow out of the folder)."""
    folders: tuple[str, ...]
    """Folders that are not links (the ones ``os.walk`` descends into)."""

    def describes(self, folder: Path) -> bool:
        """True when this is the listing of ``folder`` (a caller may hand on a listing of another)."""
        return self.folder == folder

    def has(self, name: str) -> bool:
        """True when the folder holds an entry ``name``, of any kind (``names`` as a set, built once)."""
        return name in self._name_set

    @functools.cached_property
    def _name_set(self) -> frozenset[str]:
        return frozenset(self.names)


def list_folder(folder: Path) -> FolderListing:
    """``folder``'s entries, read once (OSError as ``os.scandir`` raises it: a missing folder, no permission);
    inside ``source_listed_once``, a folder of the source already listed is not listed again."""
    held = _HELD.get()
    if held is None:
        return _scan(folder)
    key = os.path.abspath(folder)
    if not held.holds(key):
        return _scan(folder)
    found = held.listings.get(key)
    if found is None:
        found = held.listings[key] = _scan(folder)
    # the same entries under the caller's spelling of the path (``describes`` compares paths as given)
    return found if found.folder == folder else dataclasses.replace(found, folder=folder)


def walk(folder: Path) -> Iterator[tuple[str, list[str], list[str]]]:
    """``os.walk(folder)`` (top-down, links not followed, an unreadable folder skipped) whose first step,
    ``folder`` itself, is ``list_folder``'s listing: the tag folder is not listed again for a walk of it.
    Links to folders are among the folder names, as ``os.walk`` puts them (one ``stat`` per link)."""
    try:
        top = list_folder(folder)
    except OSError:
        return
    links = set(top.links)
    dirs = [n for n in top.names if n in top.folders or (n in links and os.path.isdir(folder / n))]
    yield str(folder), dirs, [n for n in top.names if n not in dirs]
    for sub in dirs:  # the caller may have pruned or reordered ``dirs``, as os.walk allows
        if sub not in links:
            yield from os.walk(folder / sub)


@dataclass
class _Held:
    """The listings a ``source_listed_once`` block keeps: of folders at or under ``source``, but never at or
    under ``written`` nor the folder ``written`` is put in (listed afresh: the command changes them)."""

    source: str
    written: str | None
    listings: dict[str, FolderListing] = dataclasses.field(default_factory=dict)

    def holds(self, folder: str) -> bool:
        if not _at_or_under(folder, self.source):
            return False
        return self.written is None or not (_at_or_under(folder, self.written)
                                            or folder == os.path.dirname(self.written))


_HELD: ContextVar[_Held | None] = ContextVar("shardkit_source_listings", default=None)


def _at_or_under(folder: str, top: str) -> bool:
    return folder == top or folder.startswith(top.rstrip(os.sep) + os.sep)


@contextlib.contextmanager
def source_listed_once(source: str | os.PathLike[str], written: str | os.PathLike[str] | None = None) -> Iterator[None]:
    """Within the block, each folder at or under ``source`` (a checkpoint root, tag or Trainer folder; a rank
    file: its folder) is listed once by ``list_folder``, except ``written`` (the command's output) and the
    folder it goes in. Threads the block starts list afresh (a context variable: correct, only not shared).
    Inside a block that holds ``source`` already (a command's verify step), the outer block's listings serve."""
    path = os.path.abspath(source)
    if os.path.isfile(path):
        path = os.path.dirname(path)
    outer = _HELD.get()
    if outer is not None and outer.holds(path):
        yield
        return
    token = _HELD.set(_Held(path, os.path.abspath(written) if written is not None else None))
    try:
        yield
    finally:
        _HELD.reset(token)


_F = TypeVar("_F", bound=Callable[..., Any])


def lists_source_once(source: str, written: str | None = None) -> Callable[[_F], _F]:
    """Run the decorated command inside ``source_listed_once`` of its arguments named ``source`` and
    ``written``; an argument that is no path (a resolved object, None) runs it without the block."""
    def decorate(fn: _F) -> _F:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind_partial(*args, **kwargs).arguments
            src, out = bound.get(source), bound.get(written) if written is not None else None
            if not isinstance(src, (str, os.PathLike)):
                return fn(*args, **kwargs)
            with source_listed_once(src, out if isinstance(out, (str, os.PathLike)) else None):
                return fn(*args, **kwargs)
        return wrapper  # type: ignore[return-value]
    return decorate


def _scan(folder: Path) -> FolderListing:
    with os.scandir(folder) as it:
        entries = sorted(it, key=lambda e: e.name)
    return FolderListing(
        folder=folder, names=tuple(e.name for e in entries),
        files=frozenset(e.name for e in entries if _is_file(e)),
        links=tuple(e.name for e in entries if e.is_symlink()),
        folders=tuple(e.name for e in entries if e.is_dir(follow_symlinks=False)))


def _is_file(entry: os.DirEntry[str]) -> bool:
    """``Path.is_file``'s answer for a listed entry: a link that loops (``loop -> loop``, ELOOP) or leads
    nowhere is no file, as it is for every command that asks ``Path.is_file`` (``DirEntry.is_file`` raises
    ELOOP, which stopped every command listing the folder with 'Too many levels of symbolic links')."""
    try:
        return entry.is_file()
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOENT, errno.ENOTDIR, errno.EBADF):
            return False
        raise
