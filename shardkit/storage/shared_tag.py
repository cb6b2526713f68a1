"""One tag folder written by every launched process (reshard, convert both ways): the sequence
around ``storage.shared_save``'s pieces that each of them used to spell out.

Process 0 claims ``root/.shardkit-tmp-<tag>/``, the others join it, and they agree on what they
were asked to do before anything is written (``storage.shared_meet``); every process writes its
share of the files while it hashes its share of the source files on threads beside the writers,
checks that no source file changed while it was read, and reports in its part file; process 0
gathers every part (a process that failed, stopped its heartbeat or never joined fails the run,
named), may add the files only it writes (``finish``), and seals one manifest. Nothing is
published unless every source digest matched: a corrupted source must not get a fresh manifest
vouching for it. Any failure: process 0 removes the staging folder (and ``root`` if it made it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

from shardkit.core.errors import CheckpointError
from shardkit.storage.atomic import signals_deferred, staging_dir
from shardkit.storage.dry_run import writing_starts
from shardkit.storage.manifest import FileEntry, Manifest
from shardkit.storage.pipeline import check_source_digests, hash_beside
from shardkit.storage.request import RunRequest
from shardkit.storage.shared_meet import meet
from shardkit.storage.shared_save import Launch, gather_parts, remove_own_claim, seal, write_part

#: (size, mtime_ns, inode) of a source file: a rewrite or replacement changes one of them.
Signature = tuple[int, int, int]


def signatures(paths: Iterable[Path]) -> dict[Path, Signature]:
    """The source files as they are before anything is read (``check_unchanged`` compares)."""
    return {p: _signature(p) for p in paths}


@dataclass(frozen=True)
class Activity:
    """How messages name the run: ``Activity("the reshard", "reshard")`` gives "while the
    reshard read it" and "publish the reshard of"."""

    subject: str
    """What read the source ("the reshard", "the conversion")."""
    again: str
    """What the user runs once the source is settled ("re-run the reshard", "convert again")."""
    publish: str
    """What a digest mismatch stops ("publish the reshard of")."""
    other_tag: str
    """The alternative a digest mismatch offers ("reshard another tag")."""


def write_tag_shared(
    root: Path,
    tag: str,
    launch: Launch,
    *,
    request: RunRequest,
    write_mine: Callable[[Path], list[FileEntry]],
    to_hash: list[tuple[Path, FileEntry]],
    hash_workers: int,
    before: Mapping[Path, Signature],
    activity: Activity,
    facts: Callable[[list[FileEntry]], Manifest | None],
    finish: Callable[[Path, list[FileEntry]], list[FileEntry]] | None = None,
) -> list[FileEntry]:
    """This process's share of ``root/tag``: ``write_mine(staging folder)`` writes its files (and
    returns their entries) while ``to_hash`` is hashed beside it; on process 0, every process's
    entries plus ``finish``'s are sealed under ``facts(entries)`` (None: no manifest). Returns
    the entries this process wrote (on process 0: every file of the tag). ``request``: what this
    process was asked to do; every process's must be rank 0's before anything is written."""
    writing_starts(f"{root}/{tag}")  # a --dry-run stops here: every check before it has passed
    started = time.monotonic()
    made_root = not os.path.lexists(root)
    # process 0's claimed staging folder until it is published: removed by this function whatever
    # stops the run, even once seal has removed the owner file that remove_own_claim looks for (an
    # interrupt between that and the rename left the folder behind on a loaded CI machine)
    claimed: Path | None = None
    try:
        # inside the try: an interrupt right as the claim returns still leaves nothing
        with meet(root, tag, launch, request) as staged:
            if launch.rank == 0:
                claimed = staged
            entries: list[FileEntry] = []
            error: BaseException | None = None
            try:
                with ThreadPoolExecutor(max_workers=max(1, min(hash_workers, len(to_hash))),
                                        thread_name_prefix="shardkit-verify") as hashers:
                    hashed = hash_beside(hashers, to_hash)
                    try:
                        entries = write_mine(staged)
                    except Exception:
                        # a corrupted source file is the likelier cause of a failed write: named first
                        check_source_digests(hashed, activity.publish, activity.other_tag)
                        raise
                    check_source_digests(hashed, activity.publish, activity.other_tag)
                check_unchanged(before, activity)
            except BaseException as exc:  # noqa: BLE001 - reported to process 0 before it is raised here
                error = exc
            if launch.distributed:
                write_part(staged, launch, entries, None if error is None else one_line(error))
            if error is not None:
                raise error
            if launch.rank == 0:
                if launch.distributed:
                    entries = gather_parts(staged, launch, started)
                if finish is not None:
                    entries = entries + finish(staged, entries)
        if launch.rank == 0:
            manifest = facts(entries)
            if manifest is not None:
                manifest.files = sorted(entries, key=lambda e: e.path)
            seal(staged, root, tag, manifest)
            claimed = None  # renamed into place: no longer this run's to remove
    except BaseException:
        if launch.rank == 0:
            with signals_deferred():  # torchrun's SIGTERM, when another process exits first, waits for this
                if claimed is not None:
                    shutil.rmtree(claimed, ignore_errors=True)
                else:
                    remove_own_claim(staging_dir(root, tag), launch)  # found by its owner file, however far it got
                if made_root:
                    with contextlib.suppress(OSError):
                        root.rmdir()  # the folder this run made, if nothing else was put there meanwhile
        raise
    return entries


def check_unchanged(before: Mapping[Path, Signature], activity: Activity) -> None:
    """A source file replaced or rewritten while it was read (a run saving the same tag again) is
    refused: the output would mix bytes of two saves, and with ``--no-verify`` nothing else sees it."""
    for path, sig in before.items():
        try:
            now: Signature | None = _signature(path)
        except FileNotFoundError:
            now = None
        if now != sig:
            what = "removed" if now is None else "modified"
            raise CheckpointError(
                f"{path}: was {what} while {activity.subject} read it (size/mtime/inode changed): the output would mix "
                f"two saves. Nothing was published; {activity.again} once the source is no longer being saved")


def one_line(exc: BaseException) -> str:
    """``Type: first line`` of an error, for a part file."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _signature(path: Path) -> Signature:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ino
