"""One process's share of ``convert_zero3_to_dcp``'s torch-free route, as reshard writes its
files (``io.shared_save``): process 0 claims the staging folder, the others join it; each process
hashes its share of the source files on threads beside its writers, writes its share of the tensor
files (balanced by bytes, the same split in every process) and reports them in a part file; process
0 gathers every part (a process that failed, stopped its heartbeat or never joined fails the run,
named), writes the small items' file and ``.metadata``, and seals one manifest. Nothing is
published unless every source hash matched and no source file changed while it was read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from shardkit.checkpoint.ops.convert.zero3_to_dcp_bytes import (
    DcpItems,
    file_names,
    write_small_and_metadata,
    write_tensor_files,
)
from shardkit.storage.manifest import FileEntry, Manifest
from shardkit.storage.pipeline import default_workers
from shardkit.storage.request import RunRequest

# the same balanced split of files over processes as reshard's (by bytes, largest first)
from shardkit.storage.shared_save import Launch, outcome_unchanged, split_by_bytes
from shardkit.storage.shared_tag import Activity, Signature, signatures, write_tag_shared

CONVERT = Activity("the conversion", "convert again", "convert", "convert the previous checkpoint")


def source_signatures(tag_dir: Path) -> dict[Path, Signature]:
    """The source's rank files as they are before anything is read (``check_unchanged`` compares)."""
    return signatures(sorted(tag_dir.glob("*.pt")))


@dataclass
class ShareResult:
    """What this process wrote on the torch-free route."""

    files: int = 0
    bytes: int = 0
    workers: int = 1


def write_share(root: Path, tag: str, items: DcpItems, facts: Manifest, expected: dict[str, FileEntry],
                 before: dict[Path, Signature], workers: int | None, launch: Launch,
                 request: RunRequest) -> ShareResult:
    """The torch-free route: this process's share of the tensor files (all of them alone), then on
    process 0 the small items, ``.metadata`` and one manifest (``io.shared_save``, as reshard), once
    every process agreed on ``request``."""
    names = file_names(items)
    mine = [items.big[i] for i in split_by_bytes([it.nbytes for it in items.big], launch.world)[launch.rank]]
    workers = workers or default_workers(max(1, len(mine)))
    source = Path(str(facts.extra["converted_from"]["path"]))
    to_hash = [source / name for i, name in enumerate(sorted(expected)) if i % launch.world == launch.rank]
    outcome = outcome_unchanged(root)
    write_tag_shared(
        root, tag, launch, request=request,
        write_mine=lambda staged: write_tensor_files(staged, mine, names, outcome, workers),
        to_hash=[(f, expected[f.name]) for f in to_hash], hash_workers=len(os.sched_getaffinity(0)), before=before,
        activity=CONVERT, facts=lambda entries: facts,
        finish=lambda staged, entries: write_small_and_metadata(staged, items, names, entries, outcome))
    return ShareResult(len(mine), sum(it.nbytes for it in mine), workers)
