"""A DCP checkpoint's files written without torch: what ``dcp.save`` with torch's
``FileSystemWriter`` writes (torch 2.13), built from plain values and byte ranges.

What torch writes, checked in torch/distributed/checkpoint/filesystem.py (``_write_item``,
``FileSystemWriter.finish``) and metadata.py:

- every item of a ``.distcp`` file is a whole ``torch.save`` zip (the default ``TORCH_SAVE``
  serialization), not raw storage bytes: a tensor's zip holds ``_rebuild_tensor_v2`` of one
  storage record ``data/0``, a non-tensor value's zip is its pickle alone (``BYTE_IO`` items:
  param-group values). The item's ``_StorageInfo(relative_path, offset, length)`` is the zip's
  place in the file, and the zip's own offsets count from its start (``torch.save`` into the
  stream), so ``write_torch_zip_to`` into the open file writes exactly that.
- ``.metadata`` is ``pickle.dump(Metadata)``: ``state_dict_metadata`` (a ``TensorStorageMetadata``
  with one chunk per unsharded tensor, ``BytesStorageMetadata`` for values), ``planner_data`` (each
  flattened key's path in the nested state dict), ``storage_data`` (``MetadataIndex`` ->
  ``_StorageInfo``), ``storage_meta`` and ``version``. It is pickled here by ``StubPickler`` with
  the classes named by module and name (``torch_global``-style stand-ins), reducing each as
  Python does a dataclass (``copyreg.__newobj__`` + its ``__dict__``; ``TensorProperties``'s
  ``__getstate__`` tuple; ``torch.layout`` through ``torch.serialization._get_layout``), so plain
  ``pickle.load`` (``dcp.load``) and shardkit's restricted reader rebuild the real objects.

Nothing here imports torch; ``tests/test_convert_dcp_format.py`` checks the result against
``dcp.save``'s and ``torch.save``'s for the same state.
"""

from __future__ import annotations

import copyreg
import io
import math
import os
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable

from shardkit.checkpoint.model.tensors import contiguous_strides
from shardkit.storage.torch_load import ITEMSIZE, Dtype, TorchSize
from shardkit.storage.torch_pickle import STORAGE_TYPE, StubPickler, torch_global
from shardkit.storage.torch_zip import (
    RecordData,
    WrittenFile,
    write_torch_zip_to,
)

#: ``FileSystemWriter.finish``'s ``CURRENT_DCP_VERSION`` (torch 2.13).
DCP_VERSION = "1.0.0"
_MD = "torch.distributed.checkpoint.metadata"
#: ``torch.save`` into a stream names its archive "archive" (torch's buffer writer).
_STREAM_ARCHIVE = "archive"


@dataclass(frozen=True)
class TensorItem:
    """One unsharded tensor of the checkpoint, stored whole as one chunk."""

    key: str
    """Flattened DCP key (``model.<fqn>``, ``optim.state.<fqn>.exp_avg``)."""
    path: tuple[str | int, ...]
    """Where the key sits in the nested state dict (``planner_data``)."""
    dtype: str
    shape: tuple[int, ...]
    data: RecordData | Callable[[], RecordData]
    """Its bytes: in memory (small ones), byte ranges of source files (``SegmentedRecord``), or what
    builds those ranges when the item is written (so they never all exist at once)."""

    def record(self) -> RecordData:
        return self.data() if callable(self.data) else self.data

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


def itemsize(dtype: str) -> int:
    """Bytes per element of the torch dtype named ``dtype`` (``float32``...)."""
    return ITEMSIZE[dtype]


@dataclass(frozen=True)
class ValueItem:
    """A non-tensor value (a ``BYTE_IO`` item): a param group's ``lr``, ``betas``, ``params`` ..."""

    key: str
    path: tuple[str | int, ...]
    value: Any
    """Plain Python data only (numbers, strings, bools, None, tuples/lists of them)."""


@dataclass(frozen=True)
class Stored:
    """Where an item's zip was written: ``_StorageInfo``'s fields."""

    relative_path: str
    offset: int
    length: int


# --- torch objects named without torch ------------------------------------------------------------

class _Reduce:
    """An object pickled as ``func(*args)`` (REDUCE)."""

    def __init__(self, func: Any, args: tuple[Any, ...]):
        self.func, self.args = func, args


class _DcpObject:
    """An instance of a torch class named by ``pickle_global``, rebuilt by NEWOBJ + BUILD ``state``
    (what ``copyreg.__reduce_ex__`` gives a dataclass at protocol >= 2)."""

    pickle_global: tuple[str, str] = ("", "")

    def __init__(self, state: Any = None):
        self.state = state


_CLASSES: dict[tuple[str, str], type[_DcpObject]] = {}


def _instance(module: str, name: str, state: Any = None) -> _DcpObject:
    # NEWOBJ needs the object's own class as its first argument: one stand-in class per torch class
    key = (module, name)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"Dcp_{name}", (_DcpObject,), {"pickle_global": key})
    return _CLASSES[key](state)


class _DcpPickler(StubPickler):
    """Writes ``_Reduce``/``_DcpObject`` stand-ins as the torch objects they name, and (``storage_ids``)
    a ``_StorageRef`` as ``torch.save``'s persistent id of storage record ``"0"``."""

    def __init__(self, file: io.BytesIO, protocol: int, storage_ids: bool = False):
        super().__init__(file, protocol=protocol)
        self.storage_ids = storage_ids

    def reducer_override(self, o: Any) -> Any:
        if isinstance(o, _Reduce):
            return (o.func, o.args)
        if isinstance(o, _DcpObject):
            if o.state is None:
                return (copyreg.__newobj__, (type(o),))  # type: ignore[attr-defined]
            return (copyreg.__newobj__, (type(o),), o.state)  # type: ignore[attr-defined]
        return super().reducer_override(o)

    def persistent_id(self, o: Any) -> Any:
        if self.storage_ids and isinstance(o, _StorageRef):
            return ("storage", torch_global("torch", STORAGE_TYPE[o.dtype]), "0", "cpu", o.numel)
        return None


