"""What a ZeRO-1/2 reshard writes, file by file, without torch: each new rank's optimizer file as a pickle
plus storage records that are byte ranges of the old ranks' files and zero runs, and the model-states file
with its records copied whole.

The dicts are those ``repartition._new_optimizer_state`` builds with torch, key for key (rank 0's values,
the new ``single_partition_of_fp32_groups``, moments with their padding zeroed, ``group_paddings``,
``partition_count``, ``param_slice_mappings``; the model states with ``dp_world_size``), so ``torch.load``
and DeepSpeed's ``load_checkpoint`` read the same values from either writer. Here a new partition is never
built: per param group, the new rank's range of the flat buffer is the old ranks' unpadded slices that
overlap it (``Segment``s of their files, at the ``file_offset`` ``read_structure`` found), then zeros
(``torch_zip`` copies them through one buffer per writer thread).

What the byte route cannot express is found while planning, before anything is written, and raised as
``NotByteCopyable`` naming it: the caller then takes the torch route (``repartition.plan_files``), which
converts and gathers in memory. That is a source tensor that is not a contiguous 1-D run of its file
(``read_structure`` describes every tensor ``torch.save`` writes for DeepSpeed, so this is a file some
other tool rewrote), or a per-element state whose element type differs between ranks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from shardkit.checkpoint.zero12.reader import MODEL_FILE, OPTIMIZER_KEY, Zero12Checkpoint, open_zero12_checkpoint
from shardkit.checkpoint.zero12.repartition import (
    FRAGMENT_ADDRESS,
    GroupLayout,
    Zero12OutputFile,
    group_layouts,
    plan_files,
)
from shardkit.core.errors import CheckpointError
from shardkit.storage.torch_load import TensorRef, deepspeed_stub
from shardkit.storage.torch_pickle import NewTensor, pickle_structure
from shardkit.storage.torch_zip import RecordData, Segment, WrittenFile, write_torch_zip

#: What a worker writes for one output file: ``data.pkl`` and the storage records, in order.
Built = tuple[bytes, list[tuple[str, RecordData]]]
FP32_KEY = "single_partition_of_fp32_groups"


class NotByteCopyable(Exception):
    """The source holds something the byte-range writer cannot express (the message says what)."""


@dataclass(frozen=True)
class Zero12ByteFile:
    """One file of the resharded tag folder."""

    name: str
    nbytes: int
    """About how many bytes it will hold (the tensor records): what the writers' shares are balanced on."""
    build: Callable[[], Built]


@dataclass(frozen=True)
class _GroupSources:
    """One param group's per-element tensors on every old rank: the fp32 slices and each moment."""

    param_id: Any
    """The group's flat parameter's key in ``base_optimizer_state.state``."""
    fp32: list[TensorRef]
    states: dict[str, list[TensorRef]]
    """State key (``exp_avg``...) -> each old rank's partition-shaped tensor (padding included)."""


