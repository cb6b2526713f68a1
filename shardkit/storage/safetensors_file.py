"""The safetensors file format as shardkit's streaming writers need it: the header computed up
front from names, dtypes and shapes (tensor order asked of safetensors itself, so a file matches
what ``safetensors.torch.save_file`` writes byte for byte), and a file-to-file byte copy
(``os.copy_file_range`` in the kernel, a ``pread``/``pwrite`` loop where the kernel refuses).
Shared by ``consolidate`` and ``export``; imports neither torch nor numpy.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardkit.core import progress
from shardkit.core.errors import CheckpointError
from shardkit.core.files import open_regular
from shardkit.storage.torch_load import ITEMSIZE

#: torch dtype name (without ``torch.``) -> safetensors dtype code.
ST_DTYPE = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
}
#: safetensors dtype code -> torch dtype name.
TORCH_DTYPE = {code: name for name, code in ST_DTYPE.items()}
#: A safetensors header is read only up to this size (the format's own limit is 100 MB).
MAX_HEADER = 100_000_000


def read_header(file: Path) -> tuple[dict[str, Any], int, int]:
    """The JSON header of the safetensors file ``file`` (8-byte length + JSON; no tensor byte read), the
    offset its data section starts at and the file's size; CheckpointError naming the file when the
    header is short, oversized, not JSON or not an object."""
    with open_regular(file) as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{file}: shorter than a safetensors header (8 bytes): the file is truncated")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER:
            raise CheckpointError(f"{file}: safetensors header of {n} bytes, over the format's 100 MB limit: not a "
                                  "safetensors file")
        try:
            header = json.loads(fh.read(n))
        except ValueError as exc:
            raise CheckpointError(f"{file}: its safetensors header is not JSON ({exc}): the file is damaged") from None
        size = fh.seek(0, 2)
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: its safetensors header is not a JSON object: the file is damaged")
    return header, 8 + n, size


@dataclass
class TensorEntry:
    """One tensor of a safetensors file being laid out."""

    name: str
    dtype: str
    """torch dtype name without the ``torch.`` prefix (``float32``, ``bfloat16``...)."""
    shape: tuple[int, ...]
    start: int = 0
    """Byte offset inside the data section (set by ``header_layout``)."""

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


def header_layout(entries: dict[str, TensorEntry], metadata: dict[str, str] | None = None) -> tuple[bytes, int]:
    """The safetensors header for ``entries`` (sets each entry's ``start``) and where data begins."""
    import safetensors

    meta = metadata if metadata is not None else {"format": "pt"}
    # Ask safetensors for its tensor order (dtype, then name) with zero-size stand-ins, so the
    # file matches what save_file would write byte for byte (and no torch import is needed).
    probe = safetensors.serialize(
        {n: safetensors.TensorSpec(dtype=e.dtype, shape=(0,), data_ptr=0, data_len=0) for n, e in entries.items()},
        metadata=meta,
    )
    (n,) = struct.unpack("<Q", probe[:8])
    order = [k for k in json.loads(probe[8 : 8 + n]) if k != "__metadata__"]
    header: dict[str, object] = {"__metadata__": meta}
    offset = 0
    for name in order:
        e = entries[name]
        if e.dtype not in ST_DTYPE:
            raise CheckpointError(f"tensor {name!r}: dtype {e.dtype} cannot be written to safetensors")
        e.start = offset
        header[name] = {"dtype": ST_DTYPE[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    return raw, 8 + len(raw)


def write_header(fd: int, header: bytes, total: int) -> None:
    """Write the length prefix and ``header`` at the start of ``fd`` and size the file to ``total``."""
    os.pwrite(fd, struct.pack("<Q", len(header)) + header, 0)
    os.ftruncate(fd, total)


def copy_bytes(src_fd: int, dst_fd: int, nbytes: int, src_off: int, dst_off: int) -> None:
    """``nbytes`` from ``src_off`` of one file to ``dst_off`` of another, in the kernel where it can."""
    done = 0
    use_kernel = hasattr(os, "copy_file_range")
    while done < nbytes:
        n = 0
        if use_kernel:
            try:
                n = os.copy_file_range(src_fd, dst_fd, nbytes - done, src_off + done, dst_off + done)
            except OSError:  # EXDEV on old kernels, ENOSYS, filesystems that refuse: copy in user space
                use_kernel = False
                continue
        else:
            chunk = os.pread(src_fd, min(64 << 20, nbytes - done), src_off + done)
            n = os.pwrite(dst_fd, chunk, dst_off + done) if chunk else 0
        if n <= 0:
            raise CheckpointError(f"short read at byte {src_off + done}: the source file is truncated")
        done += n
        progress.advance(n)
