"""Writing ``writers.dcp``'s items: each big tensor its own ``.distcp`` file (``write_tensor_files``,
through one 1 MiB buffer per writer thread, crc'd and hashed as written, fsynced by its writer),
then the small items' file and ``.metadata`` (``write_small_and_metadata``); and one process's
share of them under ``srun``/``torchrun`` (``write_dcp``, as reshard writes its files through
``storage.shared_save``): process 0 claims the staging folder, the others join it; each process
hashes its share of the source files on threads beside its writers, writes its share of the tensor
files (balanced by bytes, the same split in every process) and reports them in a part file; process
0 gathers every part (a process that failed, stopped its heartbeat or never joined fails the run,
named), writes the small items' file and ``.metadata``, and seals one manifest. Nothing is
published unless every source hash matched and no source file changed while it was read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, cast

from shardkit.checkpoint.dcp.plain_metadata import METADATA_NAME
from shardkit.checkpoint.model.checkpoint import TrainingCheckpoint
from shardkit.checkpoint.writers.dcp import DcpItems
from shardkit.checkpoint.writers.dcp_format import (
    Stored,
    TensorItem,
    ValueItem,
    append_item,
    metadata_pickle,
    write_tensor_file,
)
from shardkit.core import progress
from shardkit.storage.atomic import disk_full_named
from shardkit.storage.digest import default_algorithm, new_hasher
from shardkit.storage.manifest import FileEntry, Manifest
from shardkit.storage.pipeline import default_workers
from shardkit.storage.request import RunRequest
from shardkit.storage.shared_save import Launch, outcome_unchanged, split_by_bytes
from shardkit.storage.shared_tag import Activity, Signature, write_tag_shared
from shardkit.storage.stream import FileJob, write_parallel

#: The file holding the small items (the name DCP's writer gives rank 0's first file).
SMALL_FILE = "__0_0.distcp"

CONVERT = Activity("the conversion", "convert again", "convert", "convert the previous checkpoint")


def source_files(ckpt: TrainingCheckpoint) -> list[Path]:
    """Every file a tensor of ``ckpt`` is copied from (its pieces' files), in path order."""
    tensors = [*ckpt.weights.values(), *(t for states in ckpt.optimizer.values() for t in states.values())]
    return sorted({p.file for t in tensors for p in t.pieces})


@dataclass
class ShareResult:
    """What this process wrote."""

    files: int = 0
    bytes: int = 0
    workers: int = 1


def write_dcp(root: Path, tag: str, items: DcpItems, facts: Manifest, source: Path, expected: dict[str, FileEntry],
              before: dict[Path, Signature], workers: int | None, launch: Launch, request: RunRequest) -> ShareResult:
    """This process's share of the tensor files (all of them alone), then on process 0 the small
    items, ``.metadata`` and one manifest (``facts``) under ``root/tag``, once every process agreed on
    ``request``; ``expected``: the source folder's manifest entries, hashed while writing."""
    names = file_names(items)
    mine = [items.big[i] for i in split_by_bytes([it.nbytes for it in items.big], launch.world)[launch.rank]]
    workers = workers or default_workers(max(1, len(mine)))
    to_hash = [source / name for i, name in enumerate(sorted(expected)) if i % launch.world == launch.rank]
    outcome = outcome_unchanged(root)
    write_tag_shared(
        root, tag, launch, request=request,
        write_mine=lambda staged: write_tensor_files(staged, mine, names, outcome, workers),
        to_hash=[(f, expected[f.name]) for f in to_hash], hash_workers=len(os.sched_getaffinity(0)), before=before,
        activity=CONVERT, facts=lambda entries: facts,
        finish=lambda staged, entries: write_small_and_metadata(staged, items, names, entries, outcome))
    return ShareResult(len(mine), sum(it.nbytes for it in mine), workers)


def file_names(items: DcpItems) -> dict[str, str]:
    """Each big tensor's file (the same in every process): ``__0_<n>.distcp`` in item order, as DCP's
    writer numbers rank 0's files (``SMALL_FILE`` is ``__0_0``)."""
    return {item.key: f"__0_{n + 1}.distcp" for n, item in enumerate(items.big)}


def write_tensor_files(path: Path, share: list[TensorItem], names: dict[str, str], outcome: str,
                       workers: int) -> list[FileEntry]:
    """This process's big tensors, each its own file in the staging folder ``path``, ``workers`` at
    a time (largest first, so the last files to finish are small ones and no thread idles long)."""
    order = sorted(share, key=lambda it: -it.nbytes)
    jobs: list[FileJob] = [(path / names[it.key], partial(_write_one, it)) for it in order]
    progress.expect(sum(it.nbytes for it in order))
    written = write_parallel(jobs, workers, outcome=outcome, thread_name="shardkit-convert")
    return [FileEntry.of(names[it.key], done.size, done.algorithm, done.digest)
            for it, done in zip(order, written, strict=True)]


def write_small_and_metadata(path: Path, items: DcpItems, names: dict[str, str], written: list[FileEntry],
                             outcome: str) -> list[FileEntry]:
    """Process 0, once every big file is written (``written``: their sizes, from every process):
    ``SMALL_FILE`` and ``.metadata``, fsynced, described for the manifest."""
    sizes = {e.path: e.size for e in written}
    stored = {item.key: Stored(names[item.key], 0, sizes[names[item.key]]) for item in items.big}
    out = []
    # the small tensors' data, planned like the big files' (the zips around them and .metadata grow the total)
    progress.expect(sum(item.nbytes for item in items.small if isinstance(item, TensorItem)))
    with disk_full_named(path / SMALL_FILE, outcome), open(path / SMALL_FILE, "wb") as raw:
        hashing = _Hashing(raw)
        for item in items.small:
            at = hashing.size
            stored[item.key] = Stored(SMALL_FILE, at, append_item(cast(BinaryIO, hashing), item))
        raw.flush()
        os.fsync(raw.fileno())
    out.append(FileEntry.of(SMALL_FILE, hashing.size, hashing.algorithm, hashing.sha.hexdigest()))
    tensors = [t for t in [*items.big, *items.small] if isinstance(t, TensorItem)]
    values = [v for v in items.small if isinstance(v, ValueItem)]
    body = metadata_pickle(tensors, values, stored, path)
    with disk_full_named(path / METADATA_NAME, outcome), open(path / METADATA_NAME, "wb") as fh:
        fh.write(body)
        fh.flush()
        os.fsync(fh.fileno())
    meta_hash = new_hasher(hashing.algorithm)
    meta_hash.update(body)
    out.append(FileEntry.of(METADATA_NAME, len(body), hashing.algorithm, meta_hash.hexdigest()))
    return out


class _Hashing:
    """The small file's bytes, hashed as they are appended (for the manifest)."""

    def __init__(self, raw: BinaryIO):
        self.algorithm = default_algorithm()
        self.raw, self.sha, self.size = raw, new_hasher(self.algorithm), 0

    def write(self, data: bytes | memoryview) -> int:
        self.sha.update(data)
        n = len(memoryview(data).cast("B"))
        done = self.raw.write(data)
        if done is not None and done != n:
            raise OSError(f"short write to {getattr(self.raw, 'name', SMALL_FILE)}")
        self.size += n
        return n


def _write_one(item: TensorItem, out: Path) -> Any:
    return write_tensor_file(out, item)
