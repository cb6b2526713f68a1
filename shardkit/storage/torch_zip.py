"""torch's zip checkpoint format, written without torch: the records of ``torch.save`` (the layout of
``PyTorchFileWriter``, caffe2 ``inline_container.cc`` with miniz, torch 2.13: the same record names
and order, 64-byte aligned data behind an ``FB`` padding field, data descriptors, zip64 end
records), every byte hashed (``digest.default_algorithm``, for the manifest) and crc'd as it is written.

``write_torch_zip`` takes the pickle (``data.pkl``) and the storage records; a record is bytes, or
a ``SegmentedRecord``: byte ranges of source files and zero runs, copied through one fixed buffer
so memory stays at ``chunk_bytes`` whatever the record's size. ISA-L's crc32, blake3 (or sha256),
``os.preadv`` and ``write`` release the GIL on large buffers, so threads write files in parallel.
Nothing here imports torch: ``stream.stream_save`` (lazy torch tensors) and the torch-free
reshard (``writers.zero3_same_run`` and ``writers.zero12``) both end here.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import struct
import sys
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Sequence, Union

from shardkit.core import progress
from shardkit.core.files import regular_fd
from shardkit.storage.digest import default_algorithm, new_hasher

try:
    # ISA-L's crc32 (CRC-32/ISO-HDLC, zlib's polynomial, same values) folds with PCLMULQDQ/PMULL:
    # 0.013 s/GiB against zlib's 0.24 s/GiB on the benchmark machine, where zlib's crc was 20% of a
    # reshard's CPU time. Optional: a platform without its wheel keeps zlib's.
    from isal.isal_zlib import crc32 as _fast_crc32

    crc32: Callable[..., int] = _fast_crc32
except ImportError:  # pragma: no cover - isal is a dependency; this is for platforms without a wheel
    crc32 = zlib.crc32

#: Bytes copied per read/crc/hash/write round: large enough that syscalls and Python overhead
#: vanish, small enough to stay in a core's L2 cache between the read, crc32, hash and write
#: passes (16 MiB buffers ran at half the speed of 1 MiB ones on the benchmark machine).
CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class Segment:
    """``nbytes`` bytes of a tensor record: read from ``path`` at ``offset``, or zeros when ``path`` is None."""

    path: str | None
    offset: int
    nbytes: int


@dataclass(frozen=True)
class WrittenFile:
    """What ``stream_save`` wrote: the byte count and the digest of exactly those bytes."""

    size: int
    digest: str
    """Hex digest of the bytes written."""
    algorithm: str
    """'blake3' or 'sha256' (``digest.default_algorithm``, or the source's for a byte-for-byte copy)."""




def archive_name(path: str | Path) -> str:
    # inline_container.cc: the basename up to its last '.'; non-ASCII names go through torch's
    # buffer writer, which calls the archive "archive"
    base = os.path.basename(os.fspath(path))
    stem = base[: base.rfind(".")] if "." in base else base
    return stem if stem.isascii() else "archive"



# --- torch's zip layout ----------------------------------------------------------------------------

ALIGNMENT = 64  # torch.serialization._get_storage_alignment() default ("FB" padding, kFieldAlignment)
_U32 = 0xFFFFFFFF  # the 32-bit field value that says "the real one is in the zip64 extra field"
#: Sizes and offsets from which a record is written zip64 (miniz: ``>= MZ_UINT32_MAX``). A module
#: constant so a test can lower it and exercise the zip64 branches without writing 4 GiB.
ZIP64_AT = _U32
#: The records that hold tensor data, what the writers' ``progress.expect`` counts.
STORAGES = "data/"
_FLAGS = 0x0808  # bit 3: sizes and crc follow the data (data descriptor); bit 11: UTF-8 names


class HashingWriter:
    """Every byte written to the file also goes through the manifest's digest (``algorithm``,
    default ``digest.default_algorithm``)."""

    def __init__(self, raw: BinaryIO, algorithm: str | None = None):
        self.algorithm = algorithm or default_algorithm()
        self.raw, self.sha, self.size = raw, new_hasher(self.algorithm), 0

    def written(self) -> WrittenFile:
        return WrittenFile(self.size, self.sha.hexdigest(), self.algorithm)

    def write(self, data: bytes | memoryview, *, planned: bool = False) -> None:
        """``planned``: bytes an operation counted in its ``progress.expect`` (a storage's data, a file
        copied whole); the rest (headers, pickles) grow the progress total as they are written."""
        self.sha.update(data)
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            n = self.raw.write(view[done:])
            if not n:
                raise OSError(f"short write to {getattr(self.raw, 'name', 'the output file')}")
            done += n
        self.size += len(view)
        (progress.advance if planned else progress.grow)(len(view))


@dataclass
class _Entry:
    name: bytes
    offset: int
    size: int
    crc: int
    flags: int


class ZipWriter:
    """The records of one torch zip, written front to back (see the module docstring)."""

    def __init__(self, out: HashingWriter, archive: str):
        self.out, self.prefix = out, f"{archive}/"
        self.entries: list[_Entry] = []
        self.on_read: Callable[[str, int, memoryview], None] | None = None
        """Called with (path, offset, bytes) for each window read from a source file (``stream.SourceDigests``
        hashes the sources from the bytes the copy reads anyway)."""

    def _header(self, name: str, size: int) -> _Entry:
        full = (self.prefix + name).encode()
        offset = self.out.size
        big_size, big_offset = size >= ZIP64_AT, offset >= ZIP64_AT
        zip64 = b""
        if big_size or big_offset:
            # miniz: the uncompressed size, a compressed size of 0 (the data descriptor has it), the offset
            fields = (struct.pack("<QQ", size, 0) if big_size else b"") + (struct.pack("<Q", offset) if big_offset else b"")
            zip64 = struct.pack("<HH", 1, len(fields)) + fields
        # inline_container.cc getPadding: the data starts on an _ALIGNMENT boundary
        start = offset + 30 + len(full) + len(zip64) + 4
        pad = -start % ALIGNMENT
        extra = zip64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
        # miniz writes an empty record whole (no data descriptor): crc 0 and size 0 are final
        flags = _FLAGS if size else _FLAGS & ~0x8
        self.out.write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0, len(full), len(extra)))
        self.out.write(full)
        self.out.write(extra)
        return _Entry(full, offset, size, 0, flags)

    def _footer(self, entry: _Entry) -> None:
        if not entry.size:
            pass
        elif entry.size >= ZIP64_AT or entry.offset >= ZIP64_AT:
            self.out.write(struct.pack("<IIQQ", 0x08074B50, entry.crc, entry.size, entry.size))
        else:
            self.out.write(struct.pack("<IIII", 0x08074B50, entry.crc, entry.size, entry.size))
        self.entries.append(entry)

    def add_bytes(self, name: str, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        entry = self._header(name, len(view))
        entry.crc = crc32(view)
        self.out.write(view, planned=name.startswith(STORAGES))
        self._footer(entry)

    def add_segments(self, name: str, nbytes: int, segments: Sequence[Segment], buf: memoryview) -> None:
        """A record of ``nbytes`` assembled from ``segments`` through ``buf``, one buffer at a time."""
        if sum(s.nbytes for s in segments) != nbytes:
            raise RuntimeError(f"record {name}: segments hold {sum(s.nbytes for s in segments)} bytes, expected {nbytes}")
        entry = self._header(name, nbytes)
        planned = name.startswith(STORAGES)
        fds: dict[str, int] = {}
        crc, fill = 0, 0
        try:
            for seg in segments:
                done = 0
                while done < seg.nbytes:
                    n = min(seg.nbytes - done, len(buf) - fill)
                    window = buf[fill : fill + n]
                    if seg.path is None:
                        zero_fill(window)
                    else:
                        fd = fds.get(seg.path)
                        if fd is None:
                            fd = fds[seg.path] = regular_fd(seg.path)
                        pread_exact(fd, window, seg.offset + done, seg.path)
                        if self.on_read is not None:
                            self.on_read(seg.path, seg.offset + done, window)
                    done += n
                    fill += n
                    if fill == len(buf):
                        check_cancelled()
                        crc = crc32(buf, crc)
                        self.out.write(buf, planned=planned)
                        fill = 0
            if fill:
                crc = crc32(buf[:fill], crc)
                self.out.write(buf[:fill], planned=planned)
        finally:
            for fd in fds.values():
                os.close(fd)
        entry.crc = crc
        self._footer(entry)

    def finish(self) -> None:
        # inline_container.cc writeEndOfFile: a "version" record and a serialization id
        self.add_bytes("version", b"3\n")
        combined = 0
        for e in self.entries:
            combined = zlib.crc32(struct.pack("<I", e.crc), combined)
        # torch draws the second half at random; a digest of the records' crcs keeps the id unique
        # per content while the same input gives the same bytes (a reshard by 1 or 64 processes, or
        # run twice, writes identical files)
        salt = int.from_bytes(hashlib.sha256(self.prefix.encode() + struct.pack("<I", combined)).digest()[:8], "little")
        self.add_bytes(".data/serialization_id", f"{combined:020d}{salt:020d}".encode())
        cd_offset = self.out.size
        for e in self.entries:
            big_size, big_offset = e.size >= ZIP64_AT, e.offset >= ZIP64_AT
            fields = b""
            if big_size:
                fields += struct.pack("<QQ", e.size, e.size)
            if big_offset:
                fields += struct.pack("<Q", e.offset)
            extra = struct.pack("<HH", 1, len(fields)) + fields if fields else b""
            size32 = _U32 if big_size else e.size
            offset32 = _U32 if big_offset else e.offset
            self.out.write(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 0, 0, e.flags, 0, 0, 0, e.crc, size32, size32,
                                       len(e.name), len(extra), 0, 0, 0, 0, offset32))
            self.out.write(e.name)
            self.out.write(extra)
        cd_size = self.out.size - cd_offset
        eocd64 = self.out.size
        n = len(self.entries)
        self.out.write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 0x002D, 0, 0, n, n, cd_size, cd_offset))
        self.out.write(struct.pack("<IIQI", 0x07064B50, 0, eocd64, 1))
        self.out.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(n, 0xFFFF), min(n, 0xFFFF),
                                   _U32 if cd_size >= ZIP64_AT else cd_size,
                                   _U32 if cd_offset >= ZIP64_AT else cd_offset, 0))


