"""The DCP writer: any ``TrainingCheckpoint`` with its optimizer state as the DCP checkpoint shardkit's
FSDP2 resume (``load_fsdp_checkpoint``) loads at any world size, written without torch.

What is written is what ``save_fsdp_checkpoint`` writes: ``dcp.save({"model": model_sd, "optim":
optim_sd})`` with the keys ``get_state_dict`` produces (``model.<fqn>``, ``optim.state.<fqn>.
{step,exp_avg,exp_avg_sq}``, ``optim.param_groups.<i>.<key>``). Every tensor is plain and
unsharded, one chunk (as one process's ``dcp.save`` records it), so ``dcp.load`` into a run's
DTensor shards reads just the slice each rank owns, at any world size.

The items come from the checkpoint model (``dcp_items``): each big tensor (weights, optimizer
states, frozen parameters, tied aliases) is the ``SegmentedRecord`` of its ``SourceTensor``'s
pieces (byte ranges of the source files, copied into its own ``.distcp`` file by
``dcp_files``); a tensor a reader could only describe with a ``load`` is read whole (that tensor
alone in memory, through torch) when its file is written. The small items (``step`` per
parameter, buffers, param-group values) go together into ``__0_0.distcp``; ``.metadata`` is
pickled without torch (``dcp_format``). What to write is decided by the caller (``DcpLayout``:
the names, param groups and steps a conversion plan chose); this module only writes it.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from shardkit.checkpoint.model.checkpoint import TrainingCheckpoint
from shardkit.checkpoint.model.tensors import SourceTensor
from shardkit.checkpoint.writers.dcp_format import TensorItem, ValueItem, is_plain, itemsize
from shardkit.core.errors import CheckpointError
from shardkit.storage.torch_zip import RecordData, Segment, SegmentedRecord

if TYPE_CHECKING:
    import torch

MODEL_KEY = "model"
OPTIM_KEY = "optim"


def dcp_model_key(fqn: str) -> str:
    """The flattened DCP key of a model tensor (what ``dcp.save`` of ``{"model": sd, ...}`` writes)."""
    return f"{MODEL_KEY}.{fqn}"


def dcp_optim_key(fqn: str, state_key: str) -> str:
    """The flattened DCP key of one optimizer state entry (``exp_avg``, ``exp_avg_sq``, ``step``)."""
    return f"{OPTIM_KEY}.state.{fqn}.{state_key}"


@dataclass
class DcpLayout:
    """What the output holds, decided by the caller before a byte is written."""

    fqns: dict[str, str]
    """``{name in the checkpoint model: FQN written}`` for every tensor of ``weights``."""
    aliases: dict[str, str] = field(default_factory=dict)
    """``{alias FQN: FQN holding the data}``: tied names written as their own copy (DCP load needs both)."""
    groups: list[dict[str, Any]] = field(default_factory=list)
    """torch param groups (``params``: FQNs), each value plain data."""
    steps: dict[str, float] = field(default_factory=dict)
    """``step`` of every trainable parameter, by its name in the checkpoint model."""
    state_keys: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
    """The per-element optimizer states written for every trainable parameter."""


@dataclass
class DcpItems:
    """Everything the output holds, before a byte is written."""

    big: list[TensorItem] = field(default_factory=list)
    """Weights, optimizer states, frozen parameters, aliases: one ``.distcp`` file each."""
    small: list[TensorItem | ValueItem] = field(default_factory=list)
    """``step``, buffers, param-group values: together in ``dcp_files.SMALL_FILE``."""


def dcp_items(ckpt: TrainingCheckpoint, layout: DcpLayout) -> DcpItems:
    """The items of the DCP output of ``ckpt`` as ``layout`` names them, in the order DCP's writer
    numbers them (each trainable parameter's weight and states, frozen parameters, aliases); a
    CheckpointError naming the tensor for what cannot be written (a piece missing, a value that is
    not plain data)."""
    out = DcpItems()
    by_fqn: dict[str, TensorItem] = {}
    for name in ckpt.trainable:
        fqn = layout.fqns[name]
        item = by_fqn[fqn] = _tensor_item(ckpt.weights[name], dcp_model_key(fqn), (MODEL_KEY, fqn))
        out.big.append(item)
        states = ckpt.optimizer.get(name) or {}
        for key in layout.state_keys:
            if key not in states:
                raise CheckpointError(f"{ckpt.folder}: parameter {name!r} has no {key} in the checkpoint's optimizer "
                                      f"state (it holds {sorted(states)}); every trainable parameter needs one")
            out.big.append(_tensor_item(states[key], dcp_optim_key(fqn, key), (OPTIM_KEY, "state", fqn, key)))
        # torch.tensor(step, dtype=torch.float32): the same rounding as struct's "f"
        out.small.append(TensorItem(dcp_optim_key(fqn, "step"), (OPTIM_KEY, "state", fqn, "step"), "float32", (),
                                    struct.pack("<f", layout.steps[name])))
    for name in ckpt.weights:
        if name in ckpt.frozen:
            fqn = layout.fqns[name]
            by_fqn[fqn] = _tensor_item(ckpt.weights[name], dcp_model_key(fqn), (MODEL_KEY, fqn))
            out.big.append(by_fqn[fqn])
    for name in ckpt.weights:
        if name in ckpt.buffers:
            fqn = layout.fqns[name]
            out.small.append(_tensor_item(ckpt.weights[name], dcp_model_key(fqn), (MODEL_KEY, fqn)))
    for alias, owner in layout.aliases.items():
        src = by_fqn[owner]
        out.big.append(TensorItem(dcp_model_key(alias), (MODEL_KEY, alias), src.dtype, src.shape, src.data))
    for i, group in enumerate(layout.groups):
        for key, value in group.items():
            if not is_plain(value):
                raise CheckpointError(f"param_groups[{i}].{key} is a {type(value).__name__}, not plain data a DCP "
                                      "byte item holds; leave it out of the param groups and set it after loading")
            out.small.append(ValueItem(f"{OPTIM_KEY}.param_groups.{i}.{key}", (OPTIM_KEY, "param_groups", i, key), value))
    return out


def _tensor_item(tensor: SourceTensor, key: str, path: tuple[str | int, ...]) -> TensorItem:
    """``tensor`` as one item: its pieces' byte ranges (built by the thread writing the file, so the
    ranges of all tensors never exist at once: they grow as ranks x tensors), or its loader's bytes."""
    if not tensor.covered():
        raise CheckpointError(f"{tensor.name} (written as {key}): the source's pieces do not cover its {tensor.numel} "
                              "elements once "
                              f"({len(tensor.pieces)} piece(s)); the checkpoint is incomplete or its ranks disagree")
    if tensor.load is not None:
        return TensorItem(key, path, tensor.dtype, tensor.shape, partial(_loaded, tensor.load))
    return TensorItem(key, path, tensor.dtype, tensor.shape, partial(_record, tensor))


def _record(tensor: SourceTensor) -> RecordData:
    size = itemsize(tensor.dtype)
    segments = [Segment(str(p.file), p.offset, p.numel * size) for p in sorted(tensor.pieces, key=lambda p: p.start)]
    return SegmentedRecord(tensor.numel * size, segments)


def _loaded(load: Callable[[], "torch.Tensor"]) -> RecordData:
    """A tensor only its reader's loader can read, as its bytes (torch is imported only here)."""
    import torch

    data: bytes = load().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return data
