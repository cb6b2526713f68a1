"""Symbolic links in a checkpoint folder: the ones leading out of it, which no command reads or writes through
(a rank file swapped for ``zero_pp_rank_0_... -> /home/other/run/...`` would be read, hashed or written through),
and the ones leading nowhere (a missing target, a loop), which no command reads either. ``storage.verify`` names
them in its reports; ``refuse_links_leaving`` is what readers of a folder without a manifest call first."""

from __future__ import annotations

import contextlib
import itertools
import os
from pathlib import Path
from typing import Iterable, Iterator

from shardkit.core.errors import CheckpointError
from shardkit.storage.listing import FolderListing, list_folder


def links_leaving(tag_dir: Path, listing: FolderListing | None = None) -> list[tuple[str, str]]:
    """Every symlink under ``tag_dir`` (to a file or a folder, listed in the manifest or not) whose
    target resolves outside it, as ``(relative path, where it leads)``, sorted.

    Why every link and not only the listed files: a reader that trusts the folder (DeepSpeed's own
    ``load_checkpoint``, a converter reading a file by its rank name) opens what is there, and a
    rank file swapped for ``zero_pp_rank_0_... -> /home/other/run/...`` would be read, hashed or, by
    a later save into the same folder, written through. Folders that are links are not descended
    (``os.walk`` never follows them), so a loop of links cannot hang it. ``listing``: of ``tag_dir``, already
    taken: its links are checked and its folders walked without listing ``tag_dir`` again."""
    inside = tag_dir.resolve()
    out = []
    for entry in _symlinks(tag_dir, listing):
        real = Path(os.path.realpath(entry))
        if not real.is_relative_to(inside):
            out.append((entry.relative_to(tag_dir).as_posix(), str(real)))
    return sorted(out)


def links_nowhere(tag_dir: Path, listing: FolderListing | None = None) -> list[tuple[str, str]]:
    """Every symlink under ``tag_dir`` that leads to nothing: its target missing, or a loop (``loop -> loop``),
    as ``(relative path, what it points to)``, sorted. No command reads one (a listing counts it as no file,
    as ``Path.is_file`` does), so ``shardkit verify`` names it as a warning, and a manifest, which lists files,
    is not written over it. ``listing``: as for ``links_leaving``."""
    out = []
    for entry in _symlinks(tag_dir, listing):
        if not os.path.exists(entry):  # False for a missing target and for a loop (ELOOP) alike
            with contextlib.suppress(OSError):
                out.append((entry.relative_to(tag_dir).as_posix(), os.readlink(entry)))
    return sorted(out)


def _symlinks(tag_dir: Path, listing: FolderListing | None) -> Iterator[Path]:
    """The symlinks under ``tag_dir``, folders that are links not descended (``os.walk`` never follows them, so a
    loop of links cannot hang it); ``tag_dir`` itself from ``listing`` (or the command's one listing of it)."""
    walks: Iterable[tuple[str, list[str], list[str]]] = os.walk(tag_dir)
    if listing is None or not listing.describes(tag_dir):
        with contextlib.suppress(OSError):  # no folder: os.walk finds nothing either
            listing = list_folder(tag_dir)  # the command's one listing of it (storage.listing)
    if listing is not None and listing.describes(tag_dir):
        walks = itertools.chain([(str(tag_dir), [], list(listing.links))],
                                *(os.walk(tag_dir / sub) for sub in listing.folders))
    for dirpath, dirnames, filenames in walks:
        for name in (*dirnames, *filenames):
            entry = Path(dirpath, name)
            if entry.is_symlink():
                yield entry


def link_outside_message(tag_dir: Path, rel: str, real: str) -> str:
    """One line for a link ``links_leaving`` found: which link, where it leads, and that it is not followed."""
    try:
        shown = os.readlink(tag_dir / rel)
    except OSError:
        shown = real
    return (f"{tag_dir / rel}: a symlink to {shown!r}, which leads outside the checkpoint folder {tag_dir.resolve()} "
            f"(to {real}); shardkit never reads or writes through it")


LINK_OUTSIDE_FIX = ("replace the link with a copy of the file it points to (cp --remove-destination TARGET LINK) if "
                    "that file really belongs to this checkpoint, or resume from another tag")


def refuse_links_leaving(tag_dir: str | os.PathLike[str], doing: str, listing: FolderListing | None = None) -> None:
    """Raise one CheckpointError naming the first symlink in ``tag_dir`` that leads outside it (and
    how many more there are). For readers of a folder without a manifest, which ``verify_checkpoint``
    never sees: ``doing`` says what was about to happen ('convert', 'read'); ``listing``: ``links_leaving``'s."""
    why = links_leaving_refusal(tag_dir, doing, listing)
    if why is not None:
        raise CheckpointError(why)


def links_leaving_refusal(tag_dir: str | os.PathLike[str], doing: str,
                          listing: FolderListing | None = None) -> str | None:
    """The words ``refuse_links_leaving`` raises for ``tag_dir``, or None when no link leads out of it
    (``shardkit inspect`` gives them as every command's verdict: each command refuses the folder with them)."""
    tag_dir = Path(tag_dir)
    found = links_leaving(tag_dir, listing)
    if not found:
        return None
    rel, real = found[0]
    more = f" ({len(found) - 1} more such link(s))" if len(found) > 1 else ""
    return f"refusing to {doing} {tag_dir}: {link_outside_message(tag_dir, rel, real)}{more}. Fix: {LINK_OUTSIDE_FIX}"