def zero_fill(window: memoryview) -> None:
    """memset (a ctypes call: the GIL is released) instead of copying from a buffer of zeros."""
    if len(window):
        ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(window)), 0, len(window))


def pread_exact(fd: int, window: memoryview, offset: int, path: str | os.PathLike[str], item: str = "") -> None:
    """Fill ``window`` from byte ``offset`` of ``fd`` (the file ``path``; ``item``: the tensor read, for the
    message). A file that ends first raises OSError with ``filename=path``: the CLI's line names the file,
    and a failed copy finds the source to check by it (``reshard_zero12._suspects``)."""
    done = 0
    while done < len(window):
        got = os.preadv(fd, [window[done:]], offset + done)
        if got <= 0:
            raise OSError(errno.EIO, f"ended at byte {offset + done}, {len(window) - done} bytes short of the tensor "
                          f"data{f' of {item}' if item else ''} it should hold (the file was truncated while being "
                          "read)", os.fspath(path))
        done += got


class WriteCancelled(Exception):
    """A write stopped because another file of the same operation failed or the run was interrupted."""


_local = threading.local()


def set_cancel_event(event: threading.Event | None) -> None:
    """Make this thread's copy loops stop (``WriteCancelled``) once ``event`` is set: a failed or
    interrupted operation does not wait for gigabytes of other files to finish first."""
    _local.cancel = event


