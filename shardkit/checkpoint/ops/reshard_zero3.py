"""The ZeRO-3 reshard as one composition: the ZeRO-3 reader (``readers.zero3``: every tensor and optimizer
state as pieces of the rank files, computed from the layout; rank 0's own dicts kept) -> ``TrainingCheckpoint``
-> the ZeRO-3 writer for the same run (``writers.zero3_same_run``) at the sub-groups DeepSpeed builds at the new
world size (``zero3.repartition.layout_of``).

``reshard.reshard_checkpoint`` runs the rest as for ZeRO-1/2 (``reshard_zero12``): each launched process writes its
share of the jobs returned here, the source's digests are checked while writing, and a layout that does not
change (same world size, same sub-groups) is a byte copy of the rank files.
"""

from __future__ import annotations

from pathlib import Path

from shardkit.checkpoint.ops.reshard_source import PlannedReshard
from shardkit.checkpoint.readers.zero3 import read_zero3
from shardkit.checkpoint.writers.zero3_same_run import OutputFile, Zero3SameRun
from shardkit.checkpoint.zero3.checkpoint import ParamSlot
from shardkit.checkpoint.zero3.repartition import TargetLayout, client_state_note, layout_of


def plan_zero3_reshard(tag_dir: Path, world_size: int, sub_group_size: int | None) -> PlannedReshard[OutputFile]:
    """The ZeRO-3 tag folder ``tag_dir`` planned at ``world_size`` ranks (nothing written yet). Its rank files are
    parsed when a job first needs their pieces (a process of a split run parses the few its share reads); one from
    another save is named then, before anything is published."""
    ckpt = read_zero3(tag_dir, lazy=True)
    native = ckpt.scalars["native"]
    source = ckpt.scalars["source"]
    slots: list[ParamSlot] = native["slots"]
    saved = ckpt.world_size or 0
    layout = layout_of(slots, world_size, sub_group_size, source["ds_config"], tag_dir)
    unchanged = _layout_unchanged(slots, native["sub_group_param_group"], saved, layout)
    note = client_state_note(native["model_states"], saved, world_size)
    # a copied rank file is checked as the reader checks the files it parses (a copy reads no pieces)
    rank_of = {path: r for files in (native["optim_files"], native["model_files"]) for r, path in enumerate(files)}
    return PlannedReshard(
        tag_dir=tag_dir, stage=3, world_size=saved, precision=ckpt.precision, ds_config=dict(source["ds_config"] or {}),
        ds_version=source["ds_version"], optim_files=native["optim_files"], model_files=native["model_files"],
        model_state=native["model_states"], unchanged=unchanged,
        jobs=[] if unchanged else Zero3SameRun(ckpt, layout).files(), notes=[note] if note else [],
        check_copied=lambda path: native["check_rank"](rank_of[path]))


def _layout_unchanged(slots: list[ParamSlot], owners: list[int], saved_world: int, layout: TargetLayout) -> bool:
    """True when the new layout is the source's own: same world size, same sub-groups and offsets."""
    if layout.world_size != saved_world or layout.sub_group_param_group != owners:
        return False
    new = [(j, tp.source.name, tp.offset) for j, params in enumerate(layout.sub_groups) for tp in params]
    return new == [(s.sub_group, s.name, s.offset) for s in slots]
