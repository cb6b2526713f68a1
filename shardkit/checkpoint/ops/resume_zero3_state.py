"""A resuming ZeRO-3 rank's two dicts at the engine's layout, as DeepSpeed's loaders take them: its
flat partitions (fp32 masters, per-element optimizer state, frozen fragments) read through the checkpoint
model (``readers.zero3``: each parameter's byte ranges, ``model.tensors.read_into``), around the run state of the
saved rank whose values it takes (``readers.zero3_run_state``: its own at the saved world size, rank 0's
at another).

Each new partition is the elements ``[r * p, (r + 1) * p)`` of every parameter it holds (``p = ceil(numel
/ world)``), wherever the saved ranks kept them, and zeros in the padding; only the byte ranges it
needs are read, straight into the partition (``repartition.read_partition``), so memory stays near
this rank's own partitions.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from shardkit.checkpoint.model.checkpoint import TrainingCheckpoint
from shardkit.checkpoint.readers.zero3_run_state import model_states, optim_states, saved_state
from shardkit.checkpoint.zero3.checkpoint import Zero3Checkpoint
from shardkit.checkpoint.zero3.repartition import (
    TargetLayout,
    new_model_dict,
    new_optimizer_state,
    optim_dict,
    read_fragment,
    read_partition,
)
from shardkit.core.errors import CheckpointError

if TYPE_CHECKING:
    import torch


def model_state_for_rank(ckpt: Zero3Checkpoint, model: TrainingCheckpoint, layout: TargetLayout,
                         rank: int) -> dict[str, Any]:
    """Rank ``rank``'s model_states dict at the new world size: the saved rank's (its own at the saved
    world size, so its client_state entries survive; rank 0's at another) with sizes and fragments updated."""
    import torch

    sd = model_states(ckpt, rank if layout.world_size == ckpt.world_size else 0)
    return new_model_dict(sd, layout, torch.Size, list(ckpt.frozen_param_shapes),
                          lambda name: read_fragment(model.weights[name], layout.world_size, rank))


def optim_state_for_rank(ckpt: Zero3Checkpoint, model: TrainingCheckpoint, layout: TargetLayout,
                         rank: int) -> dict[str, Any]:
    """Rank ``rank``'s optim_states dict at the new layout, its partitions read.

    The param groups and non-partition state (``step``, a custom optimizer's statistics) come from the
    saved rank's own file at the saved world size, rank 0's at another (``check_rank_values`` says what
    that loses). A non-partition tensor of several elements is refused unless the new sub-group is the
    saved one (it belongs to that partition).
    """
    import torch

    optim0 = optim_states(ckpt, rank if layout.world_size == ckpt.world_size else 0)

    def carry(j: int, first: int, k: str, v: Any) -> Any:
        if k in ckpt.state_keys:
            return read_partition(layout, rank, j, lambda name: model.tensor(name, k))
        if torch.is_tensor(v) and v.numel() > 1 and not _same_partition(ckpt, layout, j):
            raise CheckpointError(_unmappable_state_message(ckpt, layout, first, j, k, v))
        return copy.deepcopy(v)

    state = new_optimizer_state(saved_state(optim0), layout, carry)
    fp32 = [read_partition(layout, rank, j, lambda name: model.weights[name]) for j in range(len(layout.sub_groups))]
    return optim_dict(optim0, layout, state, fp32)


def _same_partition(ckpt: Zero3Checkpoint, layout: TargetLayout, j: int) -> bool:
    """Whether new sub-group ``j`` holds exactly the elements one saved sub-group held on the same
    rank (same world size, same parameters at the same offsets)."""
    params = layout.sub_groups[j]
    if layout.world_size != ckpt.world_size or not params:
        return False
    first = params[0].source.sub_group
    saved = [s for s in ckpt.slots if s.sub_group == first]
    return [tp.source for tp in params] == saved and all(tp.offset == tp.source.offset for tp in params)


def _unmappable_state_message(ckpt: Zero3Checkpoint, layout: TargetLayout, first: int, j: int, key: str,
                              value: "torch.Tensor") -> str:
    # A tensor that is neither a scalar nor partition-shaped (prodigy-plus-schedule-free keeps
    # ``p0``/``s`` as every 11th element of the partition) is sized for, and computed from, the
    # saved rank's partition: handed to another partition it is the wrong size for the optimizer's
    # next step, or silently the statistics of other elements. There is no rule to rebuild it.
    return (f"{ckpt.optim_files[0]}: optimizer state {key!r} of sub-group {first} is a tensor of shape "
            f"{tuple(value.shape)}, neither a scalar nor the partition's {ckpt.sub_group_numel[first]} elements, so it "
            f"belongs to the saved rank's partition (saved at world size {ckpt.world_size}) and cannot be carried to "
            f"sub-group {j} of the new layout (world size {layout.world_size}, {layout.sub_group_numel(j)} elements). "
            f"Resume at world size {ckpt.world_size} with the saved "
            "zero_optimization.sub_group_size, where every rank reads its own file")