class Zero12ReshardPlan:
    """The files of ``ckpt`` (opened with ``torch_free=True``) at ``world_size`` ranks, as byte ranges."""

    def __init__(self, ckpt: Zero12Checkpoint, world_size: int):
        if not ckpt.torch_free:
            raise ValueError("Zero12ReshardPlan needs a checkpoint opened with torch_free=True")
        if world_size < 1:
            raise CheckpointError(f"--world-size {world_size}: must be at least 1")
        self.ckpt, self.world_size = ckpt, world_size
        self.layouts = group_layouts(ckpt)
        self.rank0: dict[str, Any] = ckpt.optim_states[0]
        self.groups = [self._sources(g, layout) for g, layout in enumerate(self.layouts)]

    def _sources(self, g: int, layout: GroupLayout) -> _GroupSources:
        base = self.rank0[OPTIMIZER_KEY]["base_optimizer_state"]
        param_id = base["param_groups"][g]["params"][0]
        fp32 = [self._run(r, s[OPTIMIZER_KEY][FP32_KEY][g], f"{FP32_KEY}[{g}]", layout.old_sizes[r], "float32")
                for r, s in enumerate(self.ckpt.optim_states)]
        states: dict[str, list[TensorRef]] = {}
        for key, value in base["state"].get(param_id, {}).items():
            # the torch route's rule: a tensor of the old partition's size is per element, anything else
            # (step, a custom optimizer's scalars) is rank 0's value, written back as it was read
            if isinstance(value, TensorRef) and value.shape == (layout.old_partition,):
                where = f"base_optimizer_state.state[{param_id}].{key}"
                states[key] = [self._run(r, s[OPTIMIZER_KEY]["base_optimizer_state"]["state"].get(param_id, {}).get(key),
                                         where, layout.old_partition, value.dtype)
                               for r, s in enumerate(self.ckpt.optim_states)]
        return _GroupSources(param_id, fp32, states)

    def _run(self, rank: int, ref: Any, where: str, numel: int, dtype: str) -> TensorRef:
        """Old rank ``rank``'s tensor at ``where``, checked to be ``numel`` contiguous ``dtype`` elements of its file."""
        path = self.ckpt.optim_files[rank]
        if not isinstance(ref, TensorRef):
            raise CheckpointError(f"{path}: {where} is missing or not a tensor ({type(ref).__name__}), and rank 0's file "
                                  "has it: the rank files come from different saves, or the file is damaged")
        if ref.numel != numel:
            raise CheckpointError(f"{path}: {where} has {ref.numel} elements, expected {numel} (from group_paddings and "
                                  "the other ranks): the rank files come from different saves, or the file is damaged")
        if ref.dtype != dtype:
            raise NotByteCopyable(f"{path}: {where} is {ref.dtype}, rank 0's is {dtype}")
        if len(ref.shape) != 1 or not ref.is_contiguous() or ref.file_offset is None or ref.path is None:
            raise NotByteCopyable(f"{path}: {where} is not a contiguous 1-D run of its file "
                                  f"(shape {ref.shape}, stride {ref.stride})")
        return ref

    def files(self) -> list[Zero12ByteFile]:
        """One optimizer file per new rank (the large ones, first), then the model states."""
        per_rank = sum((4 + sum(refs[0].itemsize for refs in group.states.values())) * layout.new_partition(self.world_size)
                       for group, layout in zip(self.groups, self.layouts))
        files = [Zero12ByteFile(f"{self.ckpt.prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt", per_rank,
                                functools.partial(self._build_optim, r)) for r in range(self.world_size)]
        model = self.ckpt.model_files[0]
        files.append(Zero12ByteFile(MODEL_FILE, Path(model).stat().st_size, self._build_model))
        return files

    # --- one new rank's optimizer file ------------------------------------------------------------

    def _partition(self, refs: list[TensorRef], layout: GroupLayout, start: int, end: int, total: int) -> NewTensor:
        """[start, end) of the group's flat buffer from the old ranks' tensors (each holding its unpadded
        slice first), then zeros up to ``total`` elements."""
        size = refs[0].itemsize
        segs: list[Segment] = []
        base = 0
        for ref, held in zip(refs, layout.old_sizes):
            lo, hi = max(start, base), min(end, base + held)
            if lo < hi:
                assert ref.file_offset is not None and ref.path is not None  # checked by _run
                offset, nbytes = ref.file_offset + (lo - base) * size, (hi - lo) * size
                last = segs[-1] if segs else None
                if last is not None and last.path == ref.path and last.offset + last.nbytes == offset:
                    segs[-1] = Segment(ref.path, last.offset, last.nbytes + nbytes)
                else:
                    segs.append(Segment(ref.path, offset, nbytes))
            base += held
        if total > end - start:
            segs.append(Segment(None, 0, (total - (end - start)) * size))
        return NewTensor(refs[0].dtype, total, segs)

    def _build_optim(self, rank: int) -> Built:
        rank0 = self.rank0[OPTIMIZER_KEY]
        sd = dict(rank0)  # rank 0's keys, in the source's order
        base = rank0["base_optimizer_state"]
        fp32, paddings, mappings, states = [], [], [], {}
        for g, (layout, group) in enumerate(zip(self.layouts, self.groups)):
            start, end = layout.new_range(self.world_size, rank)
            size = layout.new_partition(self.world_size)
            fp32.append(self._partition(group.fp32, layout, start, end, end - start))
            paddings.append(size - (end - start))
            mapping: dict[str, Any] = {}
            for name, offset, numel in layout.params:
                lo, hi = max(start, offset), min(end, offset + numel)
                if lo < hi:
                    mapping[name] = deepspeed_stub(FRAGMENT_ADDRESS, numel=hi - lo, start=lo - start)
            mappings.append(type(rank0["param_slice_mappings"][g])(mapping))
            states[group.param_id] = {key: (self._partition(group.states[key], layout, start, end, size)
                                            if key in group.states else value)
                                      for key, value in base["state"].get(group.param_id, {}).items()}
        sd["base_optimizer_state"] = {"state": states, "param_groups": base["param_groups"]}
        sd[FP32_KEY] = fp32
        sd["group_paddings"] = paddings
        sd["partition_count"] = [self.world_size] * len(self.layouts)
        sd["param_slice_mappings"] = mappings
        new = dict(self.rank0)
        new[OPTIMIZER_KEY] = sd
        return pickle_structure(new)

    # --- the model-states file --------------------------------------------------------------------

    def _build_model(self) -> Built:
        model = dict(self.ckpt.model_state)
        model["dp_world_size"] = self.world_size  # engine._load_zero_checkpoint compares it with the world size
        return pickle_structure(model)


@dataclass(frozen=True)
class Zero12Reshard:
    """The opened source and the files a ZeRO-1/2 reshard writes, with how they are written."""

    ckpt: Zero12Checkpoint
    files: list[Zero12OutputFile]
    torch_route: str | None
    """Why the files are built with torch (``repartition.plan_files``) rather than copied as byte ranges; None
    on the byte route."""


def plan_zero12_reshard(tag_dir: Path, world_size: int) -> Zero12Reshard:
    """The byte-range route (``Zero12ReshardPlan``) where it can express the source, else the torch route,
    saying why. Errors of the source itself (a missing rank, a layout nothing moves) are raised as they are."""
    try:
        ckpt = open_zero12_checkpoint(tag_dir, torch_free=True)
    except CheckpointError as exc:
        # read_structure describes what torch.save writes for plain CPU tensors; a file it cannot describe
        # (a tensor subclass, tensor metadata) may still load with torch: if that fails too, its error is the answer
        ckpt = open_zero12_checkpoint(tag_dir)
        reason = str(exc)
    else:
        try:
            plan = Zero12ReshardPlan(ckpt, world_size)
        except NotByteCopyable as exc:
            ckpt, reason = open_zero12_checkpoint(tag_dir), str(exc)
        else:
            return Zero12Reshard(ckpt, [Zero12OutputFile(f.name, f.nbytes, _zip_writer(f.build)) for f in plan.files()], None)
    note = (f"the new rank files were built in memory with torch (one partition of one state per writer thread, "
            f"slower than the byte-range copy) because the byte-range writer cannot express the source: {reason}")
    return Zero12Reshard(ckpt, plan_files(ckpt, world_size), note)


def _zip_writer(build: Callable[[], Built]) -> Callable[[Path], WrittenFile]:
    return lambda out: write_torch_zip(out, *build())
