"""FSDP1's per-rank ``torch.save`` files, read without torch: ``ShardedTensor`` values as their local
shards (byte ranges of the file) and the global metadata they were pickled with.

Under ``SHARDED_STATE_DICT`` FSDP1 returns ``ShardedTensor``s (``_state_dict_utils`` /
``_optim_utils`` through ``_ext_chunk_tensor``: a ``ChunkShardingSpec`` over dim 0), and
accelerate's ``use_dcp=False`` ``torch.save``\\s them as they are. torch 2.13 pickles one as
``_rebuild_from_type_v2(_rebuild_wrapper_subclass, ShardedTensor, (ShardedTensor, dtype, size,
stride, storage_offset, layout, device, requires_grad), state)`` where ``state`` is
``ShardedTensor.__getstate__``'s tuple ``(local_shards, metadata, ProcessGroupState,
sharding_spec, init_rrefs)``; each ``Shard`` holds its local tensor (a plain ``_rebuild_tensor_v2``
record) and a ``ShardMetadata`` (``shard_offsets``, ``shard_sizes``, ``placement``), the metadata
the global ``size`` and every rank's ``ShardMetadata``. torch's own load needs an initialised
process group of the same world size (``ShardedTensor.__setstate__``); this reader needs neither.

Every global resolves to an inert local stand-in (the restricted-unpickler recipe of
``storage.torch_load.read_structure``, whose allow-list it extends); anything else is refused before
it is called. ``getattr`` is allowed for ``ShardedTensor.ProcessGroupState`` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardkit.core.errors import CheckpointError
from shardkit.storage.torch_load import TensorRef, _UnsupportedTensor, read_structure, structure_globals
from shardkit.storage.torch_load import _rebuild_from_type_v2 as _plain_from_type

_SHARD_API = "torch.distributed._shard"


@dataclass(frozen=True)
class LocalShard:
    """One rank's shard of a ShardedTensor: where it sits in the global tensor and where its bytes are."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    tensor: TensorRef


@dataclass(frozen=True)
class ShardedRef:
    """A ShardedTensor as pickled by one rank: the global shape and dtype, and that rank's shards."""

    dtype: str
    shape: tuple[int, ...]
    local: tuple[LocalShard, ...]
    world_size: int | None
    """The process group's size when it was saved (``ProcessGroupState.global_world_size``)."""


class Record:
    """A pickled torch.distributed object, kept as its attributes; nothing of it runs (``dtensor_pickle``'s
    objects too). ``NEWOBJ`` passes the positional fields of a NamedTuple (``TensorMeta``) or a C++-backed
    placement; ``BUILD`` sets the attributes (a dict, or dataclass slots as ``(dict or None, slot dict)``)
    or, for a plain tuple (``TensorProperties.__getstate__``), the fields."""

    fields: tuple[Any, ...] = ()

    def __new__(cls, *args: Any) -> Any:
        obj = object.__new__(cls)
        obj.__dict__["fields"] = args
        return obj

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            vars(self).update(state)
        elif isinstance(state, tuple) and state and all(part is None or isinstance(part, dict) for part in state):
            for part in state:
                vars(self).update(part or {})
        else:
            self.fields = tuple(state) if isinstance(state, tuple) else (state,)

    def __repr__(self) -> str:
        # as torch shows a placement (``Shard(dim=1)``); plain values only, so a hostile file's nesting
        # cannot recurse here
        def plain(v: Any) -> str:
            return repr(v) if isinstance(v, (int, float, str, type(None))) else type(v).__name__

        shown = {k: v for k, v in vars(self).items() if k not in ("fields", "_hash")}
        inner = ", ".join([*map(plain, getattr(self, "fields", ())), *(f"{k}={plain(v)}" for k, v in shown.items())])
        return f"{type(self).__name__}({inner})"


def record_class(name: str) -> type[Record]:
    """A ``Record`` class named as the torch class it stands in for."""
    return type(name, (Record,), {})


class _ShardedTensorType:
    """``ShardedTensor`` named in a pickle (the class argument of ``_rebuild_wrapper_subclass``)."""

    ProcessGroupState = record_class("ProcessGroupState")


