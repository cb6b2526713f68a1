"""Read element ranges of tensors in a DCP checkpoint straight from its ``.distcp`` files.

``dcp.load`` reads every stored chunk of a requested tensor whole: the item's bytes into memory,
``torch.load`` of them, a copy into the destination. Cutting N ranks' ZeRO-3 partitions out of full
tensors that way reads the checkpoint N times and copies each byte four times. With the default
``torch.save`` serialization each stored chunk is a small zip archive inside the ``.distcp`` file
(``FileSystemWriter._write_item``, torch 2.13) whose one ``data/0`` record holds the chunk's
elements in row-major order, so a range of a dim-0 chunk is one contiguous byte range of the file:
``os.preadv`` puts it straight into the output tensor.

Every assumption is checked per chunk before it is used, from the chunk's own files: no stream
transform (``transform_descriptors``), a stored (uncompressed) zip with exactly one data record of
the chunk's size, and a ``data.pkl`` that rebuilds one tensor from that record with storage offset 0,
the chunk's shape and contiguous strides (read by a restricted unpickler that only records the
arguments; nothing is constructed or called). Chunks split along dim 0 only (FSDP2's ``Shard(0)``).
Anything else answers ``None`` and the caller reads that tensor through ``safe_load.load_dcp_state``.

The same checks give what else a converter needs without torch: a tensor stored whole (a buffer, an
Adam ``step``) as a ``TensorRef`` to its record (``tensor_ref``, ``scalar``), a non-tensor item's
plain value (``value``: a restricted unpickler that takes no global at all), and whether two tensors
hold the same bytes (``same_bytes``: tied weights). The ``.metadata`` is read by
``plain_metadata.read_plain_metadata``, so none of this imports torch (``read_into`` fills a tensor
the caller made).
"""

from __future__ import annotations

import io
import math
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardkit.checkpoint.dcp.plain_metadata import METADATA_NAME, DcpMetadata, StorageInfo, read_plain_metadata
from shardkit.checkpoint.model.tensors import Piece, SourceTensor, contiguous_strides, same_bytes
from shardkit.core.files import open_regular, regular_fd
from shardkit.storage.torch_load import ITEMSIZE, STORAGE_DTYPES, TensorRef
from shardkit.storage.torch_zip import pread_exact

if TYPE_CHECKING:
    import torch

_FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")
"""Dtypes whose element ranges are cut (partitions, fragments); whole tensors (``tensor_ref``) take any."""
_SCALAR_FORMATS = {"float32": "f", "float64": "d", "int64": "q", "int32": "i"}
_UNREADABLE = (OSError, zipfile.BadZipFile, pickle.UnpicklingError, ValueError, KeyError, EOFError, struct.error,
               IndexError, TypeError, AttributeError)

@dataclass(frozen=True)
class _Chunk:
    start: int
    """First element (row-major, of the whole tensor) the chunk holds."""
    numel: int
    file: Path
    data_offset: int
    """Where the chunk's first element's bytes are in ``file``."""


class _Window(io.RawIOBase):
    """``length`` bytes of ``fh`` from ``base``: one chunk's zip archive, for ``zipfile``."""

    def __init__(self, fh: Any, base: int, length: int):
        self.fh, self.base, self.length, self.pos = fh, base, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.length + offset
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.length - self.pos if n < 0 else min(n, self.length - self.pos)
        self.fh.seek(self.base + self.pos)
        data = self.fh.read(max(n, 0))
        self.pos += len(data)
        return data


class _Probe(pickle.Unpickler):
    """Reads a one-tensor ``data.pkl``: records ``_rebuild_tensor_v2``'s arguments, builds nothing."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, requires_grad=False, hooks=None, metadata=None: (
                "tensor", storage, offset, tuple(size), tuple(stride), bool(requires_grad), bool(hooks) or bool(metadata))
        if module == "torch" and name in STORAGE_DTYPES:
            return name
        if (module, name) == ("collections", "OrderedDict"):
            import collections

            return collections.OrderedDict
        if (module, name) == ("torch", "Size"):
            return tuple
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a plain tensor record")

    def persistent_load(self, pid: Any) -> Any:
        return tuple(pid)


class _PlainValue(pickle.Unpickler):
    """A ``BYTE_IO`` item's ``data.pkl`` holding plain data only: any global or tensor is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name}: not plain data")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("a tensor: not plain data")


@dataclass(frozen=True)
class _Record:
    """The one tensor a ``torch.save`` zip inside a ``.distcp`` file holds, as ``_rebuild_tensor_v2`` reads it."""

    dtype: str
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    data_offset: int
    """Where the storage record's bytes start in the ``.distcp`` file."""
    nbytes: int
    """The storage record's size."""


