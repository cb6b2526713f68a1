"""Rewrite a ZeRO-1/2 checkpoint's rank files for another data-parallel world size, as DeepSpeed's plain
``load_checkpoint`` reads them at that size (``stage_1_and_2.py`` ``_load_legacy_checkpoint``, rigid state).

Per param group, the old ranks' unpadded fp32 slices, concatenated, are the group's flat buffer without its
tail padding (``reader``'s module doc); at the new world size M that buffer is padded to a multiple of
``2 * M`` and cut into M equal partitions. A new rank's ``single_partition_of_fp32_groups`` entry is its
partition without padding, as DeepSpeed saves it; each per-element optimizer state (``exp_avg``,
``exp_avg_sq``: a tensor of the old partition's size) becomes the new partition, with its padding
zeroed; the other optimizer values (``step``, the param-group hyperparameters) and the scalars are
rank 0's. ``group_paddings``, ``partition_count`` and ``param_slice_mappings`` follow the new partitions,
and the model-states file gets ``dp_world_size`` M (DeepSpeed's guard compares it with the new world size).

Memory: each new tensor is a ``LazyTensor`` built from views of the memory-mapped source files when
``stream_save`` writes its record, so a writer holds one new partition of one state at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from shardkit.checkpoint.zero12.reader import MODEL_FILE, OPTIMIZER_KEY, Zero12Checkpoint
from shardkit.core.errors import CheckpointError
from shardkit.storage.stream import LazyTensor, WrittenFile, stream_save
from shardkit.storage.torch_load import deepspeed_stub

if TYPE_CHECKING:
    import torch

#: DeepSpeed's ``nccl_start_alignment_factor``: a group's flat buffer is padded to a multiple of this x world size.
ALIGNMENT_FACTOR = 2
FRAGMENT_ADDRESS = "deepspeed.utils.tensor_fragment.fragment_address"


@dataclass(frozen=True)
class GroupLayout:
    """One param group's flat buffer: its length without tail padding, and where each parameter sits in it."""

    numel: int
    """Elements of the buffer before the tail padding (parameters and their alignment paddings)."""
    params: list[tuple[str, int, int]]
    """(name, offset in the buffer, numel), in buffer order."""
    old_sizes: list[int]
    """Each old rank's unpadded slice length."""
    old_partition: int
    """The old partition size (with padding)."""

    def new_partition(self, world_size: int) -> int:
        align = ALIGNMENT_FACTOR * world_size
        return math.ceil(self.numel / align) * align // world_size

    def new_range(self, world_size: int, rank: int) -> tuple[int, int]:
        """[start, end) of the buffer that new ``rank`` holds (end - start may be 0 on a last rank)."""
        size = self.new_partition(world_size)
        start = min(rank * size, self.numel)
        return start, min(start + size, self.numel)


def element_count(tensor: Any) -> int:
    """Elements of a torch tensor or of a ``read_structure`` ``TensorRef`` (a method on one, a property on the other)."""
    numel = tensor.numel
    return int(numel() if callable(numel) else numel)


def group_layouts(ckpt: Zero12Checkpoint) -> list[GroupLayout]:
    """Each param group's layout, from the rank files and the model states' ``param_shapes``; raises
    CheckpointError when the two disagree (a layout this module does not know must not be moved)."""
    rank0 = ckpt.optim_states[0][OPTIMIZER_KEY]
    shapes = ckpt.model_state.get("param_shapes") or []
    groups = len(rank0["single_partition_of_fp32_groups"])
    if len(shapes) != groups:
        raise CheckpointError(f"{ckpt.model_files[0]}: param_shapes has {len(shapes)} groups, the optimizer files "
                              f"{groups}: the model states and optimizer files are of different saves")
    layouts = []
    for g in range(groups):
        sizes = [element_count(s[OPTIMIZER_KEY]["single_partition_of_fp32_groups"][g]) for s in ckpt.optim_states]
        paddings = [int(s[OPTIMIZER_KEY]["group_paddings"][g]) for s in ckpt.optim_states]
        partitions = {size + pad for size, pad in zip(sizes, paddings)}
        param_pads = list((rank0.get("param_alignment_paddings") or [[]] * groups)[g]) or [0] * len(shapes[g])
        params, offset = [], 0
        for (name, shape), pad in zip(shapes[g].items(), param_pads):
            numel = math.prod(shape)
            params.append((name, offset, numel))
            offset += numel + int(pad)
        if len(partitions) != 1 or offset != sum(sizes) or len(param_pads) != len(shapes[g]):
            raise CheckpointError(
                f"{ckpt.tag_dir}: param group {g}: the ranks hold {sum(sizes)} fp32 elements (partitions {sorted(partitions)}), "
                f"the model's param_shapes {offset}: a layout this reshard does not know (frozen or reordered parameters?). "
                "Nothing was written; convert it with DeepSpeed's ds_to_universal instead")
        layouts.append(GroupLayout(offset, params, sizes, partitions.pop()))
    return layouts


