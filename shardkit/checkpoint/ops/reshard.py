"""Repartition a ZeRO-3 checkpoint for a new data-parallel world size, in DeepSpeed's own format.

DeepSpeed's ``engine.load_checkpoint`` refuses a checkpoint saved at another world size
("Automatic adjustment of ZeRO's optimizer state partitioning with a new world size is not
currently supported", ``engine._load_zero_checkpoint``); its answer is an offline
``ds_to_universal`` conversion into one folder per parameter plus ``load_universal: true``.
``reshard_zero3`` instead writes the per-rank files a run at the new world size would itself have
saved, so the plain ``load_checkpoint`` takes them unchanged:

- parameters are regrouped into sub-groups exactly as ZeRO-3 builds them at the new size
  (``DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups``: split a param group whenever the
  running sum of ``partition_numel()`` reaches ``sub_group_size``);
- each parameter gets ``ceil(numel / M)`` elements per rank, the last rank zero-padded, and the
  fp32 masters and every per-element optimizer state (``exp_avg``, ``exp_avg_sq``) are copied
  bit for bit; ``step`` and the param-group hyperparameters are kept;
- ``dp_world_size``/``partition_count`` become M, ``param_shapes`` follow the new sub-groups, and
  frozen parameter fragments are repartitioned too.

Speed and memory: each new rank's flat tensors are byte ranges of the source rank files plus
zero padding, copied file to file through one 1 MiB buffer per worker (``stream.stream_save``
writes torch's zip format itself); several rank files are written at once by threads, each hashed
(sha256, for the manifest) and crc'd as its bytes are written and fsynced by its worker, so
nothing is read back. When neither the world size nor the sub-groups change, the rank files are
copied byte for byte instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from shardkit.checkpoint.io.atomic import os_errors_named
from shardkit.checkpoint.io.manifest import MANIFEST_NAME, FileEntry, Manifest
from shardkit.checkpoint.io.pipeline import (
    check_output_root,
    default_workers,
    output_tag,
    verify_before_reading,
    warn_unverified,
)
from shardkit.checkpoint.io.staged_save import atomic_checkpoint
from shardkit.checkpoint.io.stream import WrittenFile, all_segmented, copy_file_hashed, stream_save, write_parallel
from shardkit.checkpoint.io.tags import LATEST_NAME
from shardkit.checkpoint.io.torch_load import safe_torch_load
from shardkit.checkpoint.zero3.checkpoint import Zero3Checkpoint
from shardkit.checkpoint.zero3.files import MODEL_FILE, OPTIM_FILE, resolve_tag_dir
from shardkit.checkpoint.zero3.gather import full_frozen_params
from shardkit.checkpoint.zero3.reader import open_zero3_checkpoint
from shardkit.checkpoint.zero3.repartition import (
    TargetLayout,
    client_state_note,
    model_state_for_rank,
    optim_state_for_rank,
    plan_layout,
    source_bytes,
)
from shardkit.config.loading import config_digest
from shardkit.core.errors import CheckpointError, UsageError


@dataclass
class ReshardResult:
    """What ``reshard_zero3`` wrote."""

    output: Path
    """The new checkpoint root (holds ``latest``)."""
    tag: str
    world_size: int
    source_world_size: int
    files: list[Path]
    bytes: int
    manifest: Path | None
    notes: list[str] = field(default_factory=list)
    """Things the user should know (client_state taken from rank 0 ...)."""
    verified: str = "sha256"
    """How the source was checked before it was read: 'sha256', 'sizes' (--no-verify) or 'none' (no manifest)."""
    copied_unchanged: bool = False
    """Same world size and sub-groups as the source: the rank files were copied byte for byte."""


@os_errors_named("resharding the checkpoint")
def reshard_zero3(
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
) -> ReshardResult:
    """Write ``checkpoint`` repartitioned for ``world_size`` ranks under ``output/<tag>`` + ``output/latest``.

    ``sub_group_size`` must match the ``zero_optimization.sub_group_size`` the resuming run uses
    (default: the one saved in the checkpoint's config, else DeepSpeed's default 1e9). The new tag
    folder is staged and renamed into place, ``latest`` moves last, and a shardkit manifest is
    written unless ``manifest=False``.

    Before anything is read the source is checked against its manifest (sizes, and sha256 unless
    ``verify=False``): a corrupted source is refused, since the new manifest would vouch for the
    corruption. ``output`` must be new, empty, or a shardkit checkpoint folder; an existing
    ``output/<tag>`` is replaced only with ``force=True``. ``warn`` receives what the user should
    know before trusting the result (default: ``warnings.warn``). ``workers``: rank files written
    at once (default: ``default_workers`` when every tensor is a byte-range copy, else 1, since a
    tensor built in memory holds a whole sub-group partition per thread).
    """
    if workers is not None and workers < 1:
        raise UsageError(f"workers={workers}: must be at least 1 (threads writing rank files at once)")
    warn = warn or warn_unverified
    source_dir, source_tag = resolve_tag_dir(checkpoint)
    tag = output_tag(tag, checkpoint, source_dir, source_tag)
    root = Path(output)
    final = root / tag
    check_output_root(root, tag, source_dir, force=force)
    checked = verify_before_reading(source_dir, checksums=verify)
    for note in checked.warnings:
        warn(note)
    verified = checked.level
    # the tag folder that was verified, not ``checkpoint`` again: a save in between could move
    # 'latest' to a tag nobody verified, and the new manifest would say "verified": "sha256"
    ckpt = open_zero3_checkpoint(source_dir)
    layout = plan_layout(ckpt, world_size, sub_group_size)

    unchanged = _layout_unchanged(ckpt, layout)
    facts = dict(
        world_size=world_size, step=ckpt.model_state.get("global_steps"), zero_stage=3, dtype=ckpt.precision,
        config_digest=config_digest(ckpt.ds_config or None),
        extra={"resharded_from": {"path": str(ckpt.tag_dir), "world_size": ckpt.world_size,
                                  "ds_version": ckpt.ds_version, "verified": verified,
                                  "copied_unchanged": unchanged}},
    )
    outcome = f"nothing written: the staging folder was removed, {root / LATEST_NAME} is unchanged"
    if unchanged:
        jobs, streamed = _copy_jobs(ckpt, checked.manifest if verified == "sha256" else None), True
    else:
        jobs, streamed = _reshard_jobs(ckpt, layout)
    if workers is None:
        optim_files = sum(name.endswith("optim_states.pt") for name, _ in jobs) or len(jobs)
        # a tensor built in memory is a whole sub-group partition: one thread at a time keeps the
        # peak at one partition, as the serial writer had it (byte-range copies hold 1 MiB each)
        workers = default_workers(optim_files) if streamed else 1
    with atomic_checkpoint(root, tag, engine="deepspeed", manifest=manifest, **facts) as save:
        entries = _write_files(save.path, jobs, outcome, workers)
        if manifest:
            save.known_files = entries
    written = [name for name, _ in jobs]
    files = [final / name for name in written]
    return ReshardResult(
        output=root,
        tag=tag,
        world_size=world_size,
        source_world_size=ckpt.world_size,
        files=files,
        bytes=sum(f.stat().st_size for f in files),
        manifest=final / MANIFEST_NAME if manifest else None,
        notes=[n for n in (client_state_note(ckpt, world_size),) if n],
        verified=verified,
        copied_unchanged=unchanged,
    )


#: A job: the rank file's name, and the function that writes it to a path and returns its digest.
_Job = tuple[str, Callable[[Path], WrittenFile]]


def _layout_unchanged(ckpt: Zero3Checkpoint, layout: TargetLayout) -> bool:
    """True when the new layout is the source's own: same world size, same sub-groups and offsets."""
    if layout.world_size != ckpt.world_size or layout.sub_group_param_group != ckpt.sub_group_param_group:
        return False
    new = [(j, tp.source.name, tp.offset) for j, params in enumerate(layout.sub_groups) for tp in params]
    return new == [(s.sub_group, s.name, s.offset) for s in ckpt.slots]