def _item_zip(fh: Any, base: int, length: int) -> zipfile.ZipFile | None:
    fh.seek(base)
    if fh.read(4) != b"PK\x03\x04":
        return None
    return zipfile.ZipFile(_Window(fh, base, length))


def _tensor_record(fh: Any, base: int, length: int) -> _Record | None:
    """The tensor stored in the item zip at ``base`` (uncompressed, one data record, no requires_grad,
    hooks or tensor metadata), or None."""
    z = _item_zip(fh, base, length)
    if z is None:
        return None
    with z:
        infos = z.infolist()
        data = [i for i in infos if "/data/" in i.filename]
        pkl = [i for i in infos if i.filename.endswith("/data.pkl")]
        if len(data) != 1 or len(pkl) != 1 or data[0].compress_type != zipfile.ZIP_STORED:
            return None
        record = data[0]
        got = _Probe(io.BytesIO(z.read(pkl[0]))).load()
    if not (isinstance(got, tuple) and len(got) == 7 and got[0] == "tensor") or got[5] or got[6]:
        return None
    _, pid, storage_offset, size, stride, _, _ = got
    dtype = STORAGE_DTYPES.get(str(pid[1])) if len(pid) >= 3 else None
    if dtype is None or f"/data/{pid[2]}" not in record.filename or type(storage_offset) is not int:
        return None
    extent = 0 if 0 in size else 1 + sum((d - 1) * st for d, st in zip(size, stride))
    if storage_offset < 0 or (storage_offset + extent) * ITEMSIZE[dtype] > record.file_size:
        return None
    fh.seek(base + record.header_offset)
    header = fh.read(30)
    if header[:4] != b"PK\x03\x04":
        return None
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return _Record(dtype, storage_offset, size, stride, base + record.header_offset + 30 + name_len + extra_len,
                   record.file_size)


def _chunk_data_offset(fh: Any, base: int, length: int, shape: tuple[int, ...], dtype: str) -> int | None:
    """Where a stored chunk's elements start, when its record is exactly them, row-major."""
    r = _tensor_record(fh, base, length)
    if (r is None or r.dtype != dtype or r.storage_offset != 0 or r.shape != shape or r.stride != contiguous_strides(shape)
            or r.nbytes != math.prod(shape) * ITEMSIZE[dtype]):
        return None
    return r.data_offset