# --- tensor and value zips -------------------------------------------------------------------------

class _StorageRef:
    def __init__(self, dtype: str, numel: int):
        self.dtype, self.numel = dtype, numel


def tensor_pickle(dtype: str, shape: tuple[int, ...]) -> bytes:
    """``data.pkl`` of ``torch.save(tensor)`` for a contiguous tensor whose one record is ``data/0``."""
    buf = io.BytesIO()
    args: tuple[Any, ...] = (_StorageRef(dtype, math.prod(shape)), 0, tuple(shape), contiguous_strides(shape), False,
                             OrderedDict())
    _DcpPickler(buf, protocol=2, storage_ids=True).dump(_Reduce(torch_global("torch._utils", "_rebuild_tensor_v2"), args))
    return buf.getvalue()


def value_pickle(value: Any) -> bytes:
    """``data.pkl`` of ``torch.save(value)`` for plain Python data (no tensor, so no record)."""
    buf = io.BytesIO()
    StubPickler(buf, protocol=2).dump(value)
    return buf.getvalue()


def write_tensor_file(path: Path, item: TensorItem) -> WrittenFile:
    """``item`` as the only item of its own ``.distcp`` file (offset 0, the whole file), fsynced: the
    zip ``torch.save`` writes into DCP's stream (archive "archive", whatever the file's name)."""
    with open(path, "wb", buffering=0) as raw:
        written = write_torch_zip_to(raw, _STREAM_ARCHIVE, tensor_pickle(item.dtype, item.shape), [("0", item.record())])
        os.fsync(raw.fileno())
    return written


def append_item(raw: BinaryIO, item: TensorItem | ValueItem) -> int:
    """``item``'s zip appended to the open file ``raw`` at its current position; its length."""
    if isinstance(item, TensorItem):
        written = write_torch_zip_to(raw, _STREAM_ARCHIVE, tensor_pickle(item.dtype, item.shape), [("0", item.record())])
    else:
        written = write_torch_zip_to(raw, _STREAM_ARCHIVE, value_pickle(item.value), [])
    return written.size


def is_plain(value: Any) -> bool:
    """A value ``value_pickle`` writes as torch.save would and that DCP keeps as one ``BYTE_IO`` item:
    None, bool, int, float, str, and lists/tuples of them (a dict would be flattened into keys)."""
    if type(value) in (list, tuple):
        return all(is_plain(v) for v in value)
    return type(value) in (type(None), bool, int, float, str)


# --- .metadata ---------------------------------------------------------------------------------------

def metadata_pickle(tensors: list[TensorItem], values: list[ValueItem], stored: dict[str, Stored],
                    checkpoint_id: Path) -> bytes:
    """The ``.metadata`` ``FileSystemWriter.finish`` writes for these items, stored at ``stored``."""
    layout = _Reduce(torch_global("torch.serialization", "_get_layout"), ("torch.strided",))
    contiguous = _Reduce(torch_global(_MD, "_MEM_FORMAT_ENCODING"), (0,))  # TORCH_CONTIGUOUS_FORMAT
    state_dict_md: dict[str, Any] = {}
    planner: dict[str, tuple[str | int, ...]] = {}
    storage: dict[Any, Any] = {}
    for t in tensors:
        zeros = TorchSize((0,) * len(t.shape))
        # TensorProperties.__getstate__: (dtype, layout, requires_grad, memory-format encoding, pin_memory)
        props = _instance(_MD, "TensorProperties", (Dtype(t.dtype), layout, False, contiguous, False))
        chunk = _instance(_MD, "ChunkStorageMetadata", {"offsets": zeros, "sizes": TorchSize(t.shape)})
        state_dict_md[t.key] = _instance(_MD, "TensorStorageMetadata",
                                         {"properties": props, "size": TorchSize(t.shape), "chunks": [chunk]})
        planner[t.key] = t.path
        # MetadataIndex.__init__ sets fqn, index, then offset: its __dict__ in that order
        index = _instance(_MD, "MetadataIndex", {"fqn": t.key, "index": 0, "offset": zeros})
        storage[index] = _storage_info(stored[t.key])
    for v in values:
        state_dict_md[v.key] = _instance(_MD, "BytesStorageMetadata")
        planner[v.key] = v.path
        storage[_instance(_MD, "MetadataIndex", {"fqn": v.key, "index": None})] = _storage_info(stored[v.key])
    meta = _instance(_MD, "StorageMeta", {
        "checkpoint_id": _Reduce(torch_global("pathlib", "PosixPath"), tuple(checkpoint_id.parts)),
        "save_id": str(uuid.uuid4()), "load_id": None, "modules": []})
    md = _instance(_MD, "Metadata", {"state_dict_metadata": state_dict_md, "planner_data": planner,
                                     "storage_data": storage, "storage_meta": meta, "version": DCP_VERSION})
    buf = io.BytesIO()
    _DcpPickler(buf, protocol=2).dump(md)
    return buf.getvalue()


def _storage_info(s: Stored) -> _DcpObject:
    # _StorageInfo.__getstate__ leaves transform_descriptors out when it is None
    return _instance("torch.distributed.checkpoint.filesystem", "_StorageInfo",
                     {"relative_path": s.relative_path, "offset": s.offset, "length": s.length})
