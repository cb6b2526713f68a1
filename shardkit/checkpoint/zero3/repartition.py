"""A ZeRO-3 checkpoint's layout at another world size: the sub-groups as ZeRO-3 builds them at the new
size (``layout_of``, ``layout_from_names`` for a live engine's) and a new rank's optim-states dict around
rank 0's (``optim_dict``). Arithmetic on plain data: the partitions themselves are read through the
checkpoint model (``readers.zero3``) by the in-process resume (``ops.resume_zero3_state``), ``reshard``
and ``convert --to zero3`` (through the ZeRO-3 writers, each new rank's flat tensor as byte ranges of the
source plus zero padding); where a partition is wanted in memory (the resume, a writer's torch route),
``read_partition`` and ``read_fragment`` read it.
"""

from __future__ import annotations

import copy
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from shardkit.checkpoint.model.tensors import SourceTensor, read_into
from shardkit.checkpoint.zero3.checkpoint import ParamSlot, Zero3Checkpoint
from shardkit.checkpoint.zero3.layout import DEFAULT_SUB_GROUP_SIZE, client_state_keys, partition_numel, rank_range
from shardkit.config.paths import get
from shardkit.core.errors import CheckpointError, UsageError

if TYPE_CHECKING:
    import torch

#: The most data-parallel ranks a layout is planned for (the largest DeepSpeed jobs run ~10^4 ranks).
MAX_WORLD_SIZE = 1 << 17


@dataclass(frozen=True)
class TargetParam:
    """One parameter in the new layout: where it comes from and where it goes."""

    source: ParamSlot
    offset: int
    """Start of its partition in each new rank's sub-group flat tensor."""
    partition_numel: int
    """``ceil(numel / new_world_size)``."""

    def rank_range(self, rank: int) -> tuple[int, int]:
        """Elements ``[start, stop)`` of the flattened parameter that new rank ``rank`` holds."""
        return rank_range(rank, self.partition_numel, self.source.numel)


@dataclass
class TargetLayout:
    """Sub-groups and partition offsets a ZeRO-3 run at ``world_size`` ranks uses."""

    world_size: int
    sub_groups: list[list[TargetParam]]
    sub_group_param_group: list[int]

    def sub_group_numel(self, sub_group: int) -> int:
        return sum(p.partition_numel for p in self.sub_groups[sub_group])


def plan_layout(ckpt: Zero3Checkpoint, world_size: int, sub_group_size: int | None = None) -> TargetLayout:
    """The layout DeepSpeed builds at ``world_size`` for the checkpoint's parameters, in their order."""
    return layout_of(ckpt.slots, world_size, sub_group_size, ckpt.ds_config, ckpt.tag_dir)


def layout_of(slots: list[ParamSlot], world_size: int, sub_group_size: int | None, ds_config: dict[str, Any],
              where: Path) -> TargetLayout:
    """The layout DeepSpeed builds at ``world_size`` for ``slots`` (the parameters in their order);
    ``sub_group_size`` None: the one ``ds_config`` (saved in ``where``) sets."""
    if world_size < 1:
        raise UsageError(f"world_size {world_size}: must be at least 1 (the number of data-parallel ranks)")
    elements = sum(slot.numel for slot in slots)
    if world_size > MAX_WORLD_SIZE or world_size > elements:
        # two files per rank: a typo (an extra zero or two) would fill the disk with files that
        # hold nothing but padding
        raise UsageError(f"world_size {world_size:,}: more ranks than "
                         + (f"shardkit writes ({MAX_WORLD_SIZE:,}, two files each)" if world_size > MAX_WORLD_SIZE else
                            f"the checkpoint's {elements:,} trainable elements (every extra rank would hold only "
                            "padding)") + "; pass the data-parallel world size of the resuming run")
    if sub_group_size is None:
        sub_group_size = saved_sub_group_size(ds_config, where)
    by_group: dict[int, list[ParamSlot]] = {}
    for slot in slots:
        by_group.setdefault(slot.param_group, []).append(slot)
    groups: list[list[ParamSlot]] = []
    owners: list[int] = []
    for g in sorted(by_group):
        for sub in _split_sub_groups(by_group[g], world_size, sub_group_size):
            groups.append(sub)
            owners.append(g)
    return _assign_offsets(groups, owners, world_size)


