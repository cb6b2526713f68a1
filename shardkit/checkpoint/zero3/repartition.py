"""A ZeRO-3 checkpoint's state at another world size, built rank by rank: the target layout
(sub-groups as ZeRO-3 builds them at the new size), each new rank's flat partitions, model-states
and optimizer-states dicts. The in-process ``resume`` loads them; ``reshard`` and ``convert --to zero3``
take the layout (``layout_of``) and write the files through the ZeRO-3 writers (``writers.zero3``,
``writers.zero3_same_run``), each new rank's flat tensor as byte ranges of the source plus zero padding.
"""

from __future__ import annotations

import copy
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from shardkit.checkpoint.zero3.checkpoint import FP32, ParamSlot, Zero3Checkpoint
from shardkit.checkpoint.zero3.gather import full_frozen_params
from shardkit.checkpoint.zero3.layout import (
    DEFAULT_SUB_GROUP_SIZE,
    client_state_keys,
    partition_numel,
    rank_range,
)
from shardkit.config.paths import get
from shardkit.core.errors import CheckpointError, UsageError
from shardkit.storage.stream import LazyTensor
from shardkit.storage.torch_load import safe_torch_load

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


def build_partition(
    ckpt: Zero3Checkpoint, layout: TargetLayout, rank: int, sub_group: int, key: str, dtype: "torch.dtype | None" = None
) -> "torch.Tensor":
    """New rank ``rank``'s flat ``key`` tensor of ``sub_group`` (fp32 masters or a moment), padding zeroed.

    Source rank files are mapped one at a time and only the ranges this partition needs are read.
    """
    import torch

    params = layout.sub_groups[sub_group]
    numel = layout.sub_group_numel(sub_group)
    if dtype is None:
        with ckpt.open_rank(0) as part:
            dtype = part.flat(key, params[0].source.sub_group).dtype if params else torch.float32
    # empty, not zeros: every element is either copied below or padding zeroed here, and
    # zero-filling gigabytes first costs a page-faulting pass of its own
    out = torch.empty(numel, dtype=dtype)
    for tp in params:
        lo, hi = tp.rank_range(rank)
        out.narrow(0, tp.offset + (hi - lo), tp.partition_numel - (hi - lo)).zero_()
    for src_rank in range(ckpt.world_size):
        pieces = []
        for tp in params:
            lo, hi = tp.rank_range(rank)
            s_lo, s_hi = tp.source.rank_range(src_rank)
            a, b = max(lo, s_lo), min(hi, s_hi)
            if b > a:
                pieces.append((tp, a, b, lo, s_lo))
        if not pieces:
            continue
        with ckpt.open_rank(src_rank) as part:
            for tp, a, b, lo, s_lo in pieces:
                part.read_into(key, tp.source.sub_group, tp.source.offset + (a - s_lo), out.narrow(0, tp.offset + (a - lo), b - a))
    return out


def repartition_frozen(full: "torch.Tensor", world_size: int, rank: int) -> "torch.Tensor":
    """Rank ``rank``'s ZeRO-3 fragment of a whole (frozen) parameter at ``world_size`` ranks."""
    import torch

    flat = full.reshape(-1)
    pn = partition_numel(flat.numel(), world_size)
    out = torch.zeros(pn, dtype=flat.dtype)
    start, stop = rank_range(rank, pn, flat.numel())
    out[: stop - start].copy_(flat[start:stop])
    return out


def model_state_for_rank(
    ckpt: Zero3Checkpoint, layout: TargetLayout, rank: int, frozen: dict[str, "torch.Tensor"] | None = None
) -> dict[str, Any]:
    """Rank ``rank``'s model_states dict at the new world size (rank 0's, with sizes and fragments updated)."""
    import torch

    if layout.world_size == ckpt.world_size and rank > 0:
        # the same partitioning: this rank's own file, so its own client_state entries survive
        sd = dict(safe_torch_load(ckpt.model_files[rank], mmap=True, real_deepspeed_objects=True))
    else:
        sd = dict(ckpt.model_state)
    sd["dp_world_size"] = layout.world_size
    sd["param_shapes"] = [
        OrderedDict((tp.source.name, torch.Size(tp.source.shape)) for tp in params) for params in layout.sub_groups
    ]
    if frozen is None:
        frozen = full_frozen_params(ckpt)
    if frozen:
        sd["frozen_param_fragments"] = OrderedDict(
            (name, repartition_frozen(t, layout.world_size, rank)) for name, t in frozen.items()
        )
    return sd


def client_state_note(model_state: dict[str, Any], saved_world_size: int, world_size: int) -> str | None:
    """Say where client_state comes from when ranks cannot keep their own (another world size)."""
    keys = client_state_keys(model_state)
    if world_size == saved_world_size or not keys:
        return None
    return (f"client_state {keys} comes from rank 0's file for every one of the {world_size} rank(s) (saved at "
            f"{saved_world_size}: there is no one-to-one mapping of ranks); per-rank values (data-loader "
            "positions, RNG) must be rebuilt by the training script")


def optim_state_for_rank(ckpt: Zero3Checkpoint, layout: TargetLayout, rank: int, optim0: dict[str, Any]) -> dict[str, Any]:
    """Rank ``rank``'s optim_states dict with lazy tensors (produced when written or materialized).

    ``optim0`` is the loaded optim file whose param groups and non-partition state (``step``, a
    custom optimizer's statistics) the rank takes: its own file at the saved world size, rank 0's at
    another (``check_rank_values`` says what that loses). A non-partition tensor of several elements
    is refused unless the new sub-group is the saved one (it belongs to that partition).
    """
    import torch

    src = optim0["optimizer_state_dict"]
    src_inner = src["optimizer_state_dict"]
    src_state = src_inner.get("state") or {}
    state: dict[int, dict[str, Any]] = {}
    for j, params in enumerate(layout.sub_groups):
        first = params[0].source.sub_group if params else 0
        entry = src_state.get(first)
        if entry is None:
            continue  # the optimizer never stepped: no state to carry
        new_entry: dict[str, Any] = {}
        for k, v in entry.items():
            if k in ckpt.state_keys:
                new_entry[k] = LazyTensor(layout.sub_group_numel(j), v.dtype, _producer(ckpt, layout, rank, j, k, v.dtype))
            else:
                if torch.is_tensor(v) and v.numel() > 1 and not _same_partition(ckpt, layout, j):
                    raise CheckpointError(_unmappable_state_message(ckpt, layout, first, j, k, v))
                new_entry[k] = copy.deepcopy(v)
        state[j] = new_entry
    fp32 = [
        LazyTensor(layout.sub_group_numel(j), torch.float32, _producer(ckpt, layout, rank, j, FP32, torch.float32))
        for j in range(len(layout.sub_groups))
    ]
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


def optim_dict(optim0: dict[str, Any], layout: TargetLayout, state: dict[int, dict[str, Any]],
               fp32: list[Any]) -> dict[str, Any]:
    """A new rank's optim_states dict: rank 0's with the new ``state`` and fp32 partitions, param
    groups indexing the new sub-groups, ``partition_count`` the new world size (the torch path and
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


def _producer(ckpt: Zero3Checkpoint, layout: TargetLayout, rank: int, j: int, key: str, dtype: "torch.dtype") -> Callable[[], "torch.Tensor"]:
    return lambda: build_partition(ckpt, layout, rank, j, key, dtype)