def check_cancelled() -> None:
    event = getattr(_local, "cancel", None)
    if event is not None and event.is_set():
        raise WriteCancelled("cancelled: another file of this operation failed, or the run was interrupted")


@dataclass(frozen=True)
class SegmentedRecord:
    """A storage record of ``nbytes`` assembled from ``segments`` (file ranges and zero runs)."""

    nbytes: int
    segments: Sequence[Segment]


#: One storage record's bytes: in memory, or to be copied from source files.
RecordData = Union[bytes, memoryview, SegmentedRecord]


def write_torch_zip(path: str | Path, data_pkl: bytes, records: Iterable[tuple[str, RecordData]], *,
                    chunk_bytes: int = CHUNK_BYTES, fsync: bool = False) -> WrittenFile:
    """Write a file ``torch.load`` reads as ``torch.save`` would have written it: ``data.pkl``, then
    each ``(key, data)`` record as ``data/<key>`` in the order given (the pickle's persistent-id
    order). ``records`` may be a generator: a record is produced only when it is written. Returns
    the size and digest of the bytes written; ``fsync=True`` flushes the file before returning."""
    with open(path, "wb", buffering=0) as raw:
        written = write_torch_zip_to(raw, archive_name(path), data_pkl, records, chunk_bytes=chunk_bytes)
        if fsync:
            os.fsync(raw.fileno())
        return written


def begin_torch_zip(out: HashingWriter, archive: str, data_pkl: bytes) -> ZipWriter:
    """The records ``torch.save`` writes before the storages (``data.pkl`` and three small ones); the
    storages and ``finish`` follow on the returned writer."""
    zw = ZipWriter(out, archive)
    zw.add_bytes("data.pkl", data_pkl)
    zw.add_bytes(".format_version", b"1")
    zw.add_bytes(".storage_alignment", str(ALIGNMENT).encode())
    zw.add_bytes("byteorder", sys.byteorder.encode())
    return zw


def write_torch_zip_to(raw: BinaryIO, archive: str, data_pkl: bytes, records: Iterable[tuple[str, RecordData]], *,
                       chunk_bytes: int = CHUNK_BYTES) -> WrittenFile:
    """``write_torch_zip`` into an open stream from its current position, the archive's own offsets
    counted from there: what ``torch.save(obj, stream)`` writes (archive name ``"archive"`` for a
    stream), e.g. one item of a DCP ``.distcp`` file (``FileSystemWriter._write_item``)."""
    out = HashingWriter(raw)
    zw = begin_torch_zip(out, archive, data_pkl)
    buf: memoryview | None = None
    for key, data in records:
        if isinstance(data, SegmentedRecord):
            if buf is None:
                buf = memoryview(bytearray(chunk_bytes))
            zw.add_segments(f"data/{key}", data.nbytes, data.segments, buf)
        else:
            zw.add_bytes(f"data/{key}", data)
    zw.finish()
    return out.written()
