"""Where a memory-mapped tensor's bytes lie in its torch zip file (``FileOffsets``), so a reader can
``os.preadv`` or ``os.copy_file_range`` them instead of paging in the mapping
(``RankPartitions.read_into`` and ``byte_offset`` in ``checkpoint``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardkit.core.files import open_regular
from shardkit.storage.torch_load import iter_leaves

if TYPE_CHECKING:
    import torch


class FileOffsets:
    """Byte offsets of memory-mapped tensors inside their torch zip file.

    ``torch.load(mmap=True)`` maps the whole file once and every storage is a slice of that
    mapping at its record's offset, so ``data_ptr`` differences are file-offset differences. The
    anchor is the data record with the lowest offset (found in the zip's local headers), which is
    the non-empty storage with the lowest address. Each offset is checked by reading the first
    bytes back from the file; anything unexpected disables the shortcut (callers then copy from
    memory).
    """

    def __init__(self, path: Path, loaded: Any):
        import torch

        self.path = path
        self._base: int | None = None
        try:
            ptrs = [t.untyped_storage().data_ptr() for t in iter_leaves(loaded, torch.Tensor) if t.untyped_storage().nbytes() > 0]
            starts = _zip_data_offsets(path)
            if ptrs and starts:
                self._base = min(starts) - min(ptrs)
        except Exception:  # noqa: BLE001 - an optimisation only; never a reason to fail
            self._base = None

    def of(self, t: "torch.Tensor") -> int | None:
        if self._base is None or t.numel() == 0:
            return None
        offset = self._base + t.data_ptr()
        probe = min(16, t.numel() * t.element_size())
        with open_regular(self.path) as fh:
            fh.seek(offset)
            on_disk = fh.read(probe)
        if on_disk != t.reshape(-1)[: max(1, probe // t.element_size())].contiguous().view(torch_uint8()).numpy().tobytes()[:probe]:
            self._base = None
            return None
        return offset


def torch_uint8() -> "torch.dtype":
    """``torch.uint8``, looked up when first needed: this module imports no torch at import time."""
    import torch

    return torch.uint8


def _zip_data_offsets(path: Path) -> list[int]:
    """File offsets where the bytes of each non-empty ``.../data/<key>`` record of a torch zip start."""
    import struct
    import zipfile

    out = []
    with open_regular(path) as fh, zipfile.ZipFile(fh) as z:
        for info in z.infolist():
            if "/data/" not in info.filename or info.file_size == 0 or info.compress_type != zipfile.ZIP_STORED:
                continue
            fh.seek(info.header_offset)
            header = fh.read(30)
            if header[:4] != b"PK\x03\x04":
                return []
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            out.append(info.header_offset + 30 + name_len + extra_len)
    return out