def _copy_jobs(ckpt: Zero3Checkpoint, verified_against: Manifest | None) -> list[_Job]:
    # Copies, never hard links: DeepSpeed's torch.save opens a rank file with O_TRUNC and rewrites it
    # in place when a run saves the same tag again, so a link would let the source run change the
    # resharded checkpoint under its manifest (and the other way round). The bytes are read anyway
    # (the manifest needs their sha256), so copy_file_range would save nothing on a filesystem
    # without reflinks (ext4).
    expected = {e.path: e.sha256 for e in verified_against.files} if verified_against is not None else {}

    def copy(src: Path) -> Callable[[Path], WrittenFile]:
        def write(out: Path) -> WrittenFile:
            digest = copy_file_hashed(src, out)
            want = expected.get(src.name)
            # the source was hashed by verify_before_reading and read again here: a run re-saving
            # the tag in between would get a fresh manifest vouching for bytes nobody verified
            if want is not None and digest.sha256 != want:
                raise CheckpointError(
                    f"{src}: changed while it was being copied: its sha256 is now {digest.sha256}, the manifest it "
                    f"was verified against says {want} (the source was rewritten after verification, e.g. a "
                    "run saving the same tag again). Nothing was written; re-run the reshard once the source is "
                    "no longer being saved")
            return digest
        return write

    return [(src.name, copy(src)) for src in [*ckpt.optim_files, *ckpt.model_files]]


