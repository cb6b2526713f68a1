"""A Hugging Face Trainer ``checkpoint-N``: find it (an ``output_dir``'s newest), find the DeepSpeed
checkpoint inside, name the Trainer's files beside it, and verify it.

With DeepSpeed, the Trainer (transformers 5.23, ``Trainer._save_checkpoint``) writes
``output_dir/checkpoint-N/`` holding DeepSpeed's own checkpoint root (``latest`` + ``global_stepN/``
with the per-rank ZeRO files; the LR scheduler is inside the model states when DeepSpeed drives it)
beside the Trainer's files: ``trainer_state.json``, ``training_args.bin``, ``rng_state_<rank>.pth``
(``rng_state.pth`` for one process), ``scheduler.pt`` when the scheduler is not DeepSpeed's, the
model's config files, and DeepSpeed's ``zero_to_fp32.py``.

``Trainer.train(resume_from_checkpoint=F)`` hands ``F`` itself to ``engine.load_checkpoint``
(``transformers.integrations.deepspeed.deepspeed_load_checkpoint``, which also insists on a
``global_step*`` folder in ``F``), so ``checkpoint-N`` *is* the DeepSpeed root. An ``output_dir``
resolves to its newest ``checkpoint-N``, the one ``resume_from_checkpoint=True`` picks
(``transformers.trainer_utils.get_last_checkpoint``). Resharding a whole ``checkpoint-N`` is the
operation ``checkpoint.ops.reshard_trainer``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from shardkit.checkpoint.hf_trainer.fsdp_files import fsdp_layout, fsdp_refusal, read_by_shardkit
from shardkit.checkpoint.hf_trainer.rng_files import RNG_RANK_FILE, RNG_SINGLE_FILE, plan_rng_files
from shardkit.core.errors import CheckpointError
from shardkit.core.files import not_regular
from shardkit.core.findings import Finding, Severity
from shardkit.storage.atomic import os_errors_named
from shardkit.storage.tags import LATEST_NAME, STAGING_PREFIX, also_there, read_latest
from shardkit.storage.verify import CheckpointReport, verify_checkpoint

#: ``transformers.trainer_utils._re_checkpoint``: the folders ``get_last_checkpoint`` considers.
CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")
TRAINER_STATE = "trainer_state.json"
#: ``deepspeed_load_checkpoint`` globs ``F/global_step*`` and refuses ``F`` without one.
DEEPSPEED_TAG_PREFIX = "global_step"
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
        return (f"{self.picked_from} is a Trainer output_dir: using {self.folder.name}, the newest checkpoint (the "
                f"one Trainer.train(resume_from_checkpoint=True) picks){also_there(self.others)}. Pass a checkpoint-N "
                "folder to choose another")


def checkpoint_dirs(p: Path) -> list[tuple[int, Path]]:
    """The ``checkpoint-N`` folders of an output_dir, as ``(N, folder)``, oldest first."""
    return sorted((int(m.group(1)), d) for d in p.iterdir()
                  if (m := CHECKPOINT_DIR.match(d.name)) is not None and d.is_dir())


def _deepspeed_tags(p: Path) -> list[str]:
    return sorted(d.name for d in p.iterdir() if d.name.startswith(DEEPSPEED_TAG_PREFIX) and d.is_dir())


def _no_deepspeed_message(p: Path, picked_from: Path | None) -> str:
    """Why the checkpoint folder ``p`` cannot be read as DeepSpeed ZeRO-3, naming what is there instead."""
    names = sorted(e.name for e in p.iterdir())
    where = f" (the newest checkpoint of the output_dir {picked_from})" if picked_from else ""
    head = f"{p}{where}: a Hugging Face Trainer checkpoint without a DeepSpeed checkpoint inside (no '{LATEST_NAME}', no {DEEPSPEED_TAG_PREFIX}*/ folder)"
    fsdp = fsdp_layout(p)
    if fsdp is not None:
        return fsdp_refusal(head, fsdp, p)
    weights = [n for n in names if n.startswith("model") and n.endswith((".safetensors", ".bin"))]
    if "optimizer.pt" in names:
        return (f"{head}; it was saved without DeepSpeed (DDP or one process: {', '.join(n for n in names if n.startswith(('model', 'optimizer', 'scheduler')))}). "
                "Its optimizer.pt holds the whole, unsharded optimizer state and the Trainer resumes it at any world "
                f"size as it is: there is nothing to reshard, and {', '.join(weights) or 'the model files'} already "
                "hold the full weights")
    if weights:
        # weights alone: save_only_model (a DDP/one-process or FSDP FULL_STATE_DICT run alike)
        return (f"{head}; it holds the model weights only ({', '.join(weights)}) and no optimizer state "
                "(TrainingArguments.save_only_model=True keeps only the weights, or the save was interrupted): it can "
                "start a new run, not resume one, and there is nothing to reshard. Pass a checkpoint-N folder saved "
                "with the optimizer state")
    shown = names[:8] + (["..."] if len(names) > 8 else [])
    return (f"{head}; it holds {shown}. The DeepSpeed save did not happen (TrainingArguments.save_only_model=True "
            "keeps only the weights) or was interrupted. Pass a checkpoint-N folder saved with the optimizer state")


@os_errors_named("reading the checkpoint folder")
def locate_trainer_checkpoint(path: str | Path, *, fsdp_read: bool = False) -> TrainerCheckpoint | None:
    """The Trainer checkpoint ``path`` designates, or None when ``path`` is not Trainer-shaped (a
    plain DeepSpeed root or tag folder, a file, a missing path: the callers' own rules apply).

    A ``checkpoint-N`` folder (it holds ``trainer_state.json`` or is named ``checkpoint-N``) with a
    DeepSpeed root inside is returned as is. An output_dir (it holds ``checkpoint-N`` folders)
    resolves to the newest one, as ``get_last_checkpoint`` picks it. Raises one CheckpointError
    naming the folder for a ``checkpoint-N`` without a DeepSpeed checkpoint inside (FSDP, DDP,
    ``save_only_model``) and for an output_dir without any ``checkpoint-N``; with ``fsdp_read`` (the
    commands whose readers take accelerate's FSDP files) a ``checkpoint-N`` holding a layout
    ``readers.fsdp1`` reads is returned instead.
    """
    p = Path(path)
    if not p.is_dir() or p.name.startswith(STAGING_PREFIX):
        return None
    has_ds_root = (p / LATEST_NAME).exists() or any(
        e.name.endswith(("_model_states.pt", "_optim_states.pt")) for e in p.iterdir())
    if has_ds_root:
        # of any kind: a FIFO there still makes a Trainer folder (whose check names it), not a plain root
        return TrainerCheckpoint(p) if (p / TRAINER_STATE).exists() else None
    found = checkpoint_dirs(p)
    if found:
        newest = found[-1][1]
        readable = (newest / LATEST_NAME).exists() or _deepspeed_tags(newest) or (fsdp_read and _fsdp_read(newest))
        if not readable:
            older = f". Older checkpoints there: {', '.join(d.name for _, d in found[:-1])}" if found[:-1] else ""
            raise CheckpointError(_no_deepspeed_message(newest, p) + older)
        return TrainerCheckpoint(newest, picked_from=p, others=tuple(d.name for _, d in found[:-1]))
    if (p / TRAINER_STATE).exists() or CHECKPOINT_DIR.match(p.name):
        if _deepspeed_tags(p) or (fsdp_read and _fsdp_read(p)):
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


def _fsdp_read(p: Path) -> bool:
    layout = fsdp_layout(p)
    return layout is not None and read_by_shardkit(layout, p)


def trainer_folder_of_tag(path: str | Path) -> Path | None:
    """The Trainer ``checkpoint-N`` holding ``path`` when ``path`` is its ``global_stepN`` tag folder
    (resharding that alone leaves the Trainer's files behind), else None."""
    p = Path(path)
    if p.is_dir() and p.name.startswith(DEEPSPEED_TAG_PREFIX) and (p.parent / TRAINER_STATE).exists():
        return p.parent
    return None


def resolve_source(path: str | Path, say: Callable[[str], None], *, fsdp_read: bool = False) -> Path:
    """``path`` as the DeepSpeed root a reader should open: a Trainer output_dir becomes its newest
    ``checkpoint-N`` (told through ``say``); anything else is returned unchanged."""
    found = locate_trainer_checkpoint(path, fsdp_read=fsdp_read)
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
    fsdp = fsdp_layout(folder)  # accelerate's model and optimizer files are what was converted
    converted = {n.rstrip("/") for n in fsdp.model + fsdp.optimizer} if fsdp and read_by_shardkit(fsdp, folder) else set()
    out = []
    for e in sorted(folder.iterdir(), key=lambda e: e.name):
        name = e.name
        if name == LATEST_NAME or name.startswith(".") or name in converted:
            continue
        if name.startswith(DEEPSPEED_TAG_PREFIX) and e.is_dir():
            if converted_tag is None or name == converted_tag:
                continue
            role = f"a DeepSpeed tag '{LATEST_NAME}' does not name, never loaded"
        elif RNG_RANK_FILE.match(name) or name == RNG_SINGLE_FILE:
            role = "a rank's saved RNG state (python, numpy, torch)"
        else:
            role = _TRAINER_FILE_ROLES.get(name, "a model/tokenizer file the Trainer saved")
        out.append(f"{name}{'/' if e.is_dir() else ''} ({role}; the FSDP2/DCP checkpoint has no slot for it: it "
                   f"stays in {folder})")
    return out


#: The fix for a Trainer file that is not a regular file (core.files.not_regular).
_TRAINER_FILE_FIX = "restore the file from a copy of the checkpoint (the Trainer reads it on resume)"


def verify_trainer_checkpoint(
    path: str | Path, *, world_size: int | None = None, engine: str | None = None, checksums: bool = True
) -> CheckpointReport | None:
    """``verify_checkpoint`` for a Trainer checkpoint-N folder or output_dir, or None when ``path``
    is not Trainer-shaped. The DeepSpeed part is checked against its manifest as any checkpoint
    (a Trainer's own save has none, and says so); an output_dir checks its newest checkpoint-N
    and says which; RNG files that do not cover ``world_size`` are reported."""
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
    for e in sorted(found.folder.iterdir()):
        refusal = None if e.is_dir() else not_regular(e, fix=_TRAINER_FILE_FIX)
        if refusal is not None:  # a FIFO or device in place of trainer_state.json, an RNG file...: the resume reads it
            report.add(Finding(Severity.ERROR, "file", e.name, str(refusal), _TRAINER_FILE_FIX, "ckpt.trainer.not_regular"))
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
