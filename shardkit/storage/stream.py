"""Streaming ``torch.save``: tensors whose bytes are produced only when their record is written, and
the file's digest (blake3 by default) computed from the bytes as they are written (no second read for the manifest).

``stream_save`` pickles real torch objects and ``LazyTensor``s and hands the records to
``torch_zip.write_torch_zip``, which writes torch's zip format itself, so that:

- a ``LazyTensor`` built from ``Segment``s (byte ranges of source files, or zero padding) is copied
  through one fixed buffer: memory stays at ``chunk_bytes`` whatever the tensor's size;
- ISA-L's crc32, blake3 (or hashlib's sha256), ``os.preadv`` and ``write`` all release the GIL on large
  buffers, so several files are written in parallel by threads (torch's own writer computes its
  crc32 and calls back into Python holding the GIL: two threads ran no faster than one).

``write_parallel`` runs such file jobs on threads (``submit_all``/``join_pool``: no thread of the pool outlives
an interrupt, for every writer's pool); ``copy_file_hashed`` copies one file, hashed;
``write_interleaved`` writes several files from one thread with their records in the order a source file holds
them, so ``SourceDigests`` hashes that source from the bytes the copy reads (one read of each source byte, not two).
"""

from __future__ import annotations

import contextlib
import heapq
import io
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterable, Iterator, Sequence, TypeVar

from shardkit.core.files import open_regular, regular_fd
from shardkit.storage.atomic import disk_full_named, fsync_file, signals_deferred
from shardkit.storage.digest import Hasher, new_hasher
from shardkit.storage.torch_pickle import StubPickler
from shardkit.storage.torch_zip import (
    CHUNK_BYTES,
    HashingWriter,
    RecordData,
    Segment,
    SegmentedRecord,
    WriteCancelled,
    WrittenFile,
    archive_name,
    begin_torch_zip,
    check_cancelled,
    set_cancel_event,
    write_torch_zip,
)

__all__ = ["CHUNK_BYTES", "FileJob", "LazyTensor", "Segment", "SourceDigests", "WrittenFile", "all_segmented",
           "copy_file_hashed", "join_pool", "main_source", "materialize", "stream_save", "submit_all", "write_interleaved",
           "write_parallel"]

_T = TypeVar("_T")

if TYPE_CHECKING:
    import torch

class LazyTensor:
    """A 1-D CPU tensor that pickles exactly like ``torch.save`` pickles one, but whose bytes are
    produced only when ``stream_save`` writes its record (or when ``materialize()`` is called).

    ``segments`` (optional) describes the bytes as file ranges and zero runs: ``stream_save`` then
    copies them through its buffer without ever building the tensor.
    """

    def __init__(self, numel: int, dtype: "torch.dtype", produce: Callable[[], "torch.Tensor"],
                 segments: Callable[[], Sequence[Segment]] | None = None):
        self.numel, self.dtype, self.produce, self.segments = numel, dtype, produce, segments
        self.storage = _LazyStorage(self)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def materialize(self) -> "torch.Tensor":
        t = self.produce()
        if t.numel() != self.numel or t.dtype != self.dtype:
            raise RuntimeError(f"lazy tensor produced {t.dtype}[{t.numel()}], expected {self.dtype}[{self.numel}]")
        return t

    def __reduce_ex__(self, protocol: int) -> Any:
        import torch

        # a new stride tuple per tensor, as Tensor.stride() returns (a shared constant would be memoized)
        return (torch._utils._rebuild_tensor_v2, (self.storage, 0, (self.numel,), tuple([1]), False, OrderedDict()))


class _LazyStorage:
    def __init__(self, owner: LazyTensor):
        self.owner = owner


