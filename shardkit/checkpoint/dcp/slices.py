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
Anything else answers ``None`` and the caller reads that tensor through ``load_dcp_state``.
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

if TYPE_CHECKING:
    import torch

_STORAGE_DTYPES = {
    "FloatStorage": "float32", "BFloat16Storage": "bfloat16", "HalfStorage": "float16", "DoubleStorage": "float64",
}


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
            return lambda storage, offset, size, stride, *_: ("tensor", storage, offset, tuple(size), tuple(stride))
        if module == "torch" and name in _STORAGE_DTYPES:
            return name
        if (module, name) == ("collections", "OrderedDict"):
            import collections

            return collections.OrderedDict
        if (module, name) == ("torch", "Size"):
            return tuple
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a plain tensor record")

    def persistent_load(self, pid: Any) -> Any:
        return tuple(pid)


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


def _chunk_data_offset(fh: Any, path: Path, base: int, length: int, shape: tuple[int, ...], dtype: str) -> int | None:
    fh.seek(base)
    if fh.read(4) != b"PK\x03\x04":
        return None
    with zipfile.ZipFile(_Window(fh, base, length)) as z:
        infos = z.infolist()
        data = [i for i in infos if "/data/" in i.filename]
        pkl = [i for i in infos if i.filename.endswith("/data.pkl")]
        if len(data) != 1 or len(pkl) != 1 or data[0].compress_type != zipfile.ZIP_STORED:
            return None
        record = data[0]
        got = _Probe(io.BytesIO(z.read(pkl[0]))).load()
    elsize = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}[dtype]
    if not (isinstance(got, tuple) and len(got) == 5 and got[0] == "tensor"):
        return None
    _, pid, storage_offset, size, stride = got
    if (len(pid) < 3 or _STORAGE_DTYPES.get(str(pid[1])) != dtype or f"/data/{pid[2]}" not in record.filename
            or storage_offset != 0 or size != shape or stride != _contiguous(shape)
            or record.file_size != math.prod(shape) * elsize):
        return None
    fh.seek(base + record.header_offset)
    header = fh.read(30)
    if header[:4] != b"PK\x03\x04":
        return None
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return base + record.header_offset + 30 + name_len + extra_len


class DcpSlices:
    """Element ranges of a DCP checkpoint's tensors, read with ``os.preadv`` (see module doc)."""

    def __init__(self, tag_dir: Path, metadata: Any):
        self.tag_dir, self.md = tag_dir, metadata
        self._chunks: dict[str, list[_Chunk] | None] = {}
        self._fds: dict[Path, int] = {}
        self.bytes_read = 0

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def chunks(self, key: str) -> list[_Chunk] | None:
        """The stored chunks of tensor ``key`` in element order, or None when they cannot be read directly."""
        if key not in self._chunks:
            try:
                self._chunks[key] = self._find(key)
            except (OSError, zipfile.BadZipFile, pickle.UnpicklingError, ValueError, KeyError, EOFError, struct.error):
                self._chunks[key] = None
        return self._chunks[key]

    def _find(self, key: str) -> list[_Chunk] | None:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

        meta = self.md.state_dict_metadata.get(key)
        if not isinstance(meta, TensorStorageMetadata) or len(meta.size) == 0:
            return None
        dtype = str(meta.properties.dtype).removeprefix("torch.")
        if dtype not in ("float32", "bfloat16", "float16", "float64"):
            return None
        full = tuple(meta.size)
        row = math.prod(full[1:])
        out = []
        for c in meta.chunks:
            offs, sizes = tuple(c.offsets), tuple(c.sizes)
            if any(offs[1:]) or sizes[1:] != full[1:]:
                return None  # not a dim-0 slab
            info = self.md.storage_data.get(MetadataIndex(key, c.offsets))
            if info is None or getattr(info, "transform_descriptors", None):
                return None
            path = self.tag_dir / info.relative_path
            if path.resolve().parent != self.tag_dir.resolve():
                return None
            with open(path, "rb") as fh:
                at = _chunk_data_offset(fh, path, info.offset, info.length, sizes, dtype)
            if at is None:
                return None
            out.append(_Chunk(offs[0] * row, math.prod(sizes), path, at))
        out.sort(key=lambda ch: ch.start)
        pos = 0
        for ch in out:
            if ch.start != pos:
                return None  # chunks overlap or leave a gap
            pos += ch.numel
        return out if pos == math.prod(full) else None

    def read_into(self, key: str, start: int, out: "torch.Tensor") -> bool:
        """Elements ``[start, start + out.numel())`` of tensor ``key`` (flattened) into ``out``
        (1-D, contiguous, CPU, the tensor's dtype). False (nothing done) when not directly readable."""
        chunks = self.chunks(key)
        if chunks is None or not out.is_contiguous() or out.device.type != "cpu":
            return False
        import torch

        meta = self.md.state_dict_metadata[key]
        if out.dtype != meta.properties.dtype:
            return False
        elsize = out.element_size()
        view = out.view(torch.uint8).numpy().data
        stop = start + out.numel()
        for ch in chunks:
            a, b = max(start, ch.start), min(stop, ch.start + ch.numel)
            if b <= a:
                continue
            fd = self._fds.get(ch.file)
            if fd is None:
                fd = self._fds[ch.file] = os.open(ch.file, os.O_RDONLY)
            dst = view[(a - start) * elsize:(b - start) * elsize]
            at, done = ch.data_offset + (a - ch.start) * elsize, 0
            while done < len(dst):
                n = os.preadv(fd, [dst[done:]], at + done)
                if n <= 0:
                    raise OSError(f"{ch.file}: ended {len(dst) - done} bytes early reading {key}")
                done += n
            self.bytes_read += len(dst)
        return True