def _reshard_jobs(ckpt: Zero3Checkpoint, layout: TargetLayout) -> tuple[list[_Job], bool]:
    """The jobs, and whether every flat tensor is copied by byte ranges (False: some are built
    whole in memory, one sub-group partition per writer thread)."""
    # DeepSpeed objects (loss scaler, ZeroStageEnum) stay safe_load's inert stand-ins: stream_save
    # writes them back under their DeepSpeed names, so DeepSpeed (seconds to import) is never imported
    optim0 = safe_torch_load(ckpt.optim_files[0], mmap=True)
    frozen = full_frozen_params(ckpt)
    prefix = "bf16_" if ckpt.optim_files[0].name.startswith("bf16_") else ""
    # None when a tensor's file offset is unknown: tensors are then built in memory
    source = source_bytes(ckpt)
    ranks = range(layout.world_size)
    # lazy tensors and their byte segments only (a few KB per rank), built here to know whether
    # any tensor needs the in-memory path before choosing how many threads write
    optims = [optim_state_for_rank(ckpt, layout, r, optim0, source=source) for r in ranks]

    def optim(rank: int) -> Callable[[Path], WrittenFile]:
        return lambda out: stream_save(optims[rank], out)

    def model(rank: int) -> Callable[[Path], WrittenFile]:
        return lambda out: stream_save(model_state_for_rank(ckpt, layout, rank, frozen), out)

    # the large files first, so the small ones fill the gaps at the end
    jobs = ([(OPTIM_FILE.format(prefix=prefix, rank=r), optim(r)) for r in ranks]
            + [(MODEL_FILE.format(rank=r), model(r)) for r in ranks])
    return jobs, all(all_segmented(o) for o in optims)


def _write_files(staged: Path, jobs: list[_Job], outcome: str, workers: int) -> list[FileEntry]:
    """Write the jobs' files into ``staged`` (``stream.write_parallel``: fsynced by their writers,
    described by the digest computed while written, the first failure cancels the rest)."""
    written = write_parallel([(staged / name, write) for name, write in jobs], workers, outcome=outcome,
                             thread_name="shardkit-reshard")
    return [FileEntry(name, d.size, d.sha256) for (name, _), d in zip(jobs, written)]
