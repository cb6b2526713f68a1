"""Streaming ``torch.save``: tensors whose bytes are produced only when their record is written, and
the file's sha256 computed from the bytes as they are written (no second read for the manifest).

``stream_save`` writes torch's zip format itself (the layout of ``PyTorchFileWriter``, caffe2
``inline_container.cc`` with miniz, torch 2.13: the same record names and order, 64-byte aligned
data behind an ``FB`` padding field, data descriptors, zip64 end records), so that:

- a ``LazyTensor`` built from ``Segment``s (byte ranges of source files, or zero padding) is copied
  through one fixed buffer: memory stays at ``chunk_bytes`` whatever the tensor's size;
- zlib's crc32, hashlib's sha256, ``os.preadv`` and ``write`` all release the GIL on large
  buffers, so several files are written in parallel by threads (torch's own writer computes its
  crc32 and calls back into Python holding the GIL: two threads ran no faster than one).
"""

from __future__ import annotations

import copyreg
import ctypes
import hashlib
import io
import os
import pickle
import random
import struct
import sys
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Sequence

from shardkit.checkpoint.io.atomic import disk_full_named, fsync_file
from shardkit.checkpoint.io.torch_load import DeepSpeedObjectStub

if TYPE_CHECKING:
    import torch

#: Bytes copied per read/crc/hash/write round: large enough that syscalls and Python overhead
#: vanish, small enough to stay in a core's L2 cache between the read, crc32, sha256 and write
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
    """What ``stream_save`` wrote: the byte count and the sha256 of exactly those bytes."""

    size: int
    sha256: str


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

        return (torch._utils._rebuild_tensor_v2, (self.storage, 0, (self.numel,), (1,), False, OrderedDict()))


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
    the sha256 of the bytes written (hashed as they are written). ``fsync=True`` flushes the file
    to disk before returning.
    """
    data, records = _pickle_with_records(obj)
    archive = _archive_name(path)
    with open(path, "wb", buffering=0) as raw:
        out = _HashingWriter(raw)
        zw = _ZipWriter(out, archive)
        zw.add_bytes("data.pkl", data)
        zw.add_bytes(".format_version", b"1")
        zw.add_bytes(".storage_alignment", str(_ALIGNMENT).encode())
        zw.add_bytes("byteorder", sys.byteorder.encode())
        buf: memoryview | None = None
        for key, rec in records.items():
            if isinstance(rec, _LazyStorage) and rec.owner.segments is not None:
                if buf is None:
                    buf = memoryview(bytearray(chunk_bytes))
                zw.add_segments(f"data/{key}", rec.owner.nbytes, rec.owner.segments(), buf)
            elif isinstance(rec, _LazyStorage):
                t = rec.owner.materialize()
                zw.add_bytes(f"data/{key}", _storage_bytes(t.contiguous().untyped_storage()))
                del t
            else:
                zw.add_bytes(f"data/{key}", _storage_bytes(rec.cpu()))
        zw.finish()
        if fsync:
            os.fsync(raw.fileno())
        return WrittenFile(out.size, out.sha.hexdigest())


def _pickle_with_records(obj: Any) -> tuple[bytes, dict[str, Any]]:
    """``data.pkl`` as torch pickles it, and the storages it references in persistent-id order.

    Python's own pickler (``pickle._Pickler``), not the C one: it lets ``save_global`` write the
    DeepSpeed class names of ``safe_load``'s inert stand-ins (``ZeroStageEnum``, ``LossScaler``)
    without importing DeepSpeed, which costs a reshard more than copying its bytes. The opcodes are
    the C pickler's (same protocol, memo and order); the pickle is a few KB (tensors are records).
    """
    import torch
    from torch.serialization import location_tag

    storage_types = torch.storage._dtype_to_storage_type_map()
    keys: dict[int, str] = {}
    records: dict[str, Any] = {}

    class _Pickler(pickle._Pickler):  # type: ignore[name-defined,misc]
        def reducer_override(self, o: Any) -> Any:
            if isinstance(o, DeepSpeedObjectStub):
                # what the real object's own reduce gives: Enum -> REDUCE cls(value); a plain
                # object -> NEWOBJ cls() then BUILD with its attributes
                state = {k: v for k, v in vars(o).items() if k != "args"}
                return (copyreg.__newobj__, (type(o), *o.args), state) if state else (type(o), o.args)
            return NotImplemented

        def save_global(self, o: Any, name: str | None = None) -> None:
            if isinstance(o, type) and issubclass(o, DeepSpeedObjectStub) and o.deepspeed_name:
                module, attr = o.deepspeed_name.rsplit(".", 1)
                self.write(pickle.GLOBAL + f"{module}\n{attr}\n".encode())
                self.memoize(o)
                return
            super().save_global(o, name)

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


def _archive_name(path: str | Path) -> str:
    # inline_container.cc: the basename up to its last '.'; non-ASCII names go through torch's
    # buffer writer, which calls the archive "archive"
    base = os.path.basename(os.fspath(path))
    stem = base[: base.rfind(".")] if "." in base else base
    return stem if stem.isascii() else "archive"


# --- torch's zip layout ----------------------------------------------------------------------------

_ALIGNMENT = 64  # torch.serialization._get_storage_alignment() default ("FB" padding, kFieldAlignment)
_U32 = 0xFFFFFFFF  # the 32-bit field value that says "the real one is in the zip64 extra field"
#: Sizes and offsets from which a record is written zip64 (miniz: ``>= MZ_UINT32_MAX``). A module
#: constant so a test can lower it and exercise the zip64 branches without writing 4 GiB.
ZIP64_AT = _U32
_FLAGS = 0x0808  # bit 3: sizes and crc follow the data (data descriptor); bit 11: UTF-8 names


class _HashingWriter:
    """Every byte written to the file also goes through sha256 (the manifest's digest)."""

    def __init__(self, raw: BinaryIO):
        self.raw, self.sha, self.size = raw, hashlib.sha256(), 0

    def write(self, data: bytes | memoryview) -> None:
        self.sha.update(data)
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            n = self.raw.write(view[done:])
            if not n:
                raise OSError(f"short write to {getattr(self.raw, 'name', 'the output file')}")
            done += n
        self.size += len(view)


@dataclass
class _Entry:
    name: bytes
    offset: int
    size: int
    crc: int
    flags: int


class _ZipWriter:
    """The records of one torch zip, written front to back (see the module docstring)."""

    def __init__(self, out: _HashingWriter, archive: str):
        self.out, self.prefix = out, f"{archive}/"
        self.entries: list[_Entry] = []

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
        pad = -start % _ALIGNMENT
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
        entry.crc = zlib.crc32(view)
        self.out.write(view)
        self._footer(entry)

    def add_segments(self, name: str, nbytes: int, segments: Sequence[Segment], buf: memoryview) -> None:
        """A record of ``nbytes`` assembled from ``segments`` through ``buf``, one buffer at a time."""
        if sum(s.nbytes for s in segments) != nbytes:
            raise RuntimeError(f"record {name}: segments hold {sum(s.nbytes for s in segments)} bytes, expected {nbytes}")
        entry = self._header(name, nbytes)
        fds: dict[str, int] = {}
        crc, fill = 0, 0
        try:
            for seg in segments:
                done = 0
                while done < seg.nbytes:
                    n = min(seg.nbytes - done, len(buf) - fill)
                    window = buf[fill : fill + n]
                    if seg.path is None:
                        _zero_fill(window)
                    else:
                        fd = fds.get(seg.path)
                        if fd is None:
                            fd = fds[seg.path] = os.open(seg.path, os.O_RDONLY)
                        _pread_exact(fd, window, seg.offset + done, seg.path)
                    done += n
                    fill += n
                    if fill == len(buf):
                        crc = zlib.crc32(buf, crc)
                        self.out.write(buf)
                        fill = 0
            if fill:
                crc = zlib.crc32(buf[:fill], crc)
                self.out.write(buf[:fill])
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
        self.add_bytes(".data/serialization_id", f"{combined:020d}{random.getrandbits(64):020d}".encode())
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


def _zero_fill(window: memoryview) -> None:
    """memset (a ctypes call: the GIL is released) instead of copying from a buffer of zeros."""
    if len(window):
        ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(window)), 0, len(window))


