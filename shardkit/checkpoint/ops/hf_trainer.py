"""Hugging Face Trainer checkpoints: find the DeepSpeed checkpoint inside, reshard a whole ``checkpoint-N``.

With DeepSpeed, the Trainer (transformers 5.23, ``Trainer._save_checkpoint``) writes
``output_dir/checkpoint-N/`` holding DeepSpeed's own checkpoint root (``latest`` + ``global_stepN/``
with the per-rank ZeRO files; the LR scheduler is inside the model states when DeepSpeed drives it)
beside the Trainer's files: ``trainer_state.json``, ``training_args.bin``, ``rng_state_<rank>.pth``
(``rng_state.pth`` for one process), ``scheduler.pt`` when the scheduler is not DeepSpeed's, the
model's config files, and DeepSpeed's ``zero_to_fp32.py``.

``Trainer.train(resume_from_checkpoint=F)`` hands ``F`` itself to ``engine.load_checkpoint``
(``transformers.integrations.deepspeed.deepspeed_load_checkpoint``, which also insists on a
``global_step*`` folder in ``F``), so ``checkpoint-N`` *is* the DeepSpeed root: reshard's ``-o``
names the new ``checkpoint-N``, exactly as for a plain DeepSpeed root it names what
``load_checkpoint`` is given. An ``output_dir`` resolves to its newest ``checkpoint-N``, the one
``resume_from_checkpoint=True`` picks (``transformers.trainer_utils.get_last_checkpoint``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

from shardkit.checkpoint.io.atomic import (
    LATEST_NAME,
    REPLACED_MARK,
    STAGING_PREFIX,
    check_tag,
    os_errors_named,
    publish_dir,
    read_latest,
)
from shardkit.checkpoint.io.manifest import MANIFEST_NAME
from shardkit.core.errors import CheckpointError, UsageError

if TYPE_CHECKING:
    from shardkit.checkpoint.io.verify import CheckpointReport
    from shardkit.checkpoint.ops.reshard import ReshardResult

#: ``transformers.trainer_utils._re_checkpoint``: the folders ``get_last_checkpoint`` considers.
CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")
TRAINER_STATE = "trainer_state.json"
#: ``deepspeed_load_checkpoint`` globs ``F/global_step*`` and refuses ``F`` without one.
DEEPSPEED_TAG_PREFIX = "global_step"
_RNG_RANK = re.compile(r"^rng_state_(\d+)\.pth$")
_RNG_SINGLE = "rng_state.pth"
#: What a Trainer output_dir holds besides checkpoint-N (``save_model``/``save_state`` at the end, logs).
_OUTPUT_DIR_MARKERS = ("training_args.bin", "train_results.json", "all_results.json", "runs")


@dataclass(frozen=True)
class TrainerCheckpoint:
    """A Trainer ``checkpoint-N`` folder whose DeepSpeed root is the folder itself."""

    folder: Path
    """The ``checkpoint-N`` folder (holds ``latest`` and ``global_stepN/``)."""
    picked_from: Path | None = None
    """The output_dir it was picked from as the newest checkpoint; None when it was given directly."""
    others: tuple[str, ...] = ()
    """The other ``checkpoint-*`` folders of that output_dir (not used)."""

    def note(self) -> str | None:
        """What the user should be told about the choice (None when the folder was given directly)."""
        if self.picked_from is None:
            return None
        older = f"; also there: {', '.join(self.others)}" if self.others else ""
        return (f"{self.picked_from} is a Trainer output_dir: using {self.folder.name}, the newest checkpoint (the "
                f"one Trainer.train(resume_from_checkpoint=True) picks){older}. Pass a checkpoint-N folder to "
                "choose another")


def _checkpoint_dirs(p: Path) -> list[tuple[int, Path]]:
    return sorted((int(m.group(1)), d) for d in p.iterdir()
                  if (m := CHECKPOINT_DIR.match(d.name)) is not None and d.is_dir())


def _deepspeed_tags(p: Path) -> list[str]:
    return sorted(d.name for d in p.iterdir() if d.name.startswith(DEEPSPEED_TAG_PREFIX) and d.is_dir())


def _no_deepspeed_message(p: Path, picked_from: Path | None) -> str:
    """Why the checkpoint folder ``p`` cannot be read as DeepSpeed ZeRO-3, naming what is there instead."""
    names = sorted(e.name for e in p.iterdir())
    where = f" (the newest checkpoint of the output_dir {picked_from})" if picked_from else ""
    head = f"{p}{where}: a Hugging Face Trainer checkpoint without a DeepSpeed checkpoint inside (no '{LATEST_NAME}', no {DEEPSPEED_TAG_PREFIX}*/ folder)"
    if any(n.startswith("pytorch_model_fsdp") for n in names):
        return (f"{head}; it was saved by FSDP through Accelerate (pytorch_model_fsdp*). shardkit's reshard, consolidate "
                "and convert read DeepSpeed ZeRO-3 checkpoint-N folders; sharded FSDP checkpoints are "
                "torch.distributed.checkpoint shards, which DCP reshards itself when the Trainer loads them at "
                "another world size")
    if "optimizer.pt" in names or any(n.startswith("model") and n.endswith((".safetensors", ".bin")) for n in names):
        return (f"{head}; it was saved without DeepSpeed (DDP or one process: {', '.join(n for n in names if n.startswith(('model', 'optimizer', 'scheduler')))}). "
                "Its optimizer.pt holds the whole, unsharded optimizer state and the Trainer resumes it at any world "
                "size as it is: there is nothing to reshard, and model.safetensors already holds the full weights")
    shown = names[:8] + (["..."] if len(names) > 8 else [])
    return (f"{head}; it holds {shown}. The DeepSpeed save did not happen (TrainingArguments.save_only_model=True "
            "keeps only the weights) or was interrupted. Pass a checkpoint-N folder saved with the optimizer state")


@os_errors_named("reading the checkpoint folder")
def locate_trainer_checkpoint(path: str | Path) -> TrainerCheckpoint | None:
    """The Trainer checkpoint ``path`` designates, or None when ``path`` is not Trainer-shaped (a
    plain DeepSpeed root or tag folder, a file, a missing path: the callers' own rules apply).

    A ``checkpoint-N`` folder (it holds ``trainer_state.json`` or is named ``checkpoint-N``) with a
    DeepSpeed root inside is returned as is. An output_dir (it holds ``checkpoint-N`` folders)
    resolves to the newest one, as ``get_last_checkpoint`` picks it. Raises one CheckpointError
    naming the folder for a ``checkpoint-N`` without a DeepSpeed checkpoint inside (FSDP, DDP,
    ``save_only_model``) and for an output_dir without any ``checkpoint-N``.
    """
    p = Path(path)
    if not p.is_dir() or p.name.startswith(STAGING_PREFIX):
        return None
    has_ds_root = (p / LATEST_NAME).exists() or any(
        e.name.endswith(("_model_states.pt", "_optim_states.pt")) for e in p.iterdir())
    if has_ds_root:
        return TrainerCheckpoint(p) if (p / TRAINER_STATE).is_file() else None
    found = _checkpoint_dirs(p)
    if found:
        newest = found[-1][1]
        if not (newest / LATEST_NAME).exists() and not _deepspeed_tags(newest):
            older = f". Older checkpoints there: {', '.join(d.name for _, d in found[:-1])}" if found[:-1] else ""
            raise CheckpointError(_no_deepspeed_message(newest, p) + older)
        return TrainerCheckpoint(newest, picked_from=p, others=tuple(d.name for _, d in found[:-1]))
    if (p / TRAINER_STATE).is_file() or CHECKPOINT_DIR.match(p.name):
        if _deepspeed_tags(p):
            return TrainerCheckpoint(p)  # no 'latest': the DeepSpeed reader names the tags found
        raise CheckpointError(_no_deepspeed_message(p, None))
    markers = [m for m in _OUTPUT_DIR_MARKERS if (p / m).exists()]
    if markers:
        raise CheckpointError(
            f"{p}: looks like a Hugging Face Trainer output_dir ({', '.join(markers)}) but holds no checkpoint-N "
            "folder: the Trainer writes one every save_steps (TrainingArguments.save_strategy/save_steps), and "
            "a run shorter than save_steps, or one saved only with trainer.save_model(), has none. Pass a "
            "checkpoint-N folder, or a DeepSpeed checkpoint folder holding 'latest'"
        )
    return None


def trainer_folder_of_tag(path: str | Path) -> Path | None:
    """The Trainer ``checkpoint-N`` holding ``path`` when ``path`` is its ``global_stepN`` tag folder
    (resharding that alone leaves the Trainer's files behind), else None."""
    p = Path(path)
    if p.is_dir() and p.name.startswith(DEEPSPEED_TAG_PREFIX) and (p.parent / TRAINER_STATE).is_file():
        return p.parent
    return None


def resolve_source(path: str | Path, say: Callable[[str], None]) -> Path:
    """``path`` as the DeepSpeed root a reader should open: a Trainer output_dir becomes its newest
    ``checkpoint-N`` (told through ``say``); anything else is returned unchanged."""
    found = locate_trainer_checkpoint(path)
    if found is None:
        return Path(path)
    note = found.note()
    if note:
        say(note)
    return found.folder


#: Why a Trainer file has no place in a DCP checkpoint, by name (anything else: a model/tokenizer file).
_TRAINER_FILE_ROLES = {
    TRAINER_STATE: "the Trainer's global step, log history and best-model record",
    "training_args.bin": "the pickled TrainingArguments",
    "scheduler.pt": "the Trainer's LR scheduler state",
    "zero_to_fp32.py": "DeepSpeed's consolidation script",
}


def trainer_files_not_converted(folder: Path) -> list[str]:
    """What ``convert --to fsdp2`` leaves behind of a Trainer ``checkpoint-N``: every entry beside the
    DeepSpeed root (``latest``, ``global_step*/``), each with what it is and where it stays, so none
    is dropped without a word (the DCP checkpoint holds ``{"model", "optim"}`` and a manifest only)."""
    try:
        converted_tag: str | None = read_latest(folder) if (folder / LATEST_NAME).is_file() else None
    except CheckpointError:
        converted_tag = None
    out = []
    for e in sorted(folder.iterdir(), key=lambda e: e.name):
        name = e.name
        if name == LATEST_NAME or name.startswith("."):
            continue
        if name.startswith(DEEPSPEED_TAG_PREFIX) and e.is_dir():
            if converted_tag is None or name == converted_tag:
                continue
            role = f"a DeepSpeed tag '{LATEST_NAME}' does not name, never loaded"
        elif _RNG_RANK.match(name) or name == _RNG_SINGLE:
            role = "a rank's saved RNG state (python, numpy, torch)"
        else:
            role = _TRAINER_FILE_ROLES.get(name, "a model/tokenizer file the Trainer saved")
        out.append(f"{name}{'/' if e.is_dir() else ''} ({role}; the FSDP2/DCP checkpoint has no slot for it: it "
                   f"stays in {folder})")
    return out


@dataclass(frozen=True)
class RngPlan:
    """What happens to the Trainer's per-rank RNG files when the rank count changes."""

    copies: tuple[tuple[str, str], ...]
    """(source file, name in the new checkpoint) for every new rank that gets its old rank's file."""
    dropped: tuple[str, ...]
    """Source files no rank of the new run reads (their rank does not exist there)."""
    absent: tuple[int, ...]
    """New ranks with no file: the Trainer keeps the RNG it seeded them with."""
    stray: tuple[str, ...] = ()
    """``rng_state.pth`` beside per-rank files (a one-process run saved into the same folder): not copied."""

    def notes(self, world_size: int) -> list[str]:
        out = []
        renamed = [f"{a} -> {b}" for a, b in self.copies if a != b]
        if renamed:
            why = ("the Trainer reads rng_state.pth when it runs as one process" if world_size == 1
                   else "the Trainer reads rng_state_<rank>.pth when it runs distributed")
            out.append(f"RNG state renamed: {', '.join(renamed)} ({why})")
        if self.dropped:
            out.append(f"RNG state dropped: {', '.join(self.dropped)} (their ranks do not exist at world size "
                       f"{world_size}; no rank would read them)")
        if self.stray:
            out.append(f"RNG state not carried: {', '.join(self.stray)} (the one-process RNG file, which only a "
                       "1-process run reads; it lies beside per-rank rng_state_<rank>.pth files, which are the "
                       "ones this checkpoint's ranks saved and the ones carried)")
        if self.absent:
            ranks = ", ".join(str(r) for r in self.absent)
            out.append(
                f"no RNG state for rank(s) {ranks}: they did not exist in the saved run. The Trainer logs \"Didn't "
                "find an RNG file for process N\" (INFO level) and those ranks keep the RNG it seeded them with "
                "(TrainingArguments.seed), so their dropout and sampling draws differ from an uninterrupted run's; "
                "no other rank's file is copied there, since two ranks would then draw the same random numbers"
            )
        return out


def plan_rng_files(names: Iterable[str], world_size: int) -> RngPlan:
    """Which RNG files of a checkpoint holding ``names`` each of ``world_size`` new ranks gets.

    Rank r keeps its own file (``rng_state_<r>.pth``, or ``rng_state.pth`` when the source ran as
    one process and r is 0). At world size 1 rank 0's file becomes ``rng_state.pth``, the name
    ``Trainer._load_rng_state`` reads without a process group. Files of ranks beyond the new
    world size are dropped; new ranks beyond the old one get none (the Trainer then keeps their
    seeded RNG, see ``RngPlan.notes``).
    """
    by_rank: dict[int, str] = {}
    for n in names:
        m = _RNG_RANK.match(n)
        if m:
            by_rank[int(m.group(1))] = n
    if 0 not in by_rank and _RNG_SINGLE in names:
        by_rank[0] = _RNG_SINGLE
    target = (lambda r: _RNG_SINGLE) if world_size == 1 else (lambda r: f"rng_state_{r}.pth")
    copies = tuple((by_rank[r], target(r)) for r in range(world_size) if r in by_rank)
    dropped = tuple(by_rank[r] for r in sorted(by_rank) if r >= world_size)
    stray = (_RNG_SINGLE,) if _RNG_SINGLE in names and by_rank.get(0) != _RNG_SINGLE else ()
    absent = tuple(r for r in range(world_size) if r not in by_rank) if by_rank else ()
    return RngPlan(copies, dropped, absent, stray)


@dataclass
class TrainerReshardResult:
    """What ``reshard_trainer_checkpoint`` wrote."""

    folder: Path
    """The new ``checkpoint-N`` folder: pass it to ``Trainer.train(resume_from_checkpoint=...)``."""
    reshard: "ReshardResult"
    """The DeepSpeed part (``folder/<tag>/`` and ``folder/latest``), as ``reshard_zero3`` reports it."""
    copied: list[str]
    """Trainer files copied unchanged (trainer_state.json, training_args.bin, scheduler.pt, configs ...)."""
    rng: RngPlan
    notes: list[str] = field(default_factory=list)
    """What the user should know: RNG files, files not carried, the batch size at the new world size."""


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
    out, src = output.resolve(), source.resolve()
    if out == src or out.is_relative_to(src) or src.is_relative_to(out):
        raise UsageError(f"-o {output}: is, holds or lies inside the checkpoint being read ({source}); write the "
                         f"resharded checkpoint to another folder, e.g. -o {source.parent}_ws_new/{source.name}")
    if not output.exists() and not output.is_symlink():
        return
    if output.is_symlink() or not output.is_dir():
        raise UsageError(f"-o {output}: exists and is not a folder; pass a new folder (it becomes the checkpoint-N "
                         "folder you resume from)")
    entries = sorted(e.name for e in output.iterdir())
    if not entries:
        return
    if _checkpoint_dirs(output):
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
        if name.startswith(STAGING_PREFIX) or REPLACED_MARK in name or (name.startswith(".") and ".tmp-" in name):
            skipped.append(f"{name} (leftover of an interrupted save)")
        elif name.startswith(DEEPSPEED_TAG_PREFIX) and e.is_dir() and not e.is_symlink():
            skipped.append(f"{name}/ (a DeepSpeed tag '{LATEST_NAME}' does not name; never loaded)")
        elif e.is_symlink() or not (e.is_file() or e.is_dir()):
            skipped.append(f"{name} (a link or special file)")
        elif e.is_dir():
            shutil.copytree(e, staged / name, symlinks=True)
            copied.append(f"{name}/")
        else:
            shutil.copy2(e, staged / name)
            copied.append(name)
    for a, b in rng.copies:
        shutil.copy2(src / a, staged / b)
    return copied, skipped


def _batch_note(tag_dir: Path, source_world: int, world_size: int) -> str | None:
    """The global batch at the new world size when the Trainer keeps its per-device settings."""
    from shardkit.checkpoint.zero3.reader import open_zero3_checkpoint

    cfg = open_zero3_checkpoint(tag_dir, torch_free=True).ds_config
    micro, accum = cfg.get("train_micro_batch_size_per_gpu"), cfg.get("gradient_accumulation_steps")
    if not isinstance(micro, int) or not isinstance(accum, int) or source_world == world_size:
        return None
    return (f"the saved run stepped on {micro} x {accum} x {source_world} = {micro * accum * source_world} samples "
            f"(micro batch x accumulation x ranks); with the same TrainingArguments at {world_size} ranks it is "
            f"{micro * accum * world_size}. Adjust per_device_train_batch_size/gradient_accumulation_steps to keep it; "
            "the Trainer skips global_step x accumulation batches of its new dataloader on resume, so the data "
            "position is approximate when the global batch changes")


#: what follows ``<STAGING_PREFIX><name>-`` in a staging folder's name: the writer's pid@host and a nonce
_STAGING_OWNER = re.compile(r"^(\d+)@(.+)-[0-9a-f]{8}$")


def _staging_folder(final: Path) -> Path:
    """Where ``final`` is assembled: a hidden sibling naming its writer, so a later run can tell a
    killed writer's leftover (``remove_stale_staging``) from a reshard still running beside it."""
    return final.parent / f"{STAGING_PREFIX}{final.name}-{os.getpid()}@{socket.gethostname()}-{uuid.uuid4().hex[:8]}"


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def remove_stale_staging(final: Path) -> list[str]:
    """Remove the staging folders of ``final`` left by killed reshards (SIGKILL, OOM, node loss skip
    the ``except`` that removes them; each is as big as the checkpoint, often inside the user's
    output_dir). ``remove_stale_saves`` may assume one writer per checkpoint root; ``final.parent``
    is any folder, so only a folder whose writer process is gone goes: same host, pid no longer
    running. Folders of other hosts (a shared filesystem) or without an owner are left. Returns the
    names removed."""
    prefix = f"{STAGING_PREFIX}{final.name}-"
    if not final.parent.is_dir():
        return []
    host, removed = socket.gethostname(), []
    for e in final.parent.iterdir():
        if not e.name.startswith(prefix) or e.is_symlink() or not e.is_dir():
            continue
        m = _STAGING_OWNER.match(e.name[len(prefix):])
        if m is None or m.group(2) != host or _process_alive(int(m.group(1))):
            continue
        shutil.rmtree(e, ignore_errors=True)
        removed.append(e.name)
    return sorted(removed)


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
) -> TrainerReshardResult:
    """Write ``source`` resharded for ``world_size`` ranks as the new ``checkpoint-N`` folder ``output``.

    The DeepSpeed part goes through ``reshard_zero3`` (source verified first, manifest in the tag
    folder); then the Trainer's files are copied unchanged (``trainer_state.json``,
    ``training_args.bin``, ``scheduler.pt``, config and tokenizer files, ``zero_to_fp32.py``) and
    the RNG files follow ``plan_rng_files``. Everything is written into a staging folder beside
    ``output`` and renamed into place last, so ``output`` is either absent or complete;
    ``force`` replaces an ``output`` that is a resharded Trainer checkpoint shardkit wrote.
    """
    from shardkit.checkpoint.ops.reshard import reshard_zero3
    from shardkit.checkpoint.zero3.reader import resolve_tag_dir

    final = Path(output)
    src = source.folder
    src_tag_dir, src_tag = resolve_tag_dir(src)
    new_tag = check_tag(tag) if tag is not None else src_tag
    if not new_tag.startswith(DEEPSPEED_TAG_PREFIX):
        raise UsageError(f"--tag {new_tag!r}: a Trainer resumes only from a checkpoint-N folder holding a "
                         f"{DEEPSPEED_TAG_PREFIX}* folder (transformers' deepspeed_load_checkpoint globs "
                         f"'{DEEPSPEED_TAG_PREFIX}*'); pass e.g. --tag {DEEPSPEED_TAG_PREFIX}{src_tag.removeprefix(DEEPSPEED_TAG_PREFIX) or '100'}")
    check_output_folder(final, src, force=force)
    rng = plan_rng_files([e.name for e in src.iterdir() if e.is_file()], world_size)
    final.parent.mkdir(parents=True, exist_ok=True)
    leftovers = remove_stale_staging(final)
    staged = _staging_folder(final)
    try:
        r = reshard_zero3(src, staged, world_size, tag=new_tag, sub_group_size=sub_group_size, manifest=manifest,
                          verify=verify, warn=warn)
        # the resharded tag is written anew; a stale folder named like the new tag would collide with it
        copied, skipped = _copy_trainer_files(src, staged, {src_tag, new_tag}, rng)
        publish_dir(staged, final)  # fsyncs the tree; an existing (forced) folder is swapped, never half-replaced
    except BaseException:
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
    batch = _batch_note(final / r.tag, r.source_world_size, world_size)
    if batch:
        notes.append(batch)
    if (src / "scheduler.pt").is_file():
        notes.append("scheduler.pt copied unchanged: the Trainer's LR scheduler counts optimizer steps, not ranks")
    return TrainerReshardResult(folder=final, reshard=moved, copied=copied, rng=rng, notes=notes + list(r.notes))


def verify_trainer_checkpoint(
    path: str | Path, *, world_size: int | None = None, engine: str | None = None, checksums: bool = True
) -> "CheckpointReport | None":
    """``verify_checkpoint`` for a Trainer checkpoint-N folder or output_dir, or None when ``path``
    is not Trainer-shaped. The DeepSpeed part is checked against its manifest as any checkpoint
    (a Trainer's own save has none, and says so); an output_dir checks its newest checkpoint-N
    and says which; RNG files that do not cover ``world_size`` are reported."""
    from shardkit.checkpoint.io.verify import CheckpointReport, verify_checkpoint
    from shardkit.core.findings import Finding, Severity

    try:
        found = locate_trainer_checkpoint(path)
    except CheckpointError as exc:
        report = CheckpointReport(subject=str(path))
        report.add(Finding(Severity.ERROR, "path", str(path), str(exc),
                           "pass a checkpoint-N folder saved by the Trainer with DeepSpeed", "ckpt.trainer.no_deepspeed"))
        return report
    if found is None:
        return None
    report = verify_checkpoint(found.folder, world_size=world_size, engine=engine, checksums=checksums)
    report.subject = str(path)
    # the generic fix names the tag folder, whose reshard is a plain DeepSpeed root without the Trainer's files
    fixes = {
        "ckpt.world_size.mismatch": f"shardkit reshard {found.folder} --world-size {world_size} -o NEW/{found.folder.name}, "
                                    "or run with the saved number of ranks",
        "ckpt.manifest.missing": "the Trainer's DeepSpeed save writes no manifest, so its files cannot be checked (the "
                                 "Trainer still resumes it as is); `shardkit reshard` writes one into the copy it makes",
    }
    report.findings = [dataclasses.replace(f, fix=fixes[f.rule]) if f.rule in fixes else f for f in report.findings]
    note = found.note()
    if note:
        report.add(Finding(Severity.INFO, "checkpoint", found.folder.name, note,
                           "nothing to do", "ckpt.trainer.newest"))
    if world_size is not None:
        names = [e.name for e in found.folder.iterdir() if e.is_file()]
        rng = plan_rng_files(names, world_size)
        missing = [b for _, b in rng.copies if b not in names]
        if rng.absent or rng.dropped or missing:
            report.add(Finding(Severity.INFO, "rng_state", [b for _, b in rng.copies],
                               f"RNG files do not match world size {world_size}: " + "; ".join(rng.notes(world_size)),
                               f"shardkit reshard {found.folder} --world-size {world_size} -o NEW/{found.folder.name} "
                               "writes the ones that carry over", "ckpt.trainer.rng"))
    return report
