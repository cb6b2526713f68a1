"""The ZeRO-1/2 reader: a DeepSpeed ZeRO-1 or ZeRO-2 tag folder as the checkpoint model, torch-free.

``open_zero12_checkpoint`` lists the rank files (names in ``zero12.files``), parses their pickles with
``read_structure`` (no ``torch.load``, no tensor data read except the steps' few bytes) and refuses what it
would read wrongly; ``read_zero12`` describes what they hold. Scalars follow ``readers.deepspeed_scalars``.

What DeepSpeed 0.19 writes (``runtime/zero/stage_1_and_2.py``, ``state_dict``; read as DeepSpeed's
``zero_to_fp32._zero2_merge_trainable_params`` does): per param group, a flat buffer holds the parameters
of ``param_shapes[g]`` in order (``round_robin_gradients`` off), each followed by its
``param_alignment_paddings[g]`` entry, then zero padding up to a multiple of ``2 * world_size``
(``nccl_start_alignment_factor``); it is cut into ``world_size`` partitions of P elements
(``get_data_parallel_partitions``). Rank r holds buffer elements ``[r * P, r * P + P)``, under
``optimizer_state_dict``:

- ``single_partition_of_fp32_groups[g]``: its fp32 masters *without* the tail padding
  (``_get_groups_without_padding``: ``P - group_paddings[g]`` elements);
- ``base_optimizer_state["state"][param id of group g]``: torch's per-element states (``exp_avg``,
  ``exp_avg_sq``) of the whole partition, padding included (P elements);
- ``partition_count``, ``param_slice_mappings`` and the scalars (``loss_scaler``, ``clip_grad``...).

So a parameter at buffer offset o with n elements is, on rank r, elements ``[max(o, rP), min(o+n,
rP+P))`` at ``(that - rP)`` of either tensor. Frozen parameters (ZeRO-2 only: DeepSpeed records them
when gradients are partitioned) are whole tensors in ``frozen_param_fragments`` of the model-states
file; under ZeRO-1 they are read from its ``module`` (the training dtype's value, which is never
updated). Buffers are ``module`` entries named in ``buffer_names``; tied parameters are stored once
(``shared_params``: ``{alias: holder}``).

Beside ``deepspeed_scalars``' keys, ``scalars["native"]`` keeps rank 0's optimizer file and the model-states
file as parsed (``optim_file``, ``model_states``, the files' ``prefix``): what ``writers.zero12``'s same-run
target writes back key for key (the reshard). A rank tensor that is not a contiguous run of its dtype in its
file (no DeepSpeed save writes one) makes its parameters' tensors torch loaders, with a note naming it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardkit.checkpoint.layout.deepspeed_files import mixed_stages
from shardkit.checkpoint.model.checkpoint import TrainingCheckpoint
from shardkit.checkpoint.model.tensors import Piece, SourceTensor
from shardkit.checkpoint.readers.deepspeed_scalars import (
    agreed_steps,
    as_dict,
    per_parameter_steps,
    run_scalars,
    training_precision,
)
from shardkit.checkpoint.readers.zero3 import MOE_MARKERS, contiguous_offset
from shardkit.checkpoint.readers.zero12_place import check_group_places
from shardkit.checkpoint.zero12.files import MODEL_FILE, OPTIM_FILE_PATTERN, OPTIMIZER_KEY, tensor_from_ref
from shardkit.core.errors import CheckpointError
from shardkit.storage.listing import FolderListing, list_folder
from shardkit.storage.torch_load import TensorRef, read_structure

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class _Rank:
    path: Path
    fp32: list[TensorRef]
    """``single_partition_of_fp32_groups``: the unpadded fp32 slice of each group."""
    states: list[dict[str, Any]]
    """Each group's ``base_optimizer_state`` entry (``exp_avg``... over the padded partition)."""
    paddings: list[int]
    """``group_paddings``: the tail padding cut from each group's fp32 slice on this rank."""
    mappings: Any
    """``param_slice_mappings``: per group, where each parameter's fragment lies in this rank's partition."""