def _pread_exact(fd: int, window: memoryview, offset: int, path: str) -> None:
    done = 0
    while done < len(window):
        got = os.preadv(fd, [window[done:]], offset + done)
        if got <= 0:
            raise OSError(f"{path}: ended at byte {offset + done}, {len(window) - done} bytes short of the "
                          "tensor data it should hold (the file was truncated while being read)")
        done += got


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


def write_parallel(jobs: Sequence[FileJob], workers: int, *, outcome: str,
                   thread_name: str = "shardkit-write") -> list[WrittenFile]:
    """Write every job's file, ``workers`` at a time on threads, and return their digests in job order.

    Each file is fsynced by the thread that wrote it (the fsyncs overlap the other files' writes;
    the staging folder's ``fsync_tree`` then finds nothing dirty). The first failure cancels the
    jobs not yet started, waits for the running ones and is raised (a full disk as the
    CheckpointError of ``disk_full_named``, ending with ``outcome``), so nothing more is written
    into a staging folder the caller is about to remove. ``workers=1`` writes in this thread.
    """
    from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

    def run(path: Path, write: Callable[[Path], WrittenFile]) -> WrittenFile:
        try:
            with disk_full_named(path, outcome):
                digest = write(path)
                fsync_file(path)
        except OSError as exc:
            if exc.filename is not None:
                raise
            # a write or fsync on an open descriptor fails without a file name (EIO ...): name the
            # file here, so the caller's os_errors_named message says which one
            raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
        return digest

    if workers <= 1 or len(jobs) <= 1:
        return [run(path, write) for path, write in jobs]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=thread_name) as pool:
        futures = [pool.submit(run, path, write) for path, write in jobs]
        wait(futures, return_when=FIRST_EXCEPTION)
        for f in futures:
            f.cancel()  # only the queued ones: leaving the block waits for the running writers
    for f in futures:
        exc = None if f.cancelled() else f.exception()
        if exc is not None:
            raise exc
    return [f.result() for f in futures]


def copy_file_hashed(src: str | Path, dst: str | Path, *, chunk_bytes: int = CHUNK_BYTES) -> WrittenFile:
    """Copy ``src`` to a new file ``dst`` through one buffer, hashing the bytes as they are written.

    A copy, never a link: the source's owner may rewrite it in place later (``torch.save`` truncates
    and rewrites an existing file), which must not change the copy its manifest describes.
    """
    buf = memoryview(bytearray(chunk_bytes))
    with open(src, "rb", buffering=0) as fin, open(dst, "xb", buffering=0) as raw:
        out = _HashingWriter(raw)
        while True:
            n = fin.readinto(buf)
            if not n:
                break
            out.write(buf[:n])
        return WrittenFile(out.size, out.sha.hexdigest())
