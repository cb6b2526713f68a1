"""Full tensors out of a ZeRO-3 checkpoint's partitions: every rank's unpadded piece of a parameter
copied into one tensor (``iter_params`` parameter by parameter, ``gather_param`` for one, and
``full_frozen_params`` for the parameters the optimizer does not own).

Every rank file is mapped once and read with ``os.preadv`` into the output tensor, so memory stays
near one parameter's tensors whatever the model size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

from shardkit.checkpoint.zero3.checkpoint import FP32, ParamSlot, Zero3Checkpoint

if TYPE_CHECKING:
    import torch


def iter_params(
    ckpt: Zero3Checkpoint, keys: tuple[str, ...] = (FP32,), slots: list[ParamSlot] | None = None
) -> Iterator[tuple[ParamSlot, dict[str, "torch.Tensor"]]]:
    """Yield ``(slot, {key: full unpadded tensor})`` parameter by parameter, in checkpoint order.

    Every rank file is mapped once but read with ``preadv`` into the output tensor, so the pages
    of the mappings are never touched: memory stays near one parameter's tensors, whatever the
    model size. ``keys``: ``"fp32"`` (the masters) and/or optimizer state keys (``exp_avg``...).
    """
    from contextlib import ExitStack

    import torch

    with ExitStack() as stack:
        parts = [stack.enter_context(ckpt.open_rank(r)) for r in range(ckpt.world_size)]
        for slot in slots if slots is not None else ckpt.slots:
            out = {}
            for key in keys:
                full = torch.empty(slot.numel, dtype=parts[0].flat(key, slot.sub_group).dtype)
                for part in parts:
                    start, stop = slot.rank_range(part.rank)
                    if stop > start:
                        part.read_into(key, slot.sub_group, slot.offset, full.narrow(0, start, stop - start))
                out[key] = full.view(slot.shape)
            yield slot, out


def gather_param(ckpt: Zero3Checkpoint, slot: ParamSlot, key: str = FP32) -> "torch.Tensor":
    """The full, unpadded ``key`` tensor of one parameter (``iter_params`` for many)."""
    for _, tensors in iter_params(ckpt, (key,), [slot]):
        return tensors[key]
    raise AssertionError("unreachable")


def full_frozen_params(ckpt: Zero3Checkpoint) -> dict[str, "torch.Tensor"]:
    """Frozen (not optimized) parameters, reassembled from every rank's fragments."""
    import torch

    shapes = ckpt.frozen_param_shapes
    if not shapes:
        return {}
    frags = [ckpt.frozen_fragments(r) for r in range(ckpt.world_size)]
    out = {}
    for name, shape in shapes.items():
        numel = math.prod(shape)
        parts = [f[name].reshape(-1) for f in frags]
        out[name] = torch.cat(parts)[:numel].view(shape)
    return out