@dataclass(frozen=True)
class Zero12Layout:
    """Where each trainable parameter sits in the source's flat param groups, known from the model-states file
    and rank 0's optimizer file alone: DeepSpeed cuts every group into ``world_size`` equal partitions of P
    elements (``get_data_parallel_partitions``), rank r holding ``[rP, rP + P)``."""

    world_size: int
    partitions: list[int]
    """P of each param group (rank 0's fp32 slice + its ``group_paddings``)."""
    offsets: dict[str, tuple[int, int]]
    """Each trainable parameter's param group and offset in that group's flat buffer."""

    def ranks_holding(self, name: str, lo: int, hi: int) -> range:
        """The source ranks whose files hold elements ``[lo, hi)`` of trainable parameter ``name``."""
        group, at = self.offsets[name]
        size = self.partitions[group]
        if hi <= lo or not size:
            return range(0)
        return range((at + lo) // size, min(self.world_size, (at + hi - 1) // size + 1))


def zero12_layout(ckpt: TrainingCheckpoint) -> Zero12Layout:
    """The layout ``read_zero12`` found (also when it parsed rank 0's file only: ``ranks=()``)."""
    layout = (ckpt.scalars.get("native") or {}).get("layout")
    if not isinstance(layout, Zero12Layout):
        raise CheckpointError(f"{ckpt.folder}: a {ckpt.format} checkpoint not described by the ZeRO-1/2 reader")
    return layout


@dataclass
class OpenedZero12:
    """One ZeRO-1/2 tag folder, its rank files listed and checked, their pickles parsed without torch
    (``read_structure``: every tensor a ``TensorRef``, its bytes never read)."""

    tag_dir: Path
    stage: int
    world_size: int
    """Data-parallel ranks that wrote it (one optimizer file each)."""
    prefix: str
    """``bf16_`` when DeepSpeed named the optimizer files for bf16, else empty."""
    optim_files: list[Path]
    optim_states: list[dict[str, Any]]
    """The whole optimizer file (``optimizer_state_dict``, ``ds_config``, ``ds_version``) of each of ``parsed_ranks``."""
    model_state: dict[str, Any]
    """The model-states file (module weights as ``TensorRef``s, ``param_shapes``, ``dp_world_size``...)."""
    ds_config: dict[str, Any]
    precision: str
    """'bf16', 'fp16' or 'fp32': what ``ds_config`` trained in."""
    parsed_ranks: list[int]
    """The ranks whose optimizer files were parsed (``optim_states``, in this order): every rank unless the opener
    was given ``ranks``."""


def open_zero12_checkpoint(tag_dir: Path, ranks: Collection[int] | None = None,
                           listing: FolderListing | None = None) -> OpenedZero12:
    """Open ``tag_dir`` (a ZeRO-1/2 tag folder); raises CheckpointError naming the file for a missing rank,
    a stage other than 1/2, ranks that disagree, or a layout the repartition cannot move
    (``round_robin_gradients``, an elastic optimizer state). The pickles only are parsed (``read_structure``,
    no torch), for ``read_zero12`` (and the benchmarks that time it). ``ranks``: parse only rank 0's and
    these ranks' optimizer files (a resuming rank's share; every file is still listed, none other opened).
    ``listing``: of ``tag_dir``, already taken by the caller (a resuming rank lists its tag folder once)."""
    found: dict[int, Path] = {}
    prefixes, other = set(), []
    names = listing.names if listing is not None and listing.describes(tag_dir) else list_folder(tag_dir).names
    for name in names:  # names, not Paths: a resuming rank lists thousands of files and opens 3
        m = OPTIM_FILE_PATTERN.match(name)
        if m:
            found[int(m.group(2))] = tag_dir / name
            prefixes.add(m.group(1) or "")
        elif any(k in name for k in MOE_MARKERS):
            other.append(name)
    mixed = mixed_stages(tag_dir, names)  # the words inspect lists it with
    if mixed is not None:
        raise CheckpointError(mixed.message())
    if other:
        raise CheckpointError(
            f"{tag_dir}: holds {', '.join(sorted(other)[:3])} beside the ZeRO-1/2 files: DeepSpeed MoE expert files "
            "(weights the data-parallel rank files do not hold). Nothing was read; pass a folder one ZeRO-1/2 save "
            "wrote without expert parallelism")
    world = len(found)
    if world == 0 or sorted(found) != list(range(world)) or len(prefixes) != 1:
        # the missing ranks named, not every rank found (a folder may hold thousands)
        gaps = sorted(set(range(max(found, default=0) + 1)) - set(found))
        what = f"rank(s) {gaps[:5]} missing" if gaps else "every rank present"
        raise CheckpointError(
            f"{tag_dir}: {len(found)} optimizer file(s), {what} (prefixes {sorted(prefixes)}), "
            "expected ranks 0..N-1 with one naming: a rank's file is missing or two saves were mixed in one folder. "
            "Re-copy the tag folder")
    optim_files = [found[r] for r in range(world)]
    parsed = list(range(world)) if ranks is None else sorted({0, *ranks})
    if parsed[-1] >= world or parsed[0] < 0:
        raise CheckpointError(f"{tag_dir}: rank files {parsed} asked for, but the folder holds ranks 0..{world - 1}")
    states = [read_structure(optim_files[r]) for r in parsed]
    model_state = read_structure(tag_dir / MODEL_FILE)
    config = dict(model_state.get("ds_config") or {})
    ckpt = OpenedZero12(tag_dir=tag_dir, stage=0, world_size=world, prefix=prefixes.pop(), optim_files=optim_files,
                        optim_states=states, model_state=model_state, ds_config=config,
                        precision=training_precision(config), parsed_ranks=parsed)
    ckpt.stage = _check_ranks(ckpt)
    return ckpt


def _check_ranks(ckpt: OpenedZero12) -> int:
    stages: set[object] = set()
    files = [ckpt.optim_files[r] for r in ckpt.parsed_ranks]
    for path, state in zip(files, ckpt.optim_states):
        sd = state.get(OPTIMIZER_KEY) if isinstance(state, dict) else None
        if not isinstance(sd, dict) or not isinstance(sd.get("single_partition_of_fp32_groups"), list):
            raise CheckpointError(f"{path}: no optimizer_state_dict.single_partition_of_fp32_groups: not a ZeRO-1/2 "
                                  "optimizer file (a ZeRO-3 or a damaged file?). Pass the tag folder DeepSpeed saved")
        if "zero_stage" not in sd:
            raise CheckpointError(
                f"{path}: no optimizer_state_dict.zero_stage: a BF16_Optimizer save (ZeRO-1 with bf16 and no offload), "
                "whose flat groups are laid out without the records this reader uses. Convert it with DeepSpeed's "
                "ds_to_universal, or save with ZeRO-2")
        stages.add(getattr(sd["zero_stage"], "value", sd["zero_stage"]))
        counts = sd.get("partition_count")
        if list(counts or []) != [ckpt.world_size] * len(sd["single_partition_of_fp32_groups"]):
            raise CheckpointError(f"{path}: partition_count is {counts}, but the folder holds {ckpt.world_size} rank "
                                  "files: ranks of different saves were mixed, or a rank file is missing")
        if not isinstance(sd.get("base_optimizer_state"), dict):
            raise CheckpointError(
                f"{path}: base_optimizer_state is a per-group list (an elastic_checkpoint save), which the repartition "
                "does not move. Convert it with DeepSpeed's ds_to_universal and resume with checkpoint.load_universal")
    only = next(iter(stages)) if len(stages) == 1 else None
    if not isinstance(only, int) or only not in (1, 2):
        # name the files that differ from rank 0's (a few: the folder may hold thousands)
        seen = [getattr(s[OPTIMIZER_KEY]["zero_stage"], "value", s[OPTIMIZER_KEY]["zero_stage"]) for s in ckpt.optim_states]
        odd = [f"{p.name} records {v}" for p, v in zip(files, seen) if v != seen[0]][:3]
        mixed = (f" ({', '.join(odd)}, {ckpt.optim_files[0].name} {seen[0]}): files of saves of different stages are "
                 "mixed in one folder; copy the tag folder again from one save") if odd else ""
        raise CheckpointError(f"{ckpt.tag_dir}: zero_stage is {sorted(map(str, stages))} across the rank files, expected "
                              f"one of 1 or 2 for this reader{mixed}")
    zero = ckpt.ds_config.get("zero_optimization") or {}
    if zero.get("round_robin_gradients"):
        raise CheckpointError(
            f"{ckpt.tag_dir}: saved with zero_optimization.round_robin_gradients: true, whose parameter order inside "
            "the flat groups depends on the world size; shardkit does not move that order. Convert it with DeepSpeed's "
            "ds_to_universal and resume with checkpoint.load_universal")
    return only


def read_zero12(tag_dir: Path, ranks: Collection[int] | None = None,
                listing: FolderListing | None = None) -> TrainingCheckpoint:
    """Describe the ZeRO-1/2 tag folder ``tag_dir`` (already verified by the caller): weights, Adam
    moments per trainable parameter, scalars. Raises CheckpointError, naming the file and the key, for
    a layout it would read wrongly (round_robin_gradients, an elastic save, a BF16_Optimizer save, ranks
    that disagree, ZeRO-3 files beside, MoE expert files); nothing is read beyond small pickles then.

    ``ranks``: parse only rank 0's optimizer file (the layout, the scalars) and these ranks' (a resuming rank's
    share: the in-process resume at 2,048 source ranks parsed every file on every rank, 1.9 s each). Tensors
    then have pieces in those files only: ``covered()`` is False for one that reaches into another (writers
    refuse it), and ``zero12_layout(ckpt).ranks_holding`` says which ranks a range needs. Each file parsed is
    checked against rank 0's (stage, partition_count, partition size, Adam step); the others are only listed.
    ``listing``: of ``tag_dir``, taken by the caller (``storage.listing``), or None to list it here."""
    # the files found and checked (rank files, stage, mixed saves, round_robin_gradients, elastic and
    # BF16_Optimizer saves), parsed without torch
    opened = open_zero12_checkpoint(tag_dir, ranks, listing)
    optims, model, stage = opened.optim_states, opened.model_state, opened.stage
    optim_files = [opened.optim_files[r] for r in opened.parsed_ranks]
    model_path = tag_dir / MODEL_FILE
    if not isinstance(model, dict) or "param_shapes" not in model:
        raise CheckpointError(f"{model_path}: no param_shapes: not a DeepSpeed ZeRO-1/2 model-states file. Pass the tag "
                              "folder a ZeRO-1/2 engine.save_checkpoint wrote")
    config = opened.ds_config
    world, every = opened.world_size, len(opened.parsed_ranks) == opened.world_size
    parsed = {r: _Rank(p, o[OPTIMIZER_KEY]["single_partition_of_fp32_groups"], _group_states(p, o[OPTIMIZER_KEY]),
                       [int(x) for x in o[OPTIMIZER_KEY].get("group_paddings") or []],
                       o[OPTIMIZER_KEY].get("param_slice_mappings"))
              for r, p, o in zip(opened.parsed_ranks, optim_files, optims)}
    files = list(parsed.values())
    shapes: list[dict[str, Any]] = list(model["param_shapes"] or [])
    rank0 = optims[0][OPTIMIZER_KEY]
    if len(shapes) != len(files[0].fp32):
        raise CheckpointError(f"{model_path}: param_shapes has {len(shapes)} groups, {optim_files[0].name} "
                              f"{len(files[0].fp32)}: the model states and optimizer files are of different saves")

    weights: dict[str, SourceTensor] = {}
    optimizer: dict[str, dict[str, SourceTensor]] = {}
    via_torch: dict[str, None] = {}  # notes on rank tensors read through torch (``_tensor``), once each
    frozen, buffers = _add_frozen_and_buffers(model, model_path, stage, shapes, weights)
    paddings = rank0.get("param_alignment_paddings")
    layout = Zero12Layout(world, [], {})
    for g, group in enumerate(shapes):
        pads = [int(x) for x in (paddings[g] if paddings is not None else [0] * len(group))]
        partition = _partition(tag_dir, g, files)
        params, offset = [], 0
        for (name, shape), pad in zip(group.items(), pads):
            params.append((name, tuple(int(d) for d in shape), offset))
            layout.offsets[name] = (g, offset)
            offset += math.prod(shape) + pad
        layout.partitions.append(partition)
        # each file holds its own rank's partition (a copied or swapped rank file agrees on every size)
        check_group_places(tag_dir, g, partition, offset, params,
                           {r: (rank.path, rank.paddings[g], rank.mappings) for r, rank in parsed.items()}, world)
        # all files parsed: their slices add up to the data exactly; a share of them: the data fits the partitions
        held = sum(r.fp32[g].numel for r in files) if every else partition * world
        if len(pads) != len(group) or (offset != held if every else offset > held):
            raise CheckpointError(
                f"{tag_dir}: param group {g}: the ranks hold {held} fp32 elements, param_shapes and "
                f"param_alignment_paddings say {offset}: a layout this reader does not know; nothing was written")
        # each rank's tensors listed once per group (not per parameter: that too was parameters x ranks)
        fp32_refs = {r: (rank.path, rank.fp32[g]) for r, rank in parsed.items()}
        state_refs = {key: (ref.dtype, {r: (rank.path, rank.states[g].get(key)) for r, rank in parsed.items()})
                      for key, ref in files[0].states[g].items() if isinstance(ref, TensorRef) and ref.shape == (partition,)}
        for name, shape, at in params:
            weights[name] = _tensor(name, "float32", shape, at, partition, world, fp32_refs,
                                    f"single_partition_of_fp32_groups[{g}]", via_torch)
            optimizer[name] = {key: _tensor(name, dtype, shape, at, partition, world, refs,
                                            f"base_optimizer_state.state[{g}].{key}", via_torch)
                               for key, (dtype, refs) in state_refs.items()}
    precision = opened.precision
    aliases = {str(k): str(v) for k, v in (model.get("shared_params") or {}).items()}
    scalars = _scalars(model, config, stage, precision, rank0, files, shapes)
    # the source's own dicts, for a writer of this format that keeps them key for key (the reshard: writers.zero12
    # SameRun); what read_structure parsed, tensors as TensorRefs
    scalars["native"] = {"optim_file": optims[0], "model_states": model, "prefix": opened.prefix, "layout": layout}
    return TrainingCheckpoint(
        f"zero{stage}", tag_dir, _model_order(model, weights), world_size=world, tag=tag_dir.name, precision=precision,
        aliases=aliases, frozen=frozen, buffers=buffers, optimizer=optimizer, optimizer_described=True,
        scalars=scalars,
        notes=[f"ZeRO-{stage} checkpoint {tag_dir} (saved by {world} rank(s), {precision} training): fp32 masters read"
               + ("" if every else f" from {len(parsed)} of the {world} rank files (rank(s) {few(list(parsed))})"),
               *via_torch])


def _group_states(path: Path, sd: dict[str, Any]) -> list[dict[str, Any]]:
    """Each param group's optimizer state (by the group's one flat parameter id)."""
    base = sd["base_optimizer_state"]
    groups, state = base.get("param_groups") or [], base.get("state") or {}
    out = []
    for g, group in enumerate(groups):
        ids = group.get("params") or []
        entry = state.get(ids[0]) if len(ids) == 1 else None
        if len(ids) != 1:
            raise CheckpointError(f"{path}: base_optimizer_state param group {g} has {len(ids)} parameters, expected the "
                                  "one flat partition DeepSpeed gives each group; the file is not a ZeRO-1/2 save")
        out.append(dict(entry) if isinstance(entry, dict) else {})
    if len(out) != len(sd["single_partition_of_fp32_groups"]):
        raise CheckpointError(f"{path}: base_optimizer_state has {len(out)} param groups, single_partition_of_fp32_groups "
                              f"{len(sd['single_partition_of_fp32_groups'])}: the file is damaged")
    return out


def _partition(tag_dir: Path, g: int, ranks: list[_Rank]) -> int:
    """Group ``g``'s partition size P (unpadded slice + its padding, the same on every rank)."""
    sizes = set()
    for rank in ranks:
        ref = rank.fp32[g]
        if not isinstance(ref, TensorRef) or ref.dtype != "float32" or len(rank.paddings) <= g:
            raise CheckpointError(f"{rank.path}: single_partition_of_fp32_groups[{g}] is {ref!r} with group_paddings "
                                  f"{rank.paddings}, expected a float32 tensor and its padding: the file is damaged or "
                                  "not a ZeRO-1/2 save")
        sizes.add(ref.numel + rank.paddings[g])
    if len(sizes) != 1:
        raise CheckpointError(f"{tag_dir}: param group {g}: the ranks' partitions are {sorted(sizes)} elements (slice + "
                              "group_paddings), expected one size: rank files of different saves were mixed")
    return sizes.pop()


def _tensor(name: str, dtype: str, shape: tuple[int, ...], at: int, partition: int, world: int,
            refs: dict[int, tuple[Path, Any]], where: str, via_torch: dict[str, None]) -> SourceTensor:
    """The parameter at buffer offset ``at`` as pieces of the ranks' tensors (rank r: buffer [rP, rP + P));
    of the ranks in ``refs`` only (the files parsed): the rest of it is left undescribed.
    Where a rank's tensor ``where`` is not a contiguous run of ``dtype`` in its file (no DeepSpeed save writes
    one; another tool might), the parameter is read through torch instead (``load``), and ``via_torch`` says so."""
    numel = math.prod(shape)
    t = SourceTensor(name, dtype, shape)
    held: list[tuple[TensorRef, int, int]] = []
    # only the ranks whose partition the parameter overlaps (an empty group's: none): looping over every
    # rank made the reader's work parameters x ranks (0.3 s of pieces for 21 tensors at 2,048 source ranks)
    overlapped = range(at // partition, min(world, (at + numel - 1) // partition + 1)) if partition else range(0)
    for r in overlapped:
        if r not in refs:
            continue
        path, ref = refs[r]
        lo, hi = max(at, r * partition), min(at + numel, (r + 1) * partition)
        if lo >= hi:
            continue
        if not isinstance(ref, TensorRef) or ref.numel < hi - r * partition:
            raise CheckpointError(f"{path}: the tensor holding {name!r} here is {ref!r}, expected {dtype} with at least "
                                  f"{hi - r * partition} elements: rank files of different saves, or a damaged file")
        held.append((ref, lo - r * partition, hi - r * partition))
        if ref.dtype != dtype or len(ref.shape) != 1 or not ref.is_contiguous() or ref.file_offset is None:
            via_torch[f"{path}: {where} is not a contiguous run of {dtype} in its file ({ref.dtype}, shape "
                      f"{list(ref.shape)}, stride {list(ref.stride)}): read through torch"] = None
        else:
            t.add(Piece(path, ref.file_offset + (lo - r * partition) * ref.itemsize, lo - at, hi - lo))
    if len(t.pieces) < len(held):
        t.pieces, t.load = [], functools.partial(_load_with_torch, held, dtype, shape)
    return t


def _load_with_torch(held: list[tuple[TensorRef, int, int]], dtype: str, shape: tuple[int, ...]) -> "torch.Tensor":
    """The parameter from elements [lo, hi) of each rank's tensor, read and cast with torch."""
    import torch  # lazy: only a source the byte ranges cannot describe

    parts = [tensor_from_ref(ref).reshape(-1)[lo:hi] for ref, lo, hi in held]
    return torch.cat(parts).to(getattr(torch, dtype)).reshape(shape)


def _add_frozen_and_buffers(model: dict[str, Any], path: Path, stage: int, shapes: list[dict[str, Any]],
                            weights: dict[str, SourceTensor]) -> tuple[set[str], set[str]]:
    """Frozen parameters and buffers into ``weights``; returns their names."""
    module = as_dict(model.get("module"))
    fragments = model.get("frozen_param_fragments") or {}
    trainable = {n for group in shapes for n in group}
    aliases = set((model.get("shared_params") or {}).keys())
    buffer_names = list(model.get("buffer_names") or [])
    if model.get("frozen_param_shapes") is not None:
        frozen_refs = dict(fragments)
    else:  # ZeRO-1 records none: the module's parameters the optimizer does not hold
        frozen_refs = {n: v for n, v in module.items()
                       if n not in trainable and n not in buffer_names and n not in aliases and isinstance(v, TensorRef)}
    for name, ref in frozen_refs.items():
        if not isinstance(ref, TensorRef):
            raise CheckpointError(f"{path}: frozen parameter {name!r} is {type(ref).__name__}, not a tensor: damaged file")
        weights[name] = SourceTensor(name, ref.dtype, ref.shape, [Piece(path, contiguous_offset(ref), 0, ref.numel)])
    buffers = set()
    for name in buffer_names:
        ref = module.get(name)
        if isinstance(ref, TensorRef):
            weights[name] = SourceTensor(name, ref.dtype, ref.shape, [Piece(path, contiguous_offset(ref), 0, ref.numel)])
            buffers.add(name)
    return set(frozen_refs), buffers


def _model_order(model: dict[str, Any], weights: dict[str, SourceTensor]) -> dict[str, SourceTensor]:
    """``weights`` in the module's state-dict order (then anything the module does not list)."""
    module = as_dict(model.get("module"))
    ordered = {n: weights[n] for n in module if n in weights}
    ordered.update({n: t for n, t in weights.items() if n not in ordered})
    return ordered


def few(items: list[Any], shown: int = 4) -> str:
    """The first ``shown`` of ``items`` for a message (a folder may hold thousands of ranks), then how many."""
    return ", ".join(map(str, items[:shown])) + (f" ... ({len(items)})" if len(items) > shown else "")


def _scalars(model: dict[str, Any], config: dict[str, Any], stage: int, precision: str, sd: dict[str, Any],
             ranks: list[_Rank], shapes: list[dict[str, Any]]) -> dict[str, Any]:
    """The scalars in ``readers.deepspeed_scalars``' words: ``step`` per parameter (from its param group),
    the param groups with their parameters' names, the loss scaler, and rank 0's run values."""
    steps = agreed_steps([(str(r.path), r.states) for r in ranks])  # one step per group, the same on every rank
    names = [list(group) for group in shapes]
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": names[g]}
              for g, group in enumerate(sd["base_optimizer_state"].get("param_groups") or [])]
    return run_scalars(model, config, sd, zero_stage=stage, ds_version=model.get("ds_version"), precision=precision,
                       step=per_parameter_steps(names, steps), param_groups=groups, clip_grad=sd.get("clip_grad"))
