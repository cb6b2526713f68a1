"""Reading the ZeRO-3 source of ``convert_zero3_to_dcp``: what its file names refuse (tensor-parallel
and MoE checkpoints, before anything is unpickled), and its tensors as the lazy state dict
``dcp.save`` is handed (``state_template``): meta tensors where the data is big, and in their place
``_ShapedLazyTensor``s whose records are the parameters' byte ranges in the rank optim files
(``_segments``, padding left out), or, where a rank file's byte offsets are unknown, the tensor
gathered rank by rank (``_gather``). The write module copies those byte ranges into the output.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, SupportsIndex

from shardkit.checkpoint.ops.convert.names import (
    ADAM_STATE_KEYS,
    MODEL_KEY,
    OPTIM_KEY,
    Uncarried,
    dcp_model_key,
    dcp_optim_key,
)
from shardkit.checkpoint.ops.convert.zero3_to_dcp_plan import DcpTarget
from shardkit.checkpoint.zero3.checkpoint import FP32, ParamSlot, RankPartitions, Zero3Checkpoint
from shardkit.checkpoint.zero3.file_offsets import FileOffsets
from shardkit.checkpoint.zero3.layout import partition_numel, rank_range
from shardkit.storage.stream import LazyTensor, Segment
from shardkit.storage.torch_load import safe_torch_load

if TYPE_CHECKING:
    import torch


def layout_refusals(tag_dir: Path) -> list[Uncarried]:
    """Tensor-parallel and MoE checkpoints, told apart by their file names (nothing unpickled yet)."""
    names = sorted(f.name for f in tag_dir.iterdir())
    out = []
    tp = [n for n in names if "_mp_rank_" in n and "_mp_rank_00_" not in n]
    if tp:
        out.append(Uncarried("mp_world_size", f"files {tp[:3]}", "this is a tensor/model-parallel checkpoint (mp_rank "
                             "> 0 files): its partitions are split along model dimensions, which neither FSDP2 "
                             "resume nor this converter reassembles", "convert it with DeepSpeed's ds_to_universal "
                             "first, or save from a data-parallel-only run", refused=True))
    moe = [n for n in names if n.startswith("expp_rank_") or ("_expert_" in n and n.endswith("_model_states.pt"))]
    if moe:
        out.append(Uncarried("moe.experts", f"files {moe[:3]}", "MoE expert parameters and their optimizer state are "
                             "saved per expert outside the ZeRO-3 partitions and are not converted", "load the "
                             "checkpoint with DeepSpeed (same world size), or use shardkit reshard for the "
                             "ZeRO-3 part", refused=True))
    return out


def _gather(parts: list[RankPartitions], slot: ParamSlot, key: str) -> "torch.Tensor":
    """The full, unpadded ``key`` tensor of ``slot``, read rank by rank straight into the output
    (the fallback when a rank file's byte offsets are unknown)."""
    import torch

    out = torch.empty(slot.numel, dtype=parts[0].flat(key, slot.sub_group).dtype)
    for part in parts:
        start, stop = slot.rank_range(part.rank)
        if stop > start:
            part.read_into(key, slot.sub_group, slot.offset, out.narrow(0, start, stop - start))
    return out.view(slot.shape)


def _segments(parts: list[RankPartitions], slot: ParamSlot, key: str) -> list[Segment] | None:
    """``slot``'s ``key`` tensor as byte ranges of the rank files, in element order and without
    the zero padding (each rank's piece is contiguous in its flat partition), or None when a
    rank file's data offset is unknown."""
    dtype = parts[0].flat(key, slot.sub_group).dtype
    segments = []
    for part in parts:
        start, stop = slot.rank_range(part.rank)
        if stop <= start:
            continue
        at = part.byte_offset(slot, key)
        if at is None or part.flat(key, slot.sub_group).dtype != dtype:
            return None
        segments.append(Segment(str(part.path), at, (stop - start) * dtype.itemsize))
    return segments


class _ShapedLazyTensor(LazyTensor):
    """A LazyTensor pickled with its real shape and contiguous strides: DCP's reader (and
    dcp.slices) check that each stored item rebuilds a tensor of the item's shape."""

    def __init__(self, shape: tuple[int, ...], dtype: "torch.dtype", produce: Callable[[], "torch.Tensor"],
                 segments: list[Segment] | None):
        super().__init__(math.prod(shape), dtype, produce, (lambda: segments) if segments is not None else None)
        self.shape = tuple(shape)

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        import torch

        stride, acc = [], 1
        for d in reversed(self.shape):
            stride.append(acc)
            acc *= d
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, 0, self.shape, tuple(reversed(stride)), False, OrderedDict()))


