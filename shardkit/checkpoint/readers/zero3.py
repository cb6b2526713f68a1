"""The ZeRO-3 reader: a ZeRO-3 checkpoint's tensors as ``Piece``s: where each rank's unpadded share of every parameter,
frozen parameter and buffer lies in the rank files.

The files are parsed with ``read_structure`` (no ``torch.load``, no tensor data read): trainable
parameters are the fp32 masters in each rank's ``fp32_flat_groups[sub_group]`` (the layout
``zero3.reader`` describes), frozen parameters each rank's ``frozen_param_fragments`` entry in its
model-states file (partitioned as trainable ones: ``ceil(numel / world)`` per rank, the tail
padded), buffers rank 0's ``module`` entries. Tied parameters are stored once and named in
``shared_params`` (``{alias: holder}``).

The optimizer state is described the same way: each trainable parameter's per-element states
(``exp_avg``, ``exp_avg_sq``: whatever the sub-groups' ``state`` holds at the flats' length) are
its unpadded pieces of every rank's ``state[sub_group][key]`` flat, at the parameter's offset
there, as for the master. The scalars (``readers.deepspeed_scalars``): ``step`` per parameter from
its sub-group, the param groups with their parameters' names, the optimizer facts of ds_config,
the loss scaler, scheduler, client state and counters of rank 0's files.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from shardkit.checkpoint.model.checkpoint import TrainingCheckpoint
from shardkit.checkpoint.model.tensors import Piece, SourceTensor
from shardkit.checkpoint.readers.deepspeed_scalars import loss_scaler, per_parameter_steps, run_scalars, step_value
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
    optimizer: dict[str, dict[str, SourceTensor]] = {slot.name: {} for slot in ckpt.slots}
    optim0: dict[str, Any] = {}
    for rank in range(ckpt.world_size):
        osd = _optimizer_dict(read_structure(ckpt.optim_files[rank]))
        optim0 = optim0 or osd
        flats = _optim_flats(ckpt, rank, osd)
        states = [_state_flats(ckpt, rank, osd, j) for j in range(len(ckpt.sub_group_numel))]
        for slot in ckpt.slots:
            start, stop = slot.rank_range(rank)
            if stop > start:
                ref = flats[slot.sub_group]
                tensors[slot.name].pieces.append(
                    Piece(ckpt.optim_files[rank], _offset(ref) + slot.offset * 4, start, stop - start))
            for key, ref in states[slot.sub_group].items():
                t = optimizer[slot.name].setdefault(key, SourceTensor(slot.name, ref.dtype, slot.shape))
                if t.dtype != ref.dtype:
                    raise CheckpointError(f"{ckpt.optim_files[rank]}: {key} of sub-group {slot.sub_group} is {ref.dtype}, "
                                          f"rank 0's is {t.dtype}; the rank files come from different saves")
                if stop > start:
                    t.pieces.append(Piece(ckpt.optim_files[rank], _offset(ref) + slot.offset * ref.itemsize, start,
                                          stop - start))
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
        optimizer={name: states for name, states in optimizer.items() if states}, optimizer_described=True,
        scalars=_scalars(ckpt, optim0),
        notes=[f"ZeRO-3 checkpoint {tag_dir} (tag {ckpt.tag!r}, saved by {ckpt.world_size} rank(s), {ckpt.precision} "
               "training): fp32 masters exported"])


def _scalars(ckpt: Zero3Checkpoint, optim0: dict[str, Any]) -> dict[str, Any]:
    """Steps per parameter (from its sub-group), param groups with their names, and the run's values."""
    state = (optim0.get("optimizer_state_dict") or {}).get("state") or {}
    steps = [step_value((state.get(j) or {}).get("step", 0), f"{ckpt.optim_files[0]}: sub-group {j}")
             for j in range(len(ckpt.sub_group_numel))]
    by_sub_group = [[s.name for s in ckpt.slots if s.sub_group == j] for j in range(len(ckpt.sub_group_numel))]
    groups = [{**g, "params": [s.name for s in ckpt.slots if s.param_group == i]}
              for i, g in enumerate(ckpt.param_groups)]
    out = run_scalars(ckpt.model_state, ckpt.ds_config, zero_stage=3, ds_version=ckpt.ds_version)
    out.update(step=per_parameter_steps(by_sub_group, steps), param_groups=groups)
    scaler = loss_scaler(optim0, ckpt.precision)
    if scaler is not None:
        out["loss_scaler"] = scaler
    return out


def _offset(ref: TensorRef) -> int:
    if ref.file_offset is None or not ref.is_contiguous():
        raise CheckpointError(f"{ref.path}: tensor {ref!r} is not stored contiguously; not a layout DeepSpeed writes")
    return ref.file_offset


def _optimizer_dict(sd: Any) -> dict[str, Any]:
    """The ``optimizer_state_dict`` of a rank's optim file ({} when absent: ``_optim_flats`` says what is wrong)."""
    osd = sd.get("optimizer_state_dict") if isinstance(sd, dict) else None
    return osd if isinstance(osd, dict) else {}


def _state_flats(ckpt: Zero3Checkpoint, rank: int, osd: dict[str, Any], sub_group: int) -> dict[str, TensorRef]:
    """Rank ``rank``'s per-element optimizer states of ``sub_group`` (the keys rank 0's layout found),
    each one contiguous run of the sub-group's length."""
    entry = ((osd.get("optimizer_state_dict") or {}).get("state") or {}).get(sub_group) or {}
    out = {}
    for key in ckpt.state_keys:
        ref = entry.get(key)
        if (not isinstance(ref, TensorRef) or ref.numel != ckpt.sub_group_numel[sub_group] or not ref.is_contiguous()
                or ref.file_offset is None):
            raise CheckpointError(
                f"{ckpt.optim_files[rank]}: {key} of sub-group {sub_group} is not one contiguous tensor of "
                f"{ckpt.sub_group_numel[sub_group]} elements ({ref!r}), as rank 0's layout says; the rank files come "
                "from different saves or the file is damaged")
        out[key] = ref
    return out


def _optim_flats(ckpt: Zero3Checkpoint, rank: int, osd: dict[str, Any]) -> list[TensorRef]:
    """Rank ``rank``'s fp32 flat partitions, checked against the layout read from rank 0."""
    path = ckpt.optim_files[rank]
    flats = osd.get("fp32_flat_groups")
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
