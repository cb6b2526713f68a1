"""Which checkpoint a path designates, and its description: ``describe_checkpoint`` resolves a Trainer
output_dir to its newest ``checkpoint-N``, a root to the tag its ``latest`` (or ``latest_universal``)
names, a file to its folder, then hands the folder to the reader of its format. Reads only small
files: pickled structures, ``.metadata``, safetensors headers, the manifest (sizes, never digests).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from shardkit.checkpoint.hf_trainer.folder import CHECKPOINT_DIR, DEEPSPEED_TAG_PREFIX, TRAINER_STATE, checkpoint_dirs
from shardkit.checkpoint.hf_trainer.fsdp_files import fsdp_layout
from shardkit.checkpoint.layout.deepspeed_files import describe_deepspeed, is_deepspeed_folder
from shardkit.checkpoint.layout.description import CheckpointDescription
from shardkit.checkpoint.layout.torch_files import (
    HF_WEIGHTS,
    METADATA_NAME,
    describe_accelerate_fsdp,
    describe_accelerate_state,
    describe_dcp,
    describe_hf_model,
    is_accelerate_state,
)
from shardkit.core.errors import CheckpointError
from shardkit.core.files import not_regular, read_regular_text
from shardkit.storage.listing import list_folder, walk
from shardkit.storage.manifest import MANIFEST_NAME
from shardkit.storage.tags import LATEST_NAME, STAGING_PREFIX, read_latest
from shardkit.storage.verify import verify_checkpoint

#: The pointer ds_to_universal's users write beside ``latest`` (DeepSpeed's load_universal reads it).
LATEST_UNIVERSAL = "latest_universal"


def _size(folder: Path) -> tuple[int, int]:
    """(files, bytes) under ``folder``, links not followed (a stat per file, nothing read)."""
    n = total = 0
    for top, _dirs, names in walk(folder):  # the folder itself: its one listing (storage.listing)
        for name in names:
            st = os.lstat(os.path.join(top, name))
            n, total = n + 1, total + st.st_size
    return n, total


def _manifest(desc: CheckpointDescription, folder: Path) -> None:
    if not (folder / MANIFEST_NAME).is_file():
        return
    report = verify_checkpoint(folder, checksums=False)
    desc.manifest = f"fails: {report.errors[0].message}" if report.errors else "sizes match"
    if report.manifest is not None and desc.step is None:
        desc.step = report.manifest.step


def _trainer_step(folder: Path) -> int | None:
    try:
        state = json.loads(read_regular_text(folder / TRAINER_STATE))
    except (OSError, ValueError):
        return None
    step = state.get("global_step") if isinstance(state, dict) else None
    return step if isinstance(step, int) else None


def _tag_folder(p: Path) -> Path | None:
    """The tag folder a root's ``latest`` (or ``latest_universal``) names, if it exists."""
    for pointer in (LATEST_NAME, LATEST_UNIVERSAL):
        if (p / pointer).is_file():
            tag = read_latest(p, pointer)
            if tag is not None and (p / tag).is_dir():
                return p / tag
            raise CheckpointError(f"{p / pointer}: names tag {tag!r} but {p / str(tag)} is not a folder (an "
                                  "interrupted save or a partial copy); pass an existing tag folder")
    return None


def _refuse_special_files(p: Path) -> None:
    """A FIFO, device or socket among the folder's entries (or a link to one) is named now: a description reads
    only some of the files, and would otherwise describe a checkpoint no resume can read."""
    listing = list_folder(p)
    for name in listing.names:
        refusal = None if name in listing.files or name in listing.folders else not_regular(p / name)
        if refusal is not None and refusal.reason != "folder":
            raise refusal