class DcpSlices:
    """Element ranges, whole tensors and plain values of a DCP checkpoint, read from its files
    without torch (see module doc); ``md``: its ``.metadata`` (read here when not given)."""

    def __init__(self, tag_dir: Path, md: DcpMetadata | None = None):
        self.tag_dir = tag_dir
        self.md = md if md is not None else read_plain_metadata(tag_dir / METADATA_NAME)
        self._chunks: dict[str, list[_Chunk] | None] = {}
        self._fds: dict[Path, int] = {}

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def chunks(self, key: str) -> list[_Chunk] | None:
        """The stored chunks of tensor ``key`` in element order, or None when they cannot be read directly."""
        if key not in self._chunks:
            try:
                self._chunks[key] = self._find(key)
            except _UNREADABLE:
                self._chunks[key] = None
        return self._chunks[key]

    def _item(self, key: str, offsets: tuple[int, ...] | None) -> tuple[Path, StorageInfo] | None:
        """The file and place of one stored item, when it is a plain zip inside this folder."""
        info = self.md.storage_info(key, offsets)
        if info is None or info.transformed:
            return None
        path = self.tag_dir / info.relative_path
        if path.resolve().parent != self.tag_dir.resolve():
            return None
        return path, info

    def _find(self, key: str) -> list[_Chunk] | None:
        meta = self.md.tensors.get(key)
        if meta is None or len(meta.size) == 0 or meta.dtype not in _FLOAT_DTYPES:
            return None
        full = meta.size
        row = math.prod(full[1:])
        out = []
        for c in meta.chunks:
            if any(c.offsets[1:]) or c.sizes[1:] != full[1:]:
                return None  # not a dim-0 slab
            item = self._item(key, c.offsets)
            if item is None:
                return None
            path, info = item
            with open_regular(path) as fh:
                at = _chunk_data_offset(fh, info.offset, info.length, c.sizes, meta.dtype)
            if at is None:
                return None
            out.append(_Chunk(c.offsets[0] * row, math.prod(c.sizes), path, at))
        out.sort(key=lambda ch: ch.start)
        pos = 0
        for ch in out:
            if ch.start != pos:
                return None  # chunks overlap or leave a gap
            pos += ch.numel
        return out if pos == math.prod(full) else None

    def tensor_ref(self, key: str) -> TensorRef | None:
        """Tensor ``key`` stored whole (one chunk: a buffer, an Adam ``step``) as a ``TensorRef`` to
        its storage record (any dtype, shape and strides), for ``torch_pickle`` to copy; None when
        it is not stored so."""
        meta = self.md.tensors.get(key)
        if meta is None or len(meta.chunks) != 1 or meta.chunks[0].sizes != meta.size or any(meta.chunks[0].offsets):
            return None
        item = self._item(key, meta.chunks[0].offsets)
        if item is None:
            return None
        path, info = item
        try:
            with open_regular(path) as fh:
                r = _tensor_record(fh, info.offset, info.length)
        except _UNREADABLE:
            return None
        if r is None or r.dtype != meta.dtype or r.shape != meta.size:
            return None
        ref = TensorRef(key, r.dtype, r.storage_offset, r.shape, r.stride)
        ref.path, ref.record_offset, ref.record_nbytes = str(path), r.data_offset, r.nbytes
        ref.file_offset = r.data_offset + r.storage_offset * ref.itemsize
        return ref

    def read_ref(self, ref: TensorRef) -> bytes:
        """The bytes of a contiguous ``TensorRef`` (a small one: a step, a buffer to compare)."""
        if not ref.is_contiguous() or ref.path is None or ref.file_offset is None:
            raise ValueError(f"{ref!r}: not a contiguous tensor read from a file")
        path = Path(ref.path)
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = regular_fd(path)
        data = bytearray(ref.numel * ref.itemsize)
        pread_exact(fd, memoryview(data), ref.file_offset, path, ref.key)
        return bytes(data)

    def scalar(self, ref: TensorRef) -> float | None:
        """The number a one-element float/int tensor (``tensor_ref``: an Adam ``step``) holds, or None."""
        if ref.numel != 1 or ref.dtype not in _SCALAR_FORMATS:
            return None
        return float(struct.unpack("<" + _SCALAR_FORMATS[ref.dtype], self.read_ref(ref))[0])

    def value(self, key: str) -> tuple[bool, Any]:
        """``(True, value)`` for a non-tensor item holding plain data (numbers, strings, lists,
        tuples, dicts of them: a param group's ``lr``, ``betas``, ``params``); ``(False, None)``
        when it holds anything else (it is then read through torch's weights_only loader)."""
        if key not in self.md.values:
            return False, None
        item = self._item(key, None)
        if item is None:
            return False, None
        path, info = item
        try:
            with open_regular(path) as fh:
                z = _item_zip(fh, info.offset, info.length)
                if z is None:
                    return False, None
                with z:
                    infos = z.infolist()
                    pkl = [i for i in infos if i.filename.endswith("/data.pkl")]
                    if len(pkl) != 1 or any("/data/" in i.filename for i in infos):
                        return False, None
                    return True, _PlainValue(io.BytesIO(z.read(pkl[0]))).load()
        except _UNREADABLE:
            return False, None

    def same_bytes(self, a: str, b: str) -> bool | None:
        """Tensors ``a`` and ``b`` hold the same bytes (a tied weight: ``model.tensors.same_bytes``); None
        when either is not directly readable."""
        ca, cb, ma, mb = self.chunks(a), self.chunks(b), self.md.tensors.get(a), self.md.tensors.get(b)
        if ca is None or cb is None or ma is None or mb is None:
            return None
        return same_bytes(*(SourceTensor(key, m.dtype, m.size, [Piece(c.file, c.data_offset, c.start, c.numel) for c in cs])
                            for key, m, cs in ((a, ma, ca), (b, mb, cb))))

    def read_into(self, key: str, start: int, out: "torch.Tensor") -> bool:
        """Elements ``[start, start + out.numel())`` of tensor ``key`` (flattened) into ``out``
        (1-D, contiguous, CPU, the tensor's dtype). False (nothing done) when not directly readable."""
        chunks = self.chunks(key)
        if chunks is None or not out.is_contiguous() or out.device.type != "cpu":
            return False
        import torch

        if str(out.dtype).removeprefix("torch.") != self.md.tensors[key].dtype:
            return False
        self._read(key, chunks, start, out.view(torch.uint8).numpy().data)
        return True

    def _read(self, key: str, chunks: list[_Chunk], start: int, view: memoryview) -> None:
        elsize = ITEMSIZE[self.md.tensors[key].dtype]
        stop = start + len(view) // elsize
        for ch in chunks:
            a, b = max(start, ch.start), min(stop, ch.start + ch.numel)
            if b <= a:
                continue
            fd = self._fds.get(ch.file)
            if fd is None:
                fd = self._fds[ch.file] = regular_fd(ch.file)
            dst = view[(a - start) * elsize:(b - start) * elsize]
            pread_exact(fd, dst, ch.data_offset + (a - ch.start) * elsize, ch.file, key)
