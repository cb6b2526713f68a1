"""Consolidate's split run: one output file written by every process ``srun``/``torchrun``
launched (``storage.shared_meet``, ``storage.shared_save``). Process 0 claims ``.shardkit-tmp-<name>/``
beside the output, every process agrees on the request before anything is written, process 0
creates the sized file (header written) in it, every process copies its share of the pieces to
their offsets, hashes its share of the source files, fsyncs and reports, and process 0 renames
the file into place. Any failure: process 0 removes the staging folder (with the partial file).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from shardkit.core.errors import CheckpointError
from shardkit.storage.atomic import disk_full_named, fsync_dir, note_published, signals_deferred, staging_dir
from shardkit.storage.manifest import FileEntry
from shardkit.storage.pipeline import check_source_digests, hash_beside
from shardkit.storage.request import RunRequest
from shardkit.storage.shared_meet import meet
from shardkit.storage.shared_save import Launch, gather_parts, join_timeout_s, remove_own_claim, write_part


def write_shared(out: Path, launch: Launch, request: RunRequest, write_small: Callable[[int], None],
                  copy_share: Callable[[int], None], to_hash: list[tuple[Path, FileEntry]], workers: int,
                  outcome: str) -> None:
    """This process's share of one output file written by every launched process (``shared_save``).

    Process 0 claims ``.shardkit-tmp-<name>/`` beside ``out``, every process agrees on ``request``
    (``storage.shared_meet``: nothing is written before), and process 0 creates the sized file in it
    (under another name first, so the others never open it before it has its header and size);
    every process copies its pieces into it, hashes ``to_hash``, fsyncs (on a shared filesystem a
    writer's pages reach the server only when it flushes them) and reports; process 0 gathers the
    reports and renames the file over ``out``. Any failure: process 0 removes the staging folder.
    """
    started = time.monotonic()
    made_parent = not out.parent.exists()
    # process 0's claimed staging folder until it is removed: removed by the clean-up below whatever
    # stops the run, even once the rmtree after the rename has taken the owner file that
    # remove_own_claim looks for (as storage.shared_tag.write_tag_shared does)
    claimed: Path | None = None
    try:
        # inside the try: an interrupt right as the claim returns still leaves nothing
        with meet(out.parent, out.name, launch, request, sweep=False) as staged, disk_full_named(out, outcome):
            if launch.rank == 0:
                claimed = staged
            data = staged / out.name
            error: BaseException | None = None
            try:
                fd = _create_sized(data, write_small) if launch.rank == 0 else _open_when_created(data, launch)
                try:
                    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(to_hash))),
                                            thread_name_prefix="shardkit-verify") as hashers:
                        hashed = hash_beside(hashers, to_hash)
                        copy_share(fd)
                        check_source_digests(hashed, "publish the consolidation of", "consolidate another tag")
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except BaseException as exc:  # noqa: BLE001 - reported to process 0 before it is raised here
                error = exc
            lines = str(error).strip().splitlines() if error is not None else []
            write_part(staged, launch, [], None if error is None else f"{type(error).__name__}: {lines[0] if lines else ''}")
            if error is not None:
                raise error
            if launch.rank == 0:
                gather_parts(staged, launch, started)
        if launch.rank == 0:
            with signals_deferred():  # the rename and its record as one step, for the CLI's message
                os.replace(data, out)
                note_published(out)
            fsync_dir(out.parent)
            shutil.rmtree(staged, ignore_errors=True)
            claimed = None
    except BaseException:
        if launch.rank == 0:
            with signals_deferred():  # a SIGTERM from torchrun waits for the clean-up (storage.atomic)
                if claimed is not None:
                    shutil.rmtree(claimed, ignore_errors=True)
                else:
                    remove_own_claim(staging_dir(out.parent, out.name), launch)  # found by its owner file
                if made_parent:
                    with contextlib.suppress(OSError):
                        out.parent.rmdir()  # the folder this run made, if nothing else was put there meanwhile
        raise


def _create_sized(data: Path, write_small: Callable[[int], None]) -> int:
    """Process 0: the output file with its header, small tensors and full size, then given its name."""
    sizing = data.with_name(f".sizing-{data.name}")
    fd = os.open(sizing, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_small(fd)
        os.rename(sizing, data)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_when_created(data: Path, launch: Launch) -> int:
    """Processes 1..N-1: the file process 0 is creating, once it has its size (it is renamed in sized)."""
    timeout = join_timeout_s()
    deadline = time.monotonic() + timeout
    while True:
        try:
            return os.open(data, os.O_WRONLY)
        except FileNotFoundError:
            if not data.parent.is_dir():
                raise CheckpointError(
                    f"rank {launch.rank} of {launch.world} ({launch.launcher}, host {launch.host}): the staging folder "
                    f"{data.parent} was removed before the output file appeared in it: rank 0 failed (see its "
                    "output). Run the whole command again") from None
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"rank {launch.rank} of {launch.world} ({launch.launcher}, host {launch.host}): rank 0 did not "
                    f"create {data} within {timeout:.0f} s although it claimed {data.parent}: it is stuck or "
                    "failed (see its output). Run the whole command again") from None
            time.sleep(0.05)
