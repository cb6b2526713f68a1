"""FSDP2's per-rank ``torch.save`` files, read without torch: every ``DTensor`` value as the byte range of
its local shard, placed in the global tensor by the ``DTensorSpec`` it was pickled with.

FSDP2 (``fully_shard``) keeps each parameter as a DTensor sharded ``Shard(0)`` over a 1-D device mesh,
and its state dicts (``get_model_state_dict``/``get_optimizer_state_dict``, which accelerate's
``save_fsdp_model``/``save_fsdp_optimizer`` ``torch.save`` per rank under ``use_dcp=False``) hold those
DTensors as they are. torch 2.13 pickles one (``Tensor._reduce_ex_internal`` for a wrapper subclass) as
``_rebuild_from_type_v2(_rebuild_wrapper_subclass, DTensor, (DTensor, dtype, size, stride,
storage_offset, layout, device, requires_grad), (None, {"_local_tensor": ..., "_spec": ...}))``: the
local tensor is a plain tensor record, the ``DTensorSpec`` holds the ``DeviceMesh`` (its shape in
``_layout``, in a ``mesh`` tensor before torch 2.9, and this rank's ``_coordinate_on_dim``), one
placement per mesh dimension and ``tensor_meta`` (global shape, stride, dtype). Where the rank's rows
start is not recorded: ``Shard(0)`` splits as ``torch.chunk`` does (``Shard.local_shard_size_and_offset``),
``ceil(rows / mesh size)`` rows per coordinate, the last ones short or empty; the reader places them so
and checks each local tensor has that many rows.

Only that layout is read. A 2-D mesh (HSDP's ``(Replicate(), Shard(0))``, FSDP2 with tensor parallelism),
``Shard(d)`` for d > 0, ``_StridedShard``, ``Partial`` and ``Replicate`` are refused naming the tensor,
the file and the placement. Every global resolves to an inert local stand-in (the restricted-unpickler
recipe of ``storage.torch_load.read_structure``, whose allow-list this extends); anything else is refused
before it is called, so a hostile file runs nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardkit.checkpoint.readers.sharded_tensor_pickle import (
    LocalShard,
    ShardedRef,
    Wrapper,
    record_class,
    wrapper_globals,
)
from shardkit.core.errors import CheckpointError
from shardkit.storage.torch_load import TensorRef, _UnsupportedTensor, read_structure
from shardkit.storage.torch_load import _rebuild_from_type_v2 as _plain_from_type

_TENSOR_API = "torch.distributed.tensor"
_RESAVE = ("Load it with the same mesh and save again with fsdp_state_dict_type SHARDED_STATE_DICT and use_dcp=True "
           "(DCP folders, which shardkit reads for any mesh torch can load)")


@dataclass(frozen=True)
class DTensorRef:
    """A DTensor as one rank pickled it: the global tensor, this rank's local tensor and where it sits."""

    dtype: str
    shape: tuple[int, ...]
    """The global shape (the wrapper's size, as ``tensor_meta`` records it)."""
    local: TensorRef
    mesh_shape: tuple[int, ...]
    """The device mesh's shape (one entry per mesh dimension)."""
    coordinate: tuple[int, ...]
    """This rank's coordinate on the mesh (``DeviceMesh._coordinate_on_dim``)."""
    placements: tuple[Any, ...]
    """One placement stand-in per mesh dimension (``Shard``, ``Replicate``, ...)."""


_PLACEMENTS = {name: record_class(name) for name in ("Shard", "Replicate", "Partial", "_StridedShard")}
_MESH_RECORDS = {("device_mesh", "DeviceMesh"), ("_mesh_layout", "_MeshLayout"), ("_mesh_layout", "_FlatLayout")}
_SPEC_RECORDS = ("DTensorSpec", "TensorMeta", "ShardOrderEntry")


class _DTensorType:
    """``DTensor`` named in a pickle (the class argument of ``_rebuild_wrapper_subclass``)."""


def _mesh_shape(mesh: Any) -> tuple[int, ...]:
    layout = getattr(mesh, "_layout", None)
    if layout is not None:
        # torch >= 2.9: one _FlatLayout per mesh dimension, its size the product of its coalesced shape
        # (a size-1 dimension is coalesced to shape ())
        axes = getattr(layout, "axes", None)
        sizes = [getattr(axis, "shape", None) for axis in (axes if isinstance(axes, tuple) else (layout,))]
        return tuple(math.prod(s) if isinstance(s, tuple) else int(s or 1) for s in sizes)
    older = getattr(mesh, "mesh", None)  # before: the mesh's ranks as an int tensor of the mesh's shape
    return tuple(older.shape) if isinstance(older, TensorRef) else ()


