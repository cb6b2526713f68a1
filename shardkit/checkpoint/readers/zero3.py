"""The ZeRO-3 reader: a ZeRO-3 checkpoint's tensors as ``Piece``s: where each rank's unpadded share of every parameter,
frozen parameter and buffer lies in the rank files.

The files are parsed with ``read_structure`` (no ``torch.load``, no tensor data read): trainable
parameters are the fp32 masters in each rank's ``fp32_flat_groups[sub_group]`` (the layout
``readers.zero3_open`` describes), frozen parameters each rank's ``frozen_param_fragments`` entry in its
model-states file (partitioned as trainable ones: ``ceil(numel / world)`` per rank, the tail
padded), buffers rank 0's ``module`` entries. Tied parameters are stored once and named in
``shared_params`` (``{alias: holder}``).

A ZeRO-3 tensor is split over every rank, so its pieces are not stored (a list per tensor would be
ranks x tensors Piece objects in every process: ~390 MB for a 70B Llama at 1,024 ranks): each
tensor's ``RankPieces`` computes rank ``r``'s piece from the layout and ``RankFiles``, which keeps
each rank file's few flat offsets (benchmarks/bench_zero3_reader.py measures it).

The optimizer state is described the same way: each trainable parameter's per-element states
(``exp_avg``, ``exp_avg_sq``: whatever the sub-groups' ``state`` holds at the flats' length) are
its unpadded pieces of every rank's ``state[sub_group][key]`` flat, at the parameter's offset
there, as for the master. The scalars (``readers.deepspeed_scalars``): ``step`` per parameter from
its sub-group, the param groups with their parameters' names, the optimizer facts of ds_config,
the loss scaler, scheduler, client state and counters of rank 0's files.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any, Callable, TypeVar

from shardkit.checkpoint.model.checkpoint import TrainingCheckpoint
from shardkit.checkpoint.model.tensors import Piece, Pieces, SourceTensor
from shardkit.checkpoint.readers.deepspeed_scalars import per_parameter_steps, run_scalars, step_value
from shardkit.checkpoint.readers.zero3_open import open_zero3_layout
from shardkit.checkpoint.zero3.checkpoint import FP32, ParamSlot, Zero3Checkpoint
from shardkit.checkpoint.zero3.layout import partition_numel, rank_range
from shardkit.core.errors import CheckpointError
from shardkit.storage.listing import list_folder
from shardkit.storage.torch_load import ITEMSIZE, TensorRef, read_structure

#: File names DeepSpeed MoE writes beside the ZeRO files (``expp_rank_*``, ``layer_*_expert_*``):
#: expert-parallel weights that the data-parallel rank files do not hold.
MOE_MARKERS = ("expp_rank_", "_expert_")
_T = TypeVar("_T")


def read_zero3(tag_dir: Path, *, lazy: bool = False) -> TrainingCheckpoint:
    """Describe the ZeRO-3 tag folder ``tag_dir`` (already verified by the caller).

    Each rank file's offsets are parsed once and kept (a few ints per rank); the pieces are computed
    from them when asked for (``RankPieces``). By default every rank's files are parsed here, so a
    rank file from another save is named before anything is written; ``lazy=True`` parses a rank's
    files the first time one of its pieces is asked for (a process of a split run parses only the
    files its share reads; its output is staged, so a late error still loses nothing)."""
    listing = list_folder(tag_dir)  # handed on: the opener lists the folder no more (storage.listing)
    moe = sorted(name for name in listing.names if any(m in name for m in MOE_MARKERS))
    if moe:
        raise CheckpointError(
            f"{tag_dir}: holds DeepSpeed MoE expert files ({', '.join(moe[:3])}): expert-parallel weights live outside "
            "the data-parallel rank files this export reads, so the exported model would lack its experts. Export "
            "it with DeepSpeed's own tools (ds_to_universal) instead")
    return describe_zero3(open_zero3_layout(tag_dir, listing=listing), lazy=lazy)


def describe_zero3(ckpt: Zero3Checkpoint, *, lazy: bool = False,
                   read: Callable[[Path], Any] = read_structure) -> TrainingCheckpoint:
    """``read_zero3`` of an opened checkpoint; ``read`` parses a rank file (``read_structure``;
    benchmarks/bench_zero3_reader.py passes synthetic structures)."""
    files = RankFiles(ckpt, read)
    tensors: dict[str, SourceTensor] = {}
    optimizer: dict[str, dict[str, SourceTensor]] = {}
    for slot in ckpt.slots:
        tensors[slot.name] = SourceTensor(slot.name, "float32", slot.shape, RankPieces(files, slot, FP32))
        optimizer[slot.name] = {key: SourceTensor(slot.name, dtype, slot.shape, RankPieces(files, slot, key))
                                for key, dtype in files.state_dtypes.items()}
    for name, shape in ckpt.frozen_param_shapes.items():
        numel = math.prod(shape)
        slot = ParamSlot(name, shape, numel, 0, 0, 0, partition_numel(numel, ckpt.world_size))
        tensors[name] = SourceTensor(name, files.frozen_dtypes[name], shape, RankPieces(files, slot, _FROZEN))
    if not lazy:
        for rank in range(ckpt.world_size):
            files.optim(rank)
            files.frozen(rank)
    module = ckpt.model_state.get("module") or {}
    names = ckpt.model_state.get("buffer_names") or []
    # a damaged or hostile model-states file (the field sweep drew lists here): named, never a TypeError
    if not isinstance(module, dict) or not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise CheckpointError(
            f"{ckpt.model_files[0]}: 'buffer_names' is {_short(names)} and 'module' a {type(module).__name__}, where "
            "DeepSpeed saves a list of buffer names and a dict of the module's tensors: the file is damaged or was not "
            "written by DeepSpeed. Re-copy it from the run that saved it")
    buffers = set()
    for name in names:
        buf = module.get(name)
        if isinstance(buf, TensorRef):
            tensors[name] = SourceTensor(name, buf.dtype, buf.shape,
                                         [Piece(ckpt.model_files[0], contiguous_offset(buf), 0, buf.numel)])
            buffers.add(name)
    return TrainingCheckpoint(
        "zero3", ckpt.tag_dir, tensors, world_size=ckpt.world_size, tag=ckpt.tag, precision=ckpt.precision,
        aliases=dict(ckpt.shared_params), frozen=set(ckpt.frozen_param_shapes or {}), buffers=buffers,
        optimizer={name: states for name, states in optimizer.items() if states}, optimizer_described=True,
        scalars={**_scalars(ckpt, files.optim0), "native": _native(ckpt, files)},
        notes=[f"ZeRO-3 checkpoint {ckpt.tag_dir} (tag {ckpt.tag!r}, saved by {ckpt.world_size} rank(s), "
               f"{ckpt.precision} training): fp32 masters exported"])


#: ``RankPieces`` key of a frozen parameter (its fragment in each rank's model-states file).
_FROZEN = ""


class RankFiles:
    """Where each rank file keeps its flat partitions: per rank, the byte offset of every sub-group's
    fp32 flat and per-element optimizer state (optim file) and of every frozen fragment (model file),
    parsed from the file the first time that rank is asked for and checked against rank 0's layout.
    Kept per rank, not per tensor: what a process holds grows with ranks + tensors, never their product."""

    def __init__(self, ckpt: Zero3Checkpoint, read: Callable[[Path], Any]):
        self.ckpt, self._read = ckpt, read
        self._optim: dict[int, dict[str, list[int]]] = {}
        self._frozen: dict[int, dict[str, int]] = {}
        # a lazy read's copier threads ask for ranks at once: each file is parsed by one of them, the
        # others wait for it (one lock per rank file, so parses of different ranks still overlap)
        self._locks: dict[tuple[int, int], threading.Lock] = {}
        self._locks_lock = threading.Lock()
        self.optim_file0 = read(ckpt.optim_files[0])
        """Rank 0's optim file as parsed (what a reshard writes back around the new partitions)."""
        self.optim0 = _optimizer_dict(self.optim_file0)
        self.state_dtypes = {key: ref.dtype for key, ref in _state_flats(ckpt, 0, self.optim0, 0).items()} \
            if ckpt.sub_group_numel else {}
        frags = ckpt.model_state.get("frozen_param_fragments") or {}
        self.frozen_dtypes = {name: getattr(frags.get(name), "dtype", "float32") for name in ckpt.frozen_param_shapes}

    def optim(self, rank: int) -> dict[str, list[int]]:
        """``{FP32 or state key: byte offset of each sub-group's flat}`` in rank ``rank``'s optim file."""
        table = self._optim.get(rank)
        return table if table is not None else self._once(self._optim, rank, self._read_optim)

    def _read_optim(self, rank: int) -> dict[str, list[int]]:
        osd = self.optim0 if rank == 0 else _optimizer_dict(self._read(self.ckpt.optim_files[rank]))
        table = {FP32: [contiguous_offset(ref) for ref in _optim_flats(self.ckpt, rank, osd)]}
        for j in range(len(self.ckpt.sub_group_numel)):
            for key, ref in _state_flats(self.ckpt, rank, osd, j).items():
                if ref.dtype != self.state_dtypes[key]:
                    raise CheckpointError(
                        f"{self.ckpt.optim_files[rank]}: {key} of sub-group {j} is {ref.dtype}, rank 0's is "
                        f"{self.state_dtypes[key]}; the rank files come from different saves")
                table.setdefault(key, []).append(contiguous_offset(ref))
        return table

    def frozen(self, rank: int) -> dict[str, int]:
        """``{frozen parameter: byte offset of its fragment}`` in rank ``rank``'s model-states file."""
        table = self._frozen.get(rank)
        if table is None:
            table = self._once(self._frozen, rank, lambda r: self._read_frozen(r) if self.ckpt.frozen_param_shapes else {})
        return table

    def _once(self, tables: dict[int, _T], rank: int, read: Callable[[int], _T]) -> _T:
        """``tables[rank]``, read by the first thread that asks for it (the others wait for its result)."""
        with self._locks_lock:
            lock = self._locks.setdefault((id(tables), rank), threading.Lock())
        with lock:
            table = tables.get(rank)
            if table is None:
                table = tables[rank] = read(rank)
            return table

    def _read_frozen(self, rank: int) -> dict[str, int]:
        ckpt = self.ckpt
        state = ckpt.model_state if rank == 0 else self._read(ckpt.model_files[rank])
        found = frozen_fragments(ckpt.model_files[rank], state, ckpt.frozen_param_shapes, rank, ckpt.world_size,
                                 self.frozen_dtypes)
        return {name: contiguous_offset(ref) if stop > start else 0 for name, (ref, start, stop) in found.items()}


