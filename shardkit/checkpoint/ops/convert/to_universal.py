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
from shardkit.checkpoint.model.checkpoint import TrainingCheckpoint
from shardkit.checkpoint.ops.convert.result import ConvertResult
from shardkit.checkpoint.ops.convert.single_source import open_source
from shardkit.checkpoint.ops.convert.to_zero3_plan import check_adam, single_adam_step, source_param_groups
from shardkit.checkpoint.ops.export.sources import Source
from shardkit.checkpoint.writers.universal import universal_state_keys, write_universal_files
from shardkit.checkpoint.zero3.layout import DEEPSPEED_MODEL_KEYS
from shardkit.config.loading import config_digest
from shardkit.storage.atomic import os_errors_named, write_latest
from shardkit.storage.listing import lists_source_once
from shardkit.storage.pipeline import warn_unverified
from shardkit.storage.staged_save import atomic_checkpoint


@os_errors_named("converting the checkpoint")
@lists_source_once("source", "output")  # each step asking what the source holds: one listing of its folders
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
    opened = open_source(source, output, target="universal", label="universal",
                         needs="every parameter's fp32 master and Adam moments", same_format=_already_universal,
                         tag=tag, force=force, verify=verify, warn=warn or warn_unverified)
    ckpt, tag, root, checked, tag_dir = opened.ckpt, opened.tag, opened.root, opened.checked, opened.tag_dir
    keys = universal_state_keys(ckpt)  # the writer's own refusals (no state, a missing moment, gaps), before writing
    check_adam(ckpt)  # DeepSpeed loads the files into its Adam: other optimizers' state has no place there
    _check_one_step_per_group(ckpt)
    notes: list[str] = [*opened.found.notes]
    not_carried, carried = _run_state(ckpt, keys, notes)
    origin = ckpt.scalars.get("source") or {}
    engine = opened.engine
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


def _already_universal(found: Source) -> str | None:
    """The same format: DeepSpeed already resumes a universal checkpoint at any world size."""
    if found.kind != "universal":
        return None
    return (f"{found.tag_dir}: is a DeepSpeed universal checkpoint already; DeepSpeed resumes it at any world size as "
            "it is (checkpoint.load_universal: true), so there is nothing to convert. For per-rank files: --to zero3 "
            "(or zero2/zero1) --world-size N; for FSDP2: --to fsdp2")


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
