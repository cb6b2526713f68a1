"""One listing of a checkpoint folder, taken once and handed to every step that asks what the folder holds.

A resuming rank used to list its tag folder five times (finding the tag, the ZeRO stage, the links leaving
it, the rank files, twice) and stat every entry on the way: at 1,024 ranks on a shared filesystem each
listing of a folder of 2,048 rank files is a metadata storm of its own. ``list_folder`` reads the folder
once with ``os.scandir``, whose entries carry the file type the directory itself records (``d_type``), so
telling files, folders and links apart costs no ``stat`` but for the links.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


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


def list_folder(folder: Path) -> FolderListing:
    """``folder``'s entries, read once (OSError as ``os.scandir`` raises it: a missing folder, no permission)."""
    with os.scandir(folder) as it:
        entries = sorted(it, key=lambda e: e.name)
    return FolderListing(
        folder=folder, names=tuple(e.name for e in entries),
        files=frozenset(e.name for e in entries if e.is_file()),
        links=tuple(e.name for e in entries if e.is_symlink()),
        folders=tuple(e.name for e in entries if e.is_dir(follow_symlinks=False)))
