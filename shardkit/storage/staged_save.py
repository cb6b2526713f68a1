"""The one save sequence every shardkit writer uses: stage, agree across ranks, hash, write the
manifest (the completion marker), publish. File-level primitives live in ``atomic``; the manifest
format in ``manifest``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from shardkit.core.errors import CheckpointError
from shardkit.platform.dist import all_gather_object, barrier, broadcast_object, rank_world
from shardkit.platform.versions import library_versions
from shardkit.storage.atomic import disk_full_error, is_disk_full, publish_tag, signals_deferred, staging_dir
from shardkit.storage.dry_run import writing_starts
from shardkit.storage.manifest import Manifest, describe_files_distributed, write_manifest
from shardkit.storage.shared_save import OWNER_NAME, Launch, claim, heartbeat, remove_own_claim
from shardkit.storage.tags import LATEST_NAME, check_tag


@dataclass
class StagedSave:
    """A save in progress: where to write, and what the manifest will record."""

    path: Path
    """The staging directory to write every file into (the same on every rank)."""
    final: Path
    """Where the checkpoint will be once published: ``root/<tag>``."""
    rank: int
    world_size: int
    facts: dict[str, Any] = field(default_factory=dict)
    """Manifest fields (step, dtype, zero_stage, extra ...); the body may add to them."""
    known_files: list[Any] = field(default_factory=list)
    """FileEntry items the body already hashed (the rest are hashed after the writes)."""
    published: bool = False
    """The staging folder has been renamed into place (it is no longer this save's to remove)."""


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


@contextlib.contextmanager
def atomic_checkpoint(
    root: str | os.PathLike[str], tag: str, *, engine: str, manifest: bool = True, **facts: Any
) -> Iterator[StagedSave]:
    """The one save sequence every shardkit writer uses. Collective when a process group exists.

    Rank 0 creates ``root``, removes leftovers of killed saves (``remove_stale_saves``) and an empty
    staging folder; the body writes into ``save.path`` on every rank; then the ranks agree that
    every write succeeded (a rank that raised makes every rank raise, none waits in a barrier),
    hash the files together, and rank 0 writes the manifest (the completion marker) and publishes
    the tag (``publish_tag``: rename, ``latest`` last). An error on rank 0 there (disk full,
    permissions) is broadcast and raised as the same CheckpointError on every rank.
    ``manifest=False`` (reshard's ``--no-manifest``) skips the hashing and the manifest.
    """
    check_tag(tag, "tag")  # the same on every rank, so every rank raises before any collective
    writing_starts(f"{root}/{tag}")  # a --dry-run stops here: every check before it has passed
    root = Path(root)
    rank, world = rank_world()
    staged = staging_dir(root, tag)
    err: str | None = None
    claimed = False
    host = socket.gethostname()
    launch = Launch(0, world, f"save-{host}-{os.getpid()}-{time.time_ns()}", "process group", host)
    save = StagedSave(path=staged, final=root / tag, rank=rank, world_size=world, facts=dict(facts))
    try:
        if rank == 0:
            # the claim inside the try: an interrupt landing as it returns, before ``claimed`` is set,
            # left the claimed staging folder behind; the clean-up finds it by its owner file
            try:
                # an exclusive claim: a second writer of the same output (another convert, say) is
                # refused while this one runs, instead of both writing into one staging folder
                claim(root, tag, launch)
                claimed = True
            except CheckpointError as exc:
                err = str(exc)
            except OSError as exc:
                err = f"cannot prepare the save of {tag!r} in {root} ({_one_line(exc)}); check the path and its permissions"
        err = broadcast_object(err)
        if err:
            raise CheckpointError(err)
        yield from _write_and_publish(save, staged, root, tag, engine=engine, manifest=manifest)
    except BaseException:
        # whatever stopped it (a failed rank, a full disk, Ctrl-C or SIGTERM between any two steps):
        # the staging folder this save claimed goes (never another writer's: a refused claim
        # leaves it alone), unless it was already published under its tag; a second signal (a
        # scheduler repeating its cancel) waits for the removal
        if rank == 0:
            with signals_deferred():
                if claimed and not save.published:
                    shutil.rmtree(staged, ignore_errors=True)
                elif not claimed:
                    remove_own_claim(staged, launch)
        raise


def _write_and_publish(save: StagedSave, staged: Path, root: Path, tag: str, *, engine: str,
                       manifest: bool) -> Iterator[StagedSave]:
    """The body of ``atomic_checkpoint`` once the staging folder is claimed."""
    rank, world = save.rank, save.world_size
    err: str | None = None
    local: Exception | None = None
    try:
        with heartbeat(staged, rank, alive_file=False):
            yield save
    except Exception as exc:  # noqa: BLE001 - every rank must hear about it before anyone waits
        local = exc
    except BaseException:
        # Ctrl-C or SIGTERM (the CLI turns it into an exception): no collective can be trusted now;
        # rank 0 removes what was staged, so nothing half-written is left behind
        if rank == 0:
            shutil.rmtree(staged, ignore_errors=True)
        raise
    statuses = all_gather_object(None if local is None else _one_line(local))
    failed = [(r, s) for r, s in enumerate(statuses) if s is not None]
    if failed:
        if rank == 0:
            shutil.rmtree(staged, ignore_errors=True)
        if local is not None and not isinstance(local, CheckpointError) and is_disk_full(local):
            # torch's writer names no file (see _TORCH_SHORT_WRITE): name the folder being written
            where = getattr(local, "filename", None) or staged
            raise disk_full_error(where, local, f"nothing written: the staging folder was removed, "
                                  f"{root / LATEST_NAME} is unchanged") from local
        if local is not None:
            raise local
        r, s = failed[0]
        raise CheckpointError(f"saving {tag!r} in {root} failed on rank {r} ({s}); the previous checkpoint and "
                              "'latest' are unchanged")
    known = {e.path: e for e in save.known_files}
    files = describe_files_distributed(staged, exclude={*known, OWNER_NAME}) if manifest else []
    barrier()  # every rank has listed the folder
    if rank == 0 and manifest:
        fields = dict(save.facts)
        fields.setdefault("world_size", world)
        fields.setdefault("versions", library_versions())
        entries = sorted([*files, *known.values()], key=lambda e: e.path)
        try:
            write_manifest(staged, Manifest(engine=engine, tag=tag, files=entries, **fields))
        except OSError as exc:
            # nothing is published yet: the staged files go, so a full disk is not left fuller
            shutil.rmtree(staged, ignore_errors=True)
            outcome = f"nothing written: the staging folder was removed, {root / LATEST_NAME} is unchanged"
            err = (str(disk_full_error(staged / "shardkit_manifest.json", exc, outcome)) if is_disk_full(exc) else
                   f"{root / tag}: the manifest could not be written on rank 0 ({_one_line(exc)}); {outcome}. "
                   f"Fix permissions or free space in {root} and save again")
    if rank == 0 and err is None:
        try:
            # the owner file goes once the folder is renamed: a staging folder without one is never live
            publish_tag(root, staged, tag, drop=(OWNER_NAME,))
            save.published = True
        except (OSError, CheckpointError) as exc:
            err = (f"{root / tag}: the save was written but could not be completed on rank 0 ({_one_line(exc)}); "
                   f"'latest' was not moved to it. Free disk space or fix permissions in {root} and save again")
    err = broadcast_object(err)
    if err:
        raise CheckpointError(err)