def materialize(obj: Any) -> Any:
    """``obj`` with every LazyTensor replaced by its produced tensor (for in-process loading)."""
    if isinstance(obj, LazyTensor):
        return obj.materialize()
    if isinstance(obj, dict):
        return type(obj)((k, materialize(v)) for k, v in obj.items()) if isinstance(obj, OrderedDict) else {k: materialize(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [materialize(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(materialize(v) for v in obj)
    return obj


def stream_save(obj: Any, path: str | Path, *, chunk_bytes: int = CHUNK_BYTES, fsync: bool = False) -> WrittenFile:
    """``torch.save(obj, path)`` where LazyTensor records are produced one at a time while writing.

    Mirrors ``torch.serialization._save`` (2.13): same pickle protocol, persistent ids, record
    names and order; ``torch.load`` (mmap or not) cannot tell the difference. Returns the size and
    the digest of the bytes written (hashed as they are written). ``fsync=True`` flushes the file
    to disk before returning.
    """
    data, records = _pickle_with_records(obj)
    return write_torch_zip(path, data, _record_bytes(records), chunk_bytes=chunk_bytes, fsync=fsync)


def _record_bytes(records: dict[str, Any]) -> Iterator[tuple[str, RecordData]]:
    """Each record's bytes, produced when the writer reaches it (a LazyTensor without segments is
    built here, one at a time, and dropped once written)."""
    for key, rec in records.items():
        if isinstance(rec, _LazyStorage) and rec.owner.segments is not None:
            yield key, SegmentedRecord(rec.owner.nbytes, rec.owner.segments())
        elif isinstance(rec, _LazyStorage):
            t = rec.owner.materialize()
            yield key, _storage_bytes(t.contiguous().untyped_storage())
            del t
        else:
            yield key, _storage_bytes(rec.cpu())


def _pickle_with_records(obj: Any) -> tuple[bytes, dict[str, Any]]:
    """``data.pkl`` as torch pickles it, and the storages it references in persistent-id order.

    ``StubPickler`` (Python's own pickler) writes the DeepSpeed class names of ``safe_load``'s inert
    stand-ins (``ZeroStageEnum``, ``LossScaler``) without importing DeepSpeed; the opcodes are the C
    pickler's (same protocol, memo and order); the pickle is a few KB (tensors are records).
    """
    import torch
    from torch.serialization import location_tag

    storage_types = torch.storage._dtype_to_storage_type_map()
    keys: dict[int, str] = {}
    records: dict[str, Any] = {}

    class _Pickler(StubPickler):
        def persistent_id(self, o: Any) -> Any:
            if isinstance(o, _LazyStorage):
                key = keys.setdefault(id(o), str(len(keys)))
                records[key] = o
                t = o.owner
                return ("storage", getattr(torch, storage_types[t.dtype]), key, "cpu", t.numel)
            if isinstance(o, torch.storage.TypedStorage):
                storage = o._untyped_storage
                key = keys.setdefault(storage._cdata, str(len(keys)))
                records[key] = storage
                return ("storage", getattr(torch, o._pickle_storage_type()), key, location_tag(storage), o._size())
            if torch.is_storage(o):
                key = keys.setdefault(o._cdata, str(len(keys)))
                records[key] = o
                return ("storage", torch.UntypedStorage, key, location_tag(o), o.nbytes())
            return None

    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue(), records


def _storage_bytes(storage: Any) -> memoryview:
    """The bytes of a CPU untyped storage, without a copy."""
    import torch

    n = storage.nbytes()
    if n == 0:
        return memoryview(b"")
    view = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (n,), (1,))
    return memoryview(view.numpy()).cast("B")


def all_segmented(obj: Any) -> bool:
    """True when every LazyTensor in ``obj`` has byte segments, so ``stream_save`` copies it through
    one buffer; False when one would be built whole in memory (``materialize``)."""
    if isinstance(obj, LazyTensor):
        return obj.segments is not None
    if isinstance(obj, dict):
        return all(all_segmented(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(all_segmented(v) for v in obj)
    return True


#: One file to write: where, and the function that writes it there and returns its digest.
FileJob = tuple[Path, Callable[[Path], WrittenFile]]


def write_parallel(jobs: Sequence[tuple[Path, Callable[[Path], _T]]], workers: int, *, outcome: str,
                   thread_name: str = "shardkit-write") -> list[_T]:
    """Write every job's file, ``workers`` at a time on threads, and return their digests in job order
    (a job of ``write_interleaved`` writes several files: its path is the first, its result their digests).

    Each file is fsynced by the thread that wrote it (the fsyncs overlap the other files' writes;
    the staging folder's ``fsync_tree`` then finds nothing dirty). The first failure cancels the
    jobs not yet started and stops the running ones at their next buffer (``torch_zip``'s cancel
    check), and is raised (a full disk as the CheckpointError of ``disk_full_named``, ending with
    ``outcome``), so nothing more is written into a staging folder the caller is about to remove.
    An interrupt (Ctrl-C, or SIGTERM turned into an exception by the command) stops them the same
    way. ``workers=1`` writes in this thread.
    """
    from concurrent.futures import FIRST_EXCEPTION, wait

    cancel = threading.Event()

    def run(path: Path, write: Callable[[Path], _T]) -> _T:
        # a worker freed by a failure picks the next queued job before the waiting thread wakes to
        # cancel the queue (seconds on a loaded machine): a job that starts after a failure stops here
        if cancel.is_set():
            raise WriteCancelled(f"{path}: not written, another file of the same operation failed")
        set_cancel_event(cancel)
        try:
            with disk_full_named(path, outcome):
                digest = write(path)
                fsync_file(path)
        except OSError as exc:
            cancel.set()  # the running writers stop at their next buffer, the queued ones never start
            if exc.filename is not None:
                raise
            # a write or fsync on an open descriptor fails without a file name (EIO ...): name the
            # file here, so the caller's os_errors_named message says which one
            raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
        except BaseException:
            cancel.set()
            raise
        finally:
            set_cancel_event(None)
        return digest

    if workers <= 1 or len(jobs) <= 1:
        return [run(path, write) for path, write in jobs]
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=thread_name)
    futures: list[Future[_T]] = []
    try:
        futures = submit_all(pool, run, jobs)
        wait(futures, return_when=FIRST_EXCEPTION)
    finally:
        if any(f.done() and not f.cancelled() and f.exception() is not None for f in futures) or \
                not all(f.done() for f in futures) or not futures:
            cancel.set()
        join_pool(pool)  # the queued jobs cancelled; the running ones stop at their next buffer
    failures = [f.exception() for f in futures if not f.cancelled() and f.exception() is not None]
    # the first real failure, not the WriteCancelled of the files it stopped
    real = [e for e in failures if not isinstance(e, WriteCancelled)]
    if real or failures:
        raise (real or failures)[0]  # type: ignore[misc]
    return [f.result() for f in futures]


def submit_all(pool: ThreadPoolExecutor, fn: Callable[..., _T], calls: Iterable[Sequence[Any]]) -> list[Future[_T]]:
    """``pool.submit(fn, *args)`` for each of ``calls``, with Ctrl-C/SIGTERM held until all are queued.

    ``submit`` starts a thread and waits for it to run; an interrupt landing in that wait left a
    thread the pool had not recorded yet, so its shutdown never joined it, and the futures were not
    yet the caller's to cancel: the thread ran the queued jobs to the end after the caller's
    clean-up (a reshard wrote a whole rank file into its emptied staging folder, which then stayed,
    without its owner file). Held here, the interrupt is raised once every future is returned."""
    with signals_deferred():
        return [pool.submit(fn, *args) for args in calls]


def join_pool(pool: ThreadPoolExecutor) -> None:
    """Cancel ``pool``'s queued jobs and wait for its running ones, with Ctrl-C/SIGTERM held: a second
    interrupt cutting the wait short left writers running while the caller removed their folder (the
    running jobs stop at their next buffer once the caller's stop event is set)."""
    with signals_deferred():
        pool.shutdown(wait=True, cancel_futures=True)


def copy_file_hashed(src: str | Path, dst: str | Path, *, chunk_bytes: int = CHUNK_BYTES,
                     algorithm: str | None = None, planned: bool = False) -> WrittenFile:
    """Copy ``src`` to a new file ``dst`` through one buffer, hashing the bytes as they are written
    (``algorithm``: the source manifest's, so the copy's digest is also the check of the source).

    ``planned``: the operation counted this file's size in its ``progress.expect`` (a reshard's copied
    rank file); otherwise (a carried file beside the checkpoint) its bytes grow the progress total.

    A copy, never a link: the source's owner may rewrite it in place later (``torch.save`` truncates
    and rewrites an existing file), which must not change the copy its manifest describes.
    """
    buf = memoryview(bytearray(chunk_bytes))
    with open_regular(src, buffering=0) as fin, open(dst, "xb", buffering=0) as raw:
        out = HashingWriter(raw, algorithm)
        while True:
            check_cancelled()
            n = fin.readinto(buf)
            if not n:
                break
            out.write(buf[:n], planned=planned)
        return out.written()


class _Cursor:
    """One source file's hasher and how far into the file it has hashed (``SourceDigests``)."""

    def __init__(self, path: Path, hasher: Hasher):
        self.path, self.hasher, self.pos = path, hasher, 0
        self.lock = threading.Lock()
        self.fd: int | None = None
        self.buf: memoryview | None = None

    def read_to(self, end: int | None) -> None:
        """Hash the file from ``pos`` up to ``end`` (None: its end), read here through one buffer."""
        if self.fd is None:
            self.fd = regular_fd(self.path)
            self.buf = memoryview(bytearray(CHUNK_BYTES))
        assert self.buf is not None
        while end is None or self.pos < end:
            check_cancelled()
            want = len(self.buf) if end is None else min(len(self.buf), end - self.pos)
            got = os.preadv(self.fd, [self.buf[:want]], self.pos)
            if got <= 0:
                return  # shorter than the windows the copy read: the digest says it (and check_unchanged)
            self.hasher.update(self.buf[:got])
            self.pos += got

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class SourceDigests:
    """Each source file's digest (with its manifest's algorithm), computed from the windows the copies read of it
    (``ZipWriter.on_read``) instead of a second read of the whole file.

    A hash runs front to back, so a window is taken only where it continues the part hashed so far; a short gap
    before it (a zip header, the pickle: bytes no output copies, up to ``gap_bytes``) is read here first; a window
    further on is left, and ``finish`` reads whatever no copy delivered in order. Every byte is hashed once in any
    order the threads read in; a byte is read twice only where no copy reached it in order
    (``write_interleaved`` orders the copies so they do). ``files``: (path, algorithm) of the files to check."""

    def __init__(self, files: Sequence[tuple[Path, str]], gap_bytes: int = CHUNK_BYTES):
        self._cursors = {os.path.realpath(p): _Cursor(p, new_hasher(algorithm)) for p, algorithm in files}
        self._by_name: dict[str, _Cursor | None] = {}
        self.gap_bytes = gap_bytes

    def seen(self, path: str, offset: int, window: memoryview) -> None:
        """``window`` was read from ``path`` at ``offset`` (called by the copy, before its buffer is reused)."""
        try:
            cursor = self._by_name[path]
        except KeyError:  # realpath once per name, not once per window
            cursor = self._by_name[path] = self._cursors.get(os.path.realpath(path))
        if cursor is None:
            return
        end = offset + len(window)
        with cursor.lock:
            if end <= cursor.pos or offset - cursor.pos > self.gap_bytes:
                return
            if offset > cursor.pos:
                cursor.read_to(offset)
            cursor.hasher.update(window[cursor.pos - offset:])
            cursor.pos = end

    def finish(self, only: Collection[Path] | None = None) -> dict[Path, str]:
        """Every file's digest (``only``: of those files alone, the others not read further), once the rest of
        each (what the copies did not hash in order) is read here. The files are closed either way."""
        try:
            wanted = [c for c in self._cursors.values() if only is None or c.path in only]
            for cursor in wanted:
                with cursor.lock:
                    cursor.read_to(None)
            return {c.path: c.hasher.hexdigest() for c in wanted}
        finally:
            for cursor in self._cursors.values():
                cursor.close()

    def hashed_in_copy(self) -> int:
        """Bytes hashed so far (before ``finish``: those the copies delivered in order, and the gaps read here)."""
        return sum(c.pos for c in self._cursors.values())


def main_source(records: Sequence[tuple[str, RecordData]]) -> str | None:
    """The source file most of ``records``' bytes are copied from (None: none are)."""
    counts: dict[str, int] = {}
    for _, data in records:
        if isinstance(data, SegmentedRecord):
            for seg in data.segments:
                if seg.path is not None:
                    counts[seg.path] = counts.get(seg.path, 0) + seg.nbytes
    return max(counts, key=lambda p: counts[p]) if counts else None


def write_interleaved(files: Sequence[tuple[Path, bytes, list[tuple[str, RecordData]]]], *,
                      on_read: Callable[[str, int, memoryview], None] | None = None,
                      chunk_bytes: int = CHUNK_BYTES) -> list[WrittenFile]:
    """Write several torch zips (``write_torch_zip``'s (path, data.pkl, records) each) from this thread, each
    file's records in its own order but the files' records interleaved by where they start in their main source
    (``main_source`` of the first file): the new ranks cut from one old rank's flat buffers read that rank's
    file front to back, so ``SourceDigests`` hashes it from the copy's own reads. Each file is fsynced;
    returns their digests in order."""
    source = main_source([r for _, _, records in files[:1] for r in records])

    def start(data: RecordData, before: int) -> int:
        if isinstance(data, SegmentedRecord):
            for seg in data.segments:
                if seg.path == source:
                    return max(before, seg.offset)
        return before  # nothing from the main source: written right after the record before it

    buf = memoryview(bytearray(chunk_bytes))
    with contextlib.ExitStack() as stack:
        raws = [stack.enter_context(open(path, "wb", buffering=0)) for path, _, _ in files]
        outs = [HashingWriter(raw) for raw in raws]
        writers = [begin_torch_zip(out, archive_name(path), pkl) for out, (path, pkl, _) in zip(outs, files)]
        for zw in writers:
            zw.on_read = on_read
        heap = [(start(records[0][1], -1), i, 0) for i, (_, _, records) in enumerate(files) if records]
        heapq.heapify(heap)
        while heap:
            at, i, k = heapq.heappop(heap)
            key, data = files[i][2][k]
            if isinstance(data, SegmentedRecord):
                writers[i].add_segments(f"data/{key}", data.nbytes, data.segments, buf)
            else:
                writers[i].add_bytes(f"data/{key}", data)
            if k + 1 < len(files[i][2]):
                heapq.heappush(heap, (start(files[i][2][k + 1][1], at), i, k + 1))
        for zw in writers:
            zw.finish()
        for raw in raws:
            os.fsync(raw.fileno())
        return [out.written() for out in outs]