def _gather(pieces: list["torch.Tensor"], layout: GroupLayout, start: int, end: int) -> list["torch.Tensor"]:
    """Views of [start, end) of the buffer, from the old ranks' tensors (each cut to its unpadded length)."""
    out, base = [], 0
    for tensor, size in zip(pieces, layout.old_sizes):
        lo, hi = max(start, base), min(end, base + size)
        if lo < hi:
            out.append(tensor.reshape(-1).narrow(0, lo - base, hi - lo))
        base += size
    return out


def _lazy(pieces: list["torch.Tensor"], layout: GroupLayout, start: int, end: int, total: int) -> LazyTensor:
    """A new flat tensor of ``total`` elements: [start, end) of the buffer, then zeros."""
    dtype = pieces[0].dtype

    def produce() -> "torch.Tensor":
        import torch

        out = torch.zeros(total, dtype=dtype)
        at = 0
        for view in _gather(pieces, layout, start, end):
            out.narrow(0, at, view.numel()).copy_(view)
            at += view.numel()
        return out

    return LazyTensor(total, dtype, produce)


def _new_optimizer_state(ckpt: Zero12Checkpoint, layouts: list[GroupLayout], world: int, rank: int) -> dict[str, Any]:
    import torch

    rank0 = ckpt.optim_states[0][OPTIMIZER_KEY]
    sd = dict(rank0)
    base = rank0["base_optimizer_state"]
    fp32, paddings, mappings, states = [], [], [], {}
    for g, layout in enumerate(layouts):
        start, end = layout.new_range(world, rank)
        size = layout.new_partition(world)
        fp32.append(_lazy([s[OPTIMIZER_KEY]["single_partition_of_fp32_groups"][g] for s in ckpt.optim_states],
                          layout, start, end, end - start))
        paddings.append(size - (end - start))
        mapping: dict[str, Any] = {}
        for name, offset, numel in layout.params:
            lo, hi = max(start, offset), min(end, offset + numel)
            if lo < hi:
                mapping[name] = deepspeed_stub(FRAGMENT_ADDRESS, numel=hi - lo, start=lo - start)
        mappings.append(type(rank0["param_slice_mappings"][g])(mapping))
        param_id = base["param_groups"][g]["params"][0]
        new_state: dict[str, Any] = {}
        for key, value in base["state"].get(param_id, {}).items():
            if torch.is_tensor(value) and tuple(value.shape) == (layout.old_partition,):
                old = [s[OPTIMIZER_KEY]["base_optimizer_state"]["state"][param_id][key] for s in ckpt.optim_states]
                new_state[key] = _lazy(old, layout, start, end, size)
            else:
                new_state[key] = value  # step and other per-group scalars: the same on every rank
        states[param_id] = new_state
    sd["base_optimizer_state"] = {"state": states, "param_groups": base["param_groups"]}
    sd["single_partition_of_fp32_groups"] = fp32
    sd["group_paddings"] = paddings
    sd["partition_count"] = [world] * len(layouts)
    sd["param_slice_mappings"] = mappings
    return sd


@dataclass(frozen=True)
class Zero12OutputFile:
    """One file of the new checkpoint: its name, about how many bytes it holds, and its writer."""

    name: str
    nbytes: int
    write: Callable[[Path], WrittenFile]


def plan_files(ckpt: Zero12Checkpoint, world_size: int) -> list[Zero12OutputFile]:
    """The new checkpoint's files for ``world_size`` ranks: one optimizer file per rank and the model states."""
    if world_size < 1:
        raise CheckpointError(f"--world-size {world_size}: must be at least 1")
    layouts = group_layouts(ckpt)
    rank0 = ckpt.optim_states[0]
    states = rank0[OPTIMIZER_KEY]["base_optimizer_state"]["state"]
    tensors_per_group = 1 + max((sum(1 for v in s.values() if hasattr(v, "numel") and v.dim() == 1)
                                 for s in states.values()), default=0)

    def optim_writer(rank: int) -> Callable[[Path], WrittenFile]:
        def write(out: Path) -> WrittenFile:
            new = dict(rank0)  # the source's key order
            new[OPTIMIZER_KEY] = _new_optimizer_state(ckpt, layouts, world_size, rank)
            return stream_save(new, out, fsync=True)
        return write

    def model_writer(out: Path) -> WrittenFile:
        model = dict(ckpt.model_state)
        model["dp_world_size"] = world_size  # engine._load_zero_checkpoint compares it with the world size
        return stream_save(model, out, fsync=True)

    per_rank = sum(4 * tensors_per_group * layout.new_partition(world_size) for layout in layouts)
    files = [Zero12OutputFile(f"{ckpt.prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt", per_rank, optim_writer(r))
             for r in range(world_size)]
    files.append(Zero12OutputFile(MODEL_FILE, ckpt.model_files[0].stat().st_size, model_writer))
    return files