def saved_sub_group_size(ds_config: dict[str, Any], where: Path) -> int:
    """``zero_optimization.sub_group_size`` of the config saved in ``where``, as DeepSpeed read it."""
    value = get(ds_config, "zero_optimization.sub_group_size", DEFAULT_SUB_GROUP_SIZE)
    if value == "auto":
        # DeepSpeed's config base drops "auto" keys, so the run that saved used the default
        warnings.warn(f"{where}: the saved zero_optimization.sub_group_size is 'auto', which DeepSpeed "
                      f"treats as its default {DEFAULT_SUB_GROUP_SIZE:.0e}; using that. Pass --sub-group-size N "
                      "if the resuming run sets another value", stacklevel=4)
        return DEFAULT_SUB_GROUP_SIZE
    try:
        size = int(value)
    except (TypeError, ValueError):
        size = 0
    if size < 1 or (isinstance(value, float) and value != size):
        raise UsageError(f"{where}: the saved zero_optimization.sub_group_size is {value!r}, not a positive "
                         "integer; pass the resuming run's value with --sub-group-size N (DeepSpeed's default is 1e9)")
    return size


def _split_sub_groups(params: list[ParamSlot], world_size: int, sub_group_size: int) -> list[list[ParamSlot]]:
    # Mirrors DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups (0.19.8) on partition numels.
    total = sum(partition_numel(p.numel, world_size) for p in params)
    if sub_group_size is None or sub_group_size >= total:
        return [params]
    out, cur, size = [], [], 0
    for i, p in enumerate(params):
        cur.append(p)
        size += partition_numel(p.numel, world_size)
        if size >= sub_group_size or i == len(params) - 1:
            out.append(cur)
            cur, size = [], 0
    return out


def _assign_offsets(groups: list[list[ParamSlot]], owners: list[int], world_size: int) -> TargetLayout:
    sub_groups = []
    for params in groups:
        offset, placed = 0, []
        for slot in params:
            pn = partition_numel(slot.numel, world_size)
            placed.append(TargetParam(slot, offset, pn))
            offset += pn
        sub_groups.append(placed)
    return TargetLayout(world_size, sub_groups, owners)


def layout_from_names(ckpt: Zero3Checkpoint, world_size: int, sub_groups: list[list[str]], owners: list[int]) -> TargetLayout:
    """A layout given as parameter names per sub-group (a live engine's), checked against the checkpoint."""
    by_name = {s.name: s for s in ckpt.slots}
    missing = [n for names in sub_groups for n in names if n not in by_name]
    wanted = {n for names in sub_groups for n in names}
    unused = [s.name for s in ckpt.slots if s.name not in wanted]
    if missing or unused:
        raise CheckpointError(
            f"{ckpt.tag_dir}: the model's trainable parameters do not match the checkpoint's: "
            f"not in the checkpoint {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"in the checkpoint but not trained by this engine {unused[:5]}{'...' if len(unused) > 5 else ''}. "
            "Build the same model (same requires_grad flags) as the run that saved it."
        )
    groups = [[by_name[n] for n in names] for names in sub_groups]
    return _assign_offsets(groups, owners, world_size)


def client_state_note(model_state: dict[str, Any], saved_world_size: int, world_size: int) -> str | None:
    """Say where client_state comes from when ranks cannot keep their own (another world size)."""
    keys = client_state_keys(model_state)
    if world_size == saved_world_size or not keys:
        return None
    return (f"client_state {keys} comes from rank 0's file for every one of the {world_size} rank(s) (saved at "
            f"{saved_world_size}: there is no one-to-one mapping of ranks); per-rank values (data-loader "
            "positions, RNG) must be rebuilt by the training script")


def new_model_dict(saved: dict[str, Any], layout: TargetLayout, size: Callable[[tuple[int, ...]], Any],
                   frozen: list[str], fragment: Callable[[str], Any]) -> dict[str, Any]:
    """A new rank's model-states dict: the saved rank's at the new world size, shapes made by ``size`` (the resume's
    torch.Size, the torch-free writer's stand-in), ``fragment(name)`` for each ``frozen`` parameter."""
    sd = dict(saved)
    sd["dp_world_size"] = layout.world_size
    sd["param_shapes"] = [OrderedDict((tp.source.name, size(tp.source.shape)) for tp in params)
                          for params in layout.sub_groups]
    if frozen:
        sd["frozen_param_fragments"] = OrderedDict((name, fragment(name)) for name in frozen)
    return sd


