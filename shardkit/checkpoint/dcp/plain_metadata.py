"""A DCP ``.metadata`` file read without torch, as plain frozen dataclasses.

``dcp.safe_load.read_dcp_metadata`` rebuilds torch's own ``Metadata`` objects (for ``dcp.load``),
which needs ``import torch`` (1.2 s, 224 MB here) even where a converter only wants to know which
byte ranges of which ``.distcp`` file hold a tensor. ``read_plain_metadata`` reads the same pickle
through the same allow-list (the globals ``dcp.save`` writes, refused by name before anything is
called otherwise), but each torch class resolves to an inert local stand-in that only keeps its
pickled state; the result is then checked and copied into ``DcpMetadata``:

- ``tensors``: flattened key -> ``TensorMeta`` (dtype name, size, chunks as offsets/sizes);
- ``values``: the keys of non-tensor (``BytesStorageMetadata``) items;
- ``planner_data``: each key's path in the nested state dict;
- ``storage``: ``(key, chunk offsets)`` (``(key, None)`` for a value) -> ``StorageInfo``, what
  ``storage_data[MetadataIndex(key, offsets)]`` gives torch (``MetadataIndex`` compares by fqn
  and offset only, so the same lookup).

The stand-ins rebuild what ``dcp.save`` (torch 2.13) pickles, as ``convert/dcp_format.py`` writes
it: dataclasses as NEWOBJ + BUILD of their ``__dict__``, ``TensorProperties`` as BUILD of its
``__getstate__`` tuple (a dict from older writers is taken too), ``_MEM_FORMAT_ENCODING(0)`` and
``_get_layout("torch.strided")`` as REDUCE, dtypes and ``torch.Size`` as globals.
``tests/test_dcp_plain_metadata.py`` compares every field with torch's reader on real saves.
"""

from __future__ import annotations

import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardkit.core.errors import CheckpointError
from shardkit.core.files import open_regular
from shardkit.storage.torch_load import Dtype

METADATA_NAME = ".metadata"
"""The file that makes a folder a complete DCP checkpoint (``dcp.save`` writes it last, on rank 0)."""
_MD = "torch.distributed.checkpoint.metadata"
#: The allow-list, shared with ``safe_load`` (which resolves the same names to torch's classes).
METADATA_CLASSES = ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                    "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
PATH_CLASSES = ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path")
_STAND_IN_CLASSES = {(_MD, name) for name in METADATA_CLASSES if name != "_MEM_FORMAT_ENCODING"} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}
#: torch dtype names (``torch.float32`` pickles as ``GLOBAL torch float32``): kept as the name
_DTYPE_NAME = re.compile(r"^(float|bfloat|half|double|int|uint|long|short|complex|bool|qint|quint|bits)\w*$")


@dataclass(frozen=True)
class ChunkMeta:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class TensorMeta:
    dtype: str
    """torch's name without ``torch.``: ``float32``, ``bfloat16``..."""
    size: tuple[int, ...]
    chunks: tuple[ChunkMeta, ...]


@dataclass(frozen=True)
class StorageInfo:
    relative_path: str
    offset: int
    length: int
    transformed: bool
    """The item went through stream transforms (``transform_descriptors``): its bytes are not the zip."""


@dataclass(frozen=True)
class DcpMetadata:
    keys: tuple[str, ...]
    """Every item's flattened key, in ``state_dict_metadata``'s order."""
    tensors: dict[str, TensorMeta]
    values: frozenset[str]
    """Keys of the non-tensor items."""
    planner_data: dict[str, tuple[Any, ...]]
    storage: dict[tuple[str, tuple[int, ...] | None], StorageInfo]

    def storage_info(self, key: str, offsets: tuple[int, ...] | None) -> StorageInfo | None:
        return self.storage.get((key, offsets))


class _StandIn:
    """A torch class named in the pickle: NEWOBJ makes one, BUILD keeps its state, nothing runs."""

    module_name: tuple[str, str] = ("", "")
    state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _Reduced:
    """What a REDUCE of an allowed function gave: its name and arguments."""

    def __init__(self, name: str, args: tuple[Any, ...]):
        self.name, self.args = name, args


def _stand_in(module: str, name: str) -> type[_StandIn]:
    return type(name, (_StandIn,), {"module_name": (module, name)})


def _reducer(name: str) -> Any:
    return lambda *args: _Reduced(name, args)


class _Unpickler(pickle.Unpickler):
    def __init__(self, fh: Any, source: str):
        super().__init__(fh)
        self._source = source
        self._classes: dict[tuple[str, str], type[_StandIn]] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _STAND_IN_CLASSES:
            return self._classes.setdefault((module, name), _stand_in(module, name))
        if (module, name) == (_MD, "_MEM_FORMAT_ENCODING") or (module, name) == ("torch.serialization", "_get_layout"):
            return _reducer(name)
        if module == "torch" and name == "Size":
            return tuple
        if module == "torch" and _DTYPE_NAME.match(name):
            return Dtype(name)
        plain = plain_global(module, name)
        if plain is None:
            raise refused_global(self._source, module, name)
        return plain


def plain_global(module: str, name: str) -> Any | None:
    """The allowed globals that are not torch's (the same object for both unpicklers), else None: pathlib's
    paths (``StorageMeta.checkpoint_id``; a path is built from strings, no I/O) and ``OrderedDict`` (older
    writers)."""
    if module == "pathlib" and name in PATH_CLASSES:
        import pathlib

        return getattr(pathlib, name)
    if (module, name) == ("collections", "OrderedDict"):
        import collections

        return collections.OrderedDict
    return None


