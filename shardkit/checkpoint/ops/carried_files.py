"""What a reshard does with the files of a DeepSpeed root besides the tag it rewrites: carried or named.

A DeepSpeed root is rarely DeepSpeed's alone. ``Accelerator.save_state`` writes its own files beside
``latest`` and the ``pytorch_model/`` tag (``random_states_<process>.pkl``, ``scheduler*.bin``,
``sampler*.bin``, ``dl_state_dict*.bin``, ``scaler.pt``, ``custom_checkpoint_<n>.pkl``), DeepSpeed adds
``zero_to_fp32.py``, and ``load_state`` reads them back from the same folder. Every entry of the source
root gets one of three fates, and the report names each (``RootFiles``):

- per-rank RNG files follow ``hf_trainer.rng_files.plan_rng_files``, the rule the Trainer's checkpoint-N
  uses: rank r keeps its own file, files of ranks the new world size lacks are not carried;
- every other regular file is copied unchanged (what it holds does not depend on the world size);
- the rest is named in ``not_carried`` with why: other DeepSpeed tags (``latest`` names the one
  resharded; the others are listed with the command that takes one), folders nothing here reads, links
  and special files (never followed), leftovers of interrupted saves, and files inside the tag folder
  that are not rank files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from shardkit.checkpoint.hf_trainer.rng_files import ACCELERATE_RNG, TRAINER_RNG, RngPlan, plan_rng_files
from shardkit.checkpoint.layout.detect import LATEST_UNIVERSAL
from shardkit.checkpoint.zero3.files import RANK_FILE
from shardkit.storage.atomic import fsync_dir, fsync_file
from shardkit.storage.listing import list_folder
from shardkit.storage.manifest import MANIFEST_NAME
from shardkit.storage.stream import copy_file_hashed
from shardkit.storage.tags import LATEST_NAME, REPLACED_MARK, STAGING_PREFIX, also_there, read_latest


@dataclass
class RootFiles:
    """The source root's entries besides the resharded tag and ``latest``, sorted by fate."""

    root: Path
    tag: str
    """The tag resharded (the one ``latest`` names)."""
    copies: list[tuple[str, str]] = field(default_factory=list)
    """(name in the source, name in the output): files copied unchanged, RNG files under their rank's name."""
    not_carried: list[str] = field(default_factory=list)
    """``name (why)`` for each entry left behind."""
    other_tags: list[str] = field(default_factory=list)
    """DeepSpeed tag folders ``latest`` does not name (also in ``not_carried``)."""
    rng: list[RngPlan] = field(default_factory=list)

    @property
    def carried(self) -> list[str]:
        """What the output gets, as the summary names it (``a -> b`` for a renamed RNG file)."""
        return [a if a == b else f"{a} -> {b}" for a, b in self.copies]

    def notes(self, world_size: int) -> list[str]:
        # the files dropped are in not_carried already, each with why: the notes say the rest (no file for a rank)
        out = [n for plan in self.rng for n in dataclasses.replace(plan, dropped=(), stray=()).notes(world_size)]
        tags = other_tags_note(self.root, self.tag, self.other_tags)
        return out + ([tags] if tags else [])


def other_tags_note(root: Path, tag: str, others: list[str]) -> str | None:
    """The line naming the tags of ``root`` that were not read, and how to take one."""
    if not others:
        return None
    return (f"{root} holds several tags: read {tag}, the one '{LATEST_NAME}' names{also_there(others)} (not read). "
            f"To take another, pass its tag folder as the checkpoint, e.g. {root / others[-1]} (the new checkpoint "
            "keeps its tag name; --tag names it otherwise)")


def _is_tag_folder(folder: Path) -> bool:
    """A checkpoint tag folder: ZeRO rank files, module states, a universal checkpoint's ``zero/``, or a DCP
    ``.metadata`` (a shardkit FSDP2 root)."""
    try:
        listing = list_folder(folder)
    except OSError:
        return False
    return (any(RANK_FILE.match(n) or (n.startswith("mp_rank_") and n.endswith("_model_states.pt"))
                for n in listing.files) or "zero" in listing.folders or ".metadata" in listing.files)


def is_leftover(name: str) -> bool:
    """A staging folder, a replaced tag or a temporary file an interrupted save left (never carried)."""
    return name.startswith(STAGING_PREFIX) or REPLACED_MARK in name or (name.startswith(".") and ".tmp-" in name)


