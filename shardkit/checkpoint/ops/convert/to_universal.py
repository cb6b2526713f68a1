"""``convert --to universal``: any checkpoint whose reader describes the optimizer (``readers.registry``:
ZeRO-1/2/3, FSDP2/DCP, FSDP1 sharded/full) -> a DeepSpeed universal checkpoint, which DeepSpeed's
``engine.load_checkpoint(OUT)`` with ``checkpoint.load_universal: true`` resumes at any data-parallel size
(``writers.universal`` says what it holds). The composition: resolve the source, verify it, read it
through the registry, refuse what the writer or DeepSpeed's universal load cannot carry, write into a
staging folder and seal it (``atomic_checkpoint``: ``OUT/<tag>``, its manifest, ``OUT/latest``), then
point ``OUT/latest_universal`` (the pointer DeepSpeed reads with ``load_universal``) at the tag.

A universal source is refused (it is universal already). Bit-exactness: the fp32 masters and both
moments are written as float32 tensors, bit for bit from float32 sources.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardkit.checkpoint.layout.detect import LATEST_UNIVERSAL
from shardkit.checkpoint.layout.support import refuse_unsupported
from shardkit.checkpoint.model.checkpoint import TrainingCheckpoint
from shardkit.checkpoint.ops.convert.result import ConvertResult
from shardkit.checkpoint.ops.convert.to_zero3_plan import check_adam, single_adam_step, source_param_groups
from shardkit.checkpoint.ops.export.sources import resolve_source
from shardkit.checkpoint.readers.registry import read_checkpoint
from shardkit.checkpoint.writers.universal import universal_state_keys, write_universal_files
from shardkit.checkpoint.zero3.layout import DEEPSPEED_MODEL_KEYS
from shardkit.config.loading import config_digest
from shardkit.core.errors import CheckpointError, UsageError
from shardkit.storage.atomic import os_errors_named, write_latest
from shardkit.storage.pipeline import check_output_root, output_tag, verify_before_reading, warn_unverified
from shardkit.storage.shared_save import launch_from_env
from shardkit.storage.staged_save import atomic_checkpoint
from shardkit.storage.verify import refuse_links_leaving


@os_errors_named("converting the checkpoint")
def convert_to_universal(
    source: str | Path,
    output: str | Path,
    *,
    tag: str | None = None,
    force: bool = False,
    verify: bool = True,
    warn: Callable[[str], None] | None = None,
) -> ConvertResult:
    """Write ``source`` as the DeepSpeed universal checkpoint ``output/<tag>`` (+ ``output/latest``,
    ``output/latest_universal``, a manifest) for ``engine.load_checkpoint(output)`` with
    ``checkpoint.load_universal: true`` at any data-parallel size.

    ``output`` follows reshard's rules (new, empty or a shardkit checkpoint folder; an existing tag only
    with ``force``). Everything refused is refused before anything is written."""
    launch = launch_from_env()
    if launch.distributed:
        raise UsageError(f"convert --to universal runs in one process, and {launch.launcher} started {launch.world}: "
                         "run shardkit convert once, without srun/torchrun")
    warn = warn or warn_unverified
    refuse_unsupported(source, "convert --to universal")  # a layout nothing converts correctly: before any tensor
    found = resolve_source(source)
    tag_dir = found.tag_dir
    if found.kind == "universal":  # the same format: DeepSpeed already resumes it at any world size
        raise UsageError(f"{tag_dir}: is a DeepSpeed universal checkpoint already; DeepSpeed resumes it at any world "
                         "size as it is (checkpoint.load_universal: true), so there is nothing to convert. For "
                         "per-rank files: --to zero3 (or zero2/zero1) --world-size N; for FSDP2: --to fsdp2")
    tag = output_tag(tag, source, tag_dir, tag_dir.name)
    root = Path(output)
    check_output_root(root, tag, tag_dir, force=force)
    checked = verify_before_reading(tag_dir, checksums=verify)
    refuse_links_leaving(tag_dir, "convert")
    for note in checked.warnings:
        warn(note)

    ckpt = read_checkpoint(found.kind, tag_dir)
    if not ckpt.optimizer_described:
        raise CheckpointError(
            f"{tag_dir}: shardkit's {found.kind} reader describes this checkpoint's weights only, not its optimizer "
            "state, and a universal checkpoint holds every parameter's fp32 master and Adam moments; convert --to "
            "universal takes the kinds whose reader describes the optimizer (`shardkit inspect` says which). For the "
            "weights alone: shardkit export")
    keys = universal_state_keys(ckpt)  # the writer's own refusals (no state, a missing moment, gaps), before writing
    check_adam(ckpt)  # DeepSpeed loads the files into its Adam: other optimizers' state has no place there
    _check_one_step_per_group(ckpt)
    notes: list[str] = [*found.notes]
    not_carried, carried = _run_state(ckpt, keys, notes)
    origin = ckpt.scalars.get("source") or {}
    engine = "fsdp2" if ckpt.format == "dcp" else str(origin.get("engine") or ckpt.format)
    step = (ckpt.scalars.get("counters") or {}).get("global_steps")
    facts: dict[str, Any] = dict(world_size=1, step=step, dtype=ckpt.precision,
                                 config_digest=config_digest(origin.get("ds_config") or None),
                                 extra={"format": "deepspeed-universal",
                                        "converted_from": {"path": str(tag_dir), "engine": engine,
                                                           "world_size": ckpt.world_size, "verified": checked.level}})
    with atomic_checkpoint(root, tag, engine="deepspeed", **facts) as save:
        write_universal_files(ckpt, save.path)
    # after the tag and 'latest' are in place, so the pointer DeepSpeed reads never names a missing folder
    write_latest(root, tag, LATEST_UNIVERSAL)
    final = root / tag
    written = [f for f in final.rglob("*") if f.is_file()]
    return ConvertResult(
        output=root, tag=tag, source_engine=engine, target_engine="universal",
        world_size=ckpt.world_size or 0,
        source_world_size=ckpt.world_size or 0, params=len(ckpt.trainable) + len(ckpt.frozen),
        bytes=sum(f.stat().st_size for f in written), carried=carried, not_carried=not_carried, notes=notes,
        verified=checked.level, route="torch", share_files=len(written), workers=1)


def _check_one_step_per_group(ckpt: TrainingCheckpoint) -> None:
    """DeepSpeed's universal load asserts that every parameter of a param group has one step
    (``load_hp_checkpoint_state_from_checkpoint_dir``: "Steps [...] are not equal"): refused here instead,
    naming the parameters, before anything is written."""
    steps: dict[str, float] = dict(ckpt.scalars.get("step") or {})
    for g, group in enumerate(source_param_groups(ckpt)):
        params = list(group["params"])
        if params:
            single_adam_step(params, steps, f"{ckpt.folder}: param group {g}", "its parameters",
                             "DeepSpeed's universal load keeps one step per param group")


def _run_state(ckpt: TrainingCheckpoint, keys: list[str], notes: list[str]) -> tuple[list[str], list[str]]:
    """(not carried, carried): the run state besides tensors, as ``writers.universal`` records it."""
    not_carried: list[str] = list(ckpt.scalars.get("not_carried") or [])
    carried = ["fp32 masters", *keys, "step", "param_groups (lr, betas, eps, weight_decay)"]
    carried += [label for label, present in (("buffers", ckpt.buffers), ("frozen parameters", ckpt.frozen),
                                             ("tied weights (shared_params)", ckpt.aliases)) if present]
    counters = ckpt.scalars.get("counters") or {}
    carried += [f"{k}" for k in ("global_steps", "global_samples", "skipped_steps") if k in counters]
    if ckpt.scalars.get("lr_scheduler") is not None:
        carried.append("lr_scheduler")
    for k, v in (ckpt.scalars.get("client_state") or {}).items():
        if k in DEEPSPEED_MODEL_KEYS:
            not_carried.append(f"client_state.{k} ({v!r}): the name of an entry DeepSpeed writes itself")
        else:
            carried.append(f"client_state.{k}")
    scaler = ckpt.scalars.get("loss_scaler")
    if scaler:
        not_carried.append(f"loss_scaler (cur_scale={scaler.get('cur_scale')}): a universal checkpoint records only "
                           f"whether it was dynamic ({bool(scaler.get('dynamic'))}); the resuming run starts from its "
                           "configured initial scale")
    notes += [n for n in ckpt.notes if not n.startswith("FSDP2/DCP checkpoint ")]
    notes.append(f"module written in {ckpt.precision} (the source's training precision); DeepSpeed's universal load "
                 "overwrites the trainable weights from the fp32 masters")
    return not_carried, carried