def new_optimizer_state(saved: dict[int, dict[str, Any]], layout: TargetLayout,
                        carry: Callable[[int, int, str, Any], Any]) -> dict[int, dict[str, Any]]:
    """The inner optimizer's ``state`` at the new layout: sub-group ``j`` takes saved sub-group ``first``'s entry (that
    of its first parameter: ``step``), each value as ``carry(j, first, key, value)`` makes it (a new partition)."""
    state: dict[int, dict[str, Any]] = {}
    for j, params in enumerate(layout.sub_groups):
        first = params[0].source.sub_group if params else 0
        entry = saved.get(first)
        if entry is not None:
            state[j] = {k: carry(j, first, k, v) for k, v in entry.items()}
    return state


def optim_dict(optim0: dict[str, Any], layout: TargetLayout, state: dict[int, dict[str, Any]],
               fp32: list[Any]) -> dict[str, Any]:
    """A new rank's optim_states dict: rank 0's with the new ``state`` and fp32 partitions, param
    groups indexing the new sub-groups, ``partition_count`` the new world size (the in-process resume and
    the torch-free ``writers.zero3_same_run`` both build theirs here)."""
    src = optim0["optimizer_state_dict"]
    param_groups = []
    for g, group in enumerate(src["optimizer_state_dict"].get("param_groups") or [{}]):
        new_group = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
        new_group["params"] = [j for j, owner in enumerate(layout.sub_group_param_group) if owner == g]
        param_groups.append(new_group)
    osd: dict[str, Any] = {}
    for k, v in src.items():
        if k == "optimizer_state_dict":
            osd[k] = {"state": state, "param_groups": param_groups}
        elif k == "fp32_flat_groups":
            osd[k] = fp32
        elif k == "partition_count":
            osd[k] = layout.world_size
        elif k == "ds_zero_partition_groups":
            continue  # AutoEP placement metadata is topology-specific
        else:
            osd[k] = v
    out = {k: v for k, v in optim0.items() if k != "optimizer_state_dict"}
    return {"optimizer_state_dict": osd, **out}


def read_partition(layout: TargetLayout, rank: int, sub_group: int, tensor: Callable[[str], SourceTensor],
                   dtype: "torch.dtype | None" = None) -> "torch.Tensor":
    """New rank ``rank``'s flat tensor of ``sub_group``: each parameter's elements of ``tensor(name)`` (its masters
    or one optimizer state) at its offset, the padding zeroed; in ``dtype``, else the first parameter's saved one."""
    import torch

    params = layout.sub_groups[sub_group]
    sources = [tensor(tp.source.name) for tp in params]
    if dtype is None:
        dtype = getattr(torch, sources[0].dtype) if sources else torch.float32
    # empty, not zeros: every element is read below or is padding zeroed here (zero-filling gigabytes
    # first costs a page-faulting pass of its own)
    out = torch.empty(layout.sub_group_numel(sub_group), dtype=dtype)
    for tp, source in zip(params, sources):
        lo, hi = tp.rank_range(rank)
        read_into(source, lo, out.narrow(0, tp.offset, hi - lo))
        out.narrow(0, tp.offset + hi - lo, tp.partition_numel - (hi - lo)).zero_()
    return out


def read_fragment(t: SourceTensor, world_size: int, rank: int, dtype: "torch.dtype | None" = None) -> "torch.Tensor":
    """Rank ``rank``'s ZeRO-3 fragment of the frozen parameter ``t`` at ``world_size`` ranks (``ceil(numel /
    world_size)`` elements, the last rank's tail zero), in ``dtype``, else its saved one."""
    import torch

    pn = partition_numel(t.numel, world_size)
    out = torch.zeros(pn, dtype=dtype or getattr(torch, t.dtype))
    start, stop = rank_range(rank, pn, t.numel)
    read_into(t, start, out.narrow(0, 0, stop - start))
    return out
