"""The steps every checkpoint operation shares, in the order it runs them: verify the source before
anything is unpickled (``verify_before_reading``; ``check_source``, its digests now or while writing), choose the output's tag and refuse an output
folder where writing would destroy something (``output_tag``, ``source_tag_as_new_tag``,
``check_output_root``; ``refuse_output_in_checkpoint``, the check every command's output runs), size the writer pool (``default_workers``); staging and sealing the output
is ``staged_save.atomic_checkpoint``. Reshard, convert and consolidate (and the coming export) call these instead
of borrowing them from one another. Which tag folder a source path designates is the format's
question (``zero3.files.resolve_tag_dir``); what a tag may be is ``tags``'.
"""

from __future__ import annotations

import os
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from pathlib import Path

from shardkit.core.errors import CheckpointError, UsageError
from shardkit.storage.manifest import MANIFEST_NAME, FileEntry, Manifest, file_digest
from shardkit.storage.shared_save import owner_alive
from shardkit.storage.tags import LATEST_NAME, REPLACED_MARK, STAGING_PREFIX, check_tag, tag_problem
from shardkit.storage.verify import refuse_links_leaving, verify_checkpoint


class UnverifiedCheckpointWarning(UserWarning):
    """A checkpoint is read without (full) verification: no manifest, or hashes skipped."""


@dataclass
class SourceCheck:
    """How a converter's input was checked before it was read."""

    level: str
    """'hash' (sizes and content digests), 'sizes' (digests skipped) or 'none' (no manifest to check against)."""
    warnings: list[str]
    """What the user should know before trusting the output."""
    manifest: Manifest | None = None
    """The manifest the files were checked against (None without one)."""
    owed: dict[str, FileEntry] = field(default_factory=dict)
    """Files whose digests are still to be checked, by path: hashed while the output is written
    (``check_source(hash_now=False)``); empty when they were checked now or not asked for."""


#: How ``source checked before reading`` reads (reshard, consolidate) for each ``SourceCheck.level``.
CHECKED_LEVELS = {
    "hash": "sizes and content digests (blake3 or sha256, as its manifest lists them) match its manifest",
    "sizes": "sizes match its manifest (content digests skipped: --no-verify)",
    "none": "not verified (no shardkit manifest)",
}


def warn_unverified(message: str) -> None:
    """Default ``warn`` of the converters: an UnverifiedCheckpointWarning at the converter's caller
    (called straight from a function wrapped by ``os_errors_named``: stacklevel 4 skips the wrapper)."""
    import warnings

    warnings.warn(message, UnverifiedCheckpointWarning, stacklevel=4)


def verify_before_reading(tag_dir: str | os.PathLike[str], *, checksums: bool = True, workers: int = 1) -> SourceCheck:
    """What a converter (reshard, consolidate) calls on the tag folder it is about to read, before
    anything is unpickled: the same checks as ``shardkit verify`` (sizes always, digests unless
    ``checksums=False``), so a corrupted checkpoint is refused instead of converted into a new one
    whose fresh manifest would vouch for the corruption.

    Raises one CheckpointError naming the first problem. A folder without a manifest (a plain
    ``engine.save_checkpoint``) cannot be verified: it is read, with a warning. ``workers > 1``
    hashes that many files at once (blake3 and hashlib release the GIL: one file per core).
    """
    tag_dir = Path(tag_dir)
    if not os.path.lexists(tag_dir / MANIFEST_NAME):
        # without a manifest verify never looks: a link leaving the tag is refused here, not read through
        refuse_links_leaving(tag_dir, "read")
        return SourceCheck("none", [
            f"{tag_dir} has no {MANIFEST_NAME} (it was not saved by shardkit), so its files cannot be verified: a "
            f"truncated or corrupted rank file is read as is. Check it first with `shardkit verify {tag_dir}` (a "
            "structural check; --write-manifest then records digests once), or save with shardkit to get a manifest"])
    report = verify_checkpoint(tag_dir, checksums=checksums and workers <= 1)
    if checksums and workers > 1 and not report.errors and report.manifest is not None:
        _hash_in_parallel(tag_dir, report.manifest, workers)
    if report.errors:
        first = report.errors[0]
        more = f" ({len(report.errors) - 1} more problem(s): run `shardkit verify {tag_dir}`)" if len(report.errors) > 1 else ""
        raise CheckpointError(f"refusing to read {tag_dir}: it fails verification: [{first.key}] {first.message}. "
                              f"Fix: {first.fix}{more}")
    notes = [f.message for f in report.warnings]
    if not checksums:
        n = len(report.manifest.files) if report.manifest else 0
        notes.append(f"--no-verify: the content digests of the {n} file(s) of {tag_dir} were not checked (their sizes were); "
                     "a corrupted file of the right size is read as is")
    return SourceCheck("hash" if checksums else "sizes", notes, report.manifest)


