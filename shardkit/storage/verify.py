"""Check a checkpoint against its manifest before anything is unpickled.

``verify_checkpoint`` returns a report (the CLI table and ``--json`` come from it);
``check_resumable`` is what loaders call first: it raises one CheckpointError naming the file or
field at fault, so a truncated or corrupted rank file never surfaces as a raw unpickling traceback
from deep inside ``torch.load``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardkit.core.errors import CheckpointError
from shardkit.core.findings import Finding, Report, Severity
from shardkit.platform.dist import all_gather_object, rank_world
from shardkit.storage.atomic import os_errors_named
from shardkit.storage.links import LINK_OUTSIDE_FIX, link_outside_message, links_leaving, links_nowhere
from shardkit.storage.links import refuse_links_leaving as refuse_links_leaving
from shardkit.storage.listing import lists_source_once
from shardkit.storage.manifest import (
    ENGINES,
    MANIFEST_NAME,
    Manifest,
    checkpoint_files,
    file_digest,
    read_manifest,
)
from shardkit.storage.rank_coverage import RANK_NAME, missing_rank_files, rank_pattern
from shardkit.storage.tags import LATEST_NAME, STAGING_PREFIX, latest_tag, read_latest

# Files that mark a directory as one checkpoint of some engine even without a shardkit manifest.
_ENGINE_MARKERS = re.compile(r"(_model_states\.pt|_optim_states\.pt|^\.metadata|\.distcp)$")


@dataclass
class CheckpointReport(Report):
    """A Report about one checkpoint, with where it was found and its manifest when readable."""

    root: str | None = None
    """The directory holding ``latest`` and the tag directories."""
    tag_dir: str | None = None
    """The checkpoint (tag) directory that was checked."""
    manifest: Manifest | None = None
    """The parsed manifest, when it could be read."""

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["root"] = self.root
        d["tag_dir"] = self.tag_dir
        d["tag"] = self.manifest.tag if self.manifest else None
        d["engine"] = self.manifest.engine if self.manifest else None
        d["world_size"] = self.manifest.world_size if self.manifest else None
        d["step"] = self.manifest.step if self.manifest else None
        return d


def _err(key: str, value: Any, message: str, fix: str, rule: str) -> Finding:
    return Finding(Severity.ERROR, key, value, message, fix, rule)


def _complete_tags(root: Path) -> list[Path]:
    """Tag directories under root that hold a manifest, newest step (then mtime) last."""
    found = [d for d in root.iterdir() if d.is_dir() and not d.name.startswith(STAGING_PREFIX)
             and (d / MANIFEST_NAME).is_file()]

    def key(d: Path) -> tuple[int, float]:
        try:
            step = read_manifest(d).step
        except CheckpointError:
            step = None
        return (step if isinstance(step, int) else -1, (d / MANIFEST_NAME).stat().st_mtime)

    return sorted(found, key=key)


def resolve_checkpoint(path: str | os.PathLike[str], report: CheckpointReport) -> Path | None:
    """Find the tag directory ``path`` designates (root with ``latest``, or a tag dir), recording
    findings about misuse on ``report``. Returns None when there is nothing to check."""
    p = Path(path)
    if not p.exists():
        report.add(_err("path", str(p), "checkpoint path does not exist", "check the path", "ckpt.path.missing"))
        return None
    if p.is_file():
        report.add(_err("path", str(p), "is a file, not a checkpoint directory",
                        "pass the checkpoint root (the directory holding 'latest') or one tag directory",
                        "ckpt.path.file"))
        return None
    if p.name.startswith(STAGING_PREFIX):
        report.add(_err("path", str(p), "is the staging directory of a save that never completed (killed or "
                        "failed before it was renamed into place)",
                        f"resume from the checkpoint named in {p.parent / LATEST_NAME}; delete this directory",
                        "ckpt.path.staging"))
        return None
    if (p / MANIFEST_NAME).is_file():
        # A step folder: fine, but say when it is not the one 'latest' names (Lightning points to the parent).
        report.root, report.tag_dir = str(p.parent), str(p)
        try:
            latest = read_latest(p.parent)
        except CheckpointError:
            latest = None  # only used for the note below; the tag folder itself was passed
        if latest is not None and latest != p.name:
            report.add(Finding(Severity.INFO, LATEST_NAME, latest,
                               f"{p} is a step folder; the root's 'latest' names {latest!r}, not {p.name!r}",
                               f"pass {p.parent} to resume from the newest checkpoint", "ckpt.path.not_latest"))
        return p
    try:
        latest = latest_tag(p)  # one folder name inside p: '/etc' or '../x' would check another folder
    except CheckpointError as exc:
        report.root = str(p)
        report.add(_err(LATEST_NAME, None, str(exc), "write the tag of a complete checkpoint into it, or pass a tag "
                        "directory directly", "ckpt.latest.invalid"))
        return None
    if latest is not None:
        report.root = str(p)
        tag_dir = p / latest
        report.tag_dir = str(tag_dir)
        if not tag_dir.is_dir():
            report.add(_err(LATEST_NAME, latest, f"{p / LATEST_NAME} names tag {latest!r} but {tag_dir} does not exist",
                            "point 'latest' at an existing tag directory, or pass a tag directory directly",
                            "ckpt.latest.dangling"))
            return None
        if not (tag_dir / MANIFEST_NAME).is_file():
            report.add(_err(f"{latest}/{MANIFEST_NAME}", None,
                            f"{tag_dir} has no {MANIFEST_NAME}: the save did not complete, or it was not written by "
                            "shardkit (plain engine.save_checkpoint moves 'latest' before anything is verified)",
                            "save with shardkit (save_deepspeed_checkpoint / save_fsdp_checkpoint), or resume from "
                            "an earlier complete tag", "ckpt.manifest.missing"))
            return None
        return tag_dir
    # No manifest, no latest: a step folder of another writer, or a root with no complete checkpoint.
    if any(_ENGINE_MARKERS.search(f.name) for f in p.iterdir() if f.is_file()):
        report.root, report.tag_dir = str(p.parent), str(p)
        report.add(_err(MANIFEST_NAME, None,
                        f"{p} looks like a checkpoint step folder but has no {MANIFEST_NAME}: the save did not "
                        "complete, or it was not written by shardkit",
                        "resume from a complete checkpoint, or re-save it with shardkit", "ckpt.manifest.missing"))
        return None
    report.root = str(p)
    complete = _complete_tags(p)
    if complete:
        newest = complete[-1]
        report.tag_dir = str(newest)
        report.add(Finding(Severity.WARNING, LATEST_NAME, None,
                           f"{p} has no 'latest' pointer; checking the newest complete checkpoint {newest.name!r}",
                           f"write the tag into {p / LATEST_NAME}, or pass the tag directory", "ckpt.latest.missing"))
        return newest
    staged = sorted(d.name for d in p.iterdir() if d.name.startswith(STAGING_PREFIX))
    why = f" (only interrupted saves: {staged})" if staged else ""
    report.add(_err("path", str(p), f"no completed checkpoint under {p}{why}",
                    "pass a checkpoint root holding 'latest' or a tag directory holding " + MANIFEST_NAME,
                    "ckpt.none_complete"))
    return None


def precision_naming_problem(tag_dir: Path, bf16: bool) -> tuple[str, str] | None:
    """(message, fix) when the ZeRO optimizer files in ``tag_dir`` are named for another precision
    than a run with ``bf16.enabled: bf16`` looks for; None when it finds its own naming (or there
    are no such files).

    DeepSpeed names them ``bf16_zero_pp_rank_R_...`` under bf16 and ``zero_pp_rank_R_...``
    otherwise, and 0.19.8's ``load_checkpoint`` looks for its own naming only: its fallback to the
    other (``DeepSpeedEngine._get_all_zero_checkpoints``, with the warning "Loading bf16 zero
    checkpoints into fp16 training engine") runs only when ``_get_all_zero_checkpoint_names`` returns
    None, which it never does. The user meets ``FileNotFoundError: ...bf16_zero_pp_rank_0_...``."""
    files = sorted(f.name for f in tag_dir.iterdir() if (m := RANK_NAME.match(f.name)) and m.group(2) == "optim")
    if not files:
        return None
    bf16_files = [f for f in files if f.startswith("bf16_")]
    plain_files = [f for f in files if not f.startswith("bf16_")]
    if bf16_files if bf16 else plain_files:
        return None  # the run finds its own naming (a missing rank file is named elsewhere)
    seen = (bf16_files or plain_files)[0]
    expected = f"bf16_{seen}" if bf16 else seen.removeprefix("bf16_")
    files_for = "bf16 (bf16.enabled: true)" if bf16_files else "a run without bf16 (fp32 or fp16)"
    run = "bf16" if bf16 else "without bf16"
    message = (f"{tag_dir}: its ZeRO optimizer files are named for {files_for} ({seen}), but this engine runs "
               f"{run} (bf16.enabled: {str(bf16).lower()}), so DeepSpeed's load_checkpoint looks for {expected} "
               "and stops with FileNotFoundError (DeepSpeed 0.19.8 never falls back to the other naming)")
    fix = (f"resume with the precision the checkpoint was written in (set bf16.enabled to {str(not bf16).lower()} "
           "in the DeepSpeed config), or load with shardkit.load_checkpoint_resharded(engine, path), which reads either "
           "naming (the fp32 masters are the same); for a `shardkit convert --to zero3` output, convert again with "
           "--ds-config set to this run's config")
    return message, fix


@os_errors_named("verifying the checkpoint")
@lists_source_once("path")  # the link check and the file walk share one listing of the tag folder
def verify_checkpoint(
    path: str | os.PathLike[str],
    *,
    world_size: int | None = None,
    engine: str | None = None,
    checksums: bool = True,
    allow_reshard: bool = False,
    bf16: bool | None = None,
) -> CheckpointReport:
    """Check one checkpoint (a root with ``latest``, or a tag directory) against its manifest.

    Errors: a listed file missing, shorter/longer than recorded (truncated), or with another
    digest (corrupted); a rank file the world size requires absent from the manifest; a
    different engine; a different world size (except for FSDP2/DCP, or ``allow_reshard``);
    ZeRO files named for another precision than the resuming run's ``bf16`` (its
    ``bf16.enabled``; None: not checked), which DeepSpeed's own load would not find.
    """
    report = CheckpointReport(subject=str(path))
    if engine is not None and engine not in ENGINES:
        report.add(_err("engine", engine, f"unknown engine {engine!r}", f"use one of {list(ENGINES)}", "ckpt.engine.unknown"))
        return report
    tag_dir = resolve_checkpoint(path, report)
    if tag_dir is None:
        return report
    try:
        m = read_manifest(tag_dir)
    except CheckpointError as exc:
        report.add(_err(MANIFEST_NAME, None, str(exc), "re-save the checkpoint; the manifest cannot be trusted",
                        "ckpt.manifest.invalid"))
        return report
    report.manifest = m
    listed = {f.path for f in m.files}
    inside = tag_dir.resolve()
    leaving = links_leaving(tag_dir)
    for rel, real_target in leaving:
        # a link listed in the manifest is named once below, with the file it stands for
        if not any(entry == rel or entry.startswith(rel + "/") for entry in listed):
            report.add(_err(rel, real_target, link_outside_message(tag_dir, rel, real_target), LINK_OUTSIDE_FIX,
                            "ckpt.link.outside"))
    for entry in m.files:
        f = tag_dir / entry.path  # entry.path is relative, without '..' (Manifest.from_dict checks)
        real = f.resolve()
        if not real.is_relative_to(inside):
            # the text of the path is checked when the manifest is read; a symlink inside the tag
            # folder (sub -> /) still leads out of it, so where the path really goes is checked here
            report.add(_err(entry.path, str(real), f"{f}: leads outside the checkpoint folder {inside} (to {real}, "
                            "through a symlink); it is not read",
                            "replace the link with the real file, or resume from another tag", "ckpt.file.outside"))
            continue
        if f.exists() and not f.is_file():
            report.add(_err(entry.path, None, f"{f}: listed in the manifest as a file but is not a regular file "
                            "(a folder, fifo or device); it is not read",
                            "restore the file from a copy of the checkpoint, or resume from another tag",
                            "ckpt.file.not_regular"))
            continue
        if not f.is_file():
            report.add(_err(entry.path, None, f"{f}: file listed in the manifest is missing",
                            "restore it from a copy of the checkpoint, or resume from another tag", "ckpt.file.missing"))
            continue
        size = f.stat().st_size
        if size != entry.size:
            kind = "truncated" if size < entry.size else "longer than when it was saved"
            report.add(_err(entry.path, size, f"{f}: {size} bytes on disk, manifest records {entry.size} ({kind})",
                            "the copy or the save was cut short; restore the file or resume from another tag",
                            "ckpt.file.size"))
            continue
        if checksums and file_digest(f, entry.algorithm, inside=inside) != entry.digest:
            report.add(_err(entry.path, f"{entry.algorithm} mismatch", f"{f}: content differs from the manifest "
                            f"({entry.algorithm} mismatch): the file is corrupted or was modified after the save",
                            "restore the file from a good copy or resume from another tag", "ckpt.file.checksum"))
    for kind, count, first in missing_rank_files(m):
        for r in first:
            report.add(_err(f"rank {r}", None, f"{tag_dir}: no file for rank {r} matching {rank_pattern(kind, r)} "
                            f"although the checkpoint records world_size={m.world_size}",
                            "the save is incomplete; resume from another tag", "ckpt.rank_file.missing"))
        if count > len(first):
            report.add(_err("ranks", count - len(first), f"{tag_dir}: {count - len(first):,} more rank(s) have no "
                            f"{kind}_states file although the checkpoint records world_size={m.world_size} (it "
                            f"lists {len(m.files)} files)", "the save is incomplete, or its manifest was edited; "
                            "resume from another tag", "ckpt.rank_file.missing"))
    nowhere = dict(links_nowhere(tag_dir))
    for rel in checkpoint_files(tag_dir):
        if rel in listed:
            continue
        if rel in nowhere:  # a link to nothing (a loop, a missing target): no file, and no command reads it
            report.add(Finding(Severity.WARNING, rel, nowhere[rel], f"{tag_dir / rel}: a symbolic link to "
                               f"{nowhere[rel]!r}, which leads nowhere: no file of this checkpoint, and no command "
                               "reads it", "remove the link", "ckpt.link.nowhere"))
        elif _ENGINE_MARKERS.search(rel.rsplit("/", 1)[-1]):
            # a data file the loaders read (a DCP shard, its .metadata, a DeepSpeed rank file) that the
            # manifest does not vouch for would be read unverified: found by the hostile sweep, where a
            # dropped .distcp entry verified and the converts read the file unchecked
            report.add(_err(rel, None, f"{tag_dir / rel}: a checkpoint data file the manifest does not list (an entry "
                            "dropped from the manifest, or the file added after the save): it would be read unverified",
                            "restore the manifest from a good copy, or re-save the checkpoint", "ckpt.file.unlisted"))
        else:
            report.add(Finding(Severity.WARNING, rel, None, f"{tag_dir / rel}: file not listed in the manifest "
                               "(added after the save)", "remove it, or re-save the checkpoint", "ckpt.file.extra"))
    if bf16 is not None and m.engine == "deepspeed" and not allow_reshard:
        # allow_reshard: shardkit's own loader, which reads either naming
        problem = precision_naming_problem(tag_dir, bf16)
        if problem is not None:
            report.add(_err("bf16.enabled", bf16, problem[0], problem[1], "ckpt.precision.mismatch"))
    if engine is not None and engine != m.engine:
        report.add(_err("engine", m.engine, f"checkpoint was written by engine {m.engine!r}, this run uses {engine!r}",
                        f"load it with the {m.engine} loader, or convert it", "ckpt.engine.mismatch"))
    if world_size is not None and world_size != m.world_size:
        if m.engine == "fsdp2" or allow_reshard:
            report.add(Finding(Severity.INFO, "world_size", m.world_size,
                               f"saved at world size {m.world_size}, resuming at {world_size}: state is resharded on load",
                               "nothing to do", "ckpt.world_size.reshard"))
        else:
            report.add(_err("world_size", m.world_size,
                            f"checkpoint was saved by {m.world_size} ranks, this run has {world_size}; DeepSpeed's "
                            "load_checkpoint cannot repartition ZeRO state to a new world size",
                            f"run with {m.world_size} ranks, or reshard it first: shardkit reshard {tag_dir} "
                            f"--world-size {world_size} -o NEW_DIR", "ckpt.world_size.mismatch"))
    if report.root:
        root = Path(report.root)
        leftovers = sorted(d.name for d in root.iterdir() if d.name.startswith(STAGING_PREFIX)) if root.is_dir() else []
        if leftovers:
            report.add(Finding(Severity.INFO, "staging", leftovers, f"{root} holds staging directories of interrupted "
                               "saves; they are never loaded", "delete them to reclaim space", "ckpt.staging.leftover"))
    return report


def check_resumable(
    path: str | os.PathLike[str],
    *,
    world_size: int | None = None,
    engine: str | None = None,
    checksums: bool = True,
    allow_reshard: bool = False,
    bf16: bool | None = None,
) -> CheckpointReport:
    """``verify_checkpoint`` for loaders: raise one CheckpointError naming the file or field of the
    first problem (and how many more there are); return the report when the checkpoint is usable."""
    report = verify_checkpoint(path, world_size=world_size, engine=engine, checksums=checksums,
                               allow_reshard=allow_reshard, bf16=bf16)
    if report.errors:
        first = report.errors[0]
        more = f" ({len(report.errors) - 1} more problem(s): run `shardkit verify {path}`)" if len(report.errors) > 1 else ""
        raise CheckpointError(f"cannot resume from {path}: [{first.key}] {first.message}. Fix: {first.fix}{more}")
    return report


def check_resumable_distributed(
    path: str | os.PathLike[str],
    *,
    world_size: int | None = None,
    engine: str | None = None,
    checksums: bool = True,
    allow_reshard: bool = False,
    bf16: bool | None = None,
) -> CheckpointReport:
    """``check_resumable`` for N ranks resuming together. Collective when a process group exists.

    Every rank checks presence, sizes and the manifest's facts (cheap), and hashes only its share of
    the files (``files[rank::world]``), so N ranks read the checkpoint once between them instead of
    N times. The findings are all-gathered, and every rank raises the same CheckpointError (naming
    the first file or field at fault), so no rank is left waiting in a collective when another one
    alone found a corrupted file.
    """

    rank, world = rank_world()
    local: list[tuple[str, str, str]] = []  # (key, message, fix)
    report: CheckpointReport | None = None
    try:
        report = verify_checkpoint(path, world_size=world_size, engine=engine, checksums=False,
                                   allow_reshard=allow_reshard, bf16=bf16)
        local += [(f.key, f.message, f.fix) for f in report.errors]
        if not report.errors and checksums and report.manifest is not None and report.tag_dir is not None:
            tag_dir = Path(report.tag_dir)
            inside = tag_dir.resolve()
            for entry in report.manifest.files[rank::world]:
                f = tag_dir / entry.path
                if file_digest(f, entry.algorithm, inside=inside) != entry.digest:
                    local.append((entry.path, f"{f}: content differs from the manifest ({entry.algorithm} mismatch): "
                                  "the file is corrupted or was modified after the save",
                                  "restore the file from a good copy or resume from another tag"))
    except (CheckpointError, OSError) as exc:
        local.append(("path", f"rank {rank}: {exc}", "check the path is readable on every rank"))
    problems: list[tuple[str, str, str]] = []
    for part in all_gather_object(local):
        problems += [p for p in part if p not in problems]
    if problems:
        key, message, fix = problems[0]
        more = f" ({len(problems) - 1} more problem(s): run `shardkit verify {path}`)" if len(problems) > 1 else ""
        raise CheckpointError(f"cannot resume from {path}: [{key}] {message}. Fix: {fix}{more}")
    assert report is not None  # no problems means verify_checkpoint returned
    return report

