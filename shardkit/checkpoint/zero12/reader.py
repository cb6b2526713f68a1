"""Open a DeepSpeed ZeRO-1/2 tag folder: its rank files, and the small facts a repartition plans from.

What DeepSpeed 0.19 writes (``runtime/zero/stage_1_and_2.py``, ``state_dict``): per rank, under
``optimizer_state_dict``, ``single_partition_of_fp32_groups`` (that rank's slice of each param group's
flat fp32 masters, *without* its alignment padding: ``_get_groups_without_padding``), ``group_paddings``
(how much of that rank's partition was padding), ``base_optimizer_state`` (torch's ``optimizer.state_dict()``
of the flat partitions, moments *with* their padding, one flat parameter per group), ``partition_count``,
``param_alignment_paddings``, ``param_slice_mappings`` and the scalars (``loss_scaler``, ``clip_grad``...).
A group's flat buffer is its parameters in order (``round_robin_gradients`` off), each followed by its
``param_alignment_paddings`` entry, then zero padding up to a multiple of ``2 * world_size``
(``nccl_start_alignment_factor``), cut into ``world_size`` equal partitions (``get_data_parallel_partitions``).
So the old ranks' unpadded slices, concatenated, are the world-size-free part of the buffer.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardkit.core.errors import CheckpointError
from shardkit.storage.torch_load import TensorRef, read_structure

if TYPE_CHECKING:
    import torch

OPTIM_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
#: ZeRO-3's per-rank model-states files: beside ZeRO-1/2 files they mean two saves in one folder.
_ZERO3_MODEL_FILE = re.compile(r"^zero_pp_rank_\d+_mp_rank_\d+_model_states\.pt$")
#: DeepSpeed MoE expert files: expert-parallel weights outside the data-parallel rank files.
_MOE_MARKERS = ("expp_rank_", "_expert_")
MODEL_FILE = "mp_rank_00_model_states.pt"
OPTIMIZER_KEY = "optimizer_state_dict"


@dataclass
class Zero12Checkpoint:
    """One ZeRO-1/2 tag folder, its rank files' pickles parsed without torch (``read_structure``: every tensor a
    ``TensorRef``, its bytes never read)."""

    tag_dir: Path
    stage: int
    world_size: int
    """Data-parallel ranks that wrote it (one optimizer file each)."""
    prefix: str
    """``bf16_`` when DeepSpeed named the optimizer files for bf16, else empty."""
    optim_files: list[Path]
    model_files: list[Path]
    optim_states: list[dict[str, Any]]
    """The whole optimizer file (``optimizer_state_dict``, ``ds_config``, ``ds_version``) of each of ``parsed_ranks``."""
    model_state: dict[str, Any]
    """The model-states file (module weights as ``TensorRef``s, ``param_shapes``, ``dp_world_size``...)."""
    ds_config: dict[str, Any] = field(default_factory=dict)
    ds_version: str | None = None
    precision: str = "fp32"
    parsed_ranks: list[int] = field(default_factory=list)
    """The ranks whose optimizer files were parsed (``optim_states``, in this order): every rank unless the opener
    was given ``ranks``."""


def is_zero12_folder(tag_dir: Path) -> bool:
    """True when ``tag_dir`` holds a ZeRO-1/2 layout: rank optimizer files and one ``mp_rank_00`` model file."""
    return (tag_dir / MODEL_FILE).is_file() and any(OPTIM_FILE.match(p.name) for p in tag_dir.iterdir())


def training_precision(config: dict[str, Any]) -> str:
    """'bf16', 'fp16' or 'fp32': the precision the DeepSpeed config ``config`` trained in."""
    for key in ("bf16", "fp16"):
        section = config.get(key)
        if isinstance(section, dict) and section.get("enabled"):
            return key
    return "fp32"


def open_zero12_checkpoint(tag_dir: Path, ranks: Collection[int] | None = None) -> Zero12Checkpoint:
    """Open ``tag_dir`` (a ZeRO-1/2 tag folder); raises CheckpointError naming the file for a missing rank,
    a stage other than 1/2, ranks that disagree, or a layout the repartition cannot move
    (``round_robin_gradients``, an elastic optimizer state). The pickles only are parsed (``read_structure``,
    no torch), for the reader of the checkpoint model (``readers.zero12``). ``ranks``: parse only rank 0's and
    these ranks' optimizer files (a resuming rank's share; every file is still listed, none other opened)."""
    found: dict[int, Path] = {}
    prefixes, other = set(), []
    for name in os.listdir(tag_dir):  # names, not Paths: a resuming rank lists thousands of files and opens 3
        m = OPTIM_FILE.match(name)
        if m:
            found[int(m.group(2))] = tag_dir / name
            prefixes.add(m.group(1) or "")
        elif _ZERO3_MODEL_FILE.match(name) or any(k in name for k in _MOE_MARKERS):
            other.append(name)
    if other:
        raise CheckpointError(
            f"{tag_dir}: holds {', '.join(sorted(other)[:3])} beside the ZeRO-1/2 files: ZeRO-3 rank files (two saves "
            "of different stages mixed in one folder) or DeepSpeed MoE expert files (weights the data-parallel rank "
            "files do not hold). Nothing was read; pass a folder one ZeRO-1/2 save wrote")
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
    ckpt = Zero12Checkpoint(tag_dir=tag_dir, stage=0, world_size=world, prefix=prefixes.pop(), optim_files=optim_files,
                            model_files=[tag_dir / MODEL_FILE], optim_states=states, model_state=model_state,
                            ds_config=dict(model_state.get("ds_config") or {}),
                            ds_version=model_state.get("ds_version"), parsed_ranks=parsed)
    ckpt.precision = training_precision(ckpt.ds_config)
    ckpt.stage = _check_ranks(ckpt)
    return ckpt


def _check_ranks(ckpt: Zero12Checkpoint) -> int:
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


def tensor_from_ref(ref: TensorRef) -> "torch.Tensor":
    """The tensor ``ref`` describes, read with torch from its file: its storage record, then the view (any
    stride or offset). For what byte ranges cannot express: a strided view some tool saved, a cast."""
    import torch  # lazy: only a source the byte ranges cannot describe pays for torch

    if ref.path is None:
        raise CheckpointError(f"{ref!r} was not read from a file: its bytes are unknown")
    with open(ref.path, "rb") as fh:
        fh.seek(ref.record_offset)
        raw = bytearray(fh.read(ref.record_nbytes))
    dtype = getattr(torch, ref.dtype)
    storage = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
    return storage.as_strided(ref.shape, ref.stride, ref.storage_offset)
