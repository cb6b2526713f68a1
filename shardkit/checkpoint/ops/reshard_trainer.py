"""Reshard a whole Hugging Face Trainer ``checkpoint-N`` for another world size: the DeepSpeed part
through ``reshard.reshard_checkpoint``, the Trainer's files copied beside it, the RNG files following
``hf_trainer.rng_files.plan_rng_files``, all staged beside the output and renamed into place last.

A ``checkpoint-N`` *is* the DeepSpeed root ``Trainer.train(resume_from_checkpoint=F)`` hands to
``engine.load_checkpoint`` (``checkpoint.hf_trainer.folder``), so reshard's ``-o`` names the new
``checkpoint-N``, exactly as for a plain DeepSpeed root it names what ``load_checkpoint`` is given.
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from shardkit.checkpoint.hf_trainer.folder import (
    CHECKPOINT_DIR,
    DEEPSPEED_TAG_PREFIX,
    TRAINER_STATE,
    TrainerCheckpoint,
    checkpoint_dirs,
)
from shardkit.checkpoint.hf_trainer.rng_files import RngPlan, plan_rng_files
from shardkit.checkpoint.layout.support import refuse_unsupported
from shardkit.checkpoint.ops.carried_files import is_leftover, rng_not_carried, tag_files_not_carried
from shardkit.checkpoint.ops.reshard import ReshardResult, reshard_checkpoint
from shardkit.checkpoint.zero3.files import resolve_tag_dir
from shardkit.core.errors import CheckpointError, UsageError
from shardkit.core.files import copy_regular, not_regular
from shardkit.storage.atomic import os_errors_named, publish_dir, signals_deferred
from shardkit.storage.dry_run import writing_starts
from shardkit.storage.manifest import MANIFEST_NAME
from shardkit.storage.pipeline import refuse_output_in_checkpoint
from shardkit.storage.shared_save import launch_from_env
from shardkit.storage.sibling_staging import remove_stale_staging, staging_folder
from shardkit.storage.tags import LATEST_NAME, check_tag, read_latest


@dataclass
class TrainerReshardResult:
    """What ``reshard_trainer_checkpoint`` wrote."""

    folder: Path
    """The new ``checkpoint-N`` folder: pass it to ``Trainer.train(resume_from_checkpoint=...)``."""
    reshard: ReshardResult
    """The DeepSpeed part (``folder/<tag>/`` and ``folder/latest``), as ``reshard_checkpoint`` reports it."""
    copied: list[str]
    """Trainer files copied unchanged (trainer_state.json, training_args.bin, scheduler.pt, configs ...)."""
    rng: RngPlan
    notes: list[str] = field(default_factory=list)
    """What the user should know: RNG files, files not carried, the batch size at the new world size."""
    not_carried: list[str] = field(default_factory=list)
    """``name (why)`` for every entry of the source the new folder does not hold (also in ``notes``)."""


def _is_shardkit_trainer_checkpoint(p: Path) -> bool:
    try:
        tag = read_latest(p)
    except CheckpointError:
        return False
    return bool(tag) and (p / TRAINER_STATE).is_file() and (p / str(tag) / MANIFEST_NAME).is_file()


def check_output_folder(output: Path, source: Path, *, force: bool) -> None:
    """Refuse an ``-o`` whose replacement would destroy something: the source (or a folder holding
    or inside it), a file, a Trainer output_dir, any non-empty folder that is not a Trainer
    checkpoint shardkit wrote (those are replaced only with ``force``)."""
    refuse_output_in_checkpoint(output, [source], writes="the resharded checkpoint", suffix="_resharded")
    if not output.exists() and not output.is_symlink():
        return
    if output.is_symlink() or not output.is_dir():
        raise UsageError(f"-o {output}: exists and is not a folder; pass a new folder (it becomes the checkpoint-N "
                         "folder you resume from)")
    entries = sorted(e.name for e in output.iterdir())
    if not entries:
        return
    if checkpoint_dirs(output):
        raise UsageError(f"-o {output}: is a Trainer output_dir (it holds checkpoint-N folders); -o names the new "
                         f"checkpoint folder itself, e.g. -o {output / source.name}")
    if not _is_shardkit_trainer_checkpoint(output) and (output / TRAINER_STATE).is_file() and (output / LATEST_NAME).is_file():
        raise UsageError(
            f"-o {output}: holds a Trainer checkpoint without a shardkit manifest ({TRAINER_STATE} and "
            f"'{LATEST_NAME}', no <tag>/{MANIFEST_NAME}): a Trainer's own save or a reshard written with "
            "--no-manifest. Nothing in it shows shardkit wrote it, and a Trainer's own checkpoint-N has the same "
            "files, so it is never replaced, even with --force (only manifested reshards are). Pass a new folder, "
            "or delete this one yourself if it is a --no-manifest reshard you no longer need")
    if not _is_shardkit_trainer_checkpoint(output):
        shown = entries[:5] + (["..."] if len(entries) > 5 else [])
        raise UsageError(f"-o {output}: folder is not empty and is not a Trainer checkpoint written by shardkit (it "
                         f"holds {shown}); it is never replaced. Pass a new or empty folder")
    if not force:
        raise UsageError(f"-o {output}: already holds a resharded Trainer checkpoint; pass --force to replace it, or "
                         "write to another folder")


def _copy_trainer_files(src: Path, staged: Path, tags: set[str], rng: RngPlan) -> tuple[list[str], list[str]]:
    """Copy what the Trainer saved beside its DeepSpeed root; returns (copied, not carried)."""
    rng_names = {a for a, _ in rng.copies} | set(rng.dropped) | set(rng.stray)
    copied, skipped = [], []
    for e in sorted(src.iterdir(), key=lambda e: e.name):
        name = e.name
        if name == LATEST_NAME or name in tags or name in rng_names:
            continue
        if is_leftover(name):
            skipped.append(f"{name} (leftover of an interrupted save)")
        elif name.startswith(DEEPSPEED_TAG_PREFIX) and e.is_dir() and not e.is_symlink():
            skipped.append(f"{name}/ (a DeepSpeed tag '{LATEST_NAME}' does not name; never loaded)")
        elif not e.is_symlink() and not e.is_dir() and (refusal := not_regular(e)) is not None:
            raise refusal  # a FIFO or device in place of a Trainer file: the resume reads it, so the source is not whole
        elif e.is_symlink() or not (e.is_file() or e.is_dir()):
            skipped.append(f"{name} (a link or special file)")
        elif e.is_dir():
            shutil.copytree(e, staged / name, symlinks=True, copy_function=copy_regular)
            copied.append(f"{name}/")
        else:
            copy_regular(e, staged / name)
            copied.append(name)
    for a, b in rng.copies:
        copy_regular(src / a, staged / b)
    return copied, skipped


def _batch_note(cfg: dict[str, Any], source_world: int, world_size: int) -> str | None:
    """The global batch at the new world size when the Trainer keeps its per-device settings (``cfg``: the
    DeepSpeed config the reshard read from the source, which the new rank files record unchanged)."""
    micro, accum = cfg.get("train_micro_batch_size_per_gpu"), cfg.get("gradient_accumulation_steps")
    if not isinstance(micro, int) or not isinstance(accum, int) or source_world == world_size:
        return None
    return (f"the saved run stepped on {micro} x {accum} x {source_world} = {micro * accum * source_world} samples "
            f"(micro batch x accumulation x ranks); with the same TrainingArguments at {world_size} ranks it is "
            f"{micro * accum * world_size}. Adjust per_device_train_batch_size/gradient_accumulation_steps to keep it; "
            "the Trainer skips global_step x accumulation batches of its new dataloader on resume, so the data "
            "position is approximate when the global batch changes")


@os_errors_named("resharding the Trainer checkpoint")
def reshard_trainer_checkpoint(
    source: TrainerCheckpoint,
    output: str | Path,
    world_size: int,
    *,
    tag: str | None = None,
    sub_group_size: int | None = None,
    manifest: bool = True,
    force: bool = False,
    verify: bool = True,
    warn: Callable[[str], None] | None = None,
    workers: int | None = None,
) -> TrainerReshardResult:
    """Write ``source`` resharded for ``world_size`` ranks as the new ``checkpoint-N`` folder ``output``.

    The DeepSpeed part goes through ``reshard_checkpoint`` (source verified first, manifest in the tag
    folder); then the Trainer's files are copied unchanged (``trainer_state.json``,
    ``training_args.bin``, ``scheduler.pt``, config and tokenizer files, ``zero_to_fp32.py``) and
    the RNG files follow ``plan_rng_files``. Everything is written into a staging folder beside
    ``output`` and renamed into place last, so ``output`` is either absent or complete;
    ``force`` replaces an ``output`` that is a resharded Trainer checkpoint shardkit wrote.
    """
    final = Path(output)
    src = source.folder
    refuse_unsupported(src, "reshard")  # a layout nothing converts correctly: refused before anything is read
    src_tag_dir, src_tag = resolve_tag_dir(src)
    new_tag = check_tag(tag) if tag is not None else src_tag
    if not new_tag.startswith(DEEPSPEED_TAG_PREFIX):
        raise UsageError(f"--tag {new_tag!r}: a Trainer resumes only from a checkpoint-N folder holding a "
                         f"{DEEPSPEED_TAG_PREFIX}* folder (transformers' deepspeed_load_checkpoint globs "
                         f"'{DEEPSPEED_TAG_PREFIX}*'); pass e.g. --tag {DEEPSPEED_TAG_PREFIX}{src_tag.removeprefix(DEEPSPEED_TAG_PREFIX) or '100'}")
    check_output_folder(final, src, force=force)
    rng = plan_rng_files([e.name for e in src.iterdir() if e.is_file()], world_size)
    writing_starts(str(final))  # a --dry-run stops here: every check before it has passed
    final.parent.mkdir(parents=True, exist_ok=True)
    leftovers = remove_stale_staging(final)
    staged = staging_folder(final)
    try:
        r = reshard_checkpoint(src, staged, world_size, tag=new_tag, sub_group_size=sub_group_size, manifest=manifest,
                               verify=verify, warn=warn, workers=workers, launch=launch_from_env(single=True),
                               carry_root=False)  # the Trainer's files are carried below, into the same staging folder
        # the resharded tag is written anew; a stale folder named like the new tag would collide with it
        copied, skipped = _copy_trainer_files(src, staged, {src_tag, new_tag}, rng)
        publish_dir(staged, final)  # fsyncs the tree; an existing (forced) folder is swapped, never half-replaced
    except BaseException:
        with signals_deferred():  # a second SIGTERM (a repeated cancel) must not cut the removal short
            shutil.rmtree(staged, ignore_errors=True)
        raise
    moved = dataclasses.replace(
        r, output=final, files=[final / f.relative_to(staged) for f in r.files],
        manifest=(final / r.tag / MANIFEST_NAME) if r.manifest else None,
    )
    notes = [*rng.notes(world_size)]
    if leftovers:
        notes.append(f"removed the staging folder(s) of killed earlier reshards to {final.name} (their process is "
                     f"gone): {', '.join(leftovers)}")
    if skipped:
        notes.append(f"not carried into {final}: {'; '.join(skipped)}")
    if not CHECKPOINT_DIR.match(final.name):
        notes.append(f"{final.name!r} is not named checkpoint-<step>: resume with resume_from_checkpoint={str(final)!r}; "
                     "resume_from_checkpoint=True (get_last_checkpoint) only finds folders named checkpoint-<step>")
    batch = _batch_note(r.ds_config, r.source_world_size, world_size)
    if batch:
        notes.append(batch)
    if (src / "scheduler.pt").is_file():
        notes.append("scheduler.pt copied unchanged: the Trainer's LR scheduler counts optimizer steps, not ranks")
    return TrainerReshardResult(folder=final, reshard=moved, copied=copied, rng=rng, notes=notes + list(r.notes),
                                not_carried=[*skipped, *rng_not_carried(rng, world_size), *tag_files_not_carried(src_tag_dir)])