def frozen_fragments(path: Path, state: Any, shapes: dict[str, tuple[int, ...]], rank: int, world: int,
                     dtypes: dict[str, str]) -> dict[str, tuple[TensorRef, int, int]]:
    """Rank ``rank``'s fragment of each frozen parameter in ``state``, its model-states dict as parsed from ``path``
    (the universal reader's copies too): ``(ref, start, stop)``, holding elements ``[start, stop)`` (``ceil(numel /
    world)`` per rank, the last rank's tail padded), checked to hold them in rank 0's dtype (``dtypes``, where known)."""
    frags = state.get("frozen_param_fragments") or {} if isinstance(state, dict) else {}
    out = {}
    for name, shape in shapes.items():
        numel = math.prod(shape)
        start, stop = rank_range(rank, partition_numel(numel, world), numel)
        ref = frags.get(name)
        if not isinstance(ref, TensorRef) or ref.numel < stop - start:
            raise CheckpointError(f"{path}: frozen parameter {name!r} has no fragment of {stop - start} elements "
                                  "(frozen_param_fragments); the rank file is damaged or from another save")
        if ref.dtype != dtypes.get(name, ref.dtype):
            raise CheckpointError(f"{path}: frozen parameter {name!r} is {ref.dtype} here but {dtypes[name]} on rank 0; "
                                  "the rank files come from different saves")
        out[name] = (ref, start, stop)
    return out