def check_source(tag_dir: Path, *, verify: bool, hash_now: bool, workers: int = 1) -> SourceCheck:
    """The source check every writing operation opens with: ``verify_before_reading``, its digests
    now (``hash_now``) or owed (``SourceCheck.owed``) to the writer, which hashes each process's share
    while it writes instead of every process hashing everything first. Sizes are always checked now
    (a truncated file is refused before it is parsed). ``level`` is what the source will have been
    checked to once the owed digests are; the --no-verify note is dropped then (the user asked for them)."""
    checked = verify_before_reading(tag_dir, checksums=verify and hash_now, workers=workers)
    if hash_now or not verify or checked.manifest is None:
        return checked
    return SourceCheck("hash", [n for n in checked.warnings if not n.startswith("--no-verify")], checked.manifest,
                       {e.path: e for e in checked.manifest.files})


def _hash_in_parallel(tag_dir: Path, manifest: Manifest, workers: int) -> None:
    """The digest half of ``verify_checkpoint``, ``workers`` files at a time (sizes already checked)."""
    from concurrent.futures import ThreadPoolExecutor


    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shardkit-verify") as pool:
        digests = list(pool.map(lambda e: file_digest(tag_dir / e.path, e.algorithm), manifest.files))
    for entry, got in zip(manifest.files, digests):
        if got != entry.digest:
            f = tag_dir / entry.path
            raise CheckpointError(f"refusing to read {tag_dir}: it fails verification: [{entry.path}] {f}: content "
                                  f"differs from the manifest ({entry.algorithm} mismatch): the file is corrupted or was modified "
                                  "after the save. Fix: restore the file from a good copy or resume from another tag")


def source_tag_as_new_tag(checkpoint: str | Path, source_dir: Path, source_tag: str) -> str:
    """The source's tag, reused for the output when no ``--tag`` was given, or a UsageError that
    names where that tag came from (the user never typed it) and says to pass ``--tag``."""

    why = tag_problem(source_tag)
    if why is None:
        return source_tag
    given = Path(checkpoint).resolve()
    # a root or its 'latest' file: the tag was read from 'latest'; a tag folder or a rank file: its folder name
    if given != source_dir.resolve() and given.parent != source_dir.resolve():
        origin = f"read from {source_dir.parent / LATEST_NAME}"
    else:
        origin = f"the name of the source folder {source_dir}"
    raise UsageError(f"source tag {source_tag!r} ({origin}) cannot name the new checkpoint ({why}); no --tag was "
                     "given, so the source's tag would be reused. Pass --tag NAME, e.g. --tag global_step100")


def output_tag(tag: str | None, checkpoint: str | Path, source_dir: Path, source_tag: str) -> str:
    """The tag the output gets: ``tag`` (the user's ``--tag``) checked by ``check_tag``, or, when
    none was given, the source's own (``source_tag_as_new_tag``)."""
    return check_tag(tag) if tag is not None else source_tag_as_new_tag(checkpoint, source_dir, source_tag)


#: Names that make a folder a checkpoint's own, whatever wrote it: shardkit's manifest, the pointers beside
#: DeepSpeed's tags (``latest``, ds_to_universal's ``latest_universal``), DeepSpeed's rank-0 model files and
#: DCP's ``.metadata``. Listed here, below every format, so every command's output check shares them.
CHECKPOINT_MARKERS = (MANIFEST_NAME, LATEST_NAME, "latest_universal", "zero_pp_rank_0_mp_rank_00_model_states.pt",
                      "mp_rank_00_model_states.pt", ".metadata")


