"""One process's share of ``convert_zero3_to_dcp``'s torch-free route, as reshard writes its
files (``io.shared_save``): process 0 claims the staging folder, the others join it; each process
hashes its share of the source files on threads beside its writers, writes its share of the tensor
files (balanced by bytes, the same split in every process) and reports them in a part file; process
0 gathers every part (a process that failed, stopped its heartbeat or never joined fails the run,
named), writes the small items' file and ``.metadata``, and seals one manifest. Nothing is
published unless every source hash matched and no source file changed while it was read.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from shardkit.checkpoint.io.manifest import FileEntry, Manifest
from shardkit.checkpoint.io.pipeline import check_source_digests, default_workers, hash_beside

# the same balanced split of files over processes as reshard's (by bytes, largest first)
from shardkit.checkpoint.io.shared_save import (
    Launch,
    claim,
    gather_parts,
    heartbeat,
    join,
    outcome_unchanged,
    seal,
    split_by_bytes,
    write_part,
)
from shardkit.checkpoint.ops.convert.zero3_to_dcp_bytes import (
    DcpItems,
    file_names,
    write_small_and_metadata,
    write_tensor_files,
)
from shardkit.core.errors import CheckpointError

#: (size, mtime_ns, inode) of a source file: a rewrite or replacement changes one of them.
Signature = tuple[int, int, int]


def source_signatures(tag_dir: Path) -> dict[Path, Signature]:
    """The source's rank files as they are before anything is read (``_check_unchanged`` compares)."""
    return {f: _signature(f) for f in sorted(tag_dir.glob("*.pt"))}


@dataclass
class ShareResult:
    """What this process wrote on the torch-free route."""

    files: int = 0
    bytes: int = 0
    workers: int = 1


def write_share(root: Path, tag: str, items: DcpItems, facts: Manifest, expected: dict[str, str],
                 before: dict[Path, Signature], workers: int | None, launch: Launch) -> ShareResult:
    """The torch-free route: this process's share of the tensor files (all of them alone), then on
    process 0 the small items, ``.metadata`` and one manifest (``io.shared_save``, as reshard)."""
    names = file_names(items)
    mine = [items.big[i] for i in split_by_bytes([it.nbytes for it in items.big], launch.world)[launch.rank]]
    workers = workers or default_workers(max(1, len(mine)))
    source = Path(str(facts.extra["converted_from"]["path"]))
    to_hash = [source / name for i, name in enumerate(sorted(expected)) if i % launch.world == launch.rank]
    outcome = outcome_unchanged(root)
    started = time.monotonic()
    made_root = not os.path.lexists(root)
    staged = claim(root, tag, launch) if launch.rank == 0 else join(root, tag, launch)
    try:
        with heartbeat(staged, launch.rank):
            entries: list[FileEntry] = []
            error: BaseException | None = None
            try:
                # hashed on threads beside the writers (the copy reads byte ranges, not whole files);
                # nothing is published unless every hash matched: a corrupted source must not get a
                # fresh manifest vouching for it
                with ThreadPoolExecutor(max_workers=max(1, min(len(to_hash), len(os.sched_getaffinity(0)))),
                                        thread_name_prefix="shardkit-verify") as hashers:
                    hashed = hash_beside(hashers, [(f, expected[f.name]) for f in to_hash])
                    entries = write_tensor_files(staged, mine, names, outcome, workers)
                    check_source_digests(hashed, "convert", "convert the previous checkpoint")
                _check_unchanged(before)
            except BaseException as exc:  # noqa: BLE001 - reported to process 0 before it is raised here
                error = exc
            if launch.distributed:
                write_part(staged, launch, entries, None if error is None else _one_line(error))
            if error is not None:
                raise error
            if launch.rank == 0:
                if launch.distributed:
                    entries = gather_parts(staged, launch, started)
                entries += write_small_and_metadata(staged, items, names, entries, outcome)
        if launch.rank == 0:
            facts.files = sorted(entries, key=lambda e: e.path)
            seal(staged, root, tag, facts)
    except BaseException:
        if launch.rank == 0:
            shutil.rmtree(staged, ignore_errors=True)
            if made_root:
                with contextlib.suppress(OSError):
                    root.rmdir()  # the folder this run made, if nothing else was put there meanwhile
        raise
    return ShareResult(len(mine), sum(it.nbytes for it in mine), workers)


def _signature(path: Path) -> Signature:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ino


def _check_unchanged(before: dict[Path, Signature]) -> None:
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
                f"{path}: was {what} while the conversion read it (size/mtime/inode changed): the output would mix "
                "two saves. Nothing was published; convert again once the source is no longer being saved")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