class RankPieces(Pieces):
    """One tensor's pieces, one per rank holding elements of it, computed from the layout: rank ``r``
    holds elements ``[r * p, (r + 1) * p)`` (``p = ceil(numel / world)``) at the parameter's offset in
    its flat (or its frozen fragment), whose byte offset ``RankFiles`` gives."""

    __slots__ = ("_files", "_slot", "_key", "_itemsize", "_count")

    def __init__(self, files: RankFiles, slot: ParamSlot, key: str):
        self._files, self._slot, self._key = files, slot, key
        dtype = "float32" if key == FP32 else (files.frozen_dtypes[slot.name] if key == _FROZEN
                                               else files.state_dtypes[key])
        self._itemsize = ITEMSIZE[dtype]
        self._count = 0 if slot.numel == 0 else -(-slot.numel // slot.partition_numel)

    def __len__(self) -> int:
        return self._count

    def overlapping(self, lo: int, hi: int) -> range:
        partition = max(1, self._slot.partition_numel)
        return range(min(self._count, max(0, lo) // partition), min(self._count, -(-max(0, hi) // partition)))

    def piece(self, i: int) -> Piece:
        slot, ckpt = self._slot, self._files.ckpt
        start, stop = slot.rank_range(i)
        if self._key == _FROZEN:
            return Piece(ckpt.model_files[i], self._files.frozen(i)[slot.name], start, stop - start)
        base = self._files.optim(i)[self._key][slot.sub_group]
        return Piece(ckpt.optim_files[i], base + slot.offset * self._itemsize, start, stop - start)


def _scalars(ckpt: Zero3Checkpoint, optim0: dict[str, Any]) -> dict[str, Any]:
    """Steps per parameter (from its sub-group), param groups with their names, and the run's values."""
    state = (optim0.get("optimizer_state_dict") or {}).get("state") or {}
    steps = [step_value((state.get(j) or {}).get("step", 0), f"{ckpt.optim_files[0]}: sub-group {j}")
             for j in range(len(ckpt.sub_group_numel))]
    by_sub_group = [[s.name for s in ckpt.slots if s.sub_group == j] for j in range(len(ckpt.sub_group_numel))]
    groups = [{**g, "params": [s.name for s in ckpt.slots if s.param_group == i]}
              for i, g in enumerate(ckpt.param_groups)]
    return run_scalars(ckpt.model_state, ckpt.ds_config, optim0, zero_stage=3, ds_version=ckpt.ds_version,
                       precision=ckpt.precision, step=per_parameter_steps(by_sub_group, steps), param_groups=groups)


def _native(ckpt: Zero3Checkpoint, files: RankFiles) -> dict[str, Any]:
    """What a ZeRO-3 writer needs to write the source back as its own run at another world size
    (``writers.zero3_same_run``): rank 0's two dicts as parsed, the rank files, and where each trainable
    parameter lies in the sub-groups (the source's ``ParamSlot``s, in their order); ``check_rank(r)`` parses rank r's
    files and checks them against rank 0's layout, as reading their pieces would (a reshard that copies them)."""
    return {"optim_file": files.optim_file0, "model_states": ckpt.model_state, "slots": list(ckpt.slots),
            "sub_group_param_group": list(ckpt.sub_group_param_group), "optim_files": list(ckpt.optim_files),
            "model_files": list(ckpt.model_files), "prefix": "bf16_" if ckpt.optim_files[0].name.startswith("bf16_") else "",
            "check_rank": lambda rank: (files.optim(rank), files.frozen(rank))}


def contiguous_offset(ref: TensorRef) -> int:
    """Where the contiguous tensor ``ref`` starts in its file; CheckpointError for any other (DeepSpeed writes none)."""
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


def _short(value: Any) -> str:
    """``value`` as a message shows a field read from a damaged file: its repr, cut at 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