@dataclass(frozen=True)
class Wrapper:
    """``_rebuild_wrapper_subclass``'s result: the subclass's global dtype and size (ShardedTensor and DTensor
    pickles both name it: ``dtensor_pickle`` uses these too)."""

    dtype: str
    size: tuple[int, ...]


def rebuild_wrapper_subclass(cls: Any, dtype: Any, size: Any, stride: Any, storage_offset: Any, layout: Any,
                              device: Any, requires_grad: Any) -> Wrapper:
    return Wrapper(str(dtype), tuple(int(d) for d in size))


def wrapper_globals(from_type: Any) -> dict[tuple[str, str], Any]:
    """``structure_globals`` with what a tensor subclass's pickle names (ShardedTensor's, DTensor's): its
    ``_rebuild_from_type_v2`` (``from_type``), ``_rebuild_wrapper_subclass``, the layout and the device."""
    allowed = structure_globals()
    allowed.update({("torch._tensor", "_rebuild_from_type_v2"): from_type,
                    ("torch._utils", "_rebuild_wrapper_subclass"): rebuild_wrapper_subclass,
                    ("torch.serialization", "_get_layout"): str, ("torch", "device"): str})
    return allowed


def _from_type(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    if new_type is not _ShardedTensorType:
        return _plain_from_type(func, new_type, args, state)
    wrapper = func(*args)
    if not isinstance(wrapper, Wrapper) or not isinstance(state, tuple) or len(state) < 2:
        raise _UnsupportedTensor(f"a ShardedTensor pickled as {args!r} with state {type(state).__name__}, not what "
                                 "ShardedTensor.__getstate__ of torch 2.x writes")
    shards, meta = state[0], state[1]
    local = []
    for shard in shards:
        md, tensor = getattr(shard, "metadata", None), getattr(shard, "tensor", None)
        if not isinstance(tensor, TensorRef) or md is None:
            raise _UnsupportedTensor(f"a ShardedTensor's local shard holds {type(tensor).__name__}, not a tensor")
        local.append(LocalShard(tuple(md.shard_offsets), tuple(md.shard_sizes), tensor))
    size = tuple(int(d) for d in getattr(meta, "size", wrapper.size))
    world = getattr(state[2], "global_world_size", None) if len(state) > 2 else None
    return ShardedRef(wrapper.dtype, size, tuple(local), world if isinstance(world, int) else None)


def _only_process_group_state(obj: Any, name: str) -> Any:
    if obj is _ShardedTensorType and name == "ProcessGroupState":
        return _ShardedTensorType.ProcessGroupState
    raise CheckpointError(f"refused to load: the pickle calls getattr({obj!r}, {name!r}); only "
                          "ShardedTensor.ProcessGroupState is allowed (nothing from the file was run)")


def _mem_format(value: Any) -> int:
    return int(value)


def _allowed() -> dict[tuple[str, str], Any]:
    allowed = wrapper_globals(_from_type)
    allowed.update({
        (f"{_SHARD_API}.sharded_tensor.api", "ShardedTensor"): _ShardedTensorType,
        ("__builtin__", "getattr"): _only_process_group_state,
        ("builtins", "getattr"): _only_process_group_state,
        (f"{_SHARD_API}.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"): _mem_format,
    })
    for module, name in ((f"{_SHARD_API}.sharded_tensor.shard", "Shard"), (f"{_SHARD_API}.metadata", "ShardMetadata"),
                         ("torch.distributed.remote_device", "_remote_device"),
                         (f"{_SHARD_API}.sharded_tensor.metadata", "ShardedTensorMetadata"),
                         (f"{_SHARD_API}.sharded_tensor.metadata", "TensorProperties"),
                         (f"{_SHARD_API}.sharding_spec.chunk_sharding_spec", "ChunkShardingSpec")):
        allowed[(module, name)] = record_class(name)
    return allowed


def read_sharded_file(path: Path) -> Any:
    """The object a per-rank FSDP1 ``torch.save`` file holds, every plain tensor a ``TensorRef`` and
    every ShardedTensor a ``ShardedRef`` (no torch import, no tensor bytes read): ``read_structure``
    with the ShardedTensor stand-ins on its allow-list."""
    return read_structure(path, allowed=_allowed(), what="FSDP1's per-rank state dict files")