def _describe_folder(p: Path, given: str) -> CheckpointDescription:
    _refuse_special_files(p)
    if (p / METADATA_NAME).exists():  # of any kind: a FIFO there is named by the DCP read
        return describe_dcp(p, given)
    if is_deepspeed_folder(p):
        return describe_deepspeed(p, given)
    fsdp = fsdp_layout(p)
    if fsdp is not None:
        return describe_accelerate_fsdp(p, fsdp, given)
    if is_accelerate_state(p):
        return describe_accelerate_state(p, given)
    if any((p / n).is_file() for n in HF_WEIGHTS):
        return describe_hf_model(p, given)
    tags = sorted(d.name for d in p.iterdir() if d.is_dir() and d.name.startswith(DEEPSPEED_TAG_PREFIX))
    if tags:
        raise CheckpointError(f"{p}: has no '{LATEST_NAME}' file, so which tag to read is ambiguous; found {tags}. "
                              f"Pass the tag folder, e.g. {p / tags[-1]}")
    names = sorted(e.name for e in p.iterdir())
    shown = names[:8] + (["..."] if len(names) > 8 else [])
    raise CheckpointError(
        f"{p}: not a checkpoint shardkit knows (it holds {shown}): expected DeepSpeed rank files "
        "(*_model_states.pt, *_optim_states.pt) or a 'latest' naming their tag, a DCP folder (.metadata), "
        "accelerate's FSDP files (pytorch_model_fsdp*), a universal checkpoint (zero/ beside "
        "mp_rank_00_model_states.pt) or a Hugging Face folder (model.safetensors)")


@dataclass(frozen=True)
class Located:
    """The folder whose files a checkpoint path designates, before any of them is read."""

    folder: Path
    """The tag folder (DeepSpeed), DCP folder, or the folder itself."""
    trainer: Path | None
    """The Hugging Face Trainer checkpoint-N holding it, if any."""
    notes: tuple[str, ...] = ()


def locate_checkpoint(path: str | Path) -> Located:
    """The folder ``path`` designates: a file's folder, a Trainer output_dir's newest checkpoint-N,
    the tag a root's ``latest`` (or ``latest_universal``) names. Reads names and pointers only."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: checkpoint path does not exist")
    if p.is_file():
        p = p.parent
    if p.name.startswith(STAGING_PREFIX):
        raise CheckpointError(f"{p}: is the staging folder of a save that never completed; pass a complete checkpoint")
    notes: list[str] = []
    found = checkpoint_dirs(p) if _tag_folder(p) is None and not is_deepspeed_folder(p) else []
    if found:
        older = f"; also there: {', '.join(d.name for _, d in found[:-1])}" if found[:-1] else ""
        notes.append(f"{p} is a Trainer output_dir: describing {found[-1][1].name}, its newest checkpoint (the one "
                     f"resume_from_checkpoint=True picks){older}")
        p = found[-1][1]
    trainer = p if (p / TRAINER_STATE).is_file() or CHECKPOINT_DIR.match(p.name) else None
    tag = _tag_folder(p)
    return Located(tag if tag is not None else p, trainer, tuple(notes))


def read_folder(folder: Path, given: str, describe: Callable[[Path, str], CheckpointDescription]) -> CheckpointDescription:
    """``describe(folder, given)``, with a structure that reads but holds odd values (hostile, or a
    writer shardkit does not know) turned into one CheckpointError naming the folder."""
    try:
        return describe(folder, given)
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        raise CheckpointError(f"{folder}: its files do not hold what their names promise ({type(exc).__name__}: "
                              f"{exc}); `shardkit verify {folder}` checks them against a shardkit manifest") from exc


def describe_checkpoint(path: str | Path, *, check_manifest: bool = True) -> CheckpointDescription:
    """Describe the checkpoint at ``path`` (a root, tag folder, rank file, DCP folder, Trainer
    checkpoint-N or output_dir, accelerate FSDP folder, universal checkpoint, Hugging Face folder).

    Raises CheckpointError naming the path when it is none of those. ``check_manifest``: compare the
    file sizes with a shardkit manifest when there is one (digests are `shardkit verify`'s job).
    """
    where = locate_checkpoint(path)
    desc = read_folder(where.folder, str(path), _describe_folder)
    desc.notes[:0] = where.notes
    if where.trainer is not None:
        desc.trainer_folder = str(where.trainer)
        # the Trainer's global_step is the N users know the folder by; a DCP optimizer's Adam step
        # lags it where fp16 skipped steps, so the format's own step is only the fallback
        trainer_step = _trainer_step(where.trainer)
        desc.step = trainer_step if trainer_step is not None else desc.step
        desc.layout = f"Hugging Face Trainer {where.trainer.name} holding {desc.layout}"
    desc.files, desc.size_bytes = _size(where.trainer if where.trainer is not None else where.folder)
    if check_manifest:
        _manifest(desc, where.folder)
    return desc
