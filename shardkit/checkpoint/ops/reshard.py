"""Repartition a ZeRO-3 (or ZeRO-1/2) checkpoint for a new data-parallel world size, in DeepSpeed's own format.

DeepSpeed's ``engine.load_checkpoint`` refuses a checkpoint saved at another world size
("Automatic adjustment of ZeRO's optimizer state partitioning with a new world size is not
currently supported", ``engine._load_zero_checkpoint``); its answer is an offline
``ds_to_universal`` conversion into one folder per parameter plus ``load_universal: true``.
``reshard_checkpoint`` instead writes the per-rank files a run at the new world size would itself have
saved, so the plain ``load_checkpoint`` takes them unchanged:

- parameters are regrouped into sub-groups exactly as ZeRO-3 builds them at the new size
  (``DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups``: split a param group whenever the
  running sum of ``partition_numel()`` reaches ``sub_group_size``);
- each parameter gets ``ceil(numel / M)`` elements per rank, the last rank zero-padded, and the
  fp32 masters and every per-element optimizer state (``exp_avg``, ``exp_avg_sq``) are copied
  bit for bit; ``step`` and the param-group hyperparameters are kept;
- ``dp_world_size``/``partition_count`` become M, ``param_shapes`` follow the new sub-groups, and
  frozen parameter fragments are repartitioned too.

Speed, memory, scale: nothing imports torch or unpickles a tensor. The source files are parsed by
``read_structure``; each new file is a pickle plus byte ranges of the source files
(``ops.reshard_zero3``: the ZeRO-3 reader, then the ZeRO-3 writer for the same run), copied through one 1 MiB buffer per writer thread, crc'd and hashed
(blake3 by default, for the manifest) as written, fsynced by its writer (``torch_zip``). ``workers`` threads
write at once; under ``srun``/``torchrun`` every launched process writes its share of the files
(balanced by bytes) into one staging folder and process 0 seals one manifest
(``shared_save``), once every process agreed it was asked for the same reshard (``shared_meet``).
The source's digests are checked while the output is written (each process
hashes its share of the source files), and nothing is published unless it matched; when neither
the world size nor the sub-groups change, the rank files are copied byte for byte and that copy's
hash is the check. A ZeRO-1/2 repartition hashes the source from the byte ranges its copies read
(``reshard_zero12.write_hashing_sources``), not from a second read on threads of their own.

ZeRO-1/2 sources go through the same steps, torch-free as well, as one reader + writer composition
(``ops.reshard_zero12``: the ZeRO-1/2 reader, then the ZeRO-1/2 writer with the source's own dicts at the new
world size): each new rank file is a pickle plus byte ranges of the old ranks' files and zero runs. A source
the byte ranges cannot express is written through torch instead, and the result's notes say why.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from shardkit.checkpoint.layout.support import refuse_unsupported
from shardkit.checkpoint.ops.carried_files import (
    RootFiles,
    copy_root_files,
    plan_root_files,
    remove_created,
    root_left_note,
    tag_files_not_carried,
)
from shardkit.checkpoint.ops.convert.arguments import check_workers, check_world_size
from shardkit.checkpoint.ops.convert.result import WrittenCheckpoint
from shardkit.checkpoint.ops.reshard_source import PlannedReshard
from shardkit.checkpoint.ops.reshard_zero3 import plan_zero3_reshard
from shardkit.checkpoint.ops.reshard_zero12 import plan_zero12_reshard, write_hashing_sources
from shardkit.checkpoint.ops.verify_files import parse_torch_file
from shardkit.checkpoint.zero3.files import resolve_tag_dir
from shardkit.checkpoint.zero12.files import is_zero12_folder
from shardkit.config.loading import config_digest
from shardkit.core import progress
from shardkit.core.deprecated import deprecated_alias
from shardkit.core.errors import CheckpointError, UsageError
from shardkit.platform.versions import library_versions
from shardkit.storage.atomic import os_errors_named, signals_deferred
from shardkit.storage.listing import lists_source_once
from shardkit.storage.manifest import MANIFEST_NAME, FileEntry, Manifest
from shardkit.storage.pipeline import (
    check_output_root,
    check_source,
    default_workers,
    output_tag,
    warn_unverified,
)
from shardkit.storage.request import RunRequest, source_of
from shardkit.storage.shared_save import Launch, launch_from_env, outcome_unchanged, split_by_bytes
from shardkit.storage.shared_tag import Activity, signatures, write_tag_shared
from shardkit.storage.stream import WrittenFile, copy_file_hashed, write_parallel
from shardkit.storage.structure_observers import reusing_parses
from shardkit.storage.tags import LATEST_NAME
from shardkit.storage.torch_zip import RecordData, write_torch_zip

RESHARD = Activity("the reshard", "re-run the reshard", "publish the reshard of", "reshard another tag")


@dataclass(kw_only=True)
class ReshardResult(WrittenCheckpoint):
    """What ``reshard_checkpoint`` wrote (``carried``/``not_carried``: the source root's files beside the tag)."""

    files: list[Path]
    manifest: Path | None
    copied_unchanged: bool = False
    """Same world size and sub-groups as the source: the rank files were copied byte for byte."""
    ds_config: dict[str, Any] = field(default_factory=dict)
    """The DeepSpeed config the source recorded (the new rank files record it unchanged)."""


@os_errors_named("resharding the checkpoint")
@lists_source_once("checkpoint", "output")  # each step asking what the source holds: one listing of its folders
def reshard_checkpoint(
    checkpoint: str | Path,
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
    launch: Launch | None = None,
    carry_root: bool = True,
) -> ReshardResult:
    """Write ``checkpoint`` repartitioned for ``world_size`` ranks under ``output/<tag>`` + ``output/latest``.

    ``sub_group_size`` must match the ``zero_optimization.sub_group_size`` the resuming run uses
    (default: the one saved in the checkpoint's config, else DeepSpeed's default 1e9). The new tag
    folder is staged and renamed into place, ``latest`` moves last, and a shardkit manifest is
    written unless ``manifest=False``.

    The source is checked against its manifest: sizes before anything is read, digests (unless
    ``verify=False``) while the output is written, and nothing is published unless every file
    matched, since the new manifest would vouch for the corruption. ``output`` must be new, empty,
    or a shardkit checkpoint folder; an existing ``output/<tag>`` is replaced only with
    ``force=True``; another run writing the same output at the same time is refused. ``warn``
    receives what the user should know before trusting the result (default: ``warnings.warn``).
    ``workers``: files written at once by this process (default ``default_workers``). ``launch``:
    this process's share of the files (default: from ``srun``/``torchrun``'s variables; one
    process does everything without them).

    Given a root, the files beside its tag (Accelerate's ``save_state`` files, ``zero_to_fp32.py``) are copied
    into ``output`` before ``latest`` moves, RNG files by rank (``carried_files``), and whatever is not carried is
    named in the result (``carry_root=False``: the caller carries them, as the Trainer reshard does).
    """
    check_world_size(world_size)
    check_workers(workers, "rank files")
    launch = launch or launch_from_env()
    warn = warn or warn_unverified
    refuse_unsupported(checkpoint, "reshard")  # a layout nothing converts correctly: refused before anything is read
    source_dir, source_tag = resolve_tag_dir(checkpoint)
    tag = output_tag(tag, checkpoint, source_dir, source_tag)
    root = Path(output)
    root_files: RootFiles | None = None
    tag_not_carried: list[str] = []
    root_notes: list[str] = []
    given = Path(checkpoint).parent if Path(checkpoint).name == LATEST_NAME else Path(checkpoint)
    if launch.rank == 0:
        if carry_root and source_dir.parent == given and source_dir != given:
            root_files = plan_root_files(given, source_tag, world_size)
            root_notes = root_files.notes(world_size)
        elif carry_root:
            tag_not_carried = tag_files_not_carried(source_dir)
            left = root_left_note(source_dir)  # the root's files are not this source's, yet a resume may read them
            root_notes = [left] if left else []
    if launch.rank == 0:
        # the others write into the staging folder rank 0 claims after this check (by the time
        # they run it, that folder may already be in ``root``)
        check_output_root(root, tag, source_dir, force=force)
    # sizes now (a truncated file is refused before it is parsed); digests while the output is written
    checked = check_source(source_dir, verify=verify, hash_now=False)
    for note in checked.warnings if launch.rank == 0 else []:
        warn(note)
    verified, expected = checked.level, checked.owed
    ckpt: PlannedReshard[Any]
    if is_zero12_folder(source_dir):
        # ZeRO-1/2 (checkpoint.zero12): one partition per rank and parameter group, no sub-groups
        if sub_group_size is not None:
            raise UsageError(f"--sub-group-size {sub_group_size}: a ZeRO-3 setting, and {source_dir} is a ZeRO-1/2 "
                             "checkpoint (no sub-groups). Leave the flag out")
        ckpt = plan_zero12_reshard(source_dir, world_size)  # the ZeRO-1/2 reader -> the ZeRO-1/2 writer
        jobs = [_Job(f.name, f.nbytes, f.write, f.contents) for f in ckpt.jobs]
        if ckpt.unchanged:
            ckpt.notes = []  # they say how the writer builds the files, and the files are copied instead
    else:
        ckpt = plan_zero3_reshard(source_dir, world_size, sub_group_size)  # the ZeRO-3 reader -> the ZeRO-3 writer
        jobs = [_Job(f.name, f.nbytes, _built(f.build)) for f in ckpt.jobs]
    unchanged = ckpt.unchanged
    if unchanged:
        jobs = _copy_jobs(ckpt, expected)
    mine = split_by_bytes([j.nbytes for j in jobs], launch.world)[launch.rank]
    share = [jobs[i] for i in mine]
    sources = [*ckpt.optim_files, *ckpt.model_files]
    # the copies hash every source byte themselves; a repartition reads ranges, so this process
    # also hashes its share of the source files, on threads beside the writers
    to_hash = [] if unchanged else [f for i, f in enumerate(sources) if i % launch.world == launch.rank and f.name in expected]
    if workers is None:
        workers = default_workers(max(1, len(share)))
    # torch-free ZeRO-1/2 files: the copies deliver the source bytes to the hashers themselves (one read, not two)
    hash_in_copy = bool(to_hash) and all(j.contents is not None for j in share)
    before = signatures(sources)

    def facts(entries: list[FileEntry]) -> Manifest | None:
        if not manifest:
            return None
        return Manifest(
            engine="deepspeed", tag=tag, world_size=world_size, step=ckpt.model_state.get("global_steps"),
            zero_stage=ckpt.stage,
            dtype=ckpt.precision, versions=library_versions(), config_digest=config_digest(ckpt.ds_config or None),
            extra={"resharded_from": {"path": str(ckpt.tag_dir), "world_size": ckpt.world_size,
                                      "ds_version": ckpt.ds_version, "verified": verified,
                                      "copied_unchanged": unchanged}},
        )

    # what every process must agree on before anything is written (io.shared_meet)
    request = RunRequest("reshard", source_of(source_dir), str(root.resolve()), tag, {
        "--world-size": world_size, "--sub-group-size": sub_group_size, "--no-verify": not verify,
        "--no-manifest": not manifest})
    made_root = not os.path.lexists(root)
    placed: list[Path] = []

    def carry(staged: Path, entries: list[FileEntry]) -> list[FileEntry]:
        # every share written and the source's digests matched: the root's files go in before 'latest' moves
        if root_files is not None:
            placed.extend(copy_root_files(root_files, root))
        return []

    try:
        entries = write_tag_shared(
            root, tag, launch, request=request,
            write_mine=lambda staged: _write_share(staged, share, workers, outcome_unchanged(root),
                                                   [(f, expected[f.name]) for f in to_hash] if hash_in_copy else None),
            to_hash=[] if hash_in_copy else [(f, expected[f.name]) for f in to_hash],
            hash_workers=workers, before=before, activity=RESHARD,
            facts=facts, finish=carry)
    except BaseException:
        if placed:
            with signals_deferred():  # the files this run put beside an unpublished tag go with it
                remove_created(placed)
                if made_root:
                    with contextlib.suppress(OSError):
                        root.rmdir()
        raise
    final = root / tag
    return ReshardResult(
        output=root,
        tag=tag,
        world_size=world_size,
        source_world_size=ckpt.world_size,
        files=[final / j.name for j in jobs],
        bytes=sum(e.size for e in entries) if launch.rank == 0 else 0,
        manifest=final / MANIFEST_NAME if manifest else None,
        notes=[*ckpt.notes, *root_notes],
        verified=verified,
        copied_unchanged=unchanged,
        rank=launch.rank,
        processes=launch.world,
        share_files=len(share),
        share_bytes=sum(j.nbytes for j in share),
        workers=workers,
        launcher=launch.launcher,
        ds_config=dict(ckpt.ds_config or {}),
        carried=root_files.carried if root_files is not None else [],
        not_carried=root_files.not_carried if root_files is not None else tag_not_carried,
    )


# the name before it took every layout; warns on call, goes in the next release
reshard_zero3 = deprecated_alias("reshard_zero3", "reshard_checkpoint", reshard_checkpoint)


@dataclass(frozen=True)
class _Job:
    """One output file: its name, about how many bytes it holds, and what writes it."""

    name: str
    nbytes: int
    write: Callable[[Path], WrittenFile]
    contents: Callable[[], tuple[bytes, list[tuple[str, RecordData]]]] | None = None
    """The file as ``data.pkl`` + source byte ranges, where it is written without torch (``writers.zero12``)."""


def _copy_jobs(ckpt: PlannedReshard[Any], expected: dict[str, FileEntry]) -> list[_Job]:
    # Copies, never hard links: DeepSpeed's torch.save opens a rank file with O_TRUNC and rewrites it
    # in place when a run saves the same tag again, so a link would let the source run change the
    # resharded checkpoint under its manifest (and the other way round). The bytes are read anyway
    # (the manifest needs their digest), so copy_file_range would save nothing on a filesystem
    # without reflinks (ext4).
    def copy(src: Path) -> Callable[[Path], WrittenFile]:
        def write(out: Path) -> WrittenFile:
            # the new manifest vouches for what is copied, so each file is checked as verify checks it first: its
            # pickle parsed through the allow-list (a rank file no reader parses, model states of rank > 0, cannot
            # carry a code-running global into a sealed output DeepSpeed would load), its zip records against the
            # central directory (a rewritten record size torch.load refuses), and the rank's own share as the reader
            # checks the ranks it parses (ckpt.check_copied); one parse for all three (reusing_parses)
            with reusing_parses(keep=1):
                _, problem = parse_torch_file(src.parent, src.name)
                if problem is not None:
                    raise CheckpointError(f"{problem.message}. Nothing was published (a copy of it would be sealed as "
                                          f"whole). Fix: {problem.fix}")
                ckpt.check_copied(src)
            want = expected.get(src.name)
            # hashed with the source manifest's algorithm: the copy's digest is the check of the source as well
            digest = copy_file_hashed(src, out, algorithm=want.algorithm if want is not None else None, planned=True)
            if want is not None and digest.digest != want.digest:
                raise CheckpointError(
                    f"{src}: its {want.algorithm} is {digest.digest}, its manifest says {want.digest}: the file is corrupted, or was "
                    "rewritten after the save (a run saving the same tag again). Nothing was written; restore the "
                    "file, or re-run the reshard once the source is no longer being saved")
            return digest
        return write

    return [_Job(src.name, src.stat().st_size, copy(src)) for src in [*ckpt.optim_files, *ckpt.model_files]]


def _built(build: Callable[[], tuple[bytes, list[tuple[str, RecordData]]]]) -> Callable[[Path], WrittenFile]:
    """A job writing the file ``build`` makes (its pickle and records) without torch."""
    return lambda out: write_torch_zip(out, *build())


def _write_share(staged: Path, share: list[_Job], workers: int, outcome: str,
                 sources: list[tuple[Path, FileEntry]] | None = None) -> list[FileEntry]:
    """Write this process's files into ``staged`` (``stream.write_parallel``: fsynced by their
    writers, described by the digest computed while written, the first failure cancels the rest).
    ``sources``: the source files to check from the bytes the copies read (every job has ``contents``)."""
    if sources is not None:
        return write_hashing_sources(staged, [(j.name, j.contents) for j in share if j.contents is not None], sources,
                                     workers, outcome=outcome, refusing=RESHARD.publish, retry=RESHARD.other_tag)
    progress.expect(sum(j.nbytes for j in share))
    written = write_parallel([(staged / j.name, j.write) for j in share], workers, outcome=outcome,
                             thread_name="shardkit-reshard")
    return [FileEntry.of(j.name, d.size, d.algorithm, d.digest) for j, d in zip(share, written)]