def plan_root_files(root: Path, tag: str, world_size: int) -> RootFiles:
    """The fate of every entry of the DeepSpeed root ``root`` (resharded: ``root/tag``) at ``world_size`` ranks,
    and of every file in the tag folder that is not a rank file. Reads names only."""
    listing = list_folder(root)  # the command's listing of its root (storage.listing): no second scan
    regular = sorted(n for n in listing.files if n not in listing.links)
    plans = [plan_rng_files(regular, world_size, files) for files in (ACCELERATE_RNG, TRAINER_RNG)]
    plans = [p for p in plans if p.copies or p.dropped or p.stray]
    out = RootFiles(root, tag, rng=plans)
    rng_names = {a for p in plans for a, _ in p.copies}
    out.not_carried += [line for p in plans for line in rng_not_carried(p, world_size)]
    for name in listing.names:
        if name in (LATEST_NAME, tag) or name in rng_names or any(name in p.dropped + p.stray for p in plans):
            continue
        path = root / name
        if is_leftover(name):
            out.not_carried.append(f"{name} (leftover of an interrupted save)")
        elif name in listing.links or not (name in listing.files or name in listing.folders):
            out.not_carried.append(f"{name} (a link or special file: never followed)")
        elif name in listing.folders:
            if _is_tag_folder(path):
                out.other_tags.append(name)
                out.not_carried.append(f"{name}/ (another tag; '{LATEST_NAME}' names {tag})")
            else:
                out.not_carried.append(f"{name}/ (a folder nothing a resume loads is known to read; copy it "
                                       "yourself if your run reads it)")
        elif name == LATEST_UNIVERSAL:  # ds_to_universal's pointer names a universal folder, never carried
            out.not_carried.append(f"{name} (points to a universal checkpoint folder, which is not carried)")
        else:
            out.copies.append((name, name))
    out.copies += [c for p in plans for c in p.copies]
    out.copies.sort()
    out.not_carried += tag_files_not_carried(root / tag)
    return out


def rng_not_carried(plan: RngPlan, world_size: int) -> list[str]:
    """``name (why)`` for the RNG files ``plan`` leaves behind at ``world_size`` ranks."""
    return [*(f"{n} ({plan.dropped_why(world_size)})" for n in plan.dropped),
            *(f"{n} (the one-process RNG file beside per-rank ones: not the ranks' own)" for n in plan.stray)]


def tag_files_not_carried(tag_dir: Path) -> list[str]:
    """Entries of a tag folder that a reshard does not rewrite: anything but rank files and the manifest."""
    listing = list_folder(tag_dir)
    return [f"{tag_dir.name}/{n} (in the tag folder but not a DeepSpeed rank file; the new tag folder holds the "
            "rank files written for the new world size and their manifest only)"
            for n in listing.names if not RANK_FILE.match(n) and n != MANIFEST_NAME
            and not (n.startswith("mp_rank_") and n.endswith("_model_states.pt"))]


def copy_root_files(files: RootFiles, output: Path) -> list[Path]:
    """Copy ``files.copies`` into the output root, each through a temporary name and a rename (a stopped copy
    leaves no half file). Returns the paths this call created (where nothing of that name was), which the
    caller removes when the run fails after them."""
    created: list[Path] = []
    tmp: Path | None = None
    try:
        for src, dst in files.copies:
            target = output / dst
            new = not os.path.lexists(target)
            tmp = output / f".{dst}.tmp-{os.getpid()}"  # a leftover's name, should the process be killed here
            copy_file_hashed(files.root / src, tmp)  # reads a regular file only (a FIFO is refused by name)
            shutil.copystat(files.root / src, tmp)
            fsync_file(tmp)
            os.replace(tmp, target)
            tmp = None
            if new:
                created.append(target)
        fsync_dir(output)
    except BaseException:
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink()
        remove_created(created)
        raise
    return created


def remove_created(paths: list[Path]) -> None:
    """Undo ``copy_root_files``: remove the files it created."""
    for p in paths:
        with contextlib.suppress(OSError):
            p.unlink()


def root_files_not_converted(source: Path) -> tuple[list[str], str | None]:
    """What a conversion of the DeepSpeed root ``source`` leaves behind: every entry beside ``latest`` and the tag
    it names, ``name (why)``, and the line naming the other tags (None: one tag, or ``source`` is no root). A
    conversion writes the model and optimizer state only; none of these has a slot in its output."""
    if not source.is_dir() or not (source / LATEST_NAME).is_file():
        return [], None
    tag = read_latest(source)
    if not tag:
        return [], None
    listing = list_folder(source)
    lines: list[str] = []
    others: list[str] = []
    for name in listing.names:
        if name in (LATEST_NAME, tag) or name.startswith("."):
            continue
        folder = name in listing.folders
        if folder and _is_tag_folder(source / name):
            others.append(name)
            lines.append(f"{name}/ (another tag; '{LATEST_NAME}' names {tag}, the one converted)")
            continue
        lines.append(f"{name}{'/' if folder else ''} (no slot for it in the converted checkpoint, which holds model "
                     f"and optimizer state; it stays in {source})")
    return lines, other_tags_note(source, tag, others)


def root_left_note(tag_dir: Path) -> str | None:
    """When the checkpoint given is a tag folder inside a DeepSpeed root with files beside its tags (Accelerate's
    ``random_states_0.pkl`` ...): what is left there and how to carry it. None when there is nothing such."""
    root = tag_dir.parent
    if not (root / LATEST_NAME).is_file():
        return None
    listing = list_folder(root)
    names = sorted(n for n in listing.files if n not in listing.links and n != LATEST_NAME and not n.startswith("."))
    if not names:
        return None
    shown = ", ".join(names[:6] + (["..."] if len(names) > 6 else []))
    latest = read_latest(root)
    how = (f"pass {root} to carry them (RNG files by rank)" if latest == tag_dir.name
           else f"they belong to the save '{LATEST_NAME}' names ({latest}), not necessarily to {tag_dir.name}")
    return (f"{tag_dir} is a tag folder of {root}, which holds {shown} beside its tags: not carried, since the "
            f"checkpoint given is the tag folder; {how}")
