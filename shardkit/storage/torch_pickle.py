"""Write a checkpoint structure back as ``torch.save``'s ``data.pkl`` without importing torch.

``read_structure`` turns a torch zip file into plain Python with inert stand-ins (``TensorRef`` for
a tensor, ``TorchSize``, dtype names, DeepSpeed stubs); ``pickle_structure`` is its inverse: the
pickle torch itself would write for the same objects (the GLOBAL names, persistent ids and
``_rebuild_tensor_v2`` arguments of ``torch.Tensor._reduce_ex_internal``, torch 2.13), and the
storage records to write beside it, as byte ranges of the files the tensors were read from
(``SegmentedRecord``), so no tensor byte passes through Python objects. A ``NewTensor`` is a 1-D
tensor assembled from ``Segment``s (a resharded partition).

Python's own pickler (``pickle._Pickler``) is used: it lets ``save_global`` write torch's and
DeepSpeed's names for the stand-ins; its opcodes are the C pickler's (same protocol 2, memo and order).
"""

from __future__ import annotations

import copyreg
import io
import pickle
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

from shardkit.storage.torch_load import (
    ITEMSIZE,
    STORAGE_DTYPES,
    DeepSpeedObjectStub,
    Dtype,
    TensorRef,
    TorchSize,
)
from shardkit.storage.torch_zip import RecordData, Segment, SegmentedRecord

#: ``float32`` -> ``FloatStorage``: the storage class torch.save names for each element type.
STORAGE_TYPE = {dtype: name for name, dtype in STORAGE_DTYPES.items()}


@dataclass(frozen=True)
class NewTensor:
    """A contiguous 1-D tensor to write whose bytes are ``segments`` (source byte ranges, zero runs)."""

    dtype: str
    numel: int
    segments: Sequence[Segment]

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]


_GLOBALS: dict[tuple[str, str], type] = {}


def torch_global(module: str, name: str) -> type:
    """A class that ``StubPickler`` writes as ``GLOBAL module name`` (torch's own names, without torch)."""
    key = (module, name)
    if key not in _GLOBALS:
        _GLOBALS[key] = type(f"Global_{name}", (), {"pickle_global": key})
    return _GLOBALS[key]


class StubPickler(pickle._Pickler):  # type: ignore[name-defined,misc]
    """Writes the stand-ins of ``read_structure`` / ``safe_torch_load`` under the names they stand for."""

    def reducer_override(self, o: Any) -> Any:
        if isinstance(o, DeepSpeedObjectStub):
            # what the real object's own reduce gives: Enum -> REDUCE cls(value); a plain object ->
            # NEWOBJ cls() then BUILD with its attributes
            state = {k: v for k, v in vars(o).items() if k != "args"}
            args = getattr(o, "args", ())
            return (copyreg.__newobj__, (type(o), *args), state) if state else (type(o), args)  # type: ignore[attr-defined]
        if isinstance(o, TorchSize):
            return (torch_global("torch", "Size"), (tuple(o),))
        if isinstance(o, Dtype):
            return str(o)  # a string reduce means "save as a global": see save_global
        return NotImplemented

    def save_global(self, o: Any, name: str | None = None) -> None:
        if isinstance(o, type) and issubclass(o, DeepSpeedObjectStub) and o.deepspeed_name:
            module, attr = o.deepspeed_name.rsplit(".", 1)
        elif isinstance(o, type) and hasattr(o, "pickle_global"):
            module, attr = o.pickle_global
        elif isinstance(o, Dtype):
            module, attr = "torch", str(o)  # torch.dtype.__reduce__ is its name in module torch
        else:
            super().save_global(o, name)  # type: ignore[misc]
            return
        self.write(pickle.GLOBAL + f"{module}\n{attr}\n".encode())  # type: ignore[attr-defined]
        self.memoize(o)  # type: ignore[attr-defined]


class _Storage:
    """One output storage record: its persistent-id key, element type, and where its bytes come from."""

    def __init__(self, key: str, dtype: str, data: SegmentedRecord):
        self.key, self.dtype, self.data = key, dtype, data


class _StructurePickler(StubPickler):
    def __init__(self, file: io.BytesIO):
        super().__init__(file, protocol=2)
        self.storages: dict[Any, _Storage] = {}

    def _storage(self, source: Any, dtype: str, data: SegmentedRecord) -> _Storage:
        # one record per source storage: views of one storage stay views of one storage
        found = self.storages.get(source)
        if found is None:
            found = self.storages[source] = _Storage(str(len(self.storages)), dtype, data)
        return found

    def reducer_override(self, o: Any) -> Any:
        if isinstance(o, TensorRef):
            if o.path is None:
                raise ValueError(f"{o!r} was not read from a file: its bytes are unknown")
            record = SegmentedRecord(o.record_nbytes, [Segment(o.path, o.record_offset, o.record_nbytes)])
            storage = self._storage((o.path, o.key), o.dtype, record)
            args: tuple[Any, ...] = (storage, o.storage_offset, tuple(o.shape), tuple(o.stride), o.requires_grad, OrderedDict())
            rebuild: tuple[Any, ...] = (torch_global("torch._utils", "_rebuild_tensor_v2"), args)
            if o.py_state:
                # Tensor.__reduce_ex__ for a tensor with attributes: _rebuild_from_type_v2(func, type, args, state)
                rebuild = (torch_global("torch._tensor", "_rebuild_from_type_v2"),
                           (rebuild[0], torch_global("torch", "Tensor"), args, o.py_state))
            if o.parameter:
                return (torch_global("torch._utils", "_rebuild_parameter"),
                        (_Rebuilt(rebuild), o.requires_grad, OrderedDict()))
            return rebuild
        if isinstance(o, _Rebuilt):
            return o.reduce
        if isinstance(o, NewTensor):
            storage = self._storage(id(o), o.dtype, SegmentedRecord(o.nbytes, o.segments))
            # a new stride tuple per tensor, as Tensor.stride() returns: a shared constant (1,) would
            # be memoized and written as a back-reference, bytes torch.save never writes
            stride = tuple([1])
            return (torch_global("torch._utils", "_rebuild_tensor_v2"),
                    (storage, 0, (o.numel,), stride, False, OrderedDict()))
        return super().reducer_override(o)

    def persistent_id(self, o: Any) -> Any:
        if isinstance(o, _Storage):
            numel = o.data.nbytes // ITEMSIZE[o.dtype]
            return ("storage", torch_global("torch", STORAGE_TYPE[o.dtype]), o.key, "cpu", numel)
        return None


class _Rebuilt:
    """A tensor's reduce value, pickled in place (the data argument of ``_rebuild_parameter``)."""

    def __init__(self, reduce: tuple[Any, ...]):
        self.reduce = reduce


def pickle_structure(obj: Any) -> tuple[bytes, list[tuple[str, RecordData]]]:
    """``data.pkl`` for ``obj`` as torch.save writes it, and its storage records in persistent-id order.

    ``obj`` holds plain Python values, the stand-ins of ``read_structure`` and ``NewTensor``s; a
    TensorRef's record is copied whole from the file it was read from.
    """
    buf = io.BytesIO()
    pickler = _StructurePickler(buf)
    pickler.dump(obj)
    records: list[tuple[str, RecordData]] = [(s.key, s.data) for s in pickler.storages.values()]
    return buf.getvalue(), records