def _frozen_producer(fragments: list[dict[str, Any]], name: str, shape: tuple[int, ...]) -> Callable[[], Any]:
    """The whole frozen parameter built from every rank's fragment (the fallback when a rank
    file's byte offsets are unknown): copied piece by piece into one tensor, never concatenated
    and then cut (which held it twice)."""
    def make() -> Any:
        import torch

        numel = math.prod(shape)
        out = torch.empty(numel, dtype=fragments[0][name].dtype)
        pn = partition_numel(numel, len(fragments))
        for r, f in enumerate(fragments):
            start, stop = rank_range(r, pn, numel)
            if stop > start:
                out.narrow(0, start, stop - start).copy_(f[name].reshape(-1)[: stop - start])
        return out.view(shape)

    return make


def _frozen_segments(ckpt: Zero3Checkpoint, loaded: list[dict[str, Any]], name: str,
                     shape: tuple[int, ...]) -> list[Segment] | None:
    """The frozen parameter ``name`` as byte ranges of the rank model-states files (each rank's
    fragment without its padding, in rank order), or None when an offset is unknown. Frozen
    weights then stay on disk, memory-mapped, and are copied through the writer's buffer like
    the masters and moments: a LoRA-style model whose weights are mostly frozen converts at the
    peak memory of a fully trained one (they were gathered into one tensor each)."""
    numel = math.prod(shape)
    pn = partition_numel(numel, len(loaded))
    segments = []
    for r, sd in enumerate(loaded):
        start, stop = rank_range(r, pn, numel)
        if stop <= start:
            continue
        fragment = sd["frozen_param_fragments"][name]
        at = FileOffsets(ckpt.model_files[r], sd).of(fragment)
        if at is None:
            return None
        segments.append(Segment(str(ckpt.model_files[r]), at, (stop - start) * fragment.element_size()))
    return segments


def state_template(ckpt: Zero3Checkpoint, plan: DcpTarget, parts: list[RankPartitions]) -> tuple[dict[str, Any], dict[str, LazyTensor]]:
    """``{"model": ..., "optim": ...}`` with meta tensors (shape and dtype only) where the data is
    big, and the lazy tensors ``zero3_to_dcp_write`` writes in their place (keyed by flattened DCP
    key)."""
    import torch

    names = plan.names
    model: dict[str, Any] = {}
    optim_state: dict[str, Any] = {}
    lazy: dict[str, LazyTensor] = {}
    by_fqn: dict[str, LazyTensor] = {}

    def lazy_slot(slot: ParamSlot, key: str) -> _ShapedLazyTensor:
        dtype = parts[0].flat(key, slot.sub_group).dtype
        return _ShapedLazyTensor(slot.shape, dtype, partial(_gather, parts, slot, key), _segments(parts, slot, key))

    for slot in ckpt.slots:
        fqn = names.fsdp_name(slot.name)
        dtype = parts[0].flat(FP32, slot.sub_group).dtype
        model[fqn] = torch.empty(slot.shape, dtype=dtype, device="meta")
        by_fqn[fqn] = lazy[dcp_model_key(fqn)] = lazy_slot(slot, FP32)
        entry: dict[str, Any] = {"step": torch.tensor(plan.steps[slot.sub_group], dtype=torch.float32)}
        for key in ADAM_STATE_KEYS:
            entry[key] = torch.empty(slot.shape, dtype=parts[0].flat(key, slot.sub_group).dtype, device="meta")
            lazy[dcp_optim_key(fqn, key)] = lazy_slot(slot, key)
        optim_state[fqn] = entry
    if ckpt.frozen_param_shapes:
        # every rank's model states, memory-mapped (rank 0's is already open)
        loaded = [ckpt.model_state if r == 0 else safe_torch_load(ckpt.model_files[r], mmap=True)
                  for r in range(ckpt.world_size)]
        fragments = [dict(sd.get("frozen_param_fragments") or {}) for sd in loaded]
        for name, shape in ckpt.frozen_param_shapes.items():
            fqn = names.fsdp_name(name)
            dtype = fragments[0][name].dtype
            model[fqn] = torch.empty(shape, dtype=dtype, device="meta")
            by_fqn[fqn] = lazy[dcp_model_key(fqn)] = _ShapedLazyTensor(
                tuple(shape), dtype, _frozen_producer(fragments, name, shape),
                _frozen_segments(ckpt, loaded, name, tuple(shape)))
    for name, tensor in ckpt.buffers().items():
        model[names.fsdp_name(name)] = tensor.detach().clone()
    for alias, owner in names.aliases.items():
        model[alias] = torch.empty(model[owner].shape, dtype=model[owner].dtype, device="meta")
        lazy[dcp_model_key(alias)] = by_fqn[owner]
    return {MODEL_KEY: model, OPTIM_KEY: {"state": optim_state, "param_groups": plan.groups}}, lazy
