"""Streaming ``torch.save``: tensors whose bytes are produced only when their record is written, so
a multi-GB checkpoint file is written with one produced tensor alive at a time.
"""

from __future__ import annotations

import pickle
import sys
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch


class LazyTensor:
    """A 1-D CPU tensor that pickles exactly like ``torch.save`` pickles one, but whose bytes are
    produced only when ``stream_save`` writes its record (or when ``materialize()`` is called)."""

    def __init__(self, numel: int, dtype: "torch.dtype", produce: Callable[[], "torch.Tensor"]):
        self.numel, self.dtype, self.produce = numel, dtype, produce
        self.storage = _LazyStorage(self)

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


def stream_save(obj: Any, path: str | Path) -> None:
    """``torch.save(obj, path)`` where LazyTensor records are produced one at a time while writing.

    Mirrors ``torch.serialization._save`` (2.13): same pickle protocol, persistent ids, record
    names and order, through torch's own ``PyTorchFileWriter``; ``torch.load`` cannot tell the
    difference. Only one produced tensor is alive at a time.
    """
    import torch
    from torch.serialization import _get_storage_alignment, _open_zipfile_writer, location_tag

    storage_types = torch.storage._dtype_to_storage_type_map()
    keys: dict[int, str] = {}
    records: dict[str, Any] = {}

    class _Pickler(pickle.Pickler):
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

    import io

    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(obj)
    data = buf.getvalue()
    with _open_zipfile_writer(str(path)) as writer:
        writer.write_record("data.pkl", data, len(data))
        writer.write_record(".format_version", "1", 1)
        alignment = str(_get_storage_alignment())
        writer.write_record(".storage_alignment", alignment, len(alignment))
        writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        for key, rec in records.items():
            if isinstance(rec, _LazyStorage):
                t = rec.owner.materialize()
                storage = t.contiguous().untyped_storage()
                writer.write_record(f"data/{key}", storage, storage.nbytes())
                del t, storage
            else:
                writer.write_record(f"data/{key}", rec.cpu(), rec.nbytes())