def refused_global(source: str, module: str, name: str) -> CheckpointError:
    return CheckpointError(
        f"{source}: refused to load: the DCP metadata pickle asks for global {module}.{name}, which real "
        "torch.distributed.checkpoint metadata never holds (it could run code). The checkpoint was tampered with "
        "or written by something else; resume from a checkpoint you trust, or load it with plain dcp.load only "
        "if you trust its source")


def unreadable(p: Path, exc: BaseException) -> CheckpointError:
    if isinstance(exc, FileNotFoundError):
        return CheckpointError(f"{p}: missing; a DCP checkpoint directory needs its .metadata file (the save did not "
                               "complete). Resume from another checkpoint")
    if isinstance(exc, (MemoryError, OverflowError, RecursionError)):
        return CheckpointError(f"{p}: cannot be read as DCP metadata ({type(exc).__name__}: a damaged length or "
                               "nesting field asks for more than the file holds); the file is truncated or corrupted. "
                               "Re-copy it from the machine that saved it (rank 0 writes it last), or resume from "
                               "another checkpoint")
    return CheckpointError(f"{p}: cannot be read as DCP metadata ({type(exc).__name__}: {exc}); the file is "
                           "truncated or corrupted. Resume from another checkpoint")


def not_metadata(p: Path, obj: Any) -> CheckpointError:
    return CheckpointError(f"{p}: holds a {type(obj).__name__}, not torch.distributed.checkpoint Metadata; not a DCP "
                           "checkpoint. Pass the folder save_fsdp_checkpoint (or dcp.save) wrote")


#: What a damaged ``.metadata`` raises while it is unpickled or checked. MemoryError and OverflowError:
#: a flipped bit in a length field makes the unpickler allocate that length before it reads (a byte-flip
#: sweep of a real 43 KB file asked for exabytes); RecursionError: a damaged nesting. The file is small,
#: so neither is a real shortage.
READ_ERRORS = (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, IndexError, KeyError, OSError,
               MemoryError, OverflowError, RecursionError)


def read_plain_metadata(path: str | os.PathLike[str]) -> DcpMetadata:
    """Read the DCP ``.metadata`` file ``path`` without torch (see the module doc). CheckpointError
    naming the file: the global, for anything outside the allow-list (nothing is called); what is
    wrong, for a missing, truncated or malformed file."""
    p = Path(path)
    try:
        with open_regular(p) as fh:
            raw = _Unpickler(fh, str(p)).load()
        return _convert(raw, p)
    except CheckpointError:
        raise
    except READ_ERRORS as exc:
        raise unreadable(p, exc) from None


def _is(obj: Any, name: str) -> bool:
    return isinstance(obj, _StandIn) and obj.module_name[1] == name


def _fields(obj: Any, name: str, where: str) -> dict[str, Any]:
    if not _is(obj, name) or not isinstance(obj.state, dict):
        raise ValueError(f"{where} is {type(obj).__name__}, expected a {name}")
    return obj.state


def _ints(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int and v >= 0 for v in value):
        raise ValueError(f"{where} is {value!r}, expected a tuple of sizes")
    return tuple(value)


def _convert(raw: Any, p: Path) -> DcpMetadata:
    if not _is(raw, "Metadata"):
        raise not_metadata(p, raw)
    md = _fields(raw, "Metadata", "the metadata")
    entries = md.get("state_dict_metadata")
    if not isinstance(entries, dict):
        raise ValueError("state_dict_metadata is not a dict")
    tensors: dict[str, TensorMeta] = {}
    values: set[str] = set()
    for key, entry in entries.items():
        if not isinstance(key, str):
            raise ValueError(f"state_dict_metadata key {key!r} is not a string")
        if _is(entry, "BytesStorageMetadata"):
            values.add(key)
            continue
        f = _fields(entry, "TensorStorageMetadata", key)
        props = f["properties"]
        if not _is(props, "TensorProperties"):
            raise ValueError(f"{key}: properties is {type(props).__name__}")
        state = props.state
        dtype = state[0] if isinstance(state, tuple) else state.get("dtype") if isinstance(state, dict) else None
        if not isinstance(dtype, Dtype):
            raise ValueError(f"{key}: dtype is {dtype!r}")
        chunks = tuple(ChunkMeta(_ints(c["offsets"], f"{key} chunk offsets"), _ints(c["sizes"], f"{key} chunk sizes"))
                       for c in (_fields(c, "ChunkStorageMetadata", key) for c in f["chunks"]))
        tensors[key] = TensorMeta(str(dtype), _ints(f["size"], f"{key} size"), chunks)
    planner = md.get("planner_data") or {}
    if not isinstance(planner, dict):
        raise ValueError("planner_data is not a dict")
    storage: dict[tuple[str, tuple[int, ...] | None], StorageInfo] = {}
    for index, info in (md.get("storage_data") or {}).items():
        ix = _fields(index, "MetadataIndex", "a storage_data key")
        fqn, offset = ix.get("fqn"), ix.get("offset")
        si = _fields(info, "_StorageInfo", f"storage_data[{fqn!r}]")
        rel, off, length = si.get("relative_path"), si.get("offset"), si.get("length")
        if not isinstance(fqn, str) or not isinstance(rel, str) or type(off) is not int or type(length) is not int:
            raise ValueError(f"storage_data[{fqn!r}] is {si!r}")
        key = (fqn, None if offset is None else _ints(offset, f"{fqn} index offset"))
        storage[key] = StorageInfo(rel, off, length, bool(si.get("transform_descriptors")))
    return DcpMetadata(tuple(entries), tensors, frozenset(values), {str(k): tuple(v) for k, v in planner.items()}, storage)
