"""Writing ``convert_zero3_to_dcp``'s DCP checkpoint into the staging folder: ``write_dcp_files``
starts ``_TensorFiles`` (each lazy tensor streamed into its own ``.distcp`` file by
``stream.stream_save``, on writer threads, from before ``dcp.save`` plans) and runs ``dcp.save``
with ``_streaming_writer``, which answers each tensor item with its file and writes the small items
with torch's own ``_write_item``. Staging and sealing around it are ``atomic_checkpoint``'s.
"""

from __future__ import annotations

import os
import warnings
from functools import partial
from pathlib import Path
from typing import Any

from shardkit.core import progress
from shardkit.storage.atomic import disk_full_named
from shardkit.storage.manifest import FileEntry
from shardkit.storage.pipeline import default_workers
from shardkit.storage.stream import FileJob, LazyTensor, WrittenFile, stream_save, write_parallel


def write_dcp_files(path: Path, state: dict[str, Any], lazy: dict[str, LazyTensor], outcome: str,
                    workers: int | None = None) -> list[FileEntry]:
    """``state`` saved by ``dcp.save`` into the staging folder ``path``, each of the ``lazy``
    tensors (keyed by flattened DCP key) streamed into its own file; the files written, for the
    manifest (``.metadata`` is hashed by ``atomic_checkpoint``). A failure is raised as itself."""
    # the tensor files are written from here on, while the main thread imports DCP (~0.9 s)
    # and plans; dcp.save's writer then only waits for them
    with _TensorFiles(path, lazy, outcome, workers) as files:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            with warnings.catch_warnings():
                # no_dist=True is the intent here (one offline writer), not a missing process group
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.save(state, storage_writer=_streaming_writer(path, files), no_dist=True)
        except CheckpointException as exc:
            # DCP wraps every failure in a BaseException: raise the failure itself (a full disk
            # is already the CheckpointError naming the file), so atomic_checkpoint sees it,
            # removes the staging folder and leaves 'latest' alone
            failure = next(iter(exc.failures.values()), (None, None))[0]
            if isinstance(failure, Exception):
                raise failure from None
            raise
        return files.entries()


class _TensorFiles:
    """Each lazy tensor written to its own ``.distcp`` file by ``stream_save``, through
    ``stream.write_parallel`` (its threads, fsync by the writing thread, the first failure cancels
    the files not started) run on a background thread from before ``dcp.save`` plans: the bytes
    are copied from the rank files through one 1 MiB buffer per thread, crc'd and hashed as
    written, while the main thread imports DCP. preadv, crc32, blake3/sha256, write and fsync release the GIL."""

    def __init__(self, path: Path, lazy: dict[str, LazyTensor], outcome: str, workers: int | None = None):
        import threading

        self.lazy, self.outcome = lazy, outcome
        self.workers = workers
        # "__0_0.distcp" is the small items' file (the names DCP's writer would give rank 0's files)
        self.names = {key: f"__0_{n + 1}.distcp" for n, key in enumerate(lazy)}
        # largest first, so the last files to finish are small ones and no thread idles long
        self._order = sorted(lazy, key=lambda k: -lazy[k].nbytes)
        jobs: list[FileJob] = [(path / self.names[k], partial(stream_save, lazy[k])) for k in self._order]
        progress.expect(sum(t.nbytes for t in lazy.values()))
        self._digests: dict[str, WrittenFile] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(jobs,), name="shardkit-convert", daemon=True)
        self._thread.start()

    def _run(self, jobs: list[FileJob]) -> None:
        try:
            written = write_parallel(jobs, self.workers or default_workers(len(jobs)), outcome=self.outcome,
                                     thread_name="shardkit-convert")
            self._digests = dict(zip(self._order, written, strict=True))
        except BaseException as exc:  # noqa: BLE001 - raised in the main thread by written()
            self._error = exc

    def written(self, key: str) -> tuple[str, WrittenFile]:
        """The file holding ``key`` and what was written to it, once every file is complete."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.names[key], self._digests[key]

    def entries(self) -> list[FileEntry]:
        out = []
        for key in self._order:
            name, digest = self.written(key)
            out.append(FileEntry.of(name, digest.size, digest.algorithm, digest.digest))
        return out

    def __enter__(self) -> "_TensorFiles":
        return self

    def __exit__(self, *exc: object) -> None:
        # every writer stopped before atomic_checkpoint removes the staging folder on failure
        self._thread.join()


def _streaming_writer(path: Path, files: _TensorFiles) -> Any:
    """A FileSystemWriter whose tensor items are ``files``' (each its own file, whole: offset 0,
    the file's size), and whose other items go into one file through torch's own ``_write_item``.

    torch's writer ``torch.save``s every tensor from memory, so each one would be gathered from the
    ZeRO-3 partitions first, and computes its crc32 holding the GIL: one core. Everything else is
    DCP's own: the plan and ``.metadata`` come from ``dcp.save`` and ``FileSystemWriter.finish``,
    and ``FileSystemReader`` reads these items like any other.
    """
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import _StorageInfo, _write_item
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    class StreamingWriter(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            results = []
            small = [i for i in plan.items if i.index.fqn not in files.lazy]
            first = "__0_0.distcp"
            with disk_full_named(path / first, files.outcome), open(path / first, "wb") as stream:
                for item in small:
                    data = planner.resolve_data(item)
                    if item.type != WriteItemType.BYTE_IO:
                        data = data.detach().cpu()
                    results.append(_write_item(self.transforms, stream, data, item, first, self.serialization_format))
                stream.flush()
                os.fsync(stream.fileno())
            planned = [i for i in plan.items if i.index.fqn in files.lazy]
            if sorted(i.index.fqn for i in planned) != sorted(files.lazy):
                raise RuntimeError("dcp.save planned other tensor items than the converter wrote: "
                                   f"{sorted({i.index.fqn for i in planned} ^ set(files.lazy))[:4]}")
            for item in planned:
                chunk = item.tensor_data.chunk
                if any(chunk.offsets) or tuple(chunk.sizes) != tuple(item.tensor_data.size):
                    raise RuntimeError(f"dcp.save split {item.index.fqn} into chunks; the converter wrote it whole")
                name, done = files.written(item.index.fqn)
                results.append(WriteResult(index=item.index, size_in_bytes=done.size,
                                           storage_data=_StorageInfo(name, 0, done.size)))
            fut: Future[list[Any]] = Future()
            fut.set_result(results)
            return fut

    return StreamingWriter(str(path), single_file_per_rank=True, sync_files=True)