def _is_checkpoint_folder(folder: Path) -> bool:
    return folder.name.startswith(STAGING_PREFIX) or any(os.path.lexists(folder / m) for m in CHECKPOINT_MARKERS)


def _free_sibling(folder: Path, suffix: str) -> Path:
    """``folder``'s sibling named ``<name><suffix>`` (``<name>_2<suffix>``... when taken): the -o a refusal advises."""
    for n in range(1, 100):
        candidate = folder.parent / f"{folder.name}{'' if n == 1 else f'_{n}'}{suffix}"
        if not os.path.lexists(candidate):
            break
    return candidate


def refuse_output_in_checkpoint(output: Path, sources: list[Path], *, writes: str, suffix: str) -> None:
    """Refuse ``-o output`` (the folder or file a command creates or replaces) when it is, holds or lies inside
    the checkpoint being read (``sources``: the folders read, a DeepSpeed tag folder's root included where it
    holds ``latest``), or lies inside any other checkpoint folder (``CHECKPOINT_MARKERS``, a staging folder).
    Every command that writes from a checkpoint (reshard, convert, consolidate, export) runs this one check
    before anything is written: written next to ``latest``, an output becomes part of a root whose next save's
    clean-up, ``latest`` and loaders treat what is there as theirs, and a resume or verify of the source then
    meets files it never saved. The UsageError names the folder, and advises a free sibling of the outermost
    checkpoint folder (``<name><suffix>``), where following the advice works. ``writes``: what the command writes,
    in words ("the resharded checkpoint")."""
    real = Path(os.path.realpath(output))
    srcs = [Path(os.path.realpath(s)) for s in sources]
    roots = srcs + [s.parent for s in srcs if _is_checkpoint_folder(s.parent)]
    held = next((s for s in srcs if s == real or s.is_relative_to(real)), None)
    above = [f for f in real.parents if f in roots or _is_checkpoint_folder(f)]
    if held is None and not above:
        return
    outer = above[-1] if above else real  # parents run from the nearest to /: the last is the outermost
    fix = f"Nothing was written. Write {writes} to another folder, e.g. -o {_free_sibling(outer, suffix)}"
    if held is not None:
        pointer = (f": its '{LATEST_NAME}' would point at the new tag, and the source run could no longer resume from "
                   f"{held.name!r}") if held.parent == real and os.path.lexists(real / LATEST_NAME) else ""
        raise UsageError(f"-o {output}: {'is' if held == real else 'holds'} the checkpoint being read ({held})"
                         f"{pointer}. {fix}")
    if outer in roots:
        raise UsageError(f"-o {output}: {real} is inside the checkpoint being read ({outer}); written there it would "
                         f"sit beside the source's own files, which its '{LATEST_NAME}', its next save and its "
                         f"loaders treat as theirs. {fix}")
    raise UsageError(f"-o {output}: {outer} is a checkpoint folder; shardkit never writes into one (its "
                     f"'{LATEST_NAME}', its next save and its loaders treat what is there as theirs). {fix}")