def _from_type(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    if new_type is not _DTensorType:
        return _plain_from_type(func, new_type, args, state)
    wrapper = func(*args)
    attrs = state[1] if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict) else state
    local, spec = (attrs.get("_local_tensor"), attrs.get("_spec")) if isinstance(attrs, dict) else (None, None)
    if not isinstance(wrapper, Wrapper) or not isinstance(local, TensorRef) or spec is None:
        raise _UnsupportedTensor(f"a DTensor pickled as {args!r} with state {type(state).__name__} and local tensor "
                                 f"{type(local).__name__}, not what DTensor.__reduce_ex__ of torch 2.x writes")
    mesh = getattr(spec, "mesh", None)
    coordinate = getattr(mesh, "_coordinate_on_dim", None) or ()
    # the wrapper's size is the global shape (``tensor_meta`` records it again)
    return DTensorRef(wrapper.dtype, wrapper.size, local, _mesh_shape(mesh),
                      tuple(int(c) for c in coordinate), tuple(getattr(spec, "placements", None) or ()))


def _allowed() -> dict[tuple[str, str], Any]:
    allowed = wrapper_globals(_from_type)
    allowed[(_TENSOR_API, "DTensor")] = _DTensorType
    for name, record in _PLACEMENTS.items():
        allowed[(f"{_TENSOR_API}.placement_types", name)] = record
    for module, name in _MESH_RECORDS:
        allowed[(f"torch.distributed.{module}", name)] = record_class(name)
    for name in _SPEC_RECORDS:
        allowed[(f"{_TENSOR_API}._dtensor_spec", name)] = record_class(name)
    return allowed


def as_sharded(ref: DTensorRef, where: str, rank: int) -> ShardedRef:
    """``ref`` (``where``: the file and key it was read from, saved by ``rank``) as the shard of the global
    tensor FSDP2 gave that rank, or CheckpointError naming any layout other than Shard(0) on a 1-D mesh."""
    placements = ", ".join(map(repr, ref.placements)) or "none"
    if len(ref.mesh_shape) != 1 or len(ref.placements) != 1:
        raise CheckpointError(
            f"{where}: a DTensor on a {len(ref.mesh_shape)}-D device mesh of shape {list(ref.mesh_shape)} with "
            f"placements ({placements}): a mesh with more than one dimension (HSDP, or FSDP2 with tensor "
            "parallelism) splits tensors over several mesh dimensions, and shardkit reads FSDP2's per-rank files "
            f"for a 1-D mesh with Shard(0) only. {_RESAVE}. Nothing was written")
    [placement], [size] = ref.placements, ref.mesh_shape
    if type(placement).__name__ != "Shard" or getattr(placement, "dim", None) != 0:
        raise CheckpointError(
            f"{where}: a DTensor placed {placement!r} on its 1-D device mesh: shardkit reads FSDP2's per-rank files "
            "with Shard(0) (each rank a run of whole rows) only; "
            f"{'Shard on another dimension' if type(placement).__name__ == 'Shard' else type(placement).__name__} "
            f"is not FSDP2's parameter layout. {_RESAVE}. Nothing was written")
    if ref.coordinate != (rank,) or not ref.shape:
        raise CheckpointError(
            f"{where}: the DTensor sits at mesh coordinate {list(ref.coordinate)} with global shape {list(ref.shape)}, "
            f"in a file saved by rank {rank}: its 1-D mesh is not the ranks that saved (a sub-mesh of a larger world?). "
            f"{_RESAVE}. Nothing was written")
    rows, inner = ref.shape[0], ref.shape[1:]
    chunk = -(-rows // size) if size else 0
    start = min(rows, rank * chunk)
    count = min(rows, start + chunk) - start
    if tuple(ref.local.shape) != (count, *inner) or ref.local.dtype != ref.dtype:
        raise CheckpointError(
            f"{where}: rank {rank}'s local tensor is {ref.local.dtype}{list(ref.local.shape)}, where Shard(0) of the "
            f"global {ref.dtype}{list(ref.shape)} over {size} ranks gives it {ref.dtype}{[count, *inner]} (rows "
            f"{start}..{start + count}): the file is damaged. Restore it from a copy of the checkpoint")
    shard = LocalShard((start, *(0 for _ in inner)), (count, *inner), ref.local)
    return ShardedRef(ref.dtype, ref.shape, (shard,), size)


def _sharded_tree(obj: Any, path: Path, keys: tuple[str, ...], rank: int) -> Any:
    if isinstance(obj, DTensorRef):
        return as_sharded(obj, f"{path}: {'.'.join(keys)!r}", rank)
    if isinstance(obj, dict):
        return {k: _sharded_tree(v, path, (*keys, str(k)), rank) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_sharded_tree(v, path, (*keys, str(i)), rank) for i, v in enumerate(obj))
    return obj


def read_dtensor_file(path: Path, rank: int) -> Any:
    """The object rank ``rank``'s FSDP2 ``torch.save`` file ``path`` holds, every plain tensor a ``TensorRef``
    and every DTensor the ``ShardedRef`` of that rank's rows (no torch import, no tensor bytes read)."""
    obj = read_structure(path, allowed=_allowed(), what="FSDP2's per-rank state dict files")
    return _sharded_tree(obj, path, (), rank)
