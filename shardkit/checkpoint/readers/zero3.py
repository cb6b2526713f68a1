"""The ZeRO-3 reader: a ZeRO-3 checkpoint's tensors as ``Piece``s: where each rank's unpadded share of every parameter,
frozen parameter and buffer lies in the rank files.

The files are parsed with ``read_structure`` (no ``torch.load``, no tensor data read): trainable
parameters are the fp32 masters in each rank's ``fp32_flat_groups[sub_group]`` (the layout
``zero3.reader`` describes), frozen parameters each rank's ``frozen_param_fragments`` entry in its
model-states file (partitioned as trainable ones: ``ceil(numel / world)`` per rank, the tail
padded), buffers rank 0's ``module`` entries. Tied parameters are stored once and named in
``shared_params`` (``{alias: holder}``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from shardkit.checkpoint.model.checkpoint import TrainingCheckpoint
from shardkit.checkpoint.model.tensors import Piece, SourceTensor
from shardkit.checkpoint.zero3.checkpoint import Zero3Checkpoint
from shardkit.checkpoint.zero3.layout import partition_numel, rank_range
from shardkit.checkpoint.zero3.reader import open_zero3_checkpoint
from shardkit.core.errors import CheckpointError
from shardkit.storage.torch_load import TensorRef, read_structure

#: File names DeepSpeed MoE writes beside the ZeRO files (``expp_rank_*``, ``layer_*_expert_*``):
#: expert-parallel weights that the data-parallel rank files do not hold.
_MOE_MARKERS = ("expp_rank_", "_expert_")


def read_zero3(tag_dir: Path) -> TrainingCheckpoint:
    """Describe the weights of the ZeRO-3 tag folder ``tag_dir`` (already verified by the caller)."""
    moe = sorted(f.name for f in tag_dir.iterdir() if any(m in f.name for m in _MOE_MARKERS))
    if moe:
        raise CheckpointError(
            f"{tag_dir}: holds DeepSpeed MoE expert files ({', '.join(moe[:3])}): expert-parallel weights live outside "
            "the data-parallel rank files this export reads, so the exported model would lack its experts. Export "
            "it with DeepSpeed's own tools (ds_to_universal) instead")
    ckpt = open_zero3_checkpoint(tag_dir, torch_free=True)
    tensors: dict[str, SourceTensor] = {}
    for slot in ckpt.slots:
        tensors[slot.name] = SourceTensor(slot.name, "float32", slot.shape)
    for rank in range(ckpt.world_size):
        flats = _optim_flats(ckpt, rank)
        for slot in ckpt.slots:
            start, stop = slot.rank_range(rank)
            if stop > start:
                ref = flats[slot.sub_group]
                tensors[slot.name].pieces.append(
                    Piece(ckpt.optim_files[rank], _offset(ref) + slot.offset * 4, start, stop - start))
    _add_frozen(ckpt, tensors)
    module = ckpt.model_state.get("module") or {}
    buffers = set()
    for name in ckpt.model_state.get("buffer_names") or []:
        buf = module.get(name)
        if isinstance(buf, TensorRef):
            tensors[name] = SourceTensor(name, buf.dtype, buf.shape, [Piece(ckpt.model_files[0], _offset(buf), 0, buf.numel)])
            buffers.add(name)
    return TrainingCheckpoint(
        "zero3", tag_dir, tensors, world_size=ckpt.world_size, tag=ckpt.tag, precision=ckpt.precision,
        aliases=dict(ckpt.shared_params), frozen=set(ckpt.frozen_param_shapes or {}), buffers=buffers,
        notes=[f"ZeRO-3 checkpoint {tag_dir} (tag {ckpt.tag!r}, saved by {ckpt.world_size} rank(s), {ckpt.precision} "
               "training): fp32 masters exported"])


def _offset(ref: TensorRef) -> int:
    if ref.file_offset is None or not ref.is_contiguous():
        raise CheckpointError(f"{ref.path}: tensor {ref!r} is not stored contiguously; not a layout DeepSpeed writes")
    return ref.file_offset


def _optim_flats(ckpt: Zero3Checkpoint, rank: int) -> list[TensorRef]:
    """Rank ``rank``'s fp32 flat partitions, checked against the layout read from rank 0."""
    path = ckpt.optim_files[rank]
    osd: Any = read_structure(path)
    flats = (osd.get("optimizer_state_dict") or {}).get("fp32_flat_groups") if isinstance(osd, dict) else None
    if not isinstance(flats, list) or len(flats) != len(ckpt.sub_group_numel):
        raise CheckpointError(f"{path}: has no fp32_flat_groups with {len(ckpt.sub_group_numel)} sub-groups, as rank 0's "
                              "files say; the rank files come from different saves")
    for j, ref in enumerate(flats):
        if not isinstance(ref, TensorRef) or ref.dtype != "float32" or ref.numel != ckpt.sub_group_numel[j]:
            raise CheckpointError(
                f"{path}: fp32 partition of sub-group {j} is {getattr(ref, 'dtype', type(ref).__name__)}"
                f"[{getattr(ref, 'numel', '?')}], expected float32[{ckpt.sub_group_numel[j]}] from rank 0's layout; "
                "the rank files come from different saves or the file is damaged")
    return flats


def _add_frozen(ckpt: Zero3Checkpoint, tensors: dict[str, SourceTensor]) -> None:
    """Frozen parameters: each rank's fragment (padded like a trainable partition) in its model file."""
    shapes = ckpt.frozen_param_shapes
    if not shapes:
        return
    for name, shape in shapes.items():
        tensors[name] = SourceTensor(name, "", shape)
    for rank in range(ckpt.world_size):
        state = ckpt.model_state if rank == 0 else read_structure(ckpt.model_files[rank])
        frags = state.get("frozen_param_fragments") or {} if isinstance(state, dict) else {}
        for name, shape in shapes.items():
            numel = math.prod(shape)
            start, stop = rank_range(rank, partition_numel(numel, ckpt.world_size), numel)
            ref = frags.get(name)
            if not isinstance(ref, TensorRef) or ref.numel < stop - start:
                raise CheckpointError(
                    f"{ckpt.model_files[rank]}: frozen parameter {name!r} has no fragment of {stop - start} elements "
                    "(frozen_param_fragments); the rank file is damaged or from another save")
            t = tensors[name]
            if t.dtype and t.dtype != ref.dtype:
                raise CheckpointError(f"{ckpt.model_files[rank]}: frozen parameter {name!r} is {ref.dtype} here but "
                                      f"{t.dtype} on rank 0; the rank files come from different saves")
            t.dtype = ref.dtype
            if stop > start:
                t.pieces.append(Piece(ckpt.model_files[rank], _offset(ref), start, stop - start))