def check_output_root(root: Path, tag: str, source_dir: Path, *, force: bool = False) -> None:
    """Refuse an output folder where writing ``<tag>/`` and ``latest`` would destroy something.

    Accepted: a path that does not exist, an empty folder, or a shardkit checkpoint folder (one
    holding at least one tag folder with a manifest). Refused: what ``refuse_output_in_checkpoint``
    refuses (the source, its root, a folder holding it or inside any checkpoint folder); a non-empty
    folder of other files (the save sequence removes leftovers
    of interrupted saves there and points ``latest`` at the new tag); a ``<tag>`` or ``latest``
    that is not a shardkit checkpoint / a regular file; an existing ``<tag>`` checkpoint unless
    ``force``.
    """

    refuse_output_in_checkpoint(root, [source_dir], writes="the new checkpoint", suffix="_new")
    final = root / tag
    if not root.exists() and not root.is_symlink():
        return
    if not root.is_dir():
        raise UsageError(f"-o {root}: exists and is not a folder; pass a new or empty folder (the resharded "
                         f"checkpoint is written as OUT/{tag}/ and OUT/{LATEST_NAME})")
    entries = sorted(root.iterdir())
    ours = root / f"{STAGING_PREFIX}{tag}"
    if ours.is_dir():
        alive, who = owner_alive(ours, grace=1.0)
        if alive:
            raise CheckpointError(
                f"{final}: another shardkit run ({who}) is writing this output right now (its staging folder {ours} is "
                "live). One writer per output: wait for it to finish, or write to another -o/--tag. If no such run "
                f"exists (it was killed on another host), remove {ours}")
    if all(e.name.startswith(STAGING_PREFIX) and e.is_dir() for e in entries):
        return  # empty, or only what killed saves left: the save sequence removes those
    checkpoints = [e for e in entries if e.is_dir() and not e.name.startswith(STAGING_PREFIX)
                   and REPLACED_MARK not in e.name and (e / MANIFEST_NAME).is_file()]
    if not checkpoints:
        if any(not os.path.lexists(e) for e in entries):
            # another writer published (renamed its staging folder) while this looked: look again
            return check_output_root(root, tag, source_dir, force=force)
        shown = [e.name for e in entries[:5]] + (["..."] if len(entries) > 5 else [])
        raise UsageError(
            f"-o {root}: folder is not empty and is not a shardkit checkpoint folder (it holds {shown}); writing "
            f"there would point its '{LATEST_NAME}' at the new tag and remove files named like leftovers of "
            "interrupted saves. Pass a new or empty folder"
        )
    latest = root / LATEST_NAME
    if (latest.exists() or latest.is_symlink()) and not latest.is_file():
        raise UsageError(f"-o {root}: {latest} is not a regular file (a folder, device or dangling link), so it "
                         "cannot be the checkpoint pointer; pass another folder")
    if final.exists() or final.is_symlink():
        if final.is_symlink() or not final.is_dir() or not (final / MANIFEST_NAME).is_file():
            raise UsageError(f"-o {root}: {final} exists and is not a shardkit checkpoint (no {MANIFEST_NAME}, or "
                             "not a plain folder); it is never replaced. Pass --tag NEW_TAG or another folder")
        if not force:
            raise UsageError(f"-o {root}: already holds checkpoint {tag!r} ({final}); pass --force to replace it, "
                             "or --tag NEW_TAG to write beside it")


def default_workers(rank_files: int) -> int:
    """Threads writing rank files at once: one per new rank's optimizer file (a file is hashed front
    to back, so it is one thread's work; with fewer threads than files the last file runs alone
    while cores idle), at least one per core, at most 8 unless there are more cores (past that the
    disk, not the CPU, is the limit). Every step releases the GIL and each thread holds one
    CHUNK_BYTES buffer, so more threads than cores cost nothing but a time slice."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, min(rank_files, max(cores, 8)))


def hash_beside(pool: Executor, files: list[tuple[Path, FileEntry]]) -> list[tuple[Path, FileEntry, Future[str]]]:
    """Start hashing each source file with its manifest entry's algorithm on ``pool``, while the
    caller copies (reshard, convert and consolidate read byte ranges, not whole files);
    ``check_source_digests`` waits for them."""
    return [(f, entry, pool.submit(file_digest, f, entry.algorithm)) for f, entry in files]


def check_source_digests(hashed: list[tuple[Path, FileEntry, Future[str]]], refusing: str, retry: str) -> None:
    """Each digest ``hash_beside`` computed against the source's manifest: a CheckpointError naming
    the first file whose content changed, both digests and the fix. ``refusing``: what is refused
    ("publish the reshard of"); ``retry``: the other way out ("reshard another tag")."""
    for f, want, future in hashed:
        got = future.result()
        if got != want.digest:
            raise CheckpointError(
                f"refusing to {refusing} {f.parent}: {f} fails verification: its {want.algorithm} is {got}, its manifest "
                f"says {want.digest} (the file is corrupted, or was modified after the save). Nothing was written. Fix: "
                f"restore the file or {retry} (`shardkit verify {f.parent}` lists every problem)")
